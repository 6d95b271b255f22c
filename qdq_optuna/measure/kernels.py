"""Kernel evidence: each integer kernel a runtime ran, timed against its float kernel on this
machine, so the search decides from measured kernels instead of an assumed fusion.

Why: a Q/DQ pair a runtime fuses into an integer kernel is not always a gain. On an AVX512-VNNI
CPU (ONNX Runtime 1.32) Inception v1 with every Conv integer ran 1.174x over FP32 but 1.245x
with its 1x1 Convs left float; on an AVX2 CPU without VNNI the float model won outright. Which
kernel is faster depends on the op, its shapes and attributes, and the CPU, so it is measured,
per distinct node *signature*, once per runtime, version and CPU flag set (a JSON cache in the
user's cache folder, shared by runs and models).

A *unit* is one compute node (:data:`KERNEL_OPS`) whose activation inputs are read through
``Q -> DQ`` and whose output (after a following Relu/Clip the runtime folds in) is quantized:
what the runtime runs as one integer kernel. Its integer model is the Q/DQ model cut at the Q
outputs (integer in, integer out: the kernel alone, no boundary conversion); its float model is
the float model cut at the same float tensors. Both are timed by the search's own backend and
timing protocol (an interleaved A/B of fresh sessions), so the margin is the measurement's own
confidence interval: a unit is ``integer`` (faster) or ``float`` only when the interval of the
ratio float/integer excludes 1, else ``tie``. :func:`subgraph` cuts any region the same way.

Where the runtime runs MatMul/Gemm dynamically too (``kernel_table(dynamic=True)``: ONNX
Runtime), each such unit's float model is also written with that node dynamic (activations
quantized per call, int8 weights: :func:`~qdq_optuna.placement.dynamic.dynamic_node`) and
timed against float the same way: the row then shows the static, dynamic and float kernels of
the node side by side (``dynamic_ms``, ``dynamic_ratio`` float/dynamic and its interval). The
weight-only modes a run searches are timed likewise (``kernel_table(weight_only=...)``: the
node as MatMulNBits, ``weight_int8_*`` and ``weight_int4_*``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qdq_optuna._files import atomic_write_bytes
from qdq_optuna.backends.base import Backend
from qdq_optuna.machine import current_cpu
from qdq_optuna.measure.timing import Measurer, TimingProtocol, Until
from qdq_optuna.placement.dynamic import QuantMode

log = logging.getLogger("qdq_optuna")

#: ops timed as kernels: their work grows with multiply-adds, where integer and float differ
KERNEL_OPS = frozenset({"Conv", "ConvTranspose", "MatMul", "Gemm"})
#: element-wise ops a runtime folds into the kernel before its output Q (ONNX Runtime's
#: QLinearConv absorbs a Relu/Clip between the Conv and its Q)
TAIL_OPS = frozenset({"Relu", "Clip"})
#: backend settings that describe the model, not the runtime (left out of the cache key)
_MODEL_KEYS = frozenset({"input_shapes", "input_data", "seed", "model", "isolated"})
#: CPU flags shown in the report (the key uses every flag)
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni",
             "avx512_bf16", "amx_bf16", "amx_int8", "amx_tile")
#: 2: a per-node mode's ms was its float kernel's until then (its ratio was right), so a
#: cache of version 1 is timed again; 3: dynamic weights have a scale per output column
CACHE_VERSION = 3


def cpu_flags() -> frozenset[str]:
    """The CPU flags that change a kernel's speed (:func:`qdq_optuna.machine.current_cpu`: read,
    or simulated with ``QDQ_OPTUNA_CPU_FLAGS``); the cache is keyed by them."""
    return frozenset(current_cpu().flags)


def isa(flags: Iterable[str]) -> list[str]:
    """The instruction-set flags among ``flags`` that decide integer vs float kernels."""
    flags = set(flags)
    return [f for f in ISA_FLAGS if f in flags]


class KernelDecision(str, Enum):
    """What a unit's kernel timing says: ``float`` measured faster, ``integer`` faster, or
    ``tie`` (the interval includes 1: no evidence either way)."""

    FLOAT = "float"
    INTEGER = "integer"
    TIE = "tie"


@dataclass(frozen=True)
class KernelTiming:
    """One unit signature's integer kernel against its float kernel (ms: the timing
    protocol's score, each session's minimum, median over sessions)."""

    signature: str
    op: str
    int_ms: float
    float_ms: float
    #: float / integer, geometric mean of paired rounds, and its confidence interval
    ratio: float
    ci_low: float
    ci_high: float
    rounds: int
    #: the dynamic kernel of a MatMul/Gemm (None: not timed): its ms, float / dynamic and the
    #: interval of that ratio
    dynamic_ms: float | None = None
    dynamic_ratio: float | None = None
    dynamic_ci: tuple[float, float] | None = None
    #: the weight-only kernels (MatMulNBits, int8 and int4 blocks), likewise (None: not timed)
    weight_int8_ms: float | None = None
    weight_int8_ratio: float | None = None
    weight_int8_ci: tuple[float, float] | None = None
    weight_int4_ms: float | None = None
    weight_int4_ratio: float | None = None
    weight_int4_ci: tuple[float, float] | None = None

    @property
    def decision(self) -> KernelDecision:
        """Which kernel measured faster (a tie: the interval includes 1)."""
        if self.ci_high < 1.0:
            return KernelDecision.FLOAT
        if self.ci_low > 1.0:
            return KernelDecision.INTEGER
        return KernelDecision.TIE

    @property
    def gain_ms(self) -> float:
        """What running this unit in float saves (negative: what it costs)."""
        return self.int_ms - self.float_ms

    def to_dict(self) -> dict:
        return {**asdict(self), "decision": self.decision.value}

    @classmethod
    def from_dict(cls, data: Mapping) -> KernelTiming:
        """A cached timing (an entry cached before dynamic kernels were timed has none)."""
        found = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        for mode in MODE_KERNELS:
            if found.get(f"{mode.value}_ci") is not None:
                found[f"{mode.value}_ci"] = tuple(found[f"{mode.value}_ci"])
        return cls(**found)

    def mode_ms(self, mode: QuantMode) -> float | None:
        """A per-node mode's kernel ms (None: not timed)."""
        return getattr(self, f"{mode.value}_ms")


