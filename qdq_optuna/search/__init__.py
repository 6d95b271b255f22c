"""The search: one Optuna study per pattern, a run phase by phase (see the module map in
docs/architecture.md). Its public names; the modules with a leading underscore are private."""

from qdq_optuna.search._limit import NOT_EXPECTED_PREFIX
from qdq_optuna.search._options import OPTION_GROUPS, TuneOptions, option
from qdq_optuna.search._outcome import (
    FrontPoint,
    RunHeader,
    SearchOutcome,
    ShippedAccuracy,
    StoppedOutcome,
    TuneResult,
)
from qdq_optuna.search._prepare import OpenedRun, PreparedRun, open_run
from qdq_optuna.search._run import Tuner

__all__ = ["NOT_EXPECTED_PREFIX", "OPTION_GROUPS", "FrontPoint", "OpenedRun", "PreparedRun", "RunHeader", "SearchOutcome",
           "ShippedAccuracy", "StoppedOutcome", "TuneOptions", "TuneResult", "Tuner", "open_run",
           "option"]
