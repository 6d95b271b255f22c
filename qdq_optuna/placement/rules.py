"""Where Q/DQ may go, as data: the :class:`RuntimeRules` a runtime's rules are written in, and
the use filters they are built from.

TensorRT and ONNX Runtime CPU fuse differently (see the README's "Rules" section), so a placement
that is fast on one can be the slowest on the other. Each runtime's table lives in its profile
(``qdq_optuna/runtimes/<name>.py``); code elsewhere only reads the run's table.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum

from qdq_optuna.errors import OptionChoice
from qdq_optuna.model.graph import GRAPH_OUTPUT, Graph, Use
from qdq_optuna.placement.dynamic import QuantMode, slot_mode

ALL_SLOTS = -1


class Preprocess(OptionChoice):
    """The float model's preprocessing before the rules see it (``--preprocess``)."""

    __option__ = "--preprocess"

    #: the runtime's choice (its rules' :attr:`RuntimeRules.preprocess`)
    AUTO = "auto"
    #: the model as given
    NONE = "none"
    #: ONNX Runtime's basic fusions (constants folded, Conv+BatchNorm and MatMul+Add fused)
    ORT_BASIC = "ort-basic"


class SevenBitWeights(str, Enum):
    """The int8 weights that take 7 bits on a CPU whose u8 x s8 kernels sum pairs in 16 bits
    and saturate (x86-64 without VNNI, see ``calibration.cpu_saturates_u8s8``)."""

    #: none (a GPU's kernels do not saturate)
    NONE = ""
    #: all of them (ONNX Runtime's ``reduce_range``)
    ALL = "all"
    #: the weighted ops reading the model's input (NNCF's default overflow fix for OpenVINO)
    FIRST = "first"

#: Inputs that carry shapes, indices, axes, scales or biases: never a Q/DQ site on any runtime.
STRUCTURAL_INPUTS: Mapping[str, frozenset[int]] = {
    "Reshape": frozenset({1}),
    "Expand": frozenset({1}),
    "Tile": frozenset({1}),
    "Slice": frozenset({1, 2, 3, 4}),
    "Gather": frozenset({1}),
    "GatherElements": frozenset({1}),
    "GatherND": frozenset({1}),
    "ScatterND": frozenset({1}),
    "ScatterElements": frozenset({1}),
    "Squeeze": frozenset({1}),
    "Unsqueeze": frozenset({1}),
    "Pad": frozenset({1, 2, 3}),
    "Resize": frozenset({1, 2, 3}),
    "Upsample": frozenset({1}),
    "TopK": frozenset({1}),
    "Split": frozenset({1}),
    "ReduceMean": frozenset({1}),
    "ReduceSum": frozenset({1}),
    "ReduceMax": frozenset({1}),
    "ReduceMin": frozenset({1}),
    "Clip": frozenset({1, 2}),
    "BatchNormalization": frozenset({1, 2, 3, 4}),
    "InstanceNormalization": frozenset({1, 2}),
    "LayerNormalization": frozenset({1, 2}),
    "GroupNormalization": frozenset({1, 2}),
    "Conv": frozenset({2}),
    "ConvTranspose": frozenset({2}),
    "Gemm": frozenset({2}),
    "Where": frozenset({0}),
    "Range": frozenset({0, 1, 2}),
    "OneHot": frozenset({0, 1, 2}),
    "CumSum": frozenset({1}),
}

#: Ops whose inputs are never quantized at all (shape/utility ops).
STRUCTURAL_OPS = frozenset(
    {
        "Shape", "Size", "NonZero", "ConstantOfShape", "Range", "Cast", "CastLike", "NonMaxSuppression",
        "Loop", "If", "Scan", "QuantizeLinear", "DequantizeLinear", "Identity", "Dropout",
        "ArgMax", "ArgMin", "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "Not",
        "And", "Or", "Xor", "IsNaN", "IsInf", "RandomNormalLike", "RandomUniformLike",
    }
)


