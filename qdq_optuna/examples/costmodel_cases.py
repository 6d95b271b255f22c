"""The small models the cost model is calibrated on: docs/costmodel.md's figures
(``benchmarks/costmodel_figures.py``), the cost model's tests and its speed benchmark price them.

Why in the package: the figures, the tests and the benchmarks must price the same graphs, and a
user checking the cost model against their own GPU can build them too. Weights are placeholders
whose data lives "elsewhere" (the cost model never reads weight data), so the models are tiny
and are not meant to run. Float tensors are FP16 (what TensorRT users deploy) unless
``float_type`` says otherwise; the cost model prices each float tensor at its own type.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

__all__ = [
    "BLOCK_CONVS",
    "Builder",
    "big_conv",
    "big_residual_chain",
    "concat_model",
    "matmul_chain",
    "placeholder",
    "resnet18_like",
    "resnet_variants",
    "residual_block",
    "with_qdq",
]

FP16 = TensorProto.FLOAT16


def placeholder(name: str, dims: list[int], dtype: int = FP16) -> TensorProto:
    """A weight with dims but its data 'elsewhere': the cost model must never need the data."""
    t = TensorProto()
    t.name = name
    t.data_type = dtype
    t.dims.extend(dims)
    t.data_location = TensorProto.EXTERNAL
    entry = t.external_data.add()
    entry.key, entry.value = "location", "weights.bin"
    return t


class Builder:
    """Float graphs with named nodes, so Q/DQ can be added afterwards by node/tensor name."""

    def __init__(self, float_type: int = FP16) -> None:
        self.float_type = float_type
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []

    def input(self, name: str, dims: list) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, self.float_type, dims))
        return name

    def node(self, op: str, inputs: list[str], name: str, **attrs) -> str:
        self.nodes.append(helper.make_node(op, inputs, [name], name=name, **attrs))
        return name

    def conv(self, x: str, cin: int, cout: int, k: int, name: str, stride: int = 1) -> str:
        self.inits.append(placeholder(f"{name}.w", [cout, cin, k, k]))
        self.inits.append(placeholder(f"{name}.b", [cout]))
        pad = k // 2
        return self.node(
            "Conv", [x, f"{name}.w", f"{name}.b"], name, kernel_shape=[k, k],
            pads=[pad] * 4, strides=[stride, stride],
        )  # fmt: skip

    def bn(self, x: str, c: int, name: str) -> str:
        names = [f"{name}.{p}" for p in ("scale", "bias", "mean", "var")]
        self.inits.extend(placeholder(n, [c]) for n in names)
        return self.node("BatchNormalization", [x, *names], name)

    def matmul(self, x: str, k: int, n: int, name: str) -> str:
        self.inits.append(placeholder(f"{name}.w", [k, n]))
        return self.node("MatMul", [x, f"{name}.w"], name)

    def model(self, outputs: list[str]) -> onnx.ModelProto:
        outs = [helper.make_tensor_value_info(o, self.float_type, None) for o in outputs]
        for t in self.inits:
            if t.data_type in (TensorProto.FLOAT, TensorProto.FLOAT16):
                t.data_type = self.float_type
        graph = helper.make_graph(self.nodes, "g", self.inputs, outs, self.inits)
        # FP16 scales (and so FP16 Q/DQ) need QuantizeLinear-19
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])


def with_qdq(
    model: onnx.ModelProto,
    *,
    tensors: tuple[str, ...] = (),
    edges: tuple[tuple[str, int], ...] = (),
    weights: tuple[str, ...] = (),
    weight_style: str = "qdq",
) -> onnx.ModelProto:
    """Insert Q->DQ: once per tensor (all consumers share it), per (node, input) edge, or on the
    weight (input 1) of the named nodes, either as Q->DQ on the float initializer
    (``weight_style="qdq"``) or as DQ on an INT8 initializer (``"dq"``)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    inits = {t.name: t for t in g.initializer}
    float_type = model.graph.input[0].type.tensor_type.elem_type
    extra = [
        helper.make_tensor("qs", float_type, [], [0.05]),
        helper.make_tensor("qzp", TensorProto.INT8, [], [0]),
    ]
    counter = iter(range(1_000_000))

    def pair(x: str) -> tuple[list[onnx.NodeProto], str]:
        n = next(counter)
        q = helper.make_node("QuantizeLinear", [x, "qs", "qzp"], [f"q{n}"], name=f"Q{n}_{x}")
        dq = helper.make_node("DequantizeLinear", [f"q{n}", "qs", "qzp"], [f"dq{n}"],
                              name=f"DQ{n}_{x}")  # fmt: skip
        return [q, dq], f"dq{n}"

    new_nodes: list[onnx.NodeProto] = []
    renamed: dict[str, str] = {}
    for vi in g.input:
        if vi.name in tensors:
            nodes, out = pair(vi.name)
            new_nodes.extend(nodes)
            renamed[vi.name] = out
    for node in g.node:
        for k, x in enumerate(node.input):
            if x in renamed:
                node.input[k] = renamed[x]
        for _, k in [e for e in edges if e[0] == node.name]:
            nodes, out = pair(node.input[k])
            new_nodes.extend(nodes)
            node.input[k] = out
        if node.name in weights:
            w = node.input[1]
            if weight_style == "dq":
                wq = placeholder(f"{w}.int8", list(inits[w].dims), TensorProto.INT8)
                extra.append(wq)
                dq = helper.make_node("DequantizeLinear", [wq.name, "qs", "qzp"], [f"{w}.dq"],
                                      name=f"DQW_{w}")  # fmt: skip
                new_nodes.append(dq)
                node.input[1] = f"{w}.dq"
            else:
                nodes, out = pair(w)
                new_nodes.extend(nodes)
                node.input[1] = out
        new_nodes.append(node)
        for out in node.output:
            if out in tensors:
                nodes, dq_out = pair(out)
                new_nodes.extend(nodes)
                renamed[out] = dq_out
    del g.node[:]
    g.node.extend(new_nodes)
    g.initializer.extend(extra)
    return m


