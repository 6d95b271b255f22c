"""Several ``--worker`` processes on one run, one of them killed mid-trial.

Three ``qdq-optuna tune --worker`` processes share a run in an RDB storage (PostgreSQL when
``QDQ_OPTUNA_TEST_POSTGRES_URL`` is set, and always a shared SQLite file). Latencies come from
the cost model behind a sleep (``tests._latency_fns:sleepy_costmodel``), so trials take ~0.25 s
and figures are the same in every process. One worker is frozen inside a trial's measurement and
SIGKILLed. With a grace period of a few seconds (``QDQ_OPTUNA_HEARTBEAT_GRACE``) the others must
fail its trial, run its scheme again, fill every study with exactly its budget (nothing lost,
nothing measured twice), agree on every commit, exit 0 and write a valid model.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import onnx
import onnxruntime as ort
import optuna
import pytest
from _runs import check_visit, is_visit
from optuna.trial import TrialState
from test_postgres import POSTGRES_URL, URL_ENV, run_studies
from test_resume import REPO, cli_env

from qdq_optuna.record import delete_run
from qdq_optuna.record.storage import AGREE_KEY, open_storage

pytestmark = pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")

BUDGET = 6
WORKERS = 3
GRACE_S = 3
SLEEP_S = "0.25"



@pytest.fixture(params=["sqlite", "postgresql"])
def storage_url(request, tmp_path):
    """A fresh run in SQLite (always) or PostgreSQL (when the URL is set); cleaned up after."""
    if request.param == "postgresql":
        if not POSTGRES_URL:
            pytest.skip(f"set {URL_ENV} to a PostgreSQL URL to run the PostgreSQL tests")
        url = POSTGRES_URL
    else:
        url = f"sqlite:///{tmp_path / 'shared.db'}"
    run_id = f"workers-{uuid.uuid4().hex[:10]}"
    yield url, run_id
    if url == POSTGRES_URL:  # leave the shared database as it was
        try:
            delete_run(open_storage(url, heartbeat=False), run_id)
        except Exception:  # pragma: no cover - best effort
            pass


def _pattern_studies(url: str, run_id: str) -> dict[str, optuna.Study]:
    return {name.split("/", 1)[1]: s for name, s in run_studies(url, run_id).items()
            if name != f"{run_id}/_run"}


def _held_trial(url: str, run_id: str) -> tuple[str, optuna.trial.FrozenTrial] | None:
    """The trial frozen in its measurement: RUNNING with its scheme drawn, started well before
    the others (the other workers' trials last ~0.25 s; one waiting for a slot has no scheme)."""
    old = dt.datetime.now() - dt.timedelta(seconds=1.0)
    found = [(pid, t) for pid, s in _pattern_studies(url, run_id).items()
             for t in s.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
             if t.params and t.datetime_start is not None and t.datetime_start < old]
    assert len(found) <= 1, found
    return found[0] if found else None


def _complete_count(url: str, run_id: str) -> int:
    try:
        return sum(len(s.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))
                   for s in _pattern_studies(url, run_id).values())
    except Exception:  # tables not created yet
        return 0


def _dump(study: optuna.Study) -> list[tuple]:
    """The study's trials, for a failure message."""
    return [(t.number, t.state.name, t.params == {}, t.system_attrs.get("failed_trial"),
             {k: v for k, v in t.user_attrs.items() if k in ("skipped", "duplicate_of",
                                                             "retry_of", "plan_key")})
            for t in study.get_trials(deepcopy=False)]


def _freeze_and_kill(victim: subprocess.Popen, hold: Path, url: str, run_id: str,
                     deadline: float) -> tuple[str, optuna.trial.FrozenTrial, float]:
    held = Path(str(hold) + ".held")
    while time.monotonic() < deadline:
        if victim.poll() is not None:
            pytest.fail(f"the worker to kill ended first: {victim.communicate()[1]}")
        if _complete_count(url, run_id) < 3:
            time.sleep(0.1)
            continue
        held.unlink(missing_ok=True)
        hold.touch()
        while not held.exists() and time.monotonic() < deadline and victim.poll() is None:
            time.sleep(0.02)
        time.sleep(1.3)
        found = _held_trial(url, run_id)
        if found is not None:
            os.kill(victim.pid, signal.SIGKILL)
            killed_at = dt.datetime.now()
            victim.wait(timeout=30)
            hold.unlink()
            return found[0], found[1], killed_at.timestamp()
        hold.unlink()  # not caught in time (the trial just ended): try again
        time.sleep(0.5)
    pytest.fail("the worker was never caught inside a trial")