@dataclass(frozen=True)
class WeightSpec:
    """A weighted op: its activation input(s), its weight input and the per-channel axis."""

    activation_slots: frozenset[int]
    weight_slot: int
    #: (graph, node index) -> channel axis of the weight, or None for per-tensor
    axis: Callable[[Graph, int], int | None]


def _conv_axis(graph: Graph, idx: int) -> int | None:
    return 0


def _conv_transpose_axis(graph: Graph, idx: int) -> int | None:
    return 1


def _gemm_axis(graph: Graph, idx: int) -> int | None:
    node = graph.nodes[idx]
    trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0)
    return 0 if trans_b else 1


def _matmul_axis(graph: Graph, idx: int) -> int | None:
    shape = graph.shapes.get(graph.nodes[idx].input[1])
    return (len(shape) - 1) if shape else None


WEIGHTED_OPS: Mapping[str, WeightSpec] = {
    "Conv": WeightSpec(frozenset({0}), 1, _conv_axis),
    "ConvTranspose": WeightSpec(frozenset({0}), 1, _conv_transpose_axis),
    "Gemm": WeightSpec(frozenset({0}), 1, _gemm_axis),
    "MatMul": WeightSpec(frozenset({0}), 1, _matmul_axis),
}

COMPUTE_OPS = frozenset({"Conv", "ConvTranspose", "MatMul", "Gemm", "Einsum"})
_QDQ_OPS = frozenset({"QuantizeLinear", "DequantizeLinear"})


# -- use filters: (graph, use) -> reason the use is not offered, or None --------------------
def _fusable_conv(graph: Graph, tensor: str) -> int | None:
    """The Conv whose (BN'd) output ``tensor`` is, when TensorRT can fuse an Add reading it
    into that Conv: a Conv or Conv->BN output with a single consumer."""
    prod = graph.producer.get(tensor)
    if prod is None or len(graph.consumers.get(tensor, [])) != 1:
        return None
    node = graph.nodes[prod[0]]
    if node.op_type == "BatchNormalization":
        conv = graph.producer.get(node.input[0])
        if conv is None or graph.nodes[conv[0]].op_type not in ("Conv", "ConvTranspose") \
                or len(graph.consumers.get(node.input[0], [])) != 1:
            return None
        return conv[0]
    return prod[0] if node.op_type in ("Conv", "ConvTranspose") else None


def _reaches(graph: Graph, source: str, target: str) -> bool:
    """Whether ``target`` is computed from ``source`` (walking producers back from target)."""
    seen, stack = set(), [target]
    while stack:
        t = stack.pop()
        if t == source:
            return True
        if t in seen or t not in graph.producer:
            continue
        seen.add(t)
        stack.extend(x for x in graph.nodes[graph.producer[t][0]].input if x)
    return False


def residual_conv(graph: Graph, add: int) -> int | None:
    """Of an Add of two fusable Conv outputs (a ResNet downsampling block), the input slot that
    TensorRT reads as the quantized residual; the other Conv gets the Add fused into it. The
    residual is the shortcut: the Conv whose input the other branch is computed from (the 1x1
    downsampling Conv reads the block input, the main path's last Conv is two Convs deeper).
    Ties (two independent branches) go to the earlier Conv, so the later one, which runs when
    both inputs exist, takes the Add. None when the Add is not of two fusable Conv outputs."""
    node = graph.nodes[add]
    if node.op_type != "Add" or len(node.input) != 2:
        return None
    convs = [_fusable_conv(graph, t) for t in node.input]
    if None in convs or convs[0] == convs[1]:
        return None
    inputs = [graph.nodes[c].input[0] for c in convs]
    for slot in (0, 1):
        if _reaches(graph, inputs[slot], inputs[1 - slot]) and \
                not _reaches(graph, inputs[1 - slot], inputs[slot]):
            return slot
    return 0 if convs[0] < convs[1] else 1


