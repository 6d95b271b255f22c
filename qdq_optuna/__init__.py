"""qdq_optuna: search where Q/DQ pairs go in an ONNX model, one Optuna study per region pattern."""

from __future__ import annotations

__version__ = "0.1.0"

from .config import Config
from .errors import ModelError, OptionError, UserError
from .export import QDQExporter, QuantPlan
from .model import PreparedModel

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


def __getattr__(name: str):
    # the search side pulls in optuna and the backends: import it on first use
    if name in ("tune", "TuneOptions", "TuneResult", "Tuner"):
        from . import search

        return getattr(search, name)
    if name == "Autotuner":
        from .autotuner import Autotuner

        return Autotuner
    raise AttributeError(name)
