"""Calibration: data loading, one-pass statistics, histogram growth, scales, cache."""

from __future__ import annotations

import collections
import json
import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from qdq_optuna.errors import OptionError, UserError
from qdq_optuna.model.calibration import (
    METHODS,
    MIN_SCALE,
    QUANT_TYPES,
    SAME_SCALE_OPS,
    TensorStatistics,
    _param_range,
    activation_params,
    activation_scales,
    collect_statistics,
    load_calibration_data,
    load_statistics,
    random_calibration_data,
    share_concat_scales,
    share_input_scales,
    statistics_json,
)
from qdq_optuna.run_folder import RunFolder

INTERMEDIATE = ["c1", "r1", "y"]


def conv_model(batch: int | str = "N") -> onnx.ModelProto:
    """x -> Conv -> Relu -> Conv -> y."""
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "W1")
    w2 = numpy_helper.from_array(rng.standard_normal((2, 4, 3, 3)).astype(np.float32), "W2")
    nodes = [
        helper.make_node("Conv", ["x", "W1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("Conv", ["r1", "W2"], ["y"], pads=[1, 1, 1, 1]),
    ]
    graph = helper.make_graph(
        nodes,
        "conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 2, 8, 8])],
        [w1, w2],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def two_input_model() -> onnx.ModelProto:
    """A float image input and an int64 id input with a symbolic length."""
    graph = helper.make_graph(
        [
            helper.make_node("Relu", ["x"], ["y"]),
            helper.make_node("Cast", ["ids"], ["z"], to=TensorProto.FLOAT),
        ],
        "two",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 4]),
            helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", "L"]),
        ],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("z", TensorProto.FLOAT, None),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def reference_outputs(model: onnx.ModelProto, data: dict, names: list[str]) -> dict:
    """Every named tensor from one plain ORT run over all samples at once."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    existing = {o.name for o in copy.graph.output}
    for name in names:
        if name not in existing:
            copy.graph.output.append(onnx.ValueInfoProto(name=name))
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(copy.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return dict(zip(names, sess.run(names, data)))


@pytest.fixture
def model() -> onnx.ModelProto:
    return conv_model()


@pytest.fixture
def data(model) -> dict:
    return random_calibration_data(model, samples=10, seed=1)


# ------------------------------------------------------------------------------------ statistics


def test_statistics_match_numpy(model, data):
    stats = collect_statistics(model, INTERMEDIATE + ["x"], data, batch_size=4)
    ref = reference_outputs(model, data, INTERMEDIATE)
    ref["x"] = data["x"]
    assert set(stats) == set(ref)
    for name, arr in ref.items():
        s = stats[name]
        assert s.min == pytest.approx(float(arr.min()), rel=1e-6)
        assert s.max == pytest.approx(float(arr.max()), rel=1e-6)
        assert s.count == arr.size == int(s.hist.sum())
        assert s.hist_amax >= s.amax - 1e-6
    assert stats["r1"].min == 0.0


def test_caller_model_unchanged(model, data):
    before = model.SerializeToString()
    collect_statistics(model, INTERMEDIATE, data)
    assert model.SerializeToString() == before


def test_unknown_tensor_names_it(model, data):
    with pytest.raises(UserError, match="'nope'"):
        collect_statistics(model, ["c1", "nope"], data)


def test_initializer_statistics(model, data):
    stats = collect_statistics(model, ["W1"], data)
    w1 = numpy_helper.to_array(model.graph.initializer[0])
    assert stats["W1"].min == pytest.approx(float(w1.min()))
    assert stats["W1"].count == w1.size


def test_external_data_model_by_path(model, data, tmp_path):
    path = tmp_path / "model.onnx"
    on_disk = onnx.ModelProto()
    on_disk.CopyFrom(model)  # saving with external data rewrites the proto in place
    onnx.save(
        on_disk,
        str(path),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="weights.bin",
        size_threshold=0,
    )
    assert (tmp_path / "weights.bin").is_file()
    from_path = collect_statistics(path, INTERMEDIATE, data, batch_size=3)
    in_memory = collect_statistics(model, INTERMEDIATE, data, batch_size=3)
    for name in INTERMEDIATE:
        assert from_path[name].to_dict() == in_memory[name].to_dict()


def test_fixed_batch_model_uses_its_batch_size():
    model = conv_model(batch=2)
    data = random_calibration_data(model, samples=5)
    assert data["x"].shape[0] == 6  # rounded up to whole batches
    stats = collect_statistics(model, ["r1"], data, batch_size=1)
    assert stats["r1"].count == 6 * 4 * 8 * 8


def test_histogram_rebinning_keeps_count_and_matches_one_shot():
    rng = np.random.default_rng(3)
    batches = [rng.standard_normal(5000) * scale for scale in (0.0, 0.5, 1.0, 3.0, 10.0, 2.0)]
    stats = TensorStatistics.empty(bins=512)
    for batch in batches:
        stats.update(batch.astype(np.float32))
    everything = np.concatenate(batches).astype(np.float32)
    assert stats.count == everything.size == int(stats.hist.sum())
    assert stats.min == pytest.approx(float(everything.min()))
    assert stats.hist_amax >= float(np.abs(everything).max())
    one_shot, _ = np.histogram(np.abs(everything), bins=512, range=(0.0, stats.hist_amax))
    # growing by whole multiples merges bins exactly; only float rounding at edges may differ
    assert np.abs(one_shot - stats.hist).sum() <= 0.001 * everything.size


def test_statistics_ignore_non_finite_values():
    stats = TensorStatistics.empty(bins=16)
    stats.update(np.array([1.0, -2.0, np.inf, -np.inf, np.nan], dtype=np.float32))
    assert (stats.min, stats.max, stats.count) == (-2.0, 1.0, 2)


def test_statistics_dict_round_trip_is_json():
    stats = TensorStatistics.empty(bins=32)
    stats.update(np.linspace(-1, 3, 100))
    again = TensorStatistics.from_dict(json.loads(json.dumps(stats.to_dict())))
    assert again.to_dict() == stats.to_dict()
    assert np.array_equal(again.hist, stats.hist)


# ---------------------------------------------------------------------------------------- scales


def heavy_tailed_stats(relu: bool = False) -> TensorStatistics:
    rng = np.random.default_rng(5)
    x = rng.laplace(size=50_000)
    x[:5] *= 40.0  # a few outliers that clipping methods should cut
    if relu:
        x = np.maximum(x, 0.0)
    stats = TensorStatistics.empty()
    for chunk in np.array_split(x, 4):
        stats.update(chunk)
    return stats


@pytest.mark.parametrize("quant_type", QUANT_TYPES)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("relu", [False, True])
def test_every_method_gives_sane_params(method, quant_type, relu):
    stats = heavy_tailed_stats(relu)
    scale, zp = activation_params(stats, method=method, quant_type=quant_type)
    minmax, _ = activation_params(stats, method="minmax", quant_type=quant_type)
    assert math.isfinite(scale) and scale > 0
    assert scale <= minmax * (1 + 1e-6)
    if quant_type == "uint8":
        assert 0 <= zp <= 255
        assert zp == 0 if relu else zp > 0
    else:
        assert zp == 0


@pytest.mark.parametrize("method", ["entropy", "mse", "percentile"])
def test_clipping_methods_cut_outliers(method):
    stats = heavy_tailed_stats()
    scale, _ = activation_params(stats, method=method, quant_type="int8", percentile=99.9)
    assert 0 < scale * 127 < 0.8 * stats.amax


@pytest.mark.parametrize("quant_type", QUANT_TYPES)
def test_entropy_not_dragged_down_by_relu_zeros(quant_type):
    stats = TensorStatistics.empty()
    stats.update(np.maximum(np.random.default_rng(2).standard_normal(50_000), 0.0))
    scale, _ = activation_params(stats, method="entropy", quant_type=quant_type)
    qmax = {"int8": 127, "uint8": 255, "fp8": 448}[quant_type]
    assert 0.8 * stats.amax < scale * qmax <= stats.amax * (1 + 1e-6)


def test_minmax_formulas():
    stats = TensorStatistics.empty()
    stats.update(np.array([-2.0, 0.5, 6.0]))
    assert activation_params(stats, method="minmax", quant_type="int8") == (
        pytest.approx(6.0 / 127),
        0,
    )
    assert activation_params(stats, method="minmax", quant_type="fp8") == (
        pytest.approx(6.0 / 448),
        0,
    )
    scale, zp = activation_params(stats, method="minmax", quant_type="uint8")
    assert scale == pytest.approx(8.0 / 255)
    assert zp == round(2.0 / scale)


def test_uint8_range_always_contains_zero():
    stats = TensorStatistics.empty()
    stats.update(np.array([1.0, 3.0]))
    scale, zp = activation_params(stats, method="minmax", quant_type="uint8")
    assert (scale, zp) == (pytest.approx(3.0 / 255), 0)


def test_percentile_never_exceeds_minmax():
    stats = heavy_tailed_stats()
    p_scale, _ = activation_params(stats, method="percentile", quant_type="int8", percentile=99.0)
    hundred, _ = activation_params(stats, method="percentile", quant_type="int8", percentile=100)
    minmax, _ = activation_params(stats, method="minmax", quant_type="int8")
    assert p_scale < hundred == pytest.approx(minmax)


@pytest.mark.parametrize("method", METHODS)
def test_all_zero_tensor_gets_floor_scale(method):
    stats = TensorStatistics.empty()
    stats.update(np.zeros(100))
    for quant_type in QUANT_TYPES:
        assert activation_params(stats, method=method, quant_type=quant_type) == (MIN_SCALE, 0)


def test_bad_method_and_options_name_the_option():
    stats = heavy_tailed_stats()
    with pytest.raises(OptionError, match="--calibration-method.*'kl'"):
        activation_params(stats, method="kl", quant_type="int8")
    with pytest.raises(OptionError, match="'int4'"):
        activation_params(stats, method="minmax", quant_type="int4")
    with pytest.raises(OptionError, match="--percentile"):
        activation_params(stats, method="percentile", quant_type="int8", percentile=0)


def test_activation_scales_for_collected_tensors(model, data):
    stats = collect_statistics(model, INTERMEDIATE, data)
    scales = activation_scales(stats, method="entropy", quant_type="int8")
    assert set(scales) == set(INTERMEDIATE)
    assert all(s > 0 and zp == 0 for s, zp in scales.values())


# ----------------------------------------------------------------------------------------- cache


def test_cache_round_trip_and_fingerprint(model, data, tmp_path):
    stats = collect_statistics(model, INTERMEDIATE, data)
    folder = RunFolder(tmp_path / "out")  # the run folder writes the cache, atomically
    folder.write_calibration_stats(statistics_json(stats, fingerprint="abc"))
    path = folder.calibration_stats
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp left
    loaded = load_statistics(path, fingerprint="abc")
    assert loaded is not None
    assert {n: s.to_dict() for n, s in loaded.items()} == {n: s.to_dict() for n, s in stats.items()}
    assert load_statistics(path, fingerprint="other") is None
    assert load_statistics(tmp_path / "missing.json", fingerprint="abc") is None
    path.write_text("{not json")
    assert load_statistics(path, fingerprint="abc") is None


# ------------------------------------------------------------------------------ calibration data


def test_load_calibration_data_casts_float64(tmp_path):
    model = two_input_model()
    path = tmp_path / "calib.npz"
    np.savez(path, x=np.ones((4, 3, 4)), ids=np.zeros((4, 7), dtype=np.int32))
    data = load_calibration_data(path, model)
    assert data["x"].dtype == np.float32 and data["ids"].dtype == np.int64


@pytest.mark.parametrize(
    ("arrays", "expected"),
    [
        ({"x": np.ones((4, 3, 4), np.float32)}, "'ids' is missing"),
        (
            {"x": np.ones((4, 3, 4), np.float32), "ids": np.zeros((4, 2)), "extra": np.ones(3)},
            "'extra' is not a model input",
        ),
        ({"x": np.ones((4, 3, 4), np.int64), "ids": np.zeros((4, 2), np.int64)}, "'x' has dtype"),
        ({"x": np.ones((4, 3, 4), np.float32), "ids": np.zeros((4, 2))}, "'ids' has dtype"),
        ({"x": np.ones((4, 3), np.float32), "ids": np.zeros((4, 2), np.int64)}, "'x' has shape"),
        ({"x": np.ones((4, 3, 5), np.float32), "ids": np.zeros((4, 2), np.int64)}, "axis 2"),
        (
            {"x": np.ones((4, 3, 4), np.float32), "ids": np.zeros((5, 2), np.int64)},
            "different sample counts",
        ),
        ({"x": np.ones((0, 3, 4), np.float32), "ids": np.zeros((0, 2), np.int64)}, "no samples"),
        ({}, "no arrays"),
    ],
)
def test_load_calibration_data_errors_name_file_and_input(tmp_path, arrays, expected):
    path = tmp_path / "calib.npz"
    np.savez(path, **arrays)
    with pytest.raises(UserError) as err:
        load_calibration_data(path, two_input_model())
    message = str(err.value)
    assert str(path) in message and expected in message
    assert "\n" not in message


def test_load_calibration_data_bad_files(tmp_path):
    model = two_input_model()
    with pytest.raises(UserError, match="missing.npz.*not found"):
        load_calibration_data(tmp_path / "missing.npz", model)
    text = tmp_path / "calib.npz"
    text.write_text("hello")
    with pytest.raises(UserError, match="calib.npz.*not an .npz file"):
        load_calibration_data(text, model)
    single = tmp_path / "single.npy"
    np.save(single, np.ones((2, 3, 4), np.float32))
    with pytest.raises(UserError, match="single.npy.*numpy.savez"):
        load_calibration_data(single, model)


def test_random_calibration_data_shapes():
    model = two_input_model()
    with pytest.raises(UserError, match="'ids'.*--input-shapes"):
        random_calibration_data(model)
    data = random_calibration_data(model, {"ids": (1, 6)}, samples=3)
    assert data["x"].shape == (3, 3, 4) and data["x"].dtype == np.float32
    assert data["ids"].shape == (3, 6) and not data["ids"].any()
    with pytest.raises(UserError, match="--input-shapes.*'x'"):
        random_calibration_data(model, {"ids": (1, 6), "x": (1, 3, 5)})
    with pytest.raises(UserError, match="--input-shapes.*'nope'"):
        random_calibration_data(model, {"nope": (1,)})
    again = random_calibration_data(model, {"ids": (1, 6)}, samples=3)
    assert np.array_equal(again["x"], data["x"])  # seeded


def _optimized_ops(model_bytes: bytes, tmp_path) -> collections.Counter:
    """Op types of ONNX Runtime's fully optimized graph (what its CPU build runs)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    so.log_severity_level = 3
    ort.InferenceSession(model_bytes, so, providers=["CPUExecutionProvider"])
    return collections.Counter(n.op_type for n in onnx.load(so.optimized_model_filepath).graph.node)


def _yolo_scales(method: str):
    """The small YOLO-like zoo model under ONNX Runtime rules and its own activation scales."""
    from qdq_optuna.examples import zoo
    from qdq_optuna.runtimes.prepared import PreparedModel

    pm = PreparedModel.prepare(zoo.build("yolo", "small"), runtime="onnxruntime")
    data = random_calibration_data(pm.graph.full_model(), None, samples=2, seed=0)
    stats = collect_statistics(pm.graph.full_model(), pm.candidate_tensors(), data)
    return pm, activation_scales(stats, method=method, quant_type=pm.quant_type)


def test_shared_scales_let_onnxruntime_run_maxpool_and_split_on_8_bit_data(tmp_path):
    """As quantize_static does: MaxPool's and Split's outputs carry their input's scale, so
    ONNX Runtime drops their DQ -> op -> Q (SPPF's MaxPools become NhwcMaxPool); with scales of
    their own, Q/DQ stay around float MaxPool and Split."""
    from qdq_optuna.placement import starts

    pm, own = _yolo_scales("minmax")
    shared = share_input_scales(pm.graph.nodes, own)
    for node in pm.graph.nodes:
        if node.op_type in SAME_SCALE_OPS and node.input[0] in own:
            assert all(shared[o] == shared[node.input[0]] for o in node.output)
    uses = set(starts.all_on_start(pm).scheme_uses)
    ops = {}
    for name, scales in (("own", own), ("shared", shared)):
        exporter = pm.exporter(scales)
        source = exporter.source(exporter.plan(uses))
        ops[name] = _optimized_ops(source if isinstance(source, bytes)
                                   else source.SerializeToString(), tmp_path)
    assert ops["own"]["QuantizeLinear"] > 2 and "NhwcMaxPool" not in ops["own"]
    # shared: only the graph input's Q and the output's DQ are left; MaxPool runs on uint8
    assert ops["shared"]["QuantizeLinear"] == 1 and ops["shared"]["DequantizeLinear"] == 1
    assert ops["shared"]["NhwcMaxPool"] == 3


def _qlinear_concat_copies(model_bytes: bytes, tmp_path) -> tuple[int, int]:
    """(inputs ONNX Runtime's QLinearConcat copies, inputs it requantizes) in its optimized
    graph: a copy needs the input's scale and zero point to equal the output's."""
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / "optimized_concat.onnx")
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    ort.InferenceSession(model_bytes, so, providers=["CPUExecutionProvider"])
    graph = onnx.load(so.optimized_model_filepath).graph
    inits = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    copies = requants = 0
    for node in graph.node:
        if node.op_type != "QLinearConcat":
            continue
        for j in range(2, len(node.input), 3):
            same = (inits[node.input[j + 1]] == inits[node.input[0]]
                    and inits[node.input[j + 2]] == inits[node.input[1]])
            copies, requants = copies + same, requants + (not same)
    return copies, requants


