"""Old models' weights: initializers listed as graph inputs (IR 3: a default value) and weights
computed at load time by ConstantOfShape from them (the onnx test data's "light" models), and
opset-9 files with real weights, upgraded on loading."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from qdq_optuna.model.graph import load_model, opset_of


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
