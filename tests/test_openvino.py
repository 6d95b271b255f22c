"""The OpenVINO backend, its runtime rules and NNCF's start, on the real ``openvino`` package
(NNCF's tests skip where ``nncf`` is not installed: it is heavy and only the start needs it)."""

from __future__ import annotations

import collections
import re
from pathlib import Path

import numpy as np
import onnx
import pytest

from qdq_optuna.backends import make_backend, runtime_for_backend
from qdq_optuna.errors import OptionError
from qdq_optuna.examples import zoo
from qdq_optuna.placement import starts
from qdq_optuna.runtimes import openvino as ov_runtime
from qdq_optuna.runtimes import profile_for
from qdq_optuna.runtimes.prepared import PreparedModel

ov = pytest.importorskip("openvino")

from qdq_optuna.backends.openvino import OpenVinoBackend, runtime_layers  # noqa: E402


def _kinds(backend: OpenVinoBackend, model: bytes) -> collections.Counter:
    """(layerType, runtimePrecision) of every computing layer OpenVINO's CPU plugin ran."""
    layers = runtime_layers(backend.compile(model).get_runtime_model())
    return collections.Counter((x.get("layerType"), x.get("runtimePrecision")) for x in layers
                               if x.get("layerType") != "Const")


def _all_on(name: str) -> tuple[PreparedModel, bytes]:
    pm = PreparedModel.prepare(zoo.build(name, "small"), runtime="openvino")
    exporter = pm.exporter()
    uses = {u for pp in pm.points for u in pp.uses(pp.ids)}
    return pm, exporter.source(exporter.plan(uses))


def test_backend_times_fresh_compiled_models() -> None:
    backend = make_backend("openvino")
    assert runtime_for_backend("openvino") == "openvino"
    model = zoo.build("resnet", "small").SerializeToString()
    with backend.load(model) as runner:
        times = runner.time(2, 5)
    assert len(times) == 5 and all(t > 0 for t in times)
    info = backend.describe()
    assert info["threads"] == 1 and info["inference_precision"] == "f32"
    assert info["performance_hint"] == "LATENCY" and "compile_model" in info["how_to_run"]


def test_backend_options_are_checked() -> None:
    with pytest.raises(OptionError, match="performance_hint"):
        OpenVinoBackend(performance_hint="fastest")
    with pytest.raises(OptionError, match="--high-precision"):
        OpenVinoBackend(precision="int4")
    # OpenVINO's float precision is a compile hint: the graph itself stays FP32
    assert profile_for("openvino").high_precision("bf16", "openvino") == "fp32"


def test_isolated_backend_measures_in_a_worker() -> None:
    backend = make_backend("openvino", isolate=True)
    try:
        with backend.load(zoo.build("tiny_chain").SerializeToString()) as runner:
            assert len(runner.time(1, 3)) == 3
        _, model = _all_on("resnet")  # what ran is read through the isolated proxy too
        assert backend.what_ran(model).fused
    finally:
        backend.close()


def test_quantized_export_runs_integer_kernels() -> None:
    """Every point on, exported with the OpenVINO rules: the CPU plugin runs the Convolutions
    in u8 (runtimePrecision of the runtime graph), none in f32."""
    _, model = _all_on("resnet")
    kinds = _kinds(OpenVinoBackend(), model)
    assert kinds[("Convolution", "u8")] >= 5 and kinds[("Convolution", "f32")] == 0


def test_what_ran_reads_the_runtime_graph() -> None:
    pm, model = _all_on("yolo")
    ran = OpenVinoBackend().what_ran(model)
    assert ran is not None and "runtime graph" in ran.how
    assert len(ran.fused) > 10 and all(pm.graph.is_activation(t) for t in ran.fused)
    # the graph input's quantize runs on its own (nothing before it to fold it into)
    assert pm.graph.model.graph.input[0].name in ran.standalone
    assert not ran.fused & ran.standalone
    # the float model: nothing integer, so no float nodes "next to integer neighbours"
    plain = OpenVinoBackend().what_ran(zoo.build("yolo", "small").SerializeToString())
    assert not plain.fused and not plain.standalone and not plain.float_nodes


