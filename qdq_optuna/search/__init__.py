"""The search side: one Optuna study per pattern, run by run.

Its modules are private (``_run``, ``_starts``, ``_descent``, ``_pattern``, ``_moves``,
``_guard``, ``_plans``, ``_workers``, ``_options``; the map in docs/architecture.md orders
them). Code outside the search imports the names below from this package (or the public ones
from :mod:`qdq_optuna`); each is imported on first use, so importing the package costs nothing.
The stored run the search writes is :mod:`qdq_optuna.record`'s.
"""

from __future__ import annotations

#: public name -> the module of the search that defines it
_NAMES = {"tune": "_run", "Tuner": "_run", "TuneOptions": "_options", "TuneResult": "_options",
          "Settings": "_options", "Autotuner": "autotuner", "chain_groups": "_moves"}

__all__ = sorted(_NAMES)


def __getattr__(name: str):
    if name in _NAMES:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_NAMES[name]}"), name)
    raise AttributeError(name)
