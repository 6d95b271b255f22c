"""Models and input data given from Python, in the forms users already have.

The search reads calibration and validation data as one dict of stacked arrays (input name ->
samples on axis 0), checked against the model by :mod:`qdq_optuna.model.calibration`. Users of
``onnxruntime.quantization.quantize_static`` hold a ``CalibrationDataReader`` instead, others a
dict or a list of feeds: :func:`input_data` turns any of them into that dict, and
:func:`model_argument` takes a model as a path or an ``onnx.ModelProto``.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import onnx

from qdq_optuna.errors import ModelError, UserError
from qdq_optuna.model import calibration

#: what :func:`input_data` accepts: an ``.npz`` path, a mapping of arrays, an iterable of feed
#: dicts, or an ONNX Runtime ``CalibrationDataReader`` (anything with ``get_next()``)
DataLike = Any


def model_argument(model: Any) -> str | onnx.ModelProto:
    """A model argument as the model side takes it: a path (``str`` / ``PathLike``) as a
    string, an ``onnx.ModelProto`` as it is, serialized bytes parsed; anything else is one
    clear error (never the object's repr, which for a proto is the whole graph)."""
    if isinstance(model, onnx.ModelProto):
        return model
    if isinstance(model, (str, os.PathLike)):
        return os.fspath(model)
    if isinstance(model, (bytes, bytearray, memoryview)):
        proto = onnx.ModelProto()
        try:
            proto.ParseFromString(bytes(model))
        except Exception as exc:  # protobuf's DecodeError and friends
            raise ModelError(f"model: {len(model)} bytes that are not a serialized ONNX model "
                             f"({calibration.one_line(exc)})") from None
        return proto
    raise ModelError(f"model: expected a path or an onnx.ModelProto, got {type(model).__name__}")


def describe_model(model: str | os.PathLike | onnx.ModelProto) -> str:
    """A short name of a model for messages and reports: its path, or ``<ModelProto GRAPH>``."""
    if isinstance(model, onnx.ModelProto):
        return f"<ModelProto {model.graph.name or 'unnamed'}>"
    return os.fspath(model)


def fed_names(data: DataLike) -> tuple[str, ...]:
    """The input names ``data`` feeds, where that is known without reading it (an ``.npz``
    path's array names, a mapping's keys); () for a reader or an iterable, which can be
    drained only once. Prepare keeps these inputs fed even where the model gives them a
    default value (an initializer)."""
    if isinstance(data, (str, os.PathLike)):
        try:
            with np.load(data, allow_pickle=False) as loaded:
                return tuple(loaded.files) if isinstance(loaded, np.lib.npyio.NpzFile) else ()
        except Exception:  # noqa: BLE001 - reading it later reports what is wrong, as one line
            return ()
    if isinstance(data, Mapping):
        return tuple(str(k) for k in data)
    return ()


def input_data(data: DataLike, model: calibration.ModelLike,
               what: str = "calibration data") -> dict[str, np.ndarray]:
    """``data`` as one dict of stacked arrays, checked against the model's inputs.

    Args:
        data: an ``.npz`` path (read by :func:`calibration.load_calibration_data`), a mapping
            of input name -> samples on axis 0, an ONNX Runtime ``CalibrationDataReader``
            (drained with ``get_next()`` until it returns None), or an iterable of feed dicts
            as a session's ``run`` takes them (concatenated on axis 0).
        model: the model whose inputs the data must feed (a path or an ``onnx.ModelProto``).
        what: names the argument in errors.

    Returns:
        input name -> the samples stacked on axis 0.
    """
    if isinstance(data, (str, os.PathLike)):
        return calibration.load_calibration_data(data, model, what)
    if isinstance(data, Mapping):
        return _checked(dict(data), model, f"{what} (dict)")
    if callable(getattr(data, "get_next", None)):
        source = f"{what} ({type(data).__name__})"
        return _checked(_stack(_drain(data), source), model, source)
    if isinstance(data, Iterable) and not isinstance(data, (bytes, bytearray, np.ndarray)):
        source = f"{what} (iterable of feeds)"
        return _checked(_stack(data, source), model, source)
    raise UserError(f"{what}: expected an .npz path, a dict of arrays, an iterable of feed "
                    f"dicts or a CalibrationDataReader, got {type(data).__name__}")


def data_id(given: DataLike, loaded: Mapping[str, np.ndarray]) -> str:
    """How fingerprints and reports name input data: ``FILE.npz:<sha256>`` for a file, else
    ``python:<content digest>``."""
    if isinstance(given, (str, os.PathLike)):
        h = hashlib.sha256()
        with open(given, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
        return f"{os.path.basename(os.fspath(given))}:{h.hexdigest()[:16]}"
    return "python:" + data_digest(loaded)[:16]


def data_digest(data: Mapping[str, np.ndarray]) -> str:
    """A content digest of stacked input data (a resume fingerprint's stand-in for a file's
    sha256 when the data came from Python)."""
    h = hashlib.sha256()
    for name in sorted(data):
        arr = np.ascontiguousarray(data[name])
        h.update(f"{name}\0{arr.dtype.str}\0{arr.shape}\0".encode())
        h.update(arr.tobytes())
    return h.hexdigest()


def _drain(reader: Any) -> Iterable[Any]:
    while True:
        feed = reader.get_next()
        if feed is None:
            return
        yield feed


def _stack(feeds: Iterable[Any], source: str) -> dict[str, np.ndarray]:
    """Concatenate feed dicts on axis 0 (each feed holds one batch of every input)."""
    parts: dict[str, list[np.ndarray]] = {}
    names: list[str] | None = None
    count = 0
    for count, feed in enumerate(feeds, 1):
        if not isinstance(feed, Mapping):
            raise UserError(f"{source}: feed {count} is a {type(feed).__name__}, not a dict of "
                            "input name -> array")
        if names is None:
            names = list(feed)
        elif set(feed) != set(names):
            raise UserError(f"{source}: feed {count} has inputs {sorted(feed)}, the first feed "
                            f"{sorted(names)}")
        for name, value in feed.items():
            arr = np.asarray(value)
            if arr.ndim == 0:
                raise UserError(f"{source}: feed {count}, input {name!r} is a scalar; a feed "
                                "holds a batch (samples on axis 0)")
            parts.setdefault(name, []).append(arr)
    if not count:
        raise UserError(f"{source}: holds no feeds")
    stacked = {}
    for name, arrays in parts.items():
        try:
            stacked[name] = np.concatenate(arrays, axis=0)
        except ValueError as exc:
            raise UserError(f"{source}: input {name!r}: feeds of different shapes "
                            f"({calibration.one_line(exc)})") from None
    return stacked


def _checked(data: dict[str, Any], model: calibration.ModelLike, source: str) -> dict[str, np.ndarray]:
    """The same checks and casts as an ``.npz`` file gets (names, ranks, sizes, dtypes)."""
    proto, _ = calibration._load_proto(model)
    specs = calibration._input_specs(proto)
    for name in data:
        if name not in specs:
            raise UserError(f"{source}: array {name!r} is not a model input "
                            f"(inputs: {', '.join(specs) or 'none'})")
    for name in specs:
        if name not in data:
            raise UserError(f"{source}: input {name!r} is missing")
    out = {}
    for name, value in data.items():
        try:
            arr = np.asarray(value)
        except (TypeError, ValueError) as exc:
            raise UserError(f"{source}: input {name!r} is not an array "
                            f"({calibration.one_line(exc)})") from None
        out[name] = calibration._check_array(source, specs[name], arr)
    calibration.sample_count(out, source)
    return out