def test_rules_keep_weights_after_precision_preserving_ops() -> None:
    """A Conv reading a MaxPool of a quantized Relu runs u8 on OpenVINO once its weights are
    quantized: the exporter adds them (the ONNX Runtime rules do not)."""
    rules = profile_for("openvino").rules
    assert "MaxPool" in rules.precision_preserving_ops
    pm = PreparedModel.prepare(zoo.build("resnet", "small"), runtime="openvino")
    g = pm.graph
    pool = next(i for i, n in enumerate(g.nodes) if n.op_type == "MaxPool")
    relu_out = g.nodes[pool].input[0]
    plan = pm.exporter().plan({(relu_out, pool, 0)})
    conv_after = [n for n, _ in g.consumers[g.nodes[pool].output[0]]
                  if g.nodes[n].op_type == "Conv"]
    assert conv_after and all((n, 1, "int8") in plan.weights for n in conv_after)


@pytest.mark.parametrize("name", ["resnet", "yolo"])
def test_nncf_start_reexported_runs_nncf_kernels(name: str) -> None:
    """NNCF's placement read back as uses and exported by our exporter with NNCF's scales and
    its activation type runs the same layers at the same precisions as NNCF's own file."""
    pytest.importorskip("nncf")
    model = zoo.build(name, "small")
    pm = PreparedModel.prepare(model, runtime="openvino")
    theirs = ov_runtime.nncf_recipe_model(model)
    start = ov_runtime.nncf_recipe_start(pm, model)
    assert start.name == "recipe:openvino" and start.exact
    assert start.counts["unmapped"] == 0 and start.counts["mapped"] > 10
    types = starts.activation_types(theirs)  # NNCF mixes u8 (non-negative) and s8
    scales = starts.read_scales(theirs)
    scales.update({(t, types[t]): v for t, v in list(scales.items()) if t in types})
    exporter = pm.exporter(scales=scales, quant_type=ov_runtime.nncf_activation_type(theirs))
    ours = exporter.source(exporter.plan({u: types[u[0]] for u in start.scheme_uses}))
    backend = OpenVinoBackend()
    assert _kinds(backend, ours) == _kinds(backend, theirs.SerializeToString())
    if name != "resnet":  # the zoo YOLO's random weights: NNCF's bias correction moves it far
        return
    # the same numbers too, up to NNCF's bias correction (ours keeps the float model's biases)
    x = {model.graph.input[0].name: np.random.default_rng(1).standard_normal(
        [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]).astype(np.float32)}

    def output(m: bytes) -> np.ndarray:
        compiled = backend.compile(m)
        return np.asarray(compiled(x)[compiled.outputs[0]]).ravel()

    a, b = output(ours), output(theirs.SerializeToString())
    assert float(a @ b / np.linalg.norm(a) / np.linalg.norm(b)) > 0.99


def test_missing_nncf_is_a_tool_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "nncf", None)  # import nncf now raises ImportError
    with pytest.raises(starts.ToolError, match="nncf"):
        ov_runtime.nncf_recipe_model(zoo.build("tiny_chain"))


