"""The limit sees every op the runtime has an integer kernel for: MaxPool, Concat, Add, ... are
timed alone as their integer kernel against their float one (real ONNX Runtime sessions), each
signature once, within a time budget, and the limit names them."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from qdq_optuna.backends.onnxruntime import OnnxRuntimeBackend
from qdq_optuna.measure import kernels as K
from qdq_optuna.measure.timing import Measurer
from qdq_optuna.outputs.limit import limit_lines
from qdq_optuna.runtimes.onnxruntime import PROFILE
from qdq_optuna.search._limit import estimate

QUICK = K.KERNEL_PROTOCOL.with_(min_rounds=3, max_rounds=4, runs=10)
SHAPE = [1, 64, 56, 56]
POOLED = [1, 64, 28, 28]


def _pools(qdq_pool: bool = False) -> onnx.ModelProto:
    """Two MaxPools of one signature, their Concat and their Add, and a Mul by a constant
    (no op unit: its integer form needs the constant quantized too). ``qdq_pool``: the first
    MaxPool read through Q -> DQ and its output quantized (set up as an integer kernel)."""
    inits = [numpy_helper.from_array(np.full([1, 64, 1, 1], 0.5, np.float32), "half"),
             numpy_helper.from_array(np.array(0.05, np.float32), "s"),
             numpy_helper.from_array(np.array(128, np.uint8), "z")]
    pool = {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu")]
    first_in = "r"
    if qdq_pool:
        nodes += [helper.make_node("QuantizeLinear", ["r", "s", "z"], ["rq"]),
                  helper.make_node("DequantizeLinear", ["rq", "s", "z"], ["rd"])]
        first_in = "rd"
    nodes.append(helper.make_node("MaxPool", [first_in], ["p1"], name="pool", **pool))
    first_out = "p1"
    if qdq_pool:
        nodes += [helper.make_node("QuantizeLinear", ["p1", "s", "z"], ["p1q"]),
                  helper.make_node("DequantizeLinear", ["p1q", "s", "z"], ["p1d"])]
        first_out = "p1d"
    nodes += [helper.make_node("MaxPool", ["x"], ["p2"], name="pool2", **pool),
              helper.make_node("Concat", [first_out, "p2"], ["cat"], name="cat", axis=1),
              helper.make_node("Add", [first_out, "p2"], ["sum"], name="add"),
              helper.make_node("Mul", ["sum", "half"], ["out"], name="scale")]
    graph = helper.make_graph(
        nodes, "pools", [helper.make_tensor_value_info("x", TensorProto.FLOAT, SHAPE)],
        [helper.make_tensor_value_info("cat", TensorProto.FLOAT, [1, 128, 28, 28]),
         helper.make_tensor_value_info("out", TensorProto.FLOAT, POOLED)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    return K.with_shapes(model)


def _table(cache=None) -> K.KernelTable:
    flt = _pools()
    return PROFILE.kernel_timing(OnnxRuntimeBackend())(flt, flt, cache=cache, protocol=QUICK)


def test_every_pool_concat_and_add_is_timed_once_per_signature(tmp_path):
    """No Q/DQ anywhere: the op units are timed whatever the placement; the two MaxPools share
    a signature (one timing), the Mul by a constant is no op unit; the NHWC uint8 MaxPool
    ONNX Runtime runs between integer kernels is several times faster than its float one; a
    second table reads every signature from the cache."""
    cache = K.KernelCache(tmp_path / "kernels.json")
    table = _table(cache)
    assert set(table.timings) == {"pool", "pool2", "cat", "add"}
    assert table.timings["pool"] is table.timings["pool2"]
    assert table.op_units["timed"] == 3 and table.op_units["left"] == 0
    assert {"MaxPool", "Concat", "Add", "Conv"} <= table.ops
    pool = table.timings["pool"]
    # the NHWC kernel, not the NCHW uint8 one (several times slower than float): integer
    # wins; by how much depends on the CPU (about 5x on an AVX512-VNNI Xeon)
    assert pool.decision is K.KernelDecision.INTEGER and pool.float_ms > pool.int_ms, pool
    again = _table(K.KernelCache(tmp_path / "kernels.json"))
    assert again.op_units["timed"] == 0 and again.op_units["cached"] == 3
    assert {n: t.to_dict() for n, t in again.timings.items()} == {
        n: t.to_dict() for n, t in table.timings.items()}
    assert table.to_dict()["op_units"]["timed"] == 3


def test_no_new_signature_is_timed_past_the_budget():
    flt = _pools()
    table = K.KernelTable({}, [])
    measurer = Measurer(OnnxRuntimeBackend(), QUICK)
    K.time_op_units(table, measurer, flt, PROFILE.op_units, budget_s=0.0)
    assert table.timings == {} and table.op_units["left"] == 4
    assert measurer.loads == 0


def test_the_limit_names_the_pools_the_placement_left_float():
    """Placed float (no Q/DQ), the MaxPools lose their integer kernel's time: the gap by op
    names MaxPool; the placement that sets the first one up as an integer kernel is read as
    such (units of the table's op types), and its gap is smaller by that node's."""
    table = _table()
    float_ms = sum(t.float_ms for t in table.timings.values()) + 1.0
    placed_float = estimate(table, float_ms, set(), {})
    assert placed_float.by_op()["MaxPool"] > 0
    assert placed_float.to_dict()["timed_by_op"] == {"Add": 1, "Concat": 1, "MaxPool": 2}
    r = {"limit": placed_float.to_dict(), "baseline_latency_ms": float_ms,
         "final_latency_ms": float_ms}
    text = "\n".join(limit_lines(r))
    assert "4 nodes at their faster measured kernel: 1 Add, 1 Concat, 2 MaxPool" in text
    assert "| op MaxPool |" in text
    integer = {u.node for u in K.units(_pools(qdq_pool=True), True, table.ops)}
    assert integer == {"pool"}
    placed = estimate(table, float_ms, integer, {})
    pool = table.timings["pool"]
    assert placed.placed_ms == pytest.approx(placed_float.placed_ms
                                             - (pool.float_ms - pool.int_ms))


def test_additions_the_kernel_table_says_gain_go_first():
    """A point next to an integer-faster kernel (an integer MaxPool, say) placed float: the
    move that switches it on is proposed before every other move; without the table's gains
    a single-point addition is not first."""
    from qdq_optuna.samplers.qdq_mutation import Visit, VisitSpec

    standing = {"a": 0, "b": 0, "c": 0}
    spec = VisitSpec(standing=standing, add_gains={"b": 0.3, "c": 0.1})
    assert VisitSpec.from_attr(spec.to_attr()) == spec
    moves = Visit(spec, ["a", "b", "c"]).all_moves()
    assert [set(m.on) for m in moves[:2]] == [{"b"}, {"c"}] and not moves[0].off
    plain = Visit({"standing": standing}, ["a", "b", "c"]).all_moves()
    assert set(plain[0].on) != {"b"}
