"""Whole-model starting placements: float, every point on, the runtime's recipe, the user's seeds.

A pattern-by-pattern search that starts from float cannot see a gain that exists only when
neighbouring patterns are int8 too (the Q/DQ at their boundary costs a reformat otherwise).
Whole-model candidates give the search a standing model to start from that is already at least
what a user gets from the runtime's own one-line recipe.

Each :class:`Start` holds the placement twice: ``uses``, the exact set of quantized tensor
uses (what :meth:`QDQExporter.plan` takes), and ``schemes``, its projection onto the patterns'
insertion points (pattern id -> {point id: 0/1}: the studies' parameters). A point is on when
every use it covers, in every member region, is in the placement; ``scheme_uses`` is what the
projection quantizes, and ``notes`` say what was lost on the way (uses that could not be mapped
onto the prepared graph, uses the runtime's rules never offer, uses no point can express).

The recipes are run, not re-implemented: ONNX Runtime's is ``quant_pre_process`` +
``quantize_static`` on a temporary copy of the user's model, and NVIDIA Model Optimizer's
default INT8 quantizer runs where it is installed (:func:`run_modelopt`); its placement is then
read back from the Q/DQ model it wrote (:func:`read_placement`). Without Model Optimizer,
:data:`TENSORRT_PTQ_RULES` approximate its default placement as data.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from qdq_optuna.errors import ToolError, UserError
from qdq_optuna.model.graph import Graph, InputShapes, Use, ensure_opset, load_model
from qdq_optuna.placement.seeds import PatternCache

log = logging.getLogger("qdq_optuna")

#: ops a Q/DQ model may put between a tensor and its reader without changing what is read
#: (Model Optimizer's FP16 conversion adds Casts at the graph's inputs and outputs)
_TRANSPARENT = frozenset({"Cast", "Identity"})
_QDQ = frozenset({"QuantizeLinear", "DequantizeLinear"})

Schemes = dict[str, dict[str, int]]


@dataclass(frozen=True)
class Start:
    """One whole-model candidate: the exact placement and its projection onto the points."""

    name: str
    uses: frozenset[Use]
    schemes: Schemes
    scheme_uses: frozenset[Use]
    notes: tuple[str, ...] = ()
    #: how many uses the source placement had, and how many of them map onto the prepared graph
    counts: Mapping[str, int] = field(default_factory=dict)

    @property
    def exact(self) -> bool:
        """The projection quantizes exactly the placement's uses."""
        return self.uses == self.scheme_uses

    @property
    def pinned(self) -> frozenset[Use]:
        """The placement's uses its schemes cannot express (member regions of a pattern
        differ): the start is measured with them, and the lane that descends from it keeps
        them while it tunes the patterns around them (a repaired PP-OCRv4 detector ran 1.31x
        FP32 as placed, 1.03x as projected onto the schemes, past the bound)."""
        return self.uses - self.scheme_uses

    def on(self) -> dict[str, list[str]]:
        """Pattern id -> the points that are on."""
        return {p: sorted(k for k, v in s.items() if v) for p, s in self.schemes.items()}

    def to_dict(self, graph: Graph | None = None) -> dict:
        """JSON-safe summary (uses by node name when ``graph`` is given)."""
        def named(uses: Iterable[Use]) -> list:
            return sorted([t, graph.name_of(n) if graph else n, s] for t, n, s in uses)
        return {"name": self.name, "uses": named(self.uses), "points_on": self.on(),
                "exact": self.exact, "notes": list(self.notes), "counts": dict(self.counts),
                "missing_from_schemes": named(self.uses - self.scheme_uses)}


# -- schemes <-> uses -------------------------------------------------------------------------
def scheme_uses(pm, schemes: Mapping[str, Mapping[str, int]]) -> set[Use]:
    """The uses that per-pattern on/off schemes quantize together."""
    out: set[Use] = set()
    for pp in pm.tunable:
        scheme = schemes.get(pp.pattern.id, {})
        out |= pp.uses([pid for pid in pp.ids if scheme.get(pid)])
    return out


def project(pm, uses: Iterable[Use]) -> Schemes:
    """Per pattern, the points whose every covered use (in every member region) is in
    ``uses``: the largest scheme that quantizes nothing outside the placement."""
    target = set(uses)
    schemes: Schemes = {}
    for pp in pm.tunable:
        schemes[pp.pattern.id] = {pid: int(pp.uses([pid]) <= target) for pid in pp.ids}
    return schemes


def start_from_uses(pm, name: str, uses: Iterable[Use], notes: Iterable[str] = (),
                    counts: Mapping[str, int] | None = None) -> Start:
    """A :class:`Start` for a placement given as uses of the prepared graph; uses the runtime's
    rules never offer are dropped (with a note)."""
    g, rules = pm.graph, pm.rules
    kept, dropped = set(), {}
    for use in set(uses):
        reason = rules.use_reason(g, use)
        if reason is None:
            kept.add(use)
        else:
            dropped.setdefault(reason, []).append(use)
    notes = list(notes)
    for reason, lost in sorted(dropped.items()):
        notes.append(f"{len(lost)} use(s) not offered by the {rules.name} rules ({reason}): "
                     + _describe(g, lost))
    schemes = project(pm, kept)
    covered = scheme_uses(pm, schemes)
    missing = kept - covered
    if missing:
        notes.append(f"{len(missing)} use(s) no scheme can express without quantizing more "
                     "(member regions of a pattern differ), kept as they are: "
                     + _describe(g, missing))
    counts = {**(counts or {}), "not_offered": sum(map(len, dropped.values())),
              "not_expressible": len(missing)}
    return Start(name, frozenset(kept), schemes, frozenset(covered), tuple(notes), counts)