@pytest.mark.parametrize("cpu", ["avx2", "bf16"])
def test_tune_on_openvino_writes_the_hint(tmp_path: Path, cpu: str, capfd) -> None:
    """The hint is the CPU's only one (AVX2: f32), or the faster of those it offers on the
    float model (BF16: f32 or bf16, whichever measured faster: the rule, not one machine's
    answer); the report names it and the CPU it was decided by. NNCF's and OpenVINO's
    progress bars and log lines stay out of the run's output."""
    from qdq_optuna import Config, tune
    from qdq_optuna.machine import simulated_cpu

    model = tmp_path / "m.onnx"
    onnx.save(zoo.build("tiny_residual"), str(model))
    with simulated_cpu(cpu):
        result = tune(model=str(model), output_dir=str(tmp_path / "out"), backend="openvino",
                      config=Config(schemes_per_region=2, refine_rounds=0), timing="fast")
    out, err = capfd.readouterr()
    assert result.report["starts"] and any(s["name"].startswith("recipe:") for s in
                                           result.report["starts"]), "NNCF's start did not run"
    for line in (out + err).splitlines():
        assert "nncf" not in line.lower() and "━" not in line and "%|" not in line, line
        assert "Statistics collection" not in line and "Applying" not in line, line
    backend = result.report["backend"]
    hint, why = backend["inference_precision"], backend["inference_precision_why"]
    assert backend["name"] == "openvino" and why.startswith(hint)
    if cpu == "avx2":
        assert hint == "f32" and "the only inference precision" in why
    else:
        times = dict(re.findall(r"(\w+) ([\d.]+) ms", why))
        assert set(times) == {"f32", "bf16"} and "faster on the float model" in why
        assert hint == min(times, key=lambda h: float(times[h]))
    assert result.report["runtime"] == "openvino"
    assert result.report["cpu"]["bf16"] == (cpu == "bf16")
    md = (tmp_path / "out" / "report.md").read_text()
    assert f"- inference precision: `{hint}`" in md and "- run it: `openvino.Core()" in md
    assert f"'INFERENCE_PRECISION_HINT': '{hint}'" in backend["how_to_run"]
    assert np.isfinite(result.speedup)
    # the guard scored what OpenVINO computes, not the ONNX semantics in ONNX Runtime
    accuracy = result.report["accuracy"]
    assert "OpenVINO's CPU plugin" in accuracy["scored_as"]
    assert "onnxruntime_cpu_default" not in accuracy


def test_the_guard_scores_openvino_runs_with_openvinos_own_outputs(monkeypatch) -> None:
    # a first layer with 8-bit weights on a CPU whose u8 x s8 sums saturate: OpenVINO's
    # outputs drift from the ONNX semantics ONNX Runtime computes (mtcnn-rnet on an AVX2 CPU:
    # cosine 0.65 in OpenVINO, 0.997 in ONNX Runtime); the guard's figure must be OpenVINO's
    import qdq_optuna.placement.export as export
    from qdq_optuna.measure.accuracy import ErrorScorer, output_errors, run_model

    monkeypatch.setattr(export, "cpu_saturates_u8s8", lambda: False)  # 8-bit everywhere
    pm = PreparedModel.prepare(zoo.build("resnet", "small"), runtime="openvino")
    exporter = pm.exporter()
    model = exporter.source(exporter.plan({u for pp in pm.tunable for u in pp.uses(pp.ids)}))
    fp32 = exporter.source(exporter.plan(set()))
    rng = np.random.default_rng(0)
    shape = [d if isinstance(d, int) else 1 for d in pm.graph.shapes[pm.graph.graph_inputs[0]]]
    data = {pm.graph.graph_inputs[0]: (rng.random([3, *shape[1:]]) * 255).astype(np.float32)}
    backend = OpenVinoBackend()
    scorer = ErrorScorer(fp32, data, metric=None, error_measure="relative_l2", optimize=False,
                         runner=backend.outputs)
    record = scorer.score_bytes(model)
    reference = run_model(fp32, data, optimize=False)
    by_openvino = output_errors(reference, backend.outputs(model, data))
    by_onnx = output_errors(reference, run_model(model, data, optimize=False))
    name = next(iter(by_openvino))
    assert record["output_errors"][name]["relative_l2"] == pytest.approx(
        by_openvino[name]["relative_l2"], rel=1e-6)
    assert scorer.default_session_check(model) is None
    # the ONNX Runtime figure is another computation (equal only where nothing saturates)
    assert np.isfinite(by_onnx[name]["relative_l2"])


