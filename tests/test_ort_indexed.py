"""ONNX Runtime's recipe with its name lookups indexed writes the same file, faster."""

from __future__ import annotations

import onnxruntime
import pytest

from qdq_optuna.examples import zoo
from qdq_optuna.runtimes import _ort_indexed
from qdq_optuna.runtimes import onnxruntime as ort_runtime

CHECKED_VERSION = "1.32."


def _recipe_bytes(model, work, monkeypatch, indexed: bool) -> tuple[bytes, bool]:
    used = []
    real = _ort_indexed.indexed_lookups

    def spy(node_count, min_nodes=None):
        context = real(node_count, 0 if indexed else 10**9)
        used.append(context)
        return context

    monkeypatch.setattr(_ort_indexed, "indexed_lookups", spy)
    work.mkdir()
    path = ort_runtime.ort_recipe_model(model, work)
    applied = _ort_indexed.applies() and indexed
    return path.read_bytes(), applied and bool(used)


MODELS = {
    "resnet": lambda: zoo.small("resnet"),
    "mobilenet": lambda: zoo.small("mobilenet"),
    "yolo": lambda: zoo.small("yolo"),
    "transformer": lambda: zoo.small("transformer"),
    "vit": lambda: zoo.vit_like(layers=2),
    "decoder": lambda: zoo.transformer_like(layers=24, hidden=64, heads=4, ffn=256, seq=64),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_indexed_recipe_is_the_tools_own_file(name, tmp_path, monkeypatch):
    """Convolutions with biases, depthwise, Concat groups sharing scales, attention (MatMuls of
    two activations, Softmax), a 795-node decoder: each file byte for byte what the unindexed
    tool writes."""
    model = MODELS[name]()
    plain, _ = _recipe_bytes(model, tmp_path / "plain", monkeypatch, indexed=False)
    fast, applied = _recipe_bytes(model, tmp_path / "fast", monkeypatch, indexed=True)
    if onnxruntime.__version__.startswith(CHECKED_VERSION):
        assert applied, "the indexes no longer apply to the ONNX Runtime they were checked on"
    elif not applied:
        pytest.skip(f"onnxruntime {onnxruntime.__version__}: its own quantizer runs unindexed")
    assert fast == plain


def test_helpers_are_restored_and_small_graphs_run_the_tools_own_code():
    from onnxruntime.quantization import onnx_model, qdq_quantizer, quant_utils

    before = (onnx_model.ONNXModel.replace_input_of_all_nodes, quant_utils.find_by_name,
              qdq_quantizer.find_by_name, onnx_model.ONNXModel.__dict__["replace_node_input"])
    with _ort_indexed.indexed_lookups(10, min_nodes=1000) as on:
        assert not on and onnx_model.ONNXModel.replace_input_of_all_nodes is before[0]
    if not _ort_indexed.applies():
        pytest.skip(f"onnxruntime {onnxruntime.__version__}: not the checked quantizer")
    with _ort_indexed.indexed_lookups(5000) as on:
        assert on and quant_utils.find_by_name is not before[1]
        assert qdq_quantizer.find_by_name is quant_utils.find_by_name
    after = (onnx_model.ONNXModel.replace_input_of_all_nodes, quant_utils.find_by_name,
             qdq_quantizer.find_by_name, onnx_model.ONNXModel.__dict__["replace_node_input"])
    assert after == before
