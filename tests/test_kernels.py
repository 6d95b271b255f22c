"""kernels: what ONNX Runtime's CPU build runs for a model, counted from its optimized graph."""

from __future__ import annotations

import pytest

from qdq_optuna.backends import onnxruntime_kernels as kernels
from qdq_optuna.backends.onnxruntime_kernels import Kernels
from qdq_optuna.examples import zoo
from qdq_optuna.measure.recipe_parity import RecipeParity


def test_a_float_model_runs_float_kernels_only():
    k = kernels.kernels_of(zoo.build("resnet", "small"))
    assert k.integer == 0 and k.qdq == 0 and k.constant_dq == 0
    assert k.float_kernels >= 12  # one per Conv at least (fused with its Relu or not)


def test_nodes_reading_a_dequantized_tensor_count_as_float(tmp_path):
    """ONNX Runtime leaves the tensors its fusions create untyped: a LayerNormalization that
    reads a DequantizeLinear's output is still a float kernel."""
    from qdq_optuna.runtimes import onnxruntime as ort_runtime

    model = zoo.build("transformer", "small")
    recipe = ort_runtime.ort_recipe_model(model, tmp_path)
    k = kernels.kernels_of(recipe)
    graph = kernels.optimized_graph(recipe).graph
    typed = {vi.name for vi in graph.value_info}
    norms = [n for n in graph.node if n.op_type == "LayerNormalization"]
    assert any(n.input[0] not in typed for n in norms)  # the case this guards
    assert k.float_ops["LayerNormalization"] == len(norms) == 5
    assert k.ops["QLinearMatMul"] == 12 and k.integer >= 30


def _k(**ops) -> Kernels:
    floats = {op.removeprefix("f_"): n for op, n in ops.items() if op.startswith("f_")}
    return Kernels({op.removeprefix("f_"): n for op, n in ops.items()}, floats)


@pytest.mark.parametrize("ours, verdict", [
    (_k(QLinearConv=3, QuantizeLinear=1, DequantizeLinear=1), "identical"),
    (_k(QLinearConv=3, QuantizeLinear=1), "fewer Q/DQ"),
    (_k(QLinearConv=3, QuantizeLinear=2, DequantizeLinear=1), "more Q/DQ"),
    (_k(QLinearConv=2, f_Conv=1, QuantizeLinear=1, DequantizeLinear=1), "different kernels"),
])
def test_verdicts(ours, verdict):
    recipe = _k(QLinearConv=3, QuantizeLinear=1, DequantizeLinear=1)
    result = RecipeParity(None, ours, recipe)
    assert result.verdict == verdict
    assert result.as_fast == (verdict in ("identical", "fewer Q/DQ"))
    assert all(op.removeprefix("float:") in ours.ops or op.removeprefix("float:") in recipe.ops
               for op in result.diff())
