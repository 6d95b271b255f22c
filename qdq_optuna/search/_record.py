"""The stored run: study names, every user-attribute key, and reading a run back.

A run ``RUN`` is the Optuna studies named ``RUN/...`` in one storage:

* ``RUN``: the run's overview for optuna-dashboard, made when the run finishes (so it is the
  first card of the study list): a note with the run's figures, phases and studies, the
  whole-run convergence picture, a few small user attrs (speedup, latencies, the guard's
  status) and no trials (:func:`qdq_optuna.dashboard.save_run_overview`);
* ``RUN/_run``: the run's bookkeeping, kept small and out of sight. Its user attrs are the
  settings' digest, when it was made and the float baseline; its system attrs hold the
  settings, every measured model (``measured:<plan key>``) and scored error
  (``error:<plan key>``) and whether the run finished. Its trials are the values workers
  agreed on (:func:`~qdq_optuna.storage.agree`: the baseline, each study's reference, each
  commit), without values. Its note follows the run while it runs. A run stored by an earlier
  version kept all of this in user attrs and COMPLETE trials of value 0: both are read;
* ``RUN/P003``: pattern ``P003``'s first-pass study; ``RUN/P003/refine1``: its first
  refinement round. A study's user attrs describe the pattern and, once decided, hold its
  commit (``committed`` last: its presence means the whole decision is stored).

:class:`RunRecord` is the one place that names these studies and reads and writes their
attributes; the search, the report, the dashboard and ``qdq-optuna bench`` go through it.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import math
from collections.abc import Callable, Iterable
from pathlib import Path

import optuna
import yaml
from optuna.trial import FrozenTrial, TrialState

from ..cache import PatternCache
from ..errors import UserError
from ..export import atomic_write_bytes
from ..graph import Use
from ..insertion.points import PatternPoints
from ..scheme import Around, ChoiceSpace, combine
from ..storage import agree, claim

RUN_STUDY = "_run"
REFINE = "refine"


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
    ORDER = "order"
    ROUND = "refine_round"
    CONTEXT_KEY = "context_key"
    BASELINE_MS = "baseline_latency_ms"
    #: a refinement's starting scheme (points on)
    REFINES = "refines"
    #: every attr above is stored (a killed process may have left only some)
    COMPLETE = "attrs_complete"
    REFERENCE_MS = "reference_ms"
    REFERENCE_SCREEN_MS = "reference_screen_ms"
    REFERENCE_ERROR = "reference_error"
    REFERENCE_OUTPUT_ERRORS = "reference_output_errors"
    CONVERGED_AFTER = "converged_after"
    # the decision (see :meth:`RunRecord.store_decision`)
    COMMITTED = "committed"
    GAIN = "gain"
    COMMIT_REASON = "commit_reason"
    CANDIDATE_TRIAL = "candidate_trial"
    CANDIDATE = "candidate"
    CONFIRMATION = "confirmation"
    COMMITTED_ERROR = "committed_error"
    COMMITTED_OUTPUT_ERRORS = "committed_output_errors"
    COMMITTED_TYPES = "committed_types"
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


class SystemAttr:
    """System attrs the search reads: Optuna's own and our sampler's."""

    FIXED_PARAMS = "fixed_params"  # Optuna: an enqueued trial's parameters
    FAILED_TRIAL = "failed_trial"  # Optuna: the trial a retry repeats
    RETRY_HISTORY = "retry_history"
    DUPLICATE = "qdq:duplicate"  # our sampler repeats a scheme knowingly
    PHASE = "qdq:phase"


class Agreed:
    """Keys of the values a run's workers agree on (:func:`~qdq_optuna.storage.agree`).

    A commit's agreed value is a decision: a dict of :class:`PatternAttr` keys, except that its
    reason is under :attr:`REASON` (stored on the study as ``commit_reason``)."""

    FINGERPRINT = "fingerprint"
    BASELINE = "baseline"
    REASON = "reason"

    @staticmethod
    def reference(study_name: str) -> str:
        return f"reference/{study_name}"

    @staticmethod
    def commit(study_name: str) -> str:
        return f"commit/{study_name}"

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


def pattern_study_name(run_id: str, pattern_id: str, rnd: int = 0) -> str:
    name = f"{run_id}/{pattern_id}"
    return f"{name}/{REFINE}{rnd}" if rnd else name


def run_study_of(study: optuna.Study) -> optuna.Study:
    """The run study of a pattern study (KeyError when it has none: not one of our runs)."""
    run_id = study.user_attrs.get(PatternAttr.RUN_ID)
    if run_id is None:  # a study made without its attrs: its name says where it belongs
        run_id = study.study_name.split("/")[0]
    return optuna.load_study(study_name=run_study_name(run_id), storage=study._storage)


def delete_run(storage, run_id: str) -> int:
    """Remove every study of a run (``--fresh``)."""
    n = 0
    for s in storage.get_all_studies():
        if s.study_name.startswith(f"{run_id}/") or s.study_name == overview_study_name(run_id):
            optuna.delete_study(study_name=s.study_name, storage=storage)
            n += 1
    return n


# -- the run study's attrs ---------------------------------------------------------------------------
def run_attrs(run_study: optuna.Study) -> dict:
    """The run study's user and system attrs in one view (a key is in one or the other)."""
    storage, sid = run_study._storage, run_study._study_id
    return {**storage.get_study_system_attrs(sid), **storage.get_study_user_attrs(sid)}