def test_concat_inputs_share_the_output_scale_under_openvino_rules(tmp_path):
    """OpenVINO's u8 Concatenation requantizes inputs whose scale differs from the output's
    (NNCF unifies them): the run's calibrated scales share them, as under ONNX Runtime's
    rules."""
    from qdq_optuna.run_folder import RunFolder
    from qdq_optuna.search._options import TuneOptions
    from qdq_optuna.search._prepare import calibrated_scales

    model = zoo.build("tiny_concat")
    pm = PreparedModel.prepare(model, runtime="openvino")
    scales, _ = calibrated_scales(pm, TuneOptions(model=model, output_dir=str(tmp_path)),
                                  RunFolder(tmp_path), None)
    from qdq_optuna.model import calibration

    data = calibration.random_calibration_data(pm.graph.model, None, samples=4, seed=0)
    own = calibration.activation_scales(
        calibration.collect_statistics(pm.graph.full_model(), pm.candidate_tensors(), data),
        method=calibration.DEFAULT_METHOD, quant_type=pm.quant_type,
        bounds=calibration.reader_bounds(pm.graph))
    concats = [n for n in pm.graph.nodes if n.op_type == "Concat"]

    def sharing(table: dict) -> int:
        return sum(1 for n in concats for name in n.input if name in table
                   and n.output[0] in table and table[name] == table[n.output[0]])

    assert sharing(scales) > sharing(own), "the run's scales share no more than their own"


def _concat_inputs_only(pm: PreparedModel) -> set:
    """Every point on except the reads of Concat outputs: the Concats' inputs carry the Q/DQ
    and the Convolution after a Concat reads it through the precision-preserving Concat (as
    NNCF places them on YOLO's C2f blocks)."""
    cat = {n.output[0] for n in pm.graph.nodes if n.op_type == "Concat"}
    return {u for pp in pm.points for u in pp.uses(pp.ids) if u[0] not in cat}


def test_openvino_rules_share_every_concat_scale_so_the_next_conv_runs_u8() -> None:
    """LPT turns a Concat of u8 inputs with different scales into a per-channel dequantization
    the next Convolution cannot fold: that Convolution runs f32. ONNX Runtime's ratio (share
    only comparable ranges) leaves some on the zoo YOLO; the OpenVINO rules share always."""
    from qdq_optuna.model import calibration
    from qdq_optuna.runtimes.openvino import OPENVINO_CPU

    assert OPENVINO_CPU.concat_share_ratio == 0.0
    assert profile_for("onnxruntime").rules.concat_share_ratio == calibration.CONCAT_SHARE_RATIO
    pm = PreparedModel.prepare(zoo.build("yolo", "small"), runtime="openvino")
    data = calibration.random_calibration_data(pm.graph.model, None, samples=4, seed=0)
    stats = calibration.collect_statistics(pm.graph.full_model(), pm.candidate_tensors(), data)
    own = calibration.activation_scales(stats, method=calibration.DEFAULT_METHOD,
                                        quant_type="uint8")
    uses = _concat_inputs_only(pm)
    backend = OpenVinoBackend()
    f32 = {}
    for ratio in (calibration.CONCAT_SHARE_RATIO, OPENVINO_CPU.concat_share_ratio):
        scales = calibration.share_concat_scales(pm.graph.nodes, own, "uint8", ratio=ratio)
        exporter = pm.exporter(scales=scales, quant_type="uint8")
        f32[ratio] = _kinds(backend, exporter.source(exporter.plan(uses)))[
            ("Convolution", "f32")]
    assert f32[calibration.CONCAT_SHARE_RATIO] > 0, "the case no longer arises on the zoo YOLO"
    assert f32[OPENVINO_CPU.concat_share_ratio] == 0


