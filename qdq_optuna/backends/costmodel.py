"""A deterministic, analytical latency model that imitates TensorRT INT8 behaviour.

Real TensorRT timings need a GPU and are noisy; searches, comparisons and CI tests need a
figure that is reproducible and explainable. This backend reads only the graph (shapes, dtypes,
Q/DQ placement), applies TensorRT-like fusion rules and a roofline per kernel, and returns the
same latency every time. It is a *model*, not a measurement: the rules and every constant are
explained in ``docs/costmodel.md``.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from qdq_optuna.backends.base import Backend, BackendError, FixedRunner, ModelSource, Runner
from qdq_optuna.placement.rules import COMPUTE_OPS as RULES_COMPUTE_OPS
from qdq_optuna.placement.rules import EPILOGUE_OPS as RULES_EPILOGUE_OPS

if TYPE_CHECKING:  # onnx is imported lazily: backends must stay cheap to import
    import onnx

__all__ = [
    "CostBreakdown",
    "CostModelBackend",
    "GpuSpec",
    "NodeCost",
    "estimate",
]

#: Bytes per element of a float tensor in the engine, by ONNX element type. TensorRT builds
#: strongly typed networks: a float tensor runs in its own type (FP32, FP16, BF16).
FP32_BYTES = 4
FP16_BYTES = 2
FLOAT_BYTES: dict[int, int] = {1: FP32_BYTES, 10: FP16_BYTES, 16: FP16_BYTES, 11: 8}
#: Bytes per element of a quantized tensor.
INT8_BYTES = 1
#: Bytes per element of a Conv/Gemm bias (TensorRT keeps biases in FP32).
BIAS_BYTES = 4

Q_OP = "QuantizeLinear"
DQ_OP = "DequantizeLinear"

#: Tensor-core ops: roofline of FLOPs against bytes (the rules' compute ops; no FLOP count for
#: Einsum here, so it is costed like any other op).
COMPUTE_OPS = RULES_COMPUTE_OPS - {"Einsum"}
#: Metadata-only ops: no kernel, and transparent when tracing Q/DQ producers and consumers.
VIEW_OPS = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Dropout"})
#: Ops whose output is known at build time once shapes are static.
SHAPE_OPS = frozenset({"Shape", "Size", "Constant"})
#: Unary ops (other inputs constant) that TensorRT folds into a compute kernel's epilogue
#: (the rules' table: TensorRT's rules offer no Q/DQ point inside such a chain).
EPILOGUE_OPS = RULES_EPILOGUE_OPS
#: Binary arithmetic that becomes a per-channel scale/bias in the epilogue when one side is constant.
SCALE_BIAS_OPS = frozenset({"Add", "Sub", "Mul", "Div"})
#: INT8 memory ops that only move or select values, so their output keeps the input scale and
#: can feed an INT8 compute op directly (TensorRT moves the DQ after them).
MOVEMENT_OPS = frozenset(
    {
        "Concat", "Split", "Slice", "Pad", "Transpose", "MaxPool", "GlobalMaxPool", "Resize",
        "Upsample", "Gather", "Expand", "Tile", "DepthToSpace", "SpaceToDepth",
    }
)
#: Memory-bound ops that TensorRT can run on INT8 data when fed by DQ and consumed by Q.
INT8_MEMORY_OPS = MOVEMENT_OPS | frozenset(
    {
        "Add", "Sub", "Mul", "Max", "Min", "Relu", "LeakyRelu", "Clip", "AveragePool",
        "GlobalAveragePool",
    }
)
#: Single-input movement ops a Q is moved backwards over, so the producer writes INT8.
Q_COMMUTING_OPS = frozenset(
    {"MaxPool", "GlobalMaxPool", "Transpose", "Slice", "Pad", "DepthToSpace", "SpaceToDepth"}
)
#: Elementwise ops that TensorRT chains into one pointwise kernel.
POINTWISE_OPS = EPILOGUE_OPS | frozenset(
    {
        "Add",
        "Sub",
        "Mul",
        "Div",
        "Pow",
        "Sqrt",
        "Reciprocal",
        "Erf",
        "Exp",
        "Log",
        "Neg",
        "Abs",
        "Max",
        "Min",
        "Cast",
        "Floor",
        "Ceil",
        "Round",
        "Sin",
        "Cos",
        "Where",
    }
)
#: Memory ops that read only as much as they write (gather-like), not their whole input.
OUTPUT_SIZED_READ_OPS = frozenset({"Slice", "Gather", "GatherElements", "GatherND"})

#: Breakdown kinds.
KIND_COMPUTE, KIND_MEMORY, KIND_QDQ, KIND_REFORMAT, KIND_FUSED = (
    "compute",
    "memory",
    "qdq",
    "reformat",
    "fused",
)
FP32, FP16, BF16, INT8 = "fp32", "fp16", "bf16", "int8"
#: ONNX float element type -> the precision a kernel on it runs at
_PRECISION: dict[int, str] = {1: FP32, 10: FP16, 16: BF16, 11: "fp64"}


@dataclass(frozen=True)
class GpuSpec:
    """Effective (achievable, not datasheet) figures of the modelled GPU.

    Defaults are loosely a data-center GPU at batch 1; they are calibrated so that the orderings
    in ``docs/costmodel.md`` hold, not to predict any particular card.
    """

    name: str = "generic-datacenter-gpu"
    #: dense FP16 (and BF16) tensor-core throughput at full efficiency
    fp16_tflops: float = 150.0
    #: FP32 convolutions and matmuls: TensorRT runs them on TF32 tensor cores (on by default
    #: since Ampere), at half the FP16 rate
    tf32_tflops: float = 75.0
    #: dense INT8 tensor-core throughput at full efficiency (2x FP16)
    int8_tops: float = 300.0
    #: DRAM bandwidth
    bandwidth_gbs: float = 2000.0
    #: fixed cost of every kernel (launch, ramp-up and tail)
    launch_us: float = 2.5
    #: tensor cores reach full efficiency when (K per group) x (N per group) >= this squared
    saturation_channels: int = 256
    #: efficiency floor for very narrow GEMMs (e.g. a 3-channel stem conv)
    min_efficiency: float = 1.0 / 32.0

    def efficiency(self, k: int, n: int) -> float:
        """Narrow GEMMs leave tensor-core tiles half empty, so throughput falls with channels."""
        eff = (k * n) / float(self.saturation_channels**2)
        return min(1.0, max(self.min_efficiency, eff))


class NodeCost(NamedTuple):
    """One ONNX node's share of the latency and why."""

    name: str
    op: str
    precision: str  # "fp32" | "fp16" | "bf16" | "int8"
    kind: str  # "compute" | "memory" | "qdq" | "reformat" | "fused"
    ms: float


