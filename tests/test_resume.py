"""Stopping and resuming a run: ``--timeout``, a killed process, changed settings, ``--fresh``.

The storage is the truth of a run: a rerun of the same command must keep every finished trial,
redo the trial the dead process was running, and finish each study with exactly its budget.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import _latency_fns as fns
import optuna
import pytest
from _runs import check_visit, is_visit
from optuna.trial import TrialState

from qdq_optuna import Config, tune
from qdq_optuna.backends.callable import CallableBackend
from qdq_optuna.errors import OptionError
from qdq_optuna.record import run_attrs
from qdq_optuna.record.storage import open_storage

REPO = Path(__file__).resolve().parent.parent
BUDGET = 6

pytestmark = pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")



def cli_cmd(*args) -> list[str]:
    return [sys.executable, "-m", "qdq_optuna", *map(str, args)]


def cli_env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join([str(REPO)] + ([os.environ["PYTHONPATH"]]
                                          if os.environ.get("PYTHONPATH") else []))
    return {**os.environ, "PYTHONPATH": path, **extra}


def pattern_studies(out: Path, run_id: str) -> dict[str, optuna.Study]:
    storage = open_storage(f"sqlite:///{out / 'studies.db'}", heartbeat=False)
    return {s.study_name.split("/", 1)[1]: optuna.load_study(study_name=s.study_name,
                                                             storage=storage)
            for s in storage.get_all_studies()
            if s.study_name.startswith(f"{run_id}/") and s.study_name != f"{run_id}/_run"}


def snapshot(out: Path, run_id: str) -> dict[str, dict[int, tuple]]:
    """study -> trial number -> (state, params, value)."""
    return {pid: {t.number: (t.state.name, dict(t.params), t.value)
                  for t in s.get_trials(deepcopy=False)}
            for pid, s in pattern_studies(out, run_id).items()}


def assert_finished_exactly(out: Path, run_id: str, model: Path, budget: int) -> dict:
    """A finished run: every visit decided, within its budget, no model measured twice in it,
    nothing left running; the starts decided once (one trial each)."""
    report = json.loads((out / "report.json").read_text())
    assert report["complete"] is True
    studies = pattern_studies(out, run_id)
    starts = studies.pop("_starts")
    names = [t.user_attrs["start"] for t in starts.get_trials(deepcopy=False)]
    assert len(names) == len(set(names)) == len(report["starts"])
    visits = {f"{v['pattern']}/{v['lane'] + '/' if v['lane'] else ''}round{v['round']}"
              for p in report["patterns"] for v in p["visits"]}
    assert set(studies) == visits
    for pid, s in studies.items():
        assert is_visit(pid)
        check_visit(pid, s, budget)
    return report


def assert_kept(before: dict, after: dict) -> None:
    for pid, trials in before.items():
        for number, (state, params, value) in trials.items():
            if state == "COMPLETE":
                assert after[pid][number] == (state, params, value), (pid, number)


# -- --timeout -------------------------------------------------------------------------------
def test_timeout_stops_part_way_and_rerun_completes(residual, tmp_path, monkeypatch):
    out = tmp_path / "timed"
    monkeypatch.setenv("QDQ_TEST_SLEEP_S", "0.25")
    first = tune(residual, out, benchmark=CallableBackend(fns.sleepy, deterministic=True), runtime="onnxruntime",
                 timeout=3.0, config=Config(schemes_per_region=BUDGET), progress=False)
    assert first.report["complete"] is False
    assert (out / "optimized.onnx").is_file()
    state = (out / "state.yaml").read_text()
    assert "status: timeout" in state
    before = snapshot(out, "timed")
    finished = sum(s == "COMPLETE" for t in before.values() for s, _, _ in t.values())
    assert finished >= 1, "no trial finished within the timeout"
    assert any(p["status"] != "committed" for p in first.report["patterns"]) or \
        len(before) < len(first.report["patterns"])

    monkeypatch.setenv("QDQ_TEST_SLEEP_S", "0")
    second = tune(residual, out, benchmark=CallableBackend(fns.sleepy, deterministic=True), runtime="onnxruntime",
                  config=Config(schemes_per_region=BUDGET), progress=False)
    assert second.report["complete"] is True
    assert "status: done" in (out / "state.yaml").read_text()
    assert_kept(before, snapshot(out, "timed"))
    assert_finished_exactly(out, "timed", residual, BUDGET)
    assert second.report["speedup"] > 1.0


# -- a killed process ------------------------------------------------------------------------
def _db_trials(db: Path) -> list[tuple[str, int, str]]:
    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
    except sqlite3.OperationalError:
        return []
    try:
        return con.execute(
            "SELECT s.study_name, t.number, t.state FROM trials t "
            "JOIN studies s ON s.study_id = t.study_id").fetchall()
    except sqlite3.OperationalError:  # not created yet, or locked for a moment
        return []
    finally:
        con.close()


def _freeze_in_a_trial(proc: subprocess.Popen, db: Path, hold: Path,
                       deadline: float) -> tuple[str, int]:
    """Once a trial finished, hold the next trial in its measurement (the latency function
    does not return while ``hold`` exists, and says so with ``<hold>.held``); that trial's
    study name and number."""
    held = Path(str(hold) + ".held")

    def ended() -> None:
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the run ended (rc {proc.returncode}) before it could be held: {err}")

    while time.monotonic() < deadline:
        ended()
        if any(s == "COMPLETE" for _, _, s in _db_trials(db)):
            hold.touch()
            while not held.exists() and time.monotonic() < deadline:
                ended()
                time.sleep(0.05)
            rows: list = []
            while not rows:  # an empty read is a locked database
                rows = _db_trials(db)
            running = [(n, k) for n, k, s in rows if s == "RUNNING" and not n.endswith("/_run")]
            assert len(running) == 1, running  # one process: the trial the objective holds
            return running[0]
        time.sleep(0.05)
    pytest.fail("no running trial to hold")


def _foreground_signals() -> None:
    """The run as a terminal starts it: Ctrl-C's signal not ignored. A process started in the
    background of a non-interactive shell (``nohup CMD &``, some CI runners) inherits SIGINT
    ignored, and the tool rightly leaves an ignored signal alone: a test that presses Ctrl-C
    then waited 180 s for a run that never saw it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def signal_in_a_trial(argv: list[str], out: Path, hold: Path,
                      sig: int) -> tuple[int, str, str, int]:
    """Run ``argv`` (a tune with the ``sleepy`` latency function), send ``sig`` while a trial
    is held in its measurement; (exit code, stderr, that trial's study name and number)."""
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=cli_env(QDQ_TEST_SLEEP_S="0.4",
                                                   QDQ_TEST_HOLD_FILE=str(hold)),
                            preexec_fn=_foreground_signals)
    try:
        study_name, number = _freeze_in_a_trial(proc, out / "studies.db", hold,
                                                time.monotonic() + 90)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        hold.unlink(missing_ok=True)
        Path(str(hold) + ".held").unlink(missing_ok=True)
    return proc.returncode, err, study_name, number