@dataclass(frozen=True)
class Unit:
    """One node the runtime may run as an integer kernel, and where to cut both models."""

    node: str
    op: str
    signature: str
    #: the Q/DQ model's tensors: the Q outputs it reads, the Q output it writes
    int_inputs: tuple[str, ...]
    int_outputs: tuple[str, ...]
    #: the node's inputs those Q outputs feed (positions), and how many Relu/Clip follow it
    positions: tuple[int, ...]
    tail: int


@dataclass
class KernelTable:
    """The kernel evidence for one model: per unit node name, its signature's timing."""

    runtime: dict
    flags: list[str]
    timings: dict[str, KernelTiming] = field(default_factory=dict)
    #: the units were read with :func:`units`'s ``output_q``
    output_q: bool = True
    #: signatures timed now, and read from the cache
    timed: int = 0
    cached: int = 0
    seconds: float = 0.0
    #: the op types whose placement as an integer kernel the table reads (:func:`units`'s
    #: ``ops``): the multiply-add ops, and the ops timed as op units (:func:`time_op_units`)
    ops: frozenset[str] = KERNEL_OPS
    #: op units (:func:`time_op_units`): signatures timed now, read from the cache, their
    #: seconds, and the nodes left untimed once :data:`OP_UNITS_BUDGET_S` was spent
    op_units: dict = field(default_factory=lambda: {"timed": 0, "cached": 0, "seconds": 0.0,
                                                    "left": 0})
    #: a standalone Q and DQ on this machine (:func:`time_conversions`): their timings by
    #: op and size, from which :meth:`conversion_ms` prices a conversion of any size
    conversions: dict[str, KernelTiming] = field(default_factory=dict)

    def merge(self, other: KernelTable) -> None:
        """Add another model's timings (a later standing model of the same run)."""
        self.timings.update(other.timings)
        self.conversions.update(other.conversions)
        self.timed += other.timed
        self.cached += other.cached
        self.seconds += other.seconds
        self.ops = self.ops | other.ops
        for k in ("timed", "cached", "seconds"):
            self.op_units[k] += other.op_units[k]
        self.op_units["left"] = other.op_units["left"]

    def decision(self, node: str) -> str | None:
        t = self.timings.get(node)
        return None if t is None else t.decision

    def conversion_ms(self, op: str, elements: int) -> float | None:
        """What one standalone ``op`` (QuantizeLinear or DequantizeLinear) of ``elements``
        costs on this machine: the line through its timings at :data:`CONVERSION_SIZES`,
        none below zero (None: not timed)."""
        costs = sorted((n, t.int_ms - t.float_ms) for n, t in
                       ((conversion_size(k), t) for k, t in self.conversions.items()
                        if k.startswith(op + "@")))
        if not costs:
            return None
        if len(costs) == 1:
            n, ms = costs[0]
            return max(ms * elements / n, 0.0)
        (n0, ms0), (n1, ms1) = costs[0], costs[-1]
        return max(ms0 + (ms1 - ms0) * (elements - n0) / (n1 - n0), 0.0)

    def to_dict(self) -> dict:
        """The report's table, slowest integer kernel (largest float gain) first."""
        rows = [{"node": n, **t.to_dict()} for n, t in
                sorted(self.timings.items(), key=lambda nt: (-nt[1].gain_ms, nt[0]))]
        return {"runtime": self.runtime, "cpu_flags": self.flags, "timed": self.timed,
                "cached": self.cached, "seconds": round(self.seconds, 3),
                "op_units": {**self.op_units, "seconds": round(self.op_units["seconds"], 3)},
                "conversions": {k: round(t.int_ms - t.float_ms, 6)
                                for k, t in sorted(self.conversions.items())},
                "kernels": rows}


