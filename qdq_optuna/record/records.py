"""The stored run's records, typed: what a measurement, a decision and a start hold.

Each is a frozen dataclass with ``to_attrs()`` (the JSON-able dict stored in an Optuna
attribute) and ``from_attrs()`` (read back, from this version or an earlier one: a key it does
not know is kept in ``extra`` and written back unchanged, a key it lacks takes the default).
The dicts are the stored format; their keys never change.

* :class:`Measurement`: one model's latency: the trial attr ``measurement``, the run's memo
  ``measured:<plan key>`` and the baseline's ``baseline_measurement``;
* :class:`Decision`: a visit's decision: the agreed ``commit/<study>`` value and the pattern
  study's ``committed``, ``gain``, ``commit_reason``, ... attrs;
* :class:`StartOutcome`: one whole-model start as measured: a row of the run's ``starts`` and
  a trial of ``RUN/_starts``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from qdq_optuna.record.schema import Agreed, PatternAttr, StartAttr

#: ``Measurement.kind`` values: an interleaved A/B against the visit's reference, dropped by
#: the screen, one session's fast timing, a deterministic backend, the reference itself (known
#: without measuring); ``None``: a model timed on its own (the baseline, a start)
KINDS = ("ab", "screened_out", "screen", "deterministic", "reference")


def _known(cls) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls) if f.name != "extra")


@dataclass(frozen=True)
class Measurement:
    """One model's latency, and how it was measured.

    A model timed on its own (the baseline, a start) has ``latency_ms``, ``stats`` and ``qdq``.
    A candidate timed against a visit's reference also has ``kind`` (see :data:`KINDS`),
    ``ratio`` (to the reference), ``ci`` (of the ratio; ``None`` where there is none),
    ``rounds``, ``decided``, ``screened_out``, ``sessions`` (timed sessions of the candidate)
    and ``reference_ms``; some kinds say more (``verdict``, ``screen_ms``, ...). ``cached``:
    the model was measured earlier in the run (``measured_against_ms``: the reference it was
    measured against then, when that differs)."""

    latency_ms: float
    kind: str | None = None
    ratio: float | None = None
    ci: list[float] | None = None
    rounds: int | None = None
    decided: bool = False
    screened_out: bool = False
    sessions: int | None = None
    reference_ms: float | None = None
    qdq: int | None = None
    stats: dict | None = None
    verdict: str | None = None
    screen_ms: float | None = None
    reference_screen_ms: float | None = None
    screen_threshold: float | None = None
    deterministic: bool = False
    reference: bool = False
    measured_against_ms: float | None = None
    cached: bool = False
    #: keys this version does not know (a later version's), kept as they were
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def against_reference(self) -> bool:
        """Timed against a visit's reference (it has a ratio), not on its own."""
        return self.ratio is not None

    def to_attrs(self) -> dict[str, Any]:
        """The stored dict: the fields that are set; a candidate's ``ci``, ``decided`` and
        ``screened_out`` always (``ci: null``: no interval)."""
        out: dict[str, Any] = {}
        for name in _known(Measurement):
            value = getattr(self, name)
            if value is None or value is False:
                if not (self.against_reference and name in ("ci", "decided", "screened_out")):
                    continue
            out[name] = list(value) if name == "ci" and value is not None else value
        return {**out, **self.extra}

    @classmethod
    def from_attrs(cls, attrs: dict[str, Any]) -> Measurement:
        known = _known(cls)
        return cls(**{k: v for k, v in attrs.items() if k in known},
                   extra={k: v for k, v in attrs.items() if k not in known})

    def as_cached(self, reference_ms: float | None = None) -> Measurement:
        """The same model met again in the run: against ``reference_ms``, only its latency
        carries over when it was measured on its own or against another reference."""
        then = self.reference_ms
        if reference_ms is None or (then is not None and math.isclose(then, reference_ms)):
            return dataclasses.replace(self, cached=True)
        return dataclasses.replace(self, cached=True, ratio=self.latency_ms / reference_ms,
                                   ci=None, decided=False, reference_ms=reference_ms,
                                   measured_against_ms=then)


