"""Scheme -> Q/DQ model, cheap enough to run once per trial.

A set of covered tensor uses becomes a :class:`QuantPlan` (merging, the runtime's promotions,
weights that come with their activation). The plan is the identity of the resulting model: two
schemes with the same plan produce the same bytes, so the plan's key is what measurements are
cached by.

Serialization never touches the weights again: the model minus its nodes is serialized once,
every original node once, and each export only writes the Q/DQ nodes, the few rewired nodes and
small initializers, then concatenates byte strings (protobuf merges repeated fields that are
split across the wire, so this is the same message ``SerializeToString`` would write).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import logging
import os
import shutil
import tempfile
import uuid
import weakref
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qdq_optuna._files import (
    WORK_SOURCES,
    WORK_WEIGHTS,
    atomic_write_bytes,
)
from qdq_optuna.errors import OptionChoice, OptionError
from qdq_optuna.model.calibration import (
    MIN_SCALE,
    QMAX,
    REDUCED_WEIGHT_QMAX,
    QuantType,
    cpu_saturates_u8s8,
)
from qdq_optuna.model.graph import (
    GRAPH_INITIALIZER,
    GRAPH_NODE,
    GRAPH_OUTPUT,
    MODEL_GRAPH,
    Graph,
    Use,
    ensure_opset,
    opset_of,
    varint,
    wire_field,
)
from qdq_optuna.model.precision import HighPrecisionModel
from qdq_optuna.placement.dynamic import MODE_PRECEDENCE, QuantMode, dynamic_node, use_mode
from qdq_optuna.placement.rules import WEIGHTED_OPS, RuntimeRules, SevenBitWeights
from qdq_optuna.placement.weight_only import MS_DOMAIN, weight_only_node

#: entries of the exporter's planning / rewiring memos, per node of the graph, before they are
#: dropped (a few hundred bytes each: bounds their memory to a fraction of the model's)
_MEMO_PER_NODE = 2
_NON_NEGATIVE = frozenset({"Relu", "Sigmoid", "Softmax", "HardSigmoid"})
#: what a use maps to when it is not quantized (a scheme's 0, the choice "none", nothing)
_OFF = (None, "none", 0)


class Scales(OptionChoice):
    """The scales trials export with (``--scales``)."""

    __option__ = "--scales"

    #: the runtime's choice (its profile's ``default_scales``)
    AUTO = "auto"
    #: one placeholder scale for every tensor: times the same where the scale does not change
    #: the kernels (TensorRT)
    DEFAULT = "default"
    #: the calibrated scales
    CALIBRATED = "calibrated"


def check_quant_type(name: str) -> str:
    """``name`` when it is a quant type (:meth:`QuantType.parse`), as the plain name runs store."""
    return QuantType.parse(name).value


def required_opset(graph: Graph, quant_types: Iterable[str]) -> int:
    """Per-channel weights need opset 13; FP8 and FP16/BF16 scales need 19."""
    need = 13
    if QuantType.FP8 in set(quant_types):
        need = 19
    if any(
        graph.elem_types.get(t) in (TensorProto.FLOAT16, TensorProto.BFLOAT16)
        for t in graph.elem_types
    ):
        need = 19
    return need


#: in-memory models whose weights reach this size are exported to files, not bytes
FILE_EXPORT_BYTES = 256 << 20
FILE_EXPORT_ENV = "QDQ_OPTUNA_FILE_EXPORT_BYTES"


def file_export_bytes() -> int | None:
    """:data:`FILE_EXPORT_BYTES`, or bytes in $QDQ_OPTUNA_FILE_EXPORT_BYTES (0: never)."""
    value = os.environ.get(FILE_EXPORT_ENV)
    if not value:
        return FILE_EXPORT_BYTES
    try:
        limit = int(value)
    except ValueError:
        raise OptionError(f"${FILE_EXPORT_ENV}: expected bytes, got {value!r}") from None
    return limit if limit > 0 else None


def upgrade_for(graph: Graph, quant_types: Iterable[str]) -> Graph:
    """The graph at the opset its Q/DQ need (onnx's version converter), never an invalid model."""
    need = required_opset(graph, quant_types)
    if opset_of(graph.model) >= need:
        return graph
    model = ensure_opset(graph.full_model(), need, "this quantization")
    model = onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
    return Graph.from_model(model, graph.path)


@dataclass(frozen=True)
class QuantPlan:
    """Which tensors carry Q/DQ, for which consumers, of which type; and which weights."""

    #: (tensor, ((consumer node, slot), ...), quant type), sorted; a consumer GRAPH_OUTPUT
    #: (slot: the output's index) is a Q/DQ pair before that graph output
    activations: tuple[tuple[str, tuple[tuple[int, int], ...], str], ...]
    #: (consumer node, weight slot, quant type), sorted; under ONNX Runtime's rules also the
    #: constant operands and tables that come with the activations (:func:`constant_operands`)
    weights: tuple[tuple[int, int, str], ...]
    #: the mode uses (:func:`~qdq_optuna.placement.dynamic.mode_use`) of the nodes run in a
    #: per-node mode (dynamic, weight-only), one per node, sorted: no Q/DQ on their inputs
    dynamic: tuple[Use, ...] = ()

    @functools.cached_property
    def key(self) -> str:  # computed once per plan (a trial asks several times)
        parts = [self.activations, self.weights] + ([self.dynamic] if self.dynamic else [])
        return hashlib.sha256(json.dumps(parts, separators=(",", ":")).encode()).hexdigest()[:24]

    @property
    def tensors(self) -> list[str]:
        return sorted({t for t, _, _ in self.activations})

    @property
    def qdq_pairs(self) -> int:
        return len(self.activations) + len({(n, s) for n, s, _ in self.weights})

    def __len__(self) -> int:
        return len(self.activations)

    @property
    def quantized(self) -> bool:
        """Whether the plan quantizes anything: Q/DQ on activations, or nodes in a per-node
        mode (a plan of dynamic MatMuls has no Q/DQ at all: its ``len`` is 0)."""
        return bool(self.activations or self.dynamic)


def _one_mode_per_node(uses: Iterable[Use]) -> list[Use]:
    """The mode uses that are on, one per node (:data:`MODE_PRECEDENCE` where the scheme
    turned several on), sorted."""
    best: dict[int, Use] = {}
    for u in uses:
        kept = best.get(u[1])
        if kept is None or MODE_PRECEDENCE.index(use_mode(u)) < MODE_PRECEDENCE.index(
                use_mode(kept)):
            best[u[1]] = u
    return sorted(best.values())


def plan_uses(plan: QuantPlan) -> dict[Use, str]:
    """The typed uses a plan quantizes (promotions included): the same plan again from any
    exporter of the same graph (``exporter.plan(plan_uses(plan))``)."""
    return {**{(t, n, s): q for t, consumers, q in plan.activations for n, s in consumers},
            **dict.fromkeys(plan.dynamic, QuantType.INT8)}


class _QDQPieces:
    """The pieces every export of one graph is made of, built once and kept serialized: each
    activation's Q/DQ pair with its scale, each weight's quantized values and DQ, int32 biases;
    their names, unique in the model, so a plan always exports to the same bytes. In external
    mode quantized weights go to a work folder's weight file once."""

    def __init__(
        self,
        graph: Graph,
        rules: RuntimeRules,
        quant_type: str,
        *,
        scales: Mapping[str, tuple[float, int]] | None = None,
        default_scale: float = 0.1,
        default_zero_point: int | None = None,
        data_dir: str | os.PathLike | None = None,
        high_precision: HighPrecisionModel | None = None,
    ) -> None:
        self.graph = graph
        #: the graph's float part was converted (FP16/BF16): scales are looked up under the
        #: FP32 model's tensor names too, and weights are quantized from their FP32 values
        self.high_precision = high_precision
        #: external mode (the model's big weights stay on disk, see graph.INLINE_EXTERNAL_LIMIT):
        #: exports are files in a work folder under ``data_dir`` (a temporary folder if None),
        #: next to links to the weight files and one file of quantized weights
        self.external = graph.external_dir is not None
        self.data_dir = Path(data_dir) if data_dir is not None else None
        self._store_obj: _ExternalStore | None = None
        self.rules = rules
        #: which int8 weights take 7 bits on this CPU (``RuntimeRules.seven_bit_weights``;
        #: see :func:`~qdq_optuna.model.calibration.cpu_saturates_u8s8`)
        self.seven_bit = (rules.seven_bit_weights if cpu_saturates_u8s8()
                          else SevenBitWeights.NONE)
        self.quant_type = check_quant_type(quant_type)
        self.scales = dict(scales or {})
        if not (default_scale > 0 and np.isfinite(default_scale)):
            raise OptionError(f"default_q_scale must be a positive number, got {default_scale}")
        self.default_scale = float(default_scale)
        if default_zero_point is not None:
            low, high = (0, 255) if self.quant_type == QuantType.UINT8 else (-128, 127)
            if self.quant_type == QuantType.FP8 and default_zero_point != 0:
                raise OptionError("default_q_zero_point must be 0 for fp8")
            if not low <= int(default_zero_point) <= high:
                raise OptionError(
                    f"default_q_zero_point {default_zero_point} is outside [{low}, {high}] "
                    f"for {self.quant_type}"
                )
        self.default_zero_point = default_zero_point
        graph.compact()  # before any copy of the model: those copy no weights then
        # generated names are the tensor's own name plus a suffix, made unique against every
        # tensor and node name of the model, so a plan always exports to the same bytes
        self._names: set[str] = (set(graph.producer) | graph.initializers | set(graph.graph_inputs)
                                 | {n.name for n in graph.nodes if n.name})
        self._act_cache: dict[tuple[str, str], tuple[str, bytes, bytes]] = {}
        self._weight_cache: dict[tuple[str, int | None, str], tuple[str, bytes, bytes, np.ndarray]] = {}
        self._bias_cache: dict[tuple, tuple[str, bytes, bytes]] = {}
        #: whole models exported to files (set by the exporter; the store keeps few of them)
        self.to_files = False

    # -- naming and cached pieces ---------------------------------------------------------------
    def _unique(self, base: str) -> str:
        name, k = base, 1
        while name in self._names:
            name, k = f"{base}_{k}", k + 1
        self._names.add(name)
        return name

    def activation_params(self, tensor: str, qtype: str) -> tuple[float, int]:
        # ``scales`` keys are a tensor name (for the exporter's own quant type) or a
        # (tensor, quant type) pair (mixed precision: one calibration per type)
        found = self._scale_entry(tensor, qtype)
        if found is None and self.high_precision is not None:
            source = self.high_precision.source_name(tensor)
            found = self._scale_entry(source, qtype) if source != tensor else None
        if found is not None:
            scale, zp = found
            return max(float(scale), MIN_SCALE), int(zp)
        if self.default_zero_point is not None and qtype != QuantType.FP8:
            return self.default_scale, int(self.default_zero_point)
        if qtype == QuantType.UINT8:
            # a non-negative tensor gets zero point 0, as calibration would give it; ONNX
            # Runtime then drops the Relu between a quantized Conv and its Q
            return self.default_scale, 0 if self._non_negative(tensor) else 128
        return self.default_scale, 0

    def _scale_entry(self, tensor: str, qtype: str) -> tuple[float, int] | None:
        found = self.scales.get((tensor, qtype))
        if found is None and qtype == self.quant_type:
            found = self.scales.get(tensor)
        return found

    def _non_negative(self, tensor: str) -> bool:
        op = self.graph.producer_op(tensor)
        if op in _NON_NEGATIVE:
            return True
        if op != "Clip":
            return False
        node = self.graph.nodes[self.graph.producer[tensor][0]]
        low = node.input[1] if len(node.input) > 1 else ""
        if low in self.graph.initializers:
            return float(np.min(self.graph.array(low))) >= 0
        return any(a.name == "min" and a.f >= 0 for a in node.attribute)

    def _scalar(self, name: str, value: float, elem_type: int) -> bytes:
        t = numpy_helper.from_array(scales_as(np.array(value, np.float32), elem_type), name)
        return wire_field(GRAPH_INITIALIZER, t.SerializeToString())

    def _zero_point(self, name: str, zp: int, qtype: str, shape: tuple = ()) -> bytes:
        if qtype == QuantType.FP8:
            t = helper.make_tensor(name, TensorProto.FLOAT8E4M3FN, list(shape), [0.0] * int(np.prod(shape or (1,))))
        else:
            dtype = np.uint8 if qtype == QuantType.UINT8 else np.int8
            t = numpy_helper.from_array(np.full(shape, zp, dtype=dtype), name)
        return wire_field(GRAPH_INITIALIZER, t.SerializeToString())

    def _activation(self, tensor: str, qtype: str) -> tuple[str, bytes, bytes]:
        """(dq output name, initializers bytes, Q+DQ node bytes) for one tensor, cached."""
        key = (tensor, qtype)
        if key not in self._act_cache:
            elem = self.graph.elem_types.get(tensor, TensorProto.FLOAT)
            scale, zp = self.activation_params(tensor, qtype)
            base = tensor
            s_name = self._unique(f"{base}_scale")
            z_name = self._unique(f"{base}_zero_point")
            q_out = self._unique(f"{base}_quantized")
            dq_out = self._unique(f"{base}_dequantized")
            inits = self._scalar(s_name, scale, elem) + self._zero_point(z_name, zp, qtype)
            q = helper.make_node("QuantizeLinear", [tensor, s_name, z_name], [q_out],
                                 name=self._unique(f"{base}_QuantizeLinear"))
            dq = helper.make_node("DequantizeLinear", [q_out, s_name, z_name], [dq_out],
                                  name=self._unique(f"{base}_DequantizeLinear"))
            nodes = wire_field(GRAPH_NODE, q.SerializeToString()) + wire_field(GRAPH_NODE, dq.SerializeToString())
            self._act_cache[key] = (dq_out, inits, nodes)
        return self._act_cache[key]

    def _weight_qmax(self, qtype: str, node: int) -> float | None:
        """7-bit int8 weights where the rules ask for them on a CPU whose u8 x s8 kernels
        saturate (all of them: ONNX Runtime's ``reduce_range``; the first layers: OpenVINO);
        the type's range everywhere else."""
        if qtype != QuantType.INT8 or self.seven_bit is SevenBitWeights.NONE:
            return None
        if self.seven_bit is SevenBitWeights.ALL or node in self._first_layers:
            return REDUCED_WEIGHT_QMAX
        return None

    @functools.cached_property
    def _first_layers(self) -> frozenset[int]:
        """The weighted ops that read a graph input through unweighted ops only."""
        graph = self.graph
        found: set[int] = set()
        seen: set[str] = set()
        todo = list(graph.graph_inputs)
        while todo:
            tensor = todo.pop()
            if tensor in seen:
                continue
            seen.add(tensor)
            for node, slot in graph.consumers.get(tensor, []):
                op = graph.nodes[node].op_type
                if op in WEIGHTED_OPS and slot in WEIGHTED_OPS[op].activation_slots:
                    found.add(node)
                    continue
                todo.extend(o for o in graph.nodes[node].output if o)
        return frozenset(found)

    def _weight(self, node: int, slot: int, qtype: str) -> tuple[str, bytes, bytes, np.ndarray]:
        graph = self.graph
        name = graph.nodes[node].input[slot]
        spec = WEIGHTED_OPS[graph.nodes[node].op_type]
        axis = None if graph.nodes[node].op_type in self.rules.per_tensor_weight_ops else spec.axis(graph, node)
        qmax = self._weight_qmax(qtype, node)
        key = (name, axis, qtype, qmax)
        if key not in self._weight_cache and self.external \
                and graph.initializer(name).data_location == TensorProto.EXTERNAL:
            self._weight_cache[key] = self._external_weight(name, axis, qtype, qmax)
        if key not in self._weight_cache:
            w = self._fp32_weight(name)
            elem = graph.elem_types.get(name, TensorProto.FLOAT)
            # scales in the weight's own type (the DQ's output type is its scale's), and the
            # integers from the FP32 values and those scales, so DQ gives back w within a step
            scales_lp = scales_as(weight_scales(w, axis, qtype, qmax), elem)
            scales = scales_lp.astype(np.float32)
            shape = [1] * w.ndim
            if axis is not None and w.ndim:
                shape[axis] = -1
            scaled = w / scales.reshape(shape) if axis is not None and w.ndim else w / scales
            base = name
            q_name = self._unique(f"{base}_quantized")
            s_name = self._unique(f"{base}_scale")
            z_name = self._unique(f"{base}_zero_point")
            dq_out = self._unique(f"{base}_dequantized")
            zshape = tuple(scales.shape)
            if qtype == QuantType.FP8:
                import ml_dtypes

                qw = np.clip(scaled, -448, 448).astype(ml_dtypes.float8_e4m3fn)
                qt = helper.make_tensor(q_name, TensorProto.FLOAT8E4M3FN, list(w.shape),
                                        qw.astype(np.float32).reshape(-1).tolist())
            else:
                qt = numpy_helper.from_array(np.clip(np.rint(scaled), -127, 127).astype(np.int8), q_name)
            st = numpy_helper.from_array(scales_lp, s_name)
            inits = (wire_field(GRAPH_INITIALIZER, qt.SerializeToString()) + wire_field(GRAPH_INITIALIZER, st.SerializeToString())
                     + self._zero_point(z_name, 0, "fp8" if qtype == QuantType.FP8 else "int8", zshape))
            attrs = {"axis": axis} if axis is not None and scales.ndim == 1 else {}
            dq = helper.make_node("DequantizeLinear", [q_name, s_name, z_name], [dq_out],
                                  name=self._unique(f"{base}_DequantizeLinear"), **attrs)
            self._weight_cache[key] = (dq_out, inits, wire_field(GRAPH_NODE, dq.SerializeToString()), scales)
        return self._weight_cache[key]

    def _fp32_weight(self, name: str) -> np.ndarray:
        """A weight's FP32 values: from the FP32 model when the graph was converted (never
        quantized from FP16-rounded values)."""
        if self.high_precision is not None:
            w = self.high_precision.fp32_weight(name)
            if w is not None:
                return w
        return self.graph.array(name).astype(np.float32)

    def _bias(self, node: int, act: str, act_qtype: str, w_scales: np.ndarray) -> tuple[str, bytes, bytes] | None:
        """int32 bias for runtimes whose kernel needs it (ONNX Runtime's QGemm); an FP16/BF16
        bias stays float (its int32 scale, input scale x weight scale, underflows them)."""
        graph = self.graph
        n = graph.nodes[node]
        if n.op_type not in self.rules.quantize_bias_ops or len(n.input) < 3 or not n.input[2]:
            return None
        bias = n.input[2]
        if bias not in graph.initializers or act_qtype == QuantType.FP8 \
                or graph.elem_types.get(bias) != TensorProto.FLOAT:
            return None
        a_scale, _ = self.activation_params(act, act_qtype)
        key = (bias, act, act_qtype)
        if key not in self._bias_cache:
            b = np.asarray(graph.array(bias)).astype(np.float64)
            if b.ndim != 1:
                return None
            scales = (a_scale * np.broadcast_to(w_scales, b.shape)).astype(np.float32)
            qb = np.clip(np.rint(b / scales), -(2**31), 2**31 - 1).astype(np.int32)
            base = bias
            q_name, s_name, z_name = (self._unique(f"{base}_{s}") for s in ("quantized", "scale", "zero_point"))
            dq_out = self._unique(f"{base}_dequantized")
            inits = b"".join(
                wire_field(GRAPH_INITIALIZER, numpy_helper.from_array(a, nm).SerializeToString())
                for a, nm in ((qb, q_name), (scales, s_name), (np.zeros(b.shape, np.int32), z_name))
            )
            dq = helper.make_node("DequantizeLinear", [q_name, s_name, z_name], [dq_out],
                                  name=self._unique(f"{base}_DequantizeLinear"), axis=0)
            self._bias_cache[key] = (dq_out, inits, wire_field(GRAPH_NODE, dq.SerializeToString()))
        return self._bias_cache[key]

    # -- external mode: quantized weights written once ---------------------------------------
    @property
    def work_folder(self) -> Path:
        return self._store().folder

    def _store(self) -> _ExternalStore:
        if self._store_obj is None:
            # whole models, in file mode: keep few of them on disk
            self._store_obj = _ExternalStore(self.graph, self.data_dir,
                                             keep=2 if self.to_files else None)
        return self._store_obj

    def _external_weight(self, name: str, axis: int | None, qtype: str,
                         qmax: float | None) -> tuple[str, bytes, bytes, np.ndarray]:
        """A weight that stays on disk: scales and quantized values computed in chunks of a
        memory map, the quantized values appended once to the work folder's weight file."""
        w = self.graph.array(name)
        scales = chunked_weight_scales(w, axis, qtype, qmax)
        q_name = self._unique(f"{name}_quantized")
        s_name = self._unique(f"{name}_scale")
        z_name = self._unique(f"{name}_zero_point")
        dq_out = self._unique(f"{name}_dequantized")
        offset, length = self._store().append(_quantized_chunks(w, scales, axis, qtype))
        qt = TensorProto()
        qt.name = q_name
        qt.data_type = TensorProto.FLOAT8E4M3FN if qtype == QuantType.FP8 else TensorProto.INT8
        qt.dims.extend(w.shape)
        _set_external(qt, _ExternalStore.WEIGHTS, offset, length)
        st = numpy_helper.from_array(scales.astype(np.float32), s_name)
        inits = (wire_field(GRAPH_INITIALIZER, qt.SerializeToString()) + wire_field(GRAPH_INITIALIZER, st.SerializeToString())
                 + self._zero_point(z_name, 0, "fp8" if qtype == QuantType.FP8 else "int8", tuple(scales.shape)))
        attrs = {"axis": axis} if axis is not None and scales.ndim == 1 else {}
        dq = helper.make_node("DequantizeLinear", [q_name, s_name, z_name], [dq_out],
                              name=self._unique(f"{name}_DequantizeLinear"), **attrs)
        return dq_out, inits, wire_field(GRAPH_NODE, dq.SerializeToString()), scales


class QDQExporter(_QDQPieces):
    """Builds Q/DQ models for one graph, one runtime's rules and one set of scales.

    ``scales`` maps an activation tensor name to ``(scale, zero_point)`` (calibrated statistics);
    tensors without an entry use ``default_scale`` and the quant type's default zero point.
    """

    def __init__(
        self,
        graph: Graph,
        rules: RuntimeRules,
        quant_type: str,
        *,
        scales: Mapping[str, tuple[float, int]] | None = None,
        default_scale: float = 0.1,
        default_zero_point: int | None = None,
        data_dir: str | os.PathLike | None = None,
        high_precision: HighPrecisionModel | None = None,
    ) -> None:
        super().__init__(graph, rules, quant_type, scales=scales, default_scale=default_scale,
                         default_zero_point=default_zero_point, data_dir=data_dir,
                         high_precision=high_precision)
        model = graph.model
        prefix = onnx.ModelProto()
        prefix.CopyFrom(model)
        prefix.ClearField("graph")
        if rules.weight_only_modes and MS_DOMAIN not in {o.domain for o in prefix.opset_import}:
            prefix.opset_import.append(onnx.helper.make_opsetid(MS_DOMAIN, 1))  # MatMulNBits
        self._prefix = prefix.SerializeToString()
        static = onnx.GraphProto()
        static.CopyFrom(model.graph)
        static.ClearField("node")
        static.ClearField("initializer")
        self._static = static.SerializeToString()
        #: each initializer serialized once, by the graph (shared with its other exporters); a
        #: float weight that Q/DQ replaced everywhere is left out of the exported bytes
        self._init_bytes = {t.name: graph.init_fields[t.name] for t in model.graph.initializer}
        #: a big in-memory model is exported to files, written piece by piece, instead of bytes:
        #: the weights stay in memory once (see :func:`file_export_bytes`)
        limit = file_export_bytes()
        self.to_files = not self.external and limit is not None and \
            sum(map(len, self._init_bytes.values())) >= limit
        self._listed_inputs = {i.name for i in model.graph.input}
        self._node_bytes = [wire_field(GRAPH_NODE, n.SerializeToString()) for n in graph.nodes]
        self._recent: dict[str, bytes] = {}
        #: per-tensor planning results and rewired node bytes, by their inputs: trials of one
        #: pattern differ from each other in a few tensors, and the committed ones repeat
        self._tensor_plans: dict[tuple, tuple[list, list]] = {}
        self._rewired: dict[tuple, bytes] = {}

    # -- planning ----------------------------------------------------------------------------
    def plan(self, uses: Iterable[Use] | Mapping[Use, str]) -> QuantPlan:
        """Merge covered uses into per-tensor Q/DQ, apply promotions, add weights."""
        typed = dict(uses) if isinstance(uses, Mapping) else dict.fromkeys(uses, self.quant_type)
        dynamic = _one_mode_per_node(u for u, q in typed.items()
                                     if use_mode(u) is not None and q not in _OFF)
        dyn_nodes = {n for _, n, _ in dynamic}
        by_tensor: dict[str, dict[tuple[int, int], str]] = {}
        for (t, n, s), q in typed.items():
            if q in _OFF or n in dyn_nodes:  # a dynamic node takes no Q/DQ
                continue
            by_tensor.setdefault(t, {})[(n, s)] = q
        activations = []
        weights: dict[tuple[int, int], str] = {}
        memo = self._tensor_plans
        if len(memo) > _MEMO_PER_NODE * len(self.graph.nodes) + 1000:
            memo.clear()
        for t in sorted(by_tensor):
            key = (t, tuple(sorted(by_tensor[t].items())))
            found = memo.get(key)
            if found is None:
                found = memo[key] = self._plan_tensor(t, by_tensor[t])
            activations.extend(found[0])
            weights.update(found[1])
        if dyn_nodes:  # a promotion may have covered a dynamic node's input again
            activations = [(t, cs, q) for t, cs, q in (
                (t, tuple(c for c in cs if c[0] not in dyn_nodes), q) for t, cs, q in activations)
                if cs]
            weights = {k: q for k, q in weights.items() if k[0] not in dyn_nodes}
        weights.update(constant_operands(self.graph, self.rules, activations))
        weights.update(preserved_weights(self.graph, self.rules, activations, weights))
        return QuantPlan(
            activations=tuple(activations),
            weights=tuple(sorted((n, s, q) for (n, s), q in weights.items()
                                 if n not in dyn_nodes)),
            dynamic=tuple(dynamic),
        )

    def _plan_tensor(self, t: str, covered: dict[tuple[int, int], str]) -> tuple[list, list]:
        """One tensor's Q/DQ pairs and the weights that come with them (see :meth:`plan`)."""
        graph = self.graph
        covered = dict(sorted(covered.items()))  # the memo's key order
        activations: list = []
        weights: list = []
        qtypes = sorted(set(covered.values()))
        qtype = qtypes[0] if len(qtypes) == 1 else max(qtypes, key=list(covered.values()).count)
        uncovered = [c for c in graph.consumers.get(t, []) if c not in covered]
        for promote in self.rules.promotions:
            if promote(graph, t, uncovered):
                covered.update(dict.fromkeys(uncovered, qtype))
                break
        # one Q/DQ pair per (tensor, type): mixed precision keeps every use's chosen type
        for q in sorted(set(covered.values())):
            activations.append((t, tuple(sorted(c for c, v in covered.items() if v == q)), q))
        for (n, s), use_q in covered.items():
            spec = WEIGHTED_OPS.get(graph.nodes[n].op_type) if n != GRAPH_OUTPUT else None
            if spec is None or s not in spec.activation_slots:
                continue
            inputs = graph.nodes[n].input
            if len(inputs) > spec.weight_slot and graph.is_constant(inputs[spec.weight_slot]) \
                    and inputs[spec.weight_slot] in graph.initializers \
                    and graph.is_float(inputs[spec.weight_slot]):
                wq = "fp8" if use_q == QuantType.FP8 else "int8"
                weights.append(((n, spec.weight_slot), wq))
        return activations, weights

    # -- export --------------------------------------------------------------------------------
    def to_bytes(self, plan: QuantPlan) -> bytes:
        # the same plan is exported again for references and confirmations: keep the last one
        cached = self._recent.get(plan.key)
        if cached is not None:
            return cached
        self._recent.clear()  # the last model goes before the next exists: peak memory
        data = self._serialize(plan)
        self._recent[plan.key] = data
        return data

    def _serialize(self, plan: QuantPlan) -> bytes:
        return b"".join(self._parts(plan))

    def _parts(self, plan: QuantPlan) -> list[bytes]:
        """The exported model's bytes in pieces (mostly shared, cached ones) to concatenate
        or to write out one after the other."""
        graph = self.graph
        inits: list[bytes] = []
        head: list[bytes] = []
        after: dict[int, list[bytes]] = {}
        act_of: dict[int, tuple[str, str]] = {}
        renamed, rewire = _output_rewiring(self, plan)
        for tensor, consumers, qtype in plan.activations:
            dq_out, i_bytes, n_bytes = _activation_pair(self, tensor, qtype, consumers, renamed)
            inits.append(i_bytes)
            prod = graph.producer.get(tensor)
            (after.setdefault(prod[0], []) if prod else head).append(n_bytes)
            for n, s in (c for c in consumers if c[0] != GRAPH_OUTPUT):  # the DQ writes those
                rewire.setdefault(n, {})[s] = dq_out
                act_of.setdefault(n, (tensor, qtype))
        done_weights: set[str] = set()
        for n, s, qtype in plan.weights:
            dq_out, i_bytes, n_bytes, scales = _quantized_input(self, n, s, qtype)
            if dq_out not in done_weights:
                done_weights.add(dq_out)
                inits.append(i_bytes)
                head.append(n_bytes)
            rewire.setdefault(n, {})[s] = dq_out
            if n in act_of:
                bias = self._bias(n, act_of[n][0], act_of[n][1], scales)
                if bias is not None:
                    b_out, b_init, b_node = bias
                    if b_out not in done_weights:
                        done_weights.add(b_out)
                        inits.append(b_init)
                        head.append(b_node)
                    rewire[n][2] = b_out
        dynamic = self._dynamic_parts(plan, rewire)
        replaced = {graph.nodes[n].input[s] for n, rw in rewire.items() for s in rw if s >= 0}
        replaced |= {graph.nodes[n].input[1] for n in dynamic}
        kept = [
            b for name, b in self._init_bytes.items()
            if name not in replaced or name in self._listed_inputs
            or any(n not in dynamic and rewire.get(n, {}).get(s) is None
                   for n, s in graph.consumers.get(name, []))
        ]
        for i_bytes, _ in dynamic.values():
            inits.append(i_bytes)
        body: list[bytes] = []
        rewired = self._rewired
        if len(rewired) > _MEMO_PER_NODE * len(self.graph.nodes) + 1000:
            rewired.clear()
        for idx, cached in enumerate(self._node_bytes):
            if idx in dynamic:
                body.append(dynamic[idx][1])
            elif idx in rewire:
                key = (idx, tuple(sorted(rewire[idx].items())))
                node_bytes = rewired.get(key)
                if node_bytes is None:
                    node = onnx.NodeProto()
                    node.CopyFrom(graph.nodes[idx])
                    for s, name in rewire[idx].items():  # s < 0: output -1 - s renamed
                        (node.input if s >= 0 else node.output)[s if s >= 0 else -1 - s] = name
                    node_bytes = rewired[key] = wire_field(GRAPH_NODE, node.SerializeToString())
                body.append(node_bytes)
            else:
                body.append(cached)
            if idx in after:
                body.extend(after[idx])
        parts = [self._static, *kept, *inits, *head, *body]
        payload_len = sum(map(len, parts))
        return [self._prefix, bytes([MODEL_GRAPH]), varint(payload_len), *parts]

    def _dynamic_parts(self, plan: QuantPlan, rewire: dict[int, dict[int, str]]
                       ) -> dict[int, tuple[bytes, bytes]]:
        """Node -> (initializers, nodes) that write it in its mode (dynamic, weight-only);
        its output renamed where :func:`_output_rewiring` renamed it (a graph output
        carrying Q/DQ)."""
        cache = self.__dict__.setdefault("_dynamic_cache", {})
        found = {}
        for use in plan.dynamic:
            n, mode = use[1], use_mode(use)
            renames = rewire.pop(n, {})
            key = (n, renames.get(0), renames.get(-1), mode)
            if key not in cache:
                weight = self._fp32_weight(self.graph.nodes[n].input[1])
                if mode is QuantMode.DYNAMIC:
                    qmax = self._weight_qmax(QuantType.INT8, n) or QMAX["int8"]
                    cache[key] = dynamic_node(self.graph, n, self._unique, weight, qmax,
                                              source=key[1], output=key[2])
                else:
                    cache[key] = weight_only_node(self.graph, n, self._unique, weight,
                                                  mode.bits, source=key[1], output=key[2])
            found[n] = cache[key]
        return found

    def to_model(self, plan: QuantPlan) -> onnx.ModelProto:
        """The exported model as a ``ModelProto`` (for saving and for user callables). In
        external mode its big tensors reference files in :attr:`work_folder`."""
        return onnx.load_from_string(self.to_bytes(plan))

    def source(self, plan: QuantPlan) -> bytes | ExportedModel:
        """What a backend measures: the model bytes, or in external mode and for big models
        (:attr:`to_files`) a path (a file in the work folder, written piece by piece when a
        backend opens it)."""
        return ExportedModel(self, plan) if self.external or self.to_files \
            else self.to_bytes(plan)

    def save(self, plan: QuantPlan, path: str | os.PathLike) -> Path:
        if self.external:
            return self._save_external(plan, Path(path))
        if self.to_files:  # written piece by piece, checked from the file, then moved in place
            path = Path(path)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            try:
                with open(tmp, "wb") as fh:
                    fh.writelines(self._parts(plan))
                    fh.flush()
                    os.fsync(fh.fileno())
                onnx.checker.check_model(str(tmp))
                os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)
            return path
        model = self.to_model(plan)
        onnx.checker.check_model(model)
        return atomic_write_bytes(path, model.SerializeToString())

    # -- external mode -----------------------------------------------------------------------
    def materialize(self, plan: QuantPlan) -> Path:
        """The exported model as a file in the work folder (external mode, big models)."""
        return self._store().model_file(plan.key, lambda: self._parts(plan))

    def _save_external(self, plan: QuantPlan, path: Path) -> Path:
        """``path`` and one data file beside it (``<name>.<id>.data``) with every tensor the
        model keeps outside: the float weights it still uses, copied from the input's files,
        and its quantized weights. A self-contained model that ``onnx.load`` and ONNX Runtime
        open. The data file is complete before ``path`` is (atomically) replaced, then older
        data files are removed, so a kill at any moment leaves a loadable pair."""
        store = self._store()
        model = self.to_model(plan)
        name = f"{path.name}.{uuid.uuid4().hex[:8]}.data"
        tmp = path.parent / f".{name}.pid{os.getpid()}.tmp"
        path.parent.mkdir(parents=True, exist_ok=True)
        store.flush()
        try:
            with open(tmp, "wb") as out:
                for t in model.graph.initializer:
                    if t.data_location != TensorProto.EXTERNAL:
                        continue
                    info = {e.key: e.value for e in t.external_data}
                    location = info["location"]
                    src = store.folder / location if location == _ExternalStore.WEIGHTS \
                        else self.graph.external_dir / location
                    offset = out.seek(0, os.SEEK_END)
                    offset += -offset % _ExternalStore.ALIGN
                    out.seek(offset)
                    length = int(info.get("length") or 0)
                    _copy_range(src, int(info.get("offset") or 0), length, out)
                    _set_external(t, name, offset, length)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, path.parent / name)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        atomic_write_bytes(path, model.SerializeToString())
        onnx.checker.check_model(str(path))  # with its external data file
        for old in path.parent.glob(f"{path.name}.*.data"):
            if old.name != name:
                old.unlink(missing_ok=True)
        return path