def set_system_attr(study: optuna.Study, key: str, value) -> None:
    study._storage.set_study_system_attr(study._study_id, key, value)


# -- per-model records -------------------------------------------------------------------------------
class PlanMemo:
    """Plan key -> a record of that model (its measurement, or its output errors), stored in
    the run study's system attrs under ``prefix`` (shared by workers, kept across resumes; a
    run stored by an earlier version has them in user attrs)."""

    def __init__(self, run_study: optuna.Study, prefix: str) -> None:
        self.study = run_study
        self.prefix = prefix
        self._local: dict[str, dict] = {}

    def refresh(self) -> None:
        for k, v in run_attrs(self.study).items():
            if k.startswith(self.prefix):
                self._local[k[len(self.prefix):]] = v

    def get(self, key: str) -> dict | None:
        if key not in self._local:
            self.refresh()
        return self._local.get(key)

    def put(self, key: str, record: dict) -> None:
        self._local[key] = record
        set_system_attr(self.study, self.prefix + key, record)

    def __len__(self) -> int:
        return len(self._local)


# -- trial notes ---------------------------------------------------------------------------------
def note_scheme(trial: optuna.Trial, drawn, plan) -> None:
    """What a trial builds: its scheme, the model's plan key and size, the tensors it covers."""
    trial.set_user_attr(TrialAttr.SCHEME, drawn.on)
    if drawn.mixed:
        trial.set_user_attr(TrialAttr.SCHEME_TYPES, drawn.types)
    trial.set_user_attr(TrialAttr.PLAN_KEY, plan.key)
    trial.set_user_attr(TrialAttr.QDQ_COUNT, len(plan))
    trial.set_user_attr(TrialAttr.TENSORS, drawn.tensors)


def note_failure(trial: optuna.Trial, why: str, transient: bool, cost: int) -> None:
    trial.set_user_attr(TrialAttr.FAILURE, why[:2000])
    trial.set_user_attr(TrialAttr.TRANSIENT, transient)
    trial.set_user_attr(TrialAttr.MEASUREMENTS, cost)


def note_measurement(trial: optuna.Trial, record: dict, cost: int) -> None:
    trial.set_user_attr(TrialAttr.MEASUREMENTS, cost)
    trial.set_user_attr(TrialAttr.MEASUREMENT, record)


def note_error(trial: optuna.Trial, err: dict, excess: float | None) -> None:
    """A trial's output errors; with an error budget, its constraint (``excess`` over it)."""
    trial.set_user_attr(TrialAttr.ERROR, err["error"])  # the scalar objective / constraint
    trial.set_user_attr(TrialAttr.OUTPUT_ERRORS, err["output_errors"])  # per output: cosine, ...
    if excess is not None:
        trial.set_constraint("max_output_error", excess)
        trial.set_user_attr(TrialAttr.FEASIBLE, excess <= 0)


