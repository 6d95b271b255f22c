"""Dynamic int8 MatMuls: activations quantized per call, int8 weights, written in ONNX as
ONNX Runtime's ``quantize_dynamic`` writes them (DynamicQuantizeLinear + MatMulInteger, which
ONNX Runtime's CPU optimizer fuses into DynamicQuantizeMatMul / MatMulIntegerToFloat).

Why: on transformers ONNX Runtime's fastest CPU kernels are not static Q/DQ. Dynamically
quantized MatMuls need no conversion around LayerNorm, GELU and Softmax and keep their own
per-call activation range, so they are both faster and more accurate there than static Q/DQ
(a ViT-Ti/16 at one thread: ``quantize_static`` 1.53x FP32 at cosine 0.979,
``quantize_dynamic`` 2.04x at cosine 0.9997); ONNX Runtime's documentation recommends it for
transformers on CPU.

This module holds the quantization modes (:class:`QuantMode`), which nodes can run in a
per-node mode (:func:`dynamic_node_ok`), the use that stands for a node run in such a mode
(:func:`mode_use`: what a pattern's ``dynamic``, ``weight_int8`` or ``weight_int4``
insertion point covers, so the sampler, the pattern studies, the cache and resuming treat a
mode like a placement) and how the exporter writes a dynamic node (:func:`dynamic_node`; a
weight-only one: :mod:`.weight_only`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qdq_optuna.errors import OptionError
from qdq_optuna.model.graph import (
    GRAPH_INITIALIZER,
    GRAPH_NODE,
    Graph,
    Use,
    wire_field,
)


class QuantMode(str, enum.Enum):
    """How a node runs quantized: ``static`` (Q/DQ pairs where the placement puts them,
    scales calibrated once), ``dynamic`` (activations quantized per call, int8 weights) or
    weight-only (``weight_int8``, ``weight_int4``: the weight stored in blocks of 8 or 4 bits,
    the activation float; :mod:`.weight_only`)."""

    STATIC = "static"
    DYNAMIC = "dynamic"
    WEIGHT_INT8 = "weight_int8"
    WEIGHT_INT4 = "weight_int4"

    @property
    def bits(self) -> int | None:
        """A weight-only mode's weight bits (None for the others)."""
        return {QuantMode.WEIGHT_INT8: 8, QuantMode.WEIGHT_INT4: 4}.get(self)

    @property
    def per_node(self) -> bool:
        """A mode a node takes as a whole (an on/off insertion point of its own), not a
        placement of Q/DQ pairs."""
        return self is not QuantMode.STATIC

    @staticmethod
    def parse(value: str | Iterable[str] | None, offered: tuple[QuantMode, ...],
              runtime: str, default: tuple[QuantMode, ...] | None = None,
              lacking: dict[QuantMode, str] | None = None) -> tuple[QuantMode, ...]:
        """``--modes`` (comma-separated or a list; None: ``default``, else every mode
        ``offered``), checked against what the runtime offers: a mode it lacks is one line
        naming it (``lacking``: why, for a mode its installed version has no kernel for).
        Static is always searched (the other modes add to the placement)."""
        if value is None:
            return offered if default is None else tuple(m for m in default if m in offered)
        names = value.split(",") if isinstance(value, str) else list(value)
        modes = []
        for name in (str(getattr(n, "value", n)).strip() for n in names):
            known = {m.value: m for m in QuantMode}
            if name not in known:
                raise OptionError(f"--modes: unknown mode {name!r} "
                                  f"(choose from {', '.join(known)})")
            if known[name] not in offered:
                why = (lacking or {}).get(known[name])
                raise OptionError(f"--modes: {why}" if why else
                                  f"--modes: {runtime} offers no {name} mode here "
                                  f"(it offers {', '.join(m.value for m in offered)})")
            modes.append(known[name])
        chosen = {QuantMode.STATIC, *modes}
        return tuple(m for m in QuantMode if m in chosen)  # one order: the run's fingerprint


