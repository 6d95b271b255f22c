"""Activation statistics and scales for the Q/DQ pairs a search places.

Every candidate placement needs a scale for each quantized activation. Statistics are gathered
once, in a single ONNX Runtime pass over the calibration data for all tensors that may ever be
quantized, and cached; each calibration method then turns a tensor's statistics into
``(scale, zero_point)`` without touching the model again.

Quant types (the strings used throughout the project):

* ``"int8"``: symmetric, zero point 0, ``scale = amax / 127``.
* ``"uint8"``: asymmetric over [0, 255], ``scale = (max - min) / 255`` with ``min <= 0 <= max``.
* ``"fp8"``: float8 e4m3fn, zero point 0, ``scale = amax / 448``.
"""

from __future__ import annotations

import json
import math
import os
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qdq_optuna._files import map_external_sources
from qdq_optuna.errors import ModelError, OptionError, UserError
from qdq_optuna.machine import current_cpu

if TYPE_CHECKING:
    from qdq_optuna.model.graph import Graph

#: A model for ONNX Runtime: a ``ModelProto``, or a path (required when the weights live in
#: external data files, or the model is too large to serialize in memory).
ModelLike = onnx.ModelProto | str | os.PathLike

#: the quant types, one row each: the ONNX element type a QuantizeLinear writes and the
#: largest quantized magnitude (every other table of types is derived from this one)
QUANT_TYPE_TABLE = {
    "int8": (onnx.TensorProto.INT8, 127.0),
    "uint8": (onnx.TensorProto.UINT8, 255.0),
    "fp8": (onnx.TensorProto.FLOAT8E4M3FN, 448.0),
}
QUANT_TYPES = tuple(QUANT_TYPE_TABLE)


class QuantType(str, Enum):
    """A quant type: checked in one place (:meth:`parse`), compared as a member, never as a
    string (a member equals its name, so the plain names stored in runs and files still
    compare equal)."""

    INT8 = "int8"
    UINT8 = "uint8"
    FP8 = "fp8"

    def __hash__(self) -> int:  # as its name's: found in sets and dicts of plain names
        return str.__hash__(self)

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @classmethod
    def parse(cls, name: str, option: str = "--quant-type") -> QuantType:
        """The quant type called ``name``, or one line naming the option and the choices."""
        try:
            return cls(name)
        except ValueError:
            raise OptionError(f"{option}: unknown {name!r} "
                              f"(choose from {', '.join(QUANT_TYPES)})") from None


#: quant type -> the ONNX element type of its zero point and QuantizeLinear output
QUANT_ONNX_TYPES = {name: row[0] for name, row in QUANT_TYPE_TABLE.items()}
METHODS = ("minmax", "percentile", "entropy", "mse")
#: the activation calibration method runs use unless told otherwise, chosen by measurement
#: (``benchmarks/calibration_methods.py``: every offered point quantized on 4 zoo and 9 real
#: models, output error vs FP32 on held-out inputs): 99.99th percentile had the lowest error
#: on 6 of 13 models under each runtime's rules and the most models within the guard's bound;
#: entropy (TensorRT's own default) was the worst, min/max breaks on rare outliers.
DEFAULT_METHOD = "percentile"

#: Smallest scale handed out. A tensor that is constant zero (a dead ReLU, padding) would
#: otherwise get scale 0 and Q/DQ would divide by zero; 1e-8 is a normal float32 that still
#: maps every real activation (>= ~1e-6) to distinct levels. fp16 models must clamp further
#: (fp16 cannot represent 1e-8).
MIN_SCALE = 1e-8

#: the largest quantized magnitude of each quant type
QMAX = {name: row[1] for name, row in QUANT_TYPE_TABLE.items()}
#: the largest int8 weight when weights take 7 bits (ONNX Runtime's ``reduce_range``)
REDUCED_WEIGHT_QMAX = 63.0


def cpu_saturates_u8s8() -> bool:
    """Whether ONNX Runtime's CPU kernels on this machine multiply u8 activations by s8 weights
    with 16-bit intermediate sums (x86-64 without VNNI: VPMADDUBSW), which saturate with 8-bit
    weights; its quantizer's ``reduce_range`` (7-bit weights) is the documented remedy. Decided
    by :func:`qdq_optuna.machine.current_cpu` (a simulated CPU included); False where the flags
    cannot be read (other systems, other processors)."""
    return current_cpu().saturates_u8s8
_FLOAT_TYPES = {TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16}
_STATS_FORMAT = "qdq_optuna.statistics"
_STATS_VERSION = 1


# --------------------------------------------------------------------------------------------
# model helpers


def one_line(exc: BaseException) -> str:
    """Library messages can span lines; user errors must be one."""
    return " ".join(str(exc).split())


@dataclass(frozen=True)
class _InputSpec:
    name: str
    elem_type: int
    #: one entry per axis: the static size, or None for a symbolic / unknown one;
    #: None for the whole shape when the model does not give the rank
    dims: tuple[int | None, ...] | None


def _load_proto(model: ModelLike) -> tuple[onnx.ModelProto, str | None]:
    """The proto (external data left on disk) and the folder external data is relative to."""
    if isinstance(model, onnx.ModelProto):
        return model, None
    path = Path(model)
    if not path.is_file():
        raise ModelError(f"model {path}: file not found")
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # protobuf raises several unrelated types
        raise ModelError(f"model {path}: not a readable ONNX model ({one_line(exc)})") from exc
    return proto, str(path.resolve().parent)


def _input_specs(model: onnx.ModelProto) -> dict[str, _InputSpec]:
    """Graph inputs that must be fed (old models also list their initializers as inputs)."""
    inits = {t.name for t in model.graph.initializer}
    specs: dict[str, _InputSpec] = {}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        dims: tuple[int | None, ...] | None = None
        if tt.HasField("shape"):
            dims = tuple(
                d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None
                for d in tt.shape.dim
            )
        specs[vi.name] = _InputSpec(vi.name, tt.elem_type, dims)
    return specs


