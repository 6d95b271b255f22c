"""Deterministic, realistic float32 ONNX models for tests, examples and benchmarks.

Real exported models are large, licensed and slow to fetch. These builders reproduce the
topologies that matter for Q/DQ placement (residual Adds, depthwise convs, multi-input Concats,
attention fan-out, LayerNorm/GELU chains) from a seed, so tests stay hermetic and a given call
always yields a byte-identical model.

All models use opset 17 (default domain) and IR version 8 so ONNX Runtime 1.18+ loads them; every
node and tensor has a unique, readable name and shape inference has already been run.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

__all__ = [
    "EXAMPLES",
    "OPSET",
    "IR_VERSION",
    "build",
    "gated_pairs",
    "mobilenet_like",
    "resnet_like",
    "small",
    "tiny_attention",
    "tiny_chain",
    "tiny_concat",
    "tiny_residual",
    "transformer_like",
    "vit_like",
    "yolo_like",
]

OPSET = 17
IR_VERSION = 8
_BN_EPS = 1e-5
_LN_EPS = 1e-12


class _Graph:
    """Collects nodes and initializers and refuses duplicate names, so models are valid by
    construction and stable across runs (all randomness comes from one seeded generator)."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._tensors: set[str] = set()
        self._node_names: set[str] = set()

    # -- names -----------------------------------------------------------------------------
    def tensor(self, name: str) -> str:
        if not name or name in self._tensors:
            raise ValueError(f"duplicate or empty tensor name {name!r}")
        self._tensors.add(name)
        return name

    def const(self, name: str, value: Any, dtype: type = np.float32) -> str:
        arr = np.array(value, dtype=dtype)  # C-contiguous copy; keeps scalars 0-d
        self.initializers.append(numpy_helper.from_array(arr, self.tensor(name)))
        return name

    def node(
        self,
        op_type: str,
        name: str,
        inputs: Sequence[str],
        *,
        outputs: int = 1,
        out: str | None = None,
        **attrs: Any,
    ) -> list[str]:
        if not name or name in self._node_names:
            raise ValueError(f"duplicate or empty node name {name!r}")
        self._node_names.add(name)
        if out is not None:
            names = [self.tensor(out)]
        elif outputs == 1:
            names = [self.tensor(f"{name}_out")]
        else:
            names = [self.tensor(f"{name}_out{i}") for i in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), names, name=name, **attrs))
        return names

    def op(self, op_type: str, name: str, inputs: Sequence[str], **attrs: Any) -> str:
        return self.node(op_type, name, inputs, **attrs)[0]

    # -- weights ---------------------------------------------------------------------------
    def normal(self, shape: tuple[int, ...], std: float) -> np.ndarray:
        return self.rng.standard_normal(shape, dtype=np.float32) * np.float32(std)

    def bn_params(self, c: int) -> tuple[np.ndarray, ...]:
        gamma = self.rng.uniform(0.8, 1.2, c)
        beta = self.rng.normal(0.0, 0.1, c)
        mean = self.rng.normal(0.0, 0.1, c)
        var = self.rng.uniform(0.8, 1.2, c)
        return gamma, beta, mean, var

    # -- layers ----------------------------------------------------------------------------
    def _emit_conv(
        self, x: str, name: str, w: np.ndarray, b: np.ndarray | None, stride: int, group: int
    ) -> str:
        k = int(w.shape[-1])
        inputs = [x, self.const(f"{name}.weight", w)]
        if b is not None:
            inputs.append(self.const(f"{name}.bias", b))
        return self.op(
            "Conv",
            name,
            inputs,
            kernel_shape=[k, k],
            strides=[stride, stride],
            pads=[k // 2] * 4,
            dilations=[1, 1],
            group=group,
        )

    def _he(self, cin: int, cout: int, k: int, group: int) -> np.ndarray:
        # He init keeps activation variance roughly constant through ReLU-like stacks.
        fan_in = cin // group * k * k
        return self.normal((cout, cin // group, k, k), math.sqrt(2.0 / fan_in))

    def conv(
        self, x: str, name: str, cin: int, cout: int, k: int, *, stride: int = 1, group: int = 1
    ) -> str:
        w = self._he(cin, cout, k, group)
        return self._emit_conv(x, name, w, self.normal((cout,), 0.01), stride, group)

    def conv_bn(
        self,
        x: str,
        conv_name: str,
        bn_name: str,
        cin: int,
        cout: int,
        k: int,
        *,
        stride: int = 1,
        group: int = 1,
        fold: bool = False,
        gamma_scale: float = 1.0,
    ) -> str:
        # The same draws happen whether or not BN is folded, so both variants compute the same.
        w = self._he(cin, cout, k, group)
        gamma, beta, mean, var = self.bn_params(cout)
        gamma = gamma * gamma_scale
        if fold:
            s = gamma / np.sqrt(var + _BN_EPS)
            return self._emit_conv(
                x, conv_name, w * s[:, None, None, None], beta - mean * s, stride, group
            )
        y = self._emit_conv(x, conv_name, w, None, stride, group)
        return self.op(
            "BatchNormalization",
            bn_name,
            [
                y,
                self.const(f"{bn_name}.weight", gamma),
                self.const(f"{bn_name}.bias", beta),
                self.const(f"{bn_name}.running_mean", mean),
                self.const(f"{bn_name}.running_var", var),
            ],
            epsilon=_BN_EPS,
            momentum=0.9,
        )

    def gemm(self, x: str, name: str, cin: int, cout: int, *, out: str | None = None) -> str:
        w = self.const(f"{name}.weight", self.normal((cout, cin), 1.0 / math.sqrt(cin)))
        b = self.const(f"{name}.bias", self.normal((cout,), 0.01))
        return self.node("Gemm", name, [x, w, b], out=out, alpha=1.0, beta=1.0, transB=1)[0]

    def classifier(self, x: str, cin: int, num_classes: int, out: str) -> str:
        x = self.op("GlobalAveragePool", "avgpool", [x])
        x = self.op("Flatten", "flatten", [x], axis=1)
        return self.gemm(x, "fc", cin, num_classes, out=out)

    def linear(self, x: str, name: str, cin: int, cout: int, *, out: str | None = None) -> str:
        w = self.const(f"{name}.weight", self.normal((cin, cout), 1.0 / math.sqrt(cin)))
        b = self.const(f"{name}.bias", self.normal((cout,), 0.01))
        y = self.op("MatMul", f"{name}/matmul", [x, w])
        return self.node("Add", f"{name}/add", [y, b], out=out)[0]

    def layer_norm(self, x: str, name: str, hidden: int, *, out: str | None = None) -> str:
        scale = self.const(f"{name}.weight", 1.0 + self.normal((hidden,), 0.05))
        bias = self.const(f"{name}.bias", self.normal((hidden,), 0.02))
        return self.node(
            "LayerNormalization", name, [x, scale, bias], out=out, axis=-1, epsilon=_LN_EPS
        )[0]

    # -- model -----------------------------------------------------------------------------
    def model(
        self, name: str, inputs: list[onnx.ValueInfoProto], outputs: list[onnx.ValueInfoProto]
    ) -> onnx.ModelProto:
        for vi in inputs:
            self.tensor(vi.name)
        model = _make_model(name, self.nodes, inputs, outputs, self.initializers)

        # Shape inference serializes the whole model; run it on a copy whose float weights are
        # declared as typed inputs instead (shapes only), which keeps full-size builds fast.
        # Small constants keep their values: Resize scales and Reshape shapes drive inference.
        def is_weight(t: onnx.TensorProto) -> bool:
            return t.data_type == TensorProto.FLOAT and math.prod(t.dims) > 16

        weights = [t for t in self.initializers if is_weight(t)]
        small_consts = [t for t in self.initializers if not is_weight(t)]
        stubs = [helper.make_tensor_value_info(t.name, t.data_type, t.dims) for t in weights]
        skeleton = _make_model(name, self.nodes, inputs + stubs, outputs, small_consts)
        inferred = onnx.shape_inference.infer_shapes(skeleton, strict_mode=True)
        model.graph.value_info.extend(inferred.graph.value_info)
        return model


def _make_model(
    name: str,
    nodes: list[onnx.NodeProto],
    inputs: list[onnx.ValueInfoProto],
    outputs: list[onnx.ValueInfoProto],
    initializers: list[onnx.TensorProto],
) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, name, inputs, outputs, initializer=initializers)
    return helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET)],
        ir_version=IR_VERSION,
        producer_name="qdq_optuna.examples.zoo",
    )


