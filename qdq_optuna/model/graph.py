"""Loading, validating and indexing an ONNX model.

Everything downstream (regions, patterns, insertion points, export) works on :class:`Graph`: a
read-only index over one ``ModelProto`` (producers, consumers, constants, dtypes, shapes). The
user's file and ``ModelProto`` are never modified; :func:`load_model` works on its own copy.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import onnx
from onnx import TensorProto

from qdq_optuna.errors import ModelError, OptionError

QDQ_OPS = frozenset({"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear"})
FLOAT_TYPES = frozenset({TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16})
#: ops whose outputs are constants when all their inputs are constants (folded, never quantized)
CONSTANT_OPS = frozenset({"Constant", "ConstantOfShape"})
#: ops whose output is a tensor's shape, not its values (see :meth:`Graph.shape_values`)
SHAPE_OPS = frozenset({"Shape", "Size"})
MINIMUM_OPSET = 10
#: what an older model is upgraded to on loading (per-channel DequantizeLinear needs 13)
UPGRADE_OLD_TO = 13
MAXIMUM_OPSET = 23
PROTOBUF_LIMIT = 2**31 - 1
#: external data beyond this many bytes stays on disk ("external mode"): the model is never held
#: in one protobuf, exports reference the weight files, backends get a path (see export.py)
INLINE_EXTERNAL_LIMIT = 1 << 30
#: initializers of at least this many serialized bytes keep their data only in
#: ``Graph.init_fields`` once the graph is compacted
COMPACT_BYTES = 1 << 10
#: protobuf field keys (field number << 3 | length-delimited) of GraphProto.node,
#: GraphProto.initializer and ModelProto.graph
GRAPH_NODE, GRAPH_INITIALIZER, MODEL_GRAPH = 0x0A, 0x2A, 0x3A
_TENSOR_DATA_FIELDS = ("raw_data", "float_data", "int32_data", "string_data", "int64_data",
                       "double_data", "uint64_data")
INLINE_EXTERNAL_ENV = "QDQ_OPTUNA_INLINE_EXTERNAL_LIMIT"
#: in external mode, external tensors up to this size are still read in (shapes, biases, ...)
SMALL_EXTERNAL_BYTES = 1 << 16
#: bytes per element of the fixed-size tensor types (packed 4-bit and string types not checked)
_ITEMSIZE = {
    TensorProto.FLOAT: 4, TensorProto.UINT8: 1, TensorProto.INT8: 1, TensorProto.UINT16: 2,
    TensorProto.INT16: 2, TensorProto.INT32: 4, TensorProto.INT64: 8, TensorProto.BOOL: 1,
    TensorProto.FLOAT16: 2, TensorProto.DOUBLE: 8, TensorProto.UINT32: 4, TensorProto.UINT64: 8,
    TensorProto.COMPLEX64: 8, TensorProto.COMPLEX128: 16, TensorProto.BFLOAT16: 2,
}

Use = tuple[str, int, int]
"""One use of a tensor: (tensor name, consumer node index, consumer input slot)."""

#: the consumer index of a use that is a graph output (its slot: the output's index); ONNX
#: Runtime's recipe quantizes graph outputs, so that the op writing one runs quantized
GRAPH_OUTPUT = -1


@dataclass(frozen=True)
class InputShapes:
    """``--input-shapes name:1x3x224x224,other:1x128`` parsed."""

    shapes: Mapping[str, tuple[int, ...]]

    @staticmethod
    def parse(spec: str | None) -> InputShapes:
        if not spec:
            return InputShapes({})
        shapes: dict[str, tuple[int, ...]] = {}
        for item in spec.split(","):
            item = item.strip()
            name, sep, dims = item.rpartition(":")
            if not sep or not name or not re.fullmatch(r"\d+(x\d+)*", dims):
                raise OptionError(
                    f"--input-shapes: cannot parse {item!r}; expected NAME:DxDxD, "
                    "e.g. input:1x3x224x224"
                )
            values = tuple(int(d) for d in dims.split("x"))
            if any(v <= 0 for v in values):
                raise OptionError(f"--input-shapes: dims of {name!r} must be positive, got {dims}")
            if any(v > 1_000_000 for v in values) or _product(values) > 2**34:
                raise OptionError(f"--input-shapes: dims of {name!r} are absurdly large: {dims}")
            shapes[name] = values
        return InputShapes(shapes)

    def __str__(self) -> str:
        return ",".join(f"{k}:{'x'.join(map(str, v))}" for k, v in sorted(self.shapes.items()))


def _product(values: Iterable[int]) -> int:
    out = 1
    for v in values:
        out *= v
    return out


@dataclass(frozen=True)
class NodeOrigin:
    """Which nodes of the user's file one node of the graph we work on stands for.

    Loading folds constant weights and preprocessing fuses nodes, so the graph's node indices
    are not the file's: ``inspect`` and reports name nodes by these labels (a file node's name,
    or ``#<its index in the file>``)."""

    #: the file's node this node is (None: preprocessing created it)
    label: str | None
    #: file nodes fused into this node or replaced by it (e.g. the BatchNormalization folded
    #: into a Conv, the MatMul and Add behind a Gemm)
    absorbed: tuple[str, ...] = ()

    @property
    def labels(self) -> tuple[str, ...]:
        return ((self.label,) if self.label else ()) + self.absorbed


