"""Small generated models with the traits real third-party models showed (issue: real models).

Each builder returns a valid ``ModelProto`` that ONNX Runtime runs; ``tests/test_real_traits.py``
checks what the tool does with it.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

RNG_SEED = 0


def _w(rng: np.random.Generator, *shape: int, scale: float | None = None) -> np.ndarray:
    scale = scale if scale is not None else 1.0 / np.sqrt(np.prod(shape[1:]))
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def _model(nodes, inputs, outputs, inits=(), opset: int = 17) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "corpus", inputs, outputs, initializer=list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)],
                              ir_version=8 if opset >= 13 else 7)
    onnx.checker.check_model(model)
    return model


def _const(name: str, value: np.ndarray, node_name: str = "") -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], name=node_name,
                            value=numpy_helper.from_array(value, name))


def dynamic_minus_one() -> onnx.ModelProto:
    """paddle2onnx style: input dims ``[-1, 3, -1, -1]`` stored as ``dim_value: -1``, output
    ``[-1, 4]`` the same way."""
    rng = np.random.default_rng(RNG_SEED)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [-1, 3, -1, -1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [-1, 4])
    inits = [numpy_helper.from_array(_w(rng, 8, 3, 3, 3), "conv.w"),
             numpy_helper.from_array(_w(rng, 8, 4), "fc.w")]
    nodes = [
        helper.make_node("Conv", ["x", "conv.w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("GlobalAveragePool", ["r"], ["p"], name="pool"),
        helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
        helper.make_node("MatMul", ["f", "fc.w"], ["y"], name="fc"),
    ]
    return _model(nodes, [x], [y], inits)


def constant_weights() -> onnx.ModelProto:
    """paddle2onnx style: no initializers, every weight and bias a ``Constant`` node, none of
    the nodes named (``#index`` labels); one MatMul weight reaches it through a Transpose."""
    rng = np.random.default_rng(RNG_SEED)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 5])
    nodes = [
        _const("w1", _w(rng, 8, 3, 3, 3)), _const("b1", _w(rng, 8, scale=0.1)),
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        _const("w2", _w(rng, 8, 8, 3, 3)),
        helper.make_node("Conv", ["r1", "w2"], ["c2"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c2"], ["r2"]),
        helper.make_node("GlobalAveragePool", ["r2"], ["p"]),
        helper.make_node("Flatten", ["p"], ["f"]),
        _const("w3t", _w(rng, 5, 8)),
        helper.make_node("Transpose", ["w3t"], ["w3"], perm=[1, 0]),
        helper.make_node("MatMul", ["f", "w3"], ["y"]),
    ]
    return _model(nodes, [x], [y])


def integer_path() -> onnx.ModelProto:
    """A pattern with zero insertion points (magika's first op): the int32 input is reshaped
    (and passed through Identities: a region that fills the size limit) in a region of its
    own, in which no use is a float activation; the one-hot encoding after it (Shape, Expand,
    Equal, Cast) and a residual float block follow, which do get points."""
    rng = np.random.default_rng(RNG_SEED)
    ids = helper.make_tensor_value_info("ids", TensorProto.INT32, [1, 16])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, 8])
    inits = [numpy_helper.from_array(np.array([1, 16, 1], dtype=np.int64), "shape"),
             numpy_helper.from_array(np.array([8], dtype=np.int64), "depth"),
             numpy_helper.from_array(np.arange(8, dtype=np.int32).reshape(1, 1, 8), "classes"),
             numpy_helper.from_array(_w(rng, 8, 8), "fc1.w"),
             numpy_helper.from_array(_w(rng, 8, 8), "fc2.w")]
    nodes = [
        helper.make_node("Reshape", ["ids", "shape"], ["ids3_0"], name="reshape_ids"),
        *[helper.make_node("Identity", [f"ids3_{k}"], [f"ids3_{k + 1}"],
                           name=f"identity{k}") for k in range(9)],
        helper.make_node("Shape", ["ids"], ["ids_shape"], name="shape_of_ids"),
        helper.make_node("Concat", ["ids_shape", "depth"], ["hot_shape"], name="hot_shape",
                         axis=0),
        helper.make_node("Expand", ["classes", "hot_shape"], ["all_classes"], name="expand"),
        helper.make_node("Equal", ["ids3_9", "all_classes"], ["hot"], name="equal"),
        helper.make_node("Cast", ["hot"], ["x"], name="cast", to=TensorProto.FLOAT),
        helper.make_node("MatMul", ["x", "fc1.w"], ["m1"], name="fc1"),
        helper.make_node("Relu", ["m1"], ["r1"], name="relu1"),
        helper.make_node("MatMul", ["r1", "fc2.w"], ["m2"], name="fc2"),
        helper.make_node("Add", ["m2", "x"], ["s"], name="residual"),
        helper.make_node("Relu", ["s"], ["y"], name="relu2"),
    ]
    return _model(nodes, [ids], [y], inits)