def test_three_workers_one_killed_mid_trial(residual, tmp_path, storage_url):
    url, run_id = storage_url
    hold = tmp_path / "hold"
    procs = []
    for w in range(WORKERS):
        argv = [sys.executable, "-m", "qdq_optuna", "tune", "--model", str(residual),
                "--output", str(tmp_path / f"worker{w}"),
                "--backend", "tests._latency_fns:sleepy_costmodel", "--runtime", "tensorrt",
                "--timing", "fast", "--storage", url, "--worker", "--run-id", run_id,
                "--schemes-per-region", str(BUDGET), "-q"]
        env = cli_env(QDQ_TEST_SLEEP_S=SLEEP_S, QDQ_OPTUNA_HEARTBEAT_GRACE=str(GRACE_S),
                      **({"QDQ_TEST_HOLD_FILE": str(hold)} if w == 0 else {}))
        procs.append(subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    try:
        pid, killed, killed_at = _freeze_and_kill(procs[0], hold, url, run_id,
                                                  time.monotonic() + 120)
        reports = []
        for w, p in enumerate(procs[1:], start=1):
            _, err = p.communicate(timeout=240)
            assert p.returncode == 0, err
            assert "Traceback" not in err, err
            reports.append(json.loads((tmp_path / f"worker{w}" / "report.json").read_text()))
    finally:
        hold.unlink(missing_ok=True)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert procs[0].returncode == -signal.SIGKILL

    # every survivor finished the whole run with the same commits and a model that runs
    assert all(r["complete"] for r in reports)
    commits = [[(p["id"], p["committed_scheme"]) for p in r["patterns"]] for r in reports]
    assert all(c == commits[0] for c in commits)
    for w in range(1, WORKERS):
        path = tmp_path / f"worker{w}" / "optimized.onnx"
        onnx.checker.check_model(onnx.load(str(path)))
        ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])

    studies = _pattern_studies(url, run_id)
    starts = studies.pop("_starts")
    names = [t.user_attrs["start"] for t in starts.get_trials(deepcopy=False)]
    assert len(names) == len(set(names)), "a start was written twice"
    for p, s in studies.items():
        assert is_visit(p), p
        check_visit(p, s, BUDGET)  # within its budget, no model twice, decided, none running

    # the killed worker's trial failed once its heartbeat was stale, and its scheme was rerun
    study = studies[pid]
    dead = next(t for t in study.get_trials(deepcopy=False) if t.number == killed.number)
    assert dead.state == TrialState.FAIL, dead.state
    assert dead.datetime_complete.timestamp() >= killed_at + GRACE_S - 1.5, "failed too early"
    retries = [t for t in study.get_trials(deepcopy=False)
               if t.system_attrs.get("failed_trial") == dead.number]
    assert len(retries) == 1, "the dead trial was not queued again exactly once"
    assert "heartbeats" in retries[0].user_attrs["retry_reason"]
    redone = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
              if t.number > dead.number and t.params == dead.params]
    assert len(redone) == 1, ("the killed trial's scheme was not run again (or twice)",
                              _dump(study))
    # every other failure or skip is accounted for
    for s in studies.values():
        for t in s.get_trials(deepcopy=False, states=(TrialState.FAIL,)):
            assert t.number == dead.number and s is study, (t.number, t.user_attrs)
        assert not [t for t in s.get_trials(deepcopy=False, states=(TrialState.WAITING,))
                    if t.system_attrs.get("failed_trial") is not None]

    # one decision per visit and one for the starts, stored once and adopted by everybody
    run = run_studies(url, run_id)[f"{run_id}/_run"]
    claims = [t.user_attrs[AGREE_KEY] for t in run.get_trials(deepcopy=False)]
    for p in studies:
        assert claims.count(f"commit/{run_id}/{p}") >= 1
    assert claims.count("starts") >= 1
    assert all(r["starts"] == reports[0]["starts"] for r in reports)


_AGREE_SCRIPT = """
import sys, optuna
from qdq_optuna.record.storage import agree, open_storage
storage = open_storage(sys.argv[1], heartbeat=False)
study = optuna.load_study(study_name=sys.argv[2], storage=storage)
print(agree(study, "the-key", sys.argv[3]))
"""


def test_agree_is_one_decision_for_racing_processes(tmp_path, storage_url):
    """The compare-and-set behind commits, references and retries: processes that race to
    store a value for one key all come back with the same (first stored) value."""
    url, run_id = storage_url
    optuna.create_study(study_name=f"{run_id}/_run", storage=open_storage(url, heartbeat=False))
    procs = [subprocess.Popen([sys.executable, "-c", _AGREE_SCRIPT, url, f"{run_id}/_run",
                               f"value-{i}"], cwd=REPO, env=cli_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(6)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        results.append(out.strip())
    assert len(set(results)) == 1 and results[0].startswith("value-"), results
