"""The stored run: study names, every user-attribute key, and reading a run back.

A run ``RUN`` is the Optuna studies named ``RUN/...`` in one storage:

* ``RUN``: the run's overview for optuna-dashboard, made when the run finishes (so it is the
  first card of the study list): a note with the run's figures, phases and studies, the
  whole-run convergence picture, a few small user attrs (speedup, latencies, the guard's
  status) and no trials (:func:`qdq_optuna.outputs.dashboard.save_run_overview`);
* ``RUN/_run``: the run's bookkeeping, kept small and out of sight. Its user attrs are the
  settings' digest, when it was made, the baseline (the user's model) and the lane that
  ships; its system attrs hold the settings, the whole-model starts and the lanes chosen from
  them, every measured model (``measured:<plan key>``) and scored error (``error:<plan
  key>``) and whether the run finished. Its trials are the values workers agreed on
  (:func:`~qdq_optuna.record.storage.agree`: the baseline, the starts, each study's reference, each
  commit, the lane that ships), without values. Its note follows the run while it runs;
* ``RUN/_starts``: one trial per whole-model start (float, every point, the runtime's recipe,
  the user's seeds), its value the start's latency;
* ``RUN/P003/round1``: pattern ``P003``'s visit in round 1 of the descent from the standing
  model; ``RUN/P003/recipe/round1`` the same in the descent from another start (a *lane*).
  A visit's user attrs describe the pattern and, once decided, hold its commit (``committed``
  last: its presence means the whole decision is stored; ``partner``: other patterns' schemes a
  chain move changed with it). The standing model of a lane is its start with every decided
  visit replayed in order (:meth:`~qdq_optuna.record.run.RunRecord.standing`);
* ``RUN/P003`` (no round): a study of the ask/tell :class:`~qdq_optuna.Autotuner`, and of runs
  made before the whole-model search (the pattern-by-pattern pass and ``RUN/P003/refineN``),
  which this version does not resume (:meth:`~qdq_optuna.record.run.RunRecord.check_layout`).

This module is the schema: the study names and every attribute key, each documented where it
is defined, and :func:`key_table` lists them all (the docs' stored-run page shows the table).
:class:`~qdq_optuna.record.run.RunRecord` reads and writes them; the typed records of
:mod:`qdq_optuna.record.records` are what a measurement and a decision hold.
"""

from __future__ import annotations

RUN_STUDY = "_run"
STARTS_STUDY = "_starts"
#: the old layout's refinement studies (``RUN/P003/refine1``)
REFINE = "refine"
ROUND = "round"
#: the phase a two-objective run's latency/error front is measured in
FRONT_PHASE = "pareto"
#: the phases measurements are counted in (``PlanMeasurer.by_phase``, report.json's
#: ``measurements_by_phase``): the baseline, the whole-model starts (each measured once, then
#: an A/B of the fastest two on a measured backend), the descent (each visit's reference and
#: its trials), commit confirmations, the choice between lanes, the final A/B and the Pareto
#: front
PHASES = ("baseline", "starts", "descent", "confirmation", "lanes", "final", FRONT_PHASE)
#: the settings key that marks a run of the whole-model search
FLOW = "flow"
WHOLE_MODEL = "whole-model"


class RunAttr:
    """Attrs of the run study: user attrs (small, shown by ``optuna studies`` and the
    dashboard) and system attrs (the bookkeeping; earlier versions kept them in user attrs)."""

    # user attrs
    FINGERPRINT = "fingerprint"
    CREATED = "created"
    BASELINE_MS = "baseline_latency_ms"
    # system attrs
    SETTINGS = "settings"
    BASELINE_MEASUREMENT = "baseline_measurement"
    #: the run's last finish: ``fingerprint``, ``at``, ``speedup``, ``report_sha256``
    FINISHED = "qdq:finished"
    #: the agreed starts: chosen start, lanes, each lane's start schemes (``Agreed.STARTS``)
    STARTS = "starts"
    #: the measurements choosing the lane that ships took
    WINNER_COST = "winner_measurements"
    # user attrs
    #: what the baseline is (the user's model as given, or converted to FP16/BF16)
    BASELINE_MODEL = "baseline_model"
    #: the lane whose standing model ships (``Agreed.WINNER``)
    WINNER = "winner"
    #: prefixes of the per-model records: plan key -> measurement / output errors
    MEASURED = "measured:"
    ERROR = "error:"