def old_opset_unnamed() -> onnx.ModelProto:
    """Opset 11, no node named: upgrading it for per-channel weights (opset 13) makes onnx's
    version converter add nodes in the middle of the graph (around the Softmax)."""
    rng = np.random.default_rng(RNG_SEED)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 8, 8])
    inits = [numpy_helper.from_array(_w(rng, 8, 3, 3, 3), "w1"),
             numpy_helper.from_array(_w(rng, 8, 8, 1, 1), "w2")]
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Softmax", ["c1"], ["s"], axis=1),
        helper.make_node("Conv", ["s", "w2"], ["c2"]),
        helper.make_node("Relu", ["c2"], ["y"]),
    ]
    return _model(nodes, [x], [y], inits, opset=11)


def constant_batchnorm() -> onnx.ModelProto:
    """paddle2onnx style, as in every PP-OCR model: no node named, BatchNormalization parameters
    and Clip bounds (hardswish) as ``Constant`` nodes, which loading leaves in place (only
    weights of quantizable ops become initializers), placed before the nodes that read them."""
    rng = np.random.default_rng(RNG_SEED)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 8, 8])
    bn = [_const(f"bn_{k}", v) for k, v in [
        ("scale", 1 + 0.1 * _w(rng, 8, scale=1.0)), ("bias", _w(rng, 8, scale=0.1)),
        ("mean", _w(rng, 8, scale=0.1)), ("var", np.abs(1 + 0.1 * _w(rng, 8, scale=1.0)))]]
    nodes = [
        *bn, _const("lo", np.array(0.0, np.float32)), _const("hi", np.array(6.0, np.float32)),
        _const("three", np.array(3.0, np.float32)), _const("w1", _w(rng, 8, 3, 3, 3)),
        helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c1", "bn_scale", "bn_bias", "bn_mean", "bn_var"],
                         ["b1"]),
        helper.make_node("Add", ["b1", "three"], ["a1"]),
        helper.make_node("Clip", ["a1", "lo", "hi"], ["k1"]),
        helper.make_node("Mul", ["b1", "k1"], ["y"]),
    ]
    return _model(nodes, [x], [y])


