"""Measuring plans: the one place the search asks the backend to time a model.

A *plan* (:class:`~qdq_optuna.placement.export.QuantPlan`) is one Q/DQ placement of the whole model;
its key names the model it builds. :class:`PlanMeasurer` measures the baseline (the user's
model), the whole-model starts, each visit's reference (the standing model), a candidate's
latency against that reference (the screen, then an interleaved A/B), confirmations and the
final comparison, and scores a plan's output errors.
It counts every time it asks the backend to time a model (``measurements``, per phase in
``by_phase``), never measures one model twice in a run (the run record's measurement memo,
shared by workers; output errors likewise), and remembers the plans that failed in this
process, so a re-proposed failure is skipped rather than crashing the backend again.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from qdq_optuna.backends.base import BackendError, BackendUnavailable
from qdq_optuna.errors import UserError
from qdq_optuna.measure.accuracy import ErrorScorer
from qdq_optuna.measure.timing import (
    SCREEN_DISCARD_RATIO,
    Comparison,
    Measurer,
    Timing,
    Until,
    far_off,
    paired_comparison,
)
from qdq_optuna.placement.export import QuantPlan
from qdq_optuna.record import PHASES, Measurement, PlanMemo  # noqa: F401 (PHASES: re-exported)

log = logging.getLogger("qdq_optuna")

@dataclass(frozen=True)
class Reference:
    """What a pattern study's candidates are timed against: the model with everything that
    stands and this pattern's standing scheme (``source``: bytes, or a path in external mode),
    its latency and its one-session screen."""

    plan: QuantPlan
    source: object
    ms: float
    screen_ms: float | None


def region_measurer(measurer: Measurer) -> Measurer:
    """The subgraph screen's measurer: the kernel table's protocol on the run's backend."""
    from qdq_optuna.measure.kernels import KERNEL_PROTOCOL

    return Measurer(measurer.backend, KERNEL_PROTOCOL)


