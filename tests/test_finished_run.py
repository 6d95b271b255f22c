"""A finished run, run again: it prints its result and measures nothing, unless asked
(``--remeasure``: the final A/B and the report only)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import _latency_fns as fns
import onnx
import pytest
from test_resume import REPO, cli_env

from qdq_optuna import Config, tune
from qdq_optuna.backends.callable import CallableBackend
from qdq_optuna.examples import zoo
from qdq_optuna.record.storage import open_storage

pytestmark = pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")


class Counting:
    """``rewards_groups`` that counts the models it was asked to time."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, model: onnx.ModelProto) -> float:
        self.calls += 1
        return fns.rewards_groups(model)


def _digests(out) -> dict[str, str]:
    return {name: hashlib.sha256((out / name).read_bytes()).hexdigest()
            for name in ("report.json", "report.md", "optimized.onnx", "state.yaml",
                         "pattern_cache.yaml")}


def _tune(model, out, fn, **options):
    return tune(model, out, backend=CallableBackend(fn, deterministic=True),
                runtime="onnxruntime", config=Config(schemes_per_region=4), progress=False,
                **options)


def test_rerunning_a_finished_run_measures_nothing_and_changes_nothing(tmp_path):
    model = zoo.build("tiny_residual")
    out = tmp_path / "run"
    first = Counting()
    done = _tune(model, out, first)
    assert first.calls > 0 and not done.finished_before
    before = _digests(out)

    again = Counting()
    result = _tune(model, out, again)
    assert again.calls == 0  # not even the baseline
    assert result.finished_before
    assert result.report == json.loads((out / "report.json").read_text()) == done.report
    assert _digests(out) == before

    # --remeasure: the final A/B and the report again, nothing else
    redo = Counting()
    remeasured = _tune(model, out, redo, remeasure=True)
    assert not remeasured.finished_before
    assert redo.calls == 2  # the saved model and the model without Q/DQ, once each
    assert remeasured.report["measurements"] == 1
    assert remeasured.report["finished"] != done.report["finished"]
    assert [p["committed_scheme"] for p in remeasured.report["patterns"]] == [
        p["committed_scheme"] for p in done.report["patterns"]]
    assert _digests(out)["optimized.onnx"] == before["optimized.onnx"]
    # and the run is finished with that report now
    assert _tune(model, out, Counting()).report == remeasured.report
    # --fresh starts over: every study of the run goes, its overview too, and is made again
    fresh = Counting()
    assert not _tune(model, out, fresh, fresh=True).finished_before and fresh.calls > 2
    storage = open_storage(f"sqlite:///{out / 'studies.db'}", heartbeat=False)
    names = [s.study_name for s in storage.get_all_studies()]
    assert names.count("run") == 1 and names.count("run/_run") == 1


def test_a_finished_run_with_a_changed_report_is_finished_again(tmp_path):
    """The stored result is only reused when this folder holds the report the run finished
    with (not another run's, not an edited one)."""
    model = zoo.build("tiny_residual")
    out = tmp_path / "run"
    _tune(model, out, Counting())
    (out / "report.json").write_text("{}")
    counting = Counting()
    result = _tune(model, out, counting)
    assert not result.finished_before and counting.calls == 2
    assert json.loads((out / "report.json").read_text())["complete"] is True


def test_the_cli_prints_the_result_of_a_finished_run(tmp_path):
    model = tmp_path / "m.onnx"
    onnx.save(zoo.build("tiny_residual"), str(model))
    argv = [sys.executable, "-m", "qdq_optuna", "tune", "-m", str(model), "-o",
            str(tmp_path / "out"), "-b", "costmodel", "-n", "3"]
    first = subprocess.run(argv, cwd=REPO, env=cli_env(), capture_output=True, text=True,
                           timeout=300)
    assert first.returncode == 0, first.stderr
    report = (tmp_path / "out" / "report.json").read_bytes()
    second = subprocess.run(argv, cwd=REPO, env=cli_env(), capture_output=True, text=True,
                            timeout=300)
    assert second.returncode == 0, second.stderr
    assert (tmp_path / "out" / "report.json").read_bytes() == report
    lines, first_lines = second.stdout.splitlines(), first.stdout.splitlines()
    assert lines[0].startswith("run 'out' finished on ") and "--remeasure" in lines[0]
    # the same result lines as the first time, and no claim to have written anything
    assert lines[1:-1] == first_lines[:-1]
    assert first_lines[-1].startswith("wrote ") and lines[-1].startswith("kept (not rewritten) ")
    # --remeasure says what it does: one A/B, not "the rest of the descent"
    third = subprocess.run([*argv, "--remeasure"], cwd=REPO, env=cli_env(), capture_output=True,
                           text=True, timeout=300)
    assert third.returncode == 0, third.stderr
    assert "--remeasure measures its final model against the baseline again" in third.stderr
    assert "left: the rest of the descent" not in third.stderr
    assert third.stdout.splitlines()[-1].startswith("wrote ")


def test_every_file_a_run_writes_follows_the_umask(tmp_path):
    """report.*, optimized.onnx, state.yaml, pattern_cache.yaml, calibration_stats.json, the
    storage and the dashboard's artifacts: the mode ``open()`` gives a file under the umask."""
    import os
    import stat

    out = tmp_path / "run"
    old = os.umask(0o027)
    try:
        _tune(zoo.build("tiny_residual"), out, Counting())
    finally:
        os.umask(old)
    files = [p for p in out.rglob("*") if p.is_file()]
    names = {p.name for p in files}
    assert {"report.json", "report.md", "optimized.onnx", "state.yaml", "pattern_cache.yaml",
            "calibration_stats.json", "studies.db"} <= names
    assert any(p.parent.name == "artifacts" for p in files)
    modes = {p.relative_to(out).as_posix(): oct(stat.S_IMODE(p.stat().st_mode)) for p in files}
    assert set(modes.values()) == {oct(0o640)}, modes