def heavy_tail(cut: float = 3.3, gain: float = 100.0) -> onnx.ModelProto:
    """An activation with a heavy tail, like the PP-OCR detector's that broke a shipped model:
    a bulk around 0.8 (std 0.3) plus outliers of up to about 100 (``heavy``: ``gain`` x how far
    a Conv output exceeds ``cut``; on standard normal inputs 1 in 1,000 values at 3.3, 1 in
    16,000 at 4.6 (gain 300): rarer than the 99.99th percentile, given enough data). The next
    Conv subtracts the bulk's centre and amplifies (as a folded BatchNorm does), the Sigmoid
    output is near 0 in FP32. Min/max scales are set by the tail, so the bulk rounds to
    zero and the output lights up everywhere, as spurious detections do."""
    rng = np.random.default_rng(RNG_SEED)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 16, 16])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 16, 16])
    w1 = rng.standard_normal((8, 4, 1, 1)).astype(np.float32) / 2.0  # c1 ~ N(0, 1)
    inits = [numpy_helper.from_array(w1, "w1"),
             numpy_helper.from_array(np.array(cut, np.float32), "cut"),
             numpy_helper.from_array(np.array(gain, np.float32), "gain"),
             numpy_helper.from_array(np.array(0.3, np.float32), "spread"),
             numpy_helper.from_array(np.array(0.8, np.float32), "centre"),
             numpy_helper.from_array((np.eye(8, dtype=np.float32) * -10.0).reshape(8, 8, 1, 1),
                                     "w2"),
             numpy_helper.from_array(np.full(8, -1.0, np.float32), "b2")]
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1"),
        helper.make_node("Sub", ["c1", "cut"], ["over"], name="over"),
        helper.make_node("Relu", ["over"], ["tail"], name="tail"),
        helper.make_node("Mul", ["tail", "gain"], ["spike"], name="spike"),
        helper.make_node("Mul", ["c1", "spread"], ["scaled"], name="scaled"),
        helper.make_node("Add", ["scaled", "centre"], ["bulk"], name="bulk"),
        helper.make_node("Add", ["bulk", "spike"], ["heavy"], name="heavy"),
        helper.make_node("Conv", ["heavy", "w2", "b2"], ["c2"], name="conv2"),
        helper.make_node("Sigmoid", ["c2"], ["y"], name="sigmoid"),
    ]
    return _model(nodes, [x], [y], inits)


def computed_reshape() -> onnx.ModelProto:
    """paddle2onnx's flatten before the classifier head: a Reshape whose target shape is
    computed at run time (Shape -> Cast -> Slice with Constant-node bounds -> Cast -> Concat
    with a Constant): onnx's shape inference leaves the result's shape open even though every
    input is static, so anything needing static shapes stopped there."""
    rng = np.random.default_rng(RNG_SEED)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    inits = [numpy_helper.from_array(_w(rng, 8, 3, 3, 3), "conv.w"),
             numpy_helper.from_array(_w(rng, 8, 4), "fc.w")]
    i64 = np.int64
    nodes = [
        helper.make_node("Conv", ["x", "conv.w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("GlobalAveragePool", ["c"], ["p"], name="pool"),
        helper.make_node("Shape", ["p"], ["s"], name="shape"),
        helper.make_node("Cast", ["s"], ["s32"], name="cast_shape", to=TensorProto.INT32),
        _const("axes", np.array([0], i64)), _const("start", np.array([0], i64)),
        _const("end", np.array([1], i64)), _const("step", np.array([1], i64)),
        helper.make_node("Slice", ["s32", "start", "end", "axes", "step"], ["batch"],
                         name="batch"),
        helper.make_node("Cast", ["batch"], ["batch64"], name="cast_batch", to=TensorProto.INT64),
        _const("width", np.array([8], np.int32)),
        helper.make_node("Cast", ["width"], ["width64"], name="cast_width", to=TensorProto.INT64),
        helper.make_node("Concat", ["batch64", "width64"], ["target"], name="target", axis=-1),
        helper.make_node("Reshape", ["p", "target"], ["flat"], name="flatten"),
        helper.make_node("MatMul", ["flat", "fc.w"], ["y"], name="fc"),
    ]
    return _model(nodes, [x], [y], inits, opset=11)  # (inference propagates Slice-13 only)


def constant_weight_large_values() -> onnx.ModelProto:
    """A Conv whose input leaves FP16's comfortable range (kept FP32 by the conversion) and
    whose weight is a ``Constant`` node, as the PP-OCRv4 detector's head: the float16 converter
    kept the weight FP32 but recorded it as FP16 in value_info."""
    rng = np.random.default_rng(RNG_SEED)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 8, 8])
    nodes = [
        _const("w1", _w(rng, 8, 3, 3, 3)), _const("gain", np.array(3000.0, np.float32)),
        _const("w2", _w(rng, 8, 8, 3, 3)),
        helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Mul", ["c1", "gain"], ["big"]),
        helper.make_node("Conv", ["big", "w2"], ["c2"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c2"], ["y"]),
    ]
    return _model(nodes, [x], [y])


def resize_with_roi() -> onnx.ModelProto:
    """An upsampling Resize with an (empty) float ``roi`` input, as PyTorch 1.x and paddle2onnx
    export it: a BF16 conversion must leave the roi in a type Resize's schema takes."""
    rng = np.random.default_rng(RNG_SEED)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 16, 16])
    inits = [numpy_helper.from_array(_w(rng, 8, 3, 3, 3), "w1"),
             numpy_helper.from_array(np.array([], np.float32), "roi"),
             numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales")]
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu"),
        helper.make_node("Resize", ["r1", "roi", "scales"], ["y"], name="up", mode="nearest"),
    ]
    return _model(nodes, [x], [y], inits, opset=11)


