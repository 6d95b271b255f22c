"""The search: one Optuna study per pattern, a run phase by phase (see the module map in
docs/architecture.md). Its public names; the modules with a leading underscore are private."""

from qdq_optuna.search._moves import chain_groups
from qdq_optuna.search._options import OPTION_GROUPS, SearchOutcome, TuneOptions, TuneResult, option
from qdq_optuna.search._run import Tuner

__all__ = ["OPTION_GROUPS", "SearchOutcome", "TuneOptions", "TuneResult", "Tuner", "chain_groups",
           "option"]