def start_from_schemes(pm, name: str, schemes: Mapping[str, Mapping[str, int]],
                       notes: Iterable[str] = ()) -> Start:
    clean = {pp.pattern.id: {pid: int(bool(schemes.get(pp.pattern.id, {}).get(pid, 0)))
                             for pid in pp.ids} for pp in pm.tunable}
    uses = frozenset(scheme_uses(pm, clean))
    return Start(name, uses, clean, uses, tuple(notes))


def _describe(g: Graph, uses: Iterable[Use], limit: int = 6) -> str:
    items = sorted(f"{t} -> {g.name_of(n)}[{s}]" for t, n, s in uses)
    more = f" (+{len(items) - limit} more)" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


# -- the simple starts ------------------------------------------------------------------------
def float_start(pm) -> Start:
    return start_from_schemes(pm, "float", {})


def all_on_start(pm) -> Start:
    return start_from_schemes(pm, "all", {pp.pattern.id: dict.fromkeys(pp.ids, 1)
                                          for pp in pm.tunable})


def cache_start(pm, cache: PatternCache) -> Start | None:
    """Every pattern at its best cached scheme (patterns the cache does not know stay float)."""
    schemes, hits = {}, 0
    for pp in pm.tunable:
        seeds = cache.seeds_for(pp)  # best first (the cache keeps them sorted by latency)
        if seeds:
            schemes[pp.pattern.id] = seeds[0]
            hits += 1
    if not hits:
        return None
    return start_from_schemes(pm, "pattern-cache", schemes,
                              [f"{hits} of {len(pm.tunable)} patterns from the cache"])


def baseline_start(pm, qdq_model: str | os.PathLike | onnx.ModelProto) -> Start:
    """The placement of an existing Q/DQ model (``--qdq-baseline``), read use by use."""
    uses, notes, counts = read_placement(pm, qdq_model)
    return start_from_uses(pm, "qdq-baseline", uses, notes, counts)


# -- reading a Q/DQ model's placement ---------------------------------------------------------
@dataclass
class _QDQIndex:
    nodes: list[onnx.NodeProto]
    producer: dict[str, onnx.NodeProto]
    consumers: dict[str, list[tuple[onnx.NodeProto, int]]]
    constants: set[str]

    @classmethod
    def of(cls, model: onnx.ModelProto) -> _QDQIndex:
        g = model.graph
        producer = {o: n for n in g.node for o in n.output if o}
        consumers: dict[str, list] = {}
        for n in g.node:
            for slot, t in enumerate(n.input):
                if t:
                    consumers.setdefault(t, []).append((n, slot))
        constants = {t.name for t in g.initializer}
        for n in g.node:  # Constant nodes and anything computed from constants only
            if n.op_type == "Constant" or (n.input and all(i in constants for i in n.input if i)):
                constants.update(o for o in n.output if o)
        return cls(list(g.node), producer, consumers, constants)

    def source(self, tensor: str) -> str:
        """The tensor behind Casts/Identities (what the float model called it)."""
        seen = set()
        while tensor not in seen:
            seen.add(tensor)
            p = self.producer.get(tensor)
            if p is None or p.op_type not in _TRANSPARENT:
                return tensor
            tensor = p.input[0]
        return tensor

    def readers(self, tensor: str) -> list[tuple[onnx.NodeProto, int]]:
        """Consumers of ``tensor`` after Casts/Identities, Q/DQ nodes left out."""
        out, todo, seen = [], [tensor], set()
        while todo:
            t = todo.pop()
            if t in seen:
                continue
            seen.add(t)
            for node, slot in self.consumers.get(t, []):
                if node.op_type in _TRANSPARENT:
                    todo.extend(o for o in node.output if o)
                elif node.op_type not in _QDQ:
                    out.append((node, slot))
        return out


def quantized_reads(model: onnx.ModelProto) -> list[tuple[str, onnx.NodeProto, int]]:
    """(float tensor, reader node, input slot) for every activation read through a
    QuantizeLinear -> DequantizeLinear pair; weights (Q/DQ on constants) are left out."""
    ix = _QDQIndex.of(model)
    out = []
    for dq in ix.nodes:
        if dq.op_type != "DequantizeLinear" or dq.input[0] in ix.constants:
            continue
        q = ix.producer.get(ix.source(dq.input[0]))
        if q is None or q.op_type != "QuantizeLinear" or q.input[0] in ix.constants:
            continue
        tensor = ix.source(q.input[0])
        for node, slot in ix.readers(dq.output[0]):
            out.append((tensor, node, slot))
    return out


def quantized_outputs(model: onnx.ModelProto) -> list[str]:
    """Graph outputs a Q/DQ model computes through a DequantizeLinear."""
    ix = _QDQIndex.of(model)
    outs = []
    for o in model.graph.output:
        node = ix.producer.get(o.name)
        while node is not None and node.op_type in _TRANSPARENT:
            node = ix.producer.get(node.input[0])
        if node is not None and node.op_type == "DequantizeLinear" and \
                node.input[0] not in ix.constants:
            outs.append(o.name)
    return outs