def anchor_grid_head(levels: int = 3, computed: bool = True) -> onnx.ModelProto:
    """PyTorch's YOLOv8 export: a stack of identical Conv+SiLU (Sigmoid, Mul) stages, each
    with a 1x1 head; the decode adds an anchor grid *computed from the head's shape* (Shape ->
    Gather -> Cast -> Range -> Add 0.5 -> Unsqueeze -> Add -> Reshape), written right after the
    head it reads, so shape arithmetic sits between the stages (its nodes and tensors named
    ``grid<level>/...``). ``computed=False``: the same model with each grid an initializer
    (what folding it gives, the zoo's kind of graph)."""
    rng = np.random.default_rng(RNG_SEED)
    side, ch = 8, 8
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, side, side])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, levels * side * side])
    inits = [numpy_helper.from_array(_w(rng, ch, 3, 3, 3), "stem.w")]
    nodes = [helper.make_node("Conv", ["x", "stem.w"], ["a0"], name="stem", pads=[1, 1, 1, 1])]
    decoded = []
    for i in range(levels):
        inits += [numpy_helper.from_array(_w(rng, ch, ch, 3, 3), f"s{i}.w"),
                  numpy_helper.from_array(_w(rng, ch, scale=0.1), f"s{i}.b"),
                  numpy_helper.from_array(_w(rng, 4, ch, 1, 1), f"h{i}.w")]
        nodes += [
            helper.make_node("Conv", [f"a{i}", f"s{i}.w", f"s{i}.b"], [f"c{i}"], name=f"s{i}",
                             pads=[1, 1, 1, 1]),
            helper.make_node("Sigmoid", [f"c{i}"], [f"g{i}"], name=f"s{i}.sig"),
            helper.make_node("Mul", [f"c{i}", f"g{i}"], [f"a{i + 1}"], name=f"s{i}.silu"),
            helper.make_node("Conv", [f"a{i + 1}", f"h{i}.w"], [f"h{i}"], name=f"h{i}"),
        ]
        if computed:
            nodes += _grid_from_shape(f"h{i}", f"grid{i}", f"grid{i}/")
        else:
            grid = (np.arange(side, dtype=np.float32)[:, None] + 0.5
                    + np.arange(side, dtype=np.float32)[None, :] + 0.5).reshape(1, 1, -1)
            inits.append(numpy_helper.from_array(grid, f"grid{i}"))
        nodes += [
            _const(f"l{i}.flat_shape", np.array([1, 4, -1], np.int64), f"l{i}.flat_shape"),
            helper.make_node("Reshape", [f"h{i}", f"l{i}.flat_shape"], [f"f{i}"],
                             name=f"l{i}.flat"),
            helper.make_node("Add", [f"f{i}", f"grid{i}"], [f"d{i}"], name=f"l{i}.decode"),
        ]
        decoded.append(f"d{i}")
    nodes.append(helper.make_node("Concat", decoded, ["y"], name="detections", axis=2))
    return _model(nodes, [x], [y], inits)


