"""The descent: rounds over the patterns, each visit tuned against the whole standing model.

A *lane* descends from one start (the standing model the starts phase chose, and possibly the
recipe: see :mod:`~qdq_optuna.search._starts`). A round visits the patterns in order of first
appearance; a visit (:class:`~qdq_optuna.search._pattern.PatternStudy`, study
``RUN/P003/roundN``) places the pattern between every other pattern's standing scheme, starts
from its own, and our sampler proposes the visit's moves in expected-gain order, each on the
best state so far (its move engine, ``samplers/qdq_mutation/_visit.py``, reads the visit's
description that :mod:`~qdq_optuna.search._moves` writes); other samplers propose their own
schemes with the same start and budget. Its decision replaces the pattern's standing scheme (and, for a
chain move, the neighbours' it touched). A pattern whose surroundings carry the same Q/DQ as at
its last visit is skipped. A lane ends when a round changes nothing, after ``1 +
Config.refine_rounds`` rounds, or when the run's ``--timeout`` ends (its standing model is
always a finished, feasible state: every decision passed the guard). Each lane learns which move
signatures pay on its own; a later lane starts from the earlier lanes' clear losses as a prior
(a signature that only lost there is given up one failure sooner: ``PRIOR_CLEAR_LOSS``).
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable, Iterator

from optuna.trial import TrialState

from qdq_optuna.placement.points import PatternPoints
from qdq_optuna.placement.seeds import PatternCache
from qdq_optuna.record import TrialAttr, Visit
from qdq_optuna.search._limit import (
    NOT_EXPECTED_PREFIX,
    Boundary,
    GapPlan,
    boundaries,
    estimate,
    heavy_nodes,
    node_patterns,
    plan_visits,
)
from qdq_optuna.search._moves import MoveSpace, MoveStats
from qdq_optuna.search._outcome import DescentFindings
from qdq_optuna.search._pattern import OutOfTime, PatternStudy, Search, Seed
from qdq_optuna.search._unfused import (
    FINAL_LINE,
    Unfused,
    kernel_table_entry,
    placed_and_modes,
    skip_reason,
)

log = logging.getLogger("qdq_optuna")

#: an earlier lane's failure counts in a later lane's prior only when the move lost at least
#: this share against the visit's best: a near miss there is weak evidence from another start
#: (on the YOLO-like zoo model ``on:Mul>Split`` lost 0.94-0.97 % three times from float, then
#: paid three times from the recipe; the ~12 signatures that lost 1.3-13 % from float never
#: paid from the recipe either)
PRIOR_CLEAR_LOSS = 0.01
#: how much a lane trusts the limit estimate before its first visit, in noise floors of gap
#: realized (see :class:`Realization`)
REALIZATION_PRIOR = 2.0
#: priced visits a lane makes before what they realized can skip a priced pattern: one visit
#: is one A/B. ShuffleNet (onnx's test data, ONNX Runtime 1.32, AMD EPYC): its first visit
#: (0.50 ms of gap, 6.7 noise floors) failed in one run of four, which left every other
#: pattern expected within noise, and the run shipped float (0.998x) where the other three
#: runs of the same model committed and shipped 1.08-1.14x
MIN_PRICED_VISITS = 2
#: why a visit was not made: what the lane's visits realized of the estimate says this
#: pattern's gap would not show
NOT_EXPECTED = (NOT_EXPECTED_PREFIX + ": the lane's visits realized {realized:.3g} of the "
                "{estimated:.3g} ms the limit estimate gave them, so this pattern's {gap:.3g} "
                "ms is expected to yield {expected:.3g} ms (noise {noise:.3g} ms)")
#: the same for a pattern visited only for what the runtime left unfused in it
NOT_EXPECTED_UNFUSED = (NOT_EXPECTED_PREFIX + ": what the runtime left unfused (which the "
                        "estimate cannot price) is trusted as far as the lane's priced visits "
                        "realized their estimate ({trust:.2g}), and its {visits} visit(s) made "
                        "for it realized {realized:.3g} ms, so this one is expected to yield "
                        "{expected:.3g} ms (noise {noise:.3g} ms)")


class _Account:
    """Gap given and gain measured (ms) by one kind of visit of a lane."""

    def __init__(self) -> None:
        self.estimated = 0.0
        self.realized = 0.0
        self.visits = 0

    def share(self, noise_ms: float, trust: float = 1.0) -> float:
        """Realized over estimated, with :data:`REALIZATION_PRIOR` noise floors estimated
        and ``trust`` times as many realized before the first visit."""
        prior = REALIZATION_PRIOR * noise_ms
        return (self.realized + prior * trust) / (self.estimated + prior)


class Realization:
    """How much of the limit estimate's gap a lane's visits turned into measured gain.

    The estimate times each kernel alone (integer in, integer out); a node made integer
    between float neighbours also pays the conversions and reorders around it, which the
    estimate does not see. So the lane keeps score: each decided visit adds the gap the plan
    gave its pattern and the gain it measured, in ms. A pattern is visited while its gap times
    the share realized so far, with :data:`REALIZATION_PRIOR` noise floors realized of as many
    estimated before the first visit, is above the noise. ShuffleNet (onnx's test data, ONNX
    Runtime 1.32): the estimate put 0.72 ms of its 4 ms float model in eleven patterns, and
    eleven visits measured none of it in 130 s: the first two failed visits now leave the rest
    expected within noise (never fewer than :data:`MIN_PRICED_VISITS`: one failed A/B of a
    large gap once left all the rest expected within noise).

    A pattern whose gap is within the noise is visited only for what the runtime left unfused
    in it, which the estimate cannot price: such visits count one noise floor each and keep a
    score of their own, whose prior is the priced visits' share, at most one (as far as the
    estimate proved right, what it cannot price is trusted too, never more than fully; with no
    priced visit, fully). So a lane whose priced visits realized less than estimated skips
    them, as one score did (DenseNet-121: a first unfused-only visit trusted apart cost 57 s
    for nothing), and one whose priced visits paid tries one and stops at its failure: a
    ViT-like model (ONNX Runtime 1.32) realized 3.7 of 2.6 ms priced, which under one score
    kept seven unfused-only visits alive (75 of 121 moves) that measured nothing (tune 455 ->
    208 s, the same file within noise)."""

    def __init__(self) -> None:
        self.priced = _Account()
        self.unfused = _Account()

    @property
    def estimated(self) -> float:
        return self.priced.estimated + self.unfused.estimated

    @property
    def realized(self) -> float:
        return self.priced.realized + self.unfused.realized

    @staticmethod
    def gap(plan: GapPlan, pid: str) -> float:
        """The gap a visit of ``pid`` is expected to close by the plan (ms, at least its
        noise floor)."""
        return max(plan.gaps.get(pid, 0.0), plan.noise_ms)

    def account(self, plan: GapPlan, pid: str) -> _Account:
        """The score ``pid``'s visit counts in: priced by the estimate, or unfused only."""
        return self.priced if plan.gaps.get(pid, 0.0) >= plan.noise_ms else self.unfused

    def add(self, plan: GapPlan, pid: str, visit: Visit) -> None:
        """Count a decided visit of ``pid`` (its gain against its reference, in ms)."""
        account = self.account(plan, pid)
        account.estimated += self.gap(plan, pid)
        account.visits += 1
        if visit.changed and visit.reference_ms and visit.gain > 1.0:
            account.realized += visit.reference_ms * (1.0 - 1.0 / visit.gain)

    def to_dict(self) -> dict:
        """The lane's score after a round (report.json ``descent_plan``): both kinds together,
        and the visits made for unfused sites alone."""
        return {"estimated_ms": round(self.estimated, 6), "realized_ms": round(self.realized, 6),
                "unfused_visits": self.unfused.visits,
                "unfused_realized_ms": round(self.unfused.realized, 6)}

    def skip_reason(self, plan: GapPlan, pid: str) -> str | None:
        """Why ``pid`` is not worth a visit (None: it is)."""
        gap, noise = self.gap(plan, pid), plan.noise_ms
        account = self.account(plan, pid)
        if account is self.priced and account.visits < MIN_PRICED_VISITS:
            return None  # too few A/Bs yet to distrust the estimate
        trust = min(1.0, self.priced.share(noise)) if account is self.unfused else 1.0
        expected = gap * account.share(noise, trust)
        if expected >= noise * (1.0 - 1e-9):
            return None
        if account is self.unfused:
            return NOT_EXPECTED_UNFUSED.format(trust=trust, realized=account.realized,
                                               visits=account.visits, expected=expected,
                                               noise=noise)
        return NOT_EXPECTED.format(realized=account.realized, estimated=account.estimated,
                                   gap=gap, expected=expected, noise=noise)


