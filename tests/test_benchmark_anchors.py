"""``benchmarks/accuracy_anchors.py`` in CI: its options are checked, its error is the guard's,
its ONNX Runtime recipe with ``qdq_loss_debug`` exclusions reaches the bound on a real session,
and its results files are written whole.

Why: the anchor benchmark needs real models, photos and minutes of a quiet machine, so it runs
rarely; these parts run in seconds on a generated model and keep it from rotting.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from qdq_optuna.examples import zoo
from qdq_optuna.measure.accuracy import run_model

REPO = Path(__file__).resolve().parent.parent

if os.environ.get("QDQ_OPTUNA_TEST_INSTALLED") == "1":  # the suite copied beside a wheel
    pytest.skip("imports the checkout's benchmarks/: run from the checkout", allow_module_level=True)


@pytest.fixture
def anchors(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    sys.modules.pop("accuracy_anchors", None)
    return importlib.import_module("accuracy_anchors")


def test_the_defaults_name_picture_models_and_every_tool(anchors):
    args = anchors.parse([])
    assert args.models == list(anchors.MODELS)
    assert args.tools == list(anchors.TOOLS)
    assert args.bound == pytest.approx(0.2)


@pytest.mark.parametrize("argv, says", [
    (["--models", "magika"], "--models: 'magika' is not a real model that takes pictures"),
    (["--tools", "ours_onnxruntime,bogus"], "--tools: unknown tool 'bogus'"),
    (["--bound", "0"], "--bound must be > 0"),
    (["--held-out", "0"], "--held-out must be >= 1"),
    (["--budget", "-5"], "--budget must be > 0"),
])
def test_a_bad_option_is_one_line_and_exit_2(anchors, capsys, argv, says):
    with pytest.raises(SystemExit) as stop:
        anchors.parse(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


def test_the_error_is_the_worst_outputs_relative_l2(anchors):
    rng = np.random.default_rng(0)
    ref = {"a": rng.standard_normal((4, 10)), "b": rng.standard_normal((4, 3))}
    # outputs are matched by order (OpenVINO may name them differently)
    cand = {"x": ref["a"] * 1.05, "y": ref["b"] * 1.25}
    assert anchors.error(ref, cand) == pytest.approx(0.25)
    each = anchors.per_sample(ref, cand)
    assert len(each) == 4 and each == pytest.approx([0.25] * 4)
    assert anchors.spread([0.1, 0.3, 0.2]) == {"min": 0.1, "median": 0.2, "max": 0.3}


def _tiny(tmp_path: Path) -> tuple[Path, dict, dict]:
    path = tmp_path / "tiny.onnx"
    model = zoo.tiny_residual()
    for node in model.graph.node[::2]:
        node.name = ""  # an exporter's unnamed nodes: the recipe names them to exclude them
    onnx.save(model, str(path))
    rng = np.random.default_rng(1)
    cal = {"input": rng.standard_normal((6, 3, 16, 16)).astype(np.float32)}
    return path, cal, run_model(str(path), cal)


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"rank_by": "qdq", "debug_samples": 2, **kw})


def test_the_recipe_with_exclusions_reaches_a_tight_bound(anchors, tmp_path):
    path, cal, ref = _tiny(tmp_path)
    before = path.read_bytes()
    plain, _ = anchors.ort_recipe(path, tmp_path / "plain", cal, None)
    plain_error = anchors.error(ref, run_model(str(plain), cal))
    bound = plain_error / 10
    out, info = anchors.ort_recipe_excluded(path, tmp_path / "excl", cal, ref, None, bound,
                                            _args())
    assert anchors.error(ref, run_model(str(out), cal)) <= bound < plain_error
    assert info["excluded_nodes"] and info["excluded_tensors"] <= info["ranked_tensors"]
    # fewer of the worst tensors' nodes excluded stayed out of bound: the count is the least
    # the doubling and bisection found
    assert info["tried"][str(info["excluded_tensors"] - 1)] > bound
    assert path.read_bytes() == before  # the user's model is not modified


def test_the_recipe_within_the_bound_excludes_nothing(anchors, tmp_path):
    path, cal, ref = _tiny(tmp_path)
    out, info = anchors.ort_recipe_excluded(path, tmp_path / "excl", cal, ref, None, 10.0,
                                            _args())
    assert info["excluded_nodes"] == [] and out.name == "excluded_0.onnx"


def test_results_are_written_whole_with_failures_and_skips(anchors, tmp_path):
    ok = {"runtime": "onnxruntime", "seconds": 3.0, "calibration_error": 0.1,
          "held_out_error": 0.3, "held_out_per_sample": {"min": 0.1, "median": 0.2, "max": 0.5},
          "held_out_within_bound": False, "speedup": 1.5, "speedup_ci": [1.4, 1.6],
          "claim": {"error": 0.12}}
    doc = {"bound": 0.2, "machine": "a CPU", "rows": [
        {"model": "nudenet-320n", "tools": {"ours_onnxruntime": ok,
                                            "nncf_accuracy_control": {"failed": "ToolTimeout: "
                                                                      "ran past 9 s",
                                                                      "seconds": 9.0}}},
        {"model": "ppocr-det", "skipped": "fetch failed: no network"}]}
    anchors.write(doc, tmp_path / "res" / "anchors")
    assert json.loads((tmp_path / "res" / "anchors.json").read_text()) == doc
    md = (tmp_path / "res" / "anchors.md").read_text()
    assert "| nudenet-320n | ours_onnxruntime | onnxruntime | 1.50x (1.40-1.60) | 0.120 |" in md
    assert "**no**" in md and "failed: ToolTimeout: ran past 9 s" in md
    assert "fetch failed: no network" in md
    assert sorted(p.name for p in (tmp_path / "res").iterdir()) == ["anchors.json", "anchors.md"]


def test_past_the_budget_a_model_is_a_row_that_says_so(anchors, tmp_path):
    args = anchors.parse(["--models", "nudenet-320n", "--budget", "1",
                          "--work", str(tmp_path)])
    args.stop_at -= 2  # the budget spent
    row = anchors.one("nudenet-320n", args)
    assert row == {"model": "nudenet-320n", "skipped": "not started: past --budget 1 s"}
    assert list(tmp_path.iterdir()) == []  # nothing fetched or written


def test_a_row_still_running_renders_without_tools(anchors):
    doc = {"bound": 0.2, "machine": "a CPU", "rows": [{"model": "ppocr-det"}]}
    assert anchors.table(doc).count("\n") == 2  # the header only