@dataclass(frozen=True)
class CostBreakdown:
    """Estimated latency with the per-node explanation; ``total_ms == sum(ms of nodes)``."""

    total_ms: float
    nodes: tuple[NodeCost, ...] = field(default_factory=tuple)

    def node(self, name: str) -> NodeCost:
        for entry in self.nodes:
            if entry.name == name:
                return entry
        raise KeyError(name)

    @property
    def kernels(self) -> int:
        """Number of kernels the engine would launch (entries with a cost)."""
        return sum(1 for entry in self.nodes if entry.ms > 0)


# --------------------------------------------------------------------------------------------
# graph preparation


def _read_model(model: ModelSource | onnx.ModelProto) -> onnx.ModelProto:
    import onnx

    if isinstance(model, onnx.ModelProto):
        return model
    try:
        if isinstance(model, (bytes, bytearray, memoryview)):
            return onnx.load_from_string(bytes(model))
        return onnx.load(os.fspath(model), load_external_data=False)
    except Exception as exc:  # DecodeError, OSError, ...
        where = "model bytes" if isinstance(model, (bytes, bytearray, memoryview)) else model
        raise BackendError(f"costmodel: cannot read {where}: {exc}") from exc


#: Float initializers up to this size keep their data for shape inference (e.g. Resize scales).
KEEP_DATA_MAX_ELEMENTS = 64

_FLOAT_TYPES: frozenset[int] = frozenset({1, 10, 11, 16})  # FLOAT, FLOAT16, DOUBLE, BFLOAT16
_BYTE_TYPES: frozenset[int] = frozenset({2, 3})  # UINT8, INT8


def _light_copy(model: onnx.ModelProto) -> onnx.ModelProto:
    """Shape inference needs dims, not weights: drop float payloads so big models stay cheap."""
    import onnx

    light = onnx.ModelProto()
    light.CopyFrom(model)
    for init in light.graph.initializer:
        # small float tensors may be Resize scales that shape inference must read; external
        # data was not loaded, so its reference is dropped whatever the size
        big = math.prod(init.dims) > KEEP_DATA_MAX_ELEMENTS
        if init.data_type in _FLOAT_TYPES and (big or init.data_location == init.EXTERNAL):
            for name in ("raw_data", "float_data", "double_data", "int32_data", "external_data"):
                init.ClearField(name)
            init.ClearField("data_location")
    return light