def read_placement(pm, qdq_model: str | os.PathLike | onnx.ModelProto
                   ) -> tuple[set[Use], list[str], dict[str, int]]:
    """The uses of ``pm``'s graph that ``qdq_model`` reads through Q/DQ.

    Tensors and nodes are matched by name first (ONNX Runtime's preprocessing and its
    quantizer keep most names); a renamed node is matched by the tensor it writes, else by the
    tensor it reads and its op type. Returns (uses, notes on what could not be mapped,
    counts)."""
    model = qdq_model if isinstance(qdq_model, onnx.ModelProto) else _load_qdq(qdq_model)
    g = pm.graph
    by_name = {n.name: i for i, n in enumerate(g.nodes) if n.name}
    tensors = set(g.producer) | set(g.graph_inputs)
    reads = quantized_reads(model)
    uses: set[Use] = set()
    unmapped: list[str] = []
    for tensor, node, slot in reads:
        use = _map_read(g, by_name, tensors, tensor, node, slot)
        if use is None:
            unmapped.append(f"{tensor} -> {node.op_type} {node.name or '?'}[{slot}]")
        else:
            uses.add(use)
    notes = []
    if unmapped:
        notes.append(f"{len(unmapped)} quantized read(s) have no counterpart in the prepared "
                     f"graph: {', '.join(sorted(unmapped)[:6])}"
                     + (f" (+{len(unmapped) - 6} more)" if len(unmapped) > 6 else ""))
    outputs = quantized_outputs(model)
    lost = [o for o in outputs if o not in g.graph_outputs]
    uses.update(u for o in outputs for u in g.output_uses(o))
    if lost:
        notes.append(f"{len(lost)} quantized graph output(s) are no graph output of the "
                     f"prepared graph (left float): {', '.join(lost[:6])}")
    counts = {"reads": len(reads), "mapped": len(reads) - len(unmapped),
              "unmapped": len(unmapped), "quantized_outputs": len(outputs)}
    return uses, notes, counts


def _load_qdq(path: str | os.PathLike) -> onnx.ModelProto:
    try:
        return onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # noqa: BLE001 - any parse failure is the user's file
        raise UserError(f"{path}: not a readable ONNX model ({exc})") from None


def _map_read(g: Graph, by_name: dict[str, int], tensors: set[str], tensor: str,
              node: onnx.NodeProto, slot: int) -> Use | None:
    """One quantized read of a Q/DQ model as a use of ``g``: by names, else by structure."""
    idx = by_name.get(node.name) if node.name else None
    if idx is None or g.nodes[idx].op_type != node.op_type:  # renamed: the one writing its output
        idx = next((g.producer[o][0] for o in node.output if o in g.producer), None)
    if idx is not None and g.nodes[idx].op_type == node.op_type:
        ours = g.nodes[idx].input
        if tensor in tensors:  # same node, same tensor: the slot where it reads it
            if slot < len(ours) and ours[slot] == tensor:
                return (tensor, idx, slot)
            slots = [s for s, t in enumerate(ours) if t == tensor]
            if len(slots) == 1:
                return (tensor, idx, slots[0])
        elif slot < len(ours) and ours[slot]:  # the tensor was renamed: same node, same slot
            return (ours[slot], idx, slot)
    if tensor in tensors:  # the node was renamed: the one reader of this op type
        readers = [(n, s) for n, s in g.consumers.get(tensor, [])
                   if g.nodes[n].op_type == node.op_type and s == slot]
        if len(readers) == 1:
            return (tensor, *readers[0])
    return None


# -- ONNX Runtime's recipe --------------------------------------------------------------------
def ort_recipe_model(model: str | os.PathLike | onnx.ModelProto, work: Path, *,
                     data: Mapping[str, np.ndarray] | None = None,
                     input_shapes: InputShapes | str | None = None, samples: int = 4
                     ) -> Path:
    """What a user gets from ONNX Runtime's documented one-liner: ``quant_pre_process`` then
    ``quantize_static`` (QDQ, per-channel, uint8 activations, int8 weights), on a copy of
    ``model`` written to ``work``; calibrated on ``data`` (graph input -> samples on axis 0),
    or on ``samples`` random feeds. Returns the path of the quantized model."""
    from onnxruntime.quantization import (
        CalibrationDataReader,
        quantize_static,
    )
    from onnxruntime.quantization.shape_inference import quant_pre_process

    from qdq_optuna.model import calibration

    shapes = input_shapes if isinstance(input_shapes, InputShapes) else InputShapes.parse(input_shapes)
    # checked, static shapes, weights in memory; the inputs the data feeds stay inputs
    proto = load_model(model, shapes, fed=data or ()).full_model()
    # per-channel DequantizeLinear (its axis) needs opset 13: below it, the tool writes a model
    # ONNX Runtime refuses, and its user upgrades the opset first
    proto = ensure_opset(proto, 13, "ONNX Runtime's per-channel recipe")
    src, pre, out = work / "float.onnx", work / "preprocessed.onnx", work / "ort_recipe.onnx"
    big = proto.ByteSize() > (1 << 30)
    onnx.save(proto, str(src), save_as_external_data=big)
    if data is None:
        data = calibration.random_calibration_data(proto, shapes.shapes or None,
                                                   samples=samples, seed=0)
    feeds = [{k: v[i:i + 1] for k, v in data.items()} for i in range(len(next(iter(data.values()))))]

    class _Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.it = iter(feeds)

        def get_next(self):
            return next(self.it, None)

    with quiet_tool("ONNX Runtime's recipe (quant_pre_process + quantize_static)"):
        quant_pre_process(str(src), str(pre), skip_symbolic_shape=True,
                          save_as_external_data=big)
        # the ranges outside ``work``: a file beside the model there reads as its weights
        with tempfile.TemporaryDirectory(prefix="qdq-optuna-ranges-") as ranges:
            cache = ort_minmax_cache(pre, feeds, Path(ranges) / "ort_ranges.json")
            quantize_static(str(pre), str(out), None if cache else _Reader(),
                            calibration_cache_path=cache, use_external_data_format=big,
                            **ort_recipe_options())
    return out