def conv_add_relu_fusion(graph: Graph, use: Use) -> str | None:
    """TensorRT fuses Conv->[BN->]Add->Relu into one INT8 kernel; Q/DQ on the Conv (or BN)
    output that feeds the Add breaks it. Fires only when that output has a single consumer and
    the Add feeds a Relu (the review's refinement of the upstream rule). When both Add inputs
    are such Conv outputs, TensorRT fuses the Add into one Conv and wants the other input, the
    residual, in INT8: that one (the shortcut, see :func:`residual_conv`) is offered."""
    tensor, consumer, slot = use
    if consumer == GRAPH_OUTPUT or graph.nodes[consumer].op_type != "Add" \
            or _fusable_conv(graph, tensor) is None:
        return None
    add_out = graph.nodes[consumer].output[0]
    if not any(graph.nodes[n].op_type == "Relu" for n, _ in graph.consumers.get(add_out, [])):
        return None
    if residual_conv(graph, consumer) == slot:
        return None
    return "breaks TensorRT's Conv+Add+Relu fusion"


#: single-input ops (other inputs constant) that TensorRT runs in the epilogue of the
#: Conv/Gemm/MatMul kernel producing their input (the cost model fuses the same ones)
EPILOGUE_OPS = frozenset(
    {
        "BatchNormalization", "Relu", "Clip", "LeakyRelu", "PRelu", "Sigmoid", "HardSigmoid",
        "HardSwish", "Tanh", "Elu", "Selu", "Softplus", "Mish", "Gelu", "ThresholdedRelu",
    }
)
#: binary arithmetic that becomes a per-channel scale/bias in that epilogue when the other
#: operand is constant
_SCALE_BIAS_OPS = frozenset({"Add", "Sub", "Mul", "Div"})


def _in_epilogue(graph: Graph, idx: int, slot: int) -> bool:
    """Node ``idx`` reading input ``slot`` can join the kernel of the op producing it."""
    node = graph.nodes[idx]
    if node.op_type in EPILOGUE_OPS:
        if slot != 0:
            return False
    elif node.op_type not in _SCALE_BIAS_OPS:
        return False
    return all(graph.is_constant(x) for k, x in enumerate(node.input) if x and k != slot)


def _silu(graph: Graph, tensor: str) -> tuple[int, int] | None:
    """(Sigmoid, Mul) when ``tensor``'s two readers compute ``tensor * Sigmoid(tensor)``."""
    cons = graph.consumers.get(tensor, [])
    if len(cons) != 2 or tensor in graph.graph_outputs:
        return None
    for (sig, _), (mul, _) in (cons, cons[::-1]):
        if graph.nodes[sig].op_type != "Sigmoid" or graph.nodes[mul].op_type != "Mul":
            continue
        s_out = graph.nodes[sig].output[0]
        if s_out not in graph.graph_outputs and len(graph.consumers.get(s_out, [])) == 1 \
                and sorted(graph.nodes[mul].input) == sorted([tensor, s_out]):
            return sig, mul
    return None


def _epilogue_readers(graph: Graph, tensor: str) -> tuple[int, ...]:
    """The readers of ``tensor`` that join its producer's kernel: its one epilogue reader,
    or the Sigmoid and Mul of its SiLU; () when none does."""
    cons = graph.consumers.get(tensor, [])
    if tensor in graph.graph_outputs:
        return ()
    if len(cons) == 1 and _in_epilogue(graph, *cons[0]):
        return (cons[0][0],)
    return _silu(graph, tensor) or ()


def _residual_add(graph: Graph, tensor: str) -> int | None:
    """The Add that joins the kernel of the Conv writing ``tensor`` (TensorRT's Conv+Add
    kernel: the Add of a Conv output and a residual, see :func:`residual_conv`)."""
    cons = graph.consumers.get(tensor, [])
    if len(cons) != 1 or _fusable_conv(graph, tensor) is None:
        return None
    add, slot = cons[0]
    node = graph.nodes[add]
    if node.op_type != "Add" or len(node.input) != 2 or graph.is_constant(node.input[1 - slot]) \
            or node.input[1 - slot] == tensor or residual_conv(graph, add) == slot:
        return None
    return add


def _next_in_epilogue(graph: Graph, tensor: str) -> str | None:
    """The tensor after ``tensor``'s epilogue readers or residual Add (what they write)."""
    readers = _epilogue_readers(graph, tensor)
    if not readers:
        add = _residual_add(graph, tensor)
        readers = () if add is None else (add,)
    return graph.nodes[readers[-1]].output[0] if readers else None


