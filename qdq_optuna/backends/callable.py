"""Plug a user function in as a backend: ``fn(model: onnx.ModelProto) -> latency in ms``.

For runtimes this package does not know (a remote device farm, a simulator, a vendor SDK). The
function is called once per ``Runner.time`` call whatever the iteration count, because user
callables are often slow and do their own repetitions.
"""

from __future__ import annotations

import importlib
import math
import os
import sys
from collections.abc import Callable
from numbers import Real
from typing import Any

from qdq_optuna.backends.base import Backend, BackendError, ModelSource, Runner
from qdq_optuna.errors import OptionError

LatencyFn = Callable[[Any], float]


def load_callable(spec: str) -> LatencyFn:
    """Import ``"package.module:function"`` (the current directory is searched first)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise OptionError(f"--backend {spec!r}: expected 'package.module:function'")
    cwd = os.getcwd()
    if cwd not in sys.path:
        # user modules usually sit next to where the command is run
        sys.path.insert(0, cwd)
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:
        raise OptionError(
            f"--backend {spec!r}: cannot import module {module_name!r} "
            f"({type(exc).__name__}: {exc})"
        ) from exc
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise OptionError(
                f"--backend {spec!r}: module {module_name!r} has no attribute {attr!r}"
            ) from None
    if not callable(obj):
        raise OptionError(f"--backend {spec!r}: {attr!r} is not callable")
    return obj


def _qualname(fn: Any) -> str:
    mod = getattr(fn, "__module__", None) or "?"
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    return f"{mod}:{name}"


class CallableBackend(Backend):
    """Wraps ``fn(model) -> ms``; set ``deterministic=True`` for cost models and simulators."""

    def __init__(self, fn: LatencyFn, *, deterministic: bool = False, name: str | None = None):
        if not callable(fn):
            raise OptionError(f"callable backend needs a function, got {type(fn).__name__}")
        self.fn = fn
        self.deterministic = bool(deterministic)
        self.name = name or getattr(fn, "__name__", None) or "callable"

    def describe(self) -> dict:
        return {
            "name": self.name,
            "callable": _qualname(self.fn),
            "deterministic": self.deterministic,
        }

    def load(self, model: ModelSource) -> Runner:
        import onnx

        try:
            if isinstance(model, bytes):
                proto = onnx.load_from_string(model)
            else:
                proto = onnx.load(os.fspath(model))
        except Exception as exc:
            raise BackendError(f"cannot parse the model: {type(exc).__name__}: {exc}") from exc
        return CallableRunner(self.fn, proto, self.name)


class CallableRunner(Runner):
    """Holds the parsed model so repeated ``time`` calls do not re-parse it."""

    def __init__(self, fn: LatencyFn, model: Any, name: str) -> None:
        self.fn = fn
        self.model = model
        self.name = name

    def time(self, warmup: int, iterations: int) -> list[float]:
        try:
            value = self.fn(self.model)
        except BackendError:
            raise
        except Exception as exc:
            raise BackendError(f"{self.name}: {type(exc).__name__}: {exc}") from exc
        if isinstance(value, bool) or not isinstance(value, Real):
            raise BackendError(
                f"{self.name} returned {type(value).__name__} {value!r}; expected latency in ms"
            )
        value = float(value)
        if not math.isfinite(value) or value < 0:
            raise BackendError(f"{self.name} returned {value!r}; expected a finite latency >= 0")
        return [value]

    def close(self) -> None:
        self.model = None
