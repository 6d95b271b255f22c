"""The runtime's recipe file as written: kept in the run folder, reproducible, measured as
written against its re-export and the tuned model, shipped when the tuned model is slower;
what differs between two models' Q/DQ tensors."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from qdq_optuna import tune
from qdq_optuna.backends.callable import CallableBackend
from qdq_optuna.config import Config
from qdq_optuna.measure.recipe_parity import qdq_differences, qdq_params
from qdq_optuna.placement import starts
from qdq_optuna.runtimes import onnxruntime as ort_runtime
from qdq_optuna.runtimes import openvino as ov_runtime

#: ONNX Runtime's quantize_static signs the models it writes with this producer name; our
#: export keeps the user's: the latency functions below tell the recipe's own file from any
#: re-export by it
_ORT_PRODUCER = "onnx.quantize"


def _ort_written(model: onnx.ModelProto) -> bool:
    return model.producer_name == _ORT_PRODUCER


def file_fastest(model: onnx.ModelProto) -> float:
    """The recipe's own file 1 ms, every other model 2 ms."""
    return 1.0 if _ort_written(model) else 2.0


def file_slowest(model: onnx.ModelProto) -> float:
    """The recipe's own file 3 ms, every other model 2 ms."""
    return 3.0 if _ort_written(model) else 2.0


def _tune(model: Path, out: Path, fn) -> dict:
    return tune(str(model), out, benchmark=CallableBackend(fn, deterministic=True),
                runtime="onnxruntime", config=Config(schemes_per_region=3, refine_rounds=0),
                progress=False).report


def test_the_recipe_file_is_kept_as_written_and_ships_when_the_tuned_model_is_slower(
        residual, tmp_path):
    """The tuned model measured slower than quantize_static's own file: optimized.onnx is
    that file byte for byte (its Q/DQ tensors as the tool wrote them), the one kept in the
    run folder, and the same file the recipe makes again (a resumed run measures the same)."""
    report = _tune(residual, tmp_path / "r", file_fastest)
    rf = report["recipe_file"]
    kept = (tmp_path / "r" / rf["file"]).read_bytes()
    again = starts.recipe_file_bytes(lambda work: ort_runtime.ort_recipe_model(str(residual), work))
    assert kept == again
    assert rf["shipped"] and rf["within_bound"]
    assert rf["tuned_vs_file"]["verdict"] == "slower"
    assert (tmp_path / "r" / "optimized.onnx").read_bytes() == kept
    assert qdq_params(kept) == qdq_params(again)
    assert report["accuracy"]["shipped"] == "the recipe's own file"
    assert report["final_output_error"] == rf["error"]
    # the claim's spread is the file's own (it was the tuned model's)
    assert report["accuracy"]["claim"] == rf["claim"] and rf["claim"]["samples"] >= 2
    # the re-export was slower than the file beyond noise: the report says what differs
    assert rf["reexport_vs_file"]["verdict"] == "slower" and rf["differences"]
    text = (tmp_path / "r" / "report.md").read_text()
    assert "is the recipe's own file" in text and "their Q/DQ differ" in text


def test_the_tuned_model_ships_when_the_recipe_file_is_not_faster(residual, tmp_path):
    report = _tune(residual, tmp_path / "r", file_slowest)
    rf = report["recipe_file"]
    assert not rf["shipped"] and rf["tuned_vs_file"]["verdict"] == "faster"
    assert rf["differences"] == []  # the re-export is not slower than the file
    assert not _ort_written(onnx.load(str(tmp_path / "r" / "optimized.onnx")))
    assert report["accuracy"]["shipped"] != "the recipe's own file"


def test_a_recipe_file_past_the_bound_is_not_timed(residual, tmp_path):
    """A file that breaks the accuracy bound cannot ship, so no A/B is spent on it (fastest
    as it is here, it would otherwise be timed against the tuned model); the report gives its
    error and why it was not timed."""
    timed = []

    def counting(model: onnx.ModelProto) -> float:
        timed.append(_ort_written(model))
        return file_fastest(model)

    report = tune(str(residual), tmp_path / "r", benchmark=CallableBackend(counting,
                  deterministic=True), runtime="onnxruntime", max_output_error=1e-6,
                  config=Config(schemes_per_region=3, refine_rounds=0), progress=False).report
    rf = report["recipe_file"]
    assert not rf["within_bound"] and rf["error"] > 1e-6
    assert rf["not_timed"] and "tuned_vs_file" not in rf and not rf["shipped"]
    assert not any(timed), "the file past the bound was timed"
    assert "past the bound, so it was not timed" in (tmp_path / "r" / "report.md").read_text()


def test_a_missing_recipe_file_is_made_again_on_resume(residual, tmp_path):
    """A run whose kept file is gone (a resumed run in a cleaned folder) makes it again the
    same way before measuring it."""
    out = tmp_path / "r"
    first = _tune(residual, out, file_fastest)
    path = out / first["recipe_file"]["file"]
    kept = path.read_bytes()
    path.unlink()
    (out / "report.json").unlink()  # not finished as far as this folder knows
    again = tune(str(residual), out, benchmark=CallableBackend(file_fastest, deterministic=True),
                 runtime="onnxruntime", config=Config(schemes_per_region=3, refine_rounds=0),
                 progress=False, remeasure=True).report
    assert path.read_bytes() == kept
    assert again["recipe_file"]["shipped"]