#: the slot of a dynamic use: a node run dynamically, not one of its input slots
DYNAMIC_SLOT = -2
#: the tensor name of a dynamic use, before the node's name (never a tensor of the graph)
DYNAMIC_PREFIX = "dynamic:"
#: the slot of each per-node mode's use (never an input slot of the node)
MODE_SLOTS = {QuantMode.DYNAMIC: DYNAMIC_SLOT, QuantMode.WEIGHT_INT8: -3,
              QuantMode.WEIGHT_INT4: -4}
_SLOT_MODES = {slot: mode for mode, slot in MODE_SLOTS.items()}
#: which mode a node whose uses of several modes are on runs (the search proposes points
#: independently; a node runs one mode): the most accurate
MODE_PRECEDENCE = (QuantMode.DYNAMIC, QuantMode.WEIGHT_INT8, QuantMode.WEIGHT_INT4)


def mode_use(graph: Graph, node: int, mode: QuantMode) -> Use:
    """The use that stands for ``node`` run in a per-node ``mode``: what its insertion point
    covers (a name that is never a tensor of the graph, the mode's slot)."""
    return (f"{mode.value}:{graph.nodes[node].name or node}", node, MODE_SLOTS[mode])


def dynamic_use(graph: Graph, node: int) -> Use:
    """The use that stands for ``node`` run dynamically: what its insertion point covers."""
    return mode_use(graph, node, QuantMode.DYNAMIC)


def slot_mode(slot: int) -> QuantMode | None:
    """The per-node mode a use's slot stands for (None: an input slot, static Q/DQ)."""
    return _SLOT_MODES.get(slot)


def use_mode(use: Use) -> QuantMode | None:
    """The per-node mode a use stands for (None: a tensor use, static Q/DQ)."""
    return slot_mode(use[2])


def is_dynamic(use: Use) -> bool:
    return use[2] == DYNAMIC_SLOT


def _gemm_attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def dynamic_node_ok(graph: Graph, node: int, ops: Iterable[str]) -> bool:
    """Whether ``node`` can run dynamically: one of ``ops`` (the rules' ``dynamic_ops``), a
    float activation A and a constant 2-D FP32 weight B (``quantize_dynamic``'s
    ``MatMulConstBOnly``); a Gemm (what ONNX Runtime's basic fusions make of MatMul + Add)
    with alpha and beta 1, A not transposed and a constant bias or none."""
    n = graph.nodes[node]
    if n.op_type not in ops or len(n.input) < 2 or not n.input[1]:
        return False
    w = n.input[1]
    if n.op_type == "Gemm":
        attrs = _gemm_attrs(n)
        if attrs.get("alpha", 1.0) != 1.0 or attrs.get("beta", 1.0) != 1.0 \
                or attrs.get("transA", 0) or (len(n.input) > 2 and n.input[2]
                                              and not graph.is_constant(n.input[2])):
            return False
    return (w in graph.initializers and graph.is_constant(w) and graph.is_activation(n.input[0])
            and graph.elem_types.get(w) == TensorProto.FLOAT
            and graph.elem_types.get(n.input[0]) == TensorProto.FLOAT
            and len(graph.initializer(w).dims) == 2)


