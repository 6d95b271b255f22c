"""The race of issue 30: a worker's live trial failed by another worker as stale, and the owner
then crashing with ``UpdateFinishedTrialError`` at its tell.

Under load a heartbeat can fail (SQLite busy past its timeout); Optuna's heartbeat thread then
ends, the live trial goes stale and another worker fails it. The storage keeps beating after a
failed beat, and a worker whose trial was taken over steps back instead of crashing. The
bounded stress run (several workers on one run, SQLite and PostgreSQL) is the CI version of
``benchmarks/worker_race.py``.
"""

from __future__ import annotations

import importlib.util
import sqlite3
import threading
import time
import types
from pathlib import Path

import optuna
import pytest
from optuna.storages._heartbeat import get_heartbeat_thread
from optuna.trial import TrialState
from test_postgres import POSTGRES_URL, URL_ENV

from qdq_optuna.record import delete_run, fail_trial, open_storage, trial_id
from qdq_optuna.record._optuna import RequeueingRDBStorage
from qdq_optuna.search._workers import Workers

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")


def _heartbeat_at(path: Path, tid: int) -> str | None:
    with sqlite3.connect(path) as db:
        row = db.execute("select heartbeat from trial_heartbeats where trial_id = ?",
                         (tid,)).fetchone()
    return row[0] if row else None


def test_a_failed_heartbeat_does_not_end_the_beating(tmp_path):
    """A beat that meets a locked SQLite file fails; the next beat, after the lock is gone,
    must still come (Optuna's thread alone ends at the first failure: the trial goes stale)."""
    path = tmp_path / "s.db"
    storage = RequeueingRDBStorage(f"sqlite:///{path}", heartbeat_interval=1, grace_period=60,
                                   engine_kwargs={"connect_args": {"timeout": 0.05}})
    study = optuna.create_study(storage=storage)
    trial = study.ask()
    tid = trial_id(trial)
    storage.record_heartbeat(tid)
    lock = sqlite3.connect(path, isolation_level=None)
    lock.execute("begin immediate")  # every write of the heartbeat thread now fails
    beats = get_heartbeat_thread(tid, storage)
    beats.start()
    try:
        time.sleep(1.6)  # two beats fail
        before = _heartbeat_at(path, tid)
        lock.execute("commit")
        deadline = time.monotonic() + 6
        while _heartbeat_at(path, tid) == before and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _heartbeat_at(path, tid) != before, "the heartbeat thread stopped beating"
    finally:
        if lock.in_transaction:
            lock.execute("commit")
        lock.close()
        beats.join()


def _taken_over_run(tmp_path, objective_error: Exception | None):
    """One optimize call whose trial another process fails while the objective runs (what a
    worker's stale check does); returns what it raised and the Workers."""
    url = f"sqlite:///{tmp_path / 's.db'}"
    study = optuna.create_study(storage=open_storage(url), study_name="s")
    other = optuna.load_study(study_name="s", storage=open_storage(url))
    workers = Workers(types.SimpleNamespace(), worker=False, remaining=lambda: None)

    def objective(trial):
        fail_trial(other, trial_id(trial), {"failure": "stale (another worker)"})
        if objective_error is not None:
            raise objective_error
        return 1.0

    with pytest.raises((ValueError, AssertionError,
                        optuna.exceptions.UpdateFinishedTrialError)) as info:
        study.optimize(workers.interruptible(study, objective), n_trials=1)
    return info.value, workers, study


def test_a_trial_failed_by_another_worker_is_stepped_back_from(tmp_path):
    error, workers, study = _taken_over_run(tmp_path, None)
    assert workers.taken_over(study, error)
    assert [t.state for t in study.get_trials()] == [TrialState.FAIL]


def test_the_objectives_own_error_is_not_taken_for_a_take_over(tmp_path):
    own = ValueError("a bug in the objective")
    error, workers, study = _taken_over_run(tmp_path, own)
    # the objective's own error propagates after Optuna's tell, or the tell's: never hidden
    assert error is own or isinstance(error, ValueError)
    assert not workers.taken_over(study, own)


def _race():
    spec = importlib.util.spec_from_file_location("worker_race",
                                                  REPO / "benchmarks" / "worker_race.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.parametrize("storage", ["sqlite", "postgresql"])
def test_workers_racing_on_one_run_lose_and_double_nothing(storage, tmp_path, residual):
    """Two short runs of three workers on one run, a busy CPU beside them and a grace period
    of a few seconds: every worker exits 0 without a traceback, every visit within its budget,
    no model measured twice, no trial failed or left running."""
    if storage == "postgresql" and not POSTGRES_URL:
        pytest.skip(f"set {URL_ENV} to a PostgreSQL URL to run the PostgreSQL tests")
    race = _race()
    args = types.SimpleNamespace(workers=3, budget=6, grace=3, timeout=240.0)
    stop = threading.Event()
    burner = threading.Thread(target=race._burn, args=(stop,), daemon=True)
    burner.start()
    try:
        for i in range(2):
            url = POSTGRES_URL if storage == "postgresql" else f"sqlite:///{tmp_path}/r{i}.db"
            result = race.one_run(residual, tmp_path, url, args)
            if storage == "postgresql":  # leave the shared database as it was
                delete_run(open_storage(url, heartbeat=False), result["run_id"])
            assert result["problems"] == [], result
    finally:
        stop.set()
        burner.join()