def _value_info(
    name: str, elem_type: int, shape: Sequence[int], dynamic_batch: bool
) -> onnx.ValueInfoProto:
    dims: list[int | str] = list(shape)
    if dynamic_batch:
        dims[0] = "batch"
    return helper.make_tensor_value_info(name, elem_type, dims)


def _f32(name: str, shape: Sequence[int], dynamic_batch: bool = False) -> onnx.ValueInfoProto:
    return _value_info(name, TensorProto.FLOAT, shape, dynamic_batch)


# ---------------------------------------------------------------------------------------------
# ResNet
# ---------------------------------------------------------------------------------------------


def _basic_block(g: _Graph, x: str, name: str, cin: int, cout: int, stride: int, fold: bool) -> str:
    y = g.conv_bn(x, f"{name}/conv1", f"{name}/bn1", cin, cout, 3, stride=stride, fold=fold)
    y = g.op("Relu", f"{name}/relu1", [y])
    # Smaller last-BN gammas (as in trained ResNets) keep the residual stream from growing.
    y = g.conv_bn(y, f"{name}/conv2", f"{name}/bn2", cout, cout, 3, fold=fold, gamma_scale=0.5)
    shortcut = x
    if stride != 1 or cin != cout:
        shortcut = g.conv_bn(
            x,
            f"{name}/downsample/conv",
            f"{name}/downsample/bn",
            cin,
            cout,
            1,
            stride=stride,
            fold=fold,
        )
    y = g.op("Add", f"{name}/add", [y, shortcut])
    return g.op("Relu", f"{name}/relu2", [y])