class ExportedModel(os.PathLike):
    """An export of a model in external mode, as the path of a file that backends load with
    its external data. The file is written (again, if it was evicted) when a backend asks for
    the path, so holding one costs nothing."""

    def __init__(self, exporter: QDQExporter, plan: QuantPlan) -> None:
        self.exporter = exporter
        self.plan = plan

    def __fspath__(self) -> str:
        return str(self.exporter.materialize(self.plan))

    def __repr__(self) -> str:
        return f"ExportedModel({self.plan.key})"


# -- what ONNX Runtime's recipe quantizes besides activations and weights ---------------------
def constant_operands(graph: Graph, rules: RuntimeRules,
                      activations: Iterable[tuple[str, tuple[tuple[int, int], ...], str]]
                      ) -> dict[tuple[int, int], str]:
    """(node, slot) -> quant type of the constant float inputs that come with a plan's
    activations: those of ``rules.constant_operand_ops`` nodes (a bias Add, a scale Mul, a
    Concat of a constant) whose every float activation input carries Q/DQ. They take the
    activation's type, as ``quantize_static`` gives them, so the op runs as one kernel."""
    if not rules.constant_operand_ops and not rules.table_ops:
        return {}
    activations = list(activations)
    covered = {c: q for _, consumers, q in activations for c in consumers}
    out = _tables(graph, rules, activations)
    for n in sorted({n for n, _ in covered if n != GRAPH_OUTPUT}):
        node = graph.nodes[n]
        if node.op_type not in rules.constant_operand_ops:
            continue
        acts = [s for s, t in enumerate(node.input) if graph.is_activation(t)]
        qtype = covered.get((n, acts[0])) if acts else None
        if qtype not in (QuantType.UINT8, QuantType.INT8) or any(covered.get((n, s)) != qtype for s in acts):
            continue
        for s, t in enumerate(node.input):
            if t in graph.initializers and graph.elem_types.get(t) == TensorProto.FLOAT:
                out[(n, s)] = qtype
    return out


