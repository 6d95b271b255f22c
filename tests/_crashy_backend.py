"""Backends that misbehave on purpose, loaded by module path inside isolated workers."""

from __future__ import annotations

import os
import signal
import time

from qdq_optuna.backends.base import Backend, BackendError, FixedRunner

CRASH = b"crash-me"
HANG = b"hang-me"
FAIL = b"fail-me"


class _FixedRunner(FixedRunner):
    """A negative latency segfaults the worker while it times."""

    def time(self, warmup: int, iterations: int) -> list[float]:
        if self.latency_ms < 0:
            os.kill(os.getpid(), signal.SIGSEGV)
        return super().time(warmup, iterations)


class CrashyBackend(Backend):
    """Segfaults, hangs or fails on marker models; otherwise reports ``len(model)`` ms."""

    name = "crashy"

    def __init__(self, hang_s: float = 30.0) -> None:
        self.hang_s = hang_s

    def load(self, model):
        if model == CRASH:
            os.kill(os.getpid(), signal.SIGSEGV)
        if model == HANG:
            time.sleep(self.hang_s)
        if model == FAIL:
            raise BackendError("refused the marker model")
        if model == b"crash-on-time":
            return _FixedRunner(-1.0)
        return _FixedRunner(float(len(model)))

    def describe(self) -> dict:
        return {"name": self.name, "hang_s": self.hang_s, "pid": os.getpid()}


class BrokenBackend(Backend):
    """Cannot even be constructed, like TensorRT on a machine without it."""

    def __init__(self) -> None:
        from qdq_optuna.backends.base import BackendUnavailable

        raise BackendUnavailable("no such runtime here")

    def load(self, model):  # pragma: no cover - never constructed
        raise AssertionError