def _fix_inputs(model: onnx.ModelProto, input_shapes: dict[str, tuple]) -> None:
    """Static shapes are needed for every byte count; fix symbolic dims from input_shapes."""
    graph = model.graph
    init_names = {init.name for init in graph.initializer}
    inputs = {vi.name: vi for vi in graph.input if vi.name not in init_names}
    for name in input_shapes:
        if name not in inputs:
            raise BackendError(
                f"costmodel: input_shapes names {name!r}, which is not a model input "
                f"(inputs: {', '.join(sorted(inputs)) or 'none'})"
            )
    for name, vi in inputs.items():
        tensor_type = vi.type.tensor_type
        if name in input_shapes:
            dims = [int(d) for d in input_shapes[name]]
            if any(d <= 0 for d in dims):
                raise BackendError(f"costmodel: input_shapes[{name!r}] = {dims} must be positive")
            if tensor_type.HasField("shape") and len(tensor_type.shape.dim) not in (0, len(dims)):
                raise BackendError(
                    f"costmodel: input_shapes[{name!r}] has rank {len(dims)}, the model input "
                    f"has rank {len(tensor_type.shape.dim)}"
                )
            tensor_type.ClearField("shape")
            tensor_type.shape.SetInParent()
            for d in dims:
                tensor_type.shape.dim.add().dim_value = d
            continue
        if not tensor_type.HasField("shape"):
            raise BackendError(
                f"costmodel: model input {name!r} has no shape; pass input_shapes={{{name!r}: ...}}"
            )
        for dim in tensor_type.shape.dim:
            if not dim.HasField("dim_value"):
                label = dim.dim_param or "?"
                raise BackendError(
                    f"costmodel: model input {name!r} has unresolved dimension {label!r}; "
                    f"pass input_shapes={{{name!r}: (...)}}"
                )


def _check_sorted(graph: onnx.GraphProto) -> None:
    """One forward pass of the analysis relies on topological order, as ONNX requires."""
    if not graph.node:
        raise BackendError("costmodel: the model graph has no nodes")
    known = {"", *(t.name for t in graph.initializer), *(vi.name for vi in graph.input)}
    for i, node in enumerate(graph.node):
        for name in node.input:
            if name not in known:
                label = node.name or f"{node.op_type}_{i}"
                raise BackendError(
                    f"costmodel: node {label!r} reads {name!r}, which no earlier node, input or "
                    "initializer provides (graph not topologically sorted?)"
                )
        known.update(node.output)


class _Graph:
    """Producer/consumer maps, static shapes and constant folding of one inferred graph."""

    def __init__(self, model: onnx.ModelProto) -> None:
        graph = model.graph
        self.nodes = list(graph.node)
        self.names = [n.name or f"{n.op_type}_{i}" for i, n in enumerate(self.nodes)]
        self.outputs = {vi.name for vi in graph.output}
        self.shape: dict[str, tuple[int, ...]] = {}
        self.dtype: dict[str, int] = {}
        for vi in (*graph.input, *graph.output, *graph.value_info):
            tensor_type = vi.type.tensor_type
            if tensor_type.elem_type:
                self.dtype.setdefault(vi.name, tensor_type.elem_type)
            if tensor_type.HasField("shape") and all(
                d.HasField("dim_value") for d in tensor_type.shape.dim
            ):
                self.shape.setdefault(vi.name, tuple(d.dim_value for d in tensor_type.shape.dim))
        self.const: set[str] = set()
        for init in graph.initializer:
            self.shape[init.name] = tuple(init.dims)
            self.dtype[init.name] = init.data_type
            self.const.add(init.name)

        self.producer: dict[str, int] = {}
        self.consumers: dict[str, list[tuple[int, int]]] = {}
        self.const_node = [False] * len(self.nodes)
        for i, node in enumerate(self.nodes):
            for k, name in enumerate(node.input):
                if name:
                    self.consumers.setdefault(name, []).append((i, k))
            inputs = [x for x in node.input if x]
            if node.op_type in SHAPE_OPS or (inputs and all(x in self.const for x in inputs)):
                self.const_node[i] = True
                self.const.update(o for o in node.output if o)
            for out in node.output:
                if out:
                    self.producer[out] = i
        self._src: dict[str, tuple[int, str] | None] = {}
        self._users: dict[str, tuple[list[tuple[int, int]], bool]] = {}

    def op(self, i: int) -> str:
        return self.nodes[i].op_type

    def src(self, tensor: str) -> tuple[int, str] | None:
        """The node (and its output) that really produces ``tensor``, looking through views."""
        if tensor in self._src:
            return self._src[tensor]
        t = tensor
        result: tuple[int, str] | None = None
        while True:
            p = self.producer.get(t)
            if p is None:
                break
            node = self.nodes[p]
            passthrough = node.op_type in VIEW_OPS or (
                self.const_node[p] and node.op_type not in (Q_OP, DQ_OP) and node.input
            )
            if passthrough and node.input[0]:
                t = node.input[0]
                continue
            result = (p, t)
            break
        self._src[tensor] = result
        return result

    def users(self, tensor: str) -> tuple[list[tuple[int, int]], bool]:
        """Real consumers ``(node, input index)`` looking through views; and whether a graph
        output needs the tensor (then it must exist in float)."""
        if tensor in self._users:
            return self._users[tensor]
        found: list[tuple[int, int]] = []
        to_output = False
        stack = [tensor]
        while stack:
            t = stack.pop()
            if t in self.outputs:
                to_output = True
            for i, k in self.consumers.get(t, ()):
                if self.op(i) in VIEW_OPS and k == 0:
                    stack.extend(o for o in self.nodes[i].output if o)
                else:
                    found.append((i, k))
        self._users[tensor] = (found, to_output)
        return found, to_output

    def dims(self, tensor: str) -> tuple[int, ...]:
        try:
            return self.shape[tensor]
        except KeyError:
            raise BackendError(
                f"costmodel: cannot resolve the shape of tensor {tensor!r}; pass input_shapes "
                "for symbolic model inputs (or the op is unknown to ONNX shape inference)"
            ) from None

    def numel(self, tensor: str) -> int:
        return math.prod(self.dims(tensor))

    def is_float(self, tensor: str) -> bool:
        return self.dtype.get(tensor, 1) in _FLOAT_TYPES

    def nbytes(self, tensor: str, int8: bool) -> int:
        """Engine bytes: floats in their own type (INT8 when quantized); others as stored."""
        dtype = self.dtype.get(tensor, 1)
        if dtype in _FLOAT_TYPES:
            size = INT8_BYTES if int8 else FLOAT_BYTES[dtype]
        elif dtype in _BYTE_TYPES:
            size = INT8_BYTES
        else:
            size = _itemsize(dtype)
        return self.numel(tensor) * size


