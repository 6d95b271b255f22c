"""Tests of the analytical TensorRT-like cost model (no GPU needed)."""

from __future__ import annotations

import onnx
import pytest
from onnx import TensorProto, helper

from qdq_optuna.backends.base import BackendError
from qdq_optuna.backends.costmodel import CostModelBackend, GpuSpec, estimate
from qdq_optuna.examples.costmodel_cases import (
    BLOCK_CONVS,
    Builder,
    big_conv,
    big_residual_chain,
    concat_model,
    matmul_chain,
    placeholder,
    residual_block,
    resnet18_like,
    resnet_variants,
    with_qdq,
)

FP32 = TensorProto.FLOAT


def _ms(model: onnx.ModelProto, **kw) -> float:
    return estimate(model, **kw).total_ms


# ------------------------------------------------------------------------------------------
# tests


def test_deterministic_across_calls_and_backends():
    model = with_qdq(residual_block(), edges=(("conv1", 0), ("conv2", 0)), weights=BLOCK_CONVS)
    data = model.SerializeToString()
    first, second = CostModelBackend(), CostModelBackend()
    a = first.load(data).time(5, 10)
    b = second.load(data).time(0, 10)
    assert a == b and len(set(a)) == 1
    assert first.estimate(model) == second.estimate(data)


def test_time_returns_iterations_copies_of_one_figure():
    runner = CostModelBackend().load(residual_block().SerializeToString())
    three = runner.time(0, 3)
    assert len(three) == 3 and len(set(three)) == 1 and three[0] > 0
    assert runner.time(2, 0) == three[:1]  # at least one figure, never an empty list


def test_backend_metadata():
    backend = CostModelBackend(device=GpuSpec(launch_us=2.0), input_shapes={"x": (1, 3, 8, 8)})
    assert backend.name == "costmodel" and backend.deterministic
    info = backend.describe()
    assert info["device"]["launch_us"] == 2.0 and info["input_shapes"] == {"x": [1, 3, 8, 8]}


def test_breakdown_sums_to_total_and_baseline_is_fp16():
    bd = estimate(residual_block())
    assert bd.total_ms == sum(n.ms for n in bd.nodes)
    assert {n.precision for n in bd.nodes} == {"fp16"}
    # Relu and the residual Add ride in the conv epilogues
    assert {n.name: n.kind for n in bd.nodes} == {
        "stem": "compute", "stem_relu": "fused", "conv1": "compute", "relu1": "fused",
        "conv2": "compute", "add": "fused", "relu2": "fused",
    }  # fmt: skip


def test_good_placement_beats_baseline_and_runs_int8():
    base = residual_block()
    good = with_qdq(base, tensors=("stem_relu", "relu1"), weights=BLOCK_CONVS[1:])
    bd = estimate(good)
    assert bd.total_ms < estimate(base).total_ms
    assert bd.node("conv1").precision == bd.node("conv2").precision == "int8"
    assert bd.node("add").kind == "fused"
    # every Q fuses into a producer epilogue, every DQ into its INT8 consumer
    assert {n.kind for n in bd.nodes if "Q" in n.name} == {"qdq"}


@pytest.mark.parametrize("style", ["qdq", "dq"])
def test_conv_input_only_placement_runs_int8(style):
    base = residual_block()
    model = with_qdq(
        base, edges=(("conv1", 0), ("conv2", 0)), weights=("conv1", "conv2"), weight_style=style
    )
    bd = estimate(model)
    assert bd.node("conv1").precision == "int8" and bd.node("conv2").precision == "int8"
    assert bd.node("stem").precision == "fp16"
    assert bd.total_ms < estimate(base).total_ms
    # the Q on conv1's input also has a float consumer (the residual Add): stand-alone reformat
    assert [n.kind for n in bd.nodes if n.op == "QuantizeLinear" and "stem" in n.name] == [
        "reformat"
    ]


