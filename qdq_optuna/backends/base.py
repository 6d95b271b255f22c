"""The one small interface every latency backend implements.

A backend turns a serialized model into a :class:`Runner` (an ONNX Runtime session, a TensorRT
engine, ...); a runner times the model. Timing protocols (screening, interleaved A/B, confidence
intervals) live in :mod:`qdq_optuna.measure.timing` and work on any backend through this interface, so a
new backend only has to know how to build and run.
"""

from __future__ import annotations

import abc
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from qdq_optuna.backends.what_ran import WhatRan

#: A model handed to a backend: serialized ``ModelProto`` bytes, or a path to an ``.onnx`` file
#: (needed when weights live in external data files next to it).
ModelSource = bytes | str | os.PathLike


@dataclass(frozen=True)
class SessionSettings:
    """Settings of a runtime's session (not of the model file) that change what it runs for a
    placement: a runtime's own graph optimizer can undo or worsen a placement, and a
    deployment must then create its sessions with these settings to run what was measured.

    ``name`` names them in the report; ``entries``: (key, value) pairs as the runtime's
    session API takes them; ``why``: what they change; ``code``: the lines a deployment
    adds where it creates its session."""

    name: str
    entries: tuple[tuple[str, str], ...]
    why: str = ""
    code: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return {"name": self.name, "entries": dict(self.entries), "why": self.why,
                "code": list(self.code)}


@dataclass(frozen=True)
class Configured:
    """A model to be run under :class:`SessionSettings` (what a backend with
    ``session_settings`` loads besides a plain :data:`ModelSource`)."""

    model: bytes | str | os.PathLike
    settings: SessionSettings


#: the keys of a backend's ``describe()`` that change what one of its timings means: the
#: runtime and its version, threads, precision hint, device (a run's workers must agree on
#: them; seeds and input shapes are settings, in the run's fingerprint)
MEASURING_KEYS = ("name", "onnxruntime", "openvino", "tensorrt", "trtexec", "providers",
                  "threads", "inference_precision", "device")


def measuring(description: dict) -> dict:
    """What of a backend's ``describe()`` a timing depends on (:data:`MEASURING_KEYS`)."""
    return {k: description[k] for k in MEASURING_KEYS if k in description}


class BackendError(RuntimeError):
    """Building or running a model failed; the message is shown to the user / stored on the trial."""

    #: Transient failures (timeouts, lost device, crashed worker) are retried on resume.
    transient: bool = False


class TransientBackendError(BackendError):
    transient = True


class BackendUnavailable(BackendError):
    """The backend cannot run on this machine (package, binary or device missing)."""


class Runner(abc.ABC):
    """A built model that can be timed repeatedly."""

    @abc.abstractmethod
    def time(self, warmup: int, iterations: int) -> list[float]:
        """Run ``warmup`` untimed then ``iterations`` timed inferences; per-iteration ms."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the session / engine."""

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def time_calls(infer: Callable[[], object], warmup: int, iterations: int,
               runtime: str) -> list[float]:
    """``warmup`` untimed then ``iterations`` timed calls of ``infer``, in ms each; a failure
    is a :class:`BackendError` naming ``runtime``."""
    clock = time.perf_counter
    out: list[float] = []
    try:
        for _ in range(warmup):
            infer()
        for _ in range(iterations):
            t0 = clock()
            infer()
            out.append((clock() - t0) * 1e3)
    except Exception as exc:  # the runtime's own exception types
        raise BackendError(f"{runtime} inference failed: {str(exc).strip()}") from exc
    return out


class FixedRunner(Runner):
    """A runner that reports one known latency (analytical and test backends)."""

    def __init__(self, latency_ms: float) -> None:
        self.latency_ms = latency_ms

    def time(self, warmup: int, iterations: int) -> list[float]:
        # Same length contract as real runners, so timing protocols work unchanged.
        return [self.latency_ms] * max(1, iterations)


class Backend(abc.ABC):
    """Builds runners. Implementations must import heavy dependencies lazily."""

    #: short name used on the command line and in reports
    name: str = "backend"
    #: a deterministic backend returns the same figure every time: no repeats or A/B needed
    deterministic: bool = False
    #: build a fresh runner for every measurement round (cheap ORT sessions: yes; TensorRT
    #: engine builds cost seconds, so those backends time one runner repeatedly instead)
    fresh_sessions: bool = True
    #: whether :meth:`load` takes a :class:`Configured` model (runs it under its settings)
    session_settings: bool = False

    @abc.abstractmethod
    def load(self, model: ModelSource) -> Runner:
        """Build the model (session creation / engine build). Raises :class:`BackendError`.
        A backend with :attr:`session_settings` also takes a :class:`Configured` model."""

    def describe(self) -> dict:
        """Settings that change what is measured; part of the run fingerprint."""
        return {"name": self.name}

    def what_ran(self, model: bytes) -> WhatRan | None:
        """Which Q/DQ the runtime fused, which stayed standalone, where float ran and where it
        reformatted, for ``model`` (serialized); None: this backend cannot tell."""
        return None

    def worker_pids(self) -> list[int]:
        """Processes that run models for this backend, so quietness checks do not count them."""
        return []

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release persistent resources (builders, timing caches are saved here)."""
