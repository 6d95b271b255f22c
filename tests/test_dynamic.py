"""Dynamic int8 MatMuls (ONNX Runtime's transformer recipe): ``quantize_dynamic``'s own file
kept in the run folder, measured as written against what would ship, and shipped when that is
slower; no file for a model without a MatMul of constant weights."""

from __future__ import annotations

import onnx
import pytest

from qdq_optuna import tune
from qdq_optuna.backends.callable import CallableBackend
from qdq_optuna.config import Config
from qdq_optuna.examples import zoo
from qdq_optuna.placement import dynamic


def _dynamic(model: onnx.ModelProto) -> bool:
    return any(n.op_type == "DynamicQuantizeLinear" for n in model.graph.node)


def dynamic_fastest(model: onnx.ModelProto) -> float:
    """A model with dynamically quantized MatMuls 1 ms, every other model 2 ms."""
    return 1.0 if _dynamic(model) else 2.0


def dynamic_slowest(model: onnx.ModelProto) -> float:
    return 3.0 if _dynamic(model) else 2.0


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    path = tmp_path_factory.mktemp("encoder") / "encoder.onnx"
    onnx.save(zoo.tiny_attention(), str(path))
    return path


def _tune(model, out, fn) -> dict:
    return tune(str(model), out, benchmark=CallableBackend(fn, deterministic=True),
                runtime="onnxruntime", config=Config(schemes_per_region=3, refine_rounds=0),
                progress=False).report


def test_the_dynamic_recipe_writes_integer_matmuls_for_constant_weights_only():
    model = zoo.tiny_attention()
    weights = dynamic.dynamic_candidates(model)
    # the six linear layers (Q, K, V, output, fc1, fc2); the two activation MatMuls stay float
    assert len(weights) == 6
    written = onnx.load_from_string(dynamic.ort_dynamic_recipe_bytes(model))
    ops = [n.op_type for n in written.graph.node]
    assert ops.count("MatMulInteger") == 6 and ops.count("MatMul") == 2
    assert dynamic.ort_dynamic_recipe_bytes(model) == dynamic.ort_dynamic_recipe_bytes(model)


def test_no_dynamic_file_for_a_model_without_constant_matmul_weights(residual, tmp_path):
    assert dynamic.ort_dynamic_recipe_bytes(str(residual)) is None
    report = _tune(residual, tmp_path / "r", dynamic_fastest)
    assert [f["name"] for f in report["recipe_files"]] == ["onnxruntime"]
    assert not (tmp_path / "r" / "recipe_onnxruntime_dynamic.onnx").exists()


def test_the_dynamic_file_ships_when_what_would_ship_is_slower(encoder, tmp_path):
    report = _tune(encoder, tmp_path / "r", dynamic_fastest)
    static, dyn = report["recipe_files"]
    assert (static["tool"], dyn["tool"]) == ("quantize_static", "quantize_dynamic")
    assert report["recipe_file"] == static
    kept = (tmp_path / "r" / dyn["file"]).read_bytes()
    assert kept == dynamic.ort_dynamic_recipe_bytes(str(encoder))
    assert dyn["shipped"] and dyn["within_bound"] and "reexport_vs_file" not in dyn
    assert dyn["tuned_vs_file"]["verdict"] == "slower"
    assert (tmp_path / "r" / "optimized.onnx").read_bytes() == kept
    assert report["accuracy"]["shipped"] == "the recipe's own file"
    assert report["final_output_error"] == dyn["error"]
    assert "quantize_dynamic's" in (tmp_path / "r" / "report.md").read_text()


def test_the_tuned_model_ships_when_the_dynamic_file_is_slower(encoder, tmp_path):
    report = _tune(encoder, tmp_path / "r", dynamic_slowest)
    dyn = report["recipe_files"][1]
    assert not dyn["shipped"] and dyn["tuned_vs_file"]["verdict"] == "faster"
    assert dyn["against"] == "the tuned model"
    assert not _dynamic(onnx.load(str(tmp_path / "r" / "optimized.onnx")))