def _recipe(residual, tmp_path) -> onnx.ModelProto:
    return onnx.load(str(ort_runtime.ort_recipe_model(str(residual), tmp_path)))


def test_what_differs_is_nothing_for_the_same_file(residual, tmp_path):
    recipe = _recipe(residual, tmp_path)
    assert qdq_params(recipe)
    assert qdq_differences(recipe, recipe) == []


def test_what_differs_reads_models_with_constant_nodes(residual, tmp_path):
    """Paddle exports hold their weights in Constant nodes, which read no input (a real PP-OCR
    classifier's run under OpenVINO's rules once ended in an IndexError here)."""
    recipe = _recipe(residual, tmp_path)
    with_constant = onnx.ModelProto()
    with_constant.CopyFrom(recipe)
    q = next(n for n in with_constant.graph.node if n.op_type == "QuantizeLinear")
    inits = {t.name: t for t in with_constant.graph.initializer}
    scale = inits[q.input[1]]
    with_constant.graph.initializer.remove(scale)
    with_constant.graph.node.insert(0, onnx.helper.make_node(
        "Constant", [], [scale.name], value=scale))
    assert qdq_params(with_constant) == qdq_params(recipe)
    assert qdq_differences(with_constant, recipe) == []


def test_what_differs_names_a_changed_scale_and_zero_point(residual, tmp_path):
    recipe = _recipe(residual, tmp_path)
    changed = onnx.ModelProto()
    changed.CopyFrom(recipe)
    q = next(n for n in changed.graph.node if n.op_type == "QuantizeLinear")
    inits = {t.name: t for t in changed.graph.initializer}
    scale = numpy_helper.to_array(inits[q.input[1]]) * np.float32(2)
    inits[q.input[1]].CopyFrom(numpy_helper.from_array(scale, q.input[1]))
    zp = numpy_helper.to_array(inits[q.input[2]])
    inits[q.input[2]].CopyFrom(numpy_helper.from_array((zp + 1).astype(zp.dtype), q.input[2]))
    found = qdq_differences(changed, recipe)
    tensor = starts._QDQIndex.of(recipe).source(q.input[0])
    assert any(line.startswith("1 other scale") and tensor in line for line in found)
    assert any(line.startswith("1 other zero point") and tensor in line for line in found)


def test_what_differs_names_a_tensor_quantized_in_one_model_only(residual, tmp_path):
    recipe = _recipe(residual, tmp_path)
    pairs = starts.quantized_reads(recipe)
    assert pairs
    stripped = onnx.ModelProto()
    stripped.CopyFrom(recipe)
    g = stripped.graph
    q = next(n for n in g.node if n.op_type == "QuantizeLinear"
             and n.input[0] not in {t.name for t in g.initializer})
    dqs = [n for n in g.node if n.op_type == "DequantizeLinear" and n.input[0] == q.output[0]]
    for dq in dqs:  # readers read the float tensor again
        for n in g.node:
            for i, t in enumerate(n.input):
                if t == dq.output[0]:
                    n.input[i] = q.input[0]
        g.node.remove(dq)
    g.node.remove(q)
    found = qdq_differences(stripped, recipe)
    tensor = starts._QDQIndex.of(recipe).source(q.input[0])
    assert any("quantized only in the recipe's file" in line and tensor in line
               for line in found)


@pytest.mark.skipif(importlib.util.find_spec("nncf") is None, reason="nncf not installed")
def test_nncf_file_kept_as_written(residual, tmp_path):
    """NNCF's own file, kept: byte-identical to what nncf.quantize writes for the same model
    and data (and so its Q/DQ tensors)."""
    pm = starts_pm(residual)
    path = tmp_path / "recipe_openvino.onnx"
    ov_runtime.nncf_recipe_start(pm, str(residual), keep=path.write_bytes)
    written = ov_runtime.nncf_recipe_model(str(residual)).SerializeToString()
    assert path.read_bytes() == written
    assert qdq_params(path.read_bytes()) == qdq_params(written)


def starts_pm(model: Path):
    from qdq_optuna.runtimes.prepared import PreparedModel

    return PreparedModel.prepare(str(model), runtime="openvino")


def test_a_recipe_file_the_runtime_cannot_run_is_reported_and_never_ships(residual, tmp_path):
    """A recipe file the runtime fails on (NNCF's transformer file on PP-OCRv4's recognizer
    under OpenVINO's bf16 hint does not compile) is one entry with its failure; the run
    concludes and ships its own model."""
    from onnx import TensorProto, helper

    out = tmp_path / "r"
    out.mkdir()
    broken = helper.make_model(helper.make_graph(
        [helper.make_node("NoSuchKernel", ["input"], ["output"], domain="no.such.domain")], "g",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, 3, 8, 8])]),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("no.such.domain", 1)])
    (out / "recipe_onnxruntime_dynamic.onnx").write_bytes(broken.SerializeToString())
    report = _tune(residual, out, file_slowest)
    entry = {f["name"]: f for f in report["recipe_files"]}["onnxruntime_dynamic"]
    assert entry["failure"] and not entry["shipped"]
    assert report["accuracy"]["shipped"] != "the recipe's own file"
    assert onnx.load(str(out / "optimized.onnx")).graph.node[0].op_type != "NoSuchKernel"
