"""Whole-model starts: float, all points, the runtimes' recipes read back, the user's seeds."""

from __future__ import annotations

import collections
import itertools
import json
from pathlib import Path

import onnx
import onnxruntime as ort
import pytest

import qdq_optuna
from qdq_optuna.backends.callable import CallableBackend
from qdq_optuna.backends.costmodel import CostModelBackend
from qdq_optuna.errors import UserError
from qdq_optuna.examples import zoo
from qdq_optuna.model.graph import GRAPH_OUTPUT
from qdq_optuna.placement import starts
from qdq_optuna.placement.rules import residual_conv
from qdq_optuna.placement.seeds import PatternCache
from qdq_optuna.runtimes import onnxruntime as ort_runtime
from qdq_optuna.runtimes import tensorrt as trt_runtime
from qdq_optuna.runtimes.onnxruntime import recipe_parity
from qdq_optuna.runtimes.prepared import PreparedModel


@pytest.mark.parametrize("name", ["resnet", "yolo", "transformer"])
def test_ort_recipe_read_back_runs_the_same_kernels(name: str) -> None:
    """ONNX Runtime's recipe, read back and projected onto our points, exported with its own
    scales: after ONNX Runtime's optimizations both models run the same kernels (graph outputs'
    Q/DQ, Div inputs and the constant operands of Add/Mul included)."""
    model = zoo.build(name, "small")
    pm = PreparedModel.prepare(model, runtime="onnxruntime")
    result = recipe_parity(pm, model)
    start = result.start
    assert start.counts["unmapped"] == 0 and start.counts["mapped"] == start.counts["reads"] > 10
    assert start.counts["not_offered"] == 0 and start.exact  # the points express it use for use
    assert any(n == GRAPH_OUTPUT for _, n, _ in start.uses)  # the output's Q/DQ
    ours, theirs = result.ours, result.recipe
    assert ours.integer > 10 and ours.float_kernels == theirs.float_kernels
    if name == "transformer":
        # the recipe also quantizes LayerNormalization's scale and bias, which no kernel takes
        # in: ten DequantizeLinear of constants run at every inference; ours keeps them float
        assert theirs.constant_dq == 10 and ours.constant_dq == 0
        assert result.diff() == {"DequantizeLinear": (theirs.ops["DequantizeLinear"] - 10,
                                                      theirs.ops["DequantizeLinear"])}
        assert result.verdict == "fewer Q/DQ"
        assert ours.ops["QLinearAdd"] == 15 and ours.ops["QLinearMatMul"] == 12
    else:
        assert result.verdict == "identical", result.diff()


def test_ort_recipe_start_runs_the_tool(tmp_path: Path) -> None:
    model = zoo.build("resnet", "small")
    pm = PreparedModel.prepare(model, runtime="onnxruntime")
    start = ort_runtime.ort_recipe_start(pm, model)
    assert start.name == "recipe:onnxruntime" and start.counts["unmapped"] == 0
    assert ("logits", GRAPH_OUTPUT, 0) in start.uses <= start.scheme_uses  # the logits' Q/DQ
    on = start.on()
    assert sum(map(len, on.values())) > 0
    assert starts.scheme_uses(pm, start.schemes) == set(start.scheme_uses)


def test_float_and_all_on() -> None:
    pm = PreparedModel.prepare(zoo.build("resnet", "small"), runtime="tensorrt")
    f, a = starts.float_start(pm), starts.all_on_start(pm)
    assert not f.uses and f.exact and all(not any(s.values()) for s in f.schemes.values())
    assert a.exact and all(all(s.values()) for s in a.schemes.values())
    assert a.uses == set().union(*(pp.uses(pp.ids) for pp in pm.tunable))
    assert set(a.schemes) == {pp.pattern.id for pp in pm.tunable}


def test_qdq_baseline_round_trip(tmp_path: Path) -> None:
    """A Q/DQ model made from per-pattern schemes is read back to the same schemes."""
    pm = PreparedModel.prepare(zoo.build("yolo", "small"), runtime="tensorrt")
    schemes = {pp.pattern.id: {pid: int(i % 3 == 0) for i, pid in enumerate(pp.ids)}
               for pp in pm.tunable}
    uses = starts.scheme_uses(pm, schemes)
    exporter = pm.exporter()
    path = tmp_path / "baseline.onnx"
    path.write_bytes(exporter.to_bytes(exporter.plan(uses)))
    start = starts.baseline_start(pm, path)
    assert start.counts["unmapped"] == 0
    # the exporter's Concat promotion may add uses: the read-back covers the plan exactly
    assert exporter.plan(start.uses).key == exporter.plan(uses).key
    assert exporter.plan(start.scheme_uses).key == exporter.plan(uses).key


