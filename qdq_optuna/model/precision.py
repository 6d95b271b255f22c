"""The high-precision part of a model: FP32, FP16 or BF16, chosen once before region search.

TensorRT builds strongly typed networks: a float model runs in FP32, and nobody deploys that on
a GPU. The comparison users care about is INT8 against the precision they deploy, so the float
part of the model is converted first and Q/DQ are then placed (and measured) in the converted
graph. Activation statistics still come from the FP32 model and weights are quantized from their
FP32 values (see :class:`HighPrecisionModel`).

The converter is ONNX Runtime's ``onnxruntime.transformers.float16.convert_float_to_float16``.
We also evaluated onnxconverter-common's ``float16.convert_float_to_float16``, which ORT's tool
is derived from. ORT's tool ships inside the onnxruntime wheel we already depend on (no new
dependency), is released with ONNX Runtime, and has fixes the original lacks: ``keep_io_types``
per name, initializers shared by FP32 and FP16 nodes converted only where an FP16 node reads
them, the Resize/GroupNorm inputs that must stay float, and opset-aware Resize handling.
Neither tool converts to BF16 (ORT's ``use_bfloat16_as_blocked_nodes_dtype`` only changes the
type of *blocked* nodes). BF16 is built on the same structure: the FP16 conversion decides which
tensors leave FP32 and where the Casts go; those tensors, Casts and constants are then retyped
to BF16, with values rounded from the FP32 originals (never from FP16).

What this module adds to the tool: the list of ops kept in FP32 (:data:`KEEP_FP32`, as data with
the reason for each), ops whose ONNX schema lacks the type (kept in FP32 or, for BF16, the
opset upgrade that adds it), removal of the Cast pairs the tool leaves between two FP32 ops,
Casts placed where the graph stays sorted, the name map from converted tensors to FP32 ones,
and the checker.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from qdq_optuna.errors import ModelError, OptionError
from qdq_optuna.model.graph import (
    MAXIMUM_OPSET,
    Graph,
    ensure_opset,
    load_model,
    node_label,
    opset_of,
)

log = logging.getLogger("qdq_optuna")

#: the float part in full precision (the input model's own)
FP32 = "fp32"
PRECISIONS = (FP32, "fp16", "bf16")
ELEM_TYPE = {"fp32": TensorProto.FLOAT, "fp16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16}
_TYPE_STR = {"fp16": "tensor(float16)", "bf16": "tensor(bfloat16)"}


@dataclass(frozen=True)
class KeepFP32:
    """Why an op stays in FP32, and at which high precisions that applies."""

    reason: str
    precisions: frozenset[str] = frozenset({"fp16", "bf16"})


_FP16 = frozenset({"fp16"})
#: nodes whose values exceed this (on the range data) stay FP32; the default of NVIDIA's
#: ONNX autocast (its ``data_max``)
MAX_ABS = 512.0

#: Ops kept in FP32 (Casts at their boundaries). Each entry is an op whose own computation
#: overflows FP16's range (largest finite 65504) or needs more exact values than FP16/BF16 hold
#: (FP16 represents integers exactly only up to 2048, BF16 up to 256), while its output is
#: usually back in range. Consecutive kept ops share FP32 tensors (no Cast between them).
KEEP_FP32: Mapping[str, KeepFP32] = {
    "Exp": KeepFP32("exp(x) overflows FP16 once x > 11.1", _FP16),
    "Pow": KeepFP32("squares of activations above 256 overflow FP16 (the variance of a "
                    "decomposed LayerNorm/RMSNorm)", _FP16),
    "ReduceSumSquare": KeepFP32("a sum of squares overflows FP16", _FP16),
    "ReduceL2": KeepFP32("the sum of squares inside overflows FP16", _FP16),
    "ReduceLogSumExp": KeepFP32("the exp inside overflows FP16", _FP16),
    "ReduceProd": KeepFP32("products leave FP16's range in both directions", _FP16),
    "ReduceSum": KeepFP32("long sums overflow FP16 and lose their low bits in BF16"),
    "ReduceL1": KeepFP32("long sums of magnitudes overflow FP16 and lose low bits in BF16"),
    "ReduceMean": KeepFP32("its sum overflows FP16 and loses low bits in BF16 before the "
                           "division (keeps a decomposed LayerNorm's variance in FP32)"),
    "CumSum": KeepFP32("running sums overflow FP16 and stop being exact integers"),
    "Range": KeepFP32("generated indices above 2048 (FP16) or 256 (BF16) are not exact"),
    "InstanceNormalization": KeepFP32("the per-channel variance over a whole image overflows "
                                      "FP16 and loses precision in BF16"),
    "GroupNormalization": KeepFP32("the per-group variance overflows FP16 and loses precision "
                                   "in BF16"),
    "TopK": KeepFP32("scores that FP16/BF16 round together change which elements are picked"),
    "RoiAlign": KeepFP32("box coordinates in pixels lose sub-pixel precision (FP16: 0.5 px "
                         "steps above 1024, BF16: 4 px above 512)"),
    "NonMaxSuppression": KeepFP32("box coordinates and IoU thresholds need FP32 (its ONNX "
                                  "schema takes float only)"),
}

#: converter-inserted Casts are named like this by ORT's tool
_CAST_SUFFIXES = ("_cast_to_fp32_node", "_cast_to_fp16_node", "_cast_to_bfloat16_node")
_CAST_PREFIXES = ("graph_input_cast", "graph_output_cast")


def check_precision(name: str, option: str = "--high-precision") -> str:
    if name not in PRECISIONS:
        raise OptionError(f"{option}: unknown {name!r} (choose from {', '.join(PRECISIONS)})")
    return name


def resolve_high_precision(requested: str | None, backend: str, default: str,
                           refused: Mapping[str, str] | None = None) -> str:
    """``--high-precision`` for a run: the requested one (checked against what ``backend``
    ``refused``: precision -> why) or ``default`` (the backend's, else the runtime's: the
    cost model and a callable backend follow the runtime whose rules they place by)."""
    if requested is not None:
        check_precision(requested)
        why = (refused or {}).get(requested)
        if why:
            raise OptionError(f"--high-precision {requested} cannot run on --backend {backend}: "
                              f"{why}")
        return requested
    return default


@dataclass
class HighPrecisionModel:
    """A model whose float part runs at ``precision``, and the FP32 model it came from.

    ``source`` is the FP32 graph: calibration runs on it (activation statistics in FP32) and
    the exporter quantizes weights from its values. Converted tensors keep their FP32 names,
    except the ones the Casts at FP32/graph-I/O boundaries created: ``source_names`` maps those
    to the FP32 tensor holding the same value.
    """

    precision: str
    model: onnx.ModelProto
    source: Graph
    #: converted tensor -> FP32 tensor with the same value (only names that differ)
    source_names: dict[str, str] = field(default_factory=dict)
    #: node of the converted model -> why it stays FP32
    kept_fp32: dict[str, str] = field(default_factory=dict)
    keep_io_types: bool = True
    #: (model's opset, converted model's opset)
    opsets: tuple[int, int] = (0, 0)

    def source_name(self, tensor: str) -> str:
        return self.source_names.get(tensor, tensor)

    def source_tensors(self, tensors: Iterable[str]) -> list[str]:
        """FP32 names of converted tensors (what calibration collects statistics of)."""
        return list(dict.fromkeys(self.source_name(t) for t in tensors))

    def rekey_scales(self, scales: Mapping) -> dict:
        """Scales keyed by FP32 tensor names (or ``(name, quant type)``), keyed by the converted
        graph's names instead: every converted tensor that holds an FP32 tensor's value."""
        out = dict(scales)
        for new, old in self.source_names.items():
            for key, value in scales.items():
                if key == old:
                    out[new] = value
                elif isinstance(key, tuple) and key[0] == old:
                    out[(new, *key[1:])] = value
        return out

    def fp32_weight(self, name: str) -> np.ndarray | None:
        """The FP32 values of an initializer of the converted model (None if it has none)."""
        source = self.source_name(name)
        if source not in self.source.initializers:
            return None
        if self.source.elem_types.get(source) != TensorProto.FLOAT:
            return None
        return np.asarray(self.source.array(source), dtype=np.float32)

    def describe(self) -> dict:
        return {"precision": self.precision, "keep_io_types": self.keep_io_types,
                "opset": list(self.opsets), "kept_fp32": dict(self.kept_fp32)}


def convert_precision(
    model: onnx.ModelProto | Graph,
    precision: str,
    *,
    keep_io_types: bool = True,
    keep_fp32: Mapping[str, KeepFP32 | str] | None = None,
    upgrade_opset: bool = True,
    range_data: Mapping[str, np.ndarray] | None = None,
    max_abs: float | None = MAX_ABS,
) -> HighPrecisionModel | None:
    """The model with its float part in ``precision`` (None for fp32: nothing to convert).

    ``keep_io_types``: graph inputs and outputs keep their FP32 type (Casts inside the graph).
    ``keep_fp32``: op -> reason (or :class:`KeepFP32`) kept in FP32; :data:`KEEP_FP32` by
    default. ``upgrade_opset``: bring the model to the opset whose schemas accept the type
    (BF16 Conv/pooling need 22) with onnx's version converter; refused when False.
    ``max_abs``: nodes that read or write values above this on ``range_data`` (the FP32 model
    run once by ONNX Runtime; one seeded random sample when None) stay FP32 too: large values
    lose their low bits (FP16 steps are 0.5 above 512, BF16 4) and cancel badly in a following
    subtraction (a BatchNormalization after a ConvTranspose); None turns this off.
    """
    check_precision(precision)
    if precision == "fp32":
        return None
    graph = model if isinstance(model, Graph) else load_model(model)
    if graph.external_dir is not None:
        raise OptionError(f"--high-precision {precision}: the model's weights stay on disk "
                          "(external data over the in-memory limit); convert it beforehand")
    source = _constants_to_initializers(graph.full_model())
    if source is not None:
        graph = Graph.from_model(source, graph.path)
    else:
        source = graph.full_model()
    keep = _keep_list(keep_fp32, precision)
    blocked, need = _schema_blocks(source, precision, keep)
    opset = opset_of(source)
    if need > opset:
        if not upgrade_opset:
            why = ", ".join(sorted(o for o, v in blocked.items() if v == need))
            raise OptionError(f"--high-precision {precision} needs opset >= {need} ({why}); "
                              f"the model has opset {opset} and the opset upgrade is off "
                              "(--no-opset-upgrade)")
        try:
            source = ensure_opset(source, need, f"--high-precision {precision}")
        except ModelError as exc:
            raise OptionError(str(exc)) from None
        source = onnx.shape_inference.infer_shapes(source, strict_mode=False, data_prop=True)
        graph = Graph.from_model(source, graph.path)
    blocked = {**_unsupported(source, precision), **keep}
    by_range = _range_blocks(source, range_data, max_abs) if max_abs else {}
    converted = _convert_fp16(source, keep_io_types, sorted(blocked), sorted(by_range))
    source_names = _source_names(source, converted)  # before Cast pairs go: they link names
    _drop_cast_pairs(converted)
    _place_casts(converted)
    if precision == "bf16":
        _retype_bf16(converted, graph, source_names)
    converted = _checked(converted, precision)
    kept = {node_label(n, i): blocked.get(n.op_type) or by_range[n.name]
            for i, n in enumerate(converted.graph.node)
            if n.op_type in blocked or (n.name in by_range and n.op_type != "Cast")}
    return HighPrecisionModel(precision, converted, graph, source_names, kept, keep_io_types,
                              (opset_of(model.model if isinstance(model, Graph) else model),
                               opset_of(converted)))


# -- which ops stay FP32 -----------------------------------------------------------------------
def _keep_list(keep: Mapping[str, KeepFP32 | str] | None, precision: str) -> dict[str, str]:
    items = KEEP_FP32 if keep is None else keep
    out = {}
    for op, entry in items.items():
        if isinstance(entry, str):
            out[op] = entry
        elif precision in entry.precisions:
            out[op] = entry.reason
    return out


def _schema_allows(op: str, domain: str, version: int, type_str: str) -> bool | None:
    """Whether ``op``'s schema at ``version`` takes ``type_str`` anywhere; None: no schema."""
    try:
        schema = onnx.defs.get_schema(op, max_inclusive_version=version, domain=domain)
    except Exception:  # SchemaError: unknown op, custom domain
        return None
    allowed = {c.type_param_str: set(c.allowed_type_strs) for c in schema.type_constraints}
    slots = [p.type_str for p in (*schema.inputs, *schema.outputs)]
    return any(type_str in allowed.get(s, {s}) for s in slots)