def _grid_from_shape(head: str, out: str, p: str) -> list[onnx.NodeProto]:
    """The anchor grid of one level from its head's shape, as torch.onnx writes it (every
    node and tensor named with the prefix ``p``)."""
    f32, i64 = TensorProto.FLOAT, np.int64
    nodes = [helper.make_node("Shape", [head], [f"{p}shape"], name=f"{p}shape")]
    for axis, dim in ((2, "h"), (3, "w")):
        nodes += [
            _const(f"{p}{dim}.i", np.array(axis, i64), f"{p}{dim}.i"),
            helper.make_node("Gather", [f"{p}shape", f"{p}{dim}.i"], [f"{p}{dim}"],
                             name=f"{p}{dim}.gather", axis=0),
            helper.make_node("Cast", [f"{p}{dim}"], [f"{p}{dim}f"], name=f"{p}{dim}.cast",
                             to=f32),
            _const(f"{p}{dim}.zero", np.array(0, np.float32), f"{p}{dim}.zero"),
            _const(f"{p}{dim}.one", np.array(1, np.float32), f"{p}{dim}.one"),
            helper.make_node("Range", [f"{p}{dim}.zero", f"{p}{dim}f", f"{p}{dim}.one"],
                             [f"{p}{dim}.r"], name=f"{p}{dim}.range"),
            _const(f"{p}{dim}.half", np.array(0.5, np.float32), f"{p}{dim}.half"),
            helper.make_node("Add", [f"{p}{dim}.r", f"{p}{dim}.half"], [f"{p}{dim}.c"],
                             name=f"{p}{dim}.center"),
            _const(f"{p}{dim}.axes", np.array([1 if dim == "h" else 0], i64), f"{p}{dim}.axes"),
            helper.make_node("Unsqueeze", [f"{p}{dim}.c", f"{p}{dim}.axes"],
                             [f"{p}{dim}.u"], name=f"{p}{dim}.unsqueeze"),
        ]
    nodes += [
        helper.make_node("Add", [f"{p}h.u", f"{p}w.u"], [f"{p}grid2d"], name=f"{p}grid"),
        _const(f"{p}grid_shape", np.array([1, 1, -1], i64), f"{p}grid_shape"),
        helper.make_node("Reshape", [f"{p}grid2d", f"{p}grid_shape"], [out],
                         name=f"{p}grid_flat"),
    ]
    return nodes


def conv_chain(layers: int = 6, channels: int = 8) -> onnx.ModelProto:
    """Convs with Relus in a chain on the guard tests' input (``x``, 1x4x16x16): each
    quantized Conv adds a little output error (minmax scales: 0.012-0.017 relative L2 alone
    on standard normal inputs), all of them together about 0.027, so a bound of 0.02 keeps a
    few of them and not every one."""
    rng = np.random.default_rng(RNG_SEED)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 16, 16])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, channels, 16, 16])
    nodes, inits, prev, cin = [], [], "x", 4
    for i in range(layers):
        w = rng.standard_normal((channels, cin, 3, 3)) / np.sqrt(cin * 9)
        inits += [numpy_helper.from_array(w.astype(np.float32), f"w{i}"),
                  numpy_helper.from_array(np.zeros(channels, np.float32), f"b{i}")]
        last = i == layers - 1
        out = "y" if last else f"conv{i}_out"
        nodes.append(helper.make_node("Conv", [prev, f"w{i}", f"b{i}"], [out], name=f"conv{i}",
                                      pads=[1, 1, 1, 1]))
        if not last:
            nodes.append(helper.make_node("Relu", [out], [f"relu{i}"], name=f"relu{i}"))
            out = f"relu{i}"
        prev, cin = out, channels
    return _model(nodes, [x], [y], inits)