def test_read_placement_matches_renamed_nodes_by_structure(tmp_path: Path) -> None:
    pm = PreparedModel.prepare(zoo.build("resnet", "small"), runtime="tensorrt")
    uses = starts.all_on_start(pm).uses
    exporter = pm.exporter()
    model = onnx.load_from_string(exporter.to_bytes(exporter.plan(uses)))
    for i, node in enumerate(model.graph.node):
        node.name = f"renamed_{i}"
    found, notes, counts = starts.read_placement(pm, model)
    assert counts["unmapped"] == 0 and not notes
    assert exporter.plan(found).key == exporter.plan(uses).key


def test_bad_baseline_is_one_clear_error(tmp_path: Path) -> None:
    pm = PreparedModel.prepare(zoo.tiny_chain(), runtime="tensorrt")
    bad = tmp_path / "garbage.onnx"
    bad.write_bytes(b"not a model")
    with pytest.raises(UserError, match="garbage.onnx"):
        starts.baseline_start(pm, bad)


def test_pattern_cache_start() -> None:
    pm = PreparedModel.prepare(zoo.build("resnet", "small"), runtime="tensorrt")
    pp = pm.tunable[1]
    cache = PatternCache()
    cache.add(pp.pattern.signature, [(pp.ids[:1], 1.0), (pp.ids, 2.0)], minimum_distance=0,
              max_entries=4)
    start = starts.cache_start(pm, cache)
    assert start.on()[pp.pattern.id] == pp.ids[:1]  # the fastest cached scheme
    assert all(not any(s.values()) for p, s in start.schemes.items() if p != pp.pattern.id)
    assert starts.cache_start(pm, PatternCache()) is None


def test_tensorrt_recipe_rules_on_resnet() -> None:
    """Model Optimizer's default INT8 placement on a ResNet: every Conv's input, the shortcut
    input of each residual Add (never the Conv branch), the pooling input; not the GEMV-like
    classifier, never an op's output inside a Conv's kernel."""
    pm = PreparedModel.prepare(zoo.build("resnet", "medium"), runtime="tensorrt")
    g = pm.graph
    start = trt_runtime.tensorrt_recipe_start(pm)
    ops = collections.Counter(g.nodes[n].op_type for _, n, _ in start.uses)
    convs = [i for i, n in enumerate(g.nodes) if n.op_type == "Conv"]
    assert {(g.nodes[i].input[0], i, 0) for i in convs} <= start.uses
    assert ops["Gemm"] == 0 and ops["Relu"] == 0 and ops["BatchNormalization"] == 0
    for t, n, slot in start.uses:
        if g.nodes[n].op_type == "Add":  # the shortcut, never the main path's Conv/BN output
            residual = residual_conv(g, n)  # both inputs from Convs: a downsampling block
            if residual is None:
                assert g.producer_op(t) in ("Relu", "MaxPool")
            else:
                assert slot == residual
    assert ops["GlobalAveragePool"] == 1 and start.exact


def _pattern_alone_best(pm, lat) -> dict[str, float]:
    best = {}
    for pp in pm.tunable:
        best[pp.pattern.id] = min(
            lat(pp.uses([p for p, v in zip(pp.ids, bits) if v]))
            for bits in itertools.product([0, 1], repeat=len(pp.ids)))
    return best


@pytest.fixture(scope="module")
def gated(tmp_path_factory) -> tuple[Path, float]:
    """zoo.gated_pairs on disk, and the speedup of every point on (cost model)."""
    model = zoo.gated_pairs()
    path = tmp_path_factory.mktemp("gated") / "gated.onnx"
    onnx.save(model, str(path))
    # FP16: the high precision tune runs the cost model with by default
    pm = PreparedModel.prepare(model, runtime="tensorrt", high_precision="fp16")
    exporter, backend = pm.exporter(), CostModelBackend()

    def lat(uses) -> float:
        return backend.estimate(exporter.to_bytes(exporter.plan(set(uses)))).total_ms

    float_ms = lat(())
    assert len(pm.tunable) >= 2
    # every scheme of any one pattern alone, the others float: no gain at all
    assert all(ms >= float_ms for ms in _pattern_alone_best(pm, lat).values())
    return path, float_ms / lat(starts.all_on_start(pm).uses)


