"""A run stored by the pattern-by-pattern search (before the whole-model search) is refused
with one clear line, never resumed into something else, and ``--fresh`` tunes the model again.

``data/run_c32ab0d/`` holds the storage of a run made by the code at commit c32ab0d (see
``data/make_old_run.py``): ``tiny_concat`` (medium) on the cost model through a deterministic
callable, 6 schemes per pattern, cut by a Ctrl-C in a trial of its refinement round. Its
studies (``RUN/P001``, ``RUN/P001/refine1``) mean a first pass and refinements; the
whole-model search would read them as something else, so it does not resume them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import _latency_fns as fns
import optuna
import pytest
import yaml

from qdq_optuna import Config, tune
from qdq_optuna.backends.callable import CallableBackend
from qdq_optuna.backends.costmodel import CostModelBackend
from qdq_optuna.errors import UserError
from qdq_optuna.record.storage import open_storage

pytestmark = pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")

OLD = Path(__file__).resolve().parent / "data" / "run_c32ab0d"
REPO = Path(__file__).resolve().parent.parent


def _tune(model: Path, out: Path, **kwargs):
    return tune(model, out, benchmark=CallableBackend(fns.costmodel_interruptible,
                                                       deterministic=True),
                runtime="onnxruntime", config=Config(schemes_per_region=6), seed=0,
                progress=False, **kwargs)


def _trials(out: Path) -> dict[str, dict[int, tuple]]:
    storage = open_storage(f"sqlite:///{out / 'studies.db'}", heartbeat=False)
    try:
        return {s.study_name: {t.number: (t.state.name, t.params, t.values, t.user_attrs)
                               for t in optuna.load_study(study_name=s.study_name,
                                                          storage=storage).trials}
                for s in storage.get_all_studies()}
    finally:
        storage.engine.dispose()


def test_a_run_of_the_old_layout_is_refused_in_one_line_and_fresh_starts_over(tmp_path):
    shutil.copytree(OLD, tmp_path / "old")
    model, out = tmp_path / "old" / "model.onnx", tmp_path / "old" / "run"
    before = _trials(out)
    assert "run/_run" in before and "run/P001/refine1" in before
    with pytest.raises(UserError) as info:
        _tune(model, out)
    line = str(info.value)
    assert "\n" not in line and "pattern-by-pattern search" in line and "--fresh" in line
    assert _trials(out) == before  # nothing written into the old run

    # through the command line: one error line, exit 2
    proc = subprocess.run(
        [sys.executable, "-m", "qdq_optuna", "tune", "-m", str(model), "-o", str(out),
         "-b", "tests._latency_fns:costmodel_interruptible", "--runtime", "onnxruntime",
         "-n", "6", "-q"], cwd=REPO, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qdq-optuna: error:"), proc.stderr

    report = _tune(model, out, fresh=True).report
    assert report["complete"] is True
    after = _trials(out)
    assert "run/_starts" in after and not any("/refine" in name for name in after)
    assert yaml.safe_load((out / "state.yaml").read_text())["status"] == "done"
    assert CostModelBackend().estimate((out / "optimized.onnx").read_bytes()).total_ms == (
        pytest.approx(report["final_latency_ms"]))
    assert json.loads((out / "report.json").read_text())["run_id"] == "run"