def pattern_attrs(pp: PatternPoints, prepared, space: ChoiceSpace) -> dict:
    """The attrs that describe a pattern (the same in every round of it)."""
    g = prepared.graph
    uses_index = {u: i for i, u in enumerate(sorted(pp.uses(pp.ids)))}
    attrs = {
        PatternAttr.SIGNATURE: pp.pattern.signature,
        PatternAttr.PATTERN_ID: pp.pattern.id,
        PatternAttr.REGIONS: pp.pattern.regions,
        PatternAttr.REGION_NODES: {str(r): [g.name_of(n) for n in prepared.tree[r].all_nodes]
                                   for r in pp.pattern.regions},
        PatternAttr.OPS: pp.pattern.ops,
        PatternAttr.POINTS: pp.ids,
        PatternAttr.POINT_KINDS: {p.id: p.kind for p in pp.points},
        PatternAttr.CONCAT_GROUPS: pp.concat_groups,
        PatternAttr.FUSION_GROUPS: pp.fusion_groups,
        PatternAttr.POINT_TENSORS: {pid: sorted({u[0] for us in pp.resolved[pid].values()
                                                 for u in us}) for pid in pp.ids},
        PatternAttr.POINT_USES: {pid: sorted(uses_index[u] for us in pp.resolved[pid].values()
                                             for u in us) for pid in pp.ids},
    }
    if space.mixed:
        attrs[PatternAttr.NUM_CHOICES] = space.n
        attrs[PatternAttr.CHOICE_NAMES] = list(space.names)
    return attrs