# -- units and cutting -----------------------------------------------------------------------
def _attrs(node: onnx.NodeProto) -> dict:
    out = {}
    for a in node.attribute:
        v = helper.get_attribute_value(a)
        if isinstance(v, bytes):
            v = v.decode("utf-8", "replace")
        elif isinstance(v, (list, tuple)):
            v = [x.decode("utf-8", "replace") if isinstance(x, bytes) else x for x in v]
        elif not isinstance(v, (int, float, str)):
            v = str(type(v).__name__)
        out[a.name] = v
    return dict(sorted(out.items()))


def _shapes(model: onnx.ModelProto) -> dict[str, tuple]:
    g = model.graph
    out = {t.name: tuple(t.dims) for t in g.initializer}
    for vi in (*g.value_info, *g.input, *g.output):
        dims = vi.type.tensor_type.shape.dim
        out[vi.name] = tuple(d.dim_value if d.HasField("dim_value") else "?" for d in dims)
    return out


def units(qdq_model: onnx.ModelProto, output_q: bool = True,
          ops: frozenset[str] = KERNEL_OPS) -> list[Unit]:
    """The nodes of ``ops`` a Q/DQ model sets up to run as integer kernels (see the module
    docstring). ``qdq_model`` must carry shapes (:func:`onnx.shape_inference.infer_shapes`).
    ``output_q``: the runtime's integer kernel needs a Q on the output too (ONNX Runtime's
    QLinear ops); without it (OpenVINO, TensorRT: integer in, float out) a unit may end at its
    float output."""
    g = qdq_model.graph
    producer = {o: n for n in g.node for o in n.output}
    readers: dict[str, list] = {}
    for n in g.node:
        for t in n.input:
            readers.setdefault(t, []).append(n)
    consts = {t.name for t in g.initializer}
    shapes = _shapes(qdq_model)
    found = []
    for node in g.node:
        if node.op_type not in ops or not node.name:
            continue
        int_in, float_in, shape_in = [], [], []
        for pos, t in enumerate(node.input):
            if t in consts:  # a float bias: ONNX Runtime's QLinearConv takes it in
                shape_in.append(("c", shapes.get(t)))
                continue
            dq = producer.get(t)
            if not t or dq is None or dq.op_type != "DequantizeLinear":
                break
            if dq.input[0] in consts:  # a weight: part of the kernel
                shape_in.append(("w", shapes.get(dq.input[0])))
                continue
            q = producer.get(dq.input[0])
            if q is None or q.op_type != "QuantizeLinear":
                break
            int_in.append(q.output[0])
            float_in.append(pos)
            shape_in.append(("x", shapes.get(q.input[0])))
        else:
            out, tail = node.output[0], []
            while len(readers.get(out, [])) == 1 and readers[out][0].op_type in TAIL_OPS:
                tail.append(readers[out][0].op_type)
                out = readers[out][0].output[0]
            qs = [r for r in readers.get(out, []) if r.op_type == "QuantizeLinear"]
            if not int_in or (output_q and not qs):
                continue
            sig = json.dumps([node.op_type, _attrs(node), shape_in, tail, bool(qs)],
                             sort_keys=True, default=str)
            found.append(Unit(node.name, node.op_type, sig, tuple(int_in),
                              (qs[0].output[0] if qs else out,), tuple(float_in), len(tail)))
    return found


def subgraph(model: onnx.ModelProto, inputs: Iterable[str], outputs: Iterable[str]) -> bytes:
    """``model`` cut to the nodes between ``inputs`` and ``outputs`` (onnx's extractor; the
    model must carry their shapes), checked, serialized."""
    cut = onnx.utils.Extractor(model).extract_model(list(inputs), list(outputs))
    onnx.checker.check_model(cut)
    return cut.SerializeToString()


def unit_models(unit: Unit, qdq_model: onnx.ModelProto,
                float_model: onnx.ModelProto) -> tuple[bytes, bytes]:
    """(integer model, float model) of one unit, both with shapes."""
    g = float_model.graph
    node = next(n for n in g.node if n.name == unit.node)
    out = node.output[0]
    for _ in range(unit.tail):  # the Relu/Clip the runtime folds in, as in the Q/DQ model
        out = next(n for n in g.node if out in n.input).output[0]
    return (subgraph(qdq_model, unit.int_inputs, unit.int_outputs),
            subgraph(float_model, [node.input[p] for p in unit.positions], [out]))


def with_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    return onnx.shape_inference.infer_shapes(model)


# -- the cache -------------------------------------------------------------------------------
#: the environment variable that sets ``--kernel-cache``'s default
KERNEL_CACHE_ENV = "QDQ_OPTUNA_KERNEL_CACHE"
#: ``--kernel-cache off``: no cache is read or written
CACHE_OFF = "off"
KERNEL_CACHE_HELP = (
    "JSON file of the integer-vs-float kernel timings (kernel evidence on a measured backend), "
    "shared by runs and models on this machine (default: $" + KERNEL_CACHE_ENV + ", else "
    "$XDG_CACHE_HOME/qdq_optuna/kernels.json, ~/.cache when unset); off: time the kernels "
    "again in each run and write no file")