_ITEMSIZE: dict[int, int] = {}


def _itemsize(dtype: int) -> int:
    if dtype not in _ITEMSIZE:
        import onnx

        try:
            _ITEMSIZE[dtype] = onnx.helper.tensor_dtype_to_np_dtype(dtype).itemsize
        except Exception:  # unknown / exotic dtypes: assume 4 bytes
            _ITEMSIZE[dtype] = 4
    return _ITEMSIZE[dtype]


def _attr(node: onnx.NodeProto, name: str, default: int) -> int:
    for a in node.attribute:
        if a.name == name:
            return int(a.i)
    return default


@dataclass
class _Kernel:
    """A compute op with everything TensorRT fuses into it."""

    head: int
    int8: bool
    final: str
    residual: tuple[int, int] | None = None  # (Add node, input index of the residual operand)
    out_int8: bool = False


# --------------------------------------------------------------------------------------------
# the model


class _Fusion:
    """The passes that turn a graph into TensorRT-like kernels: which nodes fuse into which,
    and which run INT8."""

    def __init__(self, g: _Graph, spec: GpuSpec) -> None:
        self.g = g
        self.spec = spec
        n = len(g.nodes)
        self.owner = [-1] * n  # kernel head a fused node belongs to
        self.kernels: dict[int, _Kernel] = {}
        self.kernel_final: dict[str, int] = {}
        self.int8_mem: set[int] = set()
        self.mem_tail: dict[int, int] = {}
        self.input_casts: set[int] = set()
        self._quantized: Callable[[str], bool] = lambda t: False

    # -- passes ------------------------------------------------------------------------------

    def _float_data(self, i: int) -> list[str]:
        g = self.g
        return [x for x in g.nodes[i].input if x and x not in g.const and g.is_float(x)]

    def make_kernels(self) -> None:
        g = self.g
        for i, node in enumerate(g.nodes):
            if g.const_node[i] or node.op_type not in COMPUTE_OPS or len(node.input) < 2:
                continue
            self.kernels[i] = _Kernel(head=i, int8=False, final=node.output[0])

    def fuse_epilogues(self) -> None:
        """BN / activations / scale-bias / one residual Add join the producing kernel.

        Later kernels claim first, so an Add of two conv outputs joins the conv that runs last.
        A Q/DQ between kernel and Add leaves the Add's input produced by DQ, so it cannot join.
        An INT8 kernel takes a residual Add only when the residual is quantized (TensorRT
        fuses the Add into an INT8 convolution with an INT8 residual operand, never FP16).
        """
        g = self.g
        for head in sorted(self.kernels, reverse=True):
            kernel = self.kernels[head]
            int8 = self._int8_inputs(head)
            t = kernel.final
            while t not in g.outputs:
                cons = g.consumers.get(t, [])
                if len(cons) == 1:
                    j, k = cons[0]
                    node = g.nodes[j]
                    if self.owner[j] != -1 or g.const_node[j] or j in self.kernels:
                        break
                    others = [x for idx, x in enumerate(node.input) if idx != k and x]
                    variable = [x for x in others if x not in g.const]
                    op = node.op_type
                    if (op in EPILOGUE_OPS or op in SCALE_BIAS_OPS) and not variable:
                        pass
                    elif (
                        op == "Add"
                        and kernel.residual is None
                        and len(variable) == 1
                        and variable[0] != t
                        and (not int8 or self._from_dq(variable[0]))
                    ):
                        kernel.residual = (j, 1 - k)
                    else:
                        break
                    self.owner[j] = head
                    t = node.output[0]
                elif len(cons) == 2:
                    silu = self._silu(t, cons)
                    if silu is None:
                        break
                    for j in silu:
                        self.owner[j] = head
                    t = g.nodes[silu[1]].output[0]
                else:
                    break
            kernel.final = t
            self.kernel_final[t] = head

    def _from_dq(self, t: str, depth: int = 0) -> bool:
        """``t`` comes from a DQ, directly or through INT8 movement ops (Concat, MaxPool, ...)
        over DQ'd tensors: quantized before the INT8 pass decides it (see int8_precision)."""
        g = self.g
        found = g.src(t)
        if found is None or depth > 32:
            return False
        op = g.op(found[0])
        if op == DQ_OP:
            return True
        data = self._float_data(found[0])
        return op in MOVEMENT_OPS and bool(data) and all(self._from_dq(x, depth + 1) for x in data)

    def _int8_inputs(self, head: int) -> bool:
        node = self.g.nodes[head]
        return self._from_dq(node.input[0]) and self._from_dq(node.input[1])

    def _silu(self, t: str, cons: list[tuple[int, int]]) -> tuple[int, int] | None:
        """x * Sigmoid(x) on a kernel output fuses like any activation."""
        g = self.g
        (a, _), (b, _) = cons
        for sig, mul in ((a, b), (b, a)):
            if g.op(sig) != "Sigmoid" or g.op(mul) != "Mul":
                continue
            if self.owner[sig] != -1 or self.owner[mul] != -1:
                continue
            s_out = g.nodes[sig].output[0]
            if s_out in g.outputs or len(g.consumers.get(s_out, [])) != 1:
                continue
            if sorted(g.nodes[mul].input) == sorted([t, s_out]):
                return sig, mul
        return None

    def int8_precision(self) -> None:
        """Decide which ops move or compute INT8 data.

        A tensor is *quantized* when it comes from DQ, or from an INT8 movement op (Concat,
        Transpose, MaxPool, ...) over quantized tensors. A compute op runs INT8 when its
        activation and weight are both quantized. A memory op runs INT8 when all its float
        inputs come from DQ or other INT8 memory ops, and every consumer is a Q, another INT8
        memory op or, for movement ops over quantized data, an INT8 compute op. This is the
        greatest such set, found by removing violators until none is left.
        """
        g = self.g
        cand = {
            i
            for i, node in enumerate(g.nodes)
            if node.op_type in INT8_MEMORY_OPS
            and not g.const_node[i]
            and self.owner[i] == -1
            and i not in self.kernels
        }
        memo: dict[str, bool] = {}

        def quantized(t: str) -> bool:
            if t not in memo:
                found = g.src(t)
                ok = False
                if found is not None:
                    p = found[0]
                    if g.op(p) == DQ_OP:
                        ok = True
                    elif p in cand and g.op(p) in MOVEMENT_OPS:
                        ok = all(quantized(x) for x in self._float_data(p))
                memo[t] = ok
            return memo[t]

        def int8_compute(j: int) -> bool:
            node = g.nodes[j]
            return quantized(node.input[0]) and quantized(node.input[1])

        def ok(i: int) -> bool:
            data = self._float_data(i)
            if not data:
                return False
            for x in data:
                found = g.src(x)
                if found is None or (g.op(found[0]) != DQ_OP and found[0] not in cand):
                    return False
            movement = g.op(i) in MOVEMENT_OPS and all(quantized(x) for x in data)
            for out in g.nodes[i].output:
                if not out:
                    continue
                users, to_output = g.users(out)
                if to_output:
                    return False
                for j, k in users:
                    if g.op(j) == Q_OP or j in cand:
                        continue
                    if movement and j in self.kernels and k in (0, 1) and int8_compute(j):
                        continue
                    return False
            return True

        changed = True
        while changed:
            changed = False
            for i in sorted(cand):
                if not ok(i):
                    cand.discard(i)
                    memo.clear()
                    changed = True
        self.int8_mem = cand
        for j, kernel in self.kernels.items():
            kernel.int8 = int8_compute(j)
        self._quantized = quantized

    def propagate_q(self) -> None:
        """kernel -> MaxPool -> Q runs as kernel(+Q) -> INT8 MaxPool, as TensorRT moves the Q
        backwards over ops that commute with quantization."""
        g = self.g
        for i, node in enumerate(g.nodes):
            if (
                node.op_type not in Q_COMMUTING_OPS
                or i in self.int8_mem
                or g.const_node[i]
                or self.owner[i] != -1
                or not node.input
            ):
                continue
            found = g.src(node.input[0])
            if found is None or found[1] not in self.kernel_final:
                continue
            users, to_output = g.users(found[1])
            if to_output or users != [(i, 0)]:
                continue
            users, to_output = g.users(node.output[0])
            if to_output or not users:
                continue
            if all(g.op(j) == Q_OP or j in self.int8_mem for j, _ in users):
                self.int8_mem.add(i)

    def fuse_pointwise(self) -> None:
        """A unary pointwise op after a stand-alone pointwise kernel joins it (PointWise fusion)."""
        g = self.g
        for i, node in enumerate(g.nodes):
            if (
                node.op_type not in POINTWISE_OPS
                or g.const_node[i]
                or self.owner[i] != -1
                or i in self.kernels
            ):
                continue
            variable = [x for x in node.input if x and x not in g.const]
            if len(variable) != 1:
                continue
            t = variable[0]
            p = g.producer.get(t)
            if p is None or t in g.outputs or len(g.consumers.get(t, [])) != 1:
                continue
            head = self.owner[p] if self.owner[p] != -1 else p
            if head in self.kernels or g.op(head) not in POINTWISE_OPS or g.const_node[head]:
                continue
            if (head in self.int8_mem) != (i in self.int8_mem):
                continue
            self.owner[i] = head
            self.mem_tail[head] = i

    def _dq_absorbed(self, i: int) -> bool:
        """Free when every consumer reads INT8 itself; a graph output is converted by the
        engine's output copy anyway, so it does not need a kernel of its own."""
        g = self.g
        users, _ = g.users(g.nodes[i].output[0])
        for j, k in users:
            kernel = self.kernels.get(j)
            if kernel is not None and kernel.int8 and k in (0, 1):
                continue
            if j in self.int8_mem:
                continue
            head = self.owner[j]
            if head in self.kernels and self.kernels[head].int8:
                if self.kernels[head].residual == (j, k):
                    continue
            return False
        return True

    def _writes_int8(self, tensor: str) -> bool:
        """The producer can emit INT8 directly: a compute kernel's final output (Q fused into the
        epilogue) or an INT8 memory op; and no consumer needs the float tensor."""
        g = self.g
        found = g.src(tensor)
        if found is None:  # a graph input: quantized by the engine's input copy
            base = tensor
            while base in g.producer:  # views between the input and the Q
                base = g.nodes[g.producer[base]].input[0]
            if base in g.const or base in g.outputs:
                return False
            users, _ = g.users(base)
            return all(g.op(j) == Q_OP for j, _ in users)
        p, base = found
        writer = self.kernel_final.get(base) is not None or p in self.int8_mem \
            or p in self.input_casts
        if not writer:
            return False
        users, to_output = g.users(base)
        if to_output or not users:
            return False
        return all(g.op(j) == Q_OP or j in self.int8_mem for j, _ in users)

    def find_input_casts(self) -> None:
        """A Cast of a graph input (``keep_io_types``) read only by Qs: one pointwise kernel
        with them, that writes INT8 (as the engine's input copy does for a graph input)."""
        g = self.g
        for i, node in enumerate(g.nodes):
            if node.op_type != "Cast" or g.const_node[i] or not node.input:
                continue
            if g.src(node.input[0]) is not None or not g.is_float(node.input[0]):
                continue
            users, to_output = g.users(node.output[0])
            if users and not to_output and all(g.op(j) == Q_OP for j, _ in users):
                self.input_casts.add(i)


