"""Old models' weights: initializers listed as graph inputs (IR 3: a default value) and weights
computed at load time by ConstantOfShape from them (the onnx test data's "light" models), and
opset-9 files with real weights, upgraded on loading."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from qdq_optuna.backends.onnxruntime_kernels import kernels_of
from qdq_optuna.model.data import fed_names, input_data
from qdq_optuna.model.graph import load_model, opset_of
from qdq_optuna.runtimes.prepared import PreparedModel


def _run(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def _opset9_file(tmp_path, channels: int = 64):
    """An opset-9 Conv model with real weights big enough to be read aside (see read_split)."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((channels, 3, 3, 3)).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.standard_normal(channels).astype(np.float32), "b")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
         helper.make_node("Relu", ["c"], ["y"])], "old",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, channels, 8, 8])], [w, b])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 9)], ir_version=4)
    path = tmp_path / "old.onnx"
    onnx.save(model, path)
    return path, model


def test_an_opset_9_file_with_real_weights_is_upgraded(tmp_path):
    """The weights read aside from the file have no data in the model the version converter
    gets; it checks every tensor, so they go to it as inputs and come back unchanged."""
    path, model = _opset9_file(tmp_path)
    graph = load_model(path)
    assert opset_of(graph.model) >= 13
    assert {"w", "b"} <= graph.initializers and graph.graph_inputs == ["x"]
    full = graph.full_model()
    onnx.checker.check_model(full, full_check=True)
    x = np.random.default_rng(1).standard_normal((1, 3, 8, 8)).astype(np.float32)
    np.testing.assert_array_equal(_run(full, {"x": x})[0], _run(model, {"x": x})[0])