def default_cache_path() -> Path:
    """``$XDG_CACHE_HOME/qdq_optuna/kernels.json`` (``~/.cache`` when unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "qdq_optuna" / "kernels.json"


def kernel_cache(setting: str | os.PathLike | None) -> KernelCache | None:
    """The cache ``--kernel-cache`` names: a path, :data:`CACHE_OFF` (None: no cache), or
    None for ``$QDQ_OPTUNA_KERNEL_CACHE`` (the same two forms), else the default path."""
    chosen = setting if setting is not None else os.environ.get(KERNEL_CACHE_ENV) or None
    if chosen is not None and str(chosen).strip().lower() == CACHE_OFF:
        return None
    return KernelCache(chosen)


def machine_key(runtime: Mapping, flags: Iterable[str]) -> str:
    """The cache key of a runtime's settings on a CPU: its settings (version included) and
    every CPU flag."""
    text = json.dumps({"runtime": runtime, "flags": sorted(flags)}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


class KernelCache:
    """Timings by machine key and signature, in one JSON file (written atomically, merged
    with what other processes wrote meanwhile). An unreadable file is ignored, not fatal."""

    def __init__(self, path: str | os.PathLike | None = None) -> None:
        self.path = Path(path) if path is not None else default_cache_path()
        self.data = self._read()
        self.hits = 0

    def _read(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {"version": CACHE_VERSION, "machines": {}}
        if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
            return {"version": CACHE_VERSION, "machines": {}}
        data.setdefault("machines", {})
        return data

    def get(self, key: str, signature: str) -> KernelTiming | None:
        entry = self.data["machines"].get(key, {}).get("kernels", {}).get(signature)
        if entry is None:
            return None
        try:
            timing = KernelTiming.from_dict(entry)
        except (KeyError, TypeError):
            return None
        self.hits += 1
        return timing

    def put(self, key: str, about: Mapping, timing: KernelTiming) -> None:
        machine = self.data["machines"].setdefault(key, {**about, "kernels": {}})
        machine["kernels"][timing.signature] = timing.to_dict()

    def save(self) -> None:
        on_disk = self._read()
        for key, machine in self.data["machines"].items():
            mine = on_disk["machines"].setdefault(key, {**machine, "kernels": {}})
            mine["kernels"].update(machine["kernels"])
        self.data = on_disk
        try:
            atomic_write_bytes(self.path, json.dumps(on_disk, indent=1, sort_keys=True).encode())
        except OSError as exc:  # a cache is an optimisation: never the run's failure
            log.info("kernel cache %s not written (%s)", self.path, exc)


# -- timing ----------------------------------------------------------------------------------
#: the kernel A/B: a unit runs in well under a millisecond, so rounds are cheap; at least
#: 4 rounds, until the ratio's interval is +-3 % or 10 rounds
KERNEL_PROTOCOL = TimingProtocol(name="kernels", sessions=4, warmup=5, runs=20,
                                 final_sessions=4, min_rounds=4, max_rounds=10, target=0.03,
                                 give_up_at=None, process_warmup_rounds=1)


def runtime_of(backend: Backend) -> dict:
    """The backend's settings that decide its kernels (version included), without the ones
    that describe a model."""
    return {k: v for k, v in backend.describe().items() if k not in _MODEL_KEYS}


def time_unit(measurer: Measurer, unit: Unit, int_model: bytes,
              float_model: bytes) -> KernelTiming:
    """One unit's integer model against its float model, interleaved."""
    c = measurer.compare(float_model, int_model, until=Until.PRECISION)
    return KernelTiming(unit.signature, unit.op, round(c.reference.score_ms, 6),
                        round(c.candidate.score_ms, 6), round(c.ratio, 6),
                        round(c.ci_low, 6), round(c.ci_high, 6), c.rounds)


#: the ops whose dynamic and weight-only kernels are timed beside the static one
DYNAMIC_KERNEL_OPS = frozenset({"MatMul", "Gemm"})
#: the per-node modes a kernel row may time, in its column order
MODE_KERNELS = (QuantMode.DYNAMIC, QuantMode.WEIGHT_INT8, QuantMode.WEIGHT_INT4)