# ------------------------------------------------------------------------------------------
# models


def residual_block(c: int = 64, hw: int = 56, float_type: int = FP16) -> onnx.ModelProto:
    """x -> Conv -> Relu -> Conv -> Add(x) -> Relu, preceded by a stem conv so x is produced by
    a kernel (as inside a network)."""
    b = Builder(float_type)
    x = b.input("x", [1, c, hw, hw])
    s = b.node("Relu", [b.conv(x, c, c, 3, "stem")], "stem_relu")
    r = b.node("Relu", [b.conv(s, c, c, 3, "conv1")], "relu1")
    a = b.node("Add", [b.conv(r, c, c, 3, "conv2"), s], "add")
    return b.model([b.node("Relu", [a], "relu2")])


BLOCK_CONVS = ("stem", "conv1", "conv2")


def concat_model(float_type: int = FP16) -> onnx.ModelProto:
    """Two conv branches -> Concat -> 1x1 Conv."""
    b = Builder(float_type)
    x = b.input("x", [1, 32, 56, 56])
    left = b.node("Relu", [b.conv(x, 32, 32, 3, "left")], "left_relu")
    right = b.node("Relu", [b.conv(x, 32, 32, 3, "right")], "right_relu")
    cat = b.node("Concat", [left, right], "cat", axis=1)
    return b.model([b.conv(cat, 64, 64, 1, "fuse")])


def matmul_chain(seq: int = 512, hidden: int = 1024, norm: str = "Softmax",
                 float_type: int = FP16) -> onnx.ModelProto:
    """MatMul -> Softmax|LayerNormalization -> MatMul."""
    b = Builder(float_type)
    x = b.input("x", [1, seq, hidden])
    h = b.matmul(x, hidden, hidden, "mm1")
    if norm == "LayerNormalization":
        b.inits += [placeholder("ln.g", [hidden]), placeholder("ln.b", [hidden])]
        n = b.node(norm, [h, "ln.g", "ln.b"], "norm", axis=-1)
    else:
        n = b.node(norm, [h], "norm", axis=-1)
    return b.model([b.matmul(n, hidden, hidden, "mm2")])