def test_weight_styles_agree():
    base = residual_block()
    edges = (("conv1", 0), ("conv2", 0))
    a = with_qdq(base, edges=edges, weights=("conv1", "conv2"), weight_style="qdq")
    b = with_qdq(base, edges=edges, weights=("conv1", "conv2"), weight_style="dq")
    assert _ms(a) == pytest.approx(_ms(b))


def test_unquantized_weight_keeps_conv_fp16():
    model = with_qdq(residual_block(), edges=(("conv1", 0),))
    bd = estimate(model)
    assert bd.node("conv1").precision == "fp16"
    assert [n.kind for n in bd.nodes if n.op == "DequantizeLinear"] == ["reformat"]


def test_qdq_between_conv_and_residual_add_breaks_fusion():
    base = residual_block()
    good = with_qdq(base, tensors=("stem_relu", "relu1"), weights=BLOCK_CONVS[1:])
    broken = with_qdq(base, tensors=("stem_relu", "relu1", "conv2"), weights=BLOCK_CONVS[1:])
    good_bd, broken_bd = estimate(good), estimate(broken)
    assert good_bd.node("add").kind == "fused"
    assert broken_bd.node("add").kind == "memory"
    assert broken_bd.kernels > good_bd.kernels
    assert broken_bd.total_ms > good_bd.total_ms


def test_partial_concat_is_slower_than_all_or_nothing():
    base = concat_model()
    out = {"tensors": ("cat",), "weights": ("fuse",)}
    none = _ms(base)
    partial = with_qdq(base, edges=(("cat", 0),), **out)
    full = with_qdq(base, edges=(("cat", 0), ("cat", 1)), **out)
    full_bd, partial_bd = estimate(full), estimate(partial)
    assert partial_bd.total_ms > none > full_bd.total_ms
    assert full_bd.node("cat") == ("cat", "Concat", "int8", "fused", 0.0)
    assert partial_bd.node("cat")[2:4] == ("fp16", "memory")
    assert "reformat" in {n.kind for n in partial_bd.nodes if n.op == "DequantizeLinear"}


def test_all_quantized_concat_feeds_int8_conv_without_output_qdq():
    # Concat keeps its inputs' scale, so the INT8 conv can read it directly
    model = with_qdq(concat_model(), edges=(("cat", 0), ("cat", 1)), weights=("fuse",))
    bd = estimate(model)
    assert bd.node("cat").kind == "fused" and bd.node("fuse").precision == "int8"
    assert {n.kind for n in bd.nodes if n.op in ("QuantizeLinear", "DequantizeLinear")} == {"qdq"}


def test_dq_moves_past_transpose_into_int8_matmul():
    b = Builder()
    x = b.input("x", [1, 256, 512])
    t = b.node("Transpose", [b.node("Relu", [b.matmul(x, 512, 512, "mm1")], "act")], "tr",
               perm=[0, 2, 1])  # fmt: skip
    model = with_qdq(b.model([b.matmul(t, 256, 256, "mm2")]), tensors=("act",), weights=("mm2",))
    bd = estimate(model)
    assert bd.node("mm2").precision == "int8"
    assert bd.node("tr")[2:4] == ("int8", "memory")


def test_q_moves_back_over_maxpool():
    b = Builder()
    x = b.input("x", [1, 64, 112, 112])
    c = b.node("Relu", [b.conv(x, 64, 64, 3, "c1")], "relu")
    p = b.node("MaxPool", [c], "pool", kernel_shape=[2, 2], strides=[2, 2])
    base = b.model([b.conv(p, 64, 64, 3, "c2")])
    bd = estimate(with_qdq(base, tensors=("pool",), weights=("c2",)))
    assert bd.node("pool")[2:4] == ("int8", "memory")
    assert {n.kind for n in bd.nodes if n.op == "QuantizeLinear"} == {"qdq"}
    assert bd.node("pool").ms < estimate(base).node("pool").ms


