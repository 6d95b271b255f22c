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

import hashlib
import json
import os
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .errors import OptionError
from .graph import Graph, Use, ensure_opset, opset_of
from .insertion.rules import WEIGHTED_OPS, RuntimeRules

QUANT_TYPES = ("int8", "uint8", "fp8")
_QTYPE_PROTO = {
    "int8": TensorProto.INT8,
    "uint8": TensorProto.UINT8,
    "fp8": TensorProto.FLOAT8E4M3FN,
}
_QMAX = {"int8": 127.0, "uint8": 255.0, "fp8": 448.0}
_MIN_SCALE = 1e-8
_RECENT_EXPORTS = 3
_NON_NEGATIVE = frozenset({"Relu", "Sigmoid", "Softmax", "HardSigmoid"})


def check_quant_type(name: str) -> str:
    if name not in QUANT_TYPES:
        raise OptionError(f"--quant-type: unknown {name!r} (choose from {', '.join(QUANT_TYPES)})")
    return name


def required_opset(graph: Graph, quant_types: Iterable[str]) -> int:
    """Per-channel weights need opset 13; FP8 and FP16/BF16 scales need 19."""
    need = 13
    if "fp8" in set(quant_types):
        need = 19
    if any(
        graph.elem_types.get(t) in (TensorProto.FLOAT16, TensorProto.BFLOAT16)
        for t in graph.elem_types
    ):
        need = 19
    return need


def upgrade_for(graph: Graph, quant_types: Iterable[str]) -> Graph:
    """The graph at the opset its Q/DQ need (onnx's version converter), never an invalid model."""
    need = required_opset(graph, quant_types)
    if opset_of(graph.model) >= need:
        return graph
    model = ensure_opset(graph.model, need, "this quantization")
    model = onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
    return Graph.from_model(model, graph.path)


@dataclass(frozen=True)
class QuantPlan:
    """Which tensors carry Q/DQ, for which consumers, of which type; and which weights."""

    #: (tensor, ((consumer node, slot), ...), quant type), sorted
    activations: tuple[tuple[str, tuple[tuple[int, int], ...], str], ...]
    #: (consumer node, weight slot, quant type), sorted
    weights: tuple[tuple[int, int, str], ...]

    @property
    def key(self) -> str:
        return hashlib.sha256(
            json.dumps([self.activations, self.weights], separators=(",", ":")).encode()
        ).hexdigest()[:24]

    @property
    def tensors(self) -> list[str]:
        return sorted({t for t, _, _ in self.activations})

    @property
    def qdq_pairs(self) -> int:
        return len(self.activations) + len({(n, s) for n, s, _ in self.weights})

    def __len__(self) -> int:
        return len(self.activations)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _field(tag: int, payload: bytes) -> bytes:
    return bytes([tag]) + _varint(len(payload)) + payload


_GRAPH_NODE, _GRAPH_INIT, _MODEL_GRAPH = 0x0A, 0x2A, 0x3A