def test_the_float_part_runs_at_the_faster_supported_hint(monkeypatch, tmp_path) -> None:
    """Without --high-precision the user's float model is timed at each hint the CPU offers
    and the faster one is the run's (the baseline and every candidate compile with it)."""
    from qdq_optuna.backends import openvino as ovb
    from qdq_optuna.machine import simulated_cpu
    from qdq_optuna.search._options import TuneOptions
    from qdq_optuna.search._settings import backend_for

    model = zoo.build("tiny_chain").SerializeToString()
    assert ovb.choose_precision(model, "bf16") == ("bf16", "--high-precision bf16")
    with simulated_cpu("avx2"):  # f32 only: nothing to time
        assert ovb.choose_precision(model, None)[0] == "f32"
    # two hints (OpenVINO compiles a hint the CPU lacks at f32): both timed, the faster kept
    monkeypatch.setattr(ovb, "supported_hints", lambda core=None: ("f32", "bf16"))
    hint, ms = ovb.fastest_precision(model, rounds=3, runs=3)
    assert set(ms) == {"f32", "bf16"} and ms[hint] == min(ms.values())
    chosen, why = ovb.choose_precision(model, None, rounds=3, runs=3)
    assert chosen in ms and "faster" in why and "bf16" in why and "f32" in why
    backend = backend_for(TuneOptions(model=model, output_dir=str(tmp_path), backend="openvino",
                                      isolate=False))
    info = backend.describe()
    assert info["inference_precision"] in ("f32", "bf16")
    assert "faster on the float model" in info["inference_precision_why"]
    assert f"'INFERENCE_PRECISION_HINT': '{info['inference_precision']}'" in info["how_to_run"]


def test_swish_operands_are_not_sites_on_openvino() -> None:
    """x * Sigmoid(x) is fused into x's Convolution by OpenVINO: a Q/DQ on either operand only
    adds a float Subgraph. The rules leave them out; every point on then runs no such layer
    (the zoo YOLO: 50 f32 Subgraphs with them)."""
    pm, model = _all_on("yolo")
    g = pm.graph
    muls = [i for i, n in enumerate(g.nodes) if n.op_type == "Mul"]
    swish = [i for i in muls if any(g.producer_op(t) == "Sigmoid" for t in g.nodes[i].input)]
    assert swish, "the zoo YOLO has no SiLU any more"
    for i in swish:
        for slot, tensor in enumerate(g.nodes[i].input):
            assert not pm.rules.quantizable(g, (tensor, i, slot))
    kinds = _kinds(OpenVinoBackend(), model)
    assert kinds[("Subgraph", "f32")] <= 1
    assert kinds[("Convolution", "u8")] == 57 and kinds[("Convolution", "f32")] == 0


def test_profile_reads_per_layer_kernels_and_times() -> None:
    """PERF_COUNT per runtime layer: the quantized model's Convolutions run int8 kernels, the
    float model's f32 ones, each with a positive minimum time."""
    backend = OpenVinoBackend()
    _, quantized = _all_on("resnet")
    for model, kernel in ((zoo.build("resnet", "small").SerializeToString(), "f32"),
                          (quantized, "I8")):
        rows = backend.profile(model, runs=3, warmup=1)
        convs = [r for r in rows if r["layer_type"] == "Convolution"]
        assert convs and all(r["min_us"] > 0 for r in rows)
        assert all(r["exec_type"].endswith(kernel) for r in convs), \
            sorted({r["exec_type"] for r in convs})


