"""Weight-only int8/int4 MatMuls (ONNX Runtime's MatMulNBits) as per-node modes: the node as
ONNX Runtime's own quantizer writes it, its kernel in real sessions, its insertion points
(pattern-relative, exclusive with dynamic and static on the node), ``--modes``, the search and
its report, the kernel table's columns and ONNX Runtime's weight-only recipe file."""

from __future__ import annotations

import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from qdq_optuna import tune
from qdq_optuna.backends.callable import CallableBackend
from qdq_optuna.config import Config
from qdq_optuna.errors import OptionError
from qdq_optuna.examples import zoo
from qdq_optuna.placement import dynamic, weight_only
from qdq_optuna.placement.dynamic import QuantMode, use_mode
from qdq_optuna.runtimes import onnxruntime as ort_runtime
from qdq_optuna.runtimes import profile_for
from qdq_optuna.runtimes.prepared import PreparedModel

ORT = profile_for("onnxruntime")
ALL = (QuantMode.STATIC, QuantMode.DYNAMIC, QuantMode.WEIGHT_INT8, QuantMode.WEIGHT_INT4)
WEIGHT_ONLY = (QuantMode.STATIC, QuantMode.WEIGHT_INT8, QuantMode.WEIGHT_INT4)


def _session(data: bytes) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    return ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def _matmul(k: int, n: int, seed: int = 0) -> onnx.ModelProto:
    w = np.random.default_rng(seed).standard_normal((k, n)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["A", "W"], ["Y"], name="mm")], "mm",
        [helper.make_tensor_value_info("A", TensorProto.FLOAT, [1, 4, k])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, 4, n])],
        [numpy_helper.from_array(w, "W")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_the_installed_onnxruntime_has_both_kernels_and_offers_the_modes():
    assert weight_only.kernel_available(8) and weight_only.kernel_available(4)
    assert ORT.lacking_modes() == {}
    assert QuantMode.WEIGHT_INT8 in ORT.modes and QuantMode.WEIGHT_INT4 in ORT.modes


@pytest.mark.parametrize("bits", [8, 4])
def test_a_node_is_written_as_onnx_runtimes_own_quantizer_writes_it(bits):
    """Packed weight, scales, zero points and attributes byte for byte as
    ``MatMulNBitsQuantizer`` (the same bits, block size and accuracy level) writes them."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    model = _matmul(200, 24)  # K not a whole number of blocks: padded as ORT pads
    w = numpy_helper.to_array(model.graph.initializer[0])
    q = MatMulNBitsQuantizer(model, bits=bits, block_size=weight_only.BLOCK_SIZE,
                             accuracy_level=weight_only.ACCURACY_LEVEL)
    q.process()
    theirs = q.model.model
    (node,) = theirs.graph.node
    inits, ours = weight_only.matmul_nbits(w, "A", "Y", "W", bits=bits)
    assert ours.op_type == node.op_type == "MatMulNBits" and ours.domain == node.domain
    attrs = lambda n: {a.name: helper.get_attribute_value(a) for a in n.attribute}  # noqa: E731
    assert attrs(ours) == attrs(node)
    by_name = {t.name: numpy_helper.to_array(t) for t in theirs.graph.initializer}
    for mine, name in zip(inits, node.input[1:]):
        np.testing.assert_array_equal(numpy_helper.to_array(mine), by_name[name])


def test_weight_only_points_run_on_onnx_runtimes_matmulnbits_kernels(tmp_path):
    """Each MatMul/Gemm of a constant weight gets a weight_int8 and a weight_int4 point beside
    its dynamic one; turned on, the node runs as MatMulNBits in ONNX Runtime (its optimized
    graph keeps it), int8 within cosine 0.999 of float."""
    model = zoo.tiny_attention()
    pm = PreparedModel.prepare(model, runtime=ORT.rules_for_modes(ALL))
    ids = [p for pp in pm.tunable for p in pp.ids]
    for suffix in ("dynamic", "weight_int8", "weight_int4"):
        assert sum(p.endswith(f".{suffix}") for p in ids) == 6
    ex = pm.exporter()
    x = {"x": np.random.default_rng(1).standard_normal((1, 8, 16)).astype(np.float32)}
    ref = _session(model.SerializeToString()).run(None, x)[0]
    for mode, floor in ((QuantMode.WEIGHT_INT8, 0.999), (QuantMode.WEIGHT_INT4, 0.95)):
        uses = {u for pp in pm.tunable
                for u in pp.uses([p for p in pp.ids if p.endswith(f".{mode.value}")])}
        data = ex.to_bytes(ex.plan(uses))
        onnx.checker.check_model(onnx.load_from_string(data))
        assert list(dynamic.node_modes(data).values()).count(mode.value) == 6
        so = ort.SessionOptions()
        so.optimized_model_filepath = str(tmp_path / f"{mode.value}.onnx")
        ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])
        ran = onnx.load(str(tmp_path / f"{mode.value}.onnx"))
        assert sum(n.op_type == "MatMulNBits" for n in ran.graph.node) == 6
        assert _cosine(ref, _session(data).run(None, x)[0]) > floor


def test_a_node_runs_one_mode_and_takes_no_static_qdq_in_it():
    """Every point on: each node runs one per-node mode (dynamic before int8 before int4), and
    none of those nodes' inputs carries a Q/DQ pair; without dynamic, int8 wins over int4."""
    pm = PreparedModel.prepare(zoo.tiny_attention(), runtime=ORT.rules_for_modes(ALL))
    ex = pm.exporter()
    every = {u for pp in pm.tunable for u in pp.uses(pp.ids)}
    plan = ex.plan(every)
    assert {use_mode(u) for u in plan.dynamic} == {QuantMode.DYNAMIC}
    assert len({n for _, n, _ in plan.dynamic}) == len(plan.dynamic) == 6
    nodes = {n for _, n, _ in plan.dynamic}
    assert not any(n in nodes for _, consumers, _ in plan.activations for n, _ in consumers)
    no_dynamic = ex.plan({u for u in every if use_mode(u) is not QuantMode.DYNAMIC})
    assert {use_mode(u) for u in no_dynamic.dynamic} == {QuantMode.WEIGHT_INT8}
    modes = dynamic.node_modes(ex.to_bytes(no_dynamic))
    assert list(modes.values()).count("weight_int8") == 6


def test_modes_refuses_a_weight_only_mode_a_runtime_or_its_version_lacks():
    assert ORT.searched_modes("weight_int4", "fp32") == (QuantMode.STATIC, QuantMode.WEIGHT_INT4)
    assert ORT.searched_modes("weight_int4,dynamic,weight_int8", "fp32") == ALL
    for name in ("openvino", "tensorrt"):
        with pytest.raises(OptionError, match=f"{name} offers no weight_int8 mode"):
            profile_for(name).searched_modes("weight_int8", "fp32")
    lacking = {QuantMode.WEIGHT_INT4: "weight_int4 needs ONNX Runtime's MatMulNBits kernel "
                                      "(4-bit), which onnxruntime 1.0 here lacks"}
    with pytest.raises(OptionError, match=r"^--modes: weight_int4 needs .* 1\.0 here lacks$"):
        QuantMode.parse("weight_int4", (QuantMode.STATIC, QuantMode.DYNAMIC), "onnxruntime",
                        lacking=lacking)
    with pytest.raises(OptionError, match="--modes weight_int4: its kernels take FP32"):
        ORT.searched_modes("weight_int4", "fp16")


def _nbits(model: onnx.ModelProto) -> int:
    return sum(n.op_type == "MatMulNBits" for n in model.graph.node)


def int4_pays(model: onnx.ModelProto) -> float:
    """Each int4 MatMulNBits 0.1 ms off 2 ms, the recipe files slower than all."""
    if model.producer_name == "onnx.quantize" or any(
            n.op_type == "MatMulNBits" and n.name.endswith("_Q4") for n in model.graph.node):
        return 5.0
    four = sum(n.op_type == "MatMulNBits" and {a.name: a.i for a in n.attribute}["bits"] == 4
               for n in model.graph.node)
    return 2.0 - 0.1 * four - 0.01 * _nbits(model)


def test_the_search_chooses_weight_only_nodes_records_them_and_resumes(tmp_path):
    path = tmp_path / "encoder.onnx"
    onnx.save(zoo.tiny_attention(), str(path))

    def run(**kw) -> dict:
        return tune(str(path), tmp_path / "r", benchmark=CallableBackend(int4_pays,
                                                                         deterministic=True),
                    runtime="onnxruntime", modes="static,weight_int8,weight_int4",
                    config=Config(schemes_per_region=3, refine_rounds=0), progress=False,
                    **kw).report

    report = run()
    assert report["modes"] == ["static", "weight_int8", "weight_int4"]
    assert report["mode_counts"]["weight_int4"] == 6 and report["mode_counts"]["dynamic"] == 0
    shipped = onnx.load(str(tmp_path / "r" / "optimized.onnx"))
    assert dynamic.node_modes(shipped) == report["node_modes"]
    assert "6 weight_int4" in (tmp_path / "r" / "report.md").read_text()
    assert {"weight_int8", "weight_int4"} <= {s["name"] for s in report["starts"]}
    again = run()  # the same settings: the stored run's report, nothing measured again
    assert again["node_modes"] == report["node_modes"]
    assert again["measurements"] == report["measurements"]


def test_onnx_runtimes_weight_only_file_is_a_recipe_file_of_the_run(tmp_path):
    """ONNX Runtime's MatMulNBitsQuantizer output (int4 on the MatMuls whose K holds a block)
    is kept and measured as written, like quantize_dynamic's; it ships when what would ship is
    slower and it keeps the bound (here a latency function says so: the file's own nodes end
    in ``_Q4``, the quantizer's naming)."""
    model = zoo.transformer_like(seq=8, hidden=128, heads=2, layers=1, ffn=256, vocab=50)
    path = tmp_path / "encoder.onnx"
    onnx.save(model, str(path))
    large, small = ort_runtime.weight_only_candidates(model)
    assert large and not small  # every linear layer's K is 128 or 256
    tiny = zoo.tiny_attention()  # K 16 and 32: no whole block, no file
    assert ort_runtime.weight_only_candidates(tiny)[0] == []
    assert ort_runtime.ort_weight_only_recipe_bytes(tiny) is None
    data = ort_runtime.ort_weight_only_recipe_bytes(str(path))
    assert data == ort_runtime.ort_weight_only_recipe_bytes(str(path))
    written = onnx.load_from_string(data)
    assert _nbits(written) == len(large)
    assert {a.name: a.i for a in next(n for n in written.graph.node
                                      if n.op_type == "MatMulNBits").attribute} == {
        "K": 128, "N": 128, "bits": 4, "block_size": 128, "accuracy_level": 4}

    def file_fastest(m: onnx.ModelProto) -> float:
        return 1.0 if any(n.name.endswith("_Q4") for n in m.graph.node) else 2.0

    report = tune(str(path), tmp_path / "r", benchmark=CallableBackend(file_fastest,
                                                                       deterministic=True),
                  runtime="onnxruntime", max_output_error=1.0,
                  config=Config(schemes_per_region=2, refine_rounds=0), progress=False).report
    wo = next(f for f in report["recipe_files"] if f["tool"] == "MatMulNBitsQuantizer")
    assert wo["name"] == "onnxruntime_weight_only" and wo["within_bound"] and wo["shipped"]
    kept = (tmp_path / "r" / wo["file"]).read_bytes()
    assert kept == data and (tmp_path / "r" / "optimized.onnx").read_bytes() == kept
    assert report["mode_counts"]["weight_int4"] == len(large)


def test_the_kernel_table_times_a_matmuls_weight_only_kernels_beside_the_others(tmp_path):
    """Real ONNX Runtime sessions: asked for the weight-only modes, a MatMul unit's row has
    its MatMulNBits kernels (int8, int4) timed against float; the report gets a column each."""
    from qdq_optuna.backends.onnxruntime import OnnxRuntimeBackend
    from qdq_optuna.measure import kernels as K
    from qdq_optuna.measure.timing import TimingProtocol
    from qdq_optuna.outputs.report import _kernel_lines
    from qdq_optuna.placement import starts

    quick = TimingProtocol.fast().with_(process_warmup_rounds=0, min_rounds=2, max_rounds=2)
    pm = PreparedModel.prepare(zoo.tiny_attention())
    ex = pm.exporter()
    qdq = onnx.load_from_string(ex.to_bytes(ex.plan(starts.all_on_start(pm).scheme_uses)))
    flt = onnx.load_from_string(ex.to_bytes(ex.plan(set())))
    units = [u for u in K.units(K.with_shapes(qdq)) if u.op in K.DYNAMIC_KERNEL_OPS]
    unit = units[0]
    skip = [u.node for u in K.units(K.with_shapes(qdq)) if u.node != unit.node]
    table = K.kernel_table(OnnxRuntimeBackend(), flt, qdq, skip=skip, protocol=quick,
                           output_q=True, dynamic=True,
                           weight_only=(QuantMode.WEIGHT_INT8, QuantMode.WEIGHT_INT4))
    t = table.timings[unit.node]
    for mode in K.MODE_KERNELS:
        ms, ratio = t.mode_ms(mode), getattr(t, f"{mode.value}_ratio")
        assert math.isfinite(ms) and ms > 0 and math.isfinite(ratio), mode
    model = K.mode_unit_model(unit, K.unit_models(unit, K.with_shapes(qdq),
                                                  K.with_shapes(flt))[1], QuantMode.WEIGHT_INT4)
    assert _nbits(onnx.load_from_string(model)) == 1
    rows = [{**r, "action": r["decision"]} for r in table.to_dict()["kernels"]]
    header = next(line for line in _kernel_lines({"kernels": rows, "timed": 1, "cached": 0})
                  if line.startswith("| node"))
    assert "float/weight_int8" in header and "float/weight_int4" in header


def test_a_cnn_with_a_matmul_head_gets_no_transformer_recipe_files():
    """The dynamic and weight-only files are for models whose MatMuls are more than a head: a
    CNN whose one MatMul comes after its last convolution would get a file that is the float
    model but for that layer, and a whole-model A/B for nothing."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((8, 3, 3, 3)).astype(np.float32), "w1"),
             numpy_helper.from_array(rng.standard_normal((8, 8, 3, 3)).astype(np.float32), "w2"),
             numpy_helper.from_array(rng.standard_normal((8 * 16 * 16, 256)).astype(np.float32),
                                     "head")]
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "w2"], ["c2"], pads=[1, 1, 1, 1], name="conv2"),
             helper.make_node("Flatten", ["c2"], ["f"], name="flatten"),
             helper.make_node("MatMul", ["f", "head"], ["y"], name="head")]
    graph = helper.make_graph(nodes, "cnn", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [1, 3, 16, 16])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, [1, 256])], inits)
    cnn = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert ort_runtime.ort_dynamic_recipe_bytes(cnn) is None
    assert ort_runtime.ort_weight_only_recipe_bytes(cnn) is None
    # the companion: a transformer gets its dynamic file
    assert ort_runtime.ort_dynamic_recipe_bytes(zoo.build("transformer")) is not None