def test_concat_scales_let_onnxruntime_copy_concat_inputs(tmp_path):
    """With each tensor's own percentile scale nearly every Concat input of the YOLO-like model
    is requantized by QLinearConcat; sharing the Concat's parameters with its inputs of a
    comparable range turns most into copies, keeps SAME_SCALE_OPS ties (MaxPool still runs on
    uint8) and leaves every tensor in its group's range."""
    from qdq_optuna.placement import starts

    pm, own = _yolo_scales("percentile")
    before = share_input_scales(pm.graph.nodes, own)
    after = share_concat_scales(pm.graph.nodes, before, pm.quant_type)
    for node in pm.graph.nodes:
        if node.op_type in SAME_SCALE_OPS and node.input[0] in after:
            assert all(after[o] == after[node.input[0]] for o in node.output)
    for name in after:  # a shared range covers the tensor's own (to the zero point's rounding)
        lo, hi = _param_range(before[name], "uint8")
        lo2, hi2 = _param_range(after[name], "uint8")
        step = after[name][0]
        assert lo2 <= lo + step and hi2 >= hi - step
    uses = set(starts.all_on_start(pm).scheme_uses)
    counts, ops = {}, {}
    for name, scales in (("before", before), ("after", after)):
        exporter = pm.exporter(scales)
        source = exporter.source(exporter.plan(uses))
        blob = source if isinstance(source, bytes) else source.SerializeToString()
        counts[name] = _qlinear_concat_copies(blob, tmp_path)
        ops[name] = _optimized_ops(blob, tmp_path)
    assert sum(counts["before"]) == sum(counts["after"]) > 0
    assert counts["after"][0] >= counts["before"][0] + 4
    assert counts["after"][1] <= sum(counts["after"]) // 4
    assert ops["after"]["NhwcMaxPool"] == ops["before"]["NhwcMaxPool"] > 0