class _Estimator(_Fusion):
    """Prices the kernels :class:`_Fusion` formed, node by node (:meth:`run`)."""

    # -- costs -------------------------------------------------------------------------------

    def _ms(self, flops: float, nbytes: float, tput_tflops: float, eff: float) -> float:
        spec = self.spec
        compute = flops / (tput_tflops * 1e12 * eff) * 1e3 if flops else 0.0
        memory = nbytes / (spec.bandwidth_gbs * 1e9) * 1e3
        return max(compute, memory) + spec.launch_us * 1e-3

    def _kernel_ms(self, kernel: _Kernel) -> float:
        g, spec = self.g, self.spec
        node = g.nodes[kernel.head]
        op = node.op_type
        x, w, y = node.input[0], node.input[1], node.output[0]
        sx, sw, sy = g.dims(x), g.dims(w), g.dims(y)
        depthwise = False
        if op in ("Conv", "ConvTranspose"):
            group = _attr(node, "group", 1)
            expected = sw[1] * group if op == "Conv" else sw[0]
            if len(sx) < 3 or len(sx) != len(sw) or sx[1] != expected:
                raise BackendError(
                    f"costmodel: {op} {g.names[kernel.head]!r}: input {x!r} {list(sx)} does not "
                    f"match weight {w!r} {list(sw)} (group={group})"
                )
        if op == "Conv":
            k = sx[1] // group
            n = sw[0] // group
            flops = 2.0 * math.prod(sy) * k * math.prod(sw[2:])
            depthwise = group > 1 and k == 1
        elif op == "ConvTranspose":
            k = sx[1] // group
            n = sw[1]
            flops = 2.0 * math.prod(sx) * n * math.prod(sw[2:])
        elif op == "Gemm":
            k = sx[0] if _attr(node, "transA", 0) else sx[-1]
            n = sy[-1]
            flops = 2.0 * math.prod(sy) * k
        else:  # MatMul, broadcasting batch dims
            k = sx[-1]
            n = sw[-1] if len(sw) > 1 else 1
            flops = 2.0 * math.prod(sy) * k
        nbytes = g.nbytes(x, kernel.int8) + g.nbytes(w, kernel.int8)
        if len(node.input) > 2 and node.input[2]:
            nbytes += g.numel(node.input[2]) * BIAS_BYTES
        if kernel.residual is not None:
            add, idx = kernel.residual
            res = g.nodes[add].input[idx]
            nbytes += g.nbytes(res, kernel.int8 and self._quantized(res))
        nbytes += g.nbytes(kernel.final, kernel.out_int8)
        if depthwise:  # too little reuse for tensor cores: bytes decide
            flops = 0.0
        if kernel.int8:
            tput = spec.int8_tops
        else:
            tput = spec.tf32_tflops if g.dtype.get(x, 1) in (1, 11) else spec.fp16_tflops
        return self._ms(flops, nbytes, tput, spec.efficiency(k, n))

    def _memory_ms(self, head: int, int8: bool) -> float:
        g = self.g
        node = g.nodes[head]
        tail = g.nodes[self.mem_tail.get(head, head)]
        outs = [o for o in tail.output if o]
        written = sum(g.nbytes(o, int8 or head in self.input_casts) for o in outs)
        if node.op_type in OUTPUT_SIZED_READ_OPS:
            read = written
        else:
            read = sum(g.nbytes(x, int8) for x in node.input if x and x not in g.const)
        return self._ms(0.0, read + written, 1.0, 1.0)

    def _reformat_ms(self, tensor: str) -> float:
        """A stand-alone Q or DQ: reads/writes ``tensor`` (its float side) and the INT8 one."""
        g = self.g
        return self._ms(0.0, g.nbytes(tensor, False) + g.numel(tensor) * INT8_BYTES, 1.0, 1.0)

    def precision(self, i: int) -> str:
        """The float type node ``i`` runs at: its first float data input's (or output's)."""
        g = self.g
        node = g.nodes[i]
        for x in (*node.input, *node.output):
            if x and x not in g.const and g.dtype.get(x, 1) in _PRECISION:
                return _PRECISION[g.dtype[x]]
        return FP32

    def run(self) -> CostBreakdown:
        g = self.g
        self.make_kernels()
        self.fuse_epilogues()
        self.int8_precision()
        self.propagate_q()
        self.fuse_pointwise()
        self.find_input_casts()
        for kernel in self.kernels.values():
            kernel.out_int8 = self._writes_int8(kernel.final)

        entries: list[NodeCost] = []
        for i, node in enumerate(g.nodes):
            op, name = node.op_type, g.names[i]
            if op in (Q_OP, DQ_OP):
                if g.const_node[i]:
                    entries.append(NodeCost(name, op, INT8, KIND_QDQ, 0.0))
                    continue
                free = self._dq_absorbed(i) if op == DQ_OP else self._writes_int8(node.input[0])
                if free:
                    entries.append(NodeCost(name, op, INT8, KIND_QDQ, 0.0))
                else:
                    ms = self._reformat_ms(node.input[0] if op == Q_OP else node.output[0])
                    entries.append(NodeCost(name, op, INT8, KIND_REFORMAT, ms))
            elif g.const_node[i] or op in VIEW_OPS:
                entries.append(NodeCost(name, op, self.precision(i), KIND_FUSED, 0.0))
            elif i in self.kernels:
                kernel = self.kernels[i]
                precision = INT8 if kernel.int8 else self.precision(i)
                entries.append(NodeCost(name, op, precision, KIND_COMPUTE, self._kernel_ms(kernel)))
            elif self.owner[i] != -1:
                head = self.owner[i]
                int8 = self.kernels[head].int8 if head in self.kernels else head in self.int8_mem
                entries.append(NodeCost(name, op, INT8 if int8 else self.precision(i), KIND_FUSED,
                                        0.0))
            elif i in self.int8_mem and op == "Concat":
                # TensorRT elides the copy: producers write straight into the INT8 concat buffer.
                entries.append(NodeCost(name, op, INT8, KIND_FUSED, 0.0))
            else:
                int8 = i in self.int8_mem
                ms = self._memory_ms(i, int8)
                entries.append(NodeCost(name, op, INT8 if int8 else self.precision(i), KIND_MEMORY,
                                        ms))
        total = sum(entry.ms for entry in entries)
        return CostBreakdown(total_ms=total, nodes=tuple(entries))