def test_killed_run_resumes_redoing_the_running_trial(residual, tmp_path):
    out = tmp_path / "killed"
    hold = tmp_path / "hold"
    argv = cli_cmd("tune", "--model", residual, "--output", out,
                   "--backend", "tests._latency_fns:sleepy", "--runtime", "onnxruntime", "--timing", "fast",
                   "--schemes-per-region", BUDGET, "-q")
    returncode, _, study_name, number = signal_in_a_trial(argv, out, hold, signal.SIGKILL)
    assert returncode == -signal.SIGKILL

    pid = study_name.split("/", 1)[1]
    before = snapshot(out, "killed")
    killed_state, killed_params, _ = before[pid][number]
    assert killed_state == "RUNNING" and killed_params

    rerun = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120,
                           env=cli_env(QDQ_TEST_SLEEP_S="0"))
    assert rerun.returncode == 0, rerun.stderr
    after = snapshot(out, "killed")
    assert_kept(before, after)

    study = pattern_studies(out, "killed")[pid]
    killed = next(t for t in study.get_trials(deepcopy=False) if t.number == number)
    assert killed.state == TrialState.FAIL
    assert "process died" in killed.user_attrs.get("failure", "")
    redo = [t for t in study.get_trials(deepcopy=False)
            if t.number > number and t.system_attrs.get("fixed_params") == killed_params]
    assert redo and redo[0].state == TrialState.COMPLETE, "the killed trial was not redone"
    assert_finished_exactly(out, "killed", residual, BUDGET)


