"""Tests for the synthetic model zoo: the models other tests and benchmarks stand on."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from qdq_optuna.examples import zoo

SMALL_NAMES = ["resnet", "mobilenet", "yolo", "transformer"]
TINY_NAMES = ["tiny_chain", "tiny_residual", "tiny_concat", "tiny_attention"]
ALL_NAMES = SMALL_NAMES + TINY_NAMES


@pytest.fixture(scope="module")
def models() -> dict[str, onnx.ModelProto]:
    return {name: zoo.build(name, "small") for name in ALL_NAMES}


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def _feeds(model: onnx.ModelProto, batch: int = 1, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {}
    for vi in model.graph.input:
        tt = vi.type.tensor_type
        shape = [batch if d.dim_param else d.dim_value for d in tt.shape.dim]
        if tt.elem_type == onnx.TensorProto.INT64:
            feeds[vi.name] = rng.integers(0, 50, size=shape, dtype=np.int64)
        else:
            feeds[vi.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def _run(model: onnx.ModelProto, batch: int = 1) -> list[np.ndarray]:
    return _session(model).run(None, _feeds(model, batch))


def _producers(model: onnx.ModelProto) -> dict[str, onnx.NodeProto]:
    return {out: node for node in model.graph.node for out in node.output}


def _ops(model: onnx.ModelProto) -> Counter[str]:
    return Counter(node.op_type for node in model.graph.node)


@pytest.mark.parametrize("name", ALL_NAMES)
def test_valid_onnx(models: dict[str, onnx.ModelProto], name: str) -> None:
    m = models[name]
    onnx.checker.check_model(m, full_check=True)
    assert m.ir_version == zoo.IR_VERSION
    assert [(o.domain, o.version) for o in m.opset_import] == [("", zoo.OPSET)]
    assert len(m.graph.value_info) > 0


@pytest.mark.parametrize("name", ALL_NAMES)
def test_runs_in_onnxruntime(models: dict[str, onnx.ModelProto], name: str) -> None:
    m = models[name]
    outputs = _run(m)
    assert len(outputs) == len(m.graph.output)
    for out, vi in zip(outputs, m.graph.output):
        assert list(out.shape) == [d.dim_value for d in vi.type.tensor_type.shape.dim]
        assert out.dtype == np.float32
        assert np.isfinite(out).all()
        # Sensible init: activations neither vanish nor explode.
        assert 1e-3 < float(np.std(out)) < 100.0


@pytest.mark.parametrize("name", ALL_NAMES)
def test_deterministic(models: dict[str, onnx.ModelProto], name: str) -> None:
    assert zoo.build(name, "small").SerializeToString() == models[name].SerializeToString()


@pytest.mark.parametrize("name", TINY_NAMES)
def test_seed_changes_weights_not_structure(name: str) -> None:
    a, b = zoo.EXAMPLES[name](seed=0), zoo.EXAMPLES[name](seed=1)
    assert a.SerializeToString() != b.SerializeToString()
    assert [n.SerializeToString() for n in a.graph.node] == [
        n.SerializeToString() for n in b.graph.node
    ]


@pytest.mark.parametrize("name", ALL_NAMES)
def test_names_unique(models: dict[str, onnx.ModelProto], name: str) -> None:
    g = models[name].graph
    node_names = [n.name for n in g.node]
    assert all(node_names)
    assert len(set(node_names)) == len(node_names)
    tensors = [t.name for t in g.initializer] + [i.name for i in g.input]
    tensors += [o for n in g.node for o in n.output]
    assert len(set(tensors)) == len(tensors)


@pytest.mark.parametrize("name", TINY_NAMES)
def test_tiny_models_are_tiny(models: dict[str, onnx.ModelProto], name: str) -> None:
    m = models[name]
    assert len(m.graph.node) < 50
    for vi in list(m.graph.value_info) + list(m.graph.input):
        dims = [d.dim_value for d in vi.type.tensor_type.shape.dim]
        if len(dims) == 4:
            assert max(dims[2:]) <= 16


@pytest.mark.parametrize("name", SMALL_NAMES)
def test_dynamic_batch(name: str) -> None:
    m = zoo.small(name, dynamic_batch=True)
    onnx.checker.check_model(m, full_check=True)
    for vi in list(m.graph.input) + list(m.graph.output):
        dims = vi.type.tensor_type.shape.dim
        assert dims[0].dim_param == "batch"
        assert all(d.dim_value > 0 for d in dims[1:])
    fixed = _run(zoo.small(name), batch=1)
    for batch in (1, 3):
        outs = _run(m, batch=batch)
        assert outs[0].shape[0] == batch
        assert np.isfinite(outs[0]).all()
    # Same weights and graph: batch 1 through the dynamic model equals the static one.
    np.testing.assert_allclose(_run(m, batch=1)[0], fixed[0], rtol=1e-4, atol=1e-4)


def test_stable_io_names(models: dict[str, onnx.ModelProto]) -> None:
    io = {
        name: ([i.name for i in m.graph.input], [o.name for o in m.graph.output])
        for name, m in models.items()
    }
    assert io["resnet"] == (["input"], ["logits"])
    assert io["mobilenet"] == (["input"], ["logits"])
    assert io["yolo"] == (["input"], ["output"])
    assert io["transformer"] == (["input_ids"], ["hidden_states"])
    assert io["tiny_attention"] == (["x"], ["y"])
    for name in ("tiny_chain", "tiny_residual", "tiny_concat"):
        assert io[name] == (["input"], ["output"])


def test_resnet_structure(models: dict[str, onnx.ModelProto]) -> None:
    m = models["resnet"]
    ops = _ops(m)
    assert ops["Conv"] == ops["BatchNormalization"] == 1 + 4 * 2 + 3
    assert ops["Add"] == 4 and ops["MaxPool"] == 1 and ops["Gemm"] == 1
    producers = _producers(m)
    adds = [n for n in m.graph.node if n.op_type == "Add"]
    two_branch = [
        a for a in adds if all(producers[i].op_type == "BatchNormalization" for i in a.input)
    ]
    assert len(two_branch) == 3  # layer2-4 downsample; layer1 keeps the identity shortcut
    for a in two_branch:
        convs = [producers[producers[i].input[0]] for i in a.input]
        assert all(c.op_type == "Conv" for c in convs)
    gemm = next(n for n in m.graph.node if n.op_type == "Gemm")
    assert len(gemm.input) == 3
    assert {a.name: a.i for a in gemm.attribute}["transB"] == 1


def test_resnet_fold_bn_is_equivalent() -> None:
    plain = zoo.small("resnet")
    folded = zoo.small("resnet", fold_bn=True)
    onnx.checker.check_model(folded, full_check=True)
    ops = _ops(folded)
    assert "BatchNormalization" not in ops
    assert ops["Conv"] == _ops(plain)["Conv"]
    producers = _producers(folded)
    adds = [n for n in folded.graph.node if n.op_type == "Add"]
    assert sum(all(producers[i].op_type == "Conv" for i in a.input) for a in adds) == 3
    np.testing.assert_allclose(_run(folded)[0], _run(plain)[0], rtol=1e-3, atol=1e-3)


def test_mobilenet_structure(models: dict[str, onnx.ModelProto]) -> None:
    m = models["mobilenet"]
    ops = _ops(m)
    assert 15 <= ops["Conv"] <= 20
    assert ops["Clip"] > 0 and ops["Add"] >= 2
    depthwise = [
        n
        for n in m.graph.node
        if n.op_type == "Conv" and {a.name: a.i for a in n.attribute}["group"] > 1
    ]
    assert len(depthwise) >= 5
    inits = {t.name: t for t in m.graph.initializer}
    for n in depthwise:
        w = inits[n.input[1]]
        assert w.dims[1] == 1 and w.dims[0] == {a.name: a.i for a in n.attribute}["group"]
    for n in m.graph.node:
        if n.op_type == "Clip":
            lo, hi = (onnx.numpy_helper.to_array(inits[i]) for i in n.input[1:])
            assert (float(lo), float(hi)) == (0.0, 6.0)


def test_yolo_structure(models: dict[str, onnx.ModelProto]) -> None:
    m = models["yolo"]
    ops = _ops(m)
    concats = [n for n in m.graph.node if n.op_type == "Concat"]
    assert len(concats) >= 3
    assert {len(n.input) for n in concats} >= {2, 3, 4}
    assert ops["Split"] >= 1 and ops["Resize"] == 2 and ops["MaxPool"] == 3
    assert ops["Sigmoid"] == ops["Mul"] > 0  # SiLU as x * sigmoid(x)
    producers = _producers(m)
    for n in m.graph.node:
        if n.op_type == "Mul":
            assert producers[n.input[1]].op_type == "Sigmoid"
            assert producers[n.input[1]].input[0] == n.input[0]
    inits = {t.name for t in m.graph.initializer}
    for n in m.graph.node:
        if n.op_type == "Resize":
            assert n.input[2] in inits
    # SPPF: three chained MaxPools, all concatenated with their source.
    sppf = [n for n in concats if sum(producers[i].op_type == "MaxPool" for i in n.input) == 3]
    assert len(sppf) == 1
    assert len(sppf[0].input) == 4


def test_transformer_structure(models: dict[str, onnx.ModelProto]) -> None:
    m = models["transformer"]
    ops = _ops(m)
    assert m.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.INT64
    gather = next(n for n in m.graph.node if n.op_type == "Gather")
    assert gather.input[1] == "input_ids"
    assert ops["LayerNormalization"] == 1 + 2 * 2
    assert ops["Softmax"] == 2 and ops["Erf"] == 2
    inits = {t.name: t for t in m.graph.initializer}
    for n in m.graph.node:
        if n.op_type == "Reshape":
            assert inits[n.input[1]].data_type == onnx.TensorProto.INT64
    _assert_qkv_fan_out(m, layers=2)


def test_tiny_attention_structure(models: dict[str, onnx.ModelProto]) -> None:
    m = models["tiny_attention"]
    ops = _ops(m)
    assert "Gather" not in ops
    assert ops["LayerNormalization"] == 2 and ops["Softmax"] == 1
    x = m.graph.input[0]
    assert [d.dim_value for d in x.type.tensor_type.shape.dim] == [1, 8, 16]
    _assert_qkv_fan_out(m, layers=1)


def _assert_qkv_fan_out(m: onnx.ModelProto, layers: int) -> None:
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in m.graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    fan_out = [
        t for t, users in consumers.items() if sum(u.op_type == "MatMul" for u in users) == 3
    ]
    assert len(fan_out) == layers


@pytest.mark.parametrize(
    ("name", "convs", "concats"),
    [("tiny_chain", 2, 0), ("tiny_residual", 6, 0), ("tiny_concat", 5, 2)],
)
def test_tiny_conv_structure(
    models: dict[str, onnx.ModelProto], name: str, convs: int, concats: int
) -> None:
    ops = _ops(models[name])
    assert ops["Conv"] == convs and ops["Concat"] == concats


def test_build_and_small_errors() -> None:
    with pytest.raises(ValueError, match="'nope'.*resnet.*tiny_attention"):
        zoo.build("nope")
    with pytest.raises(ValueError, match="'nope'"):
        zoo.small("nope")
    with pytest.raises(ValueError, match="size"):
        zoo.build("resnet", "huge")
    assert set(zoo.EXAMPLES) == set(ALL_NAMES)
    assert zoo.build("tiny_chain").SerializeToString() == zoo.tiny_chain().SerializeToString()


def test_full_resnet_parameter_count() -> None:
    m = zoo.resnet_like()
    params = sum(int(np.prod(t.dims)) for t in m.graph.initializer)
    assert 11_000_000 <= params <= 12_500_000
    assert [d.dim_value for d in m.graph.input[0].type.tensor_type.shape.dim] == [1, 3, 224, 224]


@pytest.mark.parametrize("name", ALL_NAMES)
def test_value_info_matches_full_shape_inference(
    models: dict[str, onnx.ModelProto], name: str
) -> None:
    # The builder infers shapes on a weight-free copy for speed; it must agree with the real thing.
    m = models[name]
    full = onnx.shape_inference.infer_shapes(m, strict_mode=True)
    assert [v.SerializeToString() for v in full.graph.value_info] == [
        v.SerializeToString() for v in m.graph.value_info
    ]
    assert not any(d.dim_param for v in m.graph.value_info for d in v.type.tensor_type.shape.dim)