def mode_unit_model(unit: Unit, float_model: bytes,
                    mode: QuantMode = QuantMode.DYNAMIC) -> bytes | None:
    """The unit's float model with its node written in a per-node ``mode`` (dynamic:
    :func:`~qdq_optuna.placement.dynamic.dynamic_node`; weight-only:
    :func:`~qdq_optuna.placement.weight_only.weight_only_node`); None: the node has no
    constant 2-D weight to quantize."""
    from qdq_optuna.model.graph import Graph
    from qdq_optuna.placement.dynamic import dynamic_node, dynamic_node_ok
    from qdq_optuna.placement.weight_only import MS_DOMAIN, weight_only_node

    model = onnx.load_from_string(float_model)
    graph = Graph.from_model(model)
    index = next((i for i, n in enumerate(graph.nodes) if n.name == unit.node), None)
    if index is None or not dynamic_node_ok(graph, index, DYNAMIC_KERNEL_OPS):
        return None
    weight = onnx.numpy_helper.to_array(graph.initializer(graph.nodes[index].input[1]))
    unique = lambda name: f"{mode.value}/{name}"  # noqa: E731
    inits, nodes = (dynamic_node(graph, index, unique, weight, 127) if mode is QuantMode.DYNAMIC
                    else weight_only_node(graph, index, unique, weight, mode.bits))
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.node[:]
    extra = onnx.GraphProto()
    extra.ParseFromString(inits + nodes)
    for i, n in enumerate(model.graph.node):
        out.graph.node.extend(extra.node if i == index else [n])
    out.graph.initializer.extend(extra.initializer)
    if mode.bits and MS_DOMAIN not in {o.domain for o in out.opset_import}:
        out.opset_import.append(onnx.helper.make_opsetid(MS_DOMAIN, 1))
    return out.SerializeToString()


def dynamic_unit_model(unit: Unit, float_model: bytes) -> bytes | None:
    """The unit's float model with its node written dynamically (see :func:`mode_unit_model`)."""
    return mode_unit_model(unit, float_model, QuantMode.DYNAMIC)


def time_mode(measurer: Measurer, timing: KernelTiming, unit: Unit, float_model: bytes,
              mode: QuantMode = QuantMode.DYNAMIC) -> KernelTiming:
    """``timing`` with the unit's kernel in a per-node ``mode`` timed against its float
    kernel (its ``<mode>_ms``, ``<mode>_ratio`` float/mode and interval)."""
    model = mode_unit_model(unit, float_model, mode)
    if model is None:
        return timing
    c = measurer.compare(float_model, model, until="precision")  # the mode is the reference
    return dataclasses.replace(timing, **{
        f"{mode.value}_ms": round(c.reference.score_ms, 6),
        f"{mode.value}_ratio": round(c.ratio, 6),
        f"{mode.value}_ci": (round(c.ci_low, 6), round(c.ci_high, 6))})


def time_dynamic(measurer: Measurer, timing: KernelTiming, unit: Unit,
                 float_model: bytes) -> KernelTiming:
    """``timing`` with the unit's dynamic kernel timed against its float kernel."""
    return time_mode(measurer, timing, unit, float_model, QuantMode.DYNAMIC)


# -- op units: ops whose integer kernel moves bytes rather than multiply-adds ---------------
#: seconds one kernel table may spend timing op units the cache does not hold; the nodes left
#: untimed count at their float time in the limit, as every untimed op does
OP_UNITS_BUDGET_S = 20.0
#: the scale and zero point of an op unit's integer tensors (a kernel's work does not depend
#: on them)
UNIT_SCALE, UNIT_ZERO = 0.02, 128
#: inputs that are parameters, not data: taken from the model as they are
PARAMETER_INPUTS = {"Resize": (1, 2, 3)}

#: ``builder(node, inputs, output, params) -> ModelProto``: the integer model of one op unit
#: (``inputs``/``output``: (name, shape) of its data tensors; ``params``: its parameter
#: initializers), as the runtime runs the op fused
OpUnitBuilder = Callable[[onnx.NodeProto, list, tuple, list], onnx.ModelProto]


def _unit_model(nodes: list, inputs: list, outputs: list, inits: list,
                opsets: tuple = ()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "unit", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                   *(helper.make_opsetid(d, v)
                                                     for d, v in opsets)])


def qdq_unit(node: onnx.NodeProto, inputs: list, output: tuple,
             params: list) -> onnx.ModelProto:
    """The op as a runtime's QDQ fusion runs it: uint8 data in -> DQ -> op -> Q -> uint8 out
    (ONNX Runtime: QLinearConcat, QLinearAdd, QLinearAveragePool, a uint8 Resize, ...)."""
    qp = [numpy_helper.from_array(np.array(UNIT_SCALE, np.float32), "unit_scale"),
          numpy_helper.from_array(np.array(UNIT_ZERO, np.uint8), "unit_zero")]
    nodes = [helper.make_node("DequantizeLinear", [name, "unit_scale", "unit_zero"],
                              [f"{name}/dq"]) for name, _ in inputs]
    data = {name: f"{name}/dq" for name, _ in inputs}
    op = onnx.NodeProto()
    op.CopyFrom(node)
    op.output[0] = "unit_out"
    for i, t in enumerate(op.input):
        op.input[i] = data.get(t, t)
    nodes += [op, helper.make_node("QuantizeLinear", ["unit_out", "unit_scale", "unit_zero"],
                                   [output[0]])]
    return _unit_model(
        nodes, [helper.make_tensor_value_info(n, TensorProto.UINT8, s) for n, s in inputs],
        [helper.make_tensor_value_info(output[0], TensorProto.UINT8, output[1])], qp + params)