def dynamic_node(graph: Graph, node: int, unique: Callable[[str], str], weight: np.ndarray,
                 qmax: float, *, source: str | None = None,
                 output: str | None = None) -> tuple[bytes, bytes]:
    """``(initializers, nodes)`` that replace ``node`` (a MatMul or Gemm of a constant weight),
    as ``quantize_dynamic(per_channel=True)`` writes a MatMul: DynamicQuantizeLinear on A, int8
    weights per output column (symmetric, ``qmax``: 7 bits where the CPU's kernels saturate),
    MatMulInteger, Cast, the two scales multiplied, the product scaled; ``source`` and
    ``output``: the names it reads and writes (the node's own unless renamed).

    Why per column: ONNX Runtime fuses it into the same integer kernel as a scale per tensor
    (``quantize_dynamic``'s default), and on a ViT-like model it made the whole model's
    held-out 1 - cosine 0.00074 instead of 0.00133 at the same speed within 2 %
    (``benchmarks/results/dynamic_per_channel.md``): room the accuracy bound then leaves to
    the placement around it."""
    n = graph.nodes[node]
    a, base = source or n.input[0], n.name or n.output[0]
    out = output or n.output[0]
    gemm = n.op_type == "Gemm"
    if gemm and _gemm_attrs(n).get("transB", 0):
        weight = weight.T
    bias = n.input[2] if gemm and len(n.input) > 2 and n.input[2] else None
    scale = np.maximum(np.abs(weight).max(axis=0, initial=0.0) / qmax,
                       1e-12).astype(np.float32)  # one per output column
    wq = np.clip(np.rint(weight / scale), -qmax, qmax).astype(np.int8)
    names = {k: unique(f"{base}_{k}") for k in (
        "W_quantized", "W_scale", "W_zero_point", "A_quantized", "A_scale", "A_zero_point",
        "MatMulInteger", "output_int32", "output_float", "scales", "scaled", "dynamic")}
    inits = b"".join(wire_field(GRAPH_INITIALIZER, t.SerializeToString()) for t in (
        numpy_helper.from_array(wq, names["W_quantized"]),
        numpy_helper.from_array(scale, names["W_scale"]),
        numpy_helper.from_array(np.zeros(scale.shape, np.int8), names["W_zero_point"])))
    nodes = [
        helper.make_node("DynamicQuantizeLinear", [a],
                         [names["A_quantized"], names["A_scale"], names["A_zero_point"]],
                         name=unique(f"{base}_DynamicQuantizeLinear")),
        helper.make_node("MatMulInteger", [names["A_quantized"], names["W_quantized"],
                                           names["A_zero_point"], names["W_zero_point"]],
                         [names["output_int32"]], name=n.name or names["MatMulInteger"]),
        helper.make_node("Cast", [names["output_int32"]], [names["output_float"]],
                         to=TensorProto.FLOAT, name=unique(f"{base}_Cast")),
        helper.make_node("Mul", [names["A_scale"], names["W_scale"]], [names["scales"]],
                         name=unique(f"{base}_scales_Mul")),
        helper.make_node("Mul", [names["output_float"], names["scales"]],
                         [names["scaled"] if bias else out], name=names["dynamic"]),
    ]
    if bias:  # Gemm's C, added as MatMul + Add (ONNX Runtime fuses it into the kernel)
        nodes.append(helper.make_node("Add", [names["scaled"], bias], [out],
                                      name=unique(f"{base}_bias_Add")))
    return inits, b"".join(wire_field(GRAPH_NODE, x.SerializeToString()) for x in nodes)


#: the ops whose mode :func:`node_modes` reports (the weighted ops)
MODE_OPS = frozenset({"Conv", "ConvTranspose", "MatMul", "Gemm"})
#: the integer ops a dynamically quantized node is written as
_DYNAMIC_OPS = frozenset({"MatMulInteger", "ConvInteger"})
#: the op a weight-only node is written as (its ``bits`` attribute says which mode)
_WEIGHT_ONLY_OP = "MatMulNBits"


def node_modes(model: onnx.ModelProto | bytes) -> dict[str, str]:
    """Each MatMul/Gemm/Conv's mode in a written model (report.json's ``node_modes``):
    ``dynamic`` (written as an integer op reading DynamicQuantizeLinear: its name is the
    node's), ``weight_int8``/``weight_int4`` (a MatMulNBits of that many bits), ``static``
    (its activation input read through a DequantizeLinear) or ``float``. Read from the file
    itself, so it holds for a recipe file that ships too."""
    if isinstance(model, bytes):
        model = onnx.load_from_string(model)
    dq = {o for n in model.graph.node if n.op_type == "DequantizeLinear" for o in n.output}
    weight_only = {m.bits: m.value for m in QuantMode if m.bits}
    modes = {}
    for i, n in enumerate(model.graph.node):
        name = n.name or f"#{i}"
        if n.op_type in _DYNAMIC_OPS:
            modes[name] = QuantMode.DYNAMIC.value
        elif n.op_type == _WEIGHT_ONLY_OP:
            bits = {a.name: a.i for a in n.attribute}.get("bits", 4)
            modes[name] = weight_only.get(bits, f"weight_{bits}bit")
        elif n.op_type in MODE_OPS:
            modes[name] = QuantMode.STATIC.value if n.input and n.input[0] in dq else "float"
    return modes


#: report.json ``mode_counts``' keys, in order
MODE_COUNT_KEYS = (*(m.value for m in QuantMode), "float")