@pytest.mark.parametrize("norm", ["Softmax", "LayerNormalization"])
def test_qdq_around_fp16_only_ops_is_slower(norm):
    base = matmul_chain(norm=norm)
    model = with_qdq(base, edges=(("norm", 0),), tensors=("norm",))
    bd = estimate(model)
    assert bd.total_ms > _ms(base)
    assert bd.node("norm").precision == "fp16"
    assert [n.kind for n in bd.nodes if n.op == "DequantizeLinear"] == ["reformat", "reformat"]


def test_matmul_chain_int8_when_both_sides_quantized():
    base = matmul_chain(norm="Relu")
    model = with_qdq(base, tensors=("x", "norm"), weights=("mm1", "mm2"))
    bd = estimate(model)
    assert bd.node("mm1").precision == bd.node("mm2").precision == "int8"
    assert bd.total_ms < _ms(base)


@pytest.mark.parametrize(("seq", "hidden", "pays"), [(8, 64, False), (1024, 1024, True)])
def test_int8_pays_only_when_compute_dominates(seq, hidden, pays):
    # the LayerNorm output cannot be written as INT8, so the Q is a stand-alone reformat that
    # only a big enough MatMul earns back
    base = matmul_chain(seq=seq, hidden=hidden, norm="LayerNormalization")
    model = with_qdq(base, edges=(("mm2", 0),), weights=("mm2",))
    bd = estimate(model)
    assert bd.node("mm2").precision == "int8"
    assert (bd.total_ms < _ms(base)) == pays


def test_resnet_orderings():
    ms = {k: _ms(m) for k, m in resnet_variants().items()}
    speedup = ms["baseline"] / ms["conv_inputs_weights"]
    assert 1.5 <= speedup <= 2.5, ms
    assert ms["conv_inputs_weights"] < ms["naive_conv_inputs"] < 0.9 * ms["baseline"], ms
    assert ms["conv_inputs_outputs"] < ms["baseline"], ms
    assert ms["memory_ops_only"] > ms["baseline"], ms


def test_depthwise_conv_is_memory_bound():
    b = Builder()
    x = b.input("x", [1, 256, 56, 56])
    b.inits.append(placeholder("dw.w", [256, 1, 3, 3]))
    y = b.node("Conv", [x, "dw.w"], "dw", group=256, kernel_shape=[3, 3], pads=[1] * 4)
    spec = GpuSpec()
    ms = estimate(b.model([y]), device=spec).total_ms
    nbytes = 2 * (256 * 56 * 56 * 2) + 256 * 9 * 2
    assert ms == pytest.approx(nbytes / (spec.bandwidth_gbs * 1e9) * 1e3 + spec.launch_us * 1e-3)


def test_silu_fuses_into_conv():
    b = Builder()
    x = b.input("x", [1, 64, 28, 28])
    c = b.conv(x, 64, 64, 3, "conv")
    s = b.node("Sigmoid", [c], "sig")
    y = b.node("Mul", [c, s], "silu")
    bd = estimate(b.model([y]))
    assert bd.node("sig").kind == bd.node("silu").kind == "fused" and bd.kernels == 1


def test_symbolic_batch_needs_input_shapes():
    b = Builder()
    x = b.input("x", ["N", 64, 28, 28])
    model = b.model([b.node("Relu", [b.conv(x, 64, 64, 3, "conv")], "relu")])
    with pytest.raises(BackendError, match="'x'.*'N'"):
        estimate(model)
    fixed = CostModelBackend(input_shapes={"x": (2, 64, 28, 28)}).estimate(model)
    single = CostModelBackend(input_shapes={"x": (1, 64, 28, 28)}).estimate(model)
    assert fixed.total_ms > single.total_ms
    with pytest.raises(BackendError, match="'y'"):
        CostModelBackend(input_shapes={"y": (1,)}).estimate(model)
    with pytest.raises(BackendError, match="positive"):
        CostModelBackend(input_shapes={"x": (-1, 64, 28, 28)}).estimate(model)
    with pytest.raises(BackendError, match="rank"):
        CostModelBackend(input_shapes={"x": (1, 64)}).estimate(model)