def _np_dtype(spec: _InputSpec) -> np.dtype:
    if spec.elem_type in (TensorProto.UNDEFINED, TensorProto.STRING):
        raise ModelError(f"model input {spec.name!r}: unsupported element type for calibration")
    return np.dtype(helper.tensor_dtype_to_np_dtype(spec.elem_type))


def _is_float_dtype(dtype: np.dtype) -> bool:
    return dtype.kind == "f" or dtype.name in ("bfloat16", "float8_e4m3fn")


def _shape_text(dims: tuple[int | None, ...]) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in dims) + "]"


# --------------------------------------------------------------------------------------------
# calibration data


def _check_array(source: str, spec: _InputSpec, arr: np.ndarray) -> np.ndarray:
    """Validate one input's samples and cast them to the model's element type."""
    where = f"{source}: input {spec.name!r}"
    if arr.ndim == 0:
        raise UserError(f"{where} is a scalar; it needs the samples on axis 0")
    if arr.shape[0] == 0:
        raise UserError(f"{where} has no samples")
    if spec.dims is not None:
        if arr.ndim != len(spec.dims):
            raise UserError(
                f"{where} has shape {list(arr.shape)} (rank {arr.ndim}) but the model expects "
                f"rank {len(spec.dims)} {_shape_text(spec.dims)}"
            )
        for axis, (got, want) in enumerate(zip(arr.shape, spec.dims)):
            if axis > 0 and want is not None and got != want:
                raise UserError(
                    f"{where} has size {got} on axis {axis} but the model expects "
                    f"{_shape_text(spec.dims)}"
                )
        if spec.dims and spec.dims[0] is not None and arr.shape[0] % spec.dims[0]:
            raise UserError(
                f"{where} has {arr.shape[0]} samples, not a multiple of the model's fixed "
                f"batch size {spec.dims[0]}"
            )
    want = _np_dtype(spec)
    if arr.dtype == want:
        return arr
    mismatch = UserError(f"{where} has dtype {arr.dtype} but the model expects {want}")
    if _is_float_dtype(want) and _is_float_dtype(arr.dtype):
        cast = arr.astype(want)
        if not np.array_equal(np.isfinite(arr), np.isfinite(cast)):
            raise UserError(f"{where}: values overflow the model's {want} input")
        return cast
    if want.kind in "iu" and arr.dtype.kind in "iu":
        info = np.iinfo(want)
        if arr.size and (arr.min() < info.min or arr.max() > info.max):
            raise UserError(f"{where}: values do not fit the model's {want} input")
        return arr.astype(want)
    raise mismatch


def sample_count(data: Mapping[str, np.ndarray], source: str = "calibration data") -> int:
    """Number of samples (axis 0), which every input must agree on."""
    if not data:
        raise UserError(f"{source}: no input arrays")
    counts = {name: (arr.shape[0] if np.ndim(arr) else 0) for name, arr in data.items()}
    if len(set(counts.values())) > 1:
        listed = ", ".join(f"{n!r}: {c}" for n, c in counts.items())
        raise UserError(f"{source}: inputs have different sample counts ({listed})")
    count = next(iter(counts.values()))
    if count == 0:
        raise UserError(f"{source}: input {next(iter(counts))!r} has no samples")
    return count


def load_calibration_data(path: str | os.PathLike, model: ModelLike,
                          what: str = "calibration data") -> dict[str, np.ndarray]:
    """Read an ``.npz`` of graph-input arrays (samples on axis 0) checked against the model.

    Floating-point arrays are cast to the model's float type (``float64`` data is common) and
    integer arrays to its integer type when the values fit; int/float mismatches are refused,
    since they usually mean the arrays were saved under the wrong names. ``what`` names the
    argument in errors.
    """
    source = f"{what} {path}"
    file = Path(path)
    if not file.is_file():
        raise UserError(f"{source}: file not found")
    with file.open("rb") as f:
        head = f.read(6)
    if not head.startswith((b"PK", b"\x93NUMPY")):  # numpy would call it "pickled data"
        raise UserError(f"{source}: not an .npz file (save the inputs with numpy.savez, "
                        "input name -> array with the samples on axis 0)")
    try:
        loaded = np.load(file, allow_pickle=False)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise UserError(f"{source}: not a readable .npz file ({one_line(exc)})") from exc
    if not isinstance(loaded, np.lib.npyio.NpzFile):
        raise UserError(
            f"{source}: a single array, not an .npz mapping each model input name to its "
            "samples (save it with numpy.savez)"
        )
    proto, _ = _load_proto(model)
    specs = _input_specs(proto)
    with loaded:
        names = list(loaded.files)
        if not names:
            raise UserError(f"{source}: the file holds no arrays")
        for name in names:
            if name not in specs:
                raise UserError(
                    f"{source}: array {name!r} is not a model input "
                    f"(inputs: {', '.join(specs) or 'none'})"
                )
        for name in specs:
            if name not in names:
                raise UserError(f"{source}: input {name!r} is missing")
        data: dict[str, np.ndarray] = {}
        for name in names:
            try:
                arr = loaded[name]
            except (OSError, ValueError, zipfile.BadZipFile) as exc:
                raise UserError(
                    f"{source}: input {name!r} cannot be read ({one_line(exc)})"
                ) from exc
            data[name] = _check_array(source, specs[name], arr)
    sample_count(data, source)
    return data