def preserved_weights(graph: Graph, rules: RuntimeRules,
                      activations: Iterable[tuple[str, tuple[tuple[int, int], ...], str]],
                      weights: Mapping[tuple[int, int], str]) -> dict[tuple[int, int], str]:
    """(node, weight slot) -> "int8" for the weighted ops that read a quantized tensor through
    ``rules.precision_preserving_ops`` only (a Conv after a MaxPool of a Q/DQ'd Relu): the
    runtime keeps the data integer through those ops, so the op runs integer once its weights
    are quantized too (as NNCF quantizes every Conv's weights)."""
    if not rules.precision_preserving_ops:
        return {}
    covered = {c for _, consumers, _ in activations for c in consumers}
    memo: dict[str, bool] = {}

    def integer(tensor: str, depth: int = 0) -> bool:
        """Whether ``tensor`` reaches its readers integer (its producer reads quantized data
        and preserves it)."""
        if tensor in memo:
            return memo[tensor]
        memo[tensor] = False  # cycles and deep chains: not integer
        prod = graph.producer.get(tensor)
        if prod is None or depth > 64:
            return False
        node = graph.nodes[prod[0]]
        if node.op_type not in rules.precision_preserving_ops:
            return False
        acts = [s for s, t in enumerate(node.input) if graph.is_activation(t)]
        memo[tensor] = bool(acts) and all(
            (prod[0], s) in covered or integer(node.input[s], depth + 1) for s in acts)
        return memo[tensor]

    out: dict[tuple[int, int], str] = {}
    for n, node in enumerate(graph.nodes):
        spec = WEIGHTED_OPS.get(node.op_type)
        if spec is None or len(node.input) <= spec.weight_slot \
                or (n, spec.weight_slot) in weights:
            continue
        w = node.input[spec.weight_slot]
        if not (graph.is_constant(w) and w in graph.initializers and graph.is_float(w)):
            continue
        slots = [s for s in spec.activation_slots if s < len(node.input)]
        if slots and all((n, s) not in covered and integer(node.input[s]) for s in slots):
            out[(n, spec.weight_slot)] = "int8"
    return out