def _kernel_written(graph: Graph, tensor: str) -> bool:
    """``tensor`` is a Conv/Gemm/MatMul output or inside the epilogue chain after one."""
    t = tensor
    for _ in range(len(graph.nodes)):  # walk back over the chain to its compute op
        prod = graph.producer.get(t)
        if prod is None:
            return False
        node = graph.nodes[prod[0]]
        if node.op_type in COMPUTE_OPS:
            return True
        data = [x for x in node.input if x and not graph.is_constant(x)]
        if node.op_type == "Mul" and len(data) == 2:  # x * Sigmoid(x): back to x
            data = [x for x in data if graph.producer_op(x) != "Sigmoid"]
        elif node.op_type == "Add" and len(data) == 2:  # back to the Conv that takes the Add
            data = [x for x in data if _residual_add(graph, x) == prod[0]]
        if len(data) != 1 or _next_in_epilogue(graph, data[0]) != t:
            return False
        t = data[0]
    return False


def epilogue_edge(graph: Graph, use: Use) -> str | None:
    """TensorRT runs a Conv/Gemm/MatMul with the BatchNormalization, activation (SiLU too)
    and constant scale/bias after it as one kernel, and quantizes the chain's output in that
    kernel: its own placement rules (and Model Optimizer's) put Q/DQ on the compute op's
    inputs and after the activation, never inside the chain. A Q/DQ there cuts the kernel in
    two (the activation runs stand-alone), so an every-point placement was slower than float."""
    tensor, consumer, slot = use
    if consumer == GRAPH_OUTPUT:
        return None
    chain_start = tensor
    if graph.nodes[consumer].op_type == "Mul" and graph.producer_op(tensor) == "Sigmoid":
        chain_start = graph.nodes[graph.producer[tensor][0]].input[0]  # Sigmoid(x) -> x
    if consumer not in _epilogue_readers(graph, chain_start) \
            or not _kernel_written(graph, chain_start):
        return None
    return "inside a compute op's fused activation chain (TensorRT: one kernel)"


def shape_arithmetic(graph: Graph, use: Use) -> str | None:
    """TensorRT folds what is computed from tensor shapes and constants alone (a detector's
    anchor grid: Shape -> Range -> Add -> Expand ...) when it builds the engine: a Q/DQ there
    quantizes a constant and moves no data, but each such point would be measured."""
    if use[0] in graph.shape_values():
        return "computed from tensor shapes (folded when TensorRT builds the engine)"
    return None


def fused_activation(graph: Graph, use: Use) -> str | None:
    """ONNX Runtime folds a Relu that directly follows a quantized Conv/Gemm/MatMul into the
    kernel's output range (Q with zero point at the type's minimum); Q/DQ between them only adds
    a float round trip. (A Clip folds only when its range fits the Q range: left to the search.)"""
    tensor, consumer, _ = use
    if consumer == GRAPH_OUTPUT or graph.nodes[consumer].op_type != "Relu":
        return None
    if graph.producer_op(tensor) not in COMPUTE_OPS or len(graph.consumers.get(tensor, [])) != 1:
        return None
    return "activation fused into the producer's quantized kernel"


def swish_operand(graph: Graph, use: Use) -> str | None:
    """OpenVINO fuses ``x * Sigmoid(x)`` (Swish/SiLU, as PyTorch exports it) into the layer
    that computes ``x`` (a Convolution's post-op): a Q/DQ on either operand of that Mul breaks
    the fusion and runs as a float Subgraph of its own. Measured on the zoo YOLO (small, every
    point on): 50 f32 Subgraphs, 1 once these 102 of its 234 uses are left out, all 57
    Convolutions u8 either way; NNCF's placements never quantize them."""
    tensor, consumer, _ = use
    if consumer == GRAPH_OUTPUT or graph.nodes[consumer].op_type != "Mul":
        return None
    ins = list(graph.nodes[consumer].input)
    if len(ins) != 2:
        return None
    for x, y in ((ins[0], ins[1]), (ins[1], ins[0])):
        prod = graph.producer.get(y)
        if prod is not None and graph.nodes[prod[0]].op_type == "Sigmoid" \
                and graph.nodes[prod[0]].input[0] == x:
            return "an operand of x * Sigmoid(x), which OpenVINO fuses into x's layer"
    return None