@dataclass(frozen=True)
class Decision:
    """A visit's decision: the scheme that stands for the pattern after it (``committed``:
    point -> choice index; its starting scheme when nothing won) and why.

    ``gain``: the speedup of the commit (1.0: nothing changed); ``candidate_trial``: the trial
    judged; ``candidate``: how a two-objective run chose it; ``confirmation``: the interleaved
    A/B that confirmed or refused it (``ratio``, ``ci``, ``rounds``, ``speedup``);
    ``committed_error`` / ``committed_output_errors``: the whole model's output errors with
    it; ``committed_types``: the quant type of each point (mixed precision); ``partner``:
    other patterns' whole schemes a chain move changed with it (pattern id -> indices)."""

    committed: dict[str, int]
    gain: float = 1.0
    reason: str | None = None
    candidate_trial: int | None = None
    candidate: str | None = None
    confirmation: dict | None = None
    committed_error: float | None = None
    committed_output_errors: Any = None
    committed_types: Any = None
    partner: dict[str, dict[str, int]] | None = None
    #: other keys of the agreed value (stored on the study as they are)
    extra: dict[str, Any] = field(default_factory=dict)

    #: field -> the pattern study's user attr it is stored under
    _KEYS = {"committed": PatternAttr.COMMITTED, "gain": PatternAttr.GAIN,
             "reason": PatternAttr.COMMIT_REASON,
             "candidate_trial": PatternAttr.CANDIDATE_TRIAL,
             "candidate": PatternAttr.CANDIDATE, "confirmation": PatternAttr.CONFIRMATION,
             "committed_error": PatternAttr.COMMITTED_ERROR,
             "committed_output_errors": PatternAttr.COMMITTED_OUTPUT_ERRORS,
             "committed_types": PatternAttr.COMMITTED_TYPES, "partner": PatternAttr.PARTNER}

    def to_attrs(self) -> dict[str, Any]:
        """The pattern study's user attrs, ``committed`` last (its presence means the whole
        decision is stored)."""
        out = {key: getattr(self, name) for name, key in self._KEYS.items()
               if name != "committed" and getattr(self, name) is not None}
        out.update(self.extra)
        out[PatternAttr.COMMITTED] = self.committed
        return out

    def to_agreed(self) -> dict[str, Any]:
        """The value workers agree on (``commit/<study>``): the attrs, the reason under
        :attr:`Agreed.REASON`."""
        out = self.to_attrs()
        if PatternAttr.COMMIT_REASON in out:
            out[Agreed.REASON] = out.pop(PatternAttr.COMMIT_REASON)
        return out

    @classmethod
    def from_attrs(cls, attrs: dict[str, Any], *, agreed: bool = False) -> Decision | None:
        """A visit's decision from its study's user attrs (None: not decided), or, with
        ``agreed``, from the value workers agreed on (its other keys kept in ``extra``)."""
        if PatternAttr.COMMITTED not in attrs:
            return None
        values = {name: attrs[key] for name, key in cls._KEYS.items() if key in attrs}
        if "reason" not in values and Agreed.REASON in attrs:
            values["reason"] = attrs[Agreed.REASON]
        values["committed"] = dict(values["committed"])
        values["gain"] = float(values.get("gain", 1.0))
        if agreed:
            stored = set(cls._KEYS.values()) | {Agreed.REASON}
            values["extra"] = {k: v for k, v in attrs.items() if k not in stored}
        return cls(**values)