def _tables(graph: Graph, rules: RuntimeRules,
            activations: list[tuple[str, tuple[tuple[int, int], ...], str]]
            ) -> dict[tuple[int, int], str]:
    """(node, 0) -> quant type of the constant tables of ``rules.table_ops`` nodes whose
    output has one Q/DQ pair that every reader (graph outputs included) reads."""
    pairs: dict[str, list] = {}
    for t, consumers, q in activations:
        pairs.setdefault(t, []).append((set(consumers), q))
    out: dict[tuple[int, int], str] = {}
    for t, found in pairs.items():
        producer = graph.producer.get(t)
        if producer is None or len(found) != 1 or found[0][1] not in (QuantType.UINT8, QuantType.INT8):
            continue
        node = graph.nodes[producer[0]]
        table = node.input[0] if node.input else ""
        if node.op_type not in rules.table_ops or table not in graph.initializers \
                or graph.elem_types.get(table) != TensorProto.FLOAT:
            continue
        readers = {(n, s) for _, n, s in graph.uses(t) + graph.output_uses(t)}
        if readers == found[0][0]:
            out[(producer[0], 0)] = found[0][1]
    return out


def _quantized_input(exporter: QDQExporter, node: int, slot: int,
                     qtype: str) -> tuple[str, bytes, bytes, np.ndarray]:
    """A plan's weight entry: a weighted op's weight, a table or a constant operand."""
    n = exporter.graph.nodes[node]
    spec = WEIGHTED_OPS.get(n.op_type)
    if spec is not None and slot == spec.weight_slot:
        return exporter._weight(node, slot, qtype)
    if n.op_type in exporter.rules.table_ops and slot == 0:
        return _constant_operand(exporter, n.input[0], qtype,
                                 exporter.activation_params(n.output[0], qtype))
    return _constant_operand(exporter, n.input[slot], qtype)


