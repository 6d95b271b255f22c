"""Crash safety of a single-process run: SIGKILL at random moments, Ctrl-C.

The storage is the truth: a resumed run keeps every COMPLETE trial of the killed one, redoes
what was running, and ends with exactly the budget per study. Every output is written with a
temporary file and a rename, so a kill can never leave a half-written ``optimized.onnx`` or
``report.json``, and the next run removes the temporary files a killed process left behind.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import onnx
import onnxruntime as ort
import pytest
import yaml
from optuna.trial import TrialState
from test_resume import (
    BUDGET,
    REPO,
    assert_finished_exactly,
    assert_kept,
    cli_cmd,
    cli_env,
    pattern_studies,
    signal_in_a_trial,
    snapshot,
)

pytestmark = pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")

KILLS = 20
SEED = 20240611
#: each measurement sleeps this long, so a run lasts a few seconds and kills land everywhere
SLEEP_S = "0.03"
#: a kill lands this long after the start, drawn uniformly (startup, trials, commits, outputs)
KILL_WINDOW_S = (0.3, 2.5)


def _argv(model: Path, out: Path) -> list[str]:
    return cli_cmd("tune", "--model", model, "--output", out,
                   "--backend", "tests._latency_fns:sleepy", "--runtime", "onnxruntime", "--timing", "fast",
                   "--schemes-per-region", BUDGET, "-q")


def with_traceback(err: str, out: Path) -> str:
    """``err`` and the traceback an internal error kept in ``out`` (what a failure shows)."""
    from qdq_optuna._files import TRACEBACK_FILE

    kept = out / TRACEBACK_FILE
    return err + ("\n" + kept.read_text() if kept.is_file() else "")


def stray_files(out: Path) -> list[str]:
    """Temporary files of interrupted atomic writes (``.NAME.*.tmp``) anywhere in ``out``."""
    return sorted(str(p.relative_to(out)) for p in out.rglob("*")
                  if p.is_file() and p.name.endswith(".tmp"))


def assert_outputs_whole(out: Path) -> None:
    """Whatever outputs exist parse completely (no partial files)."""
    if (out / "optimized.onnx").exists():
        model = onnx.load(str(out / "optimized.onnx"))
        onnx.checker.check_model(model)
    if (out / "report.json").exists():
        json.loads((out / "report.json").read_text())
    if (out / "state.yaml").exists():
        assert isinstance(yaml.safe_load((out / "state.yaml").read_text()), dict)
    if (out / "pattern_cache.yaml").exists():
        yaml.safe_load((out / "pattern_cache.yaml").read_text())


def test_sigkill_at_random_moments_then_resume(residual, tmp_path):  # noqa: F811
    out = tmp_path / "crashy"
    argv = _argv(residual, out)
    env = cli_env(QDQ_TEST_SLEEP_S=SLEEP_S)
    rng = random.Random(SEED)
    previous: dict = {}
    kills = finished_early = 0
    started = time.monotonic()
    for _ in range(KILLS):
        delay = rng.uniform(*KILL_WINDOW_S)
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        try:
            proc.wait(timeout=delay)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            kills += 1
        _, err = proc.communicate(timeout=60)
        if proc.returncode == 0:
            finished_early += 1
        else:
            assert proc.returncode == -signal.SIGKILL, with_traceback(err, out)
        now = snapshot(out, "crashy") if (out / "studies.db").exists() else {}
        assert_kept(previous, now)  # no COMPLETE trial lost or changed
        assert_outputs_whole(out)
        previous = now

    final = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert final.returncode == 0, with_traceback(final.stderr, out)
    assert_kept(previous, snapshot(out, "crashy"))
    report = assert_finished_exactly(out, "crashy", residual, BUDGET)
    assert report["complete"] is True
    assert_outputs_whole(out)
    assert stray_files(out) == []
    ort.InferenceSession(str(out / "optimized.onnx"), providers=["CPUExecutionProvider"])
    state = yaml.safe_load((out / "state.yaml").read_text())
    assert state["status"] == "done"
    # the kills really interrupted the run: most attempts were killed part way
    assert kills >= KILLS // 2, (kills, finished_early)
    failed = [t for s in pattern_studies(out, "crashy").values()
              for t in s.get_trials(deepcopy=False, states=(TrialState.FAIL,))]
    assert all("process died" in t.user_attrs.get("failure", "") for t in failed)
    assert time.monotonic() - started < 120


def test_ctrl_c_fails_the_running_trial_and_rerun_completes(residual, tmp_path):  # noqa: F811
    out = tmp_path / "interrupted"
    hold = tmp_path / "hold"
    argv = _argv(residual, out)
    returncode, err, study_name, number = signal_in_a_trial(argv, out, hold, signal.SIGINT)
    assert returncode == 130, err
    assert "Rerun the same command to resume" in err, err
    assert "Traceback" not in err

    pid = study_name.split("/", 1)[1]
    study = pattern_studies(out, "interrupted")[pid]
    trial = next(t for t in study.get_trials(deepcopy=False) if t.number == number)
    assert trial.state == TrialState.FAIL, trial.state
    assert not study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    state = yaml.safe_load((out / "state.yaml").read_text())
    assert state["status"] == "interrupted"
    before = snapshot(out, "interrupted")

    rerun = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120,
                           env=cli_env(QDQ_TEST_SLEEP_S="0"))
    assert rerun.returncode == 0, rerun.stderr
    assert_kept(before, snapshot(out, "interrupted"))
    study = pattern_studies(out, "interrupted")[pid]
    redo = [t for t in study.get_trials(deepcopy=False)
            if t.number > number and t.system_attrs.get("fixed_params") == trial.params]
    assert redo and redo[0].state == TrialState.COMPLETE, "the interrupted trial was not redone"
    assert_finished_exactly(out, "interrupted", residual, BUDGET)
    assert stray_files(out) == []


def test_ctrl_c_inside_optunas_tell_still_ends_as_interrupted(residual, tmp_path, monkeypatch):  # noqa: F811
    """A Ctrl-C can land after the objective returned, inside Optuna's tell, where Optuna's own
    clean-up turns it into an UnboundLocalError: the run still ends as interrupted (exit 130,
    the one resume line, no trial left RUNNING), and the rerun completes."""
    from optuna.study import _optimize

    from qdq_optuna.cli.commands import main

    real_tell = _optimize._tell_with_warning
    calls = []

    def tell_then_ctrl_c(*args, **kwargs):
        calls.append(kwargs["trial"].number)
        if len(calls) == 3:  # the third trial: its figure is in, the tell is under way
            raise KeyboardInterrupt
        return real_tell(*args, **kwargs)

    monkeypatch.setattr(_optimize, "_tell_with_warning", tell_then_ctrl_c)
    out = tmp_path / "told"
    argv = ["tune", "--model", str(residual), "--output", str(out),
            "--backend", "_latency_fns:rewards_groups", "--runtime", "onnxruntime",
            "--timing", "fast", "--schemes-per-region", str(BUDGET), "-q"]
    assert main(argv) == 130
    assert len(calls) == 3
    for study in pattern_studies(out, "told").values():
        assert not study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    assert yaml.safe_load((out / "state.yaml").read_text())["status"] == "interrupted"

    monkeypatch.setattr(_optimize, "_tell_with_warning", real_tell)
    assert main(argv) == 0
    assert_finished_exactly(out, "told", residual, BUDGET)


def test_an_error_raised_while_a_ctrl_c_was_handled_counts_as_the_ctrl_c():
    from qdq_optuna.errors import interrupted_by

    def clean_up_fails(explicit_cause: bool):
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            try:
                raise ValueError("the library's clean-up")
            except ValueError as inner:
                if explicit_cause:  # `raise ... from inner`: the Ctrl-C is only a context
                    raise RuntimeError("wrapped") from inner
                raise

    for explicit in (False, True):
        with pytest.raises(Exception) as info:
            clean_up_fails(explicit)
        assert interrupted_by(info.value)
    assert not interrupted_by(RuntimeError("plain"))