class Descent:
    """The descent of a run's lanes (see the module docstring). ``rounds``: rounds at most per
    lane; ``lanes``: lane names in descent order; ``cache``: the user's pattern cache (its
    best scheme of a pattern is that pattern's first move)."""

    def __init__(self, search: Search, *, rounds: int, lanes: list[str],
                 cache: PatternCache | None = None,
                 seeds: Callable[[PatternPoints], list[Seed]] | None = None,
                 on_change: Callable[[str], None] | None = None) -> None:
        self.s = search
        self.rounds = rounds
        self.lanes = lanes
        self.cache = cache
        self.seeds = seeds
        self.space = MoveSpace(search.prepared)
        self.tunable: list[PatternPoints] = search.prepared.tunable
        #: the runtime's own report of the standing model prunes moves, reads the kernel
        #: table, the limit and the gap that plans the rounds (one objective: a commit needs a
        #: latency gain, also under a bound; with two objectives removing a fused pair can
        #: still pay in error). A run given its bound, data or metric explicitly pruned
        #: nothing and reported no limit: the real YOLOv8n, 2 visits in 140 s
        self.unfused = (Unfused(search, self.space.uses_of) if search.config.prune_by_runtime
                        and not search.settings.multi_objective else None)
        #: (lane, round, pattern id, why) of each visit the runtime's report skipped
        self.skipped: list[tuple[str, int, str, str]] = []
        #: called with the lane after a visit changed its standing model (anytime result)
        self.on_change = on_change
        #: node name -> pattern id (where a node's gap to its faster kernel is)
        self.patterns = node_patterns(search.prepared)
        #: the kernel table's op types -> pattern id -> its nodes of them
        self.heavy: dict[frozenset, dict[str, set[str]]] = {}
        #: the kernel table's op types -> the tensors where conversions may stand
        self.bounds: dict[frozenset, list[Boundary]] = {}
        #: each round's plan by the gap (report.json ``descent_plan``)
        self.plans: list[dict] = []

    def run(self) -> None:
        for lane_no, lane in enumerate(self.lanes):
            self.lane(lane, lane_no)

    def findings(self, shipped: bytes | None) -> DescentFindings:
        """What the descent read of the runtime, with the kernel table's nodes as the
        ``shipped`` model placed them (its bytes; None: the column is left out)."""
        u = self.unfused
        if u is None:
            return DescentFindings(list(self.skipped))
        if u.kernels is None:
            return DescentFindings(list(self.skipped), u.reads, None)
        placed, modes = placed_and_modes(u.kernels, shipped)
        table = kernel_table_entry(u.kernels, placed, modes)
        limit = None
        if placed is not None and self.s.baseline_ms:
            limit = estimate(u.kernels, self.s.baseline_ms, placed, self.patterns,
                             modes, self._boundaries(u.kernels.ops)).to_dict()
        return DescentFindings(list(self.skipped), u.reads, table, limit, list(self.plans))

    def order(self, lane_no: int, rnd: int, idx: int) -> int:
        n = len(self.tunable)
        return (lane_no * (self.rounds + 1) + rnd) * n + idx

    # -- a lane ----------------------------------------------------------------------------
    def lane(self, lane: str, lane_no: int) -> None:
        """Rounds of visits until one changes nothing (or ``rounds`` rounds)."""
        stats = self._stats(lane)
        label = f"{lane} round" if lane else "round"
        realization = Realization()
        for rnd in range(1, self.rounds + 1):
            plan = self._gap_plan(lane, rnd)
            if plan is not None and plan.end:
                log.info("%s %d: %s", label, rnd, plan.end)
                self.skipped += [(lane, rnd, pp.pattern.id, plan.end) for pp in self.tunable]
                break
            self.s.progress.stage(f"{label} {rnd}", len(self.tunable))
            changed, before = 0, len(self.skipped)
            for pid, why in (plan.skipped.items() if plan is not None else ()):
                self.skipped.append((lane, rnd, pid, why))
                self.s.progress.skip(pid, why)
            for idx, pp in self._ordered(plan):
                if plan is not None and self._not_expected(realization, plan, lane, rnd, pp):
                    continue
                now = self.visit(lane, self.order(lane_no, rnd, idx), rnd, pp, stats)
                decided = (self._decided_visit(lane, pp.pattern.id, rnd) if plan is not None
                           else None)
                if decided is not None:
                    realization.add(plan, pp.pattern.id, decided)
                changed += now
                if now and self.on_change is not None:
                    self.on_change(lane)
            if plan is not None:  # the round's score, beside its plan in the report
                self.plans[-1].update(realization.to_dict())
            log.info("%s %d: %d pattern(s) changed", label, rnd, changed)
            if not changed:
                # every pattern had nothing the runtime left unfused, or had it measured
                # without a gain: one line says so (once per lane)
                if len(self.skipped) > before:
                    log.info("%s", FINAL_LINE)
                break

    def _not_expected(self, realization: Realization, plan: GapPlan, lane: str, rnd: int,
                      pp: PatternPoints) -> bool:
        """Skip ``pp`` (with the reason) when what the lane realized says its gap would not
        show; a visit already decided (a resumed run) is never skipped."""
        pid = pp.pattern.id
        why = realization.skip_reason(plan, pid)
        # the stored visits are read (every study of the run) only where the score would skip
        if why is not None and self._decided_visit(lane, pid, rnd) is None:
            self.skipped.append((lane, rnd, pid, why))
            self.s.progress.skip(pid, why)
            return True
        return False

    def _decided_visit(self, lane: str, pid: str, rnd: int) -> Visit | None:
        """The lane's decided visit of ``pid`` in round ``rnd`` (None: none, or not decided)."""
        return next((v for v in self.s.record.visits(lane)
                     if v.pattern_id == pid and v.round == rnd and v.decided), None)

    def _ordered(self, plan: GapPlan | None) -> list[tuple[int, PatternPoints]]:
        """(index, pattern) in the round's visit order: the plan's, else first appearance."""
        if plan is None:
            return list(enumerate(self.tunable))
        index = {pp.pattern.id: i for i, pp in enumerate(self.tunable)}
        return [(index[pid], self.tunable[index[pid]]) for pid in plan.order]

    def _gap_plan(self, lane: str, rnd: int) -> GapPlan | None:
        """The round's visits planned by the standing model's gap to the limit (None: no
        kernel table to plan by, or no time left to read one: every pattern in order)."""
        u, s = self.unfused, self.s
        if u is None or not u.evidence or not s.baseline_ms:
            return None
        left = s.remaining()
        if left is not None and left <= 0:  # no kernel is timed out of time
            return None
        schemes = s.record.standing(lane, s.record.visits(lane))
        what = u.of(schemes, lane)  # times the standing model's kernels not timed yet
        integer, modes = u.standing_placed(schemes, lane)
        if what is None or integer is None:
            return None
        limit = estimate(u.kernels, s.baseline_ms, integer, self.patterns, modes,
                         self._boundaries(u.kernels.ops))
        if u.kernels.ops not in self.heavy:
            self.heavy[u.kernels.ops] = heavy_nodes(s.prepared, u.kernels.ops)
        plan = plan_visits([pp.pattern.id for pp in self.tunable], limit,
                           u.pattern_sites(what), self.heavy[u.kernels.ops], self._start_ms(lane))
        self.plans.append({"lane": lane, "round": rnd, **plan.to_dict()})
        log.info("round %d planned by the gap: standing %.4g ms, limit %.4g ms; order %s; "
                 "%d skipped", rnd, limit.placed_ms, limit.limit_ms, ", ".join(plan.order),
                 len(plan.skipped))
        return plan

    def _boundaries(self, ops: frozenset[str]) -> list[Boundary]:
        """Where conversions may stand, for the kernel table's op types (once per set)."""
        if ops not in self.bounds:
            self.bounds[ops] = boundaries(self.s.prepared, ops)
        return self.bounds[ops]

    def _start_ms(self, lane: str) -> float | None:
        """The measured latency of the start ``lane`` descends from (None: not known)."""
        starts = self.s.record.starts()
        name = starts.lane_starts.get(lane) if starts is not None else None
        row = next((r for r in starts.rows if r.name == name), None) if name else None
        return row.latency_ms if row is not None else None

    def _stats(self, lane: str) -> MoveStats:
        """What the lane's decided visits learnt about move kinds, with what the earlier lanes
        (in descent order) learnt as a prior (a signature that clearly lost there and never
        paid is given up sooner here: :meth:`MoveStats.need`). Read back from the trials, so
        a resumed process orders and skips moves as the first one did (earlier lanes are
        decided before a later one starts)."""
        prior = MoveStats(0)
        for other in self.lanes[:self.lanes.index(lane)]:
            for trials in self._decided(other):
                self._absorb(prior, trials, clear=PRIOR_CLEAR_LOSS)
        stats = MoveStats(self.s.config.skip_failed_moves, prior.to_attr())
        for trials in self._decided(lane):
            self._absorb(stats, trials)
        return stats

    def _decided(self, lane: str) -> Iterator[list]:
        """The trials of each of the lane's decided visits, in the order they ran."""
        for visit in self.s.record.visits(lane):
            if visit.decided:
                yield self.s.record.visit_trials(visit)

    @staticmethod
    def _absorb(stats: MoveStats, trials, clear: float | None = None) -> None:
        """Count the moves' outcomes; with ``clear``, a failure only when the trial was
        slower than the visit's best before it by that share or more."""
        best = math.inf
        for t in sorted(trials, key=lambda t: t.number):
            if t.state != TrialState.COMPLETE or not t.values:
                continue
            value = t.values[0]
            if TrialAttr.MOVE_SIGNATURE in t.user_attrs:
                improved = bool(t.user_attrs.get(TrialAttr.IMPROVED))
                if clear is None or improved or value >= best * (1 + clear):
                    stats.tell(t.user_attrs[TrialAttr.MOVE_SIGNATURE], improved)
            best = min(best, value)

    # -- a visit ---------------------------------------------------------------------------
    def visit(self, lane: str, order: int, rnd: int, pp: PatternPoints,
              stats: MoveStats) -> bool:
        """Visit ``pp`` in round ``rnd`` (or skip it); whether its decision changed the
        standing model."""
        s = self.s
        pid = pp.pattern.id
        visits = s.record.visits(lane)
        schemes = s.record.standing(lane, visits)
        around = s.record.around(pp, schemes, lane)
        key = s.neighbourhood.key(pp, around)
        mine = [v for v in visits if v.pattern_id == pid]
        this = next((v for v in mine if v.round == rnd), None)
        if this is not None and this.decided:
            s.progress.advance()
            return this.changed
        if this is None and mine and mine[-1].context_key == key:
            s.progress.skip(pid, "nothing changed near it since its last visit")
            return False
        left = s.remaining()
        if left is not None and left <= 0:  # no visit starts (reads, kernels) out of time
            raise OutOfTime()
        if s.settings.multi_objective:  # one study per pattern from float, as a first pass
            attrs = PatternStudy(s, pp, order=order, around=around, rnd=rnd, lane=lane,
                                 seeds=self.seeds(pp) if self.seeds else (),
                                 context_key=key).run()
            return Visit.from_attrs(attrs).changed
        cached = None
        if self.cache is not None:
            seeds = self.cache.seeds_for(pp)
            cached = seeds[0] if seeds else None
        visit = self.space.visit(pid, schemes, stats, cached,
                                 **(self.unfused.pruning(schemes, lane) if self.unfused else {}))
        dropped = Counter(visit.dropped)
        if dropped:  # a visit skipped outright is in the report: only the log's detail
            log.log(logging.INFO if visit.moves else logging.DEBUG, "%s round %d: %d move(s) "
                    "kept; %s", pid, rnd, len(visit.moves),
                    skip_reason(dropped).replace("all ", "dropped ", 1))
        if dropped and not visit.moves:  # nothing the runtime left can gain: nothing to measure
            self.skipped.append((lane, rnd, pid, skip_reason(dropped)))
            s.progress.skip(pid, skip_reason(dropped))
            return False
        budget = min(s.config.schemes_per_region, max(len(visit.moves) + 1, 2 * len(pp.ids)))
        study = PatternStudy(s, pp, order=order, around=around, rnd=rnd, lane=lane,
                             start=schemes[pid], budget=budget, visit=visit, context_key=key)
        attrs = study.run()
        self._absorb(stats, study.study.get_trials(deepcopy=False))
        return Visit.from_attrs(attrs).changed