# -- changed settings, --fresh -----------------------------------------------------------------
def test_resume_with_other_settings_is_refused_and_fresh_starts_over(residual, tmp_path):
    out = tmp_path / "settings"
    base = ["tune", "--model", residual, "--output", out, "--backend", "costmodel", "-q"]

    def run(*extra):
        return subprocess.run(cli_cmd(*base, *extra), cwd=REPO, capture_output=True, text=True,
                              timeout=120, env=cli_env())

    first = run("--schemes-per-region", "4")
    assert first.returncode == 0, first.stderr
    report = (out / "report.json").read_bytes()
    trials = snapshot(out, "settings")

    for extra in (["--schemes-per-region", "5"], ["--schemes-per-region", "4",
                                                  "--quant-type", "fp8"]):
        proc = run(*extra)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2, proc.stderr
        assert len(lines) == 1 and lines[0].startswith("qdq-optuna: error:"), proc.stderr
        assert "--fresh" in lines[0] and "Traceback" not in proc.stderr
        assert (out / "report.json").read_bytes() == report
        assert snapshot(out, "settings") == trials

    # the same settings again: nothing left to do, nothing re-measured
    again = run("--schemes-per-region", "4")
    assert again.returncode == 0, again.stderr
    assert snapshot(out, "settings") == trials

    fresh = run("--schemes-per-region", "5", "--fresh")
    assert fresh.returncode == 0, fresh.stderr
    assert_finished_exactly(out, "settings", residual, 5)
    storage = open_storage(f"sqlite:///{out / 'studies.db'}", heartbeat=False)
    run = optuna.load_study(study_name="settings/_run", storage=storage)
    assert run_attrs(run)["settings"]["config"]["schemes_per_region"] == 5


# -- a trial killed while its points were being suggested ----------------------------------------
@pytest.mark.parametrize("how", ["resumed run", "dead worker"])
def test_a_trial_killed_before_all_its_points_were_suggested_is_not_redone(how, tmp_path):
    """It measured nothing, and its partial params filled with "off" would build another
    model, possibly one the study measured already (seen once in the SIGKILL test)."""
    from qdq_optuna.search._workers import enqueue_redo as _enqueue_redo
    from qdq_optuna.search._workers import fail_running_trials, retry_stale_trial

    storage = open_storage(f"sqlite:///{tmp_path / 'studies.db'}", heartbeat=False)
    study = optuna.create_study(study_name="x/P000", storage=storage)
    study.set_user_attr("qdq_points", ["a", "b", "c"])
    partial, whole = study.ask(), study.ask()
    partial.suggest_int("a", 0, 1)
    for p in "abc":
        whole.suggest_int(p, 0, 1)
    if how == "resumed run":
        for params in fail_running_trials(study):
            _enqueue_redo(study, params)
    else:
        for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
            retry_stale_trial(study, storage.get_trial(t._trial_id))
    queued = study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
    assert len(queued) == 1
    assert queued[0].system_attrs.get("fixed_params", queued[0].params) == whole.params


_KILLED_WRITER = """
import os, signal, sys
import optuna
import qdq_optuna.record.storage as m
m.SQLITE_WRITE_AHEAD = sys.argv[3] == "1"
storage = m.open_storage(sys.argv[1], heartbeat=False)
study = optuna.create_study(study_name="w", storage=storage)
for i in range(int(sys.argv[2])):
    trial = study.ask()
    study.tell(trial, float(i))
os.kill(os.getpid(), signal.SIGKILL)  # no close, no checkpoint
"""