class QDQExporter:
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
    ) -> None:
        self.graph = graph
        self.rules = rules
        self.quant_type = check_quant_type(quant_type)
        self.scales = dict(scales or {})
        if not (default_scale > 0 and np.isfinite(default_scale)):
            raise OptionError(f"default_q_scale must be a positive number, got {default_scale}")
        self.default_scale = float(default_scale)
        if default_zero_point is not None:
            low, high = (0, 255) if self.quant_type == "uint8" else (-128, 127)
            if self.quant_type == "fp8" and default_zero_point != 0:
                raise OptionError("default_q_zero_point must be 0 for fp8")
            if not low <= int(default_zero_point) <= high:
                raise OptionError(
                    f"default_q_zero_point {default_zero_point} is outside [{low}, {high}] "
                    f"for {self.quant_type}"
                )
        self.default_zero_point = default_zero_point
        model = graph.model
        prefix = onnx.ModelProto()
        prefix.CopyFrom(model)
        prefix.ClearField("graph")
        self._prefix = prefix.SerializeToString()
        static = onnx.GraphProto()
        static.CopyFrom(model.graph)
        static.ClearField("node")
        static.ClearField("initializer")
        self._static = static.SerializeToString()
        #: each initializer serialized once; a float weight that Q/DQ replaced everywhere is left
        #: out of the exported bytes
        self._init_bytes = {t.name: _field(_GRAPH_INIT, t.SerializeToString()) for t in model.graph.initializer}
        self._listed_inputs = {i.name for i in model.graph.input}
        self._node_bytes = [_field(_GRAPH_NODE, n.SerializeToString()) for n in graph.nodes]
        # generated names are the tensor's own name plus a suffix, made unique against every
        # tensor and node name of the model, so a plan always exports to the same bytes
        self._names: set[str] = (set(graph.producer) | graph.initializers | set(graph.graph_inputs)
                                 | {n.name for n in graph.nodes if n.name})
        self._act_cache: dict[tuple[str, str], tuple[str, bytes, bytes]] = {}
        self._weight_cache: dict[tuple[str, int | None, str], tuple[str, bytes, bytes, np.ndarray]] = {}
        self._bias_cache: dict[tuple, tuple[str, bytes, bytes]] = {}
        self._recent: dict[str, bytes] = {}

    # -- planning ----------------------------------------------------------------------------
    def plan(self, uses: Iterable[Use] | Mapping[Use, str]) -> QuantPlan:
        """Merge covered uses into per-tensor Q/DQ, apply promotions, add weights."""
        typed = dict(uses) if isinstance(uses, Mapping) else dict.fromkeys(uses, self.quant_type)
        graph = self.graph
        by_tensor: dict[str, dict[tuple[int, int], str]] = {}
        for (t, n, s), q in typed.items():
            if q in (None, "none", 0):
                continue
            by_tensor.setdefault(t, {})[(n, s)] = q
        activations = []
        weights: dict[tuple[int, int], str] = {}
        for t in sorted(by_tensor):
            covered = by_tensor[t]
            qtypes = sorted(set(covered.values()))
            qtype = qtypes[0] if len(qtypes) == 1 else max(qtypes, key=list(covered.values()).count)
            uncovered = [c for c in graph.consumers.get(t, []) if c not in covered]
            for promote in self.rules.promotions:
                if promote(graph, t, uncovered):
                    covered.update(dict.fromkeys(uncovered, qtype))
                    break
            activations.append((t, tuple(sorted(covered)), qtype))
            for n, s in covered:
                spec = WEIGHTED_OPS.get(graph.nodes[n].op_type)
                if spec is None or s not in spec.activation_slots:
                    continue
                inputs = graph.nodes[n].input
                if len(inputs) > spec.weight_slot and graph.is_constant(inputs[spec.weight_slot]) \
                        and inputs[spec.weight_slot] in graph.initializers \
                        and graph.is_float(inputs[spec.weight_slot]):
                    wq = "fp8" if qtype == "fp8" else "int8"
                    weights[(n, spec.weight_slot)] = wq
        return QuantPlan(
            activations=tuple(activations),
            weights=tuple(sorted((n, s, q) for (n, s), q in weights.items())),
        )

    # -- naming and cached pieces ---------------------------------------------------------------
    def _unique(self, base: str) -> str:
        name, k = base, 1
        while name in self._names:
            name, k = f"{base}_{k}", k + 1
        self._names.add(name)
        return name

    def activation_params(self, tensor: str, qtype: str) -> tuple[float, int]:
        if tensor in self.scales:
            scale, zp = self.scales[tensor]
            return max(float(scale), _MIN_SCALE), int(zp)
        if self.default_zero_point is not None and qtype != "fp8":
            return self.default_scale, int(self.default_zero_point)
        if qtype == "uint8":
            # a non-negative tensor gets zero point 0, as calibration would give it; ONNX
            # Runtime then drops the Relu between a quantized Conv and its Q
            return self.default_scale, 0 if self._non_negative(tensor) else 128
        return self.default_scale, 0

    def _non_negative(self, tensor: str) -> bool:
        op = self.graph.producer_op(tensor)
        if op in _NON_NEGATIVE:
            return True
        if op != "Clip":
            return False
        node = self.graph.nodes[self.graph.producer[tensor][0]]
        low = node.input[1] if len(node.input) > 1 else ""
        if low in self.graph.initializers:
            return float(numpy_helper.to_array(self.graph.initializer(low)).min()) >= 0
        return any(a.name == "min" and a.f >= 0 for a in node.attribute)

    def _scalar(self, name: str, value: float, elem_type: int) -> bytes:
        dtype = onnx.helper.tensor_dtype_to_np_dtype(elem_type)
        t = numpy_helper.from_array(np.array(value, dtype=dtype), name)
        return _field(_GRAPH_INIT, t.SerializeToString())

    def _zero_point(self, name: str, zp: int, qtype: str, shape: tuple = ()) -> bytes:
        if qtype == "fp8":
            t = helper.make_tensor(name, TensorProto.FLOAT8E4M3FN, list(shape), [0.0] * int(np.prod(shape or (1,))))
        else:
            dtype = np.uint8 if qtype == "uint8" else np.int8
            t = numpy_helper.from_array(np.full(shape, zp, dtype=dtype), name)
        return _field(_GRAPH_INIT, t.SerializeToString())

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
            nodes = _field(_GRAPH_NODE, q.SerializeToString()) + _field(_GRAPH_NODE, dq.SerializeToString())
            self._act_cache[key] = (dq_out, inits, nodes)
        return self._act_cache[key]

    def _weight(self, node: int, slot: int, qtype: str) -> tuple[str, bytes, bytes, np.ndarray]:
        graph = self.graph
        name = graph.nodes[node].input[slot]
        spec = WEIGHTED_OPS[graph.nodes[node].op_type]
        axis = None if graph.nodes[node].op_type in self.rules.per_tensor_weight_ops else spec.axis(graph, node)
        key = (name, axis, qtype)
        if key not in self._weight_cache:
            w = numpy_helper.to_array(graph.initializer(name)).astype(np.float32)
            scales = weight_scales(w, axis, qtype)
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
            if qtype == "fp8":
                import ml_dtypes

                qw = np.clip(scaled, -448, 448).astype(ml_dtypes.float8_e4m3fn)
                qt = helper.make_tensor(q_name, TensorProto.FLOAT8E4M3FN, list(w.shape),
                                        qw.astype(np.float32).reshape(-1).tolist())
            else:
                qt = numpy_helper.from_array(np.clip(np.rint(scaled), -127, 127).astype(np.int8), q_name)
            st = numpy_helper.from_array(scales.astype(np.float32), s_name)
            inits = (_field(_GRAPH_INIT, qt.SerializeToString()) + _field(_GRAPH_INIT, st.SerializeToString())
                     + self._zero_point(z_name, 0, "fp8" if qtype == "fp8" else "int8", zshape))
            attrs = {"axis": axis} if axis is not None and scales.ndim == 1 else {}
            dq = helper.make_node("DequantizeLinear", [q_name, s_name, z_name], [dq_out],
                                  name=self._unique(f"{base}_DequantizeLinear"), **attrs)
            self._weight_cache[key] = (dq_out, inits, _field(_GRAPH_NODE, dq.SerializeToString()), scales)
        return self._weight_cache[key]

    def _bias(self, node: int, act: str, act_qtype: str, w_scales: np.ndarray) -> tuple[str, bytes, bytes] | None:
        """int32 bias for runtimes whose kernel needs it (ONNX Runtime's QGemm)."""
        graph = self.graph
        n = graph.nodes[node]
        if n.op_type not in self.rules.quantize_bias_ops or len(n.input) < 3 or not n.input[2]:
            return None
        bias = n.input[2]
        if bias not in graph.initializers or act_qtype == "fp8":
            return None
        a_scale, _ = self.activation_params(act, act_qtype)
        key = (bias, act, act_qtype)
        if key not in self._bias_cache:
            b = numpy_helper.to_array(graph.initializer(bias)).astype(np.float64)
            if b.ndim != 1:
                return None
            scales = (a_scale * np.broadcast_to(w_scales, b.shape)).astype(np.float32)
            qb = np.clip(np.rint(b / scales), -(2**31), 2**31 - 1).astype(np.int32)
            base = bias
            q_name, s_name, z_name = (self._unique(f"{base}_{s}") for s in ("quantized", "scale", "zero_point"))
            dq_out = self._unique(f"{base}_dequantized")
            inits = b"".join(
                _field(_GRAPH_INIT, numpy_helper.from_array(a, nm).SerializeToString())
                for a, nm in ((qb, q_name), (scales, s_name), (np.zeros(b.shape, np.int32), z_name))
            )
            dq = helper.make_node("DequantizeLinear", [q_name, s_name, z_name], [dq_out],
                                  name=self._unique(f"{base}_DequantizeLinear"), axis=0)
            self._bias_cache[key] = (dq_out, inits, _field(_GRAPH_NODE, dq.SerializeToString()))
        return self._bias_cache[key]

    # -- export --------------------------------------------------------------------------------
    def to_bytes(self, plan: QuantPlan) -> bytes:
        # the same plan is exported again for references and confirmations: keep the last few
        cached = self._recent.get(plan.key)
        if cached is not None:
            return cached
        data = self._serialize(plan)
        self._recent[plan.key] = data
        while len(self._recent) > _RECENT_EXPORTS:
            self._recent.pop(next(iter(self._recent)))
        return data

    def _serialize(self, plan: QuantPlan) -> bytes:
        graph = self.graph
        inits: list[bytes] = []
        head: list[bytes] = []
        after: dict[int, list[bytes]] = {}
        rewire: dict[int, dict[int, str]] = {}
        act_of: dict[int, tuple[str, str]] = {}
        for tensor, consumers, qtype in plan.activations:
            dq_out, i_bytes, n_bytes = self._activation(tensor, qtype)
            inits.append(i_bytes)
            prod = graph.producer.get(tensor)
            (after.setdefault(prod[0], []) if prod else head).append(n_bytes)
            for n, s in consumers:
                rewire.setdefault(n, {})[s] = dq_out
                act_of.setdefault(n, (tensor, qtype))
        done_weights: set[str] = set()
        for n, s, qtype in plan.weights:
            dq_out, i_bytes, n_bytes, scales = self._weight(n, s, qtype)
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
        replaced = {graph.nodes[n].input[s] for n, rw in rewire.items() for s in rw}
        kept = [
            b for name, b in self._init_bytes.items()
            if name not in replaced or name in self._listed_inputs
            or any(rewire.get(n, {}).get(s) is None for n, s in graph.consumers.get(name, []))
        ]
        body: list[bytes] = []
        for idx, cached in enumerate(self._node_bytes):
            if idx in rewire:
                node = onnx.NodeProto()
                node.CopyFrom(graph.nodes[idx])
                for s, name in rewire[idx].items():
                    node.input[s] = name
                body.append(_field(_GRAPH_NODE, node.SerializeToString()))
            else:
                body.append(cached)
            if idx in after:
                body.extend(after[idx])
        parts = [self._static, *kept, *inits, *head, *body]
        payload_len = sum(map(len, parts))
        return b"".join([self._prefix, bytes([_MODEL_GRAPH]), _varint(payload_len), *parts])

    def to_model(self, plan: QuantPlan) -> onnx.ModelProto:
        """The exported model as a ``ModelProto`` (for saving and for user callables)."""
        return onnx.load_from_string(self.to_bytes(plan))

    def save(self, plan: QuantPlan, path: str | os.PathLike) -> Path:
        model = self.to_model(plan)
        onnx.checker.check_model(model)
        return atomic_write_bytes(path, model.SerializeToString())


def weight_scales(w: np.ndarray, axis: int | None, qtype: str) -> np.ndarray:
    """Symmetric max-abs scales, per channel along ``axis`` (or one per tensor)."""
    qmax = _QMAX["fp8" if qtype == "fp8" else "int8"]
    if axis is None or w.ndim == 0:
        return np.array(max(float(np.abs(w).max(initial=0.0)) / qmax, _MIN_SCALE), dtype=np.float32)
    reduce = tuple(i for i in range(w.ndim) if i != axis)
    amax = np.abs(w).max(axis=reduce, initial=0.0) if reduce else np.abs(w)
    return np.maximum(amax / qmax, _MIN_SCALE).astype(np.float32)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write to a temporary file in the same folder, fsync, then rename over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def quantized_tensors(model: onnx.ModelProto) -> set[str]:
    """Float tensors that feed a QuantizeLinear (activations carrying Q/DQ in ``model``)."""
    return {n.input[0] for n in model.graph.node if n.op_type == "QuantizeLinear"}


def dequantized_weights(model: onnx.ModelProto) -> set[str]:
    """Constant inputs of DequantizeLinear (quantized weights and biases)."""
    inits = {t.name for t in model.graph.initializer}
    return {n.input[0] for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in inits}