@dataclass
class Graph:
    """A read-only index over a validated, shape-inferred model."""

    model: onnx.ModelProto
    path: Path | None = None
    nodes: list[onnx.NodeProto] = field(default_factory=list)
    producer: dict[str, tuple[int, int]] = field(default_factory=dict)
    consumers: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    initializers: set[str] = field(default_factory=set)
    constants: set[str] = field(default_factory=set)
    graph_inputs: list[str] = field(default_factory=list)
    graph_outputs: list[str] = field(default_factory=list)
    elem_types: dict[str, int] = field(default_factory=dict)
    shapes: dict[str, tuple | None] = field(default_factory=dict)
    opset: int = 0
    #: folder that the ``location`` of external initializers is relative to; set when the
    #: model's big weights stay on disk (external mode), None when every tensor is in memory
    external_dir: Path | None = None
    #: every initializer serialized once, as a ``GraphProto.initializer`` field (what exports
    #: concatenate); filled by :meth:`compact`, shared by all exporters of this graph
    init_fields: dict[str, bytes] = field(default_factory=dict, repr=False)
    #: initializers whose data left ``model`` at :meth:`compact` (it lives in ``init_fields``)
    compacted: set[str] = field(default_factory=set, repr=False)
    #: per node, the user's file nodes it stands for; empty: node i is the file's node i
    origins: list[NodeOrigin] = field(default_factory=list, repr=False)
    #: nodes in the user's file (None: unknown, the graph was built from a model directly)
    file_nodes: int | None = None
    #: the file's nodes with no counterpart here (folded into initializers, or removed)
    vanished: tuple[str, ...] = ()
    #: the file's graph inputs that were initializers nobody feeds (default values, as every
    #: IR 3 model lists its weights): constants here, no longer inputs (see take_off_defaults)
    defaults_taken: tuple[str, ...] = ()

    @classmethod
    def from_model(cls, model: onnx.ModelProto, path: Path | None = None,
                   init_fields: dict[str, bytes] | None = None) -> Graph:
        """``init_fields``: initializers whose data is not in ``model`` (see read_split)."""
        g = cls(model=model, path=path)
        if init_fields:
            g.init_fields = dict(init_fields)
            g.compacted = set(init_fields)
        if path is not None and any(t.data_location == TensorProto.EXTERNAL
                                    for t in model.graph.initializer):
            g.external_dir = Path(path).resolve().parent
        graph = model.graph
        g.opset = opset_of(model)
        g.nodes = list(graph.node)
        g.initializers = {t.name for t in graph.initializer}
        g.graph_inputs = [i.name for i in graph.input if i.name not in g.initializers]
        g.graph_outputs = [o.name for o in graph.output]
        for vi in list(graph.input) + list(graph.output) + list(graph.value_info):
            tt = vi.type.tensor_type
            if vi.type.HasField("tensor_type"):
                g.elem_types[vi.name] = tt.elem_type
                if tt.HasField("shape"):
                    g.shapes[vi.name] = tuple(dim_of(d) for d in tt.shape.dim)
        for t in graph.initializer:
            g.elem_types[t.name] = t.data_type
            g.shapes[t.name] = tuple(t.dims)
        known = set(g.initializers) | set(g.graph_inputs) | {""}
        for idx, node in enumerate(g.nodes):
            for slot, name in enumerate(node.input):
                if not name:
                    continue
                if name not in known:
                    raise ModelError(
                        f"node {node_label(node, idx)} reads tensor {name!r}, which no earlier "
                        "node, initializer or graph input provides (cycle, missing initializer "
                        "or unsorted graph)"
                    )
                g.consumers.setdefault(name, []).append((idx, slot))
            for slot, name in enumerate(node.output):
                if not name:
                    continue
                if name in known and name != "":
                    raise ModelError(f"tensor {name!r} is produced more than once")
                g.producer[name] = (idx, slot)
                known.add(name)
            const_inputs = [n for n in node.input if n]
            if node.op_type in CONSTANT_OPS and all(
                n in g.initializers or n in g.constants for n in const_inputs
            ):
                g.constants.update(o for o in node.output if o)
        for name in g.graph_outputs:
            if name not in known:
                raise ModelError(f"graph output {name!r} is not produced by any node")
        return g

    # -- queries ---------------------------------------------------------------------------
    def name_of(self, idx: int) -> str:
        """The node as the user's file names it (see :class:`NodeOrigin`); a node that
        preprocessing created keeps the name preprocessing gave it."""
        if idx == GRAPH_OUTPUT:
            return "<graph output>"
        if not self.origins:
            return node_label(self.nodes[idx], idx)
        origin = self.origins[idx]
        return origin.label or self.nodes[idx].name or f"<new {self.nodes[idx].op_type}>#{idx}"

    def origin(self, idx: int) -> NodeOrigin:
        if not self.origins:
            return NodeOrigin(node_label(self.nodes[idx], idx))
        return self.origins[idx]

    def is_constant(self, tensor: str) -> bool:
        return tensor in self.initializers or tensor in self.constants

    def is_float(self, tensor: str) -> bool:
        return self.elem_types.get(tensor) in FLOAT_TYPES

    def shape_values(self) -> frozenset[str]:
        """Tensors computed from tensor shapes and constants only (Shape -> Gather -> Cast ->
        Range -> ... -> the anchor grid of a detector head, as PyTorch exports it): no data
        flows into them, so an engine builder folds them (TensorRT with static shapes) or runs
        them as shape arithmetic; they are not activations worth a Q/DQ pair. Cached."""
        cached = self.__dict__.get("_shape_values")
        if cached is None or cached[0] != len(self.nodes):
            found: set[str] = set()
            for node in self.nodes:
                if node.domain not in ("", "ai.onnx") or node.op_type in QDQ_OPS \
                        or node.op_type in ("If", "Loop", "Scan"):
                    continue
                inputs = [t for t in node.input if t]
                if node.op_type in SHAPE_OPS or (any(t in found for t in inputs) and all(
                        t in found or self.is_constant(t) for t in inputs)):
                    found.update(o for o in node.output if o)
            cached = self.__dict__["_shape_values"] = (len(self.nodes), frozenset(found))
        return cached[1]

    def is_activation(self, tensor: str) -> bool:
        """A float tensor computed at run time (the only kind that gets activation Q/DQ)."""
        return bool(tensor) and not self.is_constant(tensor) and self.is_float(tensor)

    def uses(self, tensor: str) -> list[Use]:
        """The tensor's reads by nodes (graph outputs: :meth:`output_uses`)."""
        return [(tensor, n, s) for n, s in self.consumers.get(tensor, [])]

    def output_uses(self, tensor: str) -> list[Use]:
        """``(tensor, GRAPH_OUTPUT, k)`` for each graph output ``k`` that ``tensor`` is."""
        return [(tensor, GRAPH_OUTPUT, k) for k, o in enumerate(self.graph_outputs) if o == tensor]

    def producer_op(self, tensor: str) -> str | None:
        p = self.producer.get(tensor)
        return self.nodes[p[0]].op_type if p else None

    def initializer(self, name: str) -> TensorProto | None:
        index = self.__dict__.get("_init_index")
        if index is None or len(index) != len(self.model.graph.initializer):
            index = {t.name: t for t in self.model.graph.initializer}
            self.__dict__["_init_index"] = index
        return index.get(name)

    def array(self, name: str):
        """An initializer's values as numpy; external data is memory-mapped, not read in."""
        from onnx import numpy_helper

        t = self.initializer(name)
        if t is None:
            raise KeyError(name)
        if name in self.compacted:
            return numpy_helper.to_array(self.tensor(name))
        if t.data_location != TensorProto.EXTERNAL or self.external_dir is None:
            return numpy_helper.to_array(t)
        return external_array(t, self.external_dir)

    # -- one copy of the weights -------------------------------------------------------------
    def compact(self, min_bytes: int = COMPACT_BYTES) -> None:
        """Serialize every initializer once into :attr:`init_fields` and drop the data of those
        of ``min_bytes`` or more from ``model`` (names, types and shapes stay). Exports
        concatenate these bytes, so without this the weights would sit in memory twice (the
        parsed model and its serialized pieces). Idempotent; :meth:`full_model` gives a
        complete model back."""
        big = []
        for t in self.model.graph.initializer:
            if t.name not in self.init_fields:
                self.init_fields[t.name] = wire_field(GRAPH_INITIALIZER, t.SerializeToString())
            if t.name not in self.compacted and _worth_compacting(t, self.init_fields[t.name],
                                                                    min_bytes):
                big.append(t.name)
        if not big:
            return
        # a new, light model rather than cleared fields: protobuf frees a message's memory only
        # with the message (and every sub-message we hold, like ``nodes``, keeps it alive)
        self.compacted.update(big)
        light = onnx.ModelProto()
        _copy_fields(light, self.model, "graph")
        _copy_fields(light.graph, self.model.graph, "initializer")
        for t in self.model.graph.initializer:
            light.graph.initializer.append(_metadata(t) if t.name in self.compacted else t)
        self.model = light
        self.nodes = list(light.graph.node)
        self.__dict__.pop("_init_index", None)

    def tensor(self, name: str) -> TensorProto:
        """An initializer with its data (parsed again from :attr:`init_fields` if compacted)."""
        if name not in self.compacted:
            t = self.initializer(name)
            if t is None:
                raise KeyError(name)
            return t
        data = self.init_fields[name]
        return TensorProto.FromString(memoryview(data)[field_header_length(data):])

    def full_model(self) -> onnx.ModelProto:
        """``model`` with every initializer's data (a new copy when compacted: for the few
        steps, like calibration, that hand the whole model to a runtime)."""
        if not self.compacted:
            return self.model
        full = onnx.ModelProto()
        full.CopyFrom(self.model)
        for t in full.graph.initializer:
            if t.name in self.compacted:
                t.CopyFrom(self.tensor(t.name))
        return full