def resnet_like(
    *,
    image: int = 224,
    width: int = 64,
    blocks: Sequence[int] = (2, 2, 2, 2),
    num_classes: int = 1000,
    batch: int = 1,
    fold_bn: bool = False,
    dynamic_batch: bool = False,
    seed: int = 0,
) -> onnx.ModelProto:
    """ResNet-18-style classifier (BasicBlocks, 1x1/2 conv shortcuts when downsampling).

    Defaults give ~11.7M parameters like torchvision's ResNet-18. ``fold_bn`` folds every
    BatchNormalization into the preceding Conv, computing the same function.
    Input ``input`` [batch, 3, image, image] -> output ``logits`` [batch, num_classes].
    """
    g = _Graph(seed)
    x = g.conv_bn("input", "conv1", "bn1", 3, width, 7, stride=2, fold=fold_bn)
    x = g.op("Relu", "relu", [x])
    x = g.op("MaxPool", "maxpool", [x], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    cin = width
    for i, n in enumerate(blocks):
        cout = width * 2**i
        for j in range(n):
            stride = 2 if i > 0 and j == 0 else 1
            x = _basic_block(g, x, f"layer{i + 1}.{j}", cin, cout, stride, fold_bn)
            cin = cout
    g.classifier(x, cin, num_classes, "logits")
    return g.model(
        "resnet_like",
        [_f32("input", [batch, 3, image, image], dynamic_batch)],
        [_f32("logits", [batch, num_classes], dynamic_batch)],
    )


# ---------------------------------------------------------------------------------------------
# MobileNetV2
# ---------------------------------------------------------------------------------------------

# (expansion t, channels c, repeats n, first stride s): a shortened MobileNetV2 schedule.
_MOBILENET_STAGES = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 2, 2), (6, 64, 1, 2))


