"""Latency backends, the table of ``--backend NAME`` s and the factory.

Every backend module imports its runtime (onnxruntime, tensorrt, cuda-python) only when a backend
is built, so importing this package stays cheap and works without any of them.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from qdq_optuna.backends.base import (
    Backend,
    BackendError,
    BackendUnavailable,
    Configured,
    ModelSource,
    Runner,
    SessionSettings,
    TransientBackendError,
)
from qdq_optuna.backends.callable import CallableBackend, load_callable
from qdq_optuna.backends.isolated import IsolatedBackend
from qdq_optuna.backends.onnxruntime import PROVIDER_PRESETS, OnnxRuntimeBackend
from qdq_optuna.backends.tensorrt import TensorRTBackend
from qdq_optuna.backends.trtexec import TrtexecBackend, parse_trtexec_output
from qdq_optuna.errors import OptionError

__all__ = [
    "BACKENDS",
    "BACKEND_NAMES",
    "DEFAULT_BACKEND",
    "Backend",
    "BackendError",
    "BackendUnavailable",
    "CallableBackend",
    "Configured",
    "IsolatedBackend",
    "ModelSource",
    "OnnxRuntimeBackend",
    "Runner",
    "SessionSettings",
    "TensorRTBackend",
    "TransientBackendError",
    "TrtexecBackend",
    "load_callable",
    "make_backend",
    "parse_trtexec_output",
    "runtime_for_backend",
]

@dataclass(frozen=True)
class BackendSpec:
    """One ``--backend NAME``: the class that measures, whose Q/DQ rules fit it, and whether
    it runs in a worker process unless told otherwise."""

    module: str
    cls: str
    #: the runtime whose fusion rules place the Q/DQ (``--runtime`` follows the backend)
    runtime: str
    #: :func:`make_backend`'s default for ``isolate`` (tune isolates whenever it can, see
    #: ``TuneOptions.isolate``); None: never isolated (a subprocess already, or pure Python)
    isolate: bool | None
    #: the run settings tune hands it (``threads``, ``input_shapes``)
    takes: tuple[str, ...] = ("input_shapes",)
    #: ONNX Runtime: the execution-provider preset (also the backend's own name)
    preset: str | None = None
    #: how ``--backend`` help names it (None: an alias, not listed)
    label: str | None = None
    #: the float part's precision this backend's users deploy when they do not say (TensorRT
    #: and CUDA users deploy FP16; ONNX Runtime's CPU provider runs FP32, its FP16 kernels are
    #: few and slower); None: the runtime's default (the cost model, callables)
    precision: str | None = None
    #: precisions it cannot run, with why (``--high-precision`` refused in one line)
    refuses: Mapping[str, str] = field(default_factory=dict)


_ORT = "qdq_optuna.backends.onnxruntime"
#: what ONNX Runtime's CPU provider cannot run
_ORT_CPU_REFUSES: Mapping[str, str] = {
    "bf16": "ONNX Runtime's CPU provider has no bfloat16 kernels for Conv, MatMul or most ops",
    "fp16": ("ONNX Runtime's CPU provider fuses Q/DQ only with FP32 scales (its QLinearConcat "
             "rejects FP16 ones) and has few FP16 kernels"),
}
#: the backend tune measures with unless told (``--backend``)
DEFAULT_BACKEND = "onnxruntime"
#: every backend name, in the order ``--backend`` lists them (besides ``package.module:function``)
BACKENDS: dict[str, BackendSpec] = {
    "onnxruntime": BackendSpec(_ORT, "OnnxRuntimeBackend", "onnxruntime", False,
                               ("threads", "input_shapes"), "onnxruntime", "onnxruntime (CPU)",
                               "fp32", _ORT_CPU_REFUSES),
    "ort": BackendSpec(_ORT, "OnnxRuntimeBackend", "onnxruntime", False,
                       ("threads", "input_shapes"), "onnxruntime", None, "fp32", _ORT_CPU_REFUSES),
    "ort-cuda": BackendSpec(_ORT, "OnnxRuntimeBackend", "onnxruntime", False,
                            ("threads", "input_shapes"), "ort-cuda", "ort-cuda", "fp16"),
    # TensorRT builds can crash or hang the process: isolated by default
    "ort-trt": BackendSpec(_ORT, "OnnxRuntimeBackend", "tensorrt", True,
                           ("threads", "input_shapes"), "ort-trt", "ort-trt", "fp16"),
    "tensorrt": BackendSpec("qdq_optuna.backends.tensorrt", "TensorRTBackend", "tensorrt", True,
                            label="tensorrt", precision="fp16"),
    "trtexec": BackendSpec("qdq_optuna.backends.trtexec", "TrtexecBackend", "tensorrt", None,
                           label="trtexec", precision="fp16"),
    # OpenVINO's CPU plugin: compiled in process like ONNX Runtime sessions (tune isolates it)
    "openvino": BackendSpec("qdq_optuna.backends.openvino", "OpenVinoBackend", "openvino", False,
                            ("threads", "input_shapes"), label="openvino (CPU)",
                            precision="fp32"),
    "costmodel": BackendSpec("qdq_optuna.backends.costmodel", "CostModelBackend", "tensorrt",
                             None, label="costmodel"),
}
#: names accepted by ``--backend`` (besides ``package.module:function``)
BACKEND_NAMES = tuple(BACKENDS)
#: ``--backend`` help: the listed names, then callables
BACKEND_HELP = (", ".join(s.label for s in BACKENDS.values() if s.label)
                + ", or package.module:function (fn(model) -> ms)")


def runtime_for_backend(name: str) -> str:
    """Whose fusion rules fit a backend: TensorRT's for the TensorRT-like ones, OpenVINO's for
    openvino, else ONNX Runtime's (callables included)."""
    spec = BACKENDS.get(name)
    return (spec or BACKENDS[DEFAULT_BACKEND]).runtime


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


def _backend_class(key: str, spec: BackendSpec) -> type:
    try:
        module = importlib.import_module(spec.module)
    except ModuleNotFoundError as exc:
        if not (exc.name or "").startswith("qdq_optuna"):
            raise
        raise BackendUnavailable(f"the {key} backend is not part of this build") from exc
    return getattr(module, spec.cls)


def make_backend(name: str, **options: Any) -> Backend:
    """Backend for ``--backend NAME``; ``options`` are the backend's keyword arguments.

    ``isolate=True`` runs the backend in a worker process that a crash or hang cannot take
    down (default for ``tensorrt`` and ``ort-trt``, whose builds can do both; see
    :data:`BACKENDS`).
    """
    key = name.strip()
    spec = BACKENDS.get(key)
    if spec is not None:
        cls = _backend_class(key, spec)
        if spec.preset is not None:
            options.setdefault("providers", PROVIDER_PRESETS[spec.preset])
            options.setdefault("name", spec.preset)
        isolate = options.pop("isolate", spec.isolate)
        if spec.isolate is not None and isolate:
            return _isolated(spec.preset or key, spec.module, cls, options)
        _check_options(key, cls, options)
        return cls(**options)
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