def test_a_pair_added_where_every_neighbour_ran_integer_is_not_measured() -> None:
    """OpenVINO's runtime graph names the nodes it ran in u8/i8 layers: on a measured backend a
    move that only adds Q/DQ where every neighbour already ran integer is dropped
    (``integer``), and one next to a layer that ran float is measured."""
    from collections import Counter

    from qdq_optuna.search._moves import MoveSpace, MoveStats
    from qdq_optuna.search._unfused import INTEGER, Unfused, skip_reason

    pm = PreparedModel.prepare(zoo.build("yolo", "small"), runtime="openvino")
    space = MoveSpace(pm)
    # every point on but one per pattern: that one's move adds a pair into integer layers
    schemes = {pp.pattern.id: dict.fromkeys(pp.ids, 1) for pp in pm.tunable}
    exporter = pm.exporter()
    what = OpenVinoBackend().what_ran(exporter.to_bytes(exporter.plan(
        {u for pp in pm.points for u in pp.uses(pp.ids)})))
    assert what.integer_nodes and not what.integer_nodes & what.float_nodes

    class _Plans:  # a measured backend whose report was read above
        deterministic = False
        measurer = type("M", (), {"backend": None})

    class _S:
        prepared = pm
        plans = _Plans()

    unfused = Unfused(_S(), space.uses_of)
    settled = unfused.settled(what)
    g = pm.graph
    seen = Counter()
    for pp in pm.tunable:
        pid = pp.pattern.id
        for q in pp.ids:
            off = {**schemes, pid: {**schemes[pid], q: 0}}
            visit = space.visit(pid, off, MoveStats(0), sites=unfused.point_sites(what),
                                resolvable=unfused.resolvable(), settled=settled)
            every = space.visit(pid, off, MoveStats(0)).moves
            add = next(m for m in every if m.on == frozenset({q}) and not m.off)
            uses = space.uses_of[(pid, q)]
            around = {g.nodes[n].name for _, n, _ in uses} | {
                g.nodes[g.producer[t][0]].name for t, _, _ in uses if t in g.producer}
            inside = all(t in g.producer for t, _, _ in uses) and around <= what.integer_nodes \
                and not {t for t, _, _ in uses} & (what.reformats | what.standalone)
            assert (add in visit.moves) == (not inside), (pid, q, around)
            seen[inside] += 1
            if inside:
                assert visit.dropped.get(INTEGER)
    assert seen[True] and seen[False]  # both kinds occur on the zoo YOLO
    assert "already ran integer" in skip_reason(Counter({INTEGER: 2}))
    # an exact backend prices any change: nothing is settled there
    _Plans.deterministic = True
    assert Unfused(_S(), space.uses_of).settled(what) is None


def test_a_model_compiled_again_comes_from_the_backends_own_cache(tmp_path) -> None:
    """Each round compiles afresh; OpenVINO's model cache (a folder of the backend's own,
    removed with it) turns a repeated compile into an import of the same kernels."""
    import gc

    _, model = _all_on("yolo")
    backend = OpenVinoBackend()
    folder = backend.cache_dir
    with backend.load(model) as first:
        a = min(first.time(2, 5))
    assert len(list(folder.glob("*.blob"))) == 1
    with backend.load(model) as again:  # a new compiled model, from the blob
        b = min(again.time(2, 5))
    assert len(list(folder.glob("*.blob"))) == 1 and a > 0 and b > 0
    assert _kinds(backend, model) == _kinds(OpenVinoBackend(), model)
    del backend, first, again
    gc.collect()
    assert not folder.exists()