def _ir3_model(opset: int = 9, ir_version: int = 3) -> onnx.ModelProto:
    """Two Convs whose weights ConstantOfShape computes from shape initializers, every
    initializer listed as a graph input (IR 3, as onnx-caffe2 wrote the onnx test data)."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(np.array([8, 3, 3, 3], np.int64), "w1_shape"),
             numpy_helper.from_array(np.array([8, 8, 3, 3], np.int64), "w2_shape"),
             numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "b1"),
             numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "b2"),
             numpy_helper.from_array(np.zeros((1, 8, 1, 1), np.float32), "offset")]
    value = helper.make_tensor("v", TensorProto.FLOAT, [1], [0.02])
    nodes = [helper.make_node("ConstantOfShape", ["w1_shape"], ["w1"], value=value),
             helper.make_node("ConstantOfShape", ["w2_shape"], ["w2"], value=value),
             helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1] * 4),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], name="conv2", pads=[1] * 4),
             helper.make_node("Add", ["c2", "offset"], ["a2"], name="add2"),
             helper.make_node("Relu", ["a2"], ["y"], name="relu2")]
    listed = [helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in inits]
    graph = helper.make_graph(
        nodes, "ir3", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])]
        + listed, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 16, 16])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)],
                             ir_version=ir_version)


def _x() -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(2).standard_normal((1, 3, 16, 16)).astype(np.float32)}


def test_default_inputs_become_constants_and_outputs_stay(tmp_path):
    """Initializers listed as inputs and fed by nobody are constants: ConstantOfShape is folded
    into the weights, the model computes the same, and the file is left as it was."""
    path = tmp_path / "ir3.onnx"
    onnx.save(_ir3_model(), path)
    before = path.read_bytes()
    pm = PreparedModel.prepare(path)
    g = pm.graph
    assert path.read_bytes() == before
    assert g.graph_inputs == ["x"]
    assert sorted(g.defaults_taken) == ["b1", "b2", "offset", "w1_shape", "w2_shape"]
    assert {"w1", "w2"} <= g.initializers
    assert not any(n.op_type == "ConstantOfShape" for n in g.nodes)
    assert "5 initializers" in pm.described_graph()["description"]
    full = g.full_model()
    assert [i.name for i in full.graph.input] == ["x"]
    np.testing.assert_allclose(_run(full, _x())[0], _run(_ir3_model(), _x())[0],
                               rtol=1e-6, atol=1e-6)


def test_folded_weights_run_as_integer_kernels():
    """With Q/DQ on every point, ONNX Runtime's optimized graph runs both Convs as QLinearConv:
    the weights are constants it can quantize (overridable inputs kept every Conv float)."""
    pm = PreparedModel.prepare(_ir3_model())  # opset 9: upgraded, IR 7 (overridable)
    exporter = pm.exporter()
    uses = set().union(*(pp.uses(pp.ids) for pp in pm.tunable))
    quantized = exporter.to_model(exporter.plan(uses))
    kernels = kernels_of(quantized)
    assert kernels.ops.get("QLinearConv", 0) == 2, dict(kernels.ops)
    assert kernels.ops.get("Conv", 0) == 0


def test_an_input_the_calibration_data_feeds_is_never_folded(tmp_path):
    """From IR 4 a default value the data feeds is an input to feed, not a constant: its
    initializer goes, the input stays, and the data's check accepts it. Below IR 4 ONNX Runtime
    lets nobody feed one, so it is a constant whatever the data says."""
    data = tmp_path / "calib.npz"
    rng = np.random.default_rng(3)
    np.savez(data, x=rng.standard_normal((1, 3, 16, 16)).astype(np.float32),
             offset=rng.standard_normal((1, 8, 1, 1)).astype(np.float32))
    assert sorted(fed_names(data)) == ["offset", "x"]
    assert "offset" in PreparedModel.prepare(
        _ir3_model(), fed_inputs=fed_names(data)).graph.defaults_taken
    original = _ir3_model(opset=13, ir_version=7)
    pm = PreparedModel.prepare(original, fed_inputs=fed_names(data))
    g = pm.graph
    assert g.graph_inputs == ["x", "offset"] and "offset" not in g.initializers
    assert "offset" not in g.defaults_taken and "b2" in g.defaults_taken
    feeds = input_data(data, g.model)
    assert set(feeds) == {"x", "offset"}
    got = _run(g.full_model(), feeds)[0]
    np.testing.assert_allclose(got, _run(original, feeds)[0], rtol=1e-6, atol=1e-6)
    assert not np.allclose(got, _run(original, {"x": feeds["x"]})[0])  # really fed


def test_the_recipe_quantizes_the_folded_weights_and_keeps_fed_inputs(tmp_path):
    """ONNX Runtime's recipe start reads the model as prepare does: on the IR 3 model every
    Conv is an integer kernel; an input its data feeds (IR 7) stays an input."""
    from qdq_optuna.runtimes import onnxruntime as ort_runtime

    (tmp_path / "a").mkdir()
    path = ort_runtime.ort_recipe_model(_ir3_model(), tmp_path / "a")
    assert kernels_of(onnx.load(path)).ops.get("QLinearConv", 0) == 2
    data = {"x": np.zeros((1, 3, 16, 16), np.float32), "offset": np.ones((1, 8, 1, 1), np.float32)}
    (tmp_path / "b").mkdir()
    path = ort_runtime.ort_recipe_model(_ir3_model(opset=13, ir_version=7), tmp_path / "b", data=data)
    assert [i.name for i in onnx.load(path).graph.input] == ["x", "offset"]


def test_fed_names_reads_only_what_it_can_without_draining(tmp_path):
    """Names come from an .npz's array list or a mapping's keys; a single .npy, a missing file
    or a reader give none (reading the data later reports what is wrong)."""
    np.save(tmp_path / "one.npy", np.zeros(3))
    assert fed_names(tmp_path / "one.npy") == ()
    assert fed_names(tmp_path / "missing.npz") == ()
    assert fed_names({"x": np.zeros(1), "offset": np.zeros(1)}) == ("x", "offset")
    assert fed_names(iter([{"x": np.zeros(1)}])) == ()
