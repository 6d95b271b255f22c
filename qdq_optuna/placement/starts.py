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

The recipes are run, not re-implemented, each by its runtime's profile
(``qdq_optuna/runtimes/<name>.py``: ONNX Runtime's ``quantize_static``, NNCF's
``nncf.quantize``, NVIDIA Model Optimizer where it is installed); this module reads a recipe's
placement back from the Q/DQ model it wrote (:func:`read_placement`), quiets the tool while it
runs (:func:`quiet_tool`) and hands its own file over as written (:func:`recipe_file_data`;
the run folder writes it).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import tempfile
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import onnx

from qdq_optuna.errors import ToolError, UserError
from qdq_optuna.model.graph import Graph, Use
from qdq_optuna.placement.dynamic import QuantMode
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
    #: one of the runtime's own recipes (its classic recipe, a recipe file's placement, a
    #: per-node mode's recipe): the fastest of them sets how accurate the tuned model must be
    #: (:meth:`~qdq_optuna.measure.bound.AccuracyBound.under_recipe`)
    recipe: bool = False

    def as_recipe(self) -> Start:
        return replace(self, recipe=True)

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
#: the ops a CNN is made of (against which :func:`dynamic_start` weighs the dynamic nodes)
#: the float start's name (no Q/DQ: the user's model as the search sees it)
FLOAT = "float"
CONVOLUTIONS = frozenset({"Conv", "ConvTranspose"})

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
    return start_from_schemes(pm, FLOAT, {})


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


@contextlib.contextmanager
def quiet_tool(what: str, loggers: Iterable[str] = ()) -> Iterator[None]:
    """A third-party quantizer run without its per-tensor notes, hints and progress bars; its
    failure is one :class:`ToolError` line naming it. The root logger and the tool's own
    ``loggers`` (a tool may keep its own handler and level) are raised to ERROR, and what the
    tool prints (progress bars on sys.stdout/sys.stderr) is dropped."""
    raised = [logging.getLogger(name) for name in ("", *loggers)]
    levels = [lg.level for lg in raised]
    for lg in raised:
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
        for lg, level in zip(raised, levels):
            lg.setLevel(level)


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


# -- the recipe's own file --------------------------------------------------------------------
#: the largest recipe file kept whole (protobuf's limit: bigger models keep weights outside)
_ONE_FILE = (1 << 31) - (1 << 20)


#: where a recipe's own file goes (the run folder's writer: ``RunFolder.keep`` at its path)
KeepFile = Callable[[bytes], None]


def recipe_file_data(written: os.PathLike | onnx.ModelProto) -> bytes | None:
    """The recipe's own model as bytes (its Q/DQ, scales, zero points and types exactly as the
    tool wrote them), for the run to keep, measure and ship as written; None when it does not
    fit one file."""
    if isinstance(written, onnx.ModelProto):
        return None if written.ByteSize() > _ONE_FILE else written.SerializeToString()
    folder = Path(written).parent  # weights written beside it: too big for one file
    if any(f != Path(written) for f in folder.iterdir() if f.suffix not in (".onnx",)):
        return None
    return Path(written).read_bytes()


def keep_recipe_file(written: os.PathLike | onnx.ModelProto, keep: KeepFile) -> bool:
    """The recipe's own model handed to ``keep`` (the run folder writes it); False (nothing
    handed over) when it does not fit one file."""
    data = recipe_file_data(written)
    if data is not None:
        keep(data)
    return data is not None


def recipe_file_bytes(make: Callable[[Path], os.PathLike | onnx.ModelProto]) -> bytes | None:
    """A recipe model made again by ``make(work_folder)`` (a profile's recipe tool: the same
    model, data and settings give the same file, the tools calibrate deterministically), as
    bytes; None for a model too big for one file."""
    with tempfile.TemporaryDirectory(prefix="qdq-optuna-recipe-") as tmp:
        return recipe_file_data(make(Path(tmp)))


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


def dynamic_start(pm) -> Start | None:
    """A runtime's dynamic mode as a whole-model start (ONNX Runtime's transformer recipe):
    every dynamic point on and nothing else (what ``quantize_dynamic`` writes, with the
    search's graph and weights). None when the prepared model has no dynamic point, or when
    its convolutions outnumber the nodes the dynamic points cover (a CNN with a classifier
    Gemm: a start that is the float model but for one layer is not worth its measurement;
    the descent can still try those points)."""
    return mode_start(pm, QuantMode.DYNAMIC)


def mode_start(pm, mode: QuantMode) -> Start | None:
    """A per-node ``mode`` as a whole-model start named after it: every point of that mode
    on and nothing else (for ``dynamic`` ONNX Runtime's transformer recipe, for a weight-only
    mode its weight-only recipe with the search's graph and weights); None as for
    :func:`dynamic_start`."""
    suffix = f".{mode.value}"
    schemes = {pp.pattern.id: {pid: 1 for pid in pp.ids if pid.endswith(suffix)}
               for pp in pm.tunable}
    covered = {n for pp in pm.tunable for _, n, _ in pp.uses(schemes[pp.pattern.id])}
    convolutions = sum(1 for n in pm.graph.nodes if n.op_type in CONVOLUTIONS)
    if not covered or len(covered) < convolutions:
        return None
    return start_from_schemes(pm, mode.value, schemes).as_recipe()
