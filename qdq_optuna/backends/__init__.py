"""Latency backends and the ``--backend NAME`` factory.

Every backend module imports its runtime (onnxruntime, tensorrt, cuda-python) only when a backend
is built, so importing this package stays cheap and works without any of them.
"""

from __future__ import annotations

import inspect
from typing import Any

from qdq_optuna.backends.base import (
    Backend,
    BackendError,
    BackendUnavailable,
    ModelSource,
    Runner,
    TransientBackendError,
)
from qdq_optuna.backends.callable import CallableBackend, load_callable
from qdq_optuna.backends.isolated import IsolatedBackend
from qdq_optuna.backends.onnxruntime import PROVIDER_PRESETS, OnnxRuntimeBackend
from qdq_optuna.backends.tensorrt import TensorRTBackend
from qdq_optuna.backends.trtexec import TrtexecBackend, parse_trtexec_output
from qdq_optuna.errors import OptionError

__all__ = [
    "BACKEND_NAMES",
    "Backend",
    "BackendError",
    "BackendUnavailable",
    "CallableBackend",
    "IsolatedBackend",
    "ModelSource",
    "OnnxRuntimeBackend",
    "Runner",
    "TensorRTBackend",
    "TransientBackendError",
    "TrtexecBackend",
    "load_callable",
    "make_backend",
    "parse_trtexec_output",
]

#: names accepted by ``--backend`` (besides ``package.module:function``)
BACKEND_NAMES = ("onnxruntime", "ort", "ort-cuda", "ort-trt", "tensorrt", "trtexec", "costmodel")


def _valid_names() -> str:
    return ", ".join(BACKEND_NAMES) + ", or package.module:function"


def _check_options(name: str, cls: type, options: dict[str, Any]) -> None:
    """Reject misspelt options with the backend's name rather than a TypeError."""
    try:
        inspect.signature(cls).bind(**options)
    except TypeError as exc:
        raise OptionError(f"--backend {name}: {exc}") from None


def _isolated(name: str, module: str, cls: type, options: dict[str, Any]) -> IsolatedBackend:
    time_timeout_s = options.pop("time_timeout_s", 600)
    load_timeout_s = options.pop("load_timeout_s", 600)
    _check_options(name, cls, options)
    load_timeout_s = options.get("build_timeout_s", load_timeout_s)
    return IsolatedBackend(
        (module, cls.__name__, options),
        load_timeout_s=load_timeout_s,
        time_timeout_s=time_timeout_s,
        name=name,
    )


def make_backend(name: str, **options: Any) -> Backend:
    """Backend for ``--backend NAME``; ``options`` are the backend's keyword arguments.

    ``isolate=True`` runs the backend in a worker process that a crash or hang cannot take
    down (default for ``tensorrt`` and ``ort-trt``, whose builds can do both).
    """
    key = name.strip()
    if key in ("onnxruntime", "ort", "ort-cuda", "ort-trt"):
        preset = "onnxruntime" if key == "ort" else key
        options.setdefault("providers", PROVIDER_PRESETS[preset])
        options.setdefault("name", preset)
        if options.pop("isolate", key == "ort-trt"):
            return _isolated(preset, "qdq_optuna.backends.onnxruntime", OnnxRuntimeBackend, options)
        _check_options(key, OnnxRuntimeBackend, options)
        return OnnxRuntimeBackend(**options)
    if key == "tensorrt":
        if options.pop("isolate", True):
            return _isolated(key, "qdq_optuna.backends.tensorrt", TensorRTBackend, options)
        _check_options(key, TensorRTBackend, options)
        return TensorRTBackend(**options)
    if key == "trtexec":  # already a subprocess with a timeout: no worker needed
        options.pop("isolate", None)
        _check_options(key, TrtexecBackend, options)
        return TrtexecBackend(**options)
    if key == "costmodel":
        try:
            from qdq_optuna.backends.costmodel import CostModelBackend
        except ModuleNotFoundError as exc:
            if not (exc.name or "").startswith("qdq_optuna"):
                raise
            raise BackendUnavailable("the costmodel backend is not part of this build") from exc
        options.pop("isolate", None)
        _check_options(key, CostModelBackend, options)
        return CostModelBackend(**options)
    if ":" in key and not key.startswith(":"):
        fn = load_callable(key)
        options.pop("isolate", None)
        unknown = set(options) - {"deterministic", "name"}
        if unknown:
            raise OptionError(
                f"--backend {key}: a callable backend takes only deterministic= and name=, "
                f"not {', '.join(sorted(unknown))}"
            )
        return CallableBackend(fn, **options)
    raise OptionError(f"--backend {name!r} is not known; valid: {_valid_names()}")