def estimate(
    model: ModelSource | onnx.ModelProto,
    *,
    device: GpuSpec | None = None,
    input_shapes: dict[str, tuple] | None = None,
) -> CostBreakdown:
    """Estimate one model's latency on ``device``; raises :class:`BackendError` if unusable."""
    import onnx

    proto = _read_model(model)
    light = _light_copy(proto)
    _check_sorted(light.graph)
    _fix_inputs(light, dict(input_shapes or {}))
    try:  # strict: an invalid graph must fail here rather than get a plausible figure
        inferred = onnx.shape_inference.infer_shapes(light, strict_mode=True, data_prop=True)
    except Exception as exc:
        raise BackendError(f"costmodel: shape inference failed: {str(exc).strip()}") from exc
    return _Estimator(_Graph(inferred), device or GpuSpec()).run()


class CostModelBackend(Backend):
    """TensorRT-like INT8/FP16/FP32 latency from graph analysis alone: no GPU, no noise."""

    name = "costmodel"
    deterministic = True

    def __init__(
        self,
        *,
        device: GpuSpec | None = None,
        input_shapes: dict[str, tuple] | None = None,
    ) -> None:
        self.device = device or GpuSpec()
        self.input_shapes = {k: tuple(int(d) for d in v) for k, v in (input_shapes or {}).items()}

    def estimate(self, model: ModelSource | onnx.ModelProto) -> CostBreakdown:
        return estimate(model, device=self.device, input_shapes=self.input_shapes)

    def load(self, model: ModelSource) -> Runner:
        return FixedRunner(self.estimate(model).total_ms)

    def what_ran(self, model: bytes):
        """Read from this model's own fusion decisions (:func:`what_costmodel_ran`)."""
        return what_costmodel_ran(model, device=self.device, input_shapes=self.input_shapes)

    def describe(self) -> dict:
        return {
            "name": self.name,
            "device": dataclasses.asdict(self.device),
            "input_shapes": {k: list(v) for k, v in sorted(self.input_shapes.items())},
        }