def _constant_operand(exporter: QDQExporter, name: str, qtype: str,
                      params: tuple[float, int] | None = None
                      ) -> tuple[str, bytes, bytes, np.ndarray]:
    """A constant quantized as ``quantize_static`` quantizes an elementwise op's initializer:
    per tensor, asymmetric over [min(x, 0), max(x, 0)], in the activation type (its own
    ``quant_utils``, so the integers are the recipe's), behind one DequantizeLinear; or with
    the given ``params`` (scale, zero point: a table takes its output's)."""
    from onnxruntime.quantization.quant_utils import compute_data_quant_params, quantize_nparray

    key = (name, params or "asymmetric", qtype)  # beside the weights (keyed by an axis there)
    cache = exporter._weight_cache
    if key not in cache:
        w = exporter._fp32_weight(name)
        onnx_type = TensorProto.UINT8 if qtype == QuantType.UINT8 else TensorProto.INT8
        if params is None:
            zero_point, scale = compute_data_quant_params(w.reshape(-1), onnx_type, False)
        else:
            scale = np.float32(params[0])
            zero_point = np.array(params[1], helper.tensor_dtype_to_np_dtype(onnx_type))
        q = numpy_helper.from_array(np.asarray(quantize_nparray(onnx_type, w, scale, zero_point)),
                                    exporter._unique(f"{name}_quantized"))
        s_name, z_name = exporter._unique(f"{name}_scale"), exporter._unique(f"{name}_zero_point")
        dq_out = exporter._unique(f"{name}_dequantized")
        inits = (wire_field(GRAPH_INITIALIZER, q.SerializeToString())
                 + exporter._scalar(s_name, float(scale), TensorProto.FLOAT)
                 + exporter._zero_point(z_name, int(zero_point), qtype))
        dq = helper.make_node("DequantizeLinear", [q.name, s_name, z_name], [dq_out],
                              name=exporter._unique(f"{name}_DequantizeLinear"))
        cache[key] = (dq_out, inits, wire_field(GRAPH_NODE, dq.SerializeToString()),
                      np.asarray(scale, np.float32))
    return cache[key]