def test_a_bias_reshaped_from_a_constant_is_no_site_and_every_point_on_compiles() -> None:
    # paddle2onnx adds a Conv's bias through Reshape(bias, [1, C, 1, 1]) -> Add (ppocr-cls): a
    # Q/DQ on that constant's reshape made OpenVINO's low-precision AddTransformation throw
    # ("index '0' out of range") when the every-point-on start compiled. Computed from
    # constants alone, the reshape is a constant (folded on load), not an activation.
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.normal(size=(8, 3, 3, 3)).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.normal(size=(8,)).astype(np.float32), "b")
    shape = numpy_helper.from_array(np.array([1, 8, 1, 1], dtype=np.int64), "shape")
    w2 = numpy_helper.from_array(rng.normal(size=(2, 8, 1, 1)).astype(np.float32), "w2")
    b2 = numpy_helper.from_array(rng.normal(size=(2,)).astype(np.float32), "b2")
    shape2 = numpy_helper.from_array(np.array([1, 2, 1, 1], dtype=np.int64), "shape2")
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Reshape", ["b", "shape"], ["b4"]),
        helper.make_node("Add", ["c", "b4"], ["cb"]),
        helper.make_node("Relu", ["cb"], ["r"]),
        helper.make_node("GlobalAveragePool", ["r"], ["p"]),
        helper.make_node("Conv", ["p", "w2"], ["c2"]),
        helper.make_node("Reshape", ["b2", "shape2"], ["b24"]),
        helper.make_node("Add", ["c2", "b24"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "paddle_bias", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                             [1, 3, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 1, 1])],
        initializer=[w, b, shape, w2, b2, shape2])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    pm = PreparedModel.prepare(model, runtime="openvino")
    sites = {u[0] for pp in pm.points for u in pp.uses(pp.ids)}
    assert not sites & {"b4", "b24"} and {"x", "p"} <= sites
    assert "Reshape" not in {n.op_type for n in pm.graph.nodes}
    exporter = pm.exporter()
    every = exporter.source(exporter.plan({u for pp in pm.points for u in pp.uses(pp.ids)}))
    OpenVinoBackend().compile(every)  # raised BackendError before


# -- NNCF's transformer preset ------------------------------------------------------------------
def _graph(nodes: list, inputs: list, outputs: list, inits: list = ()) -> onnx.ModelProto:
    from onnx import TensorProto, helper

    def vi(name: str, shape: list) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)

    graph = helper.make_graph(nodes, "g", [vi(*i) for i in inputs], [vi(*o) for o in outputs],
                              list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_attention_blocks_are_softmaxes_whose_probabilities_weigh_values() -> None:
    """The profile's rule for NNCF's transformer preset: a Softmax a MatMul of two
    activations reads (directly or through layout ops) is one attention block; a
    classifier's Softmax, a MatMul of two activations without one, and a Softmax read by a
    linear layer's MatMul (constant weight) are not."""
    from onnx import helper, numpy_helper

    assert ov_runtime.attention_blocks(zoo.tiny_attention()) == 1
    vit = zoo.vit_like(image=32, patch=16, hidden=32, heads=2, layers=3, ffn=64, num_classes=10)
    assert ov_runtime.attention_blocks(vit) == 3
    assert ov_runtime.attention_blocks(zoo.build("tiny_residual")) == 0
    assert ov_runtime.attention_blocks(zoo.build("resnet", "small")) == 0
    w = numpy_helper.from_array(np.ones((4, 4), np.float32), "w")
    classifier = _graph([helper.make_node("MatMul", ["x", "w"], ["h"]),
                         helper.make_node("Softmax", ["h"], ["y"])],
                        [("x", [1, 4])], [("y", [1, 4])], [w])
    assert ov_runtime.attention_blocks(classifier) == 0
    linear_after = _graph([helper.make_node("Softmax", ["x"], ["p"]),
                           helper.make_node("MatMul", ["p", "w"], ["y"])],
                          [("x", [1, 4])], [("y", [1, 4])], [w])
    assert ov_runtime.attention_blocks(linear_after) == 0
    gram = _graph([helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0]),
                   helper.make_node("MatMul", ["x", "xt"], ["y"])],
                  [("x", [4, 4])], [("y", [4, 4])])
    assert ov_runtime.attention_blocks(gram) == 0
    through_layout = _graph([helper.make_node("Softmax", ["s"], ["p"]),
                             helper.make_node("Reshape", ["p", "shape"], ["r"]),
                             helper.make_node("MatMul", ["r", "v"], ["y"])],
                            [("s", [4, 4]), ("v", [4, 4])], [("y", [4, 4])],
                            [numpy_helper.from_array(np.array([4, 4], np.int64), "shape")])
    assert ov_runtime.attention_blocks(through_layout) == 1