def ort_minmax_cache(model_path: Path, feeds: list[dict], path: Path) -> Path | None:
    """``quantize_static``'s MinMax ranges for ``model_path`` on ``feeds``, written as its
    own calibration cache (``calibration_cache_path``), so it skips its calibrator; None when
    this ONNX Runtime has no such cache (it calibrates itself).

    Why: its calibrator inserts a ReduceMin/ReduceMax pair per tensor, each time searching
    the node list and rebuilding the value-info map, which is quadratic in the graph's size:
    a 4,755-node decoder spent 424 of its first 475 s there (under a profiler). The tensors
    are ONNX Runtime's own choice (``select_tensors_to_calibrate``); each range is
    the minimum and maximum over the feeds of the tensor as its calibration session computes
    it (no graph optimization), so the ranges, and the recipe's file, are the same."""
    import inspect

    import onnxruntime as ort
    from onnxruntime.quantization import quantize_static
    from onnxruntime.quantization.calibrate import (
        CalibrationMethod,
        MinMaxCalibrater,
        TensorsData,
        save_tensors_data,
    )
    from onnxruntime.quantization.registry import QDQRegistry, QLinearOpsRegistry

    if "calibration_cache_path" not in inspect.signature(quantize_static).parameters:
        return None
    ops = list(set(QLinearOpsRegistry) | set(QDQRegistry))  # quantize_static's default
    calibrator = MinMaxCalibrater(str(model_path), ops,
                                  augmented_model_path=str(path.with_suffix(".onnx")))
    model = calibrator.model
    tensors, value_infos = calibrator.select_tensors_to_calibrate(model)
    inputs = {i.name for i in model.graph.input}
    outputs = {o.name for o in model.graph.output}
    names = sorted(tensors)
    for name in names:
        if name not in inputs and name not in outputs:
            model.graph.output.append(value_infos[name])
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    fetch = [n for n in names if n not in inputs]
    lows: dict[str, list] = {n: [] for n in names}
    highs: dict[str, list] = {n: [] for n in names}
    for feed in feeds:
        values = dict(zip(fetch, session.run(fetch, feed)))
        values.update({n: feed[n] for n in names if n in inputs})
        for name in names:
            v = np.asarray(values[name])
            lows[name].append(v.min() if v.size else np.array(np.inf, v.dtype))
            highs[name].append(v.max() if v.size else np.array(-np.inf, v.dtype))
    ranges = {n: (np.nanmin(lows[n], axis=0, keepdims=True).astype(np.asarray(lows[n][0]).dtype),
                  np.nanmax(highs[n], axis=0, keepdims=True).astype(np.asarray(highs[n][0]).dtype))
              for n in names}
    save_tensors_data(TensorsData(CalibrationMethod.MinMax, ranges), path)
    return path


def ort_recipe_options() -> dict:
    """``quantize_static``'s settings in ONNX Runtime's documented recipe (QDQ, per-channel,
    uint8 activations, int8 weights; 7-bit weights where the CPU's u8 x s8 kernels saturate,
    as its documentation advises): one place for the recipe start and the benchmarks."""
    from onnxruntime.quantization import QuantFormat, QuantType

    from qdq_optuna.model import calibration

    return {"quant_format": QuantFormat.QDQ, "per_channel": True,
            "activation_type": QuantType.QUInt8, "weight_type": QuantType.QInt8,
            "reduce_range": calibration.cpu_saturates_u8s8()}


#: the loggers quiet_tool silences: the root (ONNX Runtime's quantizer logs there) and the
#: tools' own
_TOOL_LOGGERS = ("", "nncf", "openvino", "onnxruntime")