def resnet18_like(hw: int = 224, bn: bool = False, float_type: int = FP16) -> onnx.ModelProto:
    """ResNet-18 topology (stem, 4 stages x 2 basic blocks, GAP, FC); BatchNorm folded into the
    convs as exporters do in eval mode, or kept as nodes with ``bn=True``."""
    b = Builder(float_type)

    def maybe_bn(t: str, c: int, name: str) -> str:
        return b.bn(t, c, name) if bn else t

    x = b.input("x", [1, 3, hw, hw])
    t = b.node("Relu", [maybe_bn(b.conv(x, 3, 64, 7, "stem", 2), 64, "stem_bn")], "stem_relu")
    t = b.node("MaxPool", [t], "pool", kernel_shape=[3, 3], strides=[2, 2], pads=[1] * 4)
    cin = 64
    for s, cout in enumerate((64, 128, 256, 512)):
        for blk in range(2):
            p = f"s{s}b{blk}"
            stride = 2 if (blk == 0 and s > 0) else 1
            h = b.conv(t, cin, cout, 3, f"{p}_conv1", stride)
            h = b.node("Relu", [maybe_bn(h, cout, f"{p}_bn1")], f"{p}_relu1")
            h = maybe_bn(b.conv(h, cout, cout, 3, f"{p}_conv2"), cout, f"{p}_bn2")
            short = t
            if stride != 1 or cin != cout:
                short = maybe_bn(b.conv(t, cin, cout, 1, f"{p}_down", stride), cout, f"{p}_dbn")
            t = b.node("Relu", [b.node("Add", [h, short], f"{p}_add")], f"{p}_relu2")
            cin = cout
    t = b.node("Flatten", [b.node("GlobalAveragePool", [t], "gap")], "flat")
    b.inits += [placeholder("fc.w", [1000, 512]), placeholder("fc.b", [1000])]
    return b.model([b.node("Gemm", [t, "fc.w", "fc.b"], "fc", transB=1)])


def resnet_variants(bn: bool = False, float_type: int = FP16) -> dict[str, onnx.ModelProto]:
    """The placements the docs compare."""
    base = resnet18_like(bn=bn, float_type=float_type)
    nodes = {n.name: n for n in base.graph.node}
    convs = tuple(n for n, node in nodes.items() if node.op_type == "Conv")
    conv_inputs = {nodes[c].input[0] for c in convs}
    adds = [n for n, node in nodes.items() if node.op_type == "Add"]
    # residual operand of each Add: the one not produced by the block's last BN
    shortcuts = {nodes[a].input[1] for a in adds}
    return {
        "baseline": base,
        # one shared Q/DQ per conv-input tensor, also feeding the residual Add (its producer then
        # writes INT8 and the fused Add reads INT8)
        "conv_inputs_weights": with_qdq(
            base, tensors=tuple(conv_inputs | shortcuts) + ("flat",), weights=convs + ("fc",)
        ),
        # per-edge Q/DQ on conv inputs, weights quantized, outputs left float
        "naive_conv_inputs": with_qdq(base, edges=tuple((c, 0) for c in convs), weights=convs),
        "conv_inputs_outputs": with_qdq(
            base, edges=tuple((c, 0) for c in convs), tensors=convs, weights=convs
        ),
        "memory_ops_only": with_qdq(
            base,
            edges=tuple((a, k) for a in adds for k in (0, 1)) + (("pool", 0), ("gap", 0)),
        ),
    }


def big_residual_chain(blocks: int, float_type: int = FP16) -> onnx.ModelProto:
    """``blocks`` x (Conv, BatchNormalization, Relu, Add) on a 64x14x14 tensor."""
    b = Builder(float_type)
    t = b.input("x", [1, 64, 14, 14])
    for i in range(blocks):
        h = b.node("Relu", [b.bn(b.conv(t, 64, 64, 3, f"c{i}"), 64, f"bn{i}")], f"r{i}")
        t = b.node("Add", [h, t], f"a{i}")
    return b.model([t])


def big_conv(quantized: bool, float_type: int = FP16) -> onnx.ModelProto:
    """One 256-channel 3x3 Conv on 56x56 (compute-bound), with Q/DQ on its input and weight
    when ``quantized``."""
    b = Builder(float_type)
    x = b.input("x", [1, 256, 56, 56])
    y = b.conv(x, 256, 256, 3, "conv")
    model = b.model([y])
    return with_qdq(model, edges=(("conv", 0),), weights=("conv",)) if quantized else model