class OverviewAttr:
    """Attrs of the run's overview study: small user attrs (what ``optuna studies`` shows) and
    its picture (a system attr)."""

    RUN_ID = "run_id"
    STATUS = "status"
    BASELINE_MS = "baseline_latency_ms"
    FINAL_MS = "final_latency_ms"
    SPEEDUP = "speedup"
    ACCURACY = "accuracy_status"
    #: the whole-run picture uploaded to it: ``artifact_id``, ``digest``, ``url``
    PICTURE = "qdq:run_picture"


class PatternAttr:
    """User attrs of a pattern study (the ``qdq_*`` ones are read by our sampler)."""

    SIGNATURE = "signature"
    PATTERN_ID = "pattern_id"
    REGIONS = "regions"
    REGION_NODES = "region_nodes"
    OPS = "ops"
    POINTS = "qdq_points"
    POINT_KINDS = "qdq_point_kinds"
    CONCAT_GROUPS = "qdq_concat_groups"
    FUSION_GROUPS = "qdq_fusion_groups"
    POINT_TENSORS = "qdq_point_tensors"
    POINT_USES = "qdq_point_uses"
    NUM_CHOICES = "qdq_num_choices"
    CHOICE_NAMES = "qdq_choice_names"
    RUN_ID = "run_id"
    #: the order visits ran in (lane, round, pattern)
    ORDER = "order"
    #: the descent round of a visit (1, 2, ...; 0: an ask/tell study)
    ROUND = "round"
    #: the start a visit's lane descends from (``float``, ``recipe``, ...)
    LANE = "lane"
    CONTEXT_KEY = "context_key"
    BASELINE_MS = "baseline_latency_ms"
    #: a visit's starting scheme: the pattern's standing scheme (points on)
    FROM = "from_scheme"
    #: the moves a visit queued and those it left out (their kind failed in this run before)
    MOVES = "moves"
    MOVES_SKIPPED = "moves_skipped"
    #: a visit as our sampler's move engine reads it (see search/_moves.py)
    VISIT = "qdq_visit"
    #: every attr above is stored (a killed process may have left only some)
    COMPLETE = "attrs_complete"
    REFERENCE_MS = "reference_ms"
    REFERENCE_SCREEN_MS = "reference_screen_ms"
    REFERENCE_COST = "reference_measurements"
    REFERENCE_ERROR = "reference_error"
    REFERENCE_OUTPUT_ERRORS = "reference_output_errors"
    CONVERGED_AFTER = "converged_after"
    # the decision (:class:`~qdq_optuna.record.records.Decision`)
    COMMITTED = "committed"
    GAIN = "gain"
    COMMIT_REASON = "commit_reason"
    CANDIDATE_TRIAL = "candidate_trial"
    CANDIDATE = "candidate"
    CONFIRMATION = "confirmation"
    COMMITTED_ERROR = "committed_error"
    COMMITTED_OUTPUT_ERRORS = "committed_output_errors"
    COMMITTED_TYPES = "committed_types"
    #: other patterns' whole schemes a committed chain move changed (pattern id -> indices)
    PARTNER = "partner"
    #: the dashboard's pictures of the study
    ARTIFACTS = "artifacts"


class TrialAttr:
    """User attrs of a pattern study's trials."""

    SCHEME = "scheme"
    SCHEME_TYPES = "scheme_types"
    PLAN_KEY = "plan_key"
    QDQ_COUNT = "qdq_count"
    TENSORS = "tensors"
    #: what the trial cost: times the backend was asked to time a model (0 when cached)
    MEASUREMENTS = "measurements"
    MEASUREMENT = "measurement"
    ERROR = "error"
    OUTPUT_ERRORS = "output_errors"
    FEASIBLE = "feasible"
    FAILURE = "failure"
    TRANSIENT = "transient"
    KNOWN_FAILURE = "known_failure"
    DUPLICATE_OF = "duplicate_of"
    SKIPPED = "skipped"
    SLOT = "slot"
    RETRY_OF = "retry_of"
    RETRY_REASON = "retry_reason"
    #: a descent move: its kind (``cache``, ``fusion``, ``concat``, ``chain``, ``single``),
    #: its place in the visit's move list, what it changes (``on:Conv>Concat`` strings: Q/DQ
    #: added or removed between a producer op and a consumer op) and, for a chain, the other
    #: patterns' points it sets (pattern id -> {point: choice})
    MOVE = "move"
    MOVE_INDEX = "move_index"
    MOVE_SIGNATURE = "move_signature"
    PARTNER = "partner"
    #: the trial beat the visit's best so far (what the move-kind statistics count)
    IMPROVED = "improved"