# -- the record ------------------------------------------------------------------------------------
class RunRecord:
    """One run in one storage: its studies by name, what they hold, and what stands.

    ``tunable``: the model's patterns in study order; ``space``: their choices (to read stored
    schemes); ``refine_rounds``: the refinement rounds the run makes."""

    def __init__(self, storage, run_id: str, tunable: list[PatternPoints], space: ChoiceSpace,
                 refine_rounds: int = 0) -> None:
        self.storage = storage
        self.run_id = run_id
        self.tunable = tunable
        self.space = space
        self.refine_rounds = refine_rounds
        self.run_study = optuna.create_study(study_name=run_study_name(run_id), storage=storage,
                                             load_if_exists=True)
        self.measured = PlanMemo(self.run_study, RunAttr.MEASURED)
        self.errors = PlanMemo(self.run_study, RunAttr.ERROR)

    # -- agreement -------------------------------------------------------------------------
    def agree(self, key: str, value):
        return agree(self.run_study, key, value)

    def claim(self, key: str) -> bool:
        return claim(self.run_study, key)

    def settle_fingerprint(self, settings: dict, digest: str, where: str) -> None:
        """Store the run's settings once (workers starting together agree on one set); refuse
        a process whose settings differ, naming what changed."""
        attrs = run_attrs(self.run_study)
        if RunAttr.FINGERPRINT not in attrs:
            won = self.agree(Agreed.FINGERPRINT, {
                "digest": digest, "settings": json.loads(json.dumps(settings, default=str))})
            set_system_attr(self.run_study, RunAttr.SETTINGS, won["settings"])
            self.run_study.set_user_attr(RunAttr.CREATED,
                                         _dt.datetime.now(_dt.timezone.utc).isoformat())
            self.run_study.set_user_attr(RunAttr.FINGERPRINT, won["digest"])
            attrs = run_attrs(self.run_study)
        if RunAttr.FINGERPRINT in attrs and attrs[RunAttr.FINGERPRINT] != digest:
            old = attrs.get(RunAttr.SETTINGS, {})
            changed = sorted(k for k in settings
                             if json.dumps(settings[k], sort_keys=True, default=str)
                             != json.dumps(old.get(k), sort_keys=True, default=str))
            raise UserError(
                f"{where}: holds run {self.run_id!r} with other settings "
                f"(changed: {', '.join(changed) or 'unknown'}); rerun with the same settings to "
                "resume, add --fresh to start over, or pick another --output")

    def baseline(self, measure: Callable[[], tuple[float, dict]]) -> float:
        """The float model's latency, measured once for all workers."""
        if RunAttr.BASELINE_MS not in self.run_study.user_attrs:
            base_ms, record = self.agree(Agreed.BASELINE, lambda: list(measure()))
            set_system_attr(self.run_study, RunAttr.BASELINE_MEASUREMENT, record)
            self.run_study.set_user_attr(RunAttr.BASELINE_MS, base_ms)
        return self.run_study.user_attrs[RunAttr.BASELINE_MS]

    def settings(self) -> dict:
        """The run's stored settings (what its fingerprint digests)."""
        return run_attrs(self.run_study).get(RunAttr.SETTINGS, {})

    # -- a finished run --------------------------------------------------------------------
    def mark_finished(self, digest: str | None, report: dict) -> None:
        """The run finished with these settings and this report (a rerun prints it and exits,
        see :meth:`finished`)."""
        text = json.dumps(report, indent=2, default=str).encode()
        set_system_attr(self.run_study, RunAttr.FINISHED, {
            "fingerprint": digest, "at": report.get("finished"),
            "speedup": report.get("speedup"),
            "report_sha256": hashlib.sha256(text).hexdigest()})

    def finished(self) -> dict | None:
        """How the run last finished (None: it has not)."""
        return run_attrs(self.run_study).get(RunAttr.FINISHED)

    def overview_study(self) -> optuna.Study:
        """The run's overview study (made when first asked for: when the run finishes)."""
        return optuna.create_study(study_name=overview_study_name(self.run_id),
                                   storage=self.storage, load_if_exists=True)

    # -- pattern studies -------------------------------------------------------------------
    def study_name(self, pp: PatternPoints, rnd: int = 0) -> str:
        return pattern_study_name(self.run_id, pp.pattern.id, rnd)

    def create_study(self, pp: PatternPoints, rnd: int, sampler, directions: int) -> optuna.Study:
        return optuna.create_study(study_name=self.study_name(pp, rnd), storage=self.storage,
                                   sampler=sampler, directions=["minimize"] * directions,
                                   load_if_exists=True)

    def load_study(self, pp: PatternPoints, rnd: int = 0) -> optuna.Study | None:
        try:
            return optuna.load_study(study_name=self.study_name(pp, rnd), storage=self.storage)
        except KeyError:
            return None

    def study_names(self) -> set[str]:
        return {s.study_name for s in self.storage.get_all_studies()}

    @staticmethod
    def describe(study: optuna.Study, attrs: dict) -> None:
        """Store a pattern study's descriptive attrs, once (``attrs_complete`` last)."""
        if PatternAttr.COMPLETE in study.user_attrs:
            return
        for k, v in attrs.items():
            study.set_user_attr(k, v)
        study.set_user_attr(PatternAttr.COMPLETE, True)

    def reference(self, study: optuna.Study, measure: Callable[[], list[float]]) -> tuple:
        """``(reference_ms, reference_screen_ms)`` of a pattern study, agreed by all workers."""
        if PatternAttr.REFERENCE_MS not in study.user_attrs:
            ref_ms, ref_screen = self.agree(Agreed.reference(study.study_name), measure)
            study.set_user_attr(PatternAttr.REFERENCE_SCREEN_MS, ref_screen)
            study.set_user_attr(PatternAttr.REFERENCE_MS, ref_ms)
        attrs = study.user_attrs
        return attrs[PatternAttr.REFERENCE_MS], attrs.get(PatternAttr.REFERENCE_SCREEN_MS)

    @staticmethod
    def reference_error(study: optuna.Study, score: Callable[[], dict]) -> None:
        if PatternAttr.REFERENCE_ERROR not in study.user_attrs:
            err = score()
            study.set_user_attr(PatternAttr.REFERENCE_ERROR, err["error"])
            study.set_user_attr(PatternAttr.REFERENCE_OUTPUT_ERRORS, err["output_errors"])

    def store_decision(self, study: optuna.Study, decide: Callable[[], dict]) -> bool:
        """Store a pattern's decision; the first decision stored in the run wins, so every
        worker builds the next patterns on the same commits. False when the study was decided
        already (by another worker)."""
        if PatternAttr.COMMITTED in study.user_attrs:
            return False
        decision = self.agree(Agreed.commit(study.study_name), decide)
        # "committed" last: its presence means the whole decision is stored
        for k, v in sorted(decision.items(), key=lambda kv: kv[0] == PatternAttr.COMMITTED):
            study.set_user_attr(k if k != Agreed.REASON else PatternAttr.COMMIT_REASON, v)
        return True

    # -- what stands -----------------------------------------------------------------------
    def rounds(self) -> list[tuple[PatternPoints, list[dict]]]:
        """The committed patterns, in order up to the first that is not: per pattern the
        user attrs of its studies, first pass then refinement rounds, in round order."""
        attrs = {s.study_name: s.user_attrs for s in self.storage.get_all_studies()
                 if s.study_name.startswith(f"{self.run_id}/")}
        out = []
        for pp in self.tunable:
            first = attrs.get(self.study_name(pp))
            if first is None or PatternAttr.COMMITTED not in first:
                break
            later = [attrs[n] for n in (self.study_name(pp, r)
                                        for r in range(1, self.refine_rounds + 1)) if n in attrs]
            out.append((pp, [first, *later]))
        return out

    @staticmethod
    def standing(rounds: list[dict]) -> dict:
        """The attrs of the round whose decision stands for a pattern: its last committed."""
        return next(a for a in reversed(rounds) if PatternAttr.COMMITTED in a)

    @staticmethod
    def standing_scheme(rounds: list[dict]) -> dict[str, int]:
        return RunRecord.standing(rounds)[PatternAttr.COMMITTED]

    @staticmethod
    def context_key(rounds: list[dict]) -> str | None:
        """The context the pattern was last tuned in (its last round's)."""
        return rounds[-1].get(PatternAttr.CONTEXT_KEY)

    def committed(self) -> tuple[dict[Use, str], list[dict]]:
        """The uses of every standing scheme, and one report row per committed pattern: its
        first-pass attrs, the standing scheme, the product of its rounds' gains and the
        refinement rounds (``refinements``)."""
        uses: dict[Use, str] = {}
        rows = []
        for pp, rounds in self.rounds():
            last = self.standing(rounds)
            uses = combine(uses, self.space.typed_uses(pp, last[PatternAttr.COMMITTED]))
            row = dict(rounds[0])
            if len(rounds) > 1:
                for key in (PatternAttr.COMMITTED, PatternAttr.COMMITTED_TYPES,
                            PatternAttr.COMMITTED_ERROR, PatternAttr.COMMITTED_OUTPUT_ERRORS):
                    if key in last:
                        row[key] = last[key]
                row[PatternAttr.GAIN] = math.prod(float(a.get(PatternAttr.GAIN, 1.0))
                                                  for a in rounds if PatternAttr.COMMITTED in a)
                row["refinements"] = [self.refinement_entry(a) for a in rounds[1:]]
            rows.append(row)
        return uses, rows

    def refinement_entry(self, attrs: dict) -> dict:
        """One refinement round of a pattern, for the report (from its study's attrs)."""
        entry = {"round": attrs.get(PatternAttr.ROUND),
                 "status": "committed" if PatternAttr.COMMITTED in attrs else "running",
                 "from_scheme": attrs.get(PatternAttr.REFINES, []),
                 "committed_scheme": self.space.on(attrs.get(PatternAttr.COMMITTED, {})),
                 "gain": float(attrs.get(PatternAttr.GAIN, 1.0)),
                 "commit_reason": attrs.get(PatternAttr.COMMIT_REASON)}
        if PatternAttr.CONVERGED_AFTER in attrs:
            entry["converged_after"] = attrs[PatternAttr.CONVERGED_AFTER]
        return entry

    def around(self, pp: PatternPoints, rounds: list | None = None) -> Around:
        """The uses of the standing schemes of the committed patterns before ``pp`` and after
        it (``rounds``: :meth:`rounds`, when the caller has it). In the first pass nothing
        after ``pp`` is committed yet."""
        before: dict[Use, str] = {}
        after: dict[Use, str] = {}
        seen = False
        for other, its in self.rounds() if rounds is None else rounds:
            seen = seen or other.pattern.id == pp.pattern.id
            if other.pattern.id != pp.pattern.id:
                typed = self.space.typed_uses(other, self.standing_scheme(its))
                if seen:
                    after = combine(after, typed)
                else:
                    before = combine(before, typed)
        return before, after

    # -- trials ----------------------------------------------------------------------------
    def trials(self, pp: PatternPoints, rnd: int = 0,
               states: Iterable[TrialState] | None = None) -> list[FrozenTrial] | None:
        """The trials of one of the pattern's studies (None: the study does not exist)."""
        study = self.load_study(pp, rnd)
        if study is None:
            return None
        return study.get_trials(deepcopy=False, states=tuple(states) if states else None)

    def complete_trials(self, pp: PatternPoints, rnd: int = 0) -> list[FrozenTrial] | None:
        return self.trials(pp, rnd, (TrialState.COMPLETE,))

    # -- snapshots -------------------------------------------------------------------------
    def write_state(self, out: Path, status: str, run: dict) -> None:
        """``state.yaml``: a readable snapshot (``run``: storage, fingerprint, baseline and
        counters of this process, in that order)."""
        patterns = []
        committed = {r[PatternAttr.PATTERN_ID]: r for r in self.committed()[1]}
        for pp in self.tunable:
            row = {"id": pp.pattern.id, "signature": pp.pattern.signature,
                   "regions": len(pp.pattern.regions), "points": len(pp.ids), "status": "pending"}
            done = self.complete_trials(pp)
            if done is not None:
                row["trials"] = len(done)
                row["status"] = "running"
            r = committed.get(pp.pattern.id)
            if r is not None:
                row["status"] = "committed"
                row["committed"] = sorted(self.space.on(r[PatternAttr.COMMITTED]))
                row["gain"] = round(float(r.get(PatternAttr.GAIN, 1.0)), 4)
                if "refinements" in r:
                    row["refinements"] = len(r["refinements"])
            patterns.append(row)
        state = {"status": status, "run_id": self.run_id, **run, "patterns": patterns,
                 "resume": "rerun the same command to continue"}
        atomic_write_bytes(out / "state.yaml", yaml.safe_dump(state, sort_keys=False).encode())

    def write_pattern_cache(self, path: Path, *, minimum_distance: int, max_entries: int) -> None:
        """Every measured scheme of every pattern (refinements: the schemes that stood), for
        ``--pattern-cache`` of a later run."""
        cache = PatternCache()
        for pp in self.tunable:
            schemes = []
            for rnd in range(self.refine_rounds + 1):
                done = self.complete_trials(pp, rnd) or []
                schemes += [(self.space.on(t.params), t.values[0]) for t in done]
            if schemes:
                cache.add(pp.pattern.signature, schemes, minimum_distance=minimum_distance,
                          max_entries=max_entries)
        cache.save(path)