def float_unit(node: onnx.NodeProto, inputs: list, output: tuple,
               params: list) -> onnx.ModelProto:
    """The op alone in float: float data in, float out."""
    op = onnx.NodeProto()
    op.CopyFrom(node)
    del op.output[1:]
    return _unit_model(
        [op], [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
        [helper.make_tensor_value_info(output[0], TensorProto.FLOAT, output[1])], params)


def _op_unit(node: onnx.NodeProto, shapes: dict, consts: dict) -> tuple | None:
    """(inputs, output, params, signature) of one node as an op unit; None where it cannot be
    one: a data input that is a constant (its integer form needs the constant quantized too),
    or a shape not known."""
    skip = PARAMETER_INPUTS.get(node.op_type, ())
    inputs, params, described = [], [], []
    for pos, t in enumerate(node.input):
        if not t:
            continue
        if pos in skip:
            if t in consts:
                params.append(consts[t])
                described.append(numpy_helper.to_array(consts[t]).tolist())
            continue
        shape = shapes.get(t)
        if t in consts or not shape or not all(isinstance(d, int) and d > 0 for d in shape):
            return None
        inputs.append((t, list(shape)))
        described.append(list(shape))
    out = shapes.get(node.output[0]) if node.output else None
    if not inputs or not out or not all(isinstance(d, int) and d > 0 for d in out):
        return None
    signature = json.dumps(["op unit", node.op_type, _attrs(node), described],
                           sort_keys=True, default=str)
    return inputs, (node.output[0], list(out)), params, signature


def time_op_units(table: KernelTable, measurer: Measurer, float_model: onnx.ModelProto,
                  builders: Mapping[str, OpUnitBuilder], *, skip: Iterable[str] = (),
                  cache: KernelCache | None = None, key: str = "", about: Mapping = {},
                  budget_s: float = OP_UNITS_BUDGET_S) -> None:
    """Each node of ``builders``' op types (but ``skip``'s) timed as its integer kernel
    against its float one, built alone from its shapes (the integer model by its op's
    builder; the float one the op alone), whatever the placement: the limit then has both
    kernels of every such node. Each signature once (``cache``: across runs); no new
    signature is timed past ``budget_s`` seconds or the measurer's deadline."""
    t0 = time.perf_counter()
    shapes = _shapes(float_model)
    consts = {t.name: t for t in float_model.graph.initializer}
    skip, done = set(skip), {}
    for node in float_model.graph.node:
        builder = builders.get(node.op_type)
        if builder is None or not node.name or node.name in skip or node.name in table.timings:
            continue
        found = _op_unit(node, shapes, consts)
        if found is None:
            continue
        inputs, output, params, signature = found
        timing = done.get(signature) or (cache.get(key, signature) if cache else None)
        if timing is not None and signature not in done:
            table.op_units["cached"] += 1
        if timing is None:
            if measurer.out_of_time() or time.perf_counter() - t0 > budget_s:
                table.op_units["left"] += 1
                continue
            unit = Unit(node.name, node.op_type, signature, (), (), (), 0)
            try:
                timing = time_unit(
                    measurer, unit, builder(node, inputs, output, params).SerializeToString(),
                    float_unit(node, inputs, output, params).SerializeToString())
            except Exception as exc:  # evidence is an optimisation: never the run's failure
                log.info("op %s not timed (%s)", node.name, str(exc).splitlines()[0])
                continue
            table.op_units["timed"] += 1
            if cache is not None:
                cache.put(key, about, timing)
        done[signature] = timing
        table.timings[node.name] = timing
    table.op_units["seconds"] += time.perf_counter() - t0


# -- conversions: a standalone Q or DQ, what a float op next to an integer kernel costs ------
#: the sizes (elements) a standalone Q and DQ are timed at: a conversion of another size is
#: priced on the line through them (both are element-wise: one pass over the tensor)
CONVERSION_SIZES = (1 << 12, 1 << 20)
QUANTIZE, DEQUANTIZE = "QuantizeLinear", "DequantizeLinear"
CONVERSION_OPS = (QUANTIZE, DEQUANTIZE)


def conversion_key(op: str, elements: int) -> str:
    return f"{op}@{elements}"


def conversion_size(key: str) -> int:
    return int(key.rsplit("@", 1)[1])


def conversion_model(op: str, elements: int) -> bytes:
    """One ``op`` on a 1-D tensor of ``elements`` (float -> uint8 for Q, back for DQ)."""
    types = (TensorProto.FLOAT, TensorProto.UINT8)
    src, dst = types if op == QUANTIZE else types[::-1]
    qp = [numpy_helper.from_array(np.array(UNIT_SCALE, np.float32), "unit_scale"),
          numpy_helper.from_array(np.array(UNIT_ZERO, np.uint8), "unit_zero")]
    return _unit_model([helper.make_node(op, ["x", "unit_scale", "unit_zero"], ["y"])],
                       [helper.make_tensor_value_info("x", src, [elements])],
                       [helper.make_tensor_value_info("y", dst, [elements])],
                       qp).SerializeToString()


def time_conversions(table: KernelTable, measurer: Measurer, *,
                     cache: KernelCache | None = None, key: str = "",
                     about: Mapping = {}) -> int:
    """A standalone Q and DQ timed at each of :data:`CONVERSION_SIZES` against the same op
    on one element (the session's own overhead, which the difference leaves out), once per
    machine (``cache``). What the limit prices a conversion no placement avoids by: a float
    op (LRN, Softmax) between integer kernels, or the model's input and output. Returns how
    many were timed now (not read from the cache)."""
    timed = 0
    for op in CONVERSION_OPS:
        for elements in CONVERSION_SIZES:
            name = conversion_key(op, elements)
            signature = json.dumps(["conversion", name])
            timing = cache.get(key, signature) if cache is not None else None
            if timing is None:
                if measurer.out_of_time():
                    return timed
                unit = Unit(name, op, signature, (), (), (), 0)
                try:
                    timing = time_unit(measurer, unit, conversion_model(op, elements),
                                       conversion_model(op, 1))
                except Exception as exc:  # evidence is an optimisation: never the run's failure
                    log.info("conversion %s not timed (%s)", name, str(exc).splitlines()[0])
                    continue
                timed += 1
                if cache is not None:
                    cache.put(key, about, timing)
            table.conversions[name] = timing
    return timed


def kernel_table(backend: Backend, float_model: onnx.ModelProto, qdq_model: onnx.ModelProto,
                 *, skip: Iterable[str] = (), cache: KernelCache | None = None,
                 flags: Iterable[str] | None = None,
                 protocol: TimingProtocol | None = None,
                 output_q: bool, deadline: float | None = None,
                 dynamic: bool = False, weight_only: Iterable[QuantMode] = (),
                 op_units: Mapping[str, OpUnitBuilder] | None = None,
                 timed: Iterable[str] = (), conversions: bool = True) -> KernelTable:
    """The per-runtime entry point: every unit of ``qdq_model`` (but the nodes named in
    ``skip``: timed already, or run in float by the runtime) timed integer against float on
    ``backend``, each distinct signature once per machine (read from ``cache`` when there).
    A unit that cannot be cut or run is left out (logged), never the run's failure.
    ``output_q`` (see :func:`units`) follows the runtime's rules: an integer kernel that
    writes integer needs a Q on its output (``RuntimeRules.output_quantized_ops``; the
    profile's ``kernel_timing`` passes it).
    Past ``deadline`` (``time.monotonic()``, a ``--timeout`` run's) no unit is timed any more:
    Inception v1's 57 uncached units once took minutes after the run's time was up.
    ``dynamic``: each MatMul/Gemm unit's dynamic kernel is timed too (a cached timing
    without it is completed and cached again); ``weight_only``: likewise its kernel in each
    of these weight-only modes (MatMulNBits). ``op_units``: op type -> the builder of its
    integer model (the profile's table): every node of those types is timed as an op unit
    (:func:`time_op_units`) but those in ``timed`` (the run's table has them already).
    ``conversions``: a standalone Q and DQ are timed too (:func:`time_conversions`)."""
    t0 = time.perf_counter()
    flags = cpu_flags() if flags is None else frozenset(flags)
    runtime = runtime_of(backend)
    key = machine_key(runtime, flags)
    table = KernelTable(runtime, isa(flags), output_q=output_q,
                        ops=KERNEL_OPS | frozenset(op_units or ()))
    qdq, flt = with_shapes(qdq_model), with_shapes(float_model)
    skip = set(skip)
    measurer = Measurer(backend, protocol or KERNEL_PROTOCOL)
    measurer.deadline = deadline
    done: dict[str, KernelTiming] = {}
    chosen = set(weight_only) | ({QuantMode.DYNAMIC} if dynamic else set())
    modes = [m for m in MODE_KERNELS if m in chosen]
    for unit in units(qdq, output_q):
        if unit.node in skip:
            continue
        timing = done.get(unit.signature) or (cache.get(key, unit.signature)
                                              if cache is not None else None)
        if timing is not None and unit.signature not in done:
            table.cached += 1
        if timing is None and measurer.out_of_time():
            continue
        wanted = [m for m in modes if unit.op in DYNAMIC_KERNEL_OPS and (
            timing is None or timing.mode_ms(m) is None) and unit.signature not in done]
        if timing is None or wanted:
            try:
                int_model, float_unit = unit_models(unit, qdq, flt)
                if timing is None:
                    timing = time_unit(measurer, unit, int_model, float_unit)
                for mode in wanted:
                    timing = time_mode(measurer, timing, unit, float_unit, mode)
            except Exception as exc:  # evidence is an optimisation: never the run's failure
                log.info("kernel %s not timed (%s)", unit.node, str(exc).splitlines()[0])
                if timing is None:
                    continue
            table.timed += 1
            if cache is not None:
                cache.put(key, {"runtime": runtime, "cpu_flags": isa(flags)}, timing)
        done[unit.signature] = timing
        table.timings[unit.node] = timing
    if op_units:
        time_op_units(table, measurer, flt, op_units, skip=timed, cache=cache, key=key,
                      about={"runtime": runtime, "cpu_flags": isa(flags)})
    fresh = time_conversions(table, measurer, cache=cache, key=key,
                             about={"runtime": runtime, "cpu_flags": isa(flags)}
                             ) if conversions else 0
    if cache is not None and (table.timed or table.op_units["timed"] or fresh):
        cache.save()
    table.seconds = time.perf_counter() - t0
    return table


# -- subgraph screening ----------------------------------------------------------------------
def _dq_outputs(model: onnx.ModelProto, tensor: str) -> list[str]:
    """Where a cut after ``tensor`` keeps its Q/DQ: the outputs of the DQs of its Qs (the
    tensor itself when it has none)."""
    g = model.graph
    qs = {n.output[0] for n in g.node if n.op_type == "QuantizeLinear" and n.input[0] == tensor}
    out = [n.output[0] for n in g.node if n.op_type == "DequantizeLinear" and n.input[0] in qs]
    return out or [tensor]


def region_cut(graph, nodes: Iterable[int]) -> tuple[list[str], list[str]]:
    """The float tensors that bound a region of the prepared ``graph`` (node indices): what
    it reads from outside, and what it writes that is read outside or is a graph output."""
    region = set(nodes)
    made = {t for i in region for t in graph.nodes[i].output if t}
    consts = graph.initializers | graph.constants
    inputs = sorted({t for i in region for t in graph.nodes[i].input
                     if t and t not in made and t not in consts})
    outside = {t for i, n in enumerate(graph.nodes) if i not in region for t in n.input}
    outputs = {vi.name for vi in graph.model.graph.output}
    return inputs, sorted(t for t in made if t in outside or t in outputs)


def region_model(model: onnx.ModelProto, inputs: Iterable[str],
                 outputs: Iterable[str]) -> bytes:
    """A Q/DQ ``model`` (with shapes) cut to a region: from its float inputs (their Q/DQ
    inside) to its outputs after their Q/DQ."""
    outs = [o for t in outputs for o in _dq_outputs(model, t)]
    return subgraph(model, inputs, outs)


def changed_nodes(graph, plan, reference_plan) -> set[int]:
    """Nodes (indices) next to the Q/DQ two plans place differently: the consumers of every
    changed activation or weight pair, the producers of the changed tensors, and the ops
    their fusion joins (:func:`with_tails`)."""
    changed = set(plan.activations) ^ set(reference_plan.activations)
    nodes = {n for _, consumers, _ in changed for n, _ in consumers if n >= 0}
    nodes |= {n for n, _, _ in set(plan.weights) ^ set(reference_plan.weights)}
    nodes |= {graph.producer[t][0] for t, _, _ in changed if t in graph.producer}
    return with_tails(graph, {n for n in nodes if 0 <= n < len(graph.nodes)})


def with_tails(graph, nodes: set[int]) -> set[int]:
    """``nodes`` with the ops a runtime fuses with them: the op a Relu/Clip of theirs folds
    into, and the Relu/Clip folded into one of theirs. Why: a Q after Conv -> Relu decides
    whether the Conv runs integer; a region of the Relu alone (Inception v1's typical move)
    timed only the Q/DQ's own cost, never the integer Conv it buys."""
    out, todo = set(nodes), list(nodes)
    while todo:
        node = graph.nodes[todo.pop()]
        near = []
        if node.op_type in TAIL_OPS and node.input and node.input[0] in graph.producer:
            near.append(graph.producer[node.input[0]][0])  # the op it folds into
        readers = graph.consumers.get(node.output[0], []) if node.output else []
        if len(readers) == 1 and graph.nodes[readers[0][0]].op_type in TAIL_OPS:
            near.append(readers[0][0])  # its folded Relu/Clip
        for n in near:
            if 0 <= n < len(graph.nodes) and n not in out:
                out.add(n)
                todo.append(n)
    return out


@dataclass(frozen=True)
class SubgraphTiming:
    """A candidate's changed region against the reference's, interleaved."""

    nodes: int
    ratio: float
    ci_low: float
    ci_high: float
    rounds: int
    verdict: str

    def to_dict(self) -> dict:
        return asdict(self)


def time_region(measurer: Measurer, graph, candidate: onnx.ModelProto,
                reference: onnx.ModelProto, plan, reference_plan) -> SubgraphTiming | None:
    """The subgraph A/B of a candidate plan against its reference: the nodes whose Q/DQ
    differ, cut from both models (None: the plans do not differ, or the cut failed)."""
    nodes = changed_nodes(graph, plan, reference_plan)
    if not nodes:
        return None
    inputs, outputs = region_cut(graph, nodes)
    try:
        cand = region_model(with_shapes(candidate), inputs, outputs)
        ref = region_model(with_shapes(reference), inputs, outputs)
        c = measurer.compare(cand, ref, until=Until.VERDICT)
    except Exception as exc:  # a screen is an optimisation: the whole model is measured
        log.info("region of %d node(s) not timed (%s)", len(nodes), str(exc).splitlines()[0])
        return None
    return SubgraphTiming(len(nodes), round(c.ratio, 6), round(c.ci_low, 6),
                          round(c.ci_high, 6), c.rounds, c.verdict)
