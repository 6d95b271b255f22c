"""A recipe's own model next to our export of the same placement: do both run the same kernels
once ONNX Runtime has optimized them (:class:`RecipeParity`, made by the ONNX Runtime profile's
``recipe_parity``)? And, for any recipe file, what differs between its Q/DQ tensors and a
re-export's (:func:`qdq_differences`: scales, zero points, types, shared scales)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import onnx

from qdq_optuna.backends.onnxruntime_kernels import Kernels


@dataclass(frozen=True)
class RecipeParity:
    """ONNX Runtime's recipe on a model, its placement mapped onto our insertion points
    (the recipe read back as a start), and the kernels of both models after ONNX Runtime's
    optimizations: ``ours`` is our export of the projected placement with the recipe's scales."""

    start: object  # starts.Start
    ours: Kernels
    recipe: Kernels
    #: worst cosine / relative L2 / max abs of our export's outputs against the recipe's
    #: model's on the given inputs (None when no inputs were given)
    agreement: Mapping[str, float] | None = None

    @property
    def verdict(self) -> str:
        """``identical`` (every op count), ``fewer Q/DQ`` (the same kernels, no Q/DQ node
        the recipe lacks), ``more Q/DQ`` (the same kernels), else ``different kernels``."""
        if self.ours.same_as(self.recipe):
            return "identical"
        if self.ours.no_more_work_than(self.recipe):
            return "fewer Q/DQ"
        return "more Q/DQ" if self.ours.same_compute(self.recipe) else "different kernels"

    @property
    def as_fast(self) -> bool:
        """Our export runs every kernel the recipe's does, with no extra Q/DQ node."""
        return self.verdict in ("identical", "fewer Q/DQ")

    def diff(self) -> dict[str, tuple[int, int]]:
        """Op type -> (ours, the recipe's) where the counts differ."""
        return self.ours.diff(self.recipe)


# -- the Q/DQ tensors of two models ----------------------------------------------------------
@dataclass(frozen=True)
class QParams:
    """How one tensor is quantized: its scale and zero point values, the quantized type, and
    the name of the scale initializer (tensors that name the same one share a scale)."""

    scale: tuple[float, ...]
    zero_point: tuple[int, ...]
    qtype: str
    scale_name: str


def qdq_params(model: bytes | onnx.ModelProto | str) -> dict[str, QParams]:
    """Quantized tensor -> its :class:`QParams`: activations by the float tensor a
    QuantizeLinear reads (behind Casts/Identities), weights as ``weight NODE[SLOT]`` by the
    node that reads their DequantizeLinear (initializer names differ between tools)."""
    from qdq_optuna.placement.starts import _QDQIndex

    if isinstance(model, bytes):
        model = onnx.load_from_string(model)
    elif not isinstance(model, onnx.ModelProto):
        model = onnx.load(str(model))
    ix = _QDQIndex.of(model)
    inits = {t.name: t for t in model.graph.initializer}
    inits.update({n.output[0]: a.t for n in model.graph.node if n.op_type == "Constant"
                  for a in n.attribute if a.name == "value"})
    outputs = {o.name for o in model.graph.output}
    out: dict[str, QParams] = {}
    for node in ix.nodes:
        if node.op_type not in ("QuantizeLinear", "DequantizeLinear"):
            continue  # a Constant node (paddle2onnx writes weights so) has no input at all
        const = node.input[0] in ix.constants
        if node.op_type == "QuantizeLinear" and not const:
            # a quantized graph output by its name (each tool renames the float tensor)
            named = [dq.output[0] for dq, _ in ix.consumers.get(node.output[0], [])
                     if dq.op_type == "DequantizeLinear" and dq.output[0] in outputs]
            out[named[0] if named else ix.source(node.input[0])] = _params(node, inits)
        elif node.op_type == "DequantizeLinear" and const:
            for reader, slot in ix.readers(node.output[0]):
                out[f"weight {reader.name or reader.op_type}[{slot}]"] = _params(node, inits)
    return out


def _params(node: onnx.NodeProto, inits: Mapping[str, onnx.TensorProto]) -> QParams:
    from onnx import numpy_helper

    def values(i: int):
        name = node.input[i] if len(node.input) > i else ""
        return numpy_helper.to_array(inits[name]).reshape(-1) if name in inits else None

    scale, zp = values(1), values(2)
    zp_type = inits[node.input[2]].data_type if zp is not None else onnx.TensorProto.UINT8
    return QParams(tuple(float(x) for x in (scale if scale is not None else ())),
                   tuple(int(x) for x in (zp if zp is not None else (0,))),
                   onnx.helper.tensor_dtype_to_np_dtype(zp_type).name, node.input[1])


def qdq_differences(ours: bytes | onnx.ModelProto | str, recipe: bytes | onnx.ModelProto | str,
                    *, rtol: float = 1e-5, limit: int = 6) -> list[str]:
    """What differs between the Q/DQ of ``ours`` (a re-export of the recipe's placement) and
    the recipe's own file, one line per kind (tensors quantized in one only, types, zero
    points, scales, scales shared in one only); empty when the two quantize alike."""
    a, b = qdq_params(ours), qdq_params(recipe)
    kinds: dict[str, list[str]] = {}

    def add(kind: str, item: str) -> None:
        kinds.setdefault(kind, []).append(item)

    for t in sorted(set(b) - set(a)):
        add("quantized only in the recipe's file", t)
    for t in sorted(set(a) - set(b)):
        add("quantized only in the re-export", t)
    for t in sorted(set(a) & set(b)):
        x, y = a[t], b[t]
        if x.qtype != y.qtype:
            add("other type", f"{t} ({x.qtype} vs {y.qtype})")
        if x.zero_point != y.zero_point:
            add("other zero point", f"{t} ({_short(x.zero_point)} vs {_short(y.zero_point)})")
        if len(x.scale) != len(y.scale) or not all(
                abs(p - q) <= rtol * max(abs(p), abs(q)) for p, q in zip(x.scale, y.scale)):
            add("other scale", f"{t} ({_short(x.scale)} vs {_short(y.scale)})")
    for group in _shared(b):
        both = [t for t in group if t in a]
        if len({a[t].scale for t in both}) > 1:
            add("one scale in the recipe's file, several in the re-export", " = ".join(both))
    return [f"{len(items)} {kind}: " + ", ".join(items[:limit])
            + (f" (+{len(items) - limit} more)" if len(items) > limit else "")
            for kind, items in kinds.items()]


def _shared(params: Mapping[str, QParams]) -> list[list[str]]:
    """Groups of activation tensors that read one scale initializer."""
    by_scale: dict[str, list[str]] = {}
    for t, p in params.items():
        if not t.startswith("weight "):
            by_scale.setdefault(p.scale_name, []).append(t)
    return [sorted(g) for g in by_scale.values() if len(g) > 1]


def _short(values: tuple) -> str:
    """A scale or zero point for a line: one value, or the first of many and how many."""
    if len(values) == 1:
        return f"{values[0]:.6g}"
    return f"{values[0]:.6g}… ({len(values)} channels)" if values else "none"