def test_unknown_op_shape_is_named():
    b = Builder()
    x = b.input("x", [1, 8])
    b.nodes.append(helper.make_node("Mystery", [x], ["m"], name="mystery", domain="custom"))
    model = b.model([b.node("Relu", ["m"], "relu")])
    model.opset_import.append(helper.make_opsetid("custom", 1))
    with pytest.raises(BackendError, match="'m'"):
        estimate(model)


@pytest.mark.parametrize("data", [b"not a model", b""])
def test_bad_model_bytes(data):
    with pytest.raises(BackendError):
        CostModelBackend().load(data)


def test_bad_models(tmp_path):
    with pytest.raises(BackendError, match="cannot read"):
        CostModelBackend().load(tmp_path / "missing.onnx")
    b = Builder()
    x = b.input("x", [1, 8, 4, 4])
    b.inits.append(placeholder("w", [8, 3, 3, 3]))  # channel mismatch
    bad = b.model([b.node("Conv", [x, "w"], "conv")])
    with pytest.raises(BackendError, match="'conv'.*'w'"):
        CostModelBackend().load(bad.SerializeToString())
    unsorted = residual_block()
    nodes = list(unsorted.graph.node)
    del unsorted.graph.node[:]
    unsorted.graph.node.extend(reversed(nodes))
    with pytest.raises(BackendError, match="topologically"):
        estimate(unsorted)


def test_loads_path_without_external_data(tmp_path):
    path = tmp_path / "block.onnx"
    path.write_bytes(residual_block().SerializeToString())  # weights.bin does not exist
    assert CostModelBackend().load(path).time(0, 1) == [_ms(residual_block())]
    assert CostModelBackend().load(str(path)).time(0, 1) == [_ms(residual_block())]


def test_estimates_small_and_large_models():
    """A 60-node and a 5000-node model are both priced (their speed is measured by
    ``benchmarks/estimate_and_drawing_speed.py``, not here: a timed test fails on a busy
    machine)."""
    small = resnet_variants()["conv_inputs_weights"]
    assert len(small.graph.node) > 60
    assert 0 < estimate(small).total_ms == estimate(small).total_ms
    big = big_residual_chain(1250)
    assert len(big.graph.node) == 5000
    assert estimate(big).total_ms > 100 * estimate(small).total_ms / len(small.graph.node)


# ------------------------------------------------------------------------------------------
# precision: float tensors are priced at their own type (strongly typed engines)


def test_fp32_model_runs_fp32_and_slower_than_fp16():
    fp16, fp32 = estimate(residual_block()), estimate(residual_block(float_type=FP32))
    assert {n.precision for n in fp32.nodes} == {"fp32"}
    assert {n.precision for n in fp16.nodes} == {"fp16"}
    # compute at the TF32 rate (half FP16) and twice the bytes
    assert 1.5 < fp32.total_ms / fp16.total_ms <= 2.0
    ms16, ms32 = _ms(resnet18_like()), _ms(resnet18_like(float_type=FP32))
    assert 1.5 < ms32 / ms16 <= 2.0


def test_int8_conv_gains_at_most_2x_over_fp16():
    """A compute-bound Conv: INT8 tensor cores do 2x FP16 at best; against FP32 (TF32) the
    gain would look like 4x, which is why the baseline must be the deployed precision."""
    int8 = estimate(big_conv(True)).node("conv")
    fp16 = estimate(big_conv(False)).node("conv")
    fp32 = estimate(big_conv(False, float_type=FP32)).node("conv")
    assert int8.precision == "int8" and fp16.precision == "fp16" and fp32.precision == "fp32"
    assert 1.5 <= fp16.ms / int8.ms <= 2.0
    assert 3.0 <= fp32.ms / int8.ms <= 4.0