@contextlib.contextmanager
def quiet_tool(what: str) -> Iterator[None]:
    """A third-party quantizer run without its per-tensor notes, hints and progress bars; its
    failure is one :class:`ToolError` line naming it. Their own loggers (NNCF's has its own
    handler and level) are raised to ERROR too, and what they print (NNCF's rich progress
    bars go to sys.stdout/sys.stderr) is dropped."""
    loggers = [logging.getLogger(name) for name in _TOOL_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
                contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    except Exception as exc:  # noqa: BLE001 - the tool's own failures, one line for the caller
        first = str(exc).strip().splitlines()[:1] or [type(exc).__name__]
        raise ToolError(f"{what} failed on this model: {type(exc).__name__}: {first[0]}"
                        ) from None
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def ort_recipe_start(pm, model: str | os.PathLike | onnx.ModelProto, *,
                     data: Mapping[str, np.ndarray] | None = None,
                     input_shapes: InputShapes | str | None = None,
                     keep: Path | None = None) -> Start:
    """ONNX Runtime's recipe (:func:`ort_recipe_model`) on the user's ``model``, read back onto
    ``pm``'s graph; with ``keep``, the recipe's own file is also written there as the tool
    wrote it (:func:`keep_recipe_file`)."""
    with tempfile.TemporaryDirectory(prefix="qdq-optuna-recipe-") as tmp:
        path = ort_recipe_model(model, Path(tmp), data=data, input_shapes=input_shapes)
        uses, notes, counts = read_placement(pm, path)
        if keep is not None:
            keep_recipe_file(path, keep)
    return start_from_uses(pm, "recipe:onnxruntime", uses, notes, counts)


# -- NNCF, OpenVINO's recipe ------------------------------------------------------------------
def nncf_recipe_model(model: str | os.PathLike | onnx.ModelProto, *,
                      data: Mapping[str, np.ndarray] | None = None,
                      input_shapes: InputShapes | str | None = None, samples: int = 4
                      ) -> onnx.ModelProto:
    """What an OpenVINO user gets from NNCF's documented one-liner, ``nncf.quantize`` with its
    defaults (``nncf.Dataset`` of feed dicts), on ``model``; calibrated on ``data`` (graph
    input -> samples on axis 0) or on ``samples`` random feeds. Raises :class:`ToolError` when
    nncf is missing or refuses the model."""
    try:
        import nncf
    except ImportError:
        raise ToolError("NNCF (OpenVINO's recipe) is not installed (pip install nncf)") from None
    from qdq_optuna.model import calibration

    shapes = input_shapes if isinstance(input_shapes, InputShapes) else InputShapes.parse(input_shapes)
    proto = load_model(model, shapes, fed=data or ()).full_model()
    proto = ensure_opset(proto, 13, "NNCF's per-channel recipe")
    if data is None:
        data = calibration.random_calibration_data(proto, shapes.shapes or None,
                                                   samples=samples, seed=0)
    count = len(next(iter(data.values())))
    feeds = [{k: v[i:i + 1] for k, v in data.items()} for i in range(count)]
    with quiet_tool("NNCF's recipe (nncf.quantize)"):
        nncf.set_log_level(logging.ERROR)
        return nncf.quantize(proto, nncf.Dataset(feeds), subset_size=count)


def nncf_activation_type(qdq_model: onnx.ModelProto) -> str:
    """The activation type most of a Q/DQ model's QuantizeLinear write ("uint8" or "int8"):
    NNCF's default preset writes int8 (symmetric) wherever a tensor can be negative."""
    zps = {t.name: t.data_type for t in qdq_model.graph.initializer}
    types = [zps.get(n.input[2]) for n in qdq_model.graph.node
             if n.op_type == "QuantizeLinear" and len(n.input) > 2]
    signed, unsigned = types.count(onnx.TensorProto.INT8), types.count(onnx.TensorProto.UINT8)
    return "int8" if signed > unsigned else "uint8"


def activation_types(qdq_model: onnx.ModelProto) -> dict[str, str]:
    """Activation tensor -> the type ("uint8"/"int8") its QuantizeLinear writes, so a
    re-export keeps each tensor's type (NNCF mixes them: u8 where non-negative)."""
    from qdq_optuna.model import calibration

    ix = _QDQIndex.of(qdq_model)
    zps = {t.name: t.data_type for t in qdq_model.graph.initializer}
    names = {calibration.QUANT_ONNX_TYPES[n]: n for n in ("int8", "uint8")}
    return {ix.source(q.input[0]): names[zps[q.input[2]]] for q in qdq_model.graph.node
            if q.op_type == "QuantizeLinear" and len(q.input) > 2
            and zps.get(q.input[2]) in names and q.input[0] not in ix.constants}


def nncf_recipe_start(pm, model: str | os.PathLike | onnx.ModelProto, *,
                      data: Mapping[str, np.ndarray] | None = None,
                      input_shapes: InputShapes | str | None = None,
                      keep: Path | None = None) -> Start:
    """NNCF's placement (:func:`nncf_recipe_model`) read back onto ``pm``'s graph; with
    ``keep``, NNCF's own file is also written there (:func:`keep_recipe_file`)."""
    written = nncf_recipe_model(model, data=data, input_shapes=input_shapes)
    uses, notes, counts = read_placement(pm, written)
    if keep is not None:
        keep_recipe_file(written, keep)
    return start_from_uses(pm, "recipe:openvino", uses, notes, counts)


# -- the recipe's own file --------------------------------------------------------------------
#: the largest recipe file kept whole (protobuf's limit: bigger models keep weights outside)
_ONE_FILE = (1 << 31) - (1 << 20)


def keep_recipe_file(written: os.PathLike | onnx.ModelProto, path: Path) -> bool:
    """The recipe's own model (its Q/DQ, scales, zero points and types exactly as the tool
    wrote them) saved atomically at ``path``, so that a run can measure and ship it as written
    and a resumed run finds it; False (nothing written) when it does not fit one file."""
    from qdq_optuna._files import atomic_write_bytes

    if isinstance(written, onnx.ModelProto):
        if written.ByteSize() > _ONE_FILE:
            return False
        data = written.SerializeToString()
    else:
        folder = Path(written).parent  # weights written beside it: too big for one file
        if any(f != Path(written) for f in folder.iterdir() if f.suffix not in (".onnx",)):
            return False
        data = Path(written).read_bytes()
    atomic_write_bytes(path, data)
    return True


def recipe_file_bytes(make: Callable[[Path], os.PathLike | onnx.ModelProto]) -> bytes | None:
    """A recipe model made again by ``make(work_folder)`` (:func:`ort_recipe_model`,
    :func:`nncf_recipe_model`: the same model, data and settings give the same file, both
    tools calibrate deterministically), as bytes; None for a model too big for one file."""
    with tempfile.TemporaryDirectory(prefix="qdq-optuna-recipe-") as tmp:
        path = Path(tmp) / "recipe.onnx"
        return path.read_bytes() if keep_recipe_file(make(Path(tmp)), path) else None


# -- TensorRT's standard INT8 PTQ placement ---------------------------------------------------
@dataclass(frozen=True)
class PtqRules:
    """A PTQ tool's default INT8 placement as data: which nodes get Q/DQ on their inputs.

    :data:`TENSORRT_PTQ_RULES` approximate NVIDIA Model Optimizer's ``quantize`` (ONNX, int8,
    default settings): Q/DQ on the activation inputs of Conv/Gemm/MatMul (not on tensor-core
    unfriendly shapes), on the residual input of a Conv block's residual Add (never its
    backbone input), on pooling and Resize inputs next to quantized compute, never on op
    outputs; one Q/DQ pair per tensor, which every reader shares. Concat gets no Q/DQ of its
    own; the TensorRT rules' Concat promotion then covers the Concats of quantized tensors.
    """

    compute_ops: frozenset[str] = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul"})
    #: compute ops whose output chain can be fused into one kernel (the "backbone")
    backbone_ops: frozenset[str] = frozenset({"Conv", "ConvTranspose"})
    #: single-input ops that join the kernel of the compute op before them
    epilogue_ops: frozenset[str] = frozenset({"BatchNormalization", "Relu", "Sigmoid"})
    pooling_ops: frozenset[str] = frozenset({"MaxPool", "AveragePool", "GlobalAveragePool",
                                             "GlobalMaxPool"})
    #: ops whose input is quantized when it comes from a compute kernel
    follower_ops: frozenset[str] = frozenset({"Resize", "Upsample"})
    #: elementwise ops whose inputs are quantized when one comes from a compute kernel
    elementwise_ops: frozenset[str] = frozenset({"Add", "Mul"})

    #: ops a consumer search looks through
    copy_ops: frozenset[str] = frozenset({"Flatten", "Transpose", "Concat", "Split", "Squeeze",
                                          "Unsqueeze", "Expand", "Reshape", "Tile", "Gather",
                                          "Slice"})
    #: Conv channels below which a Conv stays float, unless a multiple of 8 (int8 kernels)
    min_channels: int = 16
    #: MatMul/Gemm N or K below which it stays float (GEMV-like shapes too)
    min_matmul_dim: int = 16


TENSORRT_PTQ_RULES = PtqRules()
_SCALE_BIAS = frozenset({"Add", "Sub", "Mul", "Div"})
_POINTWISE = frozenset({"Add", "Sub", "Mul", "Div", "Relu", "Clip", "LeakyRelu", "Sigmoid",
                        "HardSigmoid", "HardSwish", "Tanh", "Erf", "Gelu", "Elu", "Selu", "Exp",
                        "Log", "Sqrt", "Pow", "Neg", "Abs", "Softplus", "Mish", "PRelu",
                        "BatchNormalization"})
#: layers whose output Model Optimizer quantizes for an elementwise consumer
_OUTPUT_QUANTIZED = frozenset({"AveragePool", "BatchNormalization", "GlobalAveragePool",
                               "MaxPool", "Mul"})


def tensorrt_recipe_uses(pm, rules: PtqRules = TENSORRT_PTQ_RULES) -> set[Use]:
    """The uses :class:`PtqRules` quantize on ``pm``'s graph (before the runtime's rules)."""
    return _PtqPlacer(pm.graph, rules).uses()


def tensorrt_recipe_start(pm, qdq_model: str | os.PathLike | onnx.ModelProto | None = None,
                          rules: PtqRules = TENSORRT_PTQ_RULES) -> Start:
    """TensorRT's standard INT8 PTQ placement: read from ``qdq_model`` when Model Optimizer
    made one (:func:`run_modelopt`), else :data:`TENSORRT_PTQ_RULES` on ``pm``'s graph."""
    if qdq_model is not None:
        uses, notes, counts = read_placement(pm, qdq_model)
        return start_from_uses(pm, "recipe:tensorrt", uses,
                               ["read from NVIDIA Model Optimizer's output", *notes], counts)
    uses = tensorrt_recipe_uses(pm, rules)
    return start_from_uses(pm, "recipe:tensorrt", uses,
                           ["NVIDIA Model Optimizer's default INT8 placement, approximated "
                            "by rules (Model Optimizer not run)"])


class _PtqPlacer:
    def __init__(self, g: Graph, rules: PtqRules) -> None:
        self.g, self.r = g, rules

    def op(self, tensor: str) -> str | None:
        return self.g.producer_op(tensor)

    def node_of(self, tensor: str):
        p = self.g.producer.get(tensor)
        return None if p is None else self.g.nodes[p[0]]

    def data_inputs(self, idx: int) -> list[int]:
        node = self.g.nodes[idx]
        return [s for s, t in enumerate(node.input) if t and self.g.is_activation(t)]

    def _silu(self, node) -> str | None:
        """x for Mul(x, Sigmoid(x)), else None."""
        if node.op_type != "Mul" or len(node.input) != 2:
            return None
        for a, b in (node.input, node.input[::-1]):
            s = self.node_of(b)
            if s is not None and s.op_type == "Sigmoid" and s.input[0] == a:
                return a
        return None

    def kernel_source(self, tensor: str, partition: bool = False,
                      excluded: bool = False) -> int | None:
        """The compute node whose kernel writes ``tensor`` through its epilogue (BN,
        activations, constant scale/bias, SiLU, Relu -> MaxPool), if any; ``partition`` also
        follows any pointwise chain and a residual Add's backbone input (what Model
        Optimizer's fusible partitions hold); ``excluded`` also counts compute ops that stay
        float."""
        for _ in range(64):
            node = self.node_of(tensor)
            if node is None:
                return None
            idx = self.g.producer[tensor][0]
            op = node.op_type
            if op in self.r.compute_ops:
                return idx if excluded or not self.excluded(idx) else None
            acts = [t for t in node.input if t and self.g.is_activation(t)]
            if len(acts) == 1 and (op in self.r.epilogue_ops or op in _SCALE_BIAS
                                   or (partition and op in _POINTWISE)
                                   or (op == "MaxPool" and self.op(acts[0]) == "Relu")):
                tensor = acts[0]
            elif len(acts) == 2 and op in _POINTWISE and \
                    (src := self.kernel_source(acts[0], partition, excluded)) is not None and \
                    src == self.kernel_source(acts[1], partition, excluded):
                return src  # SiLU, GELU: both operands come from one kernel
            elif partition and op == "Add" and (res := self.residual(node)) is not None:
                tensor = node.input[1 - res]
            else:
                return None
        return None

    def residual(self, node) -> int | None:
        """For a residual Add of a Conv block: the slot of its residual (non-backbone) input."""
        ins = node.input
        if node.op_type != "Add" or len(ins) != 2 or not all(map(self.g.is_activation, ins)):
            return None
        bb = [self._backbone(t) for t in ins]
        if bb[0] != bb[1]:
            return 0 if bb[1] else 1
        if not bb[0]:
            return None
        d0, d1 = self._depths(ins[0]), self._depths(ins[1])
        common = set(d0) & set(d1)
        if not common:
            return None
        lca = min(common, key=lambda t: d0[t] + d1[t])
        return 0 if d0[lca] < d1[lca] else 1  # the shorter way back is the shortcut

    def _backbone(self, tensor: str) -> bool:
        src = self.kernel_source(tensor, excluded=True)
        return src is not None and self.g.nodes[src].op_type in self.r.backbone_ops

    def _depths(self, tensor: str, limit: int = 400) -> dict[str, int]:
        depth, frontier = {tensor: 0}, [tensor]
        while frontier and len(depth) < limit:
            nxt = []
            for t in frontier:
                node = self.node_of(t)
                for i in (node.input if node is not None else []):
                    if i and self.g.is_activation(i) and i not in depth:
                        depth[i] = depth[t] + 1
                        nxt.append(i)
            frontier = nxt
        return depth

    def excluded(self, idx: int) -> bool:
        """Compute ops Model Optimizer leaves float: narrow Convs, GEMV-like MatMul/Gemm."""
        g, r, node = self.g, self.r, self.g.nodes[idx]
        if node.op_type == "Conv":
            w = g.shapes.get(node.input[1]) if len(node.input) > 1 else None
            if not w or len(w) < 3 or not g.is_constant(node.input[1]):
                return True
            cout, cin = int(w[0]), int(w[1])
            if cout >= r.min_channels and cin >= r.min_channels:
                return False
            group = next((a.i for a in node.attribute if a.name == "group"), 1)
            ks = next((list(a.ints) for a in node.attribute if a.name == "kernel_shape"), w[2:])
            first = node.input[0] in g.graph_inputs
            if group == 1 and (cout % 8 == 0 or cin % 8 == 0) and len(set(ks)) == 1 and \
                    (first or cout >= r.min_channels or cin >= r.min_channels):
                return False
            return not (group > 1 and cout % 8 == 0 and all(k >= 3 for k in ks))
        if node.op_type in ("MatMul", "Gemm"):
            out = g.shapes.get(node.output[0]) or ()
            if any(not isinstance(d, int) for d in out) or len(out) < 2:
                return False
            if all(g.is_activation(t) for t in node.input[:2]):
                return out[-1] == 1 or out[-2] == 1
            if len(out) < 3 and 1 in out:
                return True
            w = g.shapes.get(node.input[1]) or ()
            trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0)
            k = (w[-1] if trans_b else w[-2]) if len(w) >= 2 else None
            return 0 < out[-1] < r.min_matmul_dim or (k is not None and 0 < k < r.min_matmul_dim)
        return False

    def _kernel_head(self, node) -> bool:
        """An elementwise op with computed operands that no kernel absorbs, reading a
        kernel's output or a layer Model Optimizer quantizes at its output."""
        srcs = [self.kernel_source(t, True) for t in node.input]
        if srcs[0] is not None and len(set(srcs)) == 1:
            return False  # the pointwise tail of one kernel (SiLU, GELU)
        return any(s is not None for s in srcs) or \
            any(self.op(t) in _OUTPUT_QUANTIZED for t in node.input)

    def _fused_pool(self, node) -> bool:
        """Conv -> [BN] -> Relu -> MaxPool with single consumers: one TensorRT kernel."""
        t = node.input[0]
        return node.op_type == "MaxPool" and self.op(t) == "Relu" and \
            len(self.g.consumers.get(t, [])) == 1 and self._backbone(t)

    def _feeds(self, tensor: str, quantized: set[int], seen: set[str] | None = None) -> bool:
        seen = set() if seen is None else seen
        for n, _ in self.g.consumers.get(tensor, []):
            node = self.g.nodes[n]
            if n in quantized:
                return True
            if node.op_type in self.r.copy_ops:
                for o in node.output:
                    if o and o not in seen:
                        seen.add(o)
                        if self._feeds(o, quantized, seen):
                            return True
        return False

    def uses(self) -> set[Use]:
        g, r = self.g, self.r
        slots: dict[int, set[int]] = {}   # quantized node -> its quantized input slots
        keep_float: set[tuple[int, int]] = set()
        for idx, node in enumerate(g.nodes):
            data = self.data_inputs(idx)
            if node.op_type in r.compute_ops:
                if self.excluded(idx):
                    keep_float.update((idx, s) for s in data)
                else:
                    slots[idx] = {s for s in data if s < 2}
            elif (res := self.residual(node)) is not None:
                slots[idx] = {res}
                keep_float.add((idx, 1 - res))
            elif node.op_type in r.elementwise_ops and len(data) == len(node.input) >= 2 \
                    and self._kernel_head(node):
                slots[idx] = set(data)
            elif node.op_type == "BatchNormalization" and data == [0] and \
                    self.kernel_source(node.input[0]) is None:
                slots[idx] = {0}  # not fused into a quantized Conv: a layer of its own
            elif node.op_type in r.follower_ops and data and \
                    self.kernel_source(node.input[0], True) is not None:
                slots[idx] = {0}
        first = set(slots)
        for idx, node in enumerate(g.nodes):
            if node.op_type in r.pooling_ops and not self._fused_pool(node) and \
                    self.data_inputs(idx) == [0] and \
                    (self._feeds(node.output[0], first)
                     or self.kernel_source(node.input[0], True) is not None):
                slots[idx] = {0}
        tensors = {g.nodes[n].input[s] for n, ss in slots.items() for s in ss}
        return {(t, n, s) for t in tensors for n, s in g.consumers.get(t, [])
                if (n, s) not in keep_float}