def dim_of(d: onnx.TensorShapeProto.Dimension) -> int | str | None:
    """A dim's size, its symbol, or None; a negative stored value (exporters write -1 for
    "dynamic") is dynamic, not a size (0 is the size of an empty tensor; graph inputs never
    have it: there :func:`_clear_nonpositive_dims` makes it dynamic too)."""
    if d.HasField("dim_value") and d.dim_value >= 0:
        return d.dim_value
    return d.dim_param or None


def _clear_nonpositive_dims(model: onnx.ModelProto) -> None:
    """Make every stored dim value < 0, and a graph input's 0, an unknown dim (on our copy):
    shape inference would otherwise clash with the sizes it infers from ``--input-shapes``."""
    graph = model.graph
    inputs = {vi.name for vi in graph.input}
    for vi in list(graph.input) + list(graph.output) + list(graph.value_info):
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.HasField("shape"):
            lowest = 0 if vi.name in inputs else -1
            for d in vi.type.tensor_type.shape.dim:
                if d.HasField("dim_value") and d.dim_value <= lowest:
                    d.ClearField("dim_value")


def node_label(node: onnx.NodeProto, idx: int) -> str:
    """A node's ONNX name, or ``#<index>`` when it has none (stable across runs)."""
    return node.name if node.name else f"#{idx}"


def opset_of(model: onnx.ModelProto) -> int:
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx"):
            return imp.version
    return 0


def _check_external_data(model: onnx.ModelProto, base_dir: Path, path: Path) -> None:
    base = base_dir.resolve()
    for tensor in model.graph.initializer:
        if tensor.data_location != TensorProto.EXTERNAL:
            continue
        info = {e.key: e.value for e in tensor.external_data}
        location = info.get("location", "")
        try:
            target = (base / location).resolve()
            inside = not os.path.isabs(location) and target.is_relative_to(base)
            is_file = inside and target.is_file()
        except (OSError, ValueError, RuntimeError) as exc:  # NUL byte, name too long, loop
            raise ModelError(
                f"{path}: initializer {tensor.name!r} has an unusable external data location "
                f"{location!r} ({exc})"
            ) from None
        if not inside:
            raise ModelError(
                f"{path}: initializer {tensor.name!r} points to external data {location!r} "
                "outside the model's folder; refusing to read it"
            )
        if not is_file:
            raise ModelError(
                f"{path}: external data file {location!r} of initializer {tensor.name!r} is missing"
            )
        try:
            offset = int(info.get("offset") or 0)
            length = int(info["length"]) if info.get("length") else None
            if offset < 0 or (length is not None and length < 0):
                raise ValueError
        except ValueError:
            raise ModelError(
                f"{path}: initializer {tensor.name!r} has a malformed offset/length for external "
                f"data file {location!r}"
            ) from None
        size = target.stat().st_size
        end = offset + (length if length is not None else 0)
        if end > size:
            raise ModelError(
                f"{path}: external data file {location!r} of initializer {tensor.name!r} is too "
                f"short (needs bytes {offset}-{end}, has {size})"
            )


def external_info(tensor: TensorProto) -> dict[str, str]:
    return {e.key: e.value for e in tensor.external_data}


def external_array(tensor: TensorProto, base_dir: Path):
    """A memory map of one external tensor (checked by :func:`_check_external_data`)."""
    import numpy as np

    info = external_info(tensor)
    dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)
    shape = tuple(tensor.dims)
    if _product(shape) == 0:
        return np.zeros(shape, dtype)
    return np.memmap(Path(base_dir) / info["location"], dtype=dtype, mode="r",
                     offset=int(info.get("offset") or 0), shape=shape)


def external_bytes(model: onnx.ModelProto) -> int:
    """Bytes of initializer data the model keeps in external files."""
    total = 0
    for t in model.graph.initializer:
        if t.data_location == TensorProto.EXTERNAL:
            info = external_info(t)
            length = info.get("length")
            total += int(length) if length else _product(t.dims) * _ITEMSIZE.get(t.data_type, 4)
    return total


def inline_external_limit() -> int:
    """External data above this size stays on disk (:data:`INLINE_EXTERNAL_LIMIT`, or bytes in
    $QDQ_OPTUNA_INLINE_EXTERNAL_LIMIT)."""
    value = os.environ.get(INLINE_EXTERNAL_ENV)
    if value:
        try:
            return int(value)
        except ValueError:
            raise OptionError(f"${INLINE_EXTERNAL_ENV}: expected bytes, got {value!r}") from None
    return INLINE_EXTERNAL_LIMIT


def _load_small_external(model: onnx.ModelProto, base_dir: Path) -> None:
    """External mode: read in the small external tensors (shape constants, biases, scales) and
    leave the big ones on disk."""
    from onnx.external_data_helper import load_external_data_for_tensor

    for t in model.graph.initializer:
        if t.data_location != TensorProto.EXTERNAL:
            continue
        info = external_info(t)
        size = int(info["length"]) if info.get("length") else \
            _product(t.dims) * _ITEMSIZE.get(t.data_type, 4)
        if size <= SMALL_EXTERNAL_BYTES:
            load_external_data_for_tensor(t, str(base_dir))
            t.data_location = TensorProto.DEFAULT
            del t.external_data[:]


#: weights from this size on are left out of the copy that checker and inference work on
LIGHT_CHECK_BYTES = 1 << 10


def _copy_fields(dst, src, *skip: str) -> None:
    """``dst`` gets every set field of ``src`` but those in ``skip`` (never copied)."""
    for fd, value in src.ListFields():
        if fd.name in skip:
            continue
        repeated = fd.is_repeated if hasattr(fd, "is_repeated") else fd.label == fd.LABEL_REPEATED
        if repeated:
            getattr(dst, fd.name).extend(value)
        elif fd.message_type is not None:
            getattr(dst, fd.name).CopyFrom(value)
        else:
            setattr(dst, fd.name, value)


def _without_big_weights(model: onnx.ModelProto,
                         dataless: set[str] = frozenset()) -> onnx.ModelProto | None:
    """A copy of ``model`` whose big raw-data weights (sizes checked by :func:`_check_raw_data`)
    and the ``dataless`` initializers (their data kept aside, see :func:`read_split`) are graph
    inputs of the same type and shape, or None when there are none: for the checker and shape
    inference, which never need float weight values but copy whatever they get."""
    graph = model.graph
    inputs = {i.name for i in graph.input}
    seen: set[str] = set()
    twice = set()
    for t in graph.initializer:
        (twice if t.name in seen else seen).add(t.name)
    big = {t.name for t in graph.initializer
           if t.name and t.name not in inputs and t.name not in twice
           and t.data_type in FLOAT_TYPES and t.HasField("raw_data")
           and len(t.raw_data) >= LIGHT_CHECK_BYTES} | set(dataless)
    if not big:
        return None
    light = onnx.ModelProto()
    _copy_fields(light, model, "graph")
    _copy_fields(light.graph, graph, "initializer")
    for t in graph.initializer:
        if t.name not in big:
            light.graph.initializer.append(t)
        elif t.name not in inputs:  # (an initializer listed as an input already is one)
            light.graph.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type,
                                                                        list(t.dims)))
    return light