class PlanMeasurer:
    """Latencies and errors of plans (see the module docstring)."""

    #: a candidate this much slower than its reference in the screen is dropped (the report
    #: states it beside the counts)
    screen_discard_ratio = SCREEN_DISCARD_RATIO

    def __init__(self, measurer: Measurer, memo: PlanMemo, scorer: ErrorScorer | None = None,
                 errors: PlanMemo | None = None, regions=None, audit: bool = False) -> None:
        self.measurer = measurer
        self.memo = memo
        self.scorer = scorer
        self.errors = errors
        self.measurements = 0
        self.by_phase: Counter[str] = Counter()
        self.cache_hits = 0
        #: plan key -> its measurement by :meth:`measure_together`, not yet read by
        #: :meth:`measure` (which then counts no cache hit)
        self.together: dict[str, Measurement] = {}
        #: plan key -> (its :meth:`measure_together` call's baseline timing, its own timing)
        self.rounds_of: dict[str, tuple[Any, Any]] = {}
        #: plan key -> where that model failed in this process; the sampler does not avoid
        #: failed schemes, so a re-proposal is pruned instead of crashing the worker again
        self.failed: dict[str, str] = {}
        #: the subgraph screen (``Config.subgraph_screen``; ``regions``: the prepared graph):
        #: the graph, and the measurer of its region A/Bs (None: off, or an exact backend)
        self.regions: tuple | None = None
        #: ``Config.subgraph_screen_audit``: a region measured slower is A/B-timed as a whole
        #: model all the same (the screen's drops checked, nothing screened out)
        self.audit = audit
        if regions is not None and not measurer.deterministic:
            self.regions = (regions, region_measurer(measurer))

    @property
    def deterministic(self) -> bool:
        return self.measurer.deterministic

    def set_deadline(self, at: float | None) -> None:
        """Every measurement of the run takes its minimum rounds past ``at``
        (``time.monotonic()``; see :attr:`Measurer.deadline`)."""
        self.measurer.deadline = at
        if self.regions is not None:
            self.regions[1].deadline = at

    @contextmanager
    def whole(self) -> Iterator[None]:
        """Measurements that run to their verdict past the run's deadline: a decision that
        must not be cut short (a recipe file's A/B against what would ship: cut at three
        rounds, a ViT's 1.65x faster ``quantize_dynamic`` file lost to the float model)."""
        kept = self.measurer.deadline  # the screen's measurer always has the same
        self.set_deadline(None)
        try:
            yield
        finally:
            self.set_deadline(kept)

    def _count(self, phase: str, n: int = 1) -> None:
        self.measurements += n
        self.by_phase[phase] += n

    # -- the float model and references --------------------------------------------------
    def measure(self, source, key: str, phase: str, qdq: int = 0) -> tuple[float, Measurement]:
        """One model's own latency (not against a reference), once per run: the baseline and
        the starts. ``key``: the plan key (or another name) the memo keeps it under."""
        if key in self.together:
            record = self.together.pop(key)
            return record.latency_ms, record
        cached = self._cached_key(key)
        if cached is not None:
            return cached.latency_ms, cached
        m = self.measurer.screen(source) if self.deterministic else self.measurer.measure(source)
        self._count(phase)
        record = Measurement(latency_ms=m.score_ms, stats=m.to_dict(), qdq=qdq)
        self.memo.put(key, record)
        return m.score_ms, record

    def measure_together(self, baseline, baseline_ms: float, items: list, phase: str) -> None:
        """Models not measured yet in this run (``items``: ``(key, source, qdq)``), timed in
        the same interleaved rounds as the ``baseline`` model: each one's latency is
        ``baseline_ms`` times its ratio to the baseline in those rounds (drift between
        measurements minutes apart cancels), kept in the memo that :meth:`measure` reads."""
        todo, seen = [], set()
        for key, source, qdq in items:
            if key not in seen and self.memo.get(key) is None:
                seen.add(key)
                todo.append((key, source, qdq))
        if not todo:
            return
        ms = self.measurer.interleaved([baseline] + [src for _, src, _ in todo],
                                       sessions=self.measurer.protocol.sessions)
        now = ms[0].score_ms
        for (key, _, qdq), m in zip(todo, ms[1:]):
            self.rounds_of[key] = (ms[0], m)  # the call's rounds time each of its models
            self._count(phase)
            stats = {**m.to_dict(), "baseline_now_ms": now}
            record = Measurement(latency_ms=baseline_ms * m.score_ms / now, stats=stats, qdq=qdq)
            self.memo.put(key, record)
            self.together[key] = record

    def together_comparison(self, candidate: str, reference: str) -> Comparison | None:
        """The A/B two models (plan keys) had in the rounds :meth:`measure_together` timed
        them in (:func:`~qdq_optuna.measure.timing.paired_comparison`; None: not timed in
        the same call of this process)."""
        a, b = self.rounds_of.get(candidate), self.rounds_of.get(reference)
        if a is None or b is None or a[0] is not b[0]:
            return None
        return paired_comparison(a[1], b[1], self.measurer.protocol)

    def reference(self, source, key: str | None = None) -> list[float]:
        """``[latency_ms, screen_ms]`` of a visit's reference model (the standing model). On a
        deterministic backend a model measured before costs nothing; a measured backend times
        it again (its trials are compared with it in the same minutes)."""
        if self.deterministic:
            cached = self._cached_key(key) if key is not None else None
            if cached is not None:
                return [cached.latency_ms, cached.latency_ms]
            ref = self.measurer.screen(source)
            self._count("descent")
            return [ref.score_ms, ref.score_ms]
        ref_ms = self.measurer.measure(source).score_ms
        ref_screen = self.measurer.screen(source).score_ms
        self._count("descent")
        return [ref_ms, ref_screen]

    def known(self, reference: Reference) -> None:
        """A trial that builds the reference itself is not measured: its ratio is 1 exactly."""
        self.memo.put(reference.plan.key, Measurement(
            kind="reference", latency_ms=reference.ms, ratio=1.0, ci=[1.0, 1.0], rounds=0,
            decided=True, sessions=0, reference=True, reference_ms=reference.ms))

    # -- candidates ----------------------------------------------------------------------
    def _cached_key(self, key: str, ref_ms: float | None = None) -> Measurement | None:
        """The same model measured earlier in this run (any pattern or process); against
        ``ref_ms``, see :meth:`~qdq_optuna.record.records.Measurement.as_cached`."""
        cached = self.memo.get(key)
        if cached is None:
            return None
        self.cache_hits += 1
        return cached.as_cached(ref_ms)

    def latency(self, exporter, plan: QuantPlan, reference: Reference,
                where: str) -> tuple[float, Measurement]:
        """A candidate's latency: ``reference.ms`` times its ratio to the reference, and its
        :class:`~qdq_optuna.record.records.Measurement` (the trial's ``measurement`` user attr;
        ``kind``: ``ab``, interleaved A/B against the pattern's reference; ``screened_out``,
        dropped by the screen, see :data:`~qdq_optuna.measure.timing.SCREEN_DISCARD_RATIO`;
        ``screen``, one session, fast timing; ``deterministic``; ``cached`` when the model was
        measured before). ``where`` names the trial, should the model fail (BackendError)."""
        cached = self._cached_key(plan.key, reference.ms)
        if cached is not None:
            return cached.latency_ms, cached
        try:
            record = dataclasses.replace(self._time(exporter.source(plan), reference, plan),
                                         qdq=len(plan))
        except BackendError:
            self.failed[plan.key] = where
            raise
        self.memo.put(plan.key, record)
        return record.latency_ms, record

    def _region(self, data, ref: Reference, plan: QuantPlan):
        """The subgraph A/B of the candidate's changed region against the reference's
        (None: the screen is off, or the models are files or could not be cut)."""
        if self.regions is None or not isinstance(data, bytes) \
                or not isinstance(ref.source, bytes):
            return None
        import onnx

        from qdq_optuna.measure.kernels import time_region

        graph, measurer = self.regions
        sub = time_region(measurer, graph, onnx.load_from_string(data),
                          onnx.load_from_string(ref.source), plan, ref.plan)
        self.by_phase["subgraph"] += sub is not None
        return sub

    def _time(self, data, ref: Reference, plan: QuantPlan | None = None) -> Measurement:
        if self.deterministic:
            m = self.measurer.screen(data)
            ratio = m.score_ms / ref.ms
            self._count("descent")
            return Measurement(kind="deterministic", latency_ms=m.score_ms, ratio=ratio,
                               ci=[ratio, ratio], rounds=1, decided=True, sessions=1,
                               reference_ms=ref.ms, deterministic=True)
        if self.measurer.protocol.name == Timing.FAST or ref.screen_ms is None:
            m = self.measurer.screen(data)
            self._count("descent")
            return Measurement(kind="screen", latency_ms=m.score_ms, ratio=m.score_ms / ref.ms,
                               rounds=1, sessions=m.sessions, reference_ms=ref.ms,
                               stats=m.to_dict())
        sub = self._region(data, ref, plan) if plan is not None else None
        if sub is not None and sub.verdict == "slower" and not self.audit:  # region slower
            return Measurement(kind="screened_out", screened_out=True,
                               latency_ms=ref.ms * sub.ratio, ratio=sub.ratio, rounds=0,
                               sessions=0, reference_ms=ref.ms,
                               extra={"subgraph": sub.to_dict()})
        screen = self.measurer.screen(data)
        self._count("descent")
        if far_off(screen.score_ms, ref.screen_ms):
            # the reference's screen dates from the start of the pattern: screen it again
            # now, so that drift since then cannot discard a candidate
            now = self.measurer.screen(ref.source)
            self._count("descent")
            if far_off(screen.score_ms, now.score_ms):
                ratio = screen.score_ms / now.score_ms
                return Measurement(kind="screened_out", screened_out=True,
                                   latency_ms=ref.ms * ratio, ratio=ratio, rounds=1,
                                   sessions=screen.sessions, reference_ms=ref.ms,
                                   screen_ms=screen.score_ms, reference_screen_ms=now.score_ms,
                                   screen_threshold=SCREEN_DISCARD_RATIO,
                                   stats=screen.to_dict())
        cmp = self.measurer.compare(data, ref.source)
        self._count("descent")
        extra = {} if sub is None else {  # did the region rank it as the whole model did?
            "subgraph": {**sub.to_dict(), "agrees": (sub.ratio < 1) == (cmp.ratio < 1),
                         "whole_verdict": cmp.verdict}}
        return Measurement(kind="ab", latency_ms=ref.ms * cmp.ratio, ratio=cmp.ratio,
                           ci=[cmp.ci_low, cmp.ci_high], rounds=cmp.rounds, decided=cmp.decided,
                           verdict=cmp.verdict, reference_ms=ref.ms,
                           sessions=screen.sessions + cmp.candidate.sessions,
                           screen_ms=screen.score_ms, extra=extra)

    # -- whole-model comparisons ---------------------------------------------------------
    def compare(self, candidate, reference, phase: str, *,
                until: Until = Until.VERDICT) -> Comparison:
        """An interleaved A/B of two models (a confirmation, the final figure, a front point)."""
        cmp = self.measurer.compare(candidate, reference, until=until)
        self._count(phase)
        return cmp

    def same_model(self, source, phase: str) -> Comparison:
        """The figure of a model compared with itself (:meth:`Measurer.same_model`)."""
        cmp = self.measurer.same_model(source)
        self._count(phase)
        return cmp

    # -- errors --------------------------------------------------------------------------
    def error(self, exporter, plan: QuantPlan, tag: str = "") -> dict:
        """Output errors of ``plan`` vs FP32 on the validation data (accuracy modes), scored
        once per run (the record's error memo, shared by workers); ``tag`` names another
        model of the same plan (its bias-corrected export), memoized apart."""
        key = plan.key + tag
        hit = self.errors.get(key) if self.errors is not None else None
        if hit is not None:
            return dict(hit)
        record = self.scorer.score_bytes(exporter.source(plan))  # bytes, or a path
        if self.errors is not None:
            self.errors.put(key, record)
        return record


def measure_baseline(plans: PlanMeasurer, source, key: str, backend_name: str,
                     model: str) -> tuple:
    """The baseline's measurement ``(ms, record)`` (``source``: the user's model, bytes or a
    path; ``key``: its memo key). A backend that cannot run it ends the run with one clear
    line; a crashed or hung worker is given one more try first."""
    for attempt in (1, 2):
        try:
            plans.measurer.warm_up([source])
            return plans.measure(source, key, "baseline")
        except BackendUnavailable:
            raise
        except BackendError as exc:
            if attempt == 1 and getattr(exc, "transient", False):
                log.warning("measuring the baseline failed (%s); trying once more", exc)
                continue
            raise UserError(f"backend {backend_name} cannot run the float model "
                            f"{model}: {exc}") from exc
    raise AssertionError("unreachable")