def studies_in_order(storage, run_id: str) -> list[tuple[optuna.Study, dict]]:
    """A run's pattern studies in the order the search ran them (first pass, then each
    refinement round), with their user attrs; read without the model."""
    found = [s for s in storage.get_all_studies()
             if s.study_name.startswith(f"{run_id}/") and PatternAttr.ORDER in s.user_attrs]
    found.sort(key=lambda s: s.user_attrs[PatternAttr.ORDER])
    return [(optuna.load_study(study_name=s.study_name, storage=storage), s.user_attrs)
            for s in found]


def progress_curve(storage, run_id: str, threshold: float) -> dict:
    """``{"measurements": n, "curve": [[x, speedup], ...]}`` of a run in ``storage``: after each
    measurement (the baseline, each study's reference, each trial's own count, each commit
    confirmation, the final A/B), the speedup the run would deliver had it stopped there (the
    committed gains times the running study's best in-loop gain, counted only where the commit
    rule's ``threshold`` would; see :mod:`qdq_optuna.bench`)."""
    from ..measure import CommitRule

    rule = CommitRule(threshold)
    x = 1  # the float baseline
    committed = 1.0
    curve = [(x, 1.0)]
    for study, attrs in studies_in_order(storage, run_id):
        ref = attrs.get(PatternAttr.REFERENCE_MS)
        if ref is None:  # a study cut off before its reference was measured
            continue
        ref = float(ref)
        x += 1  # the pattern's reference
        curve.append((x, committed))
        best = math.inf
        for t in sorted(study.get_trials(deepcopy=False), key=lambda t: t.number):
            x += _trial_cost(t)
            if t.state == TrialState.COMPLETE and t.values:
                best = min(best, float(t.values[0]))
            gain = ref / best if rule.promising(best, ref, rule.threshold) else 1.0
            curve.append((x, committed * gain))
        if PatternAttr.CONFIRMATION in attrs:
            x += 1
        committed *= float(attrs.get(PatternAttr.GAIN, 1.0))
        curve.append((x, committed))
    x += 1  # the final A/B against the float model
    curve.append((x, committed))
    return {"measurements": x, "curve": _compress(curve)}


def _trial_cost(t) -> int:
    n = t.user_attrs.get(TrialAttr.MEASUREMENTS)
    if isinstance(n, int) and not isinstance(n, bool):
        return n
    record = t.user_attrs.get(TrialAttr.MEASUREMENT)  # runs made before trials carried a count
    return 0 if not isinstance(record, dict) or record.get("cached") else 1


def _compress(curve: list[tuple[int, float]]) -> list[list[float]]:
    """Keep the last point of every x and drop points that change nothing."""
    by_x: dict[int, float] = {}
    for x, y in curve:
        by_x[x] = y
    out: list[list[float]] = []
    items = sorted(by_x.items())
    for i, (x, y) in enumerate(items):
        if out and out[-1][1] == y and i != len(items) - 1:
            continue
        out.append([x, y])
    return out


# -- aggregation ---------------------------------------------------------------------------------