def _check_order(model: onnx.ModelProto, label: object) -> None:
    """Each top-level node reads only tensors that exist before it: a clearer message than the
    checker's for cycles, unsorted graphs and missing initializers."""
    graph = model.graph
    producer: dict[str, int] = {}
    for idx, node in enumerate(graph.node):
        for name in node.output:
            producer.setdefault(name, idx)
    known = {t.name for t in graph.initializer} | {i.name for i in graph.input} | {""}
    known |= {t.values.name for t in graph.sparse_initializer}
    for idx, node in enumerate(graph.node):
        for name in node.input:
            if name in known:
                continue
            reader = node_label(node, idx)
            if name in producer:
                later = node_label(graph.node[producer[name]], producer[name])
                raise ModelError(
                    f"{label}: node {reader!r} reads tensor {name!r} before node {later!r} "
                    "produces it (nodes not topologically sorted, or a cycle)"
                )
            raise ModelError(
                f"{label}: node {reader!r} reads tensor {name!r}, which no node, initializer or "
                "graph input provides (a missing initializer?)"
            )
        known.update(node.output)


def _check_raw_data(model: onnx.ModelProto, label: object) -> None:
    """An initializer's raw bytes must match its shape exactly (the checker only notices too
    few bytes; ONNX Runtime refuses too many, loudly)."""
    for t in model.graph.initializer:
        _check_one_raw(t, label)


def _one_line(exc: BaseException, limit: int = 400) -> str:
    """An exception's message as one line (onnx's checker messages span several)."""
    text = " ".join(part.strip() for part in str(exc).splitlines() if part.strip())
    text = text or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def apply_input_shapes(model: onnx.ModelProto, shapes: InputShapes, path: object) -> None:
    """Fix symbolic dims of graph inputs in place (on our copy of the model)."""
    inits = {t.name for t in model.graph.initializer}
    inputs = {i.name: i for i in model.graph.input if i.name not in inits}
    for name, dims in shapes.shapes.items():
        if name not in inputs:
            raise OptionError(
                f"--input-shapes: model {path} has no input {name!r} "
                f"(inputs: {', '.join(inputs) or 'none'})"
            )
        tt = inputs[name].type.tensor_type
        if tt.HasField("shape") and len(tt.shape.dim) != len(dims):
            raise OptionError(
                f"--input-shapes: input {name!r} has rank {len(tt.shape.dim)}, "
                f"got {len(dims)} dims"
            )
        if tt.HasField("shape"):
            for d, v in zip(tt.shape.dim, dims):
                if d.HasField("dim_value") and d.dim_value > 0 and d.dim_value != v:
                    raise OptionError(
                        f"--input-shapes: input {name!r} has static dim {d.dim_value}, got {v}"
                    )
        tt.ClearField("shape")
        for v in dims:
            tt.shape.dim.add().dim_value = v
    for name, vi in inputs.items():
        tt = vi.type.tensor_type
        if not tt.HasField("shape"):
            raise ModelError(f"input {name!r} has no shape; pass --input-shapes {name}:DxDx...")
        dims = [dim_of(d) or "?" for d in tt.shape.dim]
        if any(not isinstance(d, int) for d in dims):
            shown = "x".join(str(d) for d in dims)
            raise ModelError(
                f"input {name!r} has unresolved dims [{shown}]; pass --input-shapes "
                f"{name}:" + "x".join(str(d) if isinstance(d, int) else "N" for d in dims)
                + " (N: the size to tune for, e.g. 1 for the batch)"
            )
        if _product(dims) > 2**34:
            raise ModelError(f"input {name!r} has absurd dims {dims}")


def ensure_opset(model: onnx.ModelProto, minimum: int, why: str,
                 dataless: Iterable[str] = ()) -> onnx.ModelProto:
    """Upgrade to ``minimum`` with onnx's version converter, or refuse clearly. The converter
    and the checker see the big weights and the ``dataless`` initializers (their data kept
    aside, see :func:`read_split`) as graph inputs: the converter checks every tensor, which
    a dataless one fails, and it never needs weight values; they are put back unchanged."""
    current = opset_of(model)
    if current >= minimum:
        return model
    light = _without_big_weights(model, set(dataless))
    try:
        from onnx import version_converter

        upgraded = version_converter.convert_version(light or model, minimum)
        onnx.checker.check_model(upgraded)
        if light is not None:
            _restore_weights(upgraded, model, light)
    except Exception as exc:  # the converter raises many types
        raise ModelError(
            f"{why} needs opset >= {minimum}; the model has opset {current} and onnx's version "
            f"converter failed: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
        ) from None
    return upgraded


def _restore_weights(upgraded: onnx.ModelProto, model: onnx.ModelProto,
                     light: onnx.ModelProto) -> None:
    """In place: the initializers that :func:`_without_big_weights` turned into inputs are
    initializers of ``upgraded`` again (as ``model`` holds them), no longer inputs."""
    graph = upgraded.graph
    given = {i.name for i in model.graph.input}
    lifted = {i.name for i in light.graph.input} - given \
        | {t.name for t in model.graph.initializer} - {t.name for t in light.graph.initializer}
    kept = [i for i in graph.input if i.name not in lifted or i.name in given]
    del graph.input[:]
    graph.input.extend(kept)
    have = {t.name for t in graph.initializer}
    graph.initializer.extend(t for t in model.graph.initializer
                             if t.name in lifted and t.name not in have)


def take_off_defaults(model: onnx.ModelProto, fed: Iterable[str] = ()) -> list[str]:
    """In place: graph inputs that have an initializer are default values (IR 3 lists every
    weight so); from IR 4 (which the opset upgrade gives an IR 3 model) ONNX Runtime treats
    them as overridable and folds nothing computed from them (the onnx test data's models
    compute every Conv weight by ConstantOfShape from one), so no weight there could run as
    an integer kernel. Those not in ``fed`` (the names the
    calibration data feeds) are taken off the inputs and stay initializers; a fed one loses
    its initializer instead: an input the data feeds. Below IR 4 none can be fed (ONNX
    Runtime refuses the name), so all are taken off. Returns the names taken off."""
    graph = model.graph
    inits = {t.name for t in graph.initializer}
    fed = set(fed) if model.ir_version >= 4 else set()
    listed = {i.name for i in graph.input} & inits
    if not listed:
        return []
    taken = [i.name for i in graph.input if i.name in listed and i.name not in fed]
    kept = [i for i in graph.input if i.name not in taken]
    del graph.input[:]
    graph.input.extend(kept)
    if listed & fed:
        kept_inits = [t for t in graph.initializer if t.name not in fed]
        del graph.initializer[:]
        graph.initializer.extend(kept_inits)
    model.ir_version = max(model.ir_version, 4)  # from IR 4 initializers need not be inputs
    return taken