class StartAttr:
    """User attrs of a ``RUN/_starts`` trial (one whole-model start)."""

    START = "start"
    POINTS_ON = "points_on"
    NOTES = "notes"
    EXACT = "exact"
    QDQ_COUNT = "qdq_count"
    ERROR = "error"
    FEASIBLE = "feasible"
    CHOSEN = "chosen"
    LANE = "lane"
    FAILURE = "failure"
    PLAN_KEY = "plan_key"


class SystemAttr:
    """System attrs the search reads: Optuna's own and our sampler's."""

    FIXED_PARAMS = "fixed_params"  # Optuna: an enqueued trial's parameters
    FAILED_TRIAL = "failed_trial"  # Optuna: the trial a retry repeats
    RETRY_HISTORY = "retry_history"
    DUPLICATE = "qdq:duplicate"  # our sampler repeats a scheme knowingly
    PHASE = "qdq:phase"


class Agreed:
    """Keys of the values a run's workers agree on (:func:`~qdq_optuna.record.storage.agree`).

    A commit's agreed value is a decision: a dict of :class:`PatternAttr` keys, except that its
    reason is under :attr:`REASON` (stored on the study as ``commit_reason``)."""

    FINGERPRINT = "fingerprint"
    #: the machine the run's timings come from (CPU flags, runtime, version, threads)
    MACHINE = "machine"
    BASELINE = "baseline"
    STARTS = "starts"
    WINNER = "winner"
    REASON = "reason"
    #: the recipe file's measured decision (report.json's ``recipe_file``)
    RECIPE_FILE = "recipe_file"

    @staticmethod
    def recipe_file(name: str) -> str:
        """The decision of the profile's further recipe file ``name`` (the first is under
        :attr:`RECIPE_FILE`)."""
        return f"recipe_file/{name}"

    @staticmethod
    def reference(study_name: str) -> str:
        return f"reference/{study_name}"

    @staticmethod
    def commit(study_name: str) -> str:
        return f"commit/{study_name}"

    @staticmethod
    def run(study_name: str, number: int) -> str:
        """Which worker measures a queued trial two workers popped at once."""
        return f"run/{study_name}/{number}"

    @staticmethod
    def redo(study_name: str, number: int) -> str:
        return f"redo/{study_name}/{number}"

    @staticmethod
    def retry(study_name: str, number: int) -> str:
        return f"retry/{study_name}/{number}"


# -- names -----------------------------------------------------------------------------------------
def run_study_name(run_id: str) -> str:
    return f"{run_id}/{RUN_STUDY}"


def overview_study_name(run_id: str) -> str:
    """The run's overview study (see the module docstring): the run's own name."""
    return run_id


def starts_study_name(run_id: str) -> str:
    return f"{run_id}/{STARTS_STUDY}"


def pattern_study_name(run_id: str, pattern_id: str, rnd: int = 0, lane: str = "") -> str:
    """``RUN/P003/round1`` (a visit), ``RUN/P003/recipe/round1`` (a visit in the lane that
    descends from the recipe), ``RUN/P003`` (round 0: an ask/tell study)."""
    name = f"{run_id}/{pattern_id}"
    if not rnd:
        return name
    return f"{name}/{lane}/{ROUND}{rnd}" if lane else f"{name}/{ROUND}{rnd}"


#: the key classes, in the order the stored run's page lists them
KEY_CLASSES = (RunAttr, OverviewAttr, PatternAttr, TrialAttr, StartAttr, SystemAttr, Agreed)


def key_table() -> list[tuple[str, str, str]]:
    """Every attribute key: ``(class, name, stored key)``, in definition order (the
    ``measured:`` and ``error:`` prefixes included). The stored keys never change: runs stored
    by earlier versions are read with them."""
    return [(cls.__name__, name, value) for cls in KEY_CLASSES
            for name, value in vars(cls).items()
            if not name.startswith("_") and isinstance(value, str)]
