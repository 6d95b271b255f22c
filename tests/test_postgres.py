"""Runs in a shared RDB storage: PostgreSQL (CI) and several ``--worker`` processes on one run.

The PostgreSQL tests need ``QDQ_OPTUNA_TEST_POSTGRES_URL`` (e.g.
``postgresql://qdq:qdq@127.0.0.1:5432/qdq_test``); CI starts a server and sets it. The
two-worker test also runs on a shared SQLite file, so it is exercised everywhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import optuna
import pytest
from _runs import check_visit, is_visit
from optuna.trial import TrialState

from qdq_optuna import Config, tune
from qdq_optuna.record import delete_run
from qdq_optuna.record.storage import open_storage

REPO = Path(__file__).resolve().parent.parent
URL_ENV = "QDQ_OPTUNA_TEST_POSTGRES_URL"
POSTGRES_URL = os.environ.get(URL_ENV)
BUDGET = 6

needs_postgres = pytest.mark.skipif(
    not POSTGRES_URL, reason=f"set {URL_ENV} to a PostgreSQL URL to run the PostgreSQL tests"
)
pytestmark = pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")



@pytest.fixture
def run_id():
    rid = f"test-{uuid.uuid4().hex[:12]}"
    yield rid
    if POSTGRES_URL:  # leave the shared database as it was
        try:
            delete_run(open_storage(POSTGRES_URL, heartbeat=False), rid)
        except Exception:  # pragma: no cover - best effort
            pass


def run_studies(url: str, run_id: str) -> dict[str, optuna.Study]:
    storage = open_storage(url, heartbeat=False)
    return {s.study_name: optuna.load_study(study_name=s.study_name, storage=storage)
            for s in storage.get_all_studies() if s.study_name.startswith(f"{run_id}/")}


@needs_postgres
def test_tune_into_postgres(residual, tmp_path, run_id):
    result = tune(residual, tmp_path / "pg", benchmark="costmodel", storage=POSTGRES_URL,
                  run_id=run_id, config=Config(schemes_per_region=4), progress=False)
    report = result.report
    assert report["complete"] and report["run_id"] == run_id
    assert report["storage"] == POSTGRES_URL
    assert not (tmp_path / "pg" / "studies.db").exists()
    found = run_studies(POSTGRES_URL, run_id)
    visits = {f"{run_id}/{v['pattern']}/{v['lane'] + '/' if v['lane'] else ''}round{v['round']}"
              for p in report["patterns"] for v in p["visits"]}
    assert set(found) == {f"{run_id}/_run", f"{run_id}/_starts"} | visits
    by_id = {p["id"]: p for p in report["patterns"]}
    for name in visits:
        s = found[name]
        assert s.user_attrs["signature"] == by_id[s.user_attrs["pattern_id"]]["signature"]
        check_visit(name, s, 4)


def _two_workers(model: Path, url: str, run_id: str, tmp_path: Path) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))}
    procs = []
    for w in range(2):
        argv = [sys.executable, "-m", "qdq_optuna", "tune", "--model", str(model),
                "--output", str(tmp_path / f"worker{w}"), "--backend", "costmodel",
                "--storage", url, "--worker", "--run-id", run_id,
                "--schemes-per-region", str(BUDGET), "-q"]
        procs.append(subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    reports = []
    for w, p in enumerate(procs):
        try:
            _, err = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("a worker hung")
        assert p.returncode == 0, err
        reports.append(json.loads((tmp_path / f"worker{w}" / "report.json").read_text()))
    return reports


def _check_worker_run(model: Path, url: str, run_id: str, reports: list[dict]) -> None:
    assert all(r["complete"] for r in reports)
    # both workers end with the same commits
    schemes = [[(p["id"], p["committed_scheme"]) for p in r["patterns"]] for r in reports]
    assert schemes[0] == schemes[1]
    found = run_studies(url, run_id)
    starts = [t.user_attrs["start"] for t in found.pop(f"{run_id}/_starts").get_trials()]
    assert len(starts) == len(set(starts)) == len(reports[0]["starts"])
    found.pop(f"{run_id}/_run")
    assert found
    for name, s in found.items():
        assert is_visit(name.split("/", 1)[1]), name
        check_visit(name, s, BUDGET)
        assert not s.get_trials(deepcopy=False, states=(TrialState.RUNNING, TrialState.FAIL))


@needs_postgres
def test_two_workers_share_a_postgres_run(residual, tmp_path, run_id):
    reports = _two_workers(residual, POSTGRES_URL, run_id, tmp_path)
    _check_worker_run(residual, POSTGRES_URL, run_id, reports)


def test_two_workers_share_a_sqlite_run(residual, tmp_path, run_id):
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    reports = _two_workers(residual, url, run_id, tmp_path)
    _check_worker_run(residual, url, run_id, reports)


def test_a_missing_driver_names_the_extra(monkeypatch):
    """Optuna's own message ("Please install appropriate one") names no package; ours does."""
    for driver in ("psycopg", "psycopg2"):
        monkeypatch.setitem(sys.modules, driver, None)  # as if not installed
    from qdq_optuna.errors import OptionError

    with pytest.raises(OptionError, match=r"^--storage postgresql://u@localhost/db: its "
                       r'database driver is not installed \(pip install "\.\[postgres\]" in the '
                       r"qdq_optuna checkout\)$"):
        open_storage("postgresql://u@localhost/db")