def _output_rewiring(exporter: QDQExporter, plan: QuantPlan
                     ) -> tuple[dict[str, str], dict[int, dict[int, str]]]:
    """Graph outputs keep their names: where a plan quantizes one, the node that wrote it
    writes a new name, which the Q and every reader left float read, and the DQ writes the
    output's name. Returns tensor -> new name, and node -> {input slot: new name, -1 - output
    slot: new name} (the renames to apply)."""
    graph = exporter.graph
    names = exporter.__dict__.setdefault("_float_names", {})
    renamed: dict[str, str] = {}
    rewire: dict[int, dict[int, str]] = {}
    for tensor, consumers, _ in plan.activations:
        if tensor in renamed or tensor not in graph.producer \
                or not any(n == GRAPH_OUTPUT for n, _ in consumers):
            continue
        if tensor not in names:
            names[tensor] = exporter._unique(f"{tensor}_float")
        renamed[tensor] = new = names[tensor]
        node, out_slot = graph.producer[tensor]
        rewire.setdefault(node, {})[-1 - out_slot] = new
        covered = {c for t, cs, _ in plan.activations if t == tensor for c in cs}
        for n, s in graph.consumers.get(tensor, []):
            if (n, s) not in covered:
                rewire.setdefault(n, {})[s] = new
    return renamed, rewire