def load_model(
    source: str | os.PathLike | onnx.ModelProto,
    input_shapes: InputShapes | None = None,
    *,
    allow_qdq: bool = False,
    fed: Iterable[str] = (),
) -> Graph:
    """Load, check, fix input shapes and run shape inference. Raises :class:`ModelError`.
    ``fed``: the input names the calibration data feeds (see :func:`take_off_defaults`)."""
    try:
        return _load_model(source, input_shapes, allow_qdq, frozenset(fed))
    except UnicodeDecodeError as exc:  # protobuf decodes text fields only when they are read
        label = "<model>" if isinstance(source, onnx.ModelProto) else Path(source)
        raise ModelError(f"{label}: a text field (a name, domain or doc string) is not valid "
                         f"UTF-8 ({exc.reason} at byte {exc.start})") from None


def _read_model_file(path: Path) -> tuple[onnx.ModelProto, dict[str, bytes]]:
    """A model file, parsed, with its external data (the big weights stay on disk above the
    in-memory limit), and the big initializers read straight into their serialized form."""
    fields: dict[str, bytes] = {}
    if not path.exists():
        raise ModelError(f"{path}: no such file")
    if path.is_dir():
        raise ModelError(f"{path}: is a directory, expected an .onnx file")
    size = path.stat().st_size
    if size == 0:
        raise ModelError(f"{path}: empty file")
    split = read_split(path)
    try:
        if split is not None:
            model, fields = split
        else:
            with open(path, "rb") as fh:
                model = onnx.ModelProto()
                model.ParseFromString(fh.read())
    except Exception as exc:
        raise ModelError(
            f"{path}: not a readable ONNX model (protobuf parse failed: "
            f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
        ) from None
    if not model.HasField("graph") or not model.graph.node:
        raise ModelError(f"{path}: not an ONNX model (no graph or no nodes)")
    _check_external_data(model, path.parent, path)
    try:
        if external_bytes(model) > inline_external_limit():
            _load_small_external(model, path.parent)  # the big weights stay on disk
        else:
            onnx.load_external_data_for_model(model, str(path.parent))
    except Exception as exc:
        raise ModelError(f"{path}: cannot read external data: {exc}") from None
    return model, fields


def _upgrade_old(model: onnx.ModelProto, label: object,
                 dataless: Iterable[str] = ()) -> onnx.ModelProto:
    """An opset < 10 model (onnx-caffe2, tf2onnx at opset 9) at opset 13, which Q/DQ and
    per-channel weights need, by onnx's version converter (labels then index the upgraded
    graph); others unchanged."""
    opset = opset_of(model)
    if opset >= MINIMUM_OPSET:
        return model
    model = ensure_opset(model, UPGRADE_OLD_TO, f"{label} (opset {opset})", dataless)
    # the converter keeps the file's IR version; IR 3 (onnx-caffe2) wants every initializer
    # listed as a graph input, which later rewrites do not keep
    model.ir_version = max(model.ir_version,
                           onnx.helper.find_min_ir_version_for(list(model.opset_import)))
    logging.getLogger("qdq_optuna").info("%s: opset %d upgraded to %d with onnx's version "
                                         "converter", label, opset, UPGRADE_OLD_TO)
    return model


def _load_model(source: str | os.PathLike | onnx.ModelProto,
                input_shapes: InputShapes | None, allow_qdq: bool,
                fed: frozenset[str] = frozenset()) -> Graph:
    shapes = input_shapes or InputShapes({})
    path: Path | None = None
    #: big initializers read straight into their serialized form (see read_split)
    fields: dict[str, bytes] = {}
    if isinstance(source, onnx.ModelProto):
        model = onnx.ModelProto()
        model.CopyFrom(source)
        label: object = "<model>"
    else:
        path = Path(source)
        label = path
        model, fields = _read_model_file(path)
    if not model.HasField("graph") or not model.graph.node:
        raise ModelError(f"{label}: not an ONNX model (no graph or no nodes)")
    defaults = take_off_defaults(model, fed)
    model = _upgrade_old(model, label, fields)
    opset = opset_of(model)
    if opset < MINIMUM_OPSET or opset > MAXIMUM_OPSET:
        raise ModelError(
            f"{label}: unsupported opset {opset} (supported: {MINIMUM_OPSET}-{MAXIMUM_OPSET}); "
            "convert the model with onnx.version_converter first"
        )
    qdq = sorted({n.op_type for n in model.graph.node if n.op_type in QDQ_OPS})
    if qdq and not allow_qdq:
        raise ModelError(
            f"{label}: already contains {'/'.join(qdq)} nodes; tune the float model "
            "(use it as --qdq-baseline to import its placement)"
        )
    names = [n.name for n in model.graph.node if n.name]
    if len(names) != len(set(names)):
        dup = sorted({n for n in names if names.count(n) > 1})[0]
        raise ModelError(f"{label}: node name {dup!r} is used more than once")
    _check_order(model, label)
    _check_raw_data(model, label)
    _clear_nonpositive_dims(model)
    apply_input_shapes(model, shapes, label)
    too_big = model.ByteSize() > PROTOBUF_LIMIT if hasattr(model, "ByteSize") else False
    on_disk = any(t.data_location == TensorProto.EXTERNAL for t in model.graph.initializer)
    # checker and shape inference copy the model several times: give them the graph without
    # its big weights (declared as inputs of the same type and shape instead)
    light = None if too_big else _without_big_weights(model, set(fields))
    try:
        if too_big or on_disk:  # the checker finds external files only next to a path
            onnx.checker.check_model(str(path)) if path else None
        else:
            onnx.checker.check_model(light or model)
    except Exception as exc:
        raise ModelError(f"{label}: invalid ONNX graph: {_one_line(exc)}") from None
    try:
        if light is not None:
            inferred = onnx.shape_inference.infer_shapes(light, strict_mode=True, data_prop=True)
            for name in ("node", "value_info", "output"):  # what inference adds or refines
                field_ = getattr(model.graph, name)
                del field_[:]
                field_.extend(getattr(inferred.graph, name))
        elif not too_big:
            model = onnx.shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)
    except Exception as exc:
        msg = str(exc).strip().splitlines()
        raise ModelError(f"{label}: shape inference failed: {msg[0] if msg else exc}") from None
    labels = [node_label(n, i) for i, n in enumerate(model.graph.node)]
    removed = set(fold_constant_weights(model))
    prune_opset_imports(model)  # exports declare only the domains their nodes use
    graph = Graph.from_model(model, path, init_fields=fields)
    if not too_big and not on_disk and _set_value_info(model, shapes_by_running(graph)):
        graph = Graph.from_model(model, path, init_fields=fields)
    graph.file_nodes = len(labels)
    graph.defaults_taken = tuple(defaults)
    if removed:
        graph.origins = [NodeOrigin(lb) for i, lb in enumerate(labels) if i not in removed]
        graph.vanished = tuple(labels[i] for i in sorted(removed))
    return graph


#: weight and bias inputs of the weighted ops (what the exporter quantizes as weights)
WEIGHT_SLOTS: Mapping[str, tuple[int, ...]] = {
    "Conv": (1, 2), "ConvTranspose": (1, 2), "Gemm": (1, 2), "MatMul": (1,),
}
#: ops folded into an initializer when every input is constant and the result is a weight
#: (Constant nodes, and the reshaping/casting exporters put between a constant and its op)
FOLDABLE_OPS = frozenset({"Constant", "ConstantOfShape", "Identity", "Cast", "Transpose",
                          "Reshape", "Squeeze", "Unsqueeze", "Flatten"})