def _float_ops(model: onnx.ModelProto) -> set[tuple[str, str]]:
    """(domain, op) of nodes that read or write a float tensor (or make one: Constant)."""
    types = {vi.name: vi.type.tensor_type.elem_type
             for vi in (*model.graph.input, *model.graph.output, *model.graph.value_info)}
    types.update({t.name: t.data_type for t in model.graph.initializer})
    out = set()
    for node in model.graph.node:
        if any(types.get(x) == TensorProto.FLOAT for x in (*node.input, *node.output) if x):
            out.add((node.domain or "", node.op_type))
    return out


def _schema_blocks(model: onnx.ModelProto, precision: str,
                   keep: Mapping[str, str]) -> tuple[dict[str, int], int]:
    """Ops whose schema gets the type only at a later opset (op -> that opset), and the
    highest of those opsets: what the conversion needs (0 when nothing)."""
    type_str, opset = _TYPE_STR[precision], opset_of(model)
    need: dict[str, int] = {}
    for domain, op in _float_ops(model):
        if domain not in ("", "ai.onnx") or op in keep or op == "Cast":
            continue
        if _schema_allows(op, "", opset, type_str):
            continue
        later = next((v for v in range(opset + 1, MAXIMUM_OPSET + 1)
                      if _schema_allows(op, "", v, type_str)), None)
        if later is not None:
            need[op] = later
    return need, max(need.values(), default=0)