def _activation_pair(exporter: QDQExporter, tensor: str, qtype: str,
                     consumers: tuple[tuple[int, int], ...],
                     renamed: Mapping[str, str]) -> tuple[str, bytes, bytes]:
    """(dq output, initializers, Q+DQ nodes) of one activation pair. On a renamed tensor (see
    :func:`_output_rewiring`) the Q reads the new name; the pair that holds the graph output
    writes the tensor's own name, another pair (mixed types) a new one."""
    if tensor not in renamed:
        return exporter._activation(tensor, qtype)
    source = renamed[tensor]
    owner = any(n == GRAPH_OUTPUT for n, _ in consumers)
    cache = exporter.__dict__.setdefault("_output_pairs", {})
    key = (tensor, qtype, owner)
    if key not in cache:
        elem = exporter.graph.elem_types.get(tensor, TensorProto.FLOAT)
        scale, zp = exporter.activation_params(tensor, qtype)
        s_name, z_name = exporter._unique(f"{tensor}_scale"), exporter._unique(f"{tensor}_zero_point")
        q_out = exporter._unique(f"{tensor}_quantized")
        dq_out = tensor if owner else exporter._unique(f"{tensor}_dequantized")
        q = helper.make_node("QuantizeLinear", [source, s_name, z_name], [q_out],
                             name=exporter._unique(f"{tensor}_QuantizeLinear"))
        dq = helper.make_node("DequantizeLinear", [q_out, s_name, z_name], [dq_out],
                              name=exporter._unique(f"{tensor}_DequantizeLinear"))
        cache[key] = (dq_out, exporter._scalar(s_name, scale, elem) + exporter._zero_point(z_name, zp, qtype),
                      wire_field(GRAPH_NODE, q.SerializeToString()) + wire_field(GRAPH_NODE, dq.SerializeToString()))
    return cache[key]


log = logging.getLogger("qdq_optuna")
#: weights are read and quantized in slices of about this many bytes
_CHUNK_BYTES = 64 << 20
_WORK_IDS = itertools.count()


class _ExternalStore:
    """The work folder of one exporter in external mode (``.qdq_work.pidN.K.tmp``).

    It holds the exported models, the quantized weights (``qdq_weights.bin``, each written
    once) and ``external_sources.json``: where the input's weight files are, which the models
    reference under their own relative locations. Nothing is linked or copied (ONNX and ONNX
    Runtime refuse symlinks, and ``onnx.load`` refuses files with several hard links, so a link
    would break the input model itself): the ONNX Runtime backend maps those files into memory
    for its sessions, and the cost model reads no weights. The folder is removed when the
    exporter goes away; a killed process's folder by the next run (:func:`remove_stale_temps`)."""

    WEIGHTS = WORK_WEIGHTS
    SOURCES = WORK_SOURCES
    #: quantized tensors start at multiples of this (memory-mapping loaders want pages)
    ALIGN = 4096
    #: exported model files kept at once (older ones are written again when needed)
    KEEP = 16

    def __init__(self, graph: Graph, data_dir: Path | None, keep: int | None = None) -> None:
        if keep is not None:
            self.KEEP = keep
        if data_dir is None:
            data_dir = Path(tempfile.mkdtemp(prefix="qdq-optuna-"))
            self._finalizer = weakref.finalize(self, shutil.rmtree, str(data_dir), True)
        else:
            data_dir.mkdir(parents=True, exist_ok=True)
        self.folder = data_dir / f".qdq_work.pid{os.getpid()}.{next(_WORK_IDS)}.tmp"
        self.folder.mkdir()
        self._cleanup = weakref.finalize(self, shutil.rmtree, str(self.folder), True)
        sources = {}
        for t in graph.model.graph.initializer:
            if t.data_location == TensorProto.EXTERNAL:
                location = next(e.value for e in t.external_data if e.key == "location")
                sources[location] = str((graph.external_dir / location).resolve())
        (self.folder / self.SOURCES).write_text(json.dumps(sources, indent=1))
        self._fh = open(self.folder / self.WEIGHTS, "ab")  # noqa: SIM115 - closed by finalize
        weakref.finalize(self, self._fh.close)
        self._models: dict[str, Path] = {}

    def append(self, chunks: Iterable[bytes]) -> tuple[int, int]:
        """Append one tensor's bytes; (offset, length) in :attr:`WEIGHTS`."""
        fh = self._fh
        fh.seek(0, os.SEEK_END)
        offset = fh.tell()
        pad = -offset % self.ALIGN
        if pad:
            fh.write(b"\0" * pad)
            offset += pad
        length = 0
        for chunk in chunks:
            fh.write(chunk)
            length += len(chunk)
        return offset, length

    def flush(self) -> None:
        self._fh.flush()
        os.fsync(self._fh.fileno())

    def model_file(self, key: str, data) -> Path:
        path = self._models.get(key)
        if path is None or not path.exists():
            self._fh.flush()  # the weights it references are readable before it is
            path = self.folder / f"model-{key}.onnx"
            tmp = path.with_suffix(".part")
            with open(tmp, "wb") as fh:
                fh.writelines(data())
            os.replace(tmp, path)
            self._models.pop(key, None)
            self._models[key] = path
            while len(self._models) > self.KEEP:
                old = self._models.pop(next(iter(self._models)))
                old.unlink(missing_ok=True)
        return path