def fold_constant_weights(model: onnx.ModelProto) -> list[int]:
    """Weights that reach a weight/bias slot through Constant nodes (paddle2onnx keeps every
    weight there) or foldable ops become initializers, in place on our copy, so every runtime's
    rules see them as weights; so does any other float tensor computed through foldable ops
    from constants alone (a bias reshaped before its Add), which no rule may quantize as an
    activation. Returns the indices of the nodes removed."""
    graph = model.graph
    producer = {o: i for i, n in enumerate(graph.node) for o in n.output if o}
    values = {t.name: t for t in graph.initializer}
    outputs = {o.name for o in graph.output}
    folded: dict[str, TensorProto] = {}

    def foldable(name: str, depth: int) -> onnx.NodeProto | None:
        """The node computing ``name`` when it is one that folds (not too deep a chain)."""
        idx = producer.get(name)
        if idx is None or depth > 8 or name in outputs:
            return None
        node = graph.node[idx]
        if node.op_type not in FOLDABLE_OPS or node.domain not in ("", "ai.onnx") \
                or len(node.output) != 1:
            return None
        return node

    def fold(name: str, depth: int = 0) -> TensorProto | None:
        if name in values or name in folded:
            return values.get(name) or folded[name]
        node = foldable(name, depth)
        if node is None:
            return None
        inputs = [fold(i, depth + 1) if i else None for i in node.input]
        if any(i and t is None for i, t in zip(node.input, inputs)):
            return None
        tensor = _evaluate(node, [t for t in inputs if t is not None])
        if tensor is not None:
            tensor.name = name
            folded[name] = tensor
        return tensor

    def constant_types(name: str, depth: int = 0) -> set[int] | None:
        """The data types of the constants ``name`` is computed from through foldable ops;
        None when an activation is among its inputs (checked before folding anything)."""
        if name in values:
            return {values[name].data_type}
        node = foldable(name, depth)
        if node is None:
            return None
        if node.op_type == "Constant":  # value_ints, value_float, ...: not a float tensor
            attr = node.attribute[0] if node.attribute else None
            return {attr.t.data_type} if attr is not None and attr.name == "value" else set()
        if node.op_type == "ConstantOfShape":  # its value's type (float zeros by default)
            return ({a.t.data_type for a in node.attribute if a.name == "value"}
                    or {TensorProto.FLOAT}) if constant_types(node.input[0], depth + 1) \
                is not None else None
        types: set[int] = set()
        for i in filter(None, node.input):
            found = constant_types(i, depth + 1)
            if found is None:
                return None
            types |= found
        return types

    for node in graph.node:
        for slot in WEIGHT_SLOTS.get(node.op_type, ()) if node.domain in ("", "ai.onnx") else ():
            if slot < len(node.input) and node.input[slot]:
                fold(node.input[slot])
    # any other float tensor computed from constants alone (paddle2onnx's Reshape of a bias
    # before its Add): every runtime folds it when it compiles the model, so it is a constant,
    # not an activation to quantize (a Q/DQ on one made OpenVINO's low-precision Add
    # transformation throw on ppocr-cls)
    for node in graph.node:
        for name in node.input:
            idx = producer.get(name)
            if idx is None or name in folded or graph.node[idx].op_type == "Constant":
                continue  # an activation's input, done, or a Constant node's (a constant)
            if (constant_types(name) or set()) & _FLOAT_TENSOR_TYPES:
                fold(name)
    if not folded:
        return []
    graph.initializer.extend(folded.values())
    return _drop_unused(model, set(folded))


def add_shapes_by_running(model: onnx.ModelProto) -> bool:
    """In place: value_info for the tensors whose static shape onnx's inference leaves open
    (:func:`shapes_by_running`), so that a consumer relying on static inference alone (the cost
    model) can read the user's model as given. False when nothing was added."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
        return _set_value_info(model, shapes_by_running(Graph.from_model(inferred)))
    except Exception:  # noqa: BLE001 - a model ONNX Runtime cannot run: the caller reports it
        return False


def shapes_by_running(graph: Graph, runs: int = 3) -> list[onnx.ValueInfoProto]:
    """Static shapes that onnx's inference leaves open although every input is static (a
    Reshape whose shape is computed by Shape -> Cast -> Slice -> Concat, as exporters write
    it): ONNX Runtime runs the model on ``runs`` different random inputs, and a tensor's shape
    counts when every run agrees (a data-dependent one does not). Without them, whatever needs
    static shapes (the cost model, per-tensor analysis) stops at such a tensor."""
    import numpy as np
    import onnxruntime as ort

    inputs = [(name, graph.shapes.get(name)) for name in graph.graph_inputs]
    if any(dims is None or not all(isinstance(d, int) for d in dims) for _, dims in inputs):
        return []
    open_ = [t for n in graph.nodes for t in n.output if t and not all(
        isinstance(d, int) for d in (graph.shapes.get(t) or (None,)))]
    if not open_ or any(n.op_type in ("If", "Loop", "Scan") for n in graph.nodes):
        return []
    probe = onnx.ModelProto()
    probe.CopyFrom(graph.full_model())
    del probe.graph.output[:]
    probe.graph.output.extend(onnx.ValueInfoProto(name=t) for t in open_)
    so = ort.SessionOptions()
    so.log_severity_level = 4
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    rng = np.random.default_rng(0)
    try:
        session = ort.InferenceSession(probe.SerializeToString(), so,
                                       providers=["CPUExecutionProvider"])
        del probe
        runs_out = []
        for k in range(runs):  # centred differently, so value-dependent sizes differ
            feeds = {}
            for name, dims in inputs:
                dtype = onnx.helper.tensor_dtype_to_np_dtype(graph.elem_types[name])
                feeds[name] = ((rng.standard_normal(dims) + k - 1).astype(dtype)
                               if np.dtype(dtype).kind == "f" else np.zeros(dims, dtype))
            runs_out.append([np.shape(v) for v in session.run(None, feeds)])
    except Exception:  # the model needs real data or an op ORT lacks: leave shapes open
        return []
    found = []
    for k, name in enumerate(open_):
        if all(run[k] == runs_out[0][k] for run in runs_out) and name in graph.elem_types:
            found.append(onnx.helper.make_tensor_value_info(name, graph.elem_types[name],
                                                            runs_out[0][k]))
    return found


def _set_value_info(model: onnx.ModelProto, infos: list[onnx.ValueInfoProto]) -> bool:
    """Put ``infos`` into the model's value_info (graph outputs keep their entry, typed)."""
    if not infos:
        return False
    by_name = {vi.name: vi for vi in infos}
    names = set(by_name)
    for vi in model.graph.output:
        if vi.name in by_name:
            vi.type.CopyFrom(by_name.pop(vi.name).type)
    kept = [vi for vi in model.graph.value_info if vi.name not in names]
    del model.graph.value_info[:]
    model.graph.value_info.extend(kept + list(by_name.values()))
    return True


def _static(vi: onnx.ValueInfoProto) -> bool:
    tt = vi.type.tensor_type
    return vi.type.HasField("tensor_type") and tt.HasField("shape") and \
        all(isinstance(dim_of(d), int) for d in tt.shape.dim)


_FLOAT_TENSOR_TYPES = frozenset({TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE,
                                  TensorProto.BFLOAT16})