# -- Model Optimizer, where it is installed --------------------------------------------------
def run_modelopt(model: str | os.PathLike, output: str | os.PathLike, *,
                 python: str | os.PathLike | None = None,
                 calibration_data: str | os.PathLike | None = None,
                 timeout: float = 1800) -> Path:
    """NVIDIA Model Optimizer's default INT8 quantization (``python -m
    modelopt.onnx.quantization --quantize_mode int8``, calibrated on the CPU) of ``model`` into
    ``output``, with ``python`` (an interpreter where ``nvidia-modelopt[onnx]`` is installed;
    default: this one). Its dependencies pin onnx and ONNX Runtime versions of their own, so it
    usually lives in an environment of its own."""
    cmd = [str(python or sys.executable), "-m", "modelopt.onnx.quantization",
           "--onnx_path", str(model), "--quantize_mode", "int8", "--calibration_method", "max",
           "--calibration_eps", "cpu", "--output_path", str(output)]
    if calibration_data is not None:
        cmd += ["--calibration_data_path", str(calibration_data)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ToolError(f"NVIDIA Model Optimizer ({cmd[0]}): {exc}") from None
    if done.returncode != 0 or not Path(output).is_file():
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise ToolError(f"NVIDIA Model Optimizer failed on {model}: {last}")
    return Path(output)


def read_scales(qdq_model: str | os.PathLike | onnx.ModelProto) -> dict[str, tuple[float, int]]:
    """Activation tensor -> (scale, zero point) of a Q/DQ model's QuantizeLinear nodes, for an
    exporter that should reproduce its model (per-tensor activations only)."""
    model = qdq_model if isinstance(qdq_model, onnx.ModelProto) else onnx.load(str(qdq_model))
    ix = _QDQIndex.of(model)
    inits = {t.name: t for t in model.graph.initializer}
    outputs = {o.name for o in model.graph.output}
    out: dict[str, tuple[float, int]] = {}
    for q in ix.nodes:
        if q.op_type != "QuantizeLinear" or q.input[0] in ix.constants or q.input[1] not in inits:
            continue
        scale = onnx.numpy_helper.to_array(inits[q.input[1]])
        zp = onnx.numpy_helper.to_array(inits[q.input[2]]) if len(q.input) > 2 and \
            q.input[2] in inits else np.zeros(())
        if scale.size == 1:
            params = (float(scale.reshape(())), int(zp.reshape(())))
            out[ix.source(q.input[0])] = params
            for dq, _ in ix.consumers.get(q.output[0], []):  # a renamed graph output's pair
                if dq.op_type == "DequantizeLinear" and dq.output[0] in outputs:
                    out[dq.output[0]] = params
    return out
