"""The search: one Optuna study per pattern, a run phase by phase (see the module map in
docs/architecture.md). Its public names; the modules with a leading underscore are private."""

from qdq_optuna.search._options import OPTION_GROUPS, SearchOutcome, TuneOptions, TuneResult, option
from qdq_optuna.search._run import Tuner
from qdq_optuna.search._starts import RECIPE_LANE_RATIO

__all__ = ["OPTION_GROUPS", "RECIPE_LANE_RATIO", "SearchOutcome", "TuneOptions", "TuneResult",
           "Tuner", "option"]
