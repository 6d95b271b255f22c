"""The runtime profiles: one :class:`~qdq_optuna.runtimes.base.Runtime` per runtime, found by
name (``qdq_optuna.runtimes.<name>``'s ``PROFILE``) and chosen once per run.

The runtimes are the ones the backend table names (``BackendSpec.runtime``): a new runtime is
its backend module, its row in :data:`~qdq_optuna.backends.BACKENDS` and its profile module.
"""

from __future__ import annotations

import importlib

from qdq_optuna.backends import BACKENDS, runtime_for_backend
from qdq_optuna.errors import OptionError
from qdq_optuna.runtimes.base import Runtime

__all__ = ["RUNTIME_NAMES", "Runtime", "profile_for", "profile_for_backend"]

#: every runtime a backend measures, in the backend table's order (``--runtime`` choices)
RUNTIME_NAMES: tuple[str, ...] = tuple(dict.fromkeys(s.runtime for s in BACKENDS.values()))


def profile_for(name: str) -> Runtime:
    """The profile of runtime ``name`` (one clear line for an unknown one)."""
    if name not in RUNTIME_NAMES:
        raise OptionError(f"--runtime: unknown runtime {name!r} "
                          f"(choose from {', '.join(RUNTIME_NAMES)})")
    return importlib.import_module(f"qdq_optuna.runtimes.{name}").PROFILE


def profile_for_backend(name: str) -> Runtime:
    """The profile whose rules fit ``--backend name`` (ONNX Runtime's for callables)."""
    return profile_for(runtime_for_backend(name))