def _make_divisible(v: float, divisor: int = 8) -> int:
    new_v = max(divisor, int(v + divisor / 2) // divisor * divisor)
    return new_v + divisor if new_v < 0.9 * v else new_v


def _relu6(g: _Graph, x: str, name: str) -> str:
    return g.op("Clip", name, [x, "relu6.min", "relu6.max"])


def _inverted_residual(
    g: _Graph, x: str, name: str, cin: int, cout: int, stride: int, t: int, fold: bool
) -> str:
    hidden = cin * t
    y = x
    if t != 1:
        y = g.conv_bn(y, f"{name}/expand/conv", f"{name}/expand/bn", cin, hidden, 1, fold=fold)
        y = _relu6(g, y, f"{name}/expand/relu6")
    y = g.conv_bn(
        y,
        f"{name}/dw/conv",
        f"{name}/dw/bn",
        hidden,
        hidden,
        3,
        stride=stride,
        group=hidden,
        fold=fold,
    )
    y = _relu6(g, y, f"{name}/dw/relu6")
    residual = stride == 1 and cin == cout
    y = g.conv_bn(
        y,
        f"{name}/project/conv",
        f"{name}/project/bn",
        hidden,
        cout,
        1,
        fold=fold,
        gamma_scale=0.5 if residual else 1.0,
    )
    if residual:
        y = g.op("Add", f"{name}/add", [x, y])
    return y


def mobilenet_like(
    *,
    image: int = 224,
    width_mult: float = 1.0,
    num_classes: int = 1000,
    batch: int = 1,
    fold_bn: bool = False,
    dynamic_batch: bool = False,
    seed: int = 0,
) -> onnx.ModelProto:
    """MobileNetV2-style classifier: inverted residuals with depthwise convs and Clip(0, 6).

    A shortened stage schedule (19 convs at ``width_mult=1``) keeps it quick while keeping every
    pattern: expand/depthwise/project, residual Adds, and a 1x1 head conv.
    Input ``input`` [batch, 3, image, image] -> output ``logits`` [batch, num_classes].
    """
    g = _Graph(seed)
    g.const("relu6.min", 0.0)
    g.const("relu6.max", 6.0)
    cin = _make_divisible(32 * width_mult)
    x = g.conv_bn("input", "features.0/conv", "features.0/bn", 3, cin, 3, stride=2, fold=fold_bn)
    x = _relu6(g, x, "features.0/relu6")
    idx = 1
    for t, c, n, s in _MOBILENET_STAGES:
        cout = _make_divisible(c * width_mult)
        for i in range(n):
            stride = s if i == 0 else 1
            x = _inverted_residual(g, x, f"features.{idx}", cin, cout, stride, t, fold_bn)
            cin = cout
            idx += 1
    last = _make_divisible(1280 * width_mult)
    x = g.conv_bn(x, f"features.{idx}/conv", f"features.{idx}/bn", cin, last, 1, fold=fold_bn)
    x = _relu6(g, x, f"features.{idx}/relu6")
    g.classifier(x, last, num_classes, "logits")
    return g.model(
        "mobilenet_like",
        [_f32("input", [batch, 3, image, image], dynamic_batch)],
        [_f32("logits", [batch, num_classes], dynamic_batch)],
    )


# ---------------------------------------------------------------------------------------------
# YOLOv8
# ---------------------------------------------------------------------------------------------

_YOLO_REG = 64  # 4 box sides x 16 DFL bins, as in YOLOv8's raw head output


def _cbs(
    g: _Graph,
    x: str,
    name: str,
    cin: int,
    cout: int,
    k: int = 1,
    stride: int = 1,
    fold: bool = False,
) -> str:
    y = g.conv_bn(x, f"{name}/conv", f"{name}/bn", cin, cout, k, stride=stride, fold=fold)
    s = g.op("Sigmoid", f"{name}/sigmoid", [y])
    return g.op("Mul", f"{name}/silu", [y, s])


def _c2f(
    g: _Graph, x: str, name: str, cin: int, cout: int, n: int, shortcut: bool, fold: bool
) -> str:
    c = cout // 2
    y = _cbs(g, x, f"{name}/cv1", cin, 2 * c, fold=fold)
    sizes = g.const(f"{name}/split.sizes", [c, c], np.int64)
    ys = g.node("Split", f"{name}/split", [y, sizes], outputs=2, axis=1)
    for i in range(n):
        h = _cbs(g, ys[-1], f"{name}/m.{i}/cv1", c, c, 3, fold=fold)
        h = _cbs(g, h, f"{name}/m.{i}/cv2", c, c, 3, fold=fold)
        if shortcut:
            h = g.op("Add", f"{name}/m.{i}/add", [ys[-1], h])
        ys.append(h)
    cat = g.op("Concat", f"{name}/concat", ys, axis=1)
    return _cbs(g, cat, f"{name}/cv2", (2 + n) * c, cout, fold=fold)


def _sppf(g: _Graph, x: str, name: str, cin: int, cout: int, fold: bool) -> str:
    c = cin // 2
    y = _cbs(g, x, f"{name}/cv1", cin, c, fold=fold)
    pools = [y]
    for i in range(3):
        pools.append(
            g.op(
                "MaxPool",
                f"{name}/pool{i}",
                [pools[-1]],
                kernel_shape=[5, 5],
                strides=[1, 1],
                pads=[2, 2, 2, 2],
            )
        )
    cat = g.op("Concat", f"{name}/concat", pools, axis=1)
    return _cbs(g, cat, f"{name}/cv2", 4 * c, cout, fold=fold)


def _upsample(g: _Graph, x: str, name: str) -> str:
    scales = g.const(f"{name}.scales", [1.0, 1.0, 2.0, 2.0])
    return g.op(
        "Resize",
        name,
        [x, "", scales],
        mode="nearest",
        coordinate_transformation_mode="asymmetric",
        nearest_mode="floor",
    )


def yolo_like(
    *,
    image: int = 320,
    width: int = 16,
    num_classes: int = 80,
    batch: int = 1,
    fold_bn: bool = False,
    dynamic_batch: bool = False,
    seed: int = 0,
) -> onnx.ModelProto:
    """YOLOv8-style detector: C2f backbone, SPPF, upsample/Concat neck and three heads.

    Conv blocks are Conv -> BN -> SiLU (as Sigmoid + Mul). Each head concatenates box
    (64 channels) and class logits, reshapes to [batch, 64 + num_classes, cells], and the three
    scales are concatenated along the last axis.
    Input ``input`` [batch, 3, image, image] -> output ``output`` [batch, 64 + num_classes, N].
    """
    if image % 32:
        raise ValueError(f"yolo_like: image must be a multiple of 32, got {image}")
    f = fold_bn
    w = width
    g = _Graph(seed)
    x = _cbs(g, "input", "model.0", 3, w, 3, 2, f)
    x = _cbs(g, x, "model.1", w, 2 * w, 3, 2, f)
    x = _c2f(g, x, "model.2", 2 * w, 2 * w, 1, True, f)
    x = _cbs(g, x, "model.3", 2 * w, 4 * w, 3, 2, f)
    p3 = _c2f(g, x, "model.4", 4 * w, 4 * w, 2, True, f)
    x = _cbs(g, p3, "model.5", 4 * w, 8 * w, 3, 2, f)
    p4 = _c2f(g, x, "model.6", 8 * w, 8 * w, 2, True, f)
    x = _cbs(g, p4, "model.7", 8 * w, 16 * w, 3, 2, f)
    x = _c2f(g, x, "model.8", 16 * w, 16 * w, 1, True, f)
    p5 = _sppf(g, x, "model.9", 16 * w, 16 * w, f)

    x = _upsample(g, p5, "model.10/resize")
    x = g.op("Concat", "model.11/concat", [x, p4], axis=1)
    n4 = _c2f(g, x, "model.12", 24 * w, 8 * w, 1, False, f)
    x = _upsample(g, n4, "model.13/resize")
    x = g.op("Concat", "model.14/concat", [x, p3], axis=1)
    out3 = _c2f(g, x, "model.15", 12 * w, 4 * w, 1, False, f)
    x = _cbs(g, out3, "model.16", 4 * w, 4 * w, 3, 2, f)
    x = g.op("Concat", "model.17/concat", [x, n4], axis=1)
    out4 = _c2f(g, x, "model.18", 12 * w, 8 * w, 1, False, f)
    x = _cbs(g, out4, "model.19", 8 * w, 8 * w, 3, 2, f)
    x = g.op("Concat", "model.20/concat", [x, p5], axis=1)
    out5 = _c2f(g, x, "model.21", 24 * w, 16 * w, 1, False, f)

    no = _YOLO_REG + num_classes
    c_box = max(16, w, _YOLO_REG)
    c_cls = max(4 * w, min(num_classes, 100))
    flat = []
    for i, (feat, ch) in enumerate(((out3, 4 * w), (out4, 8 * w), (out5, 16 * w))):
        p = f"model.22/scale{i}"
        box = _cbs(g, feat, f"{p}/box.0", ch, c_box, 3, 1, f)
        box = g.conv(box, f"{p}/box.1", c_box, _YOLO_REG, 1)
        cls = _cbs(g, feat, f"{p}/cls.0", ch, c_cls, 3, 1, f)
        cls = g.conv(cls, f"{p}/cls.1", c_cls, num_classes, 1)
        y = g.op("Concat", f"{p}/concat", [box, cls], axis=1)
        shape = g.const(f"{p}/reshape.shape", [0, no, -1], np.int64)
        flat.append(g.op("Reshape", f"{p}/reshape", [y, shape]))
    g.node("Concat", "model.22/concat", flat, out="output", axis=2)
    cells = sum((image // s) ** 2 for s in (8, 16, 32))
    return g.model(
        "yolo_like",
        [_f32("input", [batch, 3, image, image], dynamic_batch)],
        [_f32("output", [batch, no, cells], dynamic_batch)],
    )


# ---------------------------------------------------------------------------------------------
# Transformer encoder
# ---------------------------------------------------------------------------------------------


def _encoder_layer(
    g: _Graph, x: str, p: str, seq: int, hidden: int, heads: int, ffn: int, out: str | None = None
) -> str:
    if hidden % heads:
        raise ValueError(f"hidden ({hidden}) must be divisible by heads ({heads})")
    dh = hidden // heads
    a = f"{p}/attention"
    # Reshape with 0 copies the batch dim, so the same graph works with a dynamic batch.
    split_shape = g.const(f"{a}/split_heads.shape", [0, seq, heads, dh], np.int64)
    perms = {"query": [0, 2, 1, 3], "key": [0, 2, 3, 1], "value": [0, 2, 1, 3]}
    qkv = {}
    for n, perm in perms.items():
        h = g.linear(x, f"{a}/{n}", hidden, hidden)
        h = g.op("Reshape", f"{a}/{n}/reshape", [h, split_shape])
        qkv[n] = g.op("Transpose", f"{a}/{n}/transpose", [h], perm=perm)
    scores = g.op("MatMul", f"{a}/scores/matmul", [qkv["query"], qkv["key"]])
    scale = g.const(f"{a}/scores/scale", math.sqrt(dh))
    scores = g.op("Div", f"{a}/scores/div", [scores, scale])
    probs = g.op("Softmax", f"{a}/softmax", [scores], axis=-1)
    ctx = g.op("MatMul", f"{a}/context/matmul", [probs, qkv["value"]])
    ctx = g.op("Transpose", f"{a}/context/transpose", [ctx], perm=[0, 2, 1, 3])
    merge_shape = g.const(f"{a}/merge_heads.shape", [0, seq, hidden], np.int64)
    ctx = g.op("Reshape", f"{a}/context/reshape", [ctx, merge_shape])
    y = g.linear(ctx, f"{a}/output", hidden, hidden)
    y = g.op("Add", f"{a}/residual", [y, x])
    x = g.layer_norm(y, f"{a}/layernorm", hidden)

    m = f"{p}/ffn"
    h = g.linear(x, f"{m}/fc1", hidden, ffn)
    # GELU(h) = h * 0.5 * (1 + erf(h / sqrt(2))), in the order PyTorch exports it.
    e = g.op("Div", f"{m}/gelu/div", [h, g.const(f"{m}/gelu/sqrt2", math.sqrt(2.0))])
    e = g.op("Erf", f"{m}/gelu/erf", [e])
    e = g.op("Add", f"{m}/gelu/add", [e, g.const(f"{m}/gelu/one", 1.0)])
    e = g.op("Mul", f"{m}/gelu/mul", [h, e])
    h = g.op("Mul", f"{m}/gelu/mul_half", [e, g.const(f"{m}/gelu/half", 0.5)])
    y = g.linear(h, f"{m}/fc2", ffn, hidden)
    y = g.op("Add", f"{m}/residual", [y, x])
    return g.layer_norm(y, f"{m}/layernorm", hidden, out=out)


def transformer_like(
    *,
    seq: int = 128,
    hidden: int = 256,
    heads: int = 4,
    layers: int = 4,
    ffn: int = 1024,
    vocab: int = 1000,
    batch: int = 1,
    dynamic_batch: bool = False,
    seed: int = 0,
) -> onnx.ModelProto:
    """BERT-style post-LN encoder with separate Q/K/V MatMuls (one input, fan-out of 3).

    Input ``input_ids`` int64 [batch, seq] -> output ``hidden_states`` [batch, seq, hidden].
    """
    g = _Graph(seed)
    emb = g.const("embeddings/word.weight", g.normal((vocab, hidden), 0.02))
    pos = g.const("embeddings/position.weight", g.normal((seq, hidden), 0.02))
    x = g.op("Gather", "embeddings/gather", [emb, "input_ids"], axis=0)
    x = g.op("Add", "embeddings/add_position", [x, pos])
    out = "hidden_states"
    x = g.layer_norm(x, "embeddings/layernorm", hidden, out=None if layers else out)
    for i in range(layers):
        last = i == layers - 1
        x = _encoder_layer(g, x, f"layer{i}", seq, hidden, heads, ffn, out=out if last else None)
    return g.model(
        "transformer_like",
        [_value_info("input_ids", TensorProto.INT64, [batch, seq], dynamic_batch)],
        [_f32("hidden_states", [batch, seq, hidden], dynamic_batch)],
    )


def vit_like(
    *,
    image: int = 224,
    patch: int = 16,
    hidden: int = 192,
    heads: int = 3,
    layers: int = 12,
    ffn: int = 768,
    num_classes: int = 1000,
    seed: int = 0,
) -> onnx.ModelProto:
    """ViT-style image classifier (ViT-Ti/16 at the defaults): a strided Conv cuts the image
    into patch embeddings, a position embedding is added, then the encoder layers of
    :func:`transformer_like`, a LayerNorm, the mean over tokens and a Gemm head.

    Input ``pixel_values`` [1, 3, image, image] -> output ``logits`` [1, num_classes].
    """
    g = _Graph(seed)
    tokens = (image // patch) ** 2
    x = g.op("Conv", "patch_embed/conv", ["pixel_values", g.const(
        "patch_embed.weight", g._he(3, hidden, patch, 1)), g.const(
        "patch_embed.bias", g.normal((hidden,), 0.01))], kernel_shape=[patch, patch],
        strides=[patch, patch])
    x = g.op("Reshape", "patch_embed/flatten", [x, g.const(
        "patch_embed/flatten.shape", [1, hidden, tokens], np.int64)])
    x = g.op("Transpose", "patch_embed/transpose", [x], perm=[0, 2, 1])
    x = g.op("Add", "pos_embed/add", [x, g.const("pos_embed", g.normal((1, tokens, hidden),
                                                                        0.02))])
    for i in range(layers):
        x = _encoder_layer(g, x, f"layer{i}", tokens, hidden, heads, ffn)
    x = g.layer_norm(x, "norm", hidden)
    x = g.op("ReduceMean", "pool", [x], axes=[1], keepdims=0)
    g.gemm(x, "head", hidden, num_classes, out="logits")
    return g.model("vit_like", [_f32("pixel_values", [1, 3, image, image])],
                   [_f32("logits", [1, num_classes])])


# ---------------------------------------------------------------------------------------------
# Tiny models for unit tests
# ---------------------------------------------------------------------------------------------


def tiny_chain(seed: int = 0) -> onnx.ModelProto:
    """Straight chain, no branches: the simplest case for placement logic.

    Conv -> Relu -> Conv -> Relu -> GlobalAveragePool -> Flatten -> Gemm;
    ``input`` [1, 3, 16, 16] -> ``output`` [1, 10].
    """
    g = _Graph(seed)
    x = g.conv("input", "conv1", 3, 8, 3)
    x = g.op("Relu", "relu1", [x])
    x = g.conv(x, "conv2", 8, 16, 3, stride=2)
    x = g.op("Relu", "relu2", [x])
    g.classifier(x, 16, 10, "output")
    return g.model("tiny_chain", [_f32("input", [1, 3, 16, 16])], [_f32("output", [1, 10])])


def tiny_residual(seed: int = 0) -> onnx.ModelProto:
    """Two BasicBlocks, the second downsampling with a 1x1 conv shortcut (two-branch Add).

    ``input`` [1, 3, 16, 16] -> ``output`` [1, 10].
    """
    g = _Graph(seed)
    x = g.conv_bn("input", "conv1", "bn1", 3, 8, 3)
    x = g.op("Relu", "relu", [x])
    x = _basic_block(g, x, "layer1.0", 8, 8, 1, False)
    x = _basic_block(g, x, "layer2.0", 8, 16, 2, False)
    g.classifier(x, 16, 10, "output")
    return g.model("tiny_residual", [_f32("input", [1, 3, 16, 16])], [_f32("output", [1, 10])])


def tiny_concat(seed: int = 0) -> onnx.ModelProto:
    """Concat-heavy: two conv branches joined by Concat, then an SPPF-like MaxPool chain.

    ``input`` [1, 3, 16, 16] -> ``output`` [1, 16, 16, 16] (ends in a Conv).
    """
    g = _Graph(seed)
    x = g.op("Relu", "stem/relu", [g.conv("input", "stem/conv", 3, 8, 3)])
    a = g.op("Relu", "branch_a/relu", [g.conv(x, "branch_a/conv", 8, 8, 1)])
    b = g.op("Relu", "branch_b/relu", [g.conv(x, "branch_b/conv", 8, 8, 3)])
    x = g.op("Concat", "branches/concat", [a, b], axis=1)
    x = g.op("Relu", "fuse/relu", [g.conv(x, "fuse/conv", 16, 8, 1)])
    pools = [x]
    for i in range(3):
        pools.append(
            g.op(
                "MaxPool",
                f"sppf/pool{i}",
                [pools[-1]],
                kernel_shape=[5, 5],
                strides=[1, 1],
                pads=[2, 2, 2, 2],
            )
        )
    x = g.op("Concat", "sppf/concat", pools, axis=1)
    w = g.const("sppf/conv.weight", g._he(32, 16, 1, 1))
    b_ = g.const("sppf/conv.bias", g.normal((16,), 0.01))
    g.node("Conv", "sppf/conv", [x, w, b_], out="output", kernel_shape=[1, 1])
    return g.model(
        "tiny_concat", [_f32("input", [1, 3, 16, 16])], [_f32("output", [1, 16, 16, 16])]
    )


def tiny_attention(seed: int = 0) -> onnx.ModelProto:
    """One encoder layer (seq 8, hidden 16, 2 heads, ffn 32) on a float input, no embedding.

    ``x`` [1, 8, 16] -> ``y`` [1, 8, 16].
    """
    g = _Graph(seed)
    _encoder_layer(g, "x", "layer0", 8, 16, 2, 32, out="y")
    return g.model("tiny_attention", [_f32("x", [1, 8, 16])], [_f32("y", [1, 8, 16])])


# ---------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------

EXAMPLES: dict[str, Callable[..., onnx.ModelProto]] = {
    "resnet": resnet_like,
    "mobilenet": mobilenet_like,
    "yolo": yolo_like,
    "transformer": transformer_like,
    "tiny_chain": tiny_chain,
    "tiny_residual": tiny_residual,
    "tiny_concat": tiny_concat,
    "tiny_attention": tiny_attention,
}

_SMALL: dict[str, dict[str, Any]] = {
    "resnet": dict(image=32, width=8, blocks=(1, 1, 1, 1), num_classes=10),
    "mobilenet": dict(image=32, width_mult=0.5, num_classes=10),
    "yolo": dict(image=64, width=8),
    "transformer": dict(seq=16, hidden=32, heads=2, layers=2, ffn=64, vocab=50),
}

_SIZES = ("full", "medium", "small")


def _unknown(name: str) -> ValueError:
    return ValueError(f"unknown zoo model {name!r}; valid names: {', '.join(EXAMPLES)}")


def small(name: str, **overrides: Any) -> onnx.ModelProto:
    """Test-size variant of a zoo model (fast to build and run); tiny models are returned as is.

    ``overrides`` are passed to the builder, e.g. ``small("resnet", dynamic_batch=True)``.
    """
    if name not in EXAMPLES:
        raise _unknown(name)
    return EXAMPLES[name](**{**_SMALL.get(name, {}), **overrides})


def build(name: str, size: str = "full", **overrides: Any) -> onnx.ModelProto:
    """Build a zoo model by name; ``size`` is ``"full"`` (builder defaults) or ``"small"``."""
    if name not in EXAMPLES:
        raise _unknown(name)
    if size not in _SIZES:
        raise ValueError(f"unknown size {size!r} for zoo model {name!r}; valid sizes: full, small")
    if size == "small":
        return small(name, **overrides)
    if size == "medium":
        return EXAMPLES[name](**{**_MEDIUM.get(name, {}), **overrides})
    return EXAMPLES[name](**overrides)


#: Between test-size and full-size: big enough that quantization pays on a CPU, small enough
#: that a quick tuning run finishes in a couple of minutes (the README's example).
_MEDIUM: dict[str, dict[str, Any]] = {
    "resnet": {"image": 96, "width": 32, "blocks": (1, 1, 1, 1), "num_classes": 100},
    "mobilenet": {"image": 128},
    "yolo": {"image": 160, "width": 16},
    "transformer": {"seq": 64, "hidden": 128, "heads": 4, "layers": 2, "ffn": 512},
}


def matmul_chain(layers: int = 3, width: int = 64, rows: int = 8, *,
                 symbolic: bool = False) -> bytes:
    """A MatMul/Relu chain as serialized bytes: run time grows linearly with ``layers`` and
    quadratically with ``width`` (timing tests and benchmarks rank such pairs).
    ``symbolic`` leaves the batch dimension named."""
    rng = np.random.default_rng(0)
    nodes, inits, x = [], [], "x"
    for i in range(layers):
        w = (rng.standard_normal((width, width)) * 0.05).astype(np.float32)
        inits.append(numpy_helper.from_array(w, f"w{i}"))
        nodes.append(helper.make_node("MatMul", [x, f"w{i}"], [f"m{i}"]))
        nodes.append(helper.make_node("Relu", [f"m{i}"], [f"r{i}"]))
        x = f"r{i}"
    dim0: int | str = "batch" if symbolic else rows
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [dim0, width])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, [dim0, width])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = IR_VERSION
    return model.SerializeToString()


def gated_pairs(*, blocks: int = 6, channels: int = 256, image: int = 48, batch: int = 1,
                groups: int | None = None, seed: int = 0) -> onnx.ModelProto:
    """Gated conv blocks ``x -> Conv(x) * MaxPool(x)``, alternating 1x1 and 3x3 depthwise convs
    (``groups``: the convs' groups, default ``channels``).

    Each block is a region of its own, and the two kinds are patterns that alternate (with FP16
    high precision, blocks next to the graph's input and output Casts can be patterns of their
    own). On TensorRT-like rules INT8 pays only when a block *and
    its neighbours* are INT8: the gate (a memory op) runs INT8 only when its output's readers
    in the next block do, and a block quantized alone pays a reformat at each boundary. At the
    defaults, the cost model (FP16 high precision, what ``tune --backend costmodel`` runs) gives
    every scheme of any one pattern alone (the others float) no gain, and every point quantized
    7.2 % (a search that tunes one pattern at a time in a float context misses it). Dense convs
    would not do: an INT8 dense conv alone gains more than its boundary reformats cost.
    Input ``input`` [batch, channels, image, image] -> output ``output`` (same shape).
    """
    g = _Graph(seed)
    x = "input"
    group = channels if groups is None else groups
    for k in range(blocks):
        p = f"block{k}"
        pooled = g.op("MaxPool", f"{p}/pool", [x], kernel_shape=[3, 3], strides=[1, 1],
                      pads=[1, 1, 1, 1])
        # a gate near 1 (bias 1, small weights): values stay bounded through the blocks
        ks = 1 if k % 2 == 0 else 3
        w = g.normal((channels, channels // group, ks, ks), 0.05 / ks)
        y = g._emit_conv(x, f"{p}/conv", w, np.ones(channels, np.float32), 1, group)
        x = g.node("Mul", f"{p}/gate", [y, pooled], out="output" if k == blocks - 1 else None)[0]
    shape = [batch, channels, image, image]
    return g.model("gated_pairs", [_f32("input", shape)], [_f32("output", shape)])
