"""Faults around the anytime file: a full disk or a kill while ``optimized.onnx`` is being
replaced leaves the previous file whole (and no temp file once the next run starts)."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import onnx
import pytest

from qdq_optuna import PreparedModel
from qdq_optuna._files import remove_stale_temps
from qdq_optuna.examples import zoo
from qdq_optuna.run_folder import RunFolder

REPO = Path(__file__).resolve().parent.parent


def _exporter_and_uses():
    pm = PreparedModel.prepare(zoo.build("tiny_residual"), runtime="onnxruntime")
    return pm.exporter(), {u for pp in pm.tunable for u in pp.uses(pp.ids)}


def test_a_full_disk_mid_write_leaves_the_previous_file_whole(tmp_path, monkeypatch):
    exporter, uses = _exporter_and_uses()
    RunFolder(tmp_path).save_standing(exporter, set())  # the float model stands first
    target = tmp_path / "optimized.onnx"
    before = target.read_bytes()
    real_fdopen = os.fdopen

    class HalfThenFull:
        """A file whose write stores half the bytes, then the disk is full."""

        def __init__(self, fh):
            self.fh = fh

        def write(self, data):
            self.fh.write(data[: len(data) // 2])
            self.fh.flush()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def __getattr__(self, name):
            return getattr(self.fh, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.fh.close()

    monkeypatch.setattr(os, "fdopen", lambda *a, **k: HalfThenFull(real_fdopen(*a, **k)))
    with pytest.raises(OSError) as info:
        RunFolder(tmp_path).save_standing(exporter, uses)
    assert info.value.errno == errno.ENOSPC
    monkeypatch.setattr(os, "fdopen", real_fdopen)
    assert target.read_bytes() == before
    onnx.checker.check_model(onnx.load(str(target)))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["optimized.onnx"]
    RunFolder(tmp_path).save_standing(exporter, uses)  # with room again the new model replaces it
    assert target.read_bytes() != before


_SLOW_WRITER = """
import os, sys, time
from pathlib import Path
from qdq_optuna._files import atomic_write_bytes
marker = Path(sys.argv[2])
real_fdopen = os.fdopen

class Slow:
    def __init__(self, fh): self.fh = fh
    def write(self, data):
        for i in range(0, len(data), 4096):
            self.fh.write(data[i:i + 4096]); self.fh.flush()
            marker.touch(); time.sleep(0.05)
    def __getattr__(self, name): return getattr(self.fh, name)
    def __enter__(self): return self
    def __exit__(self, *exc): self.fh.close()

os.fdopen = lambda *a, **k: Slow(real_fdopen(*a, **k))
atomic_write_bytes(sys.argv[1], b"new" * 200000)
"""


def test_a_kill_mid_replace_leaves_the_previous_file_whole(tmp_path):
    target = tmp_path / "optimized.onnx"
    exporter, _ = _exporter_and_uses()
    RunFolder(tmp_path).save_standing(exporter, set())
    before = target.read_bytes()
    marker = tmp_path.parent / f"{tmp_path.name}.writing"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))}
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_WRITER, str(target), str(marker)],
                            env=env, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, proc.communicate()[1]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert target.read_bytes() == before
    left = [p for p in tmp_path.iterdir() if p.name != "optimized.onnx"]
    assert left and all(p.name.endswith(".tmp") for p in left)  # the killed write's part
    assert sorted(remove_stale_temps(tmp_path)) == sorted(left)  # gone at the next start
    assert [p.name for p in tmp_path.iterdir()] == ["optimized.onnx"]


def _failing_backend(model):
    raise RuntimeError("no device here")


@pytest.mark.parametrize("folder_existed", [False, True])
def test_a_run_that_fails_before_its_first_measurement_leaves_no_files(tmp_path, folder_existed):
    """The backend fails on the float model: nothing the run wrote (studies.db, calibration
    statistics, the folder itself) stays, and what was in an existing folder is untouched."""
    from qdq_optuna import tune
    from qdq_optuna.errors import UserError

    model = tmp_path / "m.onnx"
    onnx.save(zoo.build("tiny_residual"), str(model))
    out = tmp_path / "out"
    if folder_existed:
        out.mkdir()
        (out / "mine.txt").write_text("keep")
    with pytest.raises(UserError, match="cannot run the float model"):
        tune(model, out, backend=_failing_backend, runtime="onnxruntime")
    if folder_existed:
        assert sorted(p.name for p in out.iterdir()) == ["mine.txt"]
        assert (out / "mine.txt").read_text() == "keep"
    else:
        assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"] + (["out"] if folder_existed else [])