def _copy_range(src: Path, offset: int, length: int, out) -> None:
    """Copy ``length`` bytes of ``src`` from ``offset`` to ``out`` at its position, leaving
    holes where the data is zeros (sparse files stay sparse)."""
    end = out.tell() + length
    with open(src, "rb") as fin:
        fin.seek(offset)
        left = length
        while left:
            block = fin.read(min(left, 16 << 20))
            if not block:
                raise OSError(f"{src}: ends before byte {offset + length}")
            left -= len(block)
            if np.frombuffer(block, np.uint8).any():
                out.write(block)
            else:
                out.seek(len(block), os.SEEK_CUR)
    out.seek(end)
    if out.seek(0, os.SEEK_END) < end:
        out.truncate(end)
    out.seek(end)


def _set_external(tensor: TensorProto, location: str, offset: int, length: int) -> None:
    tensor.data_location = TensorProto.EXTERNAL
    del tensor.external_data[:]
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value


def _row_chunks(w: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    """(first row, float32 slice) of ``w`` along axis 0, about :data:`_CHUNK_BYTES` each."""
    if w.ndim == 0:
        yield 0, np.asarray(w, dtype=np.float32)
        return
    row_bytes = max(1, w.nbytes // max(1, w.shape[0]))
    step = max(1, _CHUNK_BYTES // row_bytes)
    path = getattr(w, "filename", None) if isinstance(w, np.memmap) else None
    if path is None or not w.flags.c_contiguous:
        for start in range(0, w.shape[0], step):
            yield start, np.asarray(w[start:start + step], dtype=np.float32)
        return
    # a weight on disk: read slice by slice (touching a memory map would keep every page of
    # the weight resident until it is unmapped)
    row_items = int(np.prod(w.shape[1:], dtype=np.int64))
    with open(path, "rb") as fh:
        for start in range(0, w.shape[0], step):
            rows = min(step, w.shape[0] - start)
            fh.seek(w.offset + start * row_bytes)
            chunk = np.fromfile(fh, dtype=w.dtype, count=rows * row_items)
            yield start, chunk.reshape((rows, *w.shape[1:])).astype(np.float32, copy=False)


def chunked_weight_scales(w: np.ndarray, axis: int | None, qtype: str,
                          qmax: float | None = None) -> np.ndarray:
    """:func:`weight_scales` of a (memory-mapped) weight, read slice by slice: the same
    values, without holding the weight, its absolute values and its quotient at once."""
    qmax = qmax or QMAX["fp8" if qtype == QuantType.FP8 else "int8"]
    if axis is None or w.ndim == 0:
        amax = 0.0
        for _, c in _row_chunks(w):
            amax = max(amax, float(np.abs(c).max(initial=0.0)))
        return np.array(max(amax / qmax, MIN_SCALE), dtype=np.float32)
    reduce = tuple(i for i in range(w.ndim) if i != axis)
    parts = [np.abs(c).max(axis=reduce, initial=0.0) if reduce else np.abs(c)
             for _, c in _row_chunks(w)]
    if axis == 0:
        amax = np.concatenate(parts)
    else:
        amax = parts[0]
        for part in parts[1:]:
            amax = np.maximum(amax, part)
    return np.maximum(amax / qmax, MIN_SCALE).astype(np.float32)


def _quantized_chunks(w: np.ndarray, scales: np.ndarray, axis: int | None,
                      qtype: str) -> Iterator[bytes]:
    """The quantized weight's bytes (C order), slice by slice (as the in-memory export)."""
    shape = [1] * w.ndim
    if axis is not None and w.ndim:
        shape[axis] = -1
    for start, c in _row_chunks(w):
        if axis is not None and w.ndim:
            s = scales.reshape(shape)
            if axis == 0:
                s = s[start:start + c.shape[0]]
            scaled = c / s
        else:
            scaled = c / scales
        if qtype == QuantType.FP8:
            import ml_dtypes

            yield np.clip(scaled, -448, 448).astype(ml_dtypes.float8_e4m3fn).tobytes()
        else:
            yield np.clip(np.rint(scaled), -127, 127).astype(np.int8).tobytes()


#: smallest normal number of the low-precision scale types: no scale is subnormal or zero
_SMALLEST_NORMAL = {TensorProto.FLOAT16: 2.0**-14, TensorProto.BFLOAT16: 2.0**-126}


def scales_as(scales: np.ndarray, elem_type: int) -> np.ndarray:
    """FP32 scales in the graph's float type (a DQ outputs its scale's type): FP16/BF16 ones
    are rounded up, so ``amax / scale`` never leaves the quantized range, and held at the
    type's smallest normal number or above."""
    scales = np.asarray(scales, np.float32)
    floor = _SMALLEST_NORMAL.get(elem_type)
    if floor is None:
        return scales
    dtype = helper.tensor_dtype_to_np_dtype(elem_type)
    want = np.maximum(scales, np.float32(floor))
    low = np.atleast_1d(want.astype(dtype))
    below = np.atleast_1d(low.astype(np.float32) < want)
    if below.any():  # positive floats order like their bit patterns: one ulp up is bits + 1
        bits = low.view(np.uint16)
        bits[below] += 1
    return low.reshape(scales.shape)


def weight_scales(w: np.ndarray, axis: int | None, qtype: str,
                  qmax: float | None = None) -> np.ndarray:
    """Symmetric max-abs scales, per channel along ``axis`` (or one per tensor); ``qmax``: the
    largest integer the weight may take (default the type's: 127 for int8)."""
    qmax = qmax or QMAX["fp8" if qtype == QuantType.FP8 else "int8"]
    if axis is None or w.ndim == 0:
        return np.array(max(float(np.abs(w).max(initial=0.0)) / qmax, MIN_SCALE), dtype=np.float32)
    reduce = tuple(i for i in range(w.ndim) if i != axis)
    amax = np.abs(w).max(axis=reduce, initial=0.0) if reduce else np.abs(w)
    return np.maximum(amax / qmax, MIN_SCALE).astype(np.float32)


def quantized_tensors(model: onnx.ModelProto) -> set[str]:
    """Float tensors that feed a QuantizeLinear (activations carrying Q/DQ in ``model``); a
    quantized graph output by its own name (its producer writes another: its DQ writes it)."""
    qs = [n for n in model.graph.node if n.op_type == "QuantizeLinear"]
    return {graph_output_names(model).get(n.input[0], n.input[0]) for n in qs}


def graph_output_names(model: onnx.ModelProto) -> dict[str, str]:
    """The float tensor a Q reads -> the graph output its DQ writes, for quantized graph
    outputs (the exporter renames the tensor behind them, see :func:`_output_rewiring`)."""
    outputs = {o.name for o in model.graph.output}
    written = {n.input[0]: n.output[0] for n in model.graph.node
               if n.op_type == "DequantizeLinear" and n.output[0] in outputs}
    return {n.input[0]: written[n.output[0]] for n in model.graph.node
            if n.op_type == "QuantizeLinear" and n.output[0] in written}


def dequantized_weights(model: onnx.ModelProto) -> set[str]:
    """Constant inputs of DequantizeLinear (quantized weights and biases)."""
    inits = {t.name for t in model.graph.initializer}
    return {n.input[0] for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in inits}
