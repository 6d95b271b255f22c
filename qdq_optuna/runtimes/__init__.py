"""The runtime profiles: one :class:`~qdq_optuna.runtimes.base.Runtime` per runtime, found by
name (``qdq_optuna.runtimes.<name>``'s ``PROFILE``) and chosen once per run. Everything one
runtime decides lives in its profile module: its rules, its recipe start, its precision
defaults, how the accuracy guard scores a candidate and how the report words it.

The runtimes are the ones the backend table names (``BackendSpec.runtime``): a new runtime is
its backend module, its row in :data:`~qdq_optuna.backends.BACKENDS` and its profile module
(``tests/test_structure.py`` adds a toy runtime and counts them).
"""

from __future__ import annotations

import importlib

from qdq_optuna.backends import BACKENDS, DEFAULT_BACKEND, runtime_for_backend
from qdq_optuna.errors import OptionError
from qdq_optuna.runtimes.base import Runtime

__all__ = ["DEFAULT_RUNTIME", "RUNTIME_NAMES", "Runtime", "profile_for", "profile_for_backend"]

#: every runtime a backend measures, in the backend table's order (``--runtime`` choices)
RUNTIME_NAMES: tuple[str, ...] = tuple(dict.fromkeys(s.runtime for s in BACKENDS.values()))
#: the runtime of the default backend (``PreparedModel.prepare`` without ``runtime``)
DEFAULT_RUNTIME: str = runtime_for_backend(DEFAULT_BACKEND)


def profile_for(name: str) -> Runtime:
    """The profile of runtime ``name`` (one clear line for an unknown one)."""
    names = tuple(dict.fromkeys(s.runtime for s in BACKENDS.values()))  # the table as it is now
    if name not in names:
        raise OptionError(f"--runtime: unknown runtime {name!r} (choose from {', '.join(names)})")
    return importlib.import_module(f"qdq_optuna.runtimes.{name}").PROFILE


def profile_for_backend(name: str) -> Runtime:
    """The profile whose rules fit ``--backend name`` (ONNX Runtime's for callables)."""
    return profile_for(runtime_for_backend(name))