@pytest.mark.parametrize("write_ahead", [True, False])
def test_a_sqlite_run_writes_ahead_and_a_killed_writer_loses_no_commit(tmp_path, monkeypatch,
                                                                      write_ahead):
    """SQLite is opened in write-ahead-log mode (commits are not synced one by one); a process
    killed before any checkpoint leaves its commits in the log, and the next open has them."""
    import qdq_optuna.record.storage as storage_mod

    db = tmp_path / "s.db"
    url = f"sqlite:///{db}"
    # off: the default rollback journal, for contrast (here too, for the reopening below)
    monkeypatch.setattr(storage_mod, "SQLITE_WRITE_AHEAD", write_ahead)
    proc = subprocess.run([sys.executable, "-c", _KILLED_WRITER, url, "7", str(int(write_ahead))],
                          env={**os.environ, "PYTHONWARNINGS": "ignore"}, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert (tmp_path / "s.db-wal").exists() == write_ahead
    with sqlite3.connect(db) as con:
        assert con.execute("PRAGMA journal_mode").fetchone()[0] == ("wal" if write_ahead
                                                                   else "delete")
    storage = open_storage(url, heartbeat=False)
    trials = optuna.load_study(study_name="w", storage=storage).get_trials(deepcopy=False)
    assert [t.value for t in trials] == [float(i) for i in range(7)]
    assert all(t.state == TrialState.COMPLETE for t in trials)


#: a process that opens a storage and is killed as it sends the statement containing argv[2]
_KILLED_AT_STATEMENT = """
import os, signal, sys
from sqlalchemy import event
from sqlalchemy.engine import Engine

def kill_at(conn, cursor, statement, *args):
    if sys.argv[2] in statement:
        os.kill(os.getpid(), signal.SIGKILL)

event.listen(Engine, "before_cursor_execute", kill_at)
if sys.argv[3] == "ours":
    from qdq_optuna.record.storage import open_storage
    open_storage(sys.argv[1], heartbeat=False)
else:  # Optuna's own storage: how a file made before the schema was made at once looks
    import optuna
    optuna.storages.RDBStorage(sys.argv[1])
"""


def _killed_at(url: str, statement: str, opener: str) -> None:
    proc = subprocess.run([sys.executable, "-c", _KILLED_AT_STATEMENT, url, statement, opener],
                          env={**os.environ, "PYTHONWARNINGS": "ignore"}, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr


def _indexes(db: Path) -> set[str]:
    with sqlite3.connect(db) as con:
        return {name for (name,) in con.execute("SELECT name FROM sqlite_master WHERE type='index'")}


@pytest.mark.parametrize("statement", ["CREATE TABLE studies", "CREATE UNIQUE INDEX ix_studies_study_name",
                                       "CREATE TABLE trials", "CREATE INDEX ix_trials_study_id",
                                       "CREATE TABLE alembic_version"])
def test_a_process_killed_while_the_storage_is_made_leaves_it_whole_or_absent(tmp_path, statement):
    """SQLite's driver commits each CREATE on its own: killed between the studies table and its
    unique index, Optuna's own table creation left a table that took a second study of the same
    name, and every resume after that failed (``MultipleResultsFound``). Ours makes the schema in
    one transaction: after a kill at any statement the next open has every index, and a study
    name is stored once however often a run resumes."""
    db = tmp_path / "s.db"
    url = f"sqlite:///{db}"
    _killed_at(url, statement, "ours")
    storage = open_storage(url, heartbeat=False)
    assert "ix_studies_study_name" in _indexes(db)
    for _ in range(3):  # a run and two resumes
        study = optuna.create_study(study_name="run", storage=storage, load_if_exists=True)
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=2)
    with sqlite3.connect(db) as con:
        assert con.execute("SELECT count(*) FROM studies").fetchone()[0] == 1


def test_a_storage_that_lost_its_unique_index_gets_it_back_and_its_empty_copies_go(tmp_path):
    """A file made by Optuna's own table creation, killed before the study-name index: the
    resumes that failed on it left empty copies of the study. Opening it deletes the copies,
    keeps the study's trials and restores the index; copies with trials are refused in one line."""
    db = tmp_path / "s.db"
    url = f"sqlite:///{db}"
    _killed_at(url, "CREATE UNIQUE INDEX ix_studies_study_name", "optuna")
    plain = optuna.storages.RDBStorage(url)
    optuna.create_study(study_name="run", storage=plain).optimize(
        lambda t: t.suggest_float("x", 0, 1), n_trials=3)
    for _ in range(2):  # what the failed resumes did: another copy each
        with pytest.raises(optuna.exceptions.StorageInternalError):
            optuna.create_study(study_name="run", storage=plain, load_if_exists=True)
    plain.engine.dispose()
    assert "ix_studies_study_name" not in _indexes(db)

    storage = open_storage(url, heartbeat=False)
    assert "ix_studies_study_name" in _indexes(db)
    study = optuna.create_study(study_name="run", storage=storage, load_if_exists=True)
    assert len(study.get_trials(deepcopy=False)) == 3
    with sqlite3.connect(db) as con:
        assert con.execute("SELECT count(*) FROM studies").fetchone()[0] == 1
        assert con.execute("SELECT count(*) FROM study_directions").fetchone()[0] == 1

    # two copies that both hold trials: nothing is deleted, the open is refused
    other = tmp_path / "t.db"
    _killed_at(f"sqlite:///{other}", "CREATE UNIQUE INDEX ix_studies_study_name", "optuna")
    plain = optuna.storages.RDBStorage(f"sqlite:///{other}")
    optuna.create_study(study_name="run", storage=plain).ask()
    with pytest.raises(optuna.exceptions.StorageInternalError):
        optuna.create_study(study_name="run", storage=plain, load_if_exists=True)
    plain.create_new_trial(2)  # the copy's id: the second study stored
    plain.engine.dispose()
    with pytest.raises(OptionError, match="two studies named 'run'"):
        open_storage(f"sqlite:///{other}", heartbeat=False)