@dataclass(frozen=True)
class StartOutcome:
    """One whole-model start as measured (a row of the run's ``starts``).

    ``schemes``: pattern id -> scheme (indices; kept out of the stored row, the lanes hold
    them); ``points_on``: its points, by name; ``latency_ms`` / ``error``: None when not
    measured (``failure`` says why); ``chosen``: the standing model's start; ``lane``: the
    lane that descends from it; ``ab_vs_float``: the A/B that let it beat float;
    ``ab_vs_best``: the recipe's A/B against the fastest start on a measured backend (the
    recipe stands unless it is ``beaten``)."""

    name: str
    schemes: dict[str, dict[str, int]] = field(default_factory=dict)
    points_on: Any = None
    notes: list[str] = field(default_factory=list)
    exact: bool = False
    qdq: int = 0
    plan_key: str | None = None
    latency_ms: float | None = None
    error: float | None = None
    feasible: bool = False
    failure: str | None = None
    chosen: bool = False
    lane: str | None = None
    ab_vs_float: dict | None = None
    ab_vs_best: dict | None = None
    #: the repair's sensitivity table (:meth:`qdq_optuna.measure.repair.Repair.to_dict`): on a
    #: repaired start's row, or on the row of a start whose repair yielded no start
    repair: dict | None = None
    #: on a start that broke the accuracy bound: what its repair came to (the repaired start's
    #: name, or why there is none)
    repair_outcome: str | None = None
    #: the uses the start quantizes beyond its schemes (:attr:`Start.pinned`; kept out of the
    #: stored row like ``schemes``: the lanes hold them)
    pinned: tuple = ()

    #: stored in every row (the rest only when set)
    _ALWAYS = ("name", "points_on", "notes", "exact", "qdq", "plan_key", "latency_ms", "error",
               "feasible")

    def to_attrs(self) -> dict[str, Any]:
        """The stored row (without ``schemes``)."""
        out = {name: getattr(self, name) for name in self._ALWAYS}
        if self.failure:
            out["failure"] = self.failure
        if self.ab_vs_float is not None:
            out["ab_vs_float"] = self.ab_vs_float
        if self.ab_vs_best is not None:
            out["ab_vs_best"] = self.ab_vs_best
        if self.repair is not None:
            out["repair"] = self.repair
        if self.repair_outcome is not None:
            out["repair_outcome"] = self.repair_outcome
        out["chosen"] = self.chosen
        out["lane"] = self.lane
        return out

    @classmethod
    def from_attrs(cls, row: dict[str, Any]) -> StartOutcome:
        known = _known(cls)
        return cls(**{k: v for k, v in row.items() if k in known})

    @property
    def usable(self) -> bool:
        """Measured and within the accuracy bound: a start a lane may descend from."""
        return self.feasible and self.latency_ms is not None

    def trial_attrs(self) -> dict[str, Any]:
        """The user attrs of its ``RUN/_starts`` trial."""
        attrs = {StartAttr.START: self.name, StartAttr.POINTS_ON: self.points_on,
                 StartAttr.NOTES: self.notes, StartAttr.EXACT: self.exact,
                 StartAttr.QDQ_COUNT: self.qdq, StartAttr.ERROR: self.error,
                 StartAttr.FEASIBLE: self.feasible, StartAttr.CHOSEN: self.chosen,
                 StartAttr.LANE: self.lane, StartAttr.PLAN_KEY: self.plan_key}
        if self.failure:
            attrs[StartAttr.FAILURE] = self.failure
        return attrs


@dataclass(frozen=True)
class FinishedRun:
    """How a run last finished (``RunAttr.FINISHED``): its settings' digest, when, its speedup
    and its report's digest; a rerun with the same settings returns that report."""

    fingerprint: str | None = None
    at: str | None = None
    speedup: float | None = None
    report_sha256: str | None = None

    def to_attrs(self) -> dict[str, Any]:
        return {"fingerprint": self.fingerprint, "at": self.at, "speedup": self.speedup,
                "report_sha256": self.report_sha256}

    @classmethod
    def from_attrs(cls, attrs: dict[str, Any]) -> FinishedRun:
        return cls(**{k: attrs.get(k) for k in ("fingerprint", "at", "speedup",
                                                 "report_sha256")})


@dataclass(frozen=True)
class AgreedStarts:
    """The starts as the run agreed them (``RunAttr.STARTS``): ``chosen`` (the standing
    model's start), ``lane_starts`` (lane -> start name), ``order`` (the lanes in descent
    order), ``lanes`` (lane -> its start's schemes), ``rows`` (one per start measured) and
    the ``measurements`` deciding them took (None: a run stored before they were counted)."""

    chosen: str
    lane_starts: dict[str, str] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)
    measurements: int | None = None
    lanes: dict[str, dict[str, dict[str, int]]] = field(default_factory=dict)
    rows: tuple[StartOutcome, ...] = ()
    pinned: dict[str, list] = field(default_factory=dict)
    #: what the forward search did (:meth:`qdq_optuna.search._starts.ForwardStart.report`;
    #: None: it did not run): the run then ends without a descent
    forward: dict | None = None
    #: the recipe that tightened the default accuracy bound
    #: (:class:`~qdq_optuna.measure.bound.RecipeFloor` as a dict; None: not tightened)
    recipe_floor: dict | None = None

    def to_attrs(self) -> dict[str, Any]:
        """The stored value (its keys in the order they were always stored; ``pinned`` and
        ``forward`` only when set, so earlier runs' values read the same)."""
        out = {"chosen": self.chosen, "lane_starts": self.lane_starts, "order": self.order,
               "measurements": self.measurements, "lanes": self.lanes,
               "starts": [r.to_attrs() for r in self.rows]}
        if any(self.pinned.values()):
            out["pinned"] = {lane: [list(u) for u in uses]
                             for lane, uses in self.pinned.items() if uses}
        if self.forward is not None:
            out["forward"] = self.forward
        if self.recipe_floor is not None:
            out["recipe_floor"] = self.recipe_floor
        return out

    @classmethod
    def from_attrs(cls, attrs: dict[str, Any]) -> AgreedStarts:
        rows = tuple(StartOutcome.from_attrs(r) for r in attrs.get("starts") or [])
        return cls(attrs["chosen"], dict(attrs.get("lane_starts") or {}),
                   list(attrs.get("order") or []), attrs.get("measurements"),
                   dict(attrs.get("lanes") or {}), rows, dict(attrs.get("pinned") or {}),
                   attrs.get("forward"), attrs.get("recipe_floor"))


