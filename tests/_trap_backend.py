"""A deterministic backend that segfaults, hangs or kills its parent on chosen models.

Loaded by module path inside an :class:`~qdq_optuna.backends.isolated.IsolatedBackend` worker
(the worker inherits the test process's ``sys.path``). A model is recognised by the set of
activation tensors its QuantizeLinear nodes quantize; every other model gets the latency of
``_latency_fns.rewards_groups``.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import _latency_fns as fns

from qdq_optuna.backends.base import Backend, FixedRunner
from qdq_optuna.placement.export import graph_output_names


def quantized_tensors(model) -> frozenset[str]:
    """Activations with Q/DQ, a quantized graph output by its own name (as plans name it)."""
    renamed = graph_output_names(model)
    return frozenset(renamed.get(q.input[0], q.input[0]) for q in fns.activation_qs(model))


class PlanTrap(Backend):
    """``crash``/``hang``: lists of tensor-name lists; a model quantizing exactly one of those
    sets segfaults / sleeps ``hang_s`` while being built. With ``state_dir``, every crash is
    logged there, and ``kill_parent_after=N`` SIGKILLs the parent process (the tuning run) at
    the N-th build after the first crash, once: a run killed part way."""

    name = "trap"
    deterministic = True

    def __init__(self, crash=(), hang=(), hang_s: float = 60.0, state_dir: str | None = None,
                 kill_parent_after: int | None = None) -> None:
        self.crash = {frozenset(c) for c in crash}
        self.hang = {frozenset(h) for h in hang}
        self.hang_s = float(hang_s)
        self.state = Path(state_dir) if state_dir else None
        self.kill_parent_after = kill_parent_after

    def describe(self) -> dict:
        return {"name": self.name, "crash": sorted(sorted(c) for c in self.crash),
                "hang": sorted(sorted(h) for h in self.hang)}

    def _append(self, name: str, text: str) -> None:
        if self.state is not None:
            with open(self.state / name, "a") as f:
                f.write(text + "\n")

    def _lines(self, name: str) -> int:
        path = None if self.state is None else self.state / name
        return len(path.read_text().splitlines()) if path is not None and path.exists() else 0

    def load(self, model):
        import onnx

        proto = onnx.load_from_string(model) if isinstance(model, bytes) else onnx.load(model)
        q = quantized_tensors(proto)
        if q in self.crash:
            self._append("crashes", ",".join(sorted(q)))
            os.kill(os.getpid(), signal.SIGSEGV)
        if q in self.hang:
            self._append("hangs", ",".join(sorted(q)))
            time.sleep(self.hang_s)
        if self.kill_parent_after is not None and self._lines("crashes") and not self._lines(
                "killed"):
            self._append("builds_after_crash", "x")
            if self._lines("builds_after_crash") >= self.kill_parent_after:
                self._append("killed", str(os.getppid()))
                os.kill(os.getppid(), signal.SIGKILL)
                os._exit(0)
        return FixedRunner(fns.rewards_groups(proto))