def test_int8_conv_fuses_the_add_only_with_an_int8_residual():
    base = residual_block()
    # shared Q/DQ on the stem output: the residual reaches the Add through the DQ
    shared = estimate(with_qdq(base, tensors=("stem_relu", "relu1"), weights=BLOCK_CONVS[1:]))
    assert shared.node("conv2").precision == "int8" and shared.node("add").kind == "fused"
    # per-edge Q/DQ on the conv inputs only: the residual stays FP16, TensorRT cannot fuse it
    # into the INT8 conv2, the Add is a kernel of its own
    edges = estimate(with_qdq(base, edges=(("conv1", 0), ("conv2", 0)), weights=BLOCK_CONVS[1:]))
    assert edges.node("conv2").precision == "int8" and edges.node("add").kind == "memory"
    # an FP16 conv2 fuses an FP16 residual as before
    assert estimate(base).node("add").kind == "fused"


def test_graph_input_cast_fuses_with_its_q():
    """keep_io_types models start with a Cast of the FP32 input: with a Q after it, the two
    are one kernel that writes INT8 (no stand-alone Q)."""
    from qdq_optuna.examples import zoo
    from qdq_optuna.model.graph import Graph
    from qdq_optuna.model.precision import convert_precision
    from qdq_optuna.placement.export import QDQExporter
    from qdq_optuna.runtimes.tensorrt import TENSORRT

    hp = convert_precision(zoo.build("resnet", "small"), "fp16")
    graph = Graph.from_model(hp.model)
    from qdq_optuna.placement.export import upgrade_for

    graph = upgrade_for(graph, ["int8"])
    exporter = QDQExporter(graph, TENSORRT, "int8", high_precision=hp)
    cast = graph.nodes[0]
    assert cast.op_type == "Cast"
    plan = exporter.plan(set(graph.uses(cast.output[0])))
    bd = estimate(exporter.to_bytes(plan))
    q = next(n for n in bd.nodes if n.op == "QuantizeLinear")
    assert q.kind == "qdq" and q.ms == 0.0
    assert bd.node(cast.name).kind == "memory"


def test_resnet_downsampling_shortcut_is_offered_and_pays():
    """The TensorRT rules offer Q/DQ on the shortcut Conv's output of a downsampling block
    (never on the main path's); with it the main path's INT8 Conv takes the Add, and the best
    placement a climb finds on the cost model is faster than the best without it."""
    from qdq_optuna import PreparedModel
    from qdq_optuna.examples import zoo
    from qdq_optuna.placement.rules import residual_conv

    pm = PreparedModel.prepare(zoo.resnet_like(image=64, width=32, blocks=(1, 1, 1, 1),
                                               num_classes=10),
                               runtime="tensorrt", high_precision="fp16")
    g = pm.graph
    pts = {(pp.pattern.id, pid): pp.uses([pid]) for pp in pm.tunable for pid in pp.ids}
    offered = {u for uses in pts.values() for u in uses}
    adds = [i for i, n in enumerate(g.nodes) if n.op_type == "Add" and residual_conv(g, i) is not None]
    assert len(adds) == 3  # layer2-4 downsample
    shortcut = set()
    for add in adds:
        slot = residual_conv(g, add)
        main, short = g.nodes[add].input[1 - slot], g.nodes[add].input[slot]
        assert "downsample" in short and "downsample" not in main
        assert (short, add, slot) in offered and (main, add, 1 - slot) not in offered
        shortcut |= {k for k, uses in pts.items() if (short, add, slot) in uses}
    exporter = pm.exporter()

    def ms(scheme) -> float:
        uses = set().union(*(pts[k] for k in scheme)) if scheme else set()
        return estimate(exporter.to_bytes(exporter.plan(uses))).total_ms

    def climb(keys, start) -> float:
        best, best_ms, improved = frozenset(start), ms(start), True
        while improved:  # first improvement, in a fixed order (sets iterate by hash)
            improved = False
            for k in sorted(keys):
                cand = best ^ {k}
                if ms(cand) < best_ms:
                    best, best_ms, improved = cand, ms(cand), True
        return best_ms

    def best(keys) -> float:
        return min(climb(keys, start) for start in (set(), keys))

    without = best(set(pts) - shortcut)
    with_shortcut = best(set(pts))
    assert with_shortcut < 0.99 * without