@dataclass(frozen=True)
class Visit:
    """One descent visit as its pattern study stores it (its user attrs): where it ran
    (``pattern_id``, ``round``, ``lane``, ``order``), the scheme it started from, its moves,
    its reference and, once decided, its :class:`Decision` (the attrs a decision writes are
    read as stored too, so a decision being written reads as it always did)."""

    pattern_id: str
    round: int
    lane: str = ""
    order: int = 0
    decision: Decision | None = None
    from_scheme: list[str] = field(default_factory=list)
    moves: int = 0
    moves_skipped: int = 0
    context_key: str | None = None
    reference_ms: float | None = None
    reference_error: float | None = None
    converged_after: int | None = None
    #: the decision's attrs as stored (before ``committed``, they may be there already)
    gain: float = 1.0
    reason: str | None = None
    committed_error: float | None = None
    committed_types: Any = None
    partner: dict[str, dict[str, int]] | None = None

    @classmethod
    def from_attrs(cls, attrs: dict[str, Any]) -> Visit:
        a, get = PatternAttr, attrs.get
        return cls(attrs[a.PATTERN_ID], get(a.ROUND), get(a.LANE, ""), get(a.ORDER, 0),
                   Decision.from_attrs(attrs), get(a.FROM, []), get(a.MOVES, 0),
                   get(a.MOVES_SKIPPED, 0), get(a.CONTEXT_KEY), get(a.REFERENCE_MS),
                   get(a.REFERENCE_ERROR), get(a.CONVERGED_AFTER), float(get(a.GAIN, 1.0)),
                   get(a.COMMIT_REASON), get(a.COMMITTED_ERROR), get(a.COMMITTED_TYPES),
                   get(a.PARTNER))

    @property
    def decided(self) -> bool:
        return self.decision is not None

    @property
    def changed(self) -> bool:
        """Decided, and the decision changed the standing model."""
        if self.decision is None:
            return False
        on = sorted(p for p, v in self.decision.committed.items() if v)
        return on != sorted(self.from_scheme) or bool(self.partner)


@dataclass(frozen=True)
class VisitEntry:
    """One visit as the report lists it (schemes by point name)."""

    pattern: str
    round: int
    lane: str
    status: str
    from_scheme: list[str]
    committed_scheme: list[str]
    gain: float
    commit_reason: str | None
    moves: int
    moves_skipped: int
    partner: dict[str, list[str]] | None = None
    converged_after: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """report.json's visit (``partner`` and ``converged_after`` only when set)."""
        out = {k: getattr(self, k) for k in (
            "pattern", "round", "lane", "status", "from_scheme", "committed_scheme", "gain",
            "commit_reason", "moves", "moves_skipped")}
        if self.partner:
            out["partner"] = self.partner
        if self.converged_after is not None:
            out["converged_after"] = self.converged_after
        return out


@dataclass(frozen=True)
class PatternStanding:
    """A pattern in a lane's standing model: its standing ``scheme`` (indices), the product
    of its committed visits' gains, the visits that changed it (its own and other patterns'
    chain moves), its start's scheme by name and its own last visit (None: never visited)."""

    pattern_id: str
    scheme: dict[str, int]
    gain: float
    visits: tuple[VisitEntry, ...]
    start_scheme: list[str]
    last: Visit | None = None