def test_gated_pairs_gain_needs_both_patterns(gated) -> None:
    _, all_on = gated
    assert all_on > 1.05


def test_tune_finds_the_gain_of_two_adjacent_patterns(gated, tmp_path: Path) -> None:
    path, all_on = gated
    result = qdq_optuna.tune(path, tmp_path / "out", benchmark="costmodel", progress=False)
    assert result.speedup >= all_on / 1.02


def test_ort_recipe_runs_on_models_below_opset_13(tmp_path: Path) -> None:
    """Per-channel DequantizeLinear needs opset 13: the recipe upgrades the model first, as
    its user would after ONNX Runtime refused the tool's output."""
    model = zoo.tiny_chain()  # Conv, Relu, GlobalAveragePool, Flatten, Gemm: all in opset 12
    model.opset_import[0].version = 12
    onnx.checker.check_model(model)
    path = ort_runtime.ort_recipe_model(model, tmp_path)
    assert ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    pm = PreparedModel.prepare(model, runtime="onnxruntime")
    assert ort_runtime.ort_recipe_start(pm, model).exact


@pytest.mark.parametrize("name", ["resnet", "transformer"])
def test_ort_recipe_ranges_are_its_own_calibrators(name: str, tmp_path: Path) -> None:
    """The recipe's ranges, computed in one pass and handed to quantize_static as its
    calibration cache, give the same file as its own (quadratic) calibrator on the same
    feeds, byte for byte."""
    import numpy as np
    from onnxruntime.quantization import CalibrationDataReader, quantize_static

    from qdq_optuna.model.calibration import random_calibration_data

    model = zoo.build(name, "small")
    data = random_calibration_data(model, None, samples=3, seed=1)
    ours = onnx.load(str(ort_runtime.ort_recipe_model(model, tmp_path, data=data)))
    # nothing beside the recipe's model but models: the run keeps it as one file
    assert all(f.suffix == ".onnx" for f in tmp_path.iterdir())
    feeds = [{k: v[i:i + 1] for k, v in data.items()} for i in range(3)]
    ranges = ort_runtime.ort_minmax_cache(tmp_path / "preprocessed.onnx", feeds,
                                     tmp_path.parent / f"{name}-ranges.json")
    assert ranges is not None and ranges.is_file()

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.it = iter(feeds)

        def get_next(self):
            return next(self.it, None)

    own = tmp_path / "own.onnx"
    quantize_static(str(tmp_path / "preprocessed.onnx"), str(own), Reader(),
                    **ort_runtime.ort_recipe_options())
    theirs = onnx.load(str(own))
    assert ours.graph.SerializeToString() == theirs.graph.SerializeToString()
    assert np.any([n.op_type == "QuantizeLinear" for n in ours.graph.node])


def test_ort_recipe_failure_is_one_clear_error(tmp_path: Path) -> None:
    import numpy as np

    with pytest.raises(UserError, match="ONNX Runtime's recipe .* failed"):
        ort_runtime.ort_recipe_model(zoo.tiny_chain(), tmp_path,
                                data={"not_an_input": np.zeros((2, 3, 16, 16), np.float32)})


def test_read_scales_names_a_quantized_graph_output_by_its_own_name(tmp_path: Path) -> None:
    """The recipe renames the tensor behind a quantized graph output; its scale is read under
    the output's name, which our exporter's output pair looks up."""
    model = zoo.build("resnet", "small")
    recipe = onnx.load(str(ort_runtime.ort_recipe_model(model, tmp_path)))
    scales = starts.read_scales(recipe)
    (q,) = [n for n in recipe.graph.node if n.op_type == "QuantizeLinear"
            and n.input[0].startswith("logits")]
    assert q.input[0] != "logits" and scales["logits"] == scales[q.input[0]]


