"""qdq_optuna: search where Q/DQ pairs go in an ONNX model, one Optuna study per region pattern."""

from __future__ import annotations

__version__ = "0.1.0"

from qdq_optuna.config import Config
from qdq_optuna.errors import ModelError, OptionError, UserError
from qdq_optuna.placement.export import QDQExporter, QuantPlan
from qdq_optuna.runtimes.prepared import PreparedModel

__all__ = [
    "Autotuner",
    "Config",
    "ModelError",
    "OptionError",
    "PreparedModel",
    "QDQExporter",
    "QuantPlan",
    "TuneOptions",
    "TuneResult",
    "UserError",
    "__version__",
    "tune",
]


#: public name -> the module that exports it (the search's own: its package, see search/__init__.py)
_LAZY = {"tune": "_tune", "Tuner": "search", "TuneOptions": "search", "TuneResult": "search",
         "Autotuner": "search.autotuner"}


def __getattr__(name: str):
    # the search side pulls in optuna and the backends: import it on first use
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(name)
