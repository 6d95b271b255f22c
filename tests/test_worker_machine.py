"""A worker on another machine never commits into a run: the run records the machine its
timings come from (CPU flags, runtime, version, threads), and a process that differs is
refused in one line naming the difference (exit 2). The CPUs are simulated
(``QDQ_OPTUNA_CPU_FLAGS``); the processes and the SQLite run are real."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import time
from pathlib import Path

import onnx
import pytest
from test_resume import REPO, cli_cmd, cli_env

from qdq_optuna.backends.base import measuring
from qdq_optuna.examples import zoo
from qdq_optuna.machine import (
    FEATURE_SETS,
    CpuFeatures,
    machine_differences,
    measuring_machine,
)

pytestmark = pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")


def _complete(db: Path) -> set[tuple[str, int]]:
    """(study, number) of the COMPLETE trials, read with a connection closed at once."""
    if not db.exists():
        return set()
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
    try:
        return set(con.execute(
            "SELECT s.study_name, t.number FROM trials t JOIN studies s "
            "ON s.study_id = t.study_id WHERE t.state = 'COMPLETE'").fetchall())
    except sqlite3.OperationalError:  # not created yet
        return set()
    finally:
        con.close()


def test_a_worker_on_another_cpu_is_refused_and_commits_nothing(tmp_path):
    model = tmp_path / "m.onnx"
    onnx.save(zoo.build("tiny_residual"), str(model))
    db = tmp_path / "run.db"

    def worker(name: str) -> list[str]:
        return cli_cmd("tune", "--model", model, "--output", tmp_path / name,
                       "--backend", "costmodel", "--storage", f"sqlite:///{db}", "--worker",
                       "--run-id", "shared", "-q")

    # a VNNI machine starts the run; killed part way, so there is work left to join
    first = subprocess.Popen(worker("vnni1"), cwd=REPO, env=cli_env(QDQ_OPTUNA_CPU_FLAGS="vnni"),
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while len(_complete(db)) < 3 and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    first.send_signal(signal.SIGKILL)
    first.communicate(timeout=60)
    assert first.returncode == -signal.SIGKILL, "the run finished before it could be joined"
    before = _complete(db)

    avx2 = subprocess.run(worker("avx2"), cwd=REPO, env=cli_env(QDQ_OPTUNA_CPU_FLAGS="avx2"),
                          capture_output=True, text=True, timeout=120)
    assert avx2.returncode == 2, avx2.stderr
    lines = [ln for ln in avx2.stderr.splitlines() if "error" in ln]
    assert len(lines) == 1 and "Traceback" not in avx2.stderr, avx2.stderr
    assert "another machine" in lines[0]
    assert "avx512f: in the run, not here" in lines[0]
    assert "avx512_vnni: in the run, not here" in lines[0]
    assert _complete(db) == before  # nothing committed
    assert not (tmp_path / "avx2" / "report.json").exists()

    # the same machine joins and finishes the run
    same = subprocess.run(worker("vnni2"), cwd=REPO, env=cli_env(QDQ_OPTUNA_CPU_FLAGS="vnni"),
                          capture_output=True, text=True, timeout=240)
    assert same.returncode == 0, same.stderr
    assert _complete(db) > before
    assert (tmp_path / "vnni2" / "report.json").exists()

    # with --measuring-group the AVX2 machine measures as a run of its own beside it: it
    # finishes, and not one trial of the VNNI machines' studies changes
    vnni_trials = _complete(db)
    group = subprocess.run(worker("avx2") + ["--measuring-group", "avx2"], cwd=REPO,
                           env=cli_env(QDQ_OPTUNA_CPU_FLAGS="avx2"), capture_output=True,
                           text=True, timeout=240)
    assert group.returncode == 0, group.stderr
    after = _complete(db)
    assert {t for t in after if not t[0].startswith("shared@avx2")} == vnni_trials
    new = after - vnni_trials
    assert new and all(t[0].startswith("shared@avx2") for t in new), sorted({t[0] for t in new})
    assert (tmp_path / "avx2" / "report.json").exists()


def test_a_measuring_group_name_is_checked(tmp_path):
    from qdq_optuna import TuneOptions
    from qdq_optuna.errors import OptionError

    opts = TuneOptions(model="m.onnx", output_dir=tmp_path / "out", run_id="r",
                       measuring_group="avx2")
    assert opts.run_id_or_default == "r@avx2"
    with pytest.raises(OptionError, match="--measuring-group"):
        TuneOptions(model="m.onnx", output_dir=tmp_path / "out", measuring_group="a/b")


def test_what_makes_two_machines_differ():
    ort = measuring({"name": "onnxruntime", "onnxruntime": "1.32.0", "threads": 1, "seed": 0,
                     "input_shapes": {}})
    vnni = CpuFeatures.from_flags(FEATURE_SETS["vnni"], model_name="a")
    amx = CpuFeatures.from_flags(FEATURE_SETS["amx"], model_name="b")
    run = measuring_machine(ort, vnni)
    assert run["cpu_flags"] == list(FEATURE_SETS["vnni"]) and run["runtime"]["threads"] == 1
    assert "seed" not in run["runtime"]  # a setting, not the machine (the fingerprint has it)
    # the CPU's name is recorded, not compared: its flags are what change an answer
    assert machine_differences(run, measuring_machine(ort, CpuFeatures.from_flags(
        FEATURE_SETS["vnni"], model_name="other"))) == []
    differs = machine_differences(run, measuring_machine(
        {**ort, "onnxruntime": "1.31.0", "threads": 2}, amx))
    assert "avx512_bf16: here, not in the run" in differs
    assert "amx_int8: here, not in the run" in differs
    assert "onnxruntime '1.31.0' here, '1.32.0' in the run" in differs
    assert "threads 2 here, 1 in the run" in differs