def what_costmodel_ran(model: ModelSource | onnx.ModelProto, *, device: GpuSpec | None = None,
                       input_shapes: dict[str, tuple] | None = None):
    """What the cost model's engine ran (:class:`~qdq_optuna.backends.what_ran.WhatRan`): a Q
    or DQ it priced as free was fused, one it priced as a reformat kernel stayed standalone
    (its reformat); a float compute or memory kernel next to an INT8 one (or a Q/DQ) is a
    float island."""
    from qdq_optuna.backends.what_ran import WhatRan, quantized_tensors

    proto = _read_model(model)
    breakdown = estimate(proto, device=device, input_shapes=input_shapes)
    nodes = list(proto.graph.node)
    if len(nodes) != len(breakdown.nodes):  # the estimate reads the graph node by node
        return None
    quantized = quantized_tensors(proto)
    entry = dict(zip((id(n) for n in nodes), breakdown.nodes, strict=True))
    producer = {o: n for n in nodes for o in n.output}
    consumers: dict[str, list] = {}
    for n in nodes:
        for t in n.input:
            consumers.setdefault(t, []).append(n)
    standalone = {quantized[n.input[0]] for n in nodes
                  if n.op_type in (Q_OP, DQ_OP) and n.input[0] in quantized
                  and entry[id(n)].kind == KIND_REFORMAT}

    def int8_near(n) -> bool:
        near = [producer.get(t) for t in n.input] + [c for t in n.output
                                                     for c in consumers.get(t, [])]
        return any(m is not None and entry[id(m)].precision == INT8 for m in near)

    float_nodes = {n.name for n in nodes
                   if n.name and entry[id(n)].kind in (KIND_COMPUTE, KIND_MEMORY)
                   and entry[id(n)].precision != INT8 and int8_near(n)}
    return WhatRan("cost model fusion decisions", fused=frozenset(set(quantized.values())
                                                                   - standalone),
                   standalone=frozenset(standalone), float_nodes=frozenset(float_nodes),
                   reformats=frozenset(standalone))