def _conv_relu_pool(bn: bool = False, fan_out: bool = False,
                    silu: bool = False) -> onnx.ModelProto:
    """x -> Conv -> [BatchNormalization ->] Relu -> MaxPool -> Conv -> Relu: the stem of a CNN
    (SqueezeNet's, ResNet's). ``fan_out``: the first Conv's output is a graph output too;
    ``silu``: the first activation is ``a * Sigmoid(a)`` (YOLO's, as PyTorch exports it)."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)

    def init(name: str, *dims: int) -> onnx.TensorProto:
        return numpy_helper.from_array(rng.standard_normal(dims).astype(np.float32) * 0.1, name)

    inits = [init("w1", 64, 3, 3, 3), init("b1", 64), init("w2", 64, 64, 3, 3), init("b2", 64)]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], "conv1", pads=[1] * 4)]
    act_in = "c1"
    if bn:
        inits += [numpy_helper.from_array(np.full(64, v, np.float32), n)
                  for n, v in (("g", 1.0), ("beta", 0.0), ("mean", 0.0), ("var", 1.0))]
        nodes.append(helper.make_node("BatchNormalization", ["c1", "g", "beta", "mean", "var"],
                                      ["bn1"], "bn1"))
        act_in = "bn1"
    if silu:
        nodes += [helper.make_node("Sigmoid", [act_in], ["s1"], "sig1"),
                  helper.make_node("Mul", [act_in, "s1"], ["r1"], "relu1")]
    else:
        nodes.append(helper.make_node("Relu", [act_in], ["r1"], "relu1"))
    nodes += [
              helper.make_node("MaxPool", ["r1"], ["p1"], "pool1", kernel_shape=[2, 2],
                               strides=[2, 2]),
              helper.make_node("Conv", ["p1", "w2", "b2"], ["c2"], "conv2", pads=[1] * 4),
              helper.make_node("Relu", ["c2"], ["y"], "relu2")]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64, 56, 56])]
    if fan_out:
        outputs.append(helper.make_tensor_value_info("c1", TensorProto.FLOAT, [1, 64, 112, 112]))
    graph = helper.make_graph(nodes, "stem", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [1, 3, 112, 112])], outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize(("bn", "silu"), [(False, False), (True, False), (True, True)])
def test_tensorrt_every_point_keeps_conv_and_activation_one_kernel(bn: bool, silu: bool) -> None:
    """TensorRT runs Conv(+BN)+Relu as one kernel with the Q after the Relu; a point between
    them made the every-point start slower than float (the activation ran stand-alone)."""
    pm = PreparedModel.prepare(_conv_relu_pool(bn, silu=silu), runtime="tensorrt",
                               high_precision="fp16")
    g, rules = pm.graph, pm.rules
    chain = {"relu1", "bn1", "sig1"}
    inside = [(t, n, s) for t, n, s in starts.all_on_start(pm).uses if g.nodes[n].name in chain]
    assert not inside
    relu = next(i for i, n in enumerate(g.nodes) if n.name == "relu1")
    assert rules.use_reason(g, (g.nodes[relu].input[0], relu, 0)) is not None
    exporter, backend = pm.exporter(), CostModelBackend()

    def breakdown(uses):
        return backend.estimate(exporter.to_bytes(exporter.plan(set(uses))))

    every = breakdown(starts.all_on_start(pm).uses)
    assert every.total_ms <= breakdown(()).total_ms
    # the first Conv reads the quantized graph input: it runs INT8, its Relu in its kernel,
    # and the MaxPool after it moves INT8 data
    assert every.node("conv1").precision == "int8"
    assert every.node("relu1").kind == "fused"
    assert every.node("pool1").precision == "int8"


def test_tensorrt_offers_the_activation_input_where_nothing_fuses() -> None:
    """A Conv output that is also a graph output has no fused epilogue: its Relu input stays a
    point (the rule is about fusion, not about Relu)."""
    pm = PreparedModel.prepare(_conv_relu_pool(fan_out=True), runtime="tensorrt")
    g = pm.graph
    relu = next(i for i, n in enumerate(g.nodes) if n.name == "relu1")
    assert pm.rules.use_reason(g, ("c1", relu, 0)) is None


def test_tensorrt_offers_no_point_between_a_residual_add_and_its_relu() -> None:
    """Conv+Add+Relu is one TensorRT kernel: the Add's output into the Relu is inside it, and
    with every point on each Relu runs in its Conv's kernel (it ran alone)."""
    pm = PreparedModel.prepare(zoo.build("resnet", "small"), runtime="tensorrt",
                               high_precision="fp16")
    g = pm.graph
    relus = [(n.input[0], i, 0) for i, n in enumerate(g.nodes)
             if n.op_type == "Relu" and g.producer_op(n.input[0]) == "Add"]
    assert relus and all("activation chain" in (pm.rules.use_reason(g, u) or "") for u in relus)
    exporter = pm.exporter()
    every = CostModelBackend().estimate(exporter.to_bytes(exporter.plan(
        set(starts.all_on_start(pm).uses))))
    assert all(every.node(g.nodes[i].name).kind == "fused" for _, i, _ in relus)


