"""load_model: every unusable input is one clear UserError naming the file / tensor / option,
and neither the user's file nor the user's ModelProto is ever modified."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from hypothesis import given
from onnx import TensorProto, helper, numpy_helper
from strategies import PROPERTY, dag_models, run_ort

from qdq_optuna.errors import ModelError, OptionError, UserError
from qdq_optuna.examples import zoo
from qdq_optuna.model.graph import (
    Graph,
    InputShapes,
    ensure_opset,
    load_model,
    node_label,
    opset_of,
    ort_basic_optimize,
)


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    return out


def _write(path: Path, model: onnx.ModelProto) -> Path:
    path.write_bytes(model.SerializeToString())
    return path


def _fails(
    path: Path | onnx.ModelProto,
    error: type[UserError],
    *needles: str,
    shapes: InputShapes | None = None,
) -> str:
    """load_model(path) raises ``error`` whose message contains every needle; the file's bytes
    are unchanged afterwards."""
    before = path.read_bytes() if isinstance(path, Path) and path.is_file() else None
    with pytest.raises(error) as info:
        load_model(path, shapes)
    message = str(info.value)
    assert isinstance(info.value, UserError)
    assert "\n" not in message.strip(), f"not one line: {message!r}"
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"
    if before is not None:
        assert path.read_bytes() == before, "load_model modified the file"
    return message


@pytest.fixture
def chain() -> onnx.ModelProto:
    return zoo.tiny_chain()


@pytest.fixture
def chain_file(tmp_path, chain) -> Path:
    return _write(tmp_path / "chain.onnx", chain)


# -- unreadable files ------------------------------------------------------------------------


def test_missing_file(tmp_path):
    _fails(tmp_path / "nope.onnx", ModelError, "nope.onnx", "no such file")


def test_directory(tmp_path):
    folder = tmp_path / "model.onnx"
    folder.mkdir()
    _fails(folder, ModelError, "model.onnx", "directory")


def test_empty_file(tmp_path):
    path = tmp_path / "empty.onnx"
    path.write_bytes(b"")
    _fails(path, ModelError, "empty.onnx", "empty")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_bytes(tmp_path, seed):
    path = tmp_path / f"random{seed}.onnx"
    path.write_bytes(np.random.default_rng(seed).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    _fails(path, ModelError, f"random{seed}.onnx")


def test_truncated_protobuf(tmp_path, chain):
    data = chain.SerializeToString()
    path = tmp_path / "truncated.onnx"
    path.write_bytes(data[: len(data) // 2])
    _fails(path, ModelError, "truncated.onnx")


def test_text_file(tmp_path):
    path = tmp_path / "notes.onnx"
    path.write_text("this is not a model\n")
    _fails(path, ModelError, "notes.onnx")


def test_protobuf_without_nodes(tmp_path):
    model = helper.make_model(helper.make_graph([], "g", [], []))
    _fails(_write(tmp_path / "hollow.onnx", model), ModelError, "hollow.onnx", "no nodes")


# -- invalid graphs --------------------------------------------------------------------------


def test_unsorted_nodes(tmp_path, chain):
    model = _copy(chain)
    nodes = list(model.graph.node)
    del model.graph.node[:]
    model.graph.node.extend(reversed(nodes))
    _fails(_write(tmp_path / "unsorted.onnx", model), ModelError, "unsorted.onnx", "sorted")


def test_cycle(tmp_path, chain):
    model = _copy(chain)
    # conv1 now reads relu1's output: conv1 -> relu1 -> conv1
    model.graph.node[0].input[0] = model.graph.node[1].output[0]
    _fails(_write(tmp_path / "cycle.onnx", model), ModelError, "cycle.onnx", "relu1_out")


def test_cycle_in_memory_model(chain):
    model = _copy(chain)
    model.graph.node[0].input[0] = model.graph.node[1].output[0]
    before = model.SerializeToString()
    _fails(model, ModelError, "relu1_out")
    assert model.SerializeToString() == before


def test_missing_initializer(tmp_path, chain):
    model = _copy(chain)
    drop = next(i for i, t in enumerate(model.graph.initializer) if t.name == "conv2.weight")
    del model.graph.initializer[drop]
    _fails(_write(tmp_path / "noweight.onnx", model), ModelError, "noweight.onnx", "conv2.weight")


def test_missing_tensor_from_graph_index():
    """Graph.from_model itself refuses a node that reads an unknown tensor (no checker run)."""
    model = _copy(zoo.tiny_chain())
    model.graph.node[2].input[0] = "ghost"
    with pytest.raises(ModelError, match="ghost"):
        Graph.from_model(model)


def test_duplicate_node_names(tmp_path, chain):
    model = _copy(chain)
    model.graph.node[1].name = model.graph.node[0].name
    _fails(_write(tmp_path / "dup.onnx", model), ModelError, "dup.onnx", repr("conv1"))


def test_duplicate_unnamed_nodes_are_fine(chain):
    model = _copy(chain)
    model.graph.node[0].name = ""
    model.graph.node[1].name = ""
    graph = load_model(model)
    assert graph.name_of(0) == "#0" and graph.name_of(1) == "#1"
    assert graph.name_of(2) == "conv2"
    assert node_label(model.graph.node[1], 7) == "#7"


def test_unsupported_opset(tmp_path, chain):
    model = _copy(chain)
    model.opset_import[0].version = 24
    _fails(_write(tmp_path / "op24.onnx", model), ModelError, "op24.onnx", "24")


@pytest.mark.parametrize("opset", [7, 9])
def test_old_opset_file_is_upgraded(tmp_path, chain, opset):
    """An old opset is upgraded on loading, also with weights read aside from the file (the
    version converter once failed on those, which this test took for a refusal)."""
    model = _copy(chain)
    model.opset_import[0].version = opset
    path = _write(tmp_path / f"op{opset}.onnx", model)
    graph = load_model(path)
    assert graph.opset == 13 and graph.init_fields  # big weights were read aside


def test_already_quantized(tmp_path, chain):
    from qdq_optuna.placement.export import QDQExporter
    from qdq_optuna.runtimes.tensorrt import TENSORRT

    graph = load_model(chain)
    exporter = QDQExporter(graph, TENSORRT, "int8")
    quantized = exporter.to_model(exporter.plan(graph.uses("relu1_out")))
    path = _write(tmp_path / "quantized.onnx", quantized)
    _fails(path, ModelError, "quantized.onnx", "QuantizeLinear")
    assert load_model(path, allow_qdq=True).opset == 17


def test_dynamic_quantize_linear_is_refused(chain):
    model = _copy(chain)
    node = helper.make_node(
        "DynamicQuantizeLinear", ["input"], ["dq_y", "dq_scale", "dq_zp"], name="dyn_q"
    )
    model.graph.node.insert(0, node)
    _fails(model, ModelError, "DynamicQuantizeLinear")


# -- input shapes ----------------------------------------------------------------------------


@pytest.fixture
def dynamic_file(tmp_path) -> Path:
    return _write(tmp_path / "dynamic.onnx", zoo.small("resnet", dynamic_batch=True))


def test_symbolic_batch_needs_input_shapes(dynamic_file):
    message = _fails(dynamic_file, ModelError, repr("input"), "--input-shapes")
    assert "batch" in message


def test_symbolic_batch_fixed_by_input_shapes(dynamic_file):
    before = dynamic_file.read_bytes()
    graph = load_model(dynamic_file, InputShapes.parse("input:2x3x32x32"))
    assert graph.shapes["input"] == (2, 3, 32, 32)
    assert graph.shapes["logits"] == (2, 10)
    assert graph.path == dynamic_file
    assert dynamic_file.read_bytes() == before
    # the proto the Graph holds is our copy, with the fixed dims; it runs at that batch size
    out = run_ort(graph.full_model())
    assert out[0].shape == (2, 10)


def test_symbolic_dims_in_memory_model_untouched():
    model = zoo.small("resnet", dynamic_batch=True)
    before = model.SerializeToString()
    graph = load_model(model, InputShapes.parse("input:1x3x32x32"))
    assert graph.shapes["logits"] == (1, 10)
    assert model.SerializeToString() == before


@pytest.mark.parametrize(
    "spec",
    ["input", "input=1x3x32x32", "input:1x3x", "input:1,3", ":1x3x32x32", "input:axb",
     "input:-1x3"],
)
def test_input_shapes_bad_syntax(spec):
    with pytest.raises(OptionError) as info:
        InputShapes.parse(spec)
    assert "--input-shapes" in str(info.value)


@pytest.mark.parametrize("spec", ["input:0x3x32x32", "input:1x3x2000000x1"])
def test_input_shapes_bad_values(spec):
    with pytest.raises(OptionError, match="'input'"):
        InputShapes.parse(spec)


def test_input_shapes_roundtrip():
    shapes = InputShapes.parse("b:1x128, a:2x3x4x4")
    assert shapes.shapes == {"a": (2, 3, 4, 4), "b": (1, 128)}
    assert str(shapes) == "a:2x3x4x4,b:1x128"
    assert InputShapes.parse(str(shapes)) == shapes
    assert InputShapes.parse(None).shapes == {} and InputShapes.parse("").shapes == {}
    # names may contain ':' (rpartition)
    assert InputShapes.parse("ns:input:1x2").shapes == {"ns:input": (1, 2)}


def test_input_shapes_unknown_input(dynamic_file):
    _fails(
        dynamic_file, OptionError, "--input-shapes", repr("images"), "input",
        shapes=InputShapes.parse("images:1x3x32x32"),
    )


def test_input_shapes_wrong_rank(dynamic_file):
    _fails(
        dynamic_file, OptionError, "--input-shapes", repr("input"), "rank",
        shapes=InputShapes.parse("input:1x3x32"),
    )


def test_input_shapes_conflicting_static_dim(dynamic_file):
    _fails(
        dynamic_file, OptionError, "--input-shapes", repr("input"), "static dim",
        shapes=InputShapes.parse("input:1x4x32x32"),
    )


def test_input_without_shape(chain):
    model = _copy(chain)
    model.graph.input[0].type.tensor_type.ClearField("shape")
    _fails(model, ModelError, repr("input"), "--input-shapes")
    graph = load_model(model, InputShapes.parse("input:1x3x16x16"))
    assert graph.shapes["output"] == (1, 10)


# -- external data ---------------------------------------------------------------------------


def _save_external(folder: Path, model: onnx.ModelProto) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.onnx"
    onnx.save_model(  # converts its argument in place: give it a copy
        _copy(model), str(path), save_as_external_data=True, all_tensors_to_one_file=True,
        location="weights.bin", size_threshold=0,
    )
    return path


def _relocate(path: Path, location: str) -> None:
    model = onnx.load(str(path), load_external_data=False)
    for tensor in model.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = location
    path.write_bytes(model.SerializeToString())


def test_external_data_loads(tmp_path, chain):
    path = _save_external(tmp_path / "ext", chain)
    graph = load_model(path)
    weight = graph.initializer("conv1.weight")
    assert weight is not None and weight.data_location == TensorProto.DEFAULT
    original = next(t for t in chain.graph.initializer if t.name == "conv1.weight")
    expected = numpy_helper.to_array(original)
    np.testing.assert_array_equal(numpy_helper.to_array(weight), expected)


@pytest.mark.parametrize("location", ["../evil.bin", "sub/../../evil.bin"])
def test_external_data_outside_folder(tmp_path, chain, location):
    path = _save_external(tmp_path / "ext", chain)
    (tmp_path / "evil.bin").write_bytes((tmp_path / "ext" / "weights.bin").read_bytes())
    _relocate(path, location)
    message = _fails(path, ModelError, "model.onnx", location, "outside")
    assert "'conv1.weight'" in message or "'conv2.weight'" in message or ".weight" in message


def test_external_data_absolute_path(tmp_path, chain):
    path = _save_external(tmp_path / "ext", chain)
    target = tmp_path / "abs.bin"
    target.write_bytes((tmp_path / "ext" / "weights.bin").read_bytes())
    _relocate(path, str(target))
    _fails(path, ModelError, "model.onnx", "outside")


def test_external_data_missing_file(tmp_path, chain):
    path = _save_external(tmp_path / "ext", chain)
    _relocate(path, "gone.bin")
    _fails(path, ModelError, "model.onnx", "gone.bin", "missing")


def test_external_data_in_constant_node_outside_folder(tmp_path):
    """A Constant node's tensor attribute with external data is not an initializer; it must
    not be read from outside the model's folder either."""
    arr = np.arange(16, dtype=np.float32).reshape(1, 1, 4, 4)
    (tmp_path / "secret.bin").write_bytes(arr.tobytes())
    tensor = numpy_helper.from_array(arr, "k")
    tensor.ClearField("raw_data")
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", "../secret.bin"), ("offset", "0"), ("length", "64")):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    graph = helper.make_graph(
        [
            helper.make_node("Constant", [], ["k"], value=tensor, name="const"),
            helper.make_node("Add", ["x", "k"], ["y"], name="add"),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, 4, 4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    folder = tmp_path / "m"
    folder.mkdir()
    _fails(_write(folder / "model.onnx", model), ModelError, "model.onnx", "secret.bin")


# -- the in-memory model and the graph index -------------------------------------------------


@PROPERTY
@given(dag_models())
def test_load_model_never_modifies_input(model):
    before = model.SerializeToString()
    graph = load_model(model)
    assert model.SerializeToString() == before
    assert graph.model is not model
    # the index is consistent: every use points back at the tensor
    for tensor, uses in graph.consumers.items():
        for node, slot in uses:
            assert graph.nodes[node].input[slot] == tensor
    for tensor, (node, slot) in graph.producer.items():
        assert graph.nodes[node].output[slot] == tensor
    assert graph.graph_inputs == ["x"] or graph.graph_inputs[0] == model.graph.input[0].name
    for tensor, (node, _) in graph.producer.items():
        constant = graph.nodes[node].op_type == "Constant"
        assert graph.is_constant(tensor) == constant
        assert graph.is_activation(tensor) == (not constant)
    assert not any(graph.is_activation(t) for t in graph.initializers)


def test_graph_queries(chain):
    graph = load_model(chain)
    assert opset_of(graph.model) == graph.opset == 17
    assert graph.graph_inputs == ["input"] and graph.graph_outputs == ["output"]
    assert graph.producer_op("relu1_out") == "Relu"
    assert graph.producer_op("input") is None
    conv2 = next(i for i, n in enumerate(graph.nodes) if n.name == "conv2")
    assert graph.uses("relu1_out") == [("relu1_out", conv2, 0)]
    assert graph.is_constant("conv1.weight") and not graph.is_activation("conv1.weight")
    assert graph.is_activation("input") and graph.is_activation("relu1_out")
    assert graph.shapes["output"] == (1, 10)
    assert graph.initializer("nope") is None


def test_ensure_opset_upgrades_without_touching_the_input(chain):
    model = _copy(chain)
    model.opset_import[0].version = 11
    before = model.SerializeToString()
    assert ensure_opset(model, 11, "x") is model
    upgraded = ensure_opset(model, 13, "per-channel weights")
    assert opset_of(upgraded) == 13 and opset_of(model) == 11
    assert model.SerializeToString() == before
    onnx.checker.check_model(upgraded, full_check=True)


def test_ort_basic_optimize_names_every_node():
    model = zoo.small("resnet")
    before = model.SerializeToString()
    optimized = ort_basic_optimize(model)
    assert model.SerializeToString() == before
    names = [n.name for n in optimized.graph.node]
    assert all(names) and len(names) == len(set(names))
    # Conv+BN fused: no BatchNormalization left
    assert "BatchNormalization" not in {n.op_type for n in optimized.graph.node}
    graph = load_model(optimized)
    assert graph.shapes["logits"] == (1, 10)


def test_paths_accept_strings_and_pathlike(chain_file):
    assert load_model(str(chain_file)).path == chain_file
    assert load_model(os.fspath(chain_file)).graph_outputs == ["output"]


def test_ort_basic_optimize_names_do_not_collide():
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["a"]),  # unnamed: becomes "Relu_0"
         helper.make_node("Sigmoid", ["a"], ["y"], name="Relu_0")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    optimized = ort_basic_optimize(model)
    names = [n.name for n in optimized.graph.node]
    assert len(names) == len(set(names)), names
    load_model(optimized)


@PROPERTY
@given(dag_models())
def test_ort_basic_optimize_random_dags(model):
    before = model.SerializeToString()
    optimized = ort_basic_optimize(model)
    assert model.SerializeToString() == before
    names = [n.name for n in optimized.graph.node]
    assert all(names) and len(names) == len(set(names))
    graph = load_model(optimized)
    assert graph.graph_outputs == [o.name for o in model.graph.output]
    feeds = {"x": np.random.default_rng(1).standard_normal(
        [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]).astype(np.float32)}
    for a, b in zip(run_ort(model, feeds), run_ort(optimized, feeds)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