def promote_concat(graph: Graph, tensor: str, uncovered: list[tuple[int, int]]) -> bool:
    """TensorRT: when the only uncovered consumers are Concats, quantize the tensor for them too
    so the Concat sees INT8 inputs (it is a byte copy in TensorRT)."""
    return bool(uncovered) and all(graph.nodes[n].op_type == "Concat" for n, _ in uncovered)


@dataclass(frozen=True)
class RuntimeRules:
    """One runtime's answer to "may this tensor use carry Q/DQ, and what comes with it"."""

    name: str
    default_quant_type: str
    quant_types: tuple[str, ...]
    #: op -> input slots that are never quantized (in addition to STRUCTURAL_INPUTS)
    never_quantize: Mapping[str, frozenset[int]] = field(default_factory=dict)
    #: if set, only these consumer ops may have Q/DQ on their inputs
    quantizable_ops: frozenset[str] | None = None
    #: extra per-use filters (name kept for reports)
    use_filters: tuple[Callable[[Graph, Use], str | None], ...] = ()
    #: the int8 weights that take 7 bits on a CPU whose u8 x s8 kernels saturate
    seven_bit_weights: SevenBitWeights = SevenBitWeights.NONE
    #: merge-stage promotions: (graph, tensor, uncovered consumers) -> cover them too
    promotions: tuple[Callable[[Graph, str, list[tuple[int, int]]], bool], ...] = ()
    #: ops whose (inputs + output) form a fusion group: the runtime only runs them quantized
    #: when all are in place
    fusion_group_ops: frozenset[str] = frozenset()
    #: quantize Gemm/Conv bias to int32 (scale = input scale * weight scale)
    quantize_bias_ops: frozenset[str] = frozenset()
    #: op -> per-tensor weights (runtime kernels that do not take per-channel weights)
    per_tensor_weight_ops: frozenset[str] = frozenset()
    #: ops whose output may carry Q/DQ whatever reads it, graph outputs included: the Q
    #: completes the op's DQ -> op -> Q group, and a reader without a quantized kernel (Div,
    #: Sub, Shape, ...) reads the dequantized value (ONNX Runtime fuses an op only when the Q
    #: is its output's only reader, and never when the output is a graph output)
    output_quantized_ops: frozenset[str] = frozenset()
    #: ops whose constant float inputs are quantized with their activations (activation
    #: type, per tensor, asymmetric: as ``quantize_static`` does), when every float
    #: activation input of the op carries Q/DQ: the op then runs as one quantized kernel
    constant_operand_ops: frozenset[str] = frozenset()
    #: ops that look up rows of a constant table (input 0): when every reader of the output
    #: reads it through Q/DQ, the table is quantized with the output's scale and zero point
    #: (the same numbers: a lookup commutes with quantization), and the op runs on the
    #: quantized table with no Q after it (``quantize_static`` does this for Gather)
    table_ops: frozenset[str] = frozenset()
    #: ops a quantized tensor passes through still quantized (OpenVINO's precision-preserving
    #: operations: a MaxPool or Split of u8 data writes u8), so a weighted op reading their
    #: output runs integer with its weights quantized, without a Q/DQ of its own
    precision_preserving_ops: frozenset[str] = frozenset()
    #: the calibration shares a Concat's output parameters with its inputs (and what a
    #: same-scale chain ties to them) when the narrowest keeps this share of the joined range
    #: (``calibration.share_concat_scales``); None: no sharing
    concat_share_ratio: float | None = None
    #: what ``--preprocess auto`` applies before the rules see the graph (``ort-basic``: ONNX
    #: Runtime's basic fusions, which its own runtime applies before its Q/DQ fusions)
    preprocess: Preprocess = Preprocess.NONE
    #: ops that may run dynamically (activations quantized per call, int8 weights), each a
    #: ``dynamic`` insertion point of its own: the runtime profile sets them for the modes
    #: a run searches (``Runtime.rules_for_modes``); none in the plain rules
    dynamic_ops: frozenset[str] = frozenset()
    #: weight-only modes (``weight_int8``, ``weight_int4``) a MatMul/Gemm of a constant 2-D
    #: weight may run in, each an insertion point of its own; set by the profile for the
    #: modes a run searches, none in the plain rules
    weight_only_modes: tuple[QuantMode, ...] = ()

    def use_reason(self, graph: Graph, use: Use) -> str | None:
        """Why a use is not a Q/DQ site on this runtime, or None when it is one (a node's
        per-node mode: when the rules offer that mode for it)."""
        tensor, consumer, slot = use
        mode = slot_mode(slot)
        if mode is not None:
            return self._mode_reason(graph, use, mode)
        if not graph.is_activation(tensor):
            return "not a float activation"
        if consumer == GRAPH_OUTPUT:
            reason = None if self.after_quantized_op(graph, tensor) else \
                f"a graph output carries no Q/DQ on {self.name} here"
        else:
            reason = self._consumer_reason(graph, use)
        if reason:
            return reason
        for rule in self.use_filters:
            reason = rule(graph, use)
            if reason:
                return reason
        return None

    def offers_mode(self, graph: Graph, node: int, mode: QuantMode) -> bool:
        """Whether ``node`` may run in the per-node ``mode`` under these rules (the modes a
        run searches): what a mode's insertion point is offered for, and a mode use kept."""
        from qdq_optuna.placement.dynamic import dynamic_node_ok
        from qdq_optuna.placement.weight_only import WEIGHT_ONLY_OPS

        if mode is QuantMode.DYNAMIC:
            return bool(self.dynamic_ops) and dynamic_node_ok(graph, node, self.dynamic_ops)
        return mode in self.weight_only_modes and dynamic_node_ok(graph, node, WEIGHT_ONLY_OPS)

    def _mode_reason(self, graph: Graph, use: Use, mode: QuantMode) -> str | None:
        from qdq_optuna.placement.dynamic import mode_use

        _, node, _ = use
        if node < 0 or node >= len(graph.nodes) or use != mode_use(graph, node, mode):
            return f"not a {mode.value} use of a node of this graph"
        return None if self.offers_mode(graph, node, mode) else \
            f"the run does not offer the {mode.value} mode for it"

    def after_quantized_op(self, graph: Graph, tensor: str) -> bool:
        """``tensor`` is the output of an op whose output Q/DQ any reader may share."""
        return graph.producer_op(tensor) in self.output_quantized_ops

    def _consumer_reason(self, graph: Graph, use: Use) -> str | None:
        tensor, consumer, slot = use
        node = graph.nodes[consumer]
        op = node.op_type
        structural = slot in STRUCTURAL_INPUTS.get(op, frozenset()) \
            or slot in self.never_quantize.get(op, ())
        if not structural and op not in _QDQ_OPS and ALL_SLOTS not in self.never_quantize.get(op, ()) \
                and self.after_quantized_op(graph, tensor):
            return None
        if op in STRUCTURAL_OPS:
            return f"{op} inputs are structural"
        if node.domain not in ("", "ai.onnx"):
            return f"custom-domain op {node.domain}.{op}"
        if structural:
            return f"input {slot} of {op} is structural (shape/index/bias)"
        if ALL_SLOTS in self.never_quantize.get(op, ()):
            return f"{op} inputs are never quantized on {self.name}"
        if not self.has_integer_kernel(op):
            return f"{op} has no quantized kernel on {self.name}"
        return None

    def has_integer_kernel(self, op: str) -> bool:
        """Whether this runtime has a quantized kernel for ``op`` (:attr:`quantizable_ops`;
        None: every op)."""
        return self.quantizable_ops is None or op in self.quantizable_ops

    def quantizable(self, graph: Graph, use: Use) -> bool:
        return self.use_reason(graph, use) is None