def _evaluate(node: onnx.NodeProto, inputs: list[TensorProto]) -> TensorProto | None:
    """The value of one node whose inputs are constants (onnx's reference evaluator)."""
    if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
        out = TensorProto()
        out.CopyFrom(node.attribute[0].t)
        return out
    from onnx import numpy_helper
    from onnx.reference import ReferenceEvaluator

    try:
        result = ReferenceEvaluator(node).run(
            None, {i: numpy_helper.to_array(t) for i, t in zip(node.input, inputs)})
    except Exception:  # an attribute form or type the evaluator lacks: leave the node
        return None
    return numpy_helper.from_array(result[0])


def _drop_unused(model: onnx.ModelProto, folded: set[str]) -> list[int]:
    """Remove the folded nodes (their output is an initializer now), then the folded
    initializers nothing reads (the intermediate steps of a folded chain)."""
    graph = model.graph
    removed = [i for i, n in enumerate(graph.node) if n.output and n.output[0] in folded]
    gone = set(removed)
    keep = [n for i, n in enumerate(graph.node) if i not in gone]
    del graph.node[:]
    graph.node.extend(keep)
    read = {i for n in keep for i in n.input} | {o.name for o in graph.output} \
        | _subgraph_reads(graph)
    unused = [t for t in graph.initializer if t.name in folded and t.name not in read]
    for t in unused:
        graph.initializer.remove(t)
    return removed


def _subgraph_reads(graph: onnx.GraphProto) -> set[str]:
    """Names read by the nodes of subgraphs (If/Loop/Scan bodies may read outer tensors)."""
    reads: set[str] = set()
    for node in graph.node:
        for attr in node.attribute:
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                for inner in sub.node:
                    reads.update(i for i in inner.input if i)
                reads |= _subgraph_reads(sub)
    return reads


def ort_basic_optimize(model: onnx.ModelProto) -> onnx.ModelProto:
    """ONNX Runtime's provider-independent optimizations (constant folding, Conv+BN/Add/Mul
    fusion, redundant node removal): the float model that ORT would run, so Q/DQ go where the
    kernels will be. Node names survive; the result is an ordinary ONNX model."""
    import tempfile

    import onnxruntime as ort

    with tempfile.TemporaryDirectory(prefix="qdq-optuna-") as tmp:
        out = os.path.join(tmp, "basic.onnx")
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        so.optimized_model_filepath = out
        so.log_severity_level = 4  # only fatal: a failure is reported below, as one line
        try:
            ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        except Exception as exc:
            msg = str(exc).strip().splitlines()
            raise ModelError(f"ONNX Runtime cannot load the model: {msg[0] if msg else exc}") from None
        optimized = onnx.load(out)
    # Initializers ORT created (e.g. "gemm_input_shape") would be created again under the same
    # name when ORT optimizes this model a second time, which it refuses: give them our prefix.
    original = {t.name for t in model.graph.initializer} | {
        o for n in model.graph.node for o in n.output
    } | {i.name for i in model.graph.input}
    rename = {t.name: f"preprocessed/{t.name}" for t in optimized.graph.initializer
              if t.name not in original}
    if rename:
        for t in optimized.graph.initializer:
            t.name = rename.get(t.name, t.name)
        for node in optimized.graph.node:
            node.input[:] = [rename.get(x, x) for x in node.input]
    # give nodes without names stable ones that no other node already uses
    taken = {n.name for n in optimized.graph.node if n.name}
    for idx, node in enumerate(optimized.graph.node):
        if not node.name:
            name, k = f"{node.op_type}_{idx}", 1
            while name in taken:
                name, k = f"{node.op_type}_{idx}_{k}", k + 1
            node.name = name
            taken.add(name)
    prune_opset_imports(optimized)
    return onnx.shape_inference.infer_shapes(optimized, strict_mode=False, data_prop=True)


def used_domains(model: onnx.ModelProto) -> set[str]:
    """Operator domains the model's nodes use (subgraphs and local functions included)."""
    def walk(nodes) -> set[str]:
        found: set[str] = set()
        for node in nodes:
            found.add(node.domain or "")
            for attr in node.attribute:
                for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                    found |= walk(sub.node)
        return found

    domains = walk(model.graph.node)
    for fn in model.functions:
        domains |= walk(fn.node)
    return {"" if d == "ai.onnx" else d for d in domains}


def prune_opset_imports(model: onnx.ModelProto) -> None:
    """Keep only the opset imports of domains some node uses (ONNX Runtime's optimized
    models declare every domain it knows, e.g. com.microsoft.nchwc, org.pytorch.aten)."""
    used = used_domains(model) | {""}
    keep = [imp for imp in model.opset_import
            if ("" if imp.domain == "ai.onnx" else imp.domain) in used]
    if len(keep) != len(model.opset_import):
        del model.opset_import[:]
        model.opset_import.extend(keep)


def transform_graph(graph: Graph, transform, created_prefix: str = "",
                    name_all: bool = False) -> Graph:
    """``transform(model) -> model`` (ONNX Runtime's preprocessing, the version converter)
    applied to the graph's model, keeping track of which of the user's nodes each node of the
    result stands for (:class:`NodeOrigin`). Nodes are matched by name: unnamed ones get a
    temporary name for the transform and lose it again (``name_all``: get ``op_index`` like
    :func:`ort_basic_optimize` gives); nodes it creates without a name get
    ``created_prefix + op_index``."""
    model = onnx.ModelProto()
    model.CopyFrom(graph.full_model())  # the transform may change what it is given
    before = [(n.name, list(n.input), list(n.output)) for n in model.graph.node]
    taken = {n.name for n in model.graph.node if n.name}
    temp: dict[str, int] = {}
    for idx, node in enumerate(model.graph.node):
        if not node.name:
            name, k = f"__qdq_optuna_node_{idx}", 0
            while name in taken:
                name, k = f"__qdq_optuna_node_{idx}_{k}", k + 1
            node.name = name
            temp[name] = idx
    result = transform(model)
    temp_of = {i: t for t, i in temp.items()}
    keys = [name or temp_of[idx] for idx, (name, _, _) in enumerate(before)]
    origins, vanished = _trace_origins(graph, before, keys, result)
    taken = {n.name for n in result.graph.node if n.name and n.name not in temp}
    for idx, node in enumerate(result.graph.node):
        if node.name in temp and not name_all:
            node.name = ""
        elif not node.name or node.name in temp:
            name, k = f"{created_prefix}{node.op_type}_{idx}", 1
            while name in taken:
                name, k = f"{created_prefix}{node.op_type}_{idx}_{k}", k + 1
            node.name = name
            taken.add(name)
    new = Graph.from_model(result, graph.path)
    new.origins, new.file_nodes = origins, graph.file_nodes
    new.vanished = graph.vanished + vanished
    new.defaults_taken = graph.defaults_taken
    return new