def _unsupported(model: onnx.ModelProto, precision: str) -> dict[str, str]:
    """Ops that cannot take the type at the model's opset (kept FP32): custom-domain ops and
    ops whose ONNX schema has no such type."""
    type_str, out = _TYPE_STR[precision], {}
    versions = {i.domain or "": i.version for i in model.opset_import}
    for domain, op in _float_ops(model):
        if op == "Cast":
            continue
        d = "" if domain == "ai.onnx" else domain
        if d not in ("", "ai.onnx.ml"):
            out[op] = f"custom-domain op {d}.{op}: its {precision} support is unknown"
            continue
        ok = _schema_allows(op, d, versions.get(d, 1), type_str)
        if not ok:
            out[op] = f"its ONNX schema (opset {versions.get(d, 1)}) has no {type_str}"
    return out


# -- conversion --------------------------------------------------------------------------------
def _convert_fp16(model: onnx.ModelProto, keep_io_types: bool, blocked: list[str],
                  blocked_nodes: list[str]) -> onnx.ModelProto:
    from onnxruntime.transformers.float16 import convert_float_to_float16

    copy = onnx.ModelProto()
    copy.CopyFrom(model)  # the tool converts in place
    try:
        converted = convert_float_to_float16(copy, keep_io_types=keep_io_types,
                                             op_block_list=blocked, node_block_list=blocked_nodes,
                                             disable_shape_infer=False)
    except Exception as exc:  # the tool asserts and raises several types
        raise ModelError(f"--high-precision: ONNX Runtime's float16 converter failed: "
                         f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    return converted


def _constants_to_initializers(model: onnx.ModelProto) -> onnx.ModelProto | None:
    """A copy of ``model`` whose float Constant nodes are initializers of the same name (None
    when it has none; ``model`` itself is never changed: it can be the caller's graph). The
    converter keeps an initializer FP32 where only FP32 nodes read it, but converts every
    Constant: a BatchNormalization variance of 1e8 (exporters write weights as Constants) would
    become FP16's 65504 even with the BatchNormalization kept FP32."""
    found = [n for n in model.graph.node if n.op_type == "Constant" and len(n.attribute) == 1
             and n.attribute[0].name == "value"
             and n.attribute[0].t.data_type == TensorProto.FLOAT]
    if not found:
        return None
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    drop = {n.output[0] for n in found}
    kept = [n for n in copy.graph.node if not (n.op_type == "Constant" and n.output[0] in drop)]
    for node in found:
        t = onnx.TensorProto()
        t.CopyFrom(node.attribute[0].t)
        t.name = node.output[0]
        copy.graph.initializer.append(t)
    del copy.graph.node[:]
    copy.graph.node.extend(kept)
    infos = [vi for vi in copy.graph.value_info if vi.name not in drop]
    del copy.graph.value_info[:]
    copy.graph.value_info.extend(infos)
    return copy


def _range_blocks(model: onnx.ModelProto, data: Mapping[str, np.ndarray] | None,
                  max_abs: float) -> dict[str, str]:
    """Named nodes whose float inputs or outputs exceed ``max_abs`` on ``data`` (one FP32 run
    of ONNX Runtime with every float tensor as an output) -> why they stay FP32."""
    import onnxruntime as ort

    from qdq_optuna.model import calibration

    if data is None:
        data = calibration.random_calibration_data(model, samples=1, seed=0)
    types = {vi.name: vi.type.tensor_type.elem_type for vi in model.graph.value_info}
    outputs = {o.name for o in model.graph.output}
    produced = {o for n in model.graph.node for o in n.output}
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    for name, elem in types.items():
        if elem == TensorProto.FLOAT and name in produced and name not in outputs:
            probe.graph.output.append(onnx.helper.make_tensor_value_info(name, elem, None))
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    try:
        session = ort.InferenceSession(probe.SerializeToString(), so,
                                       providers=["CPUExecutionProvider"])
        names = [o.name for o in session.get_outputs()]
        peak: dict[str, float] = dict.fromkeys(names, 0.0)
        for feed in calibration.iter_batches(session, data, 1):
            for name, value in zip(names, session.run(names, feed)):
                if np.issubdtype(np.asarray(value).dtype, np.floating) and np.size(value):
                    peak[name] = max(peak[name], float(np.nanmax(np.abs(value))))
    except Exception as exc:  # ORT raises its own types
        raise ModelError(f"--high-precision: ONNX Runtime cannot run the FP32 model to find "
                         f"its value ranges: {str(exc).splitlines()[0]}") from None
    peak.update({k: float(np.abs(v).max(initial=0.0)) for k, v in data.items()
                 if np.issubdtype(np.asarray(v).dtype, np.floating)})
    for t in model.graph.initializer:  # a weight FP16 cannot hold keeps its reader FP32
        if t.data_type == TensorProto.FLOAT:
            peak[t.name] = float(np.abs(numpy_helper.to_array(t)).max(initial=0.0))
    out = {}
    for node in model.graph.node:
        big = max((peak.get(x, 0.0) for x in (*node.input, *node.output) if x), default=0.0)
        if node.name and big > max_abs and node.op_type not in ("Cast", "Shape", "Constant"):
            out[node.name] = f"reads or writes values up to {big:.4g} (> {max_abs:g})"
    return out


def _inserted(node: onnx.NodeProto) -> bool:
    return node.op_type == "Cast" and (node.name.endswith(_CAST_SUFFIXES)
                                       or node.name.startswith(_CAST_PREFIXES))


def _cast_to(node: onnx.NodeProto) -> int:
    return next(a.i for a in node.attribute if a.name == "to")


def _drop_cast_pairs(model: onnx.ModelProto) -> None:
    """FP32 -> Cast(low) -> Cast(FP32) between two kept ops (or a graph input and a kept op), as
    the tool leaves them: the second Cast reads the FP32 tensor instead (an Identity where it
    names a graph output), and the first goes when nothing else reads it."""
    graph = model.graph
    producer = {o: n for n in graph.node for o in n.output}
    outputs = {o.name for o in graph.output}
    for node in list(graph.node):
        if not _inserted(node) or _cast_to(node) != TensorProto.FLOAT:
            continue
        first = producer.get(node.input[0])
        if first is None or not _inserted(first) or _cast_to(first) == TensorProto.FLOAT:
            continue
        if node.output[0] in outputs:
            node.op_type, node.input[0] = "Identity", first.input[0]
            del node.attribute[:]
            continue
        for other in graph.node:
            other.input[:] = [first.input[0] if x == node.output[0] else x for x in other.input]
        graph.node.remove(node)
    used = {x for n in graph.node for x in n.input} | outputs
    for node in list(graph.node):
        if _inserted(node) and node.output[0] not in used:
            graph.node.remove(node)
    live = {x for n in graph.node for x in (*n.input, *n.output)} | outputs
    kept = [vi for vi in graph.value_info if vi.name in live]
    del graph.value_info[:]
    graph.value_info.extend(kept)


def _place_casts(model: onnx.ModelProto) -> None:
    """The tool appends its Casts at the end; move each right after what it reads (before its
    first reader), keeping every other node where it was: the graph is sorted again and node
    order (and so region ids) follows the FP32 model's."""
    graph = model.graph
    casts = [n for n in graph.node if _inserted(n)]
    ids = {id(n) for n in casts}
    rest = [n for n in graph.node if id(n) not in ids]
    after: dict[str, list[onnx.NodeProto]] = {}
    head: list[onnx.NodeProto] = []
    produced = {o for n in rest for o in n.output}
    pending = list(casts)
    while pending:  # a Cast may read another Cast's output (graph input -> kept op)
        left = []
        for c in pending:
            src = c.input[0]
            if src in produced and any(src in n.output for n in rest):
                after.setdefault(src, []).append(c)
            elif src not in {o for p in pending for o in p.output}:
                head.append(c)
            else:
                left.append(c)
                continue
        if len(left) == len(pending):
            raise ModelError("--high-precision: the converted graph has a cycle of Casts")
        pending = left
    order: list[onnx.NodeProto] = []

    def emit(node: onnx.NodeProto) -> None:
        order.append(node)
        for out in node.output:
            for c in after.pop(out, []):
                emit(c)

    for c in head:
        emit(c)
    for n in rest:
        emit(n)
    del graph.node[:]
    graph.node.extend(order)


def _source_names(source: onnx.ModelProto, converted: onnx.ModelProto) -> dict[str, str]:
    """Each tensor the conversion created -> the FP32 tensor with the same value: the inserted
    Casts join a new tensor and a known one into one class of equal values."""
    known = {x for n in source.graph.node for x in (*n.input, *n.output)}
    known |= {i.name for i in source.graph.input} | {t.name for t in source.graph.initializer}
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent.get(x, x) != x:
            x = parent[x]
        return x

    for node in converted.graph.node:
        if node.op_type in ("Cast", "Identity") and node.input and \
                (node.input[0] not in known or node.output[0] not in known):
            a, b = find(node.input[0]), find(node.output[0])
            if a != b:  # the known name becomes the class's representative
                if a in known:
                    parent[b] = a
                else:
                    parent[a] = b
    return {x: find(x) for x in parent if find(x) in known and x != find(x)}


def _retype_bf16(model: onnx.ModelProto, graph: Graph, source_names: Mapping[str, str]) -> None:
    """The FP16 structure in BF16: every tensor, Cast, initializer and constant that was FP32 in
    the source and FP16 after conversion becomes BF16, with values rounded from FP32."""
    import ml_dtypes

    refused = _bf16_refused(model)

    def was_fp32(name: str) -> bool:
        return (name not in refused
                and graph.elem_types.get(source_names.get(name, name)) == TensorProto.FLOAT)

    def bf16(values: np.ndarray, name: str) -> TensorProto:
        return numpy_helper.from_array(
            np.asarray(values, np.float32).astype(ml_dtypes.bfloat16), name)

    g = model.graph
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
           for n in g.node for a in n.attribute):
        raise OptionError("--high-precision bf16: models with subgraphs (If/Loop/Scan) are not "
                          "supported; use fp16")
    for vi in (*g.input, *g.output, *g.value_info):
        tt = vi.type.tensor_type
        if tt.elem_type == TensorProto.FLOAT16 and was_fp32(vi.name):
            tt.elem_type = TensorProto.BFLOAT16
    for i, t in enumerate(g.initializer):
        if t.data_type == TensorProto.FLOAT16 and was_fp32(t.name):
            g.initializer[i].CopyFrom(bf16(graph.array(source_names.get(t.name, t.name)), t.name))
    source_nodes = {o: n for n in graph.nodes for o in n.output}
    for node in g.node:
        if not node.output or not was_fp32(node.output[0]):
            continue
        for a in node.attribute:
            if a.name in ("to", "dtype") and a.i == TensorProto.FLOAT16:
                a.i = TensorProto.BFLOAT16
            elif a.type == onnx.AttributeProto.TENSOR and a.t.data_type == TensorProto.FLOAT16:
                old = source_nodes.get(node.output[0])
                values = next((numpy_helper.to_array(b.t) for b in (old.attribute if old else [])
                               if b.name == a.name), np.zeros(tuple(a.t.dims), np.float32))
                a.t.CopyFrom(bf16(values, a.t.name))