def test_concat_of_unlike_ranges_keeps_its_requantization():
    """Box coordinates (0..640) and class scores (0..1) concatenated: the scores keep their
    own scale (sharing would leave them 2 of 255 levels); inputs of like range share."""
    nodes = [helper.make_node("Concat", ["box", "cls"], ["det"], axis=1),
             helper.make_node("Concat", ["a", "b"], ["ab"], axis=1)]
    scales = {"box": (640 / 255, 0), "cls": (1 / 255, 0), "det": (640 / 255, 0),
              "a": (4 / 255, 64), "b": (3 / 255, 60), "ab": (3.5 / 255, 60)}
    out = share_concat_scales(nodes, scales, "uint8")
    assert out["cls"] == scales["cls"] and out["box"] == out["det"]
    assert out["a"] == out["b"] == out["ab"] != scales["a"]
    lo, hi = -64 * 4 / 255, 191 * 4 / 255  # a's range: the widest at both ends
    scale, zp = out["ab"]
    assert scale == pytest.approx((hi - lo) / 255, rel=1e-6) and zp == round(-lo / scale)
    assert share_concat_scales(nodes, scales, "uint8", ratio=1.1) == scales  # nothing joins


def test_concat_scales_symmetric_int8():
    nodes = [helper.make_node("Concat", ["a", "b"], ["y"], axis=0)]
    out = share_concat_scales(nodes, {"a": (0.02, 0), "b": (0.03, 0), "y": (0.025, 0)}, "int8")
    assert out["a"] == out["b"] == out["y"] == (pytest.approx(0.03), 0)