def _quantized_reads(model: onnx.ModelProto) -> set[tuple[str, str]]:
    """(tensor, reader op) of every activation a DequantizeLinear hands to a reader."""
    producer = {o: n for n in model.graph.node for o in n.output}
    inits = {i.name for i in model.graph.initializer}
    out = set()
    for node in model.graph.node:
        if node.op_type in ("QuantizeLinear", "DequantizeLinear"):
            continue
        for name in node.input:
            dq = producer.get(name)
            q = producer.get(dq.input[0]) if dq is not None and dq.op_type == "DequantizeLinear" \
                else None
            if q is not None and q.op_type == "QuantizeLinear" and q.input[0] not in inits:
                out.add((q.input[0], node.name))
    return out


def test_a_start_its_schemes_cannot_express_is_measured_and_ships_as_placed(tmp_path: Path
                                                                             ) -> None:
    """A placement whose member regions of one pattern differ (a repaired start, a user's
    Q/DQ model) is measured as placed, and the lane descending from it keeps the uses its
    schemes cannot express: projected onto the schemes it lost them and shipped float."""
    path = tmp_path / "resnet.onnx"
    onnx.save(zoo.build("resnet", "small"), str(path))
    pm = PreparedModel.prepare(str(path), runtime="tensorrt")
    pp = next(p for p in pm.tunable if len(p.pattern.regions) > 1 and len(p.ids) > 1)
    every = starts.all_on_start(pm).uses
    one_region = next(u for u in pp.uses(pp.ids[:1]) if all(u not in q.uses(q.ids) for q in
                                                               pm.tunable if q is not pp))
    placed = every - {one_region}
    exporter = pm.exporter()
    baseline = tmp_path / "baseline.onnx"
    baseline.write_bytes(exporter.to_bytes(exporter.plan(placed)))
    start = starts.baseline_start(pm, baseline)
    assert not start.exact and start.pinned  # the projection leaves point 1 off everywhere
    wanted = _quantized_reads(onnx.load(str(baseline)))

    def fast_only_as_placed(model: onnx.ModelProto) -> float:
        reads = _quantized_reads(model)
        return (5.0 if wanted <= reads else 10.0) + 0.01 * len(reads - wanted)

    result = qdq_optuna.tune(path, tmp_path / "out", benchmark=CallableBackend(
        fast_only_as_placed, deterministic=True), runtime="tensorrt", high_precision="fp32",
        qdq_baseline=str(baseline), config=qdq_optuna.Config(schemes_per_region=4),
        progress=False)
    rows = {r["name"]: r for r in result.report["starts"]}
    assert rows["qdq-baseline"]["latency_ms"] == pytest.approx(5.0)
    assert rows["qdq-baseline"]["chosen"]
    shipped = onnx.load(str(result.output_dir / "optimized.onnx"))
    assert _quantized_reads(shipped) == wanted
    assert result.speedup == pytest.approx(2.0)


def test_pinned_uses_are_stored_with_the_agreed_starts() -> None:
    """A resumed run (or a worker) reads a lane's pinned uses back as the first process
    agreed them; runs stored before pinned uses existed read none."""
    from qdq_optuna.record import AgreedStarts

    agreed = AgreedStarts("qdq-baseline", {"": "qdq-baseline"}, [""], 3, {"": {}},
                          pinned={"": [("layer2.0/relu2_out", 29, 0)], "recipe": []})
    attrs = json.loads(json.dumps(agreed.to_attrs()))  # as the storage keeps it
    back = AgreedStarts.from_attrs(attrs)
    assert [tuple(u) for u in back.pinned[""]] == [("layer2.0/relu2_out", 29, 0)]
    del attrs["pinned"]
    assert AgreedStarts.from_attrs(attrs).pinned == {}
    assert "pinned" not in AgreedStarts("float", {"": "float"}, [""]).to_attrs()