def test_nncf_transformer_preset_is_a_start_and_a_file_only_for_models_with_attention(
        tmp_path: Path) -> None:
    """With attention: NNCF's ModelType.TRANSFORMER placement read back whole onto our graph,
    a placement of its own (not the default preset's), its file kept as made and made again
    byte for byte; without attention: no start and no file (NNCF is not even run)."""
    pytest.importorskip("nncf")
    model = zoo.tiny_attention()
    pm = PreparedModel.prepare(model, runtime="openvino")
    kept = tmp_path / "recipe_openvino_transformer.onnx"
    start = ov_runtime.nncf_transformer_start(pm, model, keep=kept.write_bytes)
    assert start is not None and start.name == ov_runtime.TRANSFORMER_START
    assert start.counts["unmapped"] == 0 and start.counts["mapped"] > 0 and start.uses
    assert start.uses != ov_runtime.nncf_recipe_start(pm, model).uses
    assert kept.read_bytes() == ov_runtime.nncf_transformer_bytes(model)
    cnn = zoo.build("tiny_residual")
    cnn_pm = PreparedModel.prepare(cnn, runtime="openvino")
    no_file = tmp_path / "no.onnx"
    assert ov_runtime.nncf_transformer_start(cnn_pm, cnn, keep=no_file.write_bytes) is None
    assert ov_runtime.nncf_transformer_bytes(cnn) is None and not no_file.exists()
    names = [spec.name for spec in profile_for("openvino").recipe_files()]
    assert names == ["openvino", "openvino_transformer"]


def _quantize_names(model: onnx.ModelProto) -> frozenset[str]:
    return frozenset(n.name for n in model.graph.node if n.op_type == "QuantizeLinear")


@pytest.mark.parametrize("name", ["tiny_attention", "tiny_residual"])
def test_a_tune_on_openvino_starts_from_nncf_transformer_preset_and_ships_its_file_if_faster(
        tmp_path: Path, name: str) -> None:
    """On a model with attention the run measures NNCF's transformer placement among its
    starts and its own file at the end; here that file is the fastest model (a latency
    function that knows its Q nodes), so optimized.onnx is that file as NNCF wrote it. On a
    CNN neither the start nor the file exists."""
    pytest.importorskip("nncf")
    from qdq_optuna import Config, tune
    from qdq_optuna.backends.callable import CallableBackend

    model = zoo.build(name)
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    cal = {model.graph.input[0].name: np.random.default_rng(0).standard_normal(
        [4, *[d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim][1:]]
    ).astype(np.float32)}
    np.savez(tmp_path / "cal.npz", **cal)
    made = ov_runtime.nncf_transformer_bytes(str(path), data=cal)
    fastest = None if made is None else _quantize_names(onnx.load_from_string(made))

    def latency(m: onnx.ModelProto) -> float:
        return 1.0 if _quantize_names(m) == fastest else 2.0

    report = tune(str(path), tmp_path / "out", benchmark=CallableBackend(latency,
                                                                          deterministic=True),
                  runtime="openvino", calibration_data=str(tmp_path / "cal.npz"),
                  config=Config(schemes_per_region=2, refine_rounds=0), progress=False).report
    start_names = [s["name"] for s in report["starts"]]
    files = {f["name"]: f for f in report.get("recipe_files") or []}
    kept = tmp_path / "out" / "recipe_openvino_transformer.onnx"
    if made is None:
        assert ov_runtime.TRANSFORMER_START not in start_names
        assert "openvino_transformer" not in files and not kept.exists()
        return
    assert ov_runtime.TRANSFORMER_START in start_names and "recipe:openvino" in start_names
    assert kept.read_bytes() == made
    entry = files["openvino_transformer"]
    assert entry["tool"] == "nncf.quantize(model_type=ModelType.TRANSFORMER)"
    assert entry["within_bound"] and entry["shipped"]
    assert (tmp_path / "out" / "optimized.onnx").read_bytes() == made