def random_calibration_data(
    model: ModelLike,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
    samples: int = 8,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """Synthetic inputs for runs without calibration data (scales are then only a guess).

    ``input_shapes`` gives full input shapes (axis 0 included) for inputs with symbolic sizes;
    a symbolic axis 0 needs none since it is the sample axis. Float inputs are standard normal,
    integer and bool inputs zero (ids and masks of zero are valid in nearly every model).
    """
    if samples < 1:
        raise OptionError(f"random calibration data: samples must be >= 1, got {samples}")
    proto, _ = _load_proto(model)
    specs = _input_specs(proto)
    shapes = dict(input_shapes or {})
    for name in shapes:
        if name not in specs:
            raise UserError(
                f"--input-shapes: {name!r} is not a model input (inputs: {', '.join(specs)})"
            )
    rng = np.random.default_rng(seed)
    data: dict[str, np.ndarray] = {}
    for name, spec in specs.items():
        dims = _resolve_shape(spec, shapes.get(name))
        dtype = _np_dtype(spec)
        per_batch = dims[0] if spec.dims and spec.dims[0] is not None else 1
        count = -(-samples // per_batch) * per_batch
        shape = (count, *dims[1:])
        if _is_float_dtype(dtype):
            data[name] = rng.standard_normal(shape, dtype=np.float32).astype(dtype)
        else:
            data[name] = np.zeros(shape, dtype=dtype)
    return data


def _resolve_shape(spec: _InputSpec, given: Sequence[int] | None) -> tuple[int, ...]:
    if given is not None:
        shape = tuple(int(d) for d in given)
        if any(d < 1 for d in shape):
            raise UserError(f"--input-shapes: {spec.name!r} has a non-positive size {list(shape)}")
        if spec.dims is not None:
            if len(shape) != len(spec.dims):
                raise UserError(
                    f"--input-shapes: {spec.name!r} has rank {len(shape)} but the model input "
                    f"is {_shape_text(spec.dims)}"
                )
            for got, want in zip(shape, spec.dims):
                if want is not None and got != want:
                    raise UserError(
                        f"--input-shapes: {spec.name!r} is {list(shape)} but the model input "
                        f"is {_shape_text(spec.dims)}"
                    )
        return shape
    if spec.dims is None:
        raise UserError(f"model input {spec.name!r} has no shape; give one with --input-shapes")
    if any(d is None for d in spec.dims[1:]):
        raise UserError(
            f"model input {spec.name!r} has symbolic sizes {_shape_text(spec.dims)}; "
            "give its shape with --input-shapes"
        )
    return tuple(d if d is not None else 1 for d in spec.dims)


# --------------------------------------------------------------------------------------------
# sessions and batches


def make_session(
    model: bytes | str | os.PathLike,
    *,
    optimize: bool,
    threads: int = 0,
    providers: Sequence[str] = ("CPUExecutionProvider",),
    external_data_dir: str | None = None,
    config: Sequence[tuple[str, str]] = (),
):
    """An ORT session; ``external_data_dir`` resolves external weights of a model given as bytes;
    ``config``: session config entries (key, value) it is created with."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = (
        ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if optimize
        else ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    )
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    for key, value in config:
        opts.add_session_config_entry(key, value)
    if external_data_dir is not None:
        opts.add_session_config_entry(
            "session.model_external_initializers_file_folder_path", external_data_dir
        )
    source = model if isinstance(model, bytes) else os.fspath(model)
    # an export in external mode references the input's weight files where they are
    mapped = map_external_sources(opts, source) if isinstance(source, str) else []
    session = ort.InferenceSession(source, opts, providers=list(providers))
    del mapped  # the session has copied what it needs
    return session


#: ONNX Runtime's names of the float input types numpy has
_FLOAT_INPUTS = {"tensor(float)": np.float32, "tensor(float16)": np.float16,
                 "tensor(double)": np.float64}


def iter_batches(
    session: Any, data: Mapping[str, np.ndarray], batch_size: int
) -> Iterator[dict[str, np.ndarray]]:
    """Feeds of ``batch_size`` samples; a model with a fixed batch axis gets its own size."""
    if batch_size < 1:
        raise OptionError(f"--batch-size must be >= 1, got {batch_size}")
    feeds = {}
    fixed = False
    for meta in session.get_inputs():
        if meta.name not in data:
            raise UserError(f"calibration data: input {meta.name!r} is missing")
        arr = data[meta.name]
        want = _FLOAT_INPUTS.get(meta.type)
        if want is not None and arr.dtype.kind == "f" and arr.dtype != want:
            arr = arr.astype(want)  # the same data for an FP32 model and its FP16 version
        feeds[meta.name] = arr
        if meta.shape and isinstance(meta.shape[0], int) and meta.shape[0] > 0:
            batch_size, fixed = meta.shape[0], True
    total = sample_count(feeds)
    if fixed and total % batch_size:
        raise UserError(
            f"calibration data: {total} samples do not fill whole batches of the model's fixed "
            f"batch size {batch_size}"
        )
    for start in range(0, total, batch_size):
        yield {name: arr[start : start + batch_size] for name, arr in feeds.items()}


# --------------------------------------------------------------------------------------------
# statistics


@dataclass
class TensorStatistics:
    """Range and |x| histogram of one tensor over the calibration data.

    The histogram has ``len(hist)`` equal bins over ``[0, hist_amax]``; ``hist_amax`` grows by
    whole multiples so re-binning is exact (merging neighbouring bins) and counts never drift,
    at the cost of up to half the bins lying above the final range.
    Non-finite values are left out: an ``-inf`` attention mask must not blow up the scale.
    """

    min: float = 0.0
    max: float = 0.0
    count: int = 0
    hist_amax: float = 0.0
    hist: np.ndarray = field(default_factory=lambda: np.zeros(2048, dtype=np.int64))

    @classmethod
    def empty(cls, bins: int = 2048) -> TensorStatistics:
        if bins < 1:
            raise OptionError(f"--calibration-bins must be >= 1, got {bins}")
        return cls(hist=np.zeros(int(bins), dtype=np.int64))

    @property
    def amax(self) -> float:
        return max(abs(self.min), abs(self.max))

    @property
    def bin_width(self) -> float:
        return self.hist_amax / len(self.hist)

    def update(self, values: np.ndarray) -> None:
        """Fold one batch of a tensor into the statistics."""
        arr = np.asarray(values)
        if arr.dtype.kind != "f":  # ints, bools, bfloat16 / float8 (ml_dtypes)
            arr = arr.astype(np.float64)
        arr = arr.reshape(-1)
        finite = np.isfinite(arr)
        if not finite.all():
            arr = arr[finite]
        if arr.size == 0:
            return
        lo, hi = float(arr.min()), float(arr.max())
        if self.count == 0:
            self.min, self.max = lo, hi
        else:
            self.min, self.max = min(self.min, lo), max(self.max, hi)
        amax = max(-lo, hi)
        if amax > self.hist_amax:
            self._widen(amax)
        if self.hist_amax > 0:
            counts, _ = np.histogram(np.abs(arr), bins=len(self.hist), range=(0.0, self.hist_amax))
            self.hist += counts
        else:
            self.hist[0] += arr.size
        self.count += int(arr.size)

    def _widen(self, amax: float) -> None:
        """Grow the range to cover ``amax`` by merging groups of ``factor`` old bins."""
        old = self.hist_amax
        if old <= 0:
            # everything so far was exactly zero, which stays in the first bin
            self.hist_amax = amax
            return
        factor = max(2, math.ceil(amax / old))
        while old * factor < amax:
            factor += 1
        bins = len(self.hist)
        merged = np.bincount(
            np.arange(bins) // factor, weights=self.hist.astype(np.float64), minlength=bins
        )
        self.hist = np.rint(merged[:bins]).astype(np.int64)
        self.hist_amax = old * factor

    def to_dict(self) -> dict:
        return {
            "min": float(self.min),
            "max": float(self.max),
            "count": int(self.count),
            "hist_amax": float(self.hist_amax),
            "hist": [int(c) for c in self.hist],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TensorStatistics:
        hist = np.asarray(d["hist"], dtype=np.int64)
        if hist.ndim != 1 or hist.size == 0:
            raise ValueError("histogram must be a non-empty list")
        return cls(
            min=float(d["min"]),
            max=float(d["max"]),
            count=int(d["count"]),
            hist_amax=float(d["hist_amax"]),
            hist=hist,
        )


def collect_statistics(
    model: ModelLike,
    tensors: Sequence[str],
    data: Mapping[str, np.ndarray],
    *,
    bins: int = 2048,
    batch_size: int = 1,
    providers: Sequence[str] = ("CPUExecutionProvider",),
    external_data_dir: str | os.PathLike | None = None,
) -> dict[str, TensorStatistics]:
    """Statistics of every requested tensor from one ONNX Runtime pass over ``data``.

    The model is copied and each requested intermediate tensor made a graph output; graph
    optimizations are off so that every tensor still exists. Graph inputs come straight from
    ``data`` and initializers from their values. Pass a path for models with external data
    (or a proto and ``external_data_dir``, the folder its external locations are relative to).
    """
    proto, external_dir = _load_proto(model)
    if external_dir is None and external_data_dir is not None:  # a proto whose weights are on disk
        external_dir = str(external_data_dir)
    label = f"model {model}" if isinstance(model, (str, os.PathLike)) else "model"
    graph = proto.graph
    inits = {t.name: t for t in graph.initializer}
    inputs = set(_input_specs(proto))
    produced = {out for node in graph.node for out in node.output if out}
    outputs = {o.name for o in graph.output}
    names = list(dict.fromkeys(tensors))
    for name in names:
        if name not in produced and name not in inputs and name not in inits:
            raise UserError(f"{label}: tensor {name!r} is not in the main graph")
    stats = {name: TensorStatistics.empty(bins) for name in names}

    fetch = [n for n in names if n in produced]
    if fetch:
        copy = _with_outputs(proto, [n for n in fetch if n not in outputs])
        try:
            serialized = copy.SerializeToString()
        except ValueError as exc:
            raise ModelError(
                f"{label}: too large to serialize in memory; pass the model's path "
                f"({one_line(exc)})"
            ) from exc
        del copy
        try:
            session = make_session(
                serialized, optimize=False, providers=providers, external_data_dir=external_dir
            )
        except Exception as exc:  # ORT raises its own exception types
            raise ModelError(f"{label}: ONNX Runtime cannot load it ({one_line(exc)})") from exc
        for feed in iter_batches(session, data, batch_size):
            try:
                values = session.run(fetch, feed)
            except Exception as exc:  # ORT raises its own exception types
                raise ModelError(
                    f"{label}: ONNX Runtime failed on the calibration data ({one_line(exc)})"
                ) from exc
            for name, value in zip(fetch, values):
                stats[name].update(value)
    for name in names:
        if name in inputs and name not in produced:
            if name not in data:
                raise UserError(f"calibration data: input {name!r} is missing")
            stats[name].update(data[name])
        elif name in inits and name not in produced:
            stats[name].update(numpy_helper.to_array(inits[name], external_dir or ""))
    return stats


def _with_outputs(model: onnx.ModelProto, names: Sequence[str]) -> onnx.ModelProto:
    """A copy of ``model`` with ``names`` appended as outputs, typed where inference knows."""
    try:
        copy = onnx.shape_inference.infer_shapes(model)
    except Exception:  # inference is only a source of output types
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
    types = {vi.name: vi.type.tensor_type.elem_type for vi in copy.graph.value_info}
    types.update({vi.name: vi.type.tensor_type.elem_type for vi in copy.graph.output})
    # keep the caller's value_info only: inferred shapes could disagree with ORT's own
    del copy.graph.value_info[:]
    copy.graph.value_info.extend(model.graph.value_info)
    for name in names:
        elem = types.get(name, TensorProto.UNDEFINED)
        if elem != TensorProto.UNDEFINED:
            copy.graph.output.append(helper.make_tensor_value_info(name, elem, None))
        else:
            # ONNX Runtime infers the type of an untyped graph output itself
            copy.graph.output.append(onnx.ValueInfoProto(name=name))
    return copy


def statistics_json(stats: Mapping[str, TensorStatistics], *, fingerprint: str) -> bytes:
    """The statistics' cache file as :func:`load_statistics` reads it back."""
    payload = {
        "format": _STATS_FORMAT,
        "version": _STATS_VERSION,
        "fingerprint": fingerprint,
        "tensors": {name: s.to_dict() for name, s in stats.items()},
    }
    return json.dumps(payload).encode()


def load_statistics(
    path: str | os.PathLike, *, fingerprint: str
) -> dict[str, TensorStatistics] | None:
    """Cached statistics, or None when absent, unreadable or made for another model/data set."""
    try:
        with open(path, encoding="utf-8") as fh:
            payload = json.load(fh)
    except (OSError, ValueError):
        return None
    if (
        not isinstance(payload, dict)
        or payload.get("format") != _STATS_FORMAT
        or payload.get("version") != _STATS_VERSION
        or payload.get("fingerprint") != fingerprint
        or not isinstance(payload.get("tensors"), dict)
    ):
        return None
    try:
        return {name: TensorStatistics.from_dict(d) for name, d in payload["tensors"].items()}
    except (KeyError, TypeError, ValueError):
        return None


# --------------------------------------------------------------------------------------------
# scales


def _check_quant_type(quant_type: str) -> None:
    QuantType.parse(quant_type)


def activation_params(
    stats: TensorStatistics,
    *,
    method: str,
    quant_type: str,
    percentile: float = 99.99,
    bound: tuple[float, float] | None = None,
) -> tuple[float, int]:
    """``(scale, zero_point)`` for one activation.

    ``percentile``, ``entropy`` and ``mse`` find a clipping threshold on |x|; for ``uint8`` it
    clips both ends of the observed range (``max' = min(max, t)``, ``min' = max(min, -t)``).
    ``bound``: the interval outside which every reader of the tensor saturates
    (:func:`reader_bounds`); the observed range is cut to it first (for the symmetric types
    the threshold is then at most the cut range's larger end).
    """
    if method not in METHODS:
        raise OptionError(
            f"--calibration-method: unknown method {method!r} (choose {', '.join(METHODS)})"
        )
    _check_quant_type(quant_type)
    if method == "percentile" and not 0.0 < percentile <= 100.0:
        raise OptionError(f"--percentile must be in (0, 100], got {percentile}")
    amax = stats.amax
    if stats.count == 0 or amax <= 0 or stats.hist_amax <= 0 or not stats.hist.any():
        threshold = amax
    elif method == "minmax":
        threshold = amax
    elif method == "percentile":
        threshold = _percentile_threshold(stats, percentile)
    elif method == "entropy":
        nq = 256 if quant_type == QuantType.UINT8 and stats.min >= 0 else 128
        threshold = _entropy_threshold(stats.hist, stats.bin_width, nq)
    else:
        threshold = _mse_threshold(stats, quant_type)
    lo, hi = _cut_range(stats, bound)
    return _params(lo, hi, min(threshold, amax, max(-lo, hi, 0.0)), quant_type)


def activation_scales(
    stats: Mapping[str, TensorStatistics],
    *,
    method: str,
    quant_type: str,
    percentile: float = 99.99,
    bounds: Mapping[str, tuple[float, float]] | None = None,
) -> dict[str, tuple[float, int]]:
    """``activation_params`` for every tensor; ``bounds``: :func:`reader_bounds` of the graph
    the tensors belong to (None: each tensor's own statistics alone)."""
    bounds = bounds or {}
    return {
        name: activation_params(s, method=method, quant_type=quant_type, percentile=percentile,
                                bound=bounds.get(name))
        for name, s in stats.items()
    }


def _cut_range(stats: TensorStatistics,
               bound: tuple[float, float] | None) -> tuple[float, float]:
    """The observed range cut to ``bound`` (a range entirely outside it shrinks to its edge)."""
    if bound is None:
        return stats.min, stats.max
    lo = min(max(stats.min, bound[0]), bound[1])
    return lo, max(min(stats.max, bound[1]), lo)


def clipped_by_readers(stats: Mapping[str, TensorStatistics],
                       bounds: Mapping[str, tuple[float, float]]) -> list[str]:
    """The tensors whose observed range reaches past what their readers distinguish (the
    ones :func:`activation_scales` cuts), sorted."""
    return sorted(name for name, s in stats.items() if name in bounds and s.count
                  and (s.min < bounds[name][0] or s.max > bounds[name][1]))


# --------------------------------------------------------------------------------------------
# ranges that stop where the readers stop caring

#: how far a saturating reader's output may still move beyond the cut, in steps of an 8-bit
#: quantizer over its output range: the rounding error of 8 bits is uniform, RMS step/sqrt(12)
#: (0.29 step); a tail of 1/8 step lost at the cut adds under 10 % to that
#: (sqrt(1/12 + 1/64) = 1.09 x sqrt(1/12)), while a cut range makes every step finer. Sigmoid
#: (output range 1): 1 - sigmoid(b) = 1/2040 at b = ln(2039) = 7.62; Tanh (output range 2):
#: 1 - tanh(b) = 2/2040 at b = ln(2039) / 2 = 3.81.
SATURATION_TAIL_STEPS = 1 / 8
_TAIL = SATURATION_TAIL_STEPS / 255.0
_SIGMOID_EDGE = math.log((1 - _TAIL) / _TAIL)
_INF = math.inf


def _hard_sigmoid(node, constant) -> tuple[float, float] | None:
    """max(0, min(1, alpha * x + beta)) is flat outside (0 - beta) / alpha .. (1 - beta) / alpha."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    alpha, beta = float(attrs.get("alpha", 0.2)), float(attrs.get("beta", 0.5))
    if alpha == 0:
        return None
    ends = sorted(((0 - beta) / alpha, (1 - beta) / alpha))
    return ends[0], ends[1]


def _clip(node, constant) -> tuple[float, float] | None:
    """Clip's min / max: its inputs (opset 11 on; absent: unbounded; not a constant: unknown)
    or its attributes (before opset 11). Relu6 is a Clip at 0 and 6."""
    ends = []
    for slot, attr, default in ((1, "min", -_INF), (2, "max", _INF)):
        given = [helper.get_attribute_value(a) for a in node.attribute if a.name == attr]
        if given:
            ends.append(float(given[0]))
        elif len(node.input) > slot and node.input[slot]:
            value = constant(node.input[slot])
            if value is None or np.size(value) != 1:
                return None
            ends.append(float(np.asarray(value).reshape(-1)[0]))
        else:
            ends.append(default)
    return (ends[0], ends[1]) if ends[0] <= ends[1] else None


#: op type -> the interval of its data input outside which its output no longer moves (within
#: :data:`SATURATION_TAIL_STEPS` of an 8-bit step where it only approaches its limit): a tuple,
#: or a function of the node and a constant's value (None: not known for this node)
READER_RANGES = {
    "Sigmoid": (-_SIGMOID_EDGE, _SIGMOID_EDGE),
    "Tanh": (-_SIGMOID_EDGE / 2, _SIGMOID_EDGE / 2),  # tanh(x) = 2 * sigmoid(2x) - 1
    "HardSigmoid": _hard_sigmoid,
    "Clip": _clip,
    "Relu": (0.0, _INF),
    "HardSwish": (-3.0, _INF),  # x * max(0, min(1, x / 6 + 1 / 2)): 0 below -3
}


#: ops whose outputs hold only values of their data input (moved, picked, or the largest of a
#: window): cutting the input to the interval its outputs' readers distinguish is the same as
#: cutting the outputs (``x -> Reshape -> Sigmoid``); Resize and AveragePool mix values, so they
#: are no such op
PASS_THROUGH_OPS = frozenset({"Identity", "Reshape", "Transpose", "Squeeze", "Unsqueeze",
                              "Flatten", "MaxPool", "Slice", "Split", "Gather",
                              "GatherElements", "DepthToSpace", "SpaceToDepth"})


def _subgraph_reads(nodes: Sequence) -> set[str]:
    """Every tensor a node inside an If / Loop / Scan body reads (outer tensors included)."""
    reads: set[str] = set()
    for node in nodes:
        for attr in node.attribute:
            for body in [attr.g] * attr.HasField("g") + list(attr.graphs):
                reads.update(body_input for n in body.node for body_input in n.input)
                reads |= _subgraph_reads(body.node)
    return reads


def reader_bounds(graph: Graph) -> dict[str, tuple[float, float]]:
    """Per tensor of ``graph``, the interval outside which every reader saturates or clips
    (:data:`READER_RANGES`; several readers: the hull of their intervals). A tensor that is a
    graph output, is read by any other op or in another input slot, or by a node whose bound
    is unknown (a Clip limit computed at run time) gets none. Readers that only move values
    (:data:`PASS_THROUGH_OPS`) or map them by a scalar constant (``x * a``, ``x + b``, ...)
    pass their output's interval back; ``x * gate(x)`` with a gate that is exactly 0 below
    ``t`` (a HardSwish written out: ``x * Clip(x + 3, 0, 6)``, or ``x * HardSigmoid(x)``) cuts
    ``x`` below ``t``. ``graph``: the float graph, before any Q/DQ is placed (an export's
    DequantizeLinear stands between a tensor and these same readers)."""
    def constant(name: str):
        return graph.array(name) if name in graph.initializers else None

    hull: dict[str, tuple[float, float]] = {}
    barred = set(graph.graph_outputs) | _subgraph_reads(graph.nodes)

    def settled(name: str) -> tuple[float, float] | None:
        return None if name in barred else hull.get(name)

    # readers before producers: a node's outputs are settled when it is reached
    for node in reversed(graph.nodes):
        reads = (_node_reads(node, graph, settled, constant)
                 if node.domain in ("", "ai.onnx") else {})
        for name in node.input:
            bound = reads.get(name)
            if not name:
                continue
            if bound is None:
                barred.add(name)
            elif name in hull:
                hull[name] = (min(hull[name][0], bound[0]), max(hull[name][1], bound[1]))
            else:
                hull[name] = bound
    return {name: b for name, b in hull.items() if name not in barred}


def _node_reads(node, graph: Graph, settled, constant) -> dict[str, tuple[float, float]]:
    """What one node tells apart of each input it reads (inputs left out: everything)."""
    data = node.input[0] if node.input else ""
    rule = READER_RANGES.get(node.op_type)
    if rule is not None:
        bound = rule(node, constant) if callable(rule) else rule
        return {data: bound} if bound is not None else {}
    outs = [settled(o) for o in node.output if o]
    if node.op_type in PASS_THROUGH_OPS:
        if not outs or None in outs:
            return {}
        return {data: (min(b[0] for b in outs), max(b[1] for b in outs))}
    gated = _gated_product(node, graph, constant)
    if gated is not None:
        return gated
    if node.op_type in _AFFINE and len(node.input) == 2 and outs and outs[0] is not None:
        for slot in (0, 1):
            value = constant(node.input[1 - slot])
            if value is not None and np.size(value) == 1 and node.input[slot] != \
                    node.input[1 - slot]:
                bound = _affine_back(node.op_type, slot, float(np.ravel(value)[0]), outs[0])
                return {node.input[slot]: bound} if bound is not None else {}
    return {}


#: elementwise ops that map a tensor by a scalar constant (monotone, so an interval of the
#: output is an interval of the input)
_AFFINE = frozenset({"Add", "Sub", "Mul", "Div"})


def _affine_back(op: str, slot: int, c: float,
                 out: tuple[float, float]) -> tuple[float, float] | None:
    """The interval of the data input (``slot``) that ``op`` with the scalar ``c`` maps onto
    ``out``; None where the map is not invertible (a factor 0)."""
    lo, hi = out
    if op == "Add":
        ends = (lo - c, hi - c)
    elif op == "Sub":
        ends = (lo + c, hi + c) if slot == 0 else (c - hi, c - lo)
    elif c == 0 or (op == "Div" and slot == 1):
        return None
    elif op == "Mul":
        ends = (lo / c, hi / c)
    else:  # x / c
        ends = (lo * c, hi * c)
    return min(ends), max(ends)


def _gated_product(node, graph: Graph, constant) -> dict[str, tuple[float, float]] | None:
    """``Mul(x, gate)`` where ``gate`` is computed from ``x`` and is exactly 0 for ``x <= t``
    (so is the product): ``{x: (t, inf)}``; None for any other node. Gates: ``HardSigmoid(x)``
    (alpha > 0: t = -beta / alpha) and ``Clip(x + c, 0, hi)`` (t = -c)."""
    if node.op_type != "Mul" or len(node.input) != 2:
        return None
    for x, gate in (node.input, node.input[::-1]):
        made = graph.producer.get(gate)
        g = graph.nodes[made[0]] if made else None
        if g is None or not g.input:
            continue
        if g.op_type == "HardSigmoid" and g.input[0] == x:
            attrs = {a.name: helper.get_attribute_value(a) for a in g.attribute}
            alpha, beta = float(attrs.get("alpha", 0.2)), float(attrs.get("beta", 0.5))
            if alpha > 0:
                return {x: (-beta / alpha, _INF)}
        if g.op_type == "Clip" and _clip(g, constant) is not None and _clip(g, constant)[0] == 0:
            made = graph.producer.get(g.input[0])
            add = graph.nodes[made[0]] if made else None
            if add is not None and add.op_type == "Add" and x in add.input:
                other = add.input[1] if add.input[0] == x else add.input[0]
                value = constant(other)
                if value is not None and np.size(value) == 1:
                    return {x: (-float(np.ravel(value)[0]), _INF)}
    return None


#: ops ONNX Runtime runs on 8-bit data when each output carries its input's scale and zero
#: point: ``quantize_static`` gives their outputs the input's parameters
#: (``quantize_output_same_as_input``), and ONNX Runtime's optimizer then drops their
#: DQ -> op -> Q (MaxPool becomes an 8-bit NhwcMaxPool, Split splits 8-bit data). With scales
#: of their own the Q/DQ stay and the op runs in float between them.
SAME_SCALE_OPS = frozenset({"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Resize",
                            "MaxPool", "AveragePool", "Slice", "Split", "Gather",
                            "GatherElements", "TopK"})


def _same_scale_pairs(nodes: Sequence, scales: Mapping):
    """``(input, output)`` of every :data:`SAME_SCALE_OPS` node whose data input has
    parameters, in ``nodes``' (topological) order."""
    for node in nodes:
        if node.op_type in SAME_SCALE_OPS and node.input and node.input[0] in scales:
            for name in node.output:
                if name:
                    yield node.input[0], name


def share_input_scales(nodes: Sequence, scales: Mapping) -> dict:
    """``scales`` with every output of a :data:`SAME_SCALE_OPS` node given its data input's
    parameters (``nodes`` in topological order, so a chain such as SPPF's MaxPools shares one
    scale); keys that are not plain tensor names (mixed precision) are left alone."""
    out = dict(scales)
    for source, name in _same_scale_pairs(nodes, out):
        out[name] = out[source]
    return out


#: a Concat input joins its output's quantization parameters when its own range is at least this
#: share of the joined range (one bit of resolution lost at most); ONNX Runtime's QLinearConcat
#: then copies that input's bytes instead of requantizing them through a lookup table
CONCAT_SHARE_RATIO = 0.5


def share_concat_scales(nodes: Sequence, scales: Mapping, quant_type: str,
                        ratio: float = CONCAT_SHARE_RATIO) -> dict:
    """``scales`` with each Concat's output and its inputs of a comparable range given one set
    of parameters: the union of their ranges.

    Includes :func:`share_input_scales`: tensors a :data:`SAME_SCALE_OPS` chain ties together
    stay tied (a Split output joining a Concat takes the Split's input and its other outputs
    along, or the Split would leave 8-bit data). A group joins only when its narrowest member
    keeps ``ratio`` of the joined range, so a Concat of box coordinates and class scores keeps
    its requantization. On the YOLO-like zoo model with percentile scales, 44 of 47 Concat inputs
    needed a requantization before; ``quantize_static``'s min/max scales share by chance where
    one input spans the output's range."""
    out = share_input_scales(nodes, scales)
    parent: dict[str, str] = {}

    def find(t: str) -> str:
        while parent.get(t, t) != t:
            t = parent[t]
        return t

    for source, name in _same_scale_pairs(nodes, out):  # the ties share_input_scales made
        parent[find(name)] = find(source)
    members: dict[str, list[str]] = {}
    for name in out:
        if isinstance(name, str):
            members.setdefault(find(name), []).append(name)
    ranges = {root: _param_range(out[names[0]], quant_type) for root, names in members.items()}
    narrowest = {root: r[1] - r[0] for root, r in ranges.items()}
    joined: set[str] = set()
    for node in nodes:
        if node.op_type != "Concat" or node.output[0] not in out:
            continue
        group = find(node.output[0])
        inputs = {find(t) for t in node.input if t in out} - {group}
        for root in sorted(inputs, key=lambda r: ranges[r][0] - ranges[r][1]):  # widest first
            lo = min(ranges[group][0], ranges[root][0])
            hi = max(ranges[group][1], ranges[root][1])
            if min(narrowest[group], narrowest[root]) < ratio * (hi - lo):
                continue
            parent[root] = group
            members[group] += members.pop(root)
            ranges[group] = (lo, hi)
            narrowest[group] = min(narrowest[group], narrowest.pop(root))
            joined.add(group)
    for root in joined & set(members):
        params = _range_params(*ranges[root], quant_type)
        for name in members[root]:
            out[name] = params
    return out


def _param_range(params: tuple[float, int], quant_type: str) -> tuple[float, float]:
    """The real range a ``(scale, zero_point)`` pair represents."""
    scale, zero_point = params
    if quant_type == QuantType.UINT8:
        return -zero_point * scale, (255 - zero_point) * scale
    return -QMAX[quant_type] * scale, QMAX[quant_type] * scale


def _range_params(lo: float, hi: float, quant_type: str) -> tuple[float, int]:
    """``(scale, zero_point)`` of a real range (uint8: asymmetric, the range always holds 0;
    the signed types: symmetric)."""
    if quant_type == QuantType.UINT8:
        lo, hi = min(lo, 0.0), max(hi, 0.0)
        scale = _floor_scale((hi - lo) / 255.0)
        return scale, int(np.clip(round(-lo / scale), 0, 255))
    return _floor_scale(max(-lo, hi) / QMAX[quant_type]), 0


def _params(lo: float, hi: float, threshold: float, quant_type: str) -> tuple[float, int]:
    """``lo`` .. ``hi``: the observed range (cut to the readers' bound)."""
    if quant_type == QuantType.UINT8:  # the observed range, clipped at the threshold
        return _range_params(max(lo, -threshold), min(hi, threshold), quant_type)
    return _range_params(-threshold, threshold, quant_type)


def _floor_scale(scale: float) -> float:
    # round through float32: that is the value stored in the model
    return max(float(np.float32(scale)), MIN_SCALE)


def _percentile_threshold(stats: TensorStatistics, percentile: float) -> float:
    cdf = np.cumsum(stats.hist)
    target = cdf[-1] * percentile / 100.0
    index = int(np.searchsorted(cdf, target, side="left"))
    return (min(index, len(cdf) - 1) + 1) * stats.bin_width


def _entropy_threshold(hist: np.ndarray, width: float, nq: int) -> float:
    """TensorRT's KL-divergence search: the threshold whose ``nq``-level copy loses least.

    The first bin takes its neighbour's count (as NVIDIA's pytorch-quantization does): the
    spike of exact zeros after a ReLU would otherwise dominate the divergence and drive the
    threshold far too low. Ties go to the larger threshold.
    """
    counts = hist.astype(np.float64)
    if len(counts) > 1:
        counts[0] = counts[1]
    nonzero = np.flatnonzero(counts)
    if nonzero.size == 0:
        return len(counts) * width
    last = int(nonzero[-1]) + 1
    if last <= nq:
        return last * width
    suffix = np.concatenate([np.cumsum(counts[::-1])[::-1], [0.0]])
    step = max(1, (last - nq) // 2048)
    best_i, best_kl = last, math.inf
    for i in range(nq, last + 1, step):
        sliced = counts[:i]
        p = sliced.copy()
        p[-1] += suffix[i]
        nonzero = p > 0
        group = (np.arange(i) * nq) // i
        group_sum = np.bincount(group, weights=sliced, minlength=nq)
        group_nonzero = np.bincount(group, weights=nonzero, minlength=nq)
        q = np.where(nonzero, (group_sum / np.maximum(group_nonzero, 1.0))[group], 0.0)
        kl = _kl_divergence(p, q)
        if kl <= best_kl:
            best_i, best_kl = i, kl
    return best_i * width


def _kl_divergence(p: np.ndarray, q: np.ndarray) -> float:
    """KL(p || q) of count vectors; empty q bins get a tiny count (as in TensorRT's smoothing)."""
    mask = p > 0
    p = p[mask]
    q = np.maximum(q[mask], 1e-4)
    p = p / p.sum()
    q = q / q.sum()
    return float(np.sum(p * np.log(p / q)))


def _mse_threshold(stats: TensorStatistics, quant_type: str) -> float:
    """Threshold minimizing the expected squared error, values spread evenly within each bin.

    Searched on a coarse grid of bin edges, then bin by bin around the best coarse point:
    the error curve is smooth at that scale and a full scan costs ~10x more per tensor.
    """
    nonzero = np.flatnonzero(stats.hist)
    counts = stats.hist[nonzero].astype(np.float64)
    width = stats.bin_width
    lo = nonzero * width
    hi = lo + width
    amax = stats.amax
    pos, neg = max(stats.max, 0.0), max(-stats.min, 0.0)

    def errors(edges: np.ndarray) -> np.ndarray:
        t = np.minimum(edges * width, amax)[:, None]
        top = np.minimum(hi, t)
        inside = np.maximum(top - lo, 0.0)
        # clipped part of each bin: integral of (x - t)^2 over [max(lo, t), hi]
        clipped = (np.maximum(hi - t, 0.0) ** 3 - np.maximum(lo - t, 0.0) ** 3) / 3.0
        if quant_type == QuantType.FP8:
            scale = t / 448.0
            y = np.maximum((lo + inside / 2.0) / scale, 2.0**-9)
            ulp = 2.0 ** (np.clip(np.floor(np.log2(y)), -6, 8) - 3) * scale
            rounding = inside * ulp**2 / 12.0
        else:
            if quant_type == QuantType.INT8:
                scale = t / 127.0
            else:
                scale = (np.minimum(pos, t) + np.minimum(neg, t)) / 255.0
            scale = np.maximum(scale, MIN_SCALE)
            rounding = np.where(
                inside > 0, _rounding_integral(top, scale) - _rounding_integral(lo, scale), 0.0
            )
        return ((rounding + clipped) * counts).sum(axis=1)

    last = int(nonzero[-1]) + 1
    stride = max(1, last // 128)
    coarse = np.unique(np.append(np.arange(stride, last + 1, stride), last))
    best = int(coarse[int(np.argmin(errors(coarse)))])
    fine = np.arange(max(1, best - stride), min(last, best + stride) + 1)
    best = int(fine[int(np.argmin(errors(fine)))])
    return min(best * width, amax)


def _rounding_integral(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Integral from -scale/2 to x of (y - round(y / scale) * scale)^2 dy."""
    n = np.floor(x / scale + 0.5)
    r = x - n * scale
    return n * scale**3 / 12.0 + (r**3 + (scale / 2.0) ** 3) / 3.0
