"""A run stored by the search before it became a package still resumes, to the same result.

``data/run_c32ab0d/`` holds the storage of a run made by the code at commit c32ab0d (see
``data/make_old_run.py``): ``tiny_concat`` (medium) on the cost model through a deterministic
callable, 6 schemes per pattern, cut by a Ctrl-C in a trial of its refinement round.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import _latency_fns as fns
import optuna
import pytest
import yaml

from qdq_optuna import Config, tune
from qdq_optuna.backends.callable import CallableBackend
from qdq_optuna.backends.costmodel import CostModelBackend
from qdq_optuna.storage import open_storage

pytestmark = pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")

OLD = Path(__file__).resolve().parent / "data" / "run_c32ab0d"


def _tune(model: Path, out: Path):
    return tune(model, out, benchmark=CallableBackend(fns.costmodel_interruptible,
                                                       deterministic=True), runtime="onnxruntime",
                config=Config(schemes_per_region=6), seed=0, progress=False)


def _trials(out: Path) -> dict[str, dict[int, tuple]]:
    storage = open_storage(f"sqlite:///{out / 'studies.db'}", heartbeat=False)
    try:
        return {s.study_name: {t.number: (t.state.name, t.params, t.values, t.user_attrs)
                               for t in optuna.load_study(study_name=s.study_name,
                                                          storage=storage).trials}
                for s in storage.get_all_studies()}
    finally:
        storage.engine.dispose()


def test_a_run_of_the_old_layout_resumes_to_the_same_result(tmp_path):
    shutil.copytree(OLD, tmp_path / "old")
    model, out = tmp_path / "old" / "model.onnx", tmp_path / "old" / "run"
    before = _trials(out)
    assert "run/_run" in before and "run/P001/refine1" in before
    (cut,) = [n for n, (state, *_, attrs) in before["run/P001/refine1"].items()
              if state == "FAIL" and attrs.get("transient")]

    report = _tune(model, out).report  # the same settings: no "other settings" refusal
    after = _trials(out)
    assert report["complete"] is True
    assert yaml.safe_load((out / "state.yaml").read_text())["status"] == "done"
    # every finished trial and every decision of the old process stands
    for name, trials in before.items():
        for number, (state, params, values, _) in trials.items():
            if state == "COMPLETE":
                assert after[name][number][:3] == (state, params, values), (name, number)
    # the interrupted trial was redone once, with the same scheme
    redo = [t for t in after["run/P001/refine1"].values() if t[3].get("retry_of") == cut]
    assert len(redo) == 1 and redo[0][0] == "COMPLETE"
    assert redo[0][1] == before["run/P001/refine1"][cut][1]

    fresh = _tune(model, tmp_path / "fresh" / "run").report
    assert report["speedup"] == pytest.approx(fresh["speedup"], rel=1e-12)
    assert [(p["id"], p["committed_scheme"], p["gain"]) for p in report["patterns"]] == [
        (p["id"], p["committed_scheme"], p["gain"]) for p in fresh["patterns"]]
    assert CostModelBackend().estimate((out / "optimized.onnx").read_bytes()).total_ms == (
        pytest.approx(report["final_latency_ms"]))
    assert json.loads((out / "report.json").read_text())["run_id"] == "run"
