"""The stored run: its schema, its typed records, reading and writing them.

* :mod:`~qdq_optuna.record.schema`: study names and every attribute key (:func:`key_table`);
* :mod:`~qdq_optuna.record.records`: :class:`Measurement`, :class:`Decision`,
  :class:`StartOutcome`, :class:`AgreedStarts`, :class:`Visit` (``to_attrs`` / ``from_attrs``),
  and what the record reads out of them (:class:`VisitEntry`, :class:`PatternStanding`);
* :mod:`~qdq_optuna.record.run`: :class:`RunRecord` (a run in its storage: what it holds and
  what stands), the trial notes, :func:`progress_curve`;
* :mod:`~qdq_optuna.record.files`: ``state.yaml`` and the pattern cache;
* :mod:`~qdq_optuna.record.checks`: what every decided visit must hold (:func:`visit_problems`);
* :mod:`~qdq_optuna.record.storage`: opening a storage, agreeing on a value;
* ``_optuna``: the one module that touches Optuna's private attributes (its functions are
  re-exported here: a study's storage and id, a trial's id and stored state, failing a trial).

docs/stored_run.md describes the layout and the keys.
"""

from qdq_optuna.record._optuna import (
    fail_trial,
    set_trial_system_attr,
    storage_of,
    stored_trial,
    study_id,
    study_system_attrs,
    trial_id,
    trial_system_attrs,
)
from qdq_optuna.record.checks import is_visit, visit_cap, visit_problems
from qdq_optuna.record.files import write_pattern_cache, write_state
from qdq_optuna.record.records import (
    KINDS,
    AgreedStarts,
    Decision,
    FinishedRun,
    Measurement,
    PatternStanding,
    StartOutcome,
    Visit,
    VisitEntry,
)
from qdq_optuna.record.run import (
    PlanMemo,
    RunRecord,
    delete_run,
    note_error,
    note_failure,
    note_measurement,
    note_scheme,
    pattern_attrs,
    progress_curve,
    run_attrs,
    run_study_of,
    set_system_attr,
    studies_in_order,
    trial_measurement,
)
from qdq_optuna.record.schema import (
    FLOW,
    FRONT_PHASE,
    KEY_CLASSES,
    PHASES,
    WHOLE_MODEL,
    Agreed,
    OverviewAttr,
    PatternAttr,
    RunAttr,
    StartAttr,
    SystemAttr,
    TrialAttr,
    key_table,
    overview_study_name,
    pattern_study_name,
    run_study_name,
    starts_study_name,
)
from qdq_optuna.record.storage import (
    agree,
    agreed,
    claim,
    default_storage_url,
    open_storage,
    quiet_optuna,
    release,
)

__all__ = [
    "FLOW", "FRONT_PHASE", "KEY_CLASSES", "KINDS", "PHASES", "WHOLE_MODEL", "Agreed", "AgreedStarts", "Decision",
    "FinishedRun", "Measurement", "OverviewAttr", "PatternAttr", "PlanMemo", "RunAttr", "RunRecord",
    "PatternStanding", "StartAttr", "StartOutcome", "SystemAttr", "TrialAttr", "Visit",
    "VisitEntry", "agree", "agreed", "claim",
    "default_storage_url", "delete_run", "key_table", "note_error", "note_failure",
    "note_measurement", "note_scheme", "open_storage", "overview_study_name",
    "pattern_attrs", "pattern_study_name", "progress_curve", "quiet_optuna", "release", "run_attrs",
    "run_study_name", "run_study_of", "set_system_attr", "starts_study_name",
    "studies_in_order", "trial_measurement", "write_pattern_cache", "write_state",
    "is_visit", "visit_cap", "visit_problems",
    # Optuna's storage, reached through record/_optuna.py
    "fail_trial", "set_trial_system_attr", "storage_of", "stored_trial", "study_id",
    "study_system_attrs", "trial_id", "trial_system_attrs",
]