def _bf16_refused(model: onnx.ModelProto) -> set[str]:
    """Tensors read by an input slot whose schema takes no bfloat16 (Resize's roi, say): they
    stay FP16, which those slots take."""
    opset = opset_of(model)
    out: set[str] = set()
    for node in model.graph.node:
        if node.domain not in ("", "ai.onnx"):
            continue
        try:
            schema = onnx.defs.get_schema(node.op_type, max_inclusive_version=opset)
        except Exception:  # SchemaError: unknown op
            continue
        allowed = {c.type_param_str: set(c.allowed_type_strs) for c in schema.type_constraints}
        for slot, name in enumerate(node.input):
            if not name or not schema.inputs:
                continue
            formal = schema.inputs[min(slot, len(schema.inputs) - 1)]
            types = allowed.get(formal.type_str, {formal.type_str})
            if "tensor(bfloat16)" not in types and "tensor(float16)" in types:
                out.add(name)
    return out


def _checked(model: onnx.ModelProto, precision: str) -> onnx.ModelProto:
    # an initializer's own type is its type: the float16 converter can leave a value_info of
    # the converted type for one it kept FP32 (a weight of a node kept FP32 by range)
    inits = {t.name for t in model.graph.initializer}
    infos = [vi for vi in model.graph.value_info if vi.name not in inits]
    if len(infos) != len(model.graph.value_info):
        del model.graph.value_info[:]
        model.graph.value_info.extend(infos)
    try:
        model = onnx.shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)
        onnx.checker.check_model(model)
    except Exception as exc:
        msg = str(exc).strip().splitlines()
        raise ModelError(f"--high-precision {precision}: the converted model is invalid: "
                         f"{msg[0] if msg else type(exc).__name__}") from None
    return model