def _trace_origins(graph: Graph, before: list[tuple[str, list[str], list[str]]],
                   keys: list[str], result: onnx.ModelProto
                   ) -> tuple[list[NodeOrigin], tuple[str, ...]]:
    """Which of ``graph``'s nodes (``before``, named by ``keys``) each node of ``result``
    stands for. A node whose name survives is that node; removed and created nodes that are
    tied by tensors only one side has (a fused chain's inner tensors) or by an output the
    result now computes elsewhere form one cluster, whose removed nodes each result node of the
    cluster has absorbed. Removed nodes in no cluster vanished (folded, eliminated)."""
    after = result.graph.node
    index = {k: i for i, k in enumerate(keys)}
    same = {j: index[n.name] for j, n in enumerate(after) if n.name in index}
    removed = set(range(len(before))) - set(same.values())
    b_tensors = {t for _, ins, outs in before for t in ins + outs}
    a_tensors = {t for n in after for t in list(n.input) + list(n.output)}
    b_prod = {t: i for i, (_, _, outs) in enumerate(before) for t in outs if t}
    a_prod = {t: j for j, n in enumerate(after) for t in n.output if t}
    parent: dict[tuple, tuple] = {}

    def find(x):
        while parent.get(x, x) != x:
            x = parent[x]
        return x

    def union(a, b):
        parent[find(a)] = find(b)

    for i in removed:
        for t in before[i][2]:
            if t in a_prod:
                union(("b", i), ("a", a_prod[t]))
        for t in before[i][1]:
            if b_prod.get(t) in removed and t not in a_tensors:
                union(("b", i), ("b", b_prod[t]))
    for j, node in enumerate(after):
        if j not in same:
            for t in node.input:
                if t in a_prod and a_prod[t] not in same and t not in b_tensors:
                    union(("a", j), ("a", a_prod[t]))
    absorbed: dict[tuple, list[str]] = {}
    for i in sorted(removed):
        absorbed.setdefault(find(("b", i)), []).extend(graph.origin(i).labels)
    clustered = {find(("a", j)) for j in range(len(after))}
    origins = []
    for j in range(len(after)):
        extra = tuple(absorbed.get(find(("a", j)), ()))
        if j in same:
            own = graph.origin(same[j])
            origins.append(NodeOrigin(own.label, own.absorbed + extra))
        else:
            origins.append(NodeOrigin(None, extra))
    vanished = tuple(lb for root, labels in absorbed.items() if root not in clustered
                     for lb in labels)
    return origins, vanished


# -- protobuf wire format (exports are concatenations of serialized pieces) ----------------------
def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def wire_field(key: int, payload: bytes) -> bytes:
    """One length-delimited field: its key byte, the payload's length, the payload."""
    return bytes([key]) + varint(len(payload)) + payload


def field_header_length(data: bytes) -> int:
    """Bytes before the payload of a :func:`wire_field` (key byte + length varint)."""
    i = 1
    while data[i] & 0x80:
        i += 1
    return i + 1


class _WireError(ValueError):
    """The file is not protobuf this scanner understands (the full parser then reports it)."""


def _read_varint(fh) -> int:
    shift = value = 0
    while True:
        b = fh.read(1)
        if not b:
            raise _WireError("truncated varint")
        value |= (b[0] & 0x7F) << shift
        if not b[0] & 0x80:
            return value
        shift += 7
        if shift > 63:
            raise _WireError("varint too long")


def _read_exact(fh, n: int) -> bytes:
    data = fh.read(n)
    if len(data) != n:
        raise _WireError("truncated field")
    return data


def _next_field(fh, end: int) -> tuple[int, int, int, int]:
    """The next field's (number, wire type, start, length): for a length-delimited field the
    payload's start and length, unread; for any other the whole field's."""
    start = fh.tell()
    key = _read_varint(fh)
    number, wire = key >> 3, key & 7
    if wire == 2:
        n = _read_varint(fh)
        pos = fh.tell()
        if pos + n > end:
            raise _WireError("field runs past its message")
        return number, wire, pos, n
    if wire == 0:
        _read_varint(fh)
    elif wire in (1, 5):
        fh.seek(8 if wire == 1 else 4, os.SEEK_CUR)
    else:
        raise _WireError(f"wire type {wire}")
    if fh.tell() > end:
        raise _WireError("field runs past its message")
    return number, wire, start, fh.tell() - start


def _read_field(fh, number: int, wire: int, pos: int, n: int) -> bytes:
    """The field as it stands in the file (after :func:`_next_field`)."""
    if wire == 2:
        fh.seek(pos)
        return varint(number << 3 | 2) + varint(n) + _read_exact(fh, n)
    fh.seek(pos)
    return _read_exact(fh, n)


def read_split(path: Path, min_bytes: int = COMPACT_BYTES
               ) -> tuple[onnx.ModelProto, dict[str, bytes]] | None:
    """Read a model file without ever holding its big initializers twice: each initializer
    whose serialized field is ``min_bytes`` or more is kept as that field (what exports
    concatenate, see :meth:`Graph.compact`) and appears in the returned model with its name,
    type and shape only. None when the file is not plain protobuf of this shape (the caller
    then parses it whole, and reports what is wrong)."""
    fields: dict[str, bytes] = {}
    top: list[bytes] = []
    graphs = 0
    try:
        with open(path, "rb") as fh:
            end = fh.seek(0, os.SEEK_END)
            fh.seek(0)
            while fh.tell() < end:
                number, wire, pos, n = _next_field(fh, end)
                if not (number == 7 and wire == 2):  # anything but ModelProto.graph
                    top.append(_read_field(fh, number, wire, pos, n))
                    continue
                graphs += 1
                if graphs > 1:
                    return None  # protobuf merges repeated graph fields: let it do that
                inner: list[bytes] = []
                graph_end = pos + n
                while fh.tell() < graph_end:
                    n2, w2, pos2, len2 = _next_field(fh, graph_end)
                    if not (n2 == 5 and w2 == 2):  # anything but GraphProto.initializer
                        inner.append(_read_field(fh, n2, w2, pos2, len2))
                        continue
                    data = _read_field(fh, n2, w2, pos2, len2)
                    if len(data) < min_bytes:
                        inner.append(data)
                        continue
                    t = TensorProto.FromString(memoryview(data)[field_header_length(data):])
                    if not t.name or t.name in fields or not _worth_compacting(t, data, min_bytes):
                        inner.append(data)
                        continue
                    _check_one_raw(t, path)  # the size check, on the only copy there is
                    fields[t.name] = data
                    inner.append(wire_field(GRAPH_INITIALIZER, _metadata(t).SerializeToString()))
                    del t
                top.append(wire_field(MODEL_GRAPH, b"".join(inner)))
                del inner
        model = onnx.ModelProto()
        model.ParseFromString(b"".join(top))
    except ModelError:
        raise
    except Exception:  # _WireError, a parse error, ...: the full parser says what is wrong
        return None
    return model, fields


def _worth_compacting(t: TensorProto, field_bytes: bytes, min_bytes: int) -> bool:
    """Whether a tensor's data should live only in its serialized field (see Graph.compact)."""
    return t.data_location != TensorProto.EXTERNAL and len(field_bytes) >= min_bytes


def _metadata(t: TensorProto) -> TensorProto:
    """``t`` without its values: name, type, shape (and anything else but the data)."""
    meta = TensorProto()
    _copy_fields(meta, t, *_TENSOR_DATA_FIELDS)
    return meta


def _check_one_raw(t: TensorProto, label: object) -> None:
    if not t.HasField("raw_data") or t.data_type not in _ITEMSIZE:
        return
    need = _product(t.dims) * _ITEMSIZE[t.data_type]
    if len(t.raw_data) != need:
        raise ModelError(
            f"{label}: initializer {t.name!r} holds {len(t.raw_data)} bytes, but its shape "
            f"{list(t.dims)} and type {TensorProto.DataType.Name(t.data_type)} need {need}"
        )