def float_types(model: onnx.ModelProto) -> dict[str, int]:
    """Every float tensor of ``model`` (inferred types) -> its element type."""
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    g = inferred.graph
    out = {vi.name: vi.type.tensor_type.elem_type for vi in (*g.input, *g.output, *g.value_info)}
    out.update({t.name: t.data_type for t in g.initializer})
    for node in g.node:
        for a in node.attribute:
            if node.op_type == "Constant" and a.type == onnx.AttributeProto.TENSOR:
                out[node.output[0]] = a.t.data_type
    floats = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE)
    return {k: v for k, v in out.items() if v in floats}


def bf16_computed_in_fp32(model: bytes | onnx.ModelProto) -> bytes:
    """``model`` with every BF16 tensor, constant, Cast and type retyped to FP32 (values kept:
    BF16 values are exact in FP32). ONNX Runtime's CPU provider has no BF16 kernels for Conv,
    MatMul and most ops, so a BF16 model's output errors are measured on this stand-in: the
    same weights and Q/DQ, with FP32 arithmetic between them."""
    m = model if isinstance(model, onnx.ModelProto) else onnx.load_from_string(model)
    bf16, fp32 = TensorProto.BFLOAT16, TensorProto.FLOAT

    def retype(t: TensorProto) -> None:
        if t.data_type == bf16:
            t.CopyFrom(numpy_helper.from_array(
                numpy_helper.to_array(t).astype(np.float32), t.name))

    def visit(graph: onnx.GraphProto) -> None:
        for t in graph.initializer:
            retype(t)
        for vi in (*graph.input, *graph.output, *graph.value_info):
            if vi.type.tensor_type.elem_type == bf16:
                vi.type.tensor_type.elem_type = fp32
        for node in graph.node:
            for a in node.attribute:
                if a.type == onnx.AttributeProto.TENSOR:
                    retype(a.t)
                elif a.type == onnx.AttributeProto.GRAPH:
                    visit(a.g)
                elif a.type == onnx.AttributeProto.INT and a.i == bf16 and a.name in (
                        "to", "dtype", "output_dtype"):
                    a.i = fp32

    visit(m.graph)
    return m.SerializeToString()


__all__ = [
    "KEEP_FP32",
    "PRECISIONS",
    "HighPrecisionModel",
    "KeepFP32",
    "bf16_computed_in_fp32",
    "check_precision",
    "convert_precision",
    "float_types",
    "resolve_high_precision",
]
