"""The starts phase: whole-model placements measured before any pattern is tuned.

Candidates (:mod:`qdq_optuna.placement.starts`): float; every offered point on; the runtime's
classic recipe (ONNX Runtime rules: ``quant_pre_process`` + ``quantize_static`` run on the
user's model with the user's calibration data, read back; TensorRT rules: Model Optimizer's
default INT8 placement); the user's seeds (``--qdq-baseline``, ``--pattern-cache``). Each is
projected onto the insertion points (the descent moves points), the uses no point expresses
*pinned* (measured with the start, kept by every model of its lane: ``Start.pinned``), measured
once (the plan memo), and checked by the accuracy guard: a start whose output error breaks the
bound is recorded as infeasible and never chosen; when it measured faster than float, it comes
back with the quantizer groups that cost the most error per unit of speed returned to float, as
one more start (``NAME-in-bound``). The fastest feasible start becomes the standing model when
it beats float as a commit must (the run's commit rule; on a measured backend an interleaved A/B
against float confirms it; there the runtime's recipe stands unless an A/B shows the fastest
start beats it). Where float is chosen and a quantized start broke the bound, the forward
search (:mod:`~qdq_optuna.search._forward`) builds up from float instead: its model is the
start ``forward``, chosen when it beats float, and the run ends without a descent. Which
starts the descent runs from (its *lanes*) follows ``Config.start``.

Workers and resumed runs agree on the outcome (the run record's ``starts``, first writer
wins); the study ``RUN/_starts`` shows one trial per start in optuna-dashboard.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import optuna
from optuna.trial import TrialState

from qdq_optuna.backends.base import BackendError
from qdq_optuna.config import RECIPE_LANE_RATIO
from qdq_optuna.measure.kernels import kernel_cache
from qdq_optuna.measure.repair import RepairMethod, estimated_speed, repair
from qdq_optuna.placement import starts as whole
from qdq_optuna.placement.export import plan_uses
from qdq_optuna.placement.starts import Start
from qdq_optuna.record import AgreedStarts, RunRecord, StartAttr, StartOutcome
from qdq_optuna.search._forward import (
    FORWARD_TIMED_ALONE,
    ForwardInputs,
    ForwardResult,
    forward_search,
)
from qdq_optuna.search._guard import listed

log = logging.getLogger("qdq_optuna")

#: a repaired start's name is its start's with this suffix (``recipe:openvino-in-bound``): the
#: start without the Q/DQ that broke the accuracy bound (:meth:`StartsPhase._repairs`)
REPAIRED = "-in-bound"
#: a start's ``repair_outcome`` when its repair yielded no start to measure
NO_TIME = "not repaired: no time left under --timeout"
KEPT_NOTHING = ("not repaired: no quantized part of it kept the accuracy bound (ranked groups, "
                "then bisection over tensors)")
SAME_MODEL = "not measured: the repaired start is the same model as another start"
#: a start whose quantized uses overlap this much (Jaccard) with a start repaired already (or
#: found beyond repair) is not repaired again (PP-OCRv5's detector: every point and ONNX
#: Runtime's recipe differ in 1 of 264 points, and each repair costs 64 error evaluations)
TWIN = 0.9
#: the forward search's start (:mod:`~qdq_optuna.search._forward`)
FORWARD = "forward"
#: the forward search's noise: groups whose gains together are below this share of float's
#: latency are not added (a ratio's typical p95 error on the timing protocol)
FORWARD_NOISE_SHARE = 0.03
#: the share of the search's time left that the forward search's kernel timing may take
#: (uncached signatures past it are not timed; their groups are timed whole or left out)
KERNEL_SHARE = 0.25
#: seconds the forward search's kernel timing may take however little time is left (its
#: error evaluations are bounded by their count, as the first repair's are: on a large model
#: the starts outlast a short --timeout, and a forward search cut there ships float)
KERNEL_FLOOR_S = 60.0
#: the lane of the chosen start: its visits are ``RUN/P003/round1``
MAIN_LANE = ""
#: the lane of the runtime's recipe when it is not the chosen start (``RUN/P003/recipe/...``)
RECIPE_LANE = "recipe"


class StartsPhase:
    """Build, measure, check and choose the starts (see the module docstring).

    ``recipe``: builds the runtime's recipe start (it runs ONNX Runtime's quantizer: only when
    the starts are not decided yet); ``seeds``: the user's seed starts."""

    def __init__(self, search, *, mode: str, recipe: Callable[[], Start | None],
                 seeds: Callable[[], list[Start]], worker: bool, baseline=None) -> None:
        self.s = search
        #: the baseline's model (bytes or a path): the starts are timed interleaved with it
        self.baseline = baseline
        self.mode = mode
        self.recipe = recipe
        self.seeds = seeds
        self.worker = worker
        #: plan key -> what the runtime ran for it (the backend's report, None: not readable)
        self._ran: dict[str, object] = {}

    @property
    def record(self) -> RunRecord:
        return self.s.record

    def candidates(self) -> list[Start]:
        pm = self.s.prepared
        cands = [whole.float_start(pm), whole.all_on_start(pm)]
        recipe = self.recipe()
        if recipe is not None:
            cands.append(recipe)
        return cands + self.seeds()

    def run(self) -> AgreedStarts:
        """The agreed starts (whichever process decided them)."""
        decided = self.record.starts(self.decide)
        if not self.worker or self.record.claim("starts-study"):
            self._write_study(decided)
        return decided

    # -- deciding --------------------------------------------------------------------------
    def decide(self) -> AgreedStarts:
        progress = self.s.progress
        spent = self.s.plans.by_phase["starts"]
        cands = self.candidates()
        progress.stage("starts", len(cands))
        step = self.s.wall.step
        self._together(cands)
        rows = [self._measured(start) for start in cands]
        with step("starts", "repair"):
            rows += self._repairs(cands, rows)
        with step("starts", "choice A/Bs"):
            chosen_start = self._choose(rows)
        flt, forward = _float_row(rows), None
        if flt is not None and chosen_start == flt.name:  # no quantized start beat float
            with step("starts", "forward search"):
                forward = self._forward(rows)
            if forward is not None and forward.row is not None:
                rows.append(forward.row)
                with step("starts", "choice A/Bs"):
                    chosen_start = _beats_float(self, rows, forward.row, flt)
        lanes = self._lanes(rows, chosen_start)
        chosen = lanes[MAIN_LANE]  # the start of the standing model
        rows = [replace(r, chosen=r.name == chosen,
                        lane=next((lane for lane, name in lanes.items() if name == r.name), None))
                for r in rows]
        by_name = {r.name: r for r in rows}
        return AgreedStarts(chosen, lanes, list(lanes), self.s.plans.by_phase["starts"] - spent,
                            {lane: by_name[name].schemes for lane, name in lanes.items()},
                            tuple(rows), {lane: sorted(by_name[name].pinned)
                                          for lane, name in lanes.items()},
                            forward.report(rows, chosen) if forward is not None else None)

    def _together(self, cands: list[Start]) -> None:
        """The starts timed in the same rounds as the baseline (a measured backend), each
        latency the in-search baseline's scaled by the two's ratio in those rounds: timed one
        after the other minutes apart, the float start (the baseline's own model) read
        0.77-0.87x of the baseline. A model the backend fails on is then timed alone."""
        s = self.s
        if self.baseline is None or s.plans.deterministic or not s.baseline_ms:
            return
        with s.wall.step("starts", "export"):
            plans = [self._plan(self._schemes(start), start.pinned) for start in cands]
            items = [(p.key, s.exporter.source(p), len(p)) for p in plans]
        try:
            with s.wall.step("starts", "timing"):
                s.plans.measure_together(self.baseline, s.baseline_ms, items, "starts")
        except BackendError as exc:
            log.info("the starts could not be timed together (%s): one by one", exc)

    def _measured(self, start: Start) -> StartOutcome:
        with self.s.progress.pattern(f"start {start.name}", 1) as bar:
            row = self._measure(start)
            bar.trial()
            bar.finish(note=self._summary(row))
        return row

    def _repairs(self, cands: list[Start], rows: list[StartOutcome]) -> list[StartOutcome]:
        """Each quantized start that measured faster than float but broke the accuracy bound,
        with just enough of its quantizer groups returned to float: NNCF's placement of magika (a byte-level classifier)
        runs 2.1x faster than float on OpenVINO and puts out nothing like FP32 (cosine 1e-5);
        a few tensors cause that, and the rest of the placement is worth starting from. Whole
        groups (one node's quantized inputs) go back in order of error per latency cost
        (:func:`~qdq_optuna.measure.repair.rank_repair`), so the integer chains left still
        fuse; a repaired start is measured and checked like any other (its row, with the
        sensitivity table, is returned). Each start that needed a repair says on its row what
        it came to (``repair_outcome``), with the table when no repaired start was measured,
        so the report shows where the error was even when float ships."""
        s = self.s
        flt = _float_row(rows)
        if s.guard is None or flt is None or flt.latency_ms is None or self.mode == "float":
            return []
        out, seen = [], {r.plan_key for r in rows}
        # a repair only takes Q/DQ out, so a start slower than a model already within the
        # bound is not worth its bisection (dnsmos-p835: 40 evaluations, 8 minutes)
        best = min((r.latency_ms for r in rows if r.usable), default=math.inf)
        tried: dict[str, set] = {}  # starts repaired (or found beyond repair): their uses
        todo = [(start, row) for start, row in zip(cands, rows)
                if not row.feasible and row.latency_ms is not None
                and row.latency_ms < min(flt.latency_ms, best)]
        # the start whose integer chains hold the most speed by the repair's cost model first
        # (what survives returning groups to float; measured speed breaks ties): the first
        # repair is the one that runs past the deadline
        held = {row.name: self._holds(row) for _, row in todo} if len(todo) > 1 else {}
        for start, row in sorted(todo, key=lambda sr: (-held.get(sr[1].name, 0.0),
                                                       sr[1].latency_ms)):
            if row.latency_ms >= min(flt.latency_ms, best):
                continue
            i = rows.index(row)
            # the first start repaired runs whole even past the search's deadline, as the
            # starts' A/Bs do: on a large model the starts' timing outlasts a short --timeout
            # (PP-OCRv4's detector: 330 s of 300), and a repair cut there ships float where the
            # repair's placement runs 1.3x (its cost is bounded by REPAIR_EVALUATIONS); later
            # ones only while time is left
            remaining = s.remaining()
            if tried and remaining is not None and remaining <= 0:
                rows[i] = replace(row, repair_outcome=NO_TIME)
                continue
            plan = self._row_plan(row)
            uses = set(plan_uses(plan))
            twin = next((name for name, other in tried.items() if _overlap(uses, other) >= TWIN),
                        None)
            if twin is not None:
                rows[i] = replace(row, repair_outcome=f"not repaired: nearly the placement of "
                                  f"{twin}, repaired already")
                continue
            repaired, table, outcome = self._repaired(start, plan, past_deadline=not tried)
            if outcome != NO_TIME:
                tried[start.name] = uses
            if repaired is None:
                log.info("start %s: %s", start.name, outcome)
                rows[i] = replace(row, repair_outcome=outcome, repair=table)
                continue
            key = self._plan(self._schemes(repaired), repaired.pinned).key
            if key in seen:  # float's key is among them: nothing left on
                rows[i] = replace(row, repair_outcome=SAME_MODEL, repair=table)
                continue
            rows[i] = replace(row, repair_outcome=f"repaired: {repaired.name}")
            seen.add(key)
            done = len(rows) + len(out)
            s.progress.stage("starts", done + 1, done=done)
            # timed with the baseline as the other starts were: timed alone after the repair,
            # PP-OCRv4's repaired start read 0.97x float, as placed it runs 1.24x float
            self._together([repaired])
            repaired_row = replace(self._measured(repaired), repair=table)
            out.append(repaired_row)
            if repaired_row.usable:
                best = min(best, repaired_row.latency_ms)
        return out

    def _forward(self, rows: list[StartOutcome]) -> ForwardStart | None:
        """The forward search (:mod:`~qdq_optuna.search._forward`), once float was chosen
        (no quantized start within the accuracy bound beat it) where a quantized start broke
        the bound: its groups drawn from the fastest start past the bound, its result measured
        and checked as the start ``forward``; None where it does not run."""
        s = self.s
        flt = _float_row(rows)
        if s.guard is None or flt is None or flt.latency_ms is None \
                or self.mode in ("float", "recipe"):
            return None
        noise = 0.0 if s.plans.deterministic else FORWARD_NOISE_SHARE
        broke = [r for r in rows if r.qdq and not r.feasible and r.latency_ms is not None]
        if not broke:
            return None
        source = min(broke, key=lambda r: (r.latency_ms, r.name))
        plan = self._row_plan(source)
        found = forward_search(_forward_inputs(s, plan, self._what_ran(plan),
                                               flt.latency_ms, noise))
        log.info("forward search from float (groups of %s): %d of %d group(s) added, %s",
                 source.name, len(found.added), len(found.groups), found.end.value)
        if found.plan is None:
            return ForwardStart(source.name, found, None, flt)
        start = whole.start_from_uses(
            s.prepared, FORWARD, list(plan_uses(found.plan)),
            notes=[f"built up from float: {len(found.added)} of {len(found.groups)} quantizer "
                   f"group(s) of {source.name}, by measured gain per unit of output error, "
                   f"while the whole plan kept the accuracy bound ({found.evaluations} error "
                   f"evaluations); then {found.end.value}"])
        self._together([start])
        return ForwardStart(source.name, found, self._measured(start), flt)

    def _repaired(self, start: Start, plan, *, past_deadline: bool = False
                  ) -> tuple[Start | None, dict | None, str]:
        """``start`` within the bound, the repair's sensitivity table, and what the repair came
        to: quantizer groups returned to float by error per latency cost; where that keeps
        nothing within the evaluations (an error spread over hundreds of groups ranks
        coarsely: a real PP-OCR detector and text-line classifier), bisection over tensors, as
        before (a repaired start is measured even where the repair's own estimate says it
        runs no faster than float: the runtime decides, and the report says why).
        ``past_deadline``: the ranked repair runs to its evaluation budget whatever the
        deadline."""
        s = self.s
        time_left = lambda: (r := s.remaining()) is None or r > 0  # noqa: E731
        fixed = repair(s.exporter, plan, lambda p: s.guard.error(p)["error"],
                       s.guard.bound.value, what=self._what_ran(plan), time_left=time_left,
                       rank_time_left=(lambda: True) if past_deadline else time_left)
        name, found = f"{start.name}{REPAIRED}", fixed.ranked
        table = found.to_dict()
        if fixed.method is RepairMethod.RANKED:
            nodes = [g.name for g in found.returned]
            return whole.start_from_uses(
                s.prepared, name, list(plan_uses(fixed.plan)),
                notes=[f"{start.name} with {len(nodes)} of {len(found.groups)} quantizer "
                       f"group(s) returned to float, ranked by output error per latency "
                       f"cost ({found.evaluations} error evaluations) until within the "
                       f"accuracy bound: {listed(nodes)}"]), table, ""
        if fixed.method is RepairMethod.NO_TIME:
            return None, table, NO_TIME
        if fixed.method is RepairMethod.FLOAT:
            return None, table, KEPT_NOTHING
        cut = fixed.bisection
        gone = set(cut.responsible)
        return whole.start_from_uses(
            s.prepared, name, [u for u in plan_uses(plan) if u[0] not in gone],
            notes=[f"{start.name} without the Q/DQ on {len(gone)} tensor(s) that broke the "
                   f"accuracy bound (bisection in {cut.evaluations} error evaluations, after "
                   f"the ranked repair kept nothing in {found.evaluations}): "
                   f"{listed(cut.responsible)}"]), None, ""

    def _holds(self, row: StartOutcome) -> float:
        """The integer speed a start's placement holds by the repair's cost model."""
        plan = self._row_plan(row)
        return estimated_speed(self.s.exporter, plan, self._what_ran(plan))

    def _what_ran(self, plan):
        """What the runtime ran integer for ``plan`` (the repair's latency costs), or None
        when the backend cannot tell."""
        if plan.key not in self._ran:  # the repair order and the repair read the same plan
            try:
                self._ran[plan.key] = self.s.plans.measurer.backend.what_ran(
                    self.s.exporter.to_bytes(plan))
            except Exception as exc:  # a report only sharpens the costs: never the failure
                log.info("what the runtime ran could not be read (%s)", exc)
                self._ran[plan.key] = None
        return self._ran[plan.key]

    def _summary(self, row: StartOutcome) -> str:
        if row.failure:
            return f"failed: {row.failure}"
        base = self.s.baseline_ms
        speed = f", {base / row.latency_ms:.3f}x the baseline" if base else ""
        ok = "" if row.feasible else f", output error {row.error:.3g} over the bound"
        return f"{row.latency_ms:.4f} ms{speed}{ok}"

    def _schemes(self, start: Start) -> dict[str, dict[str, int]]:
        """The start's schemes in the search space's terms (what a row stores)."""
        space = self.s.settings.space
        return {pp.pattern.id: space.indices(space.seed(start.schemes.get(pp.pattern.id, {})),
                                             pp.ids) for pp in self.s.prepared.tunable}

    def _plan(self, schemes: dict[str, dict[str, int]], pinned=()):
        """The whole model of a start's schemes and its pinned uses."""
        return self.s.exporter.plan(self.record.uses(schemes, pinned))

    def _row_plan(self, row: StartOutcome):
        return self._plan(row.schemes, row.pinned)

    def _measure(self, start: Start) -> StartOutcome:
        s, step = self.s, self.s.wall.step
        with step("starts", "export"):
            schemes = self._schemes(start)
            plan = self._plan(schemes, start.pinned)
            source = s.exporter.source(plan)
        row = StartOutcome(name=start.name, schemes=schemes, points_on=start.on(),
                           notes=list(start.notes), exact=start.exact, qdq=len(plan),
                           plan_key=plan.key, pinned=tuple(sorted(start.pinned)))
        try:
            with step("starts", "timing"):
                ms, _ = s.plans.measure(source, plan.key, "starts", qdq=len(plan))
        except BackendError as exc:
            log.warning("start %s: the backend failed on it (%s)", start.name, exc)
            return replace(row, failure=str(exc)[:500])
        if s.guard is None:
            return replace(row, latency_ms=ms, feasible=True)
        with step("starts", "accuracy"):
            error = s.guard.error(plan)["error"]
        return replace(row, latency_ms=ms, error=error, feasible=s.guard.bound.allows(error))

    def _choose(self, rows: list[StartOutcome]) -> str:
        """The fastest feasible start, when it beats float as a commit must (the run's
        ``CommitRule``: on a measured backend an interleaved A/B against float confirms it);
        else float (always feasible: its error is the high precision's only). A start that
        had to beat float in an A/B keeps it (``ab_vs_float``; ``rows`` is updated). On a
        measured backend float measured fastest once still lets the runtime's recipe try its
        A/B against float (one measurement cannot rank close starts), and when the recipe is
        the fastest or float measured fastest, float has to beat the recipe instead
        (:meth:`_recipe_unless_float_beats_it`)."""
        ok = sorted((r for r in rows if r.usable), key=lambda r: (r.latency_ms, r.name))
        flt = _float_row(rows)
        if not ok or flt is None or flt.latency_ms is None:
            return "float"
        best, rule = ok[0], self.s.rule
        recipe = _recipe(ok)
        if best is flt:
            if self.s.plans.deterministic or recipe is None or recipe.plan_key == flt.plan_key:
                return "float"
            best = recipe
        if self.s.plans.deterministic:
            return best.name if rule.promising(best.latency_ms, flt.latency_ms,
                                               rule.threshold) else "float"
        if best is recipe:
            return self._recipe_unless_float_beats_it(rows, recipe, flt)
        cmp = self.s.plans.compare(self._source(best), self._source(flt), "starts")
        rows[rows.index(best)] = replace(best, ab_vs_float=_ab(cmp))
        if not rule.confirmed(cmp, rule.threshold, False):
            return "float"
        return self._recipe_unless_beaten(rows, best)

    def _recipe_unless_float_beats_it(self, rows: list[StartOutcome], recipe: StartOutcome,
                                      flt: StartOutcome) -> str:
        """The runtime's recipe against float, on a measured backend: the recipe is what a
        user of that runtime deploys without us, so it stands unless an A/B confirms float
        faster (float the candidate: a tie, or an A/B that gives up, keeps the recipe).
        mtcnn-rnet on OpenVINO (0.15 ms): float measured fastest once, the recipe's A/B
        read 0.91x float's latency (0.81-1.01), and float shipped 7 % slower than NNCF."""
        rule = self.s.rule
        cmp = self.s.plans.compare(self._source(flt), self._source(recipe), "starts")
        rows[rows.index(recipe)] = replace(recipe, ab_vs_float=_ab(cmp, inverse=True))
        return "float" if rule.confirmed(cmp, rule.threshold, False) else recipe.name

    def _recipe_unless_beaten(self, rows: list[StartOutcome], best: StartOutcome) -> str:
        """On a measured backend one measurement per start cannot tell apart two starts a few
        percent apart (an OpenVINO YOLO chose every-point-on over NNCF's placement, which was
        faster, on a busy machine). The runtime's recipe is the model the tuned one must at
        least match, and a descent from it can only keep or beat it, so it stands unless an
        interleaved A/B confirms the fastest start beats it (``ab_vs_best`` on its row; a
        recipe confirmed slower gets no lane of its own either)."""
        recipe = _recipe(rows)
        if recipe is None or recipe.plan_key == best.plan_key:  # the recipe is the best
            return best.name
        rule = self.s.rule
        cmp = self.s.plans.compare(self._source(best), self._source(recipe), "starts")
        beaten = rule.confirmed(cmp, rule.threshold, False)
        rows[rows.index(recipe)] = replace(recipe, ab_vs_best={
            **_ab(cmp), "best": best.name, "beaten": beaten})
        return best.name if beaten else recipe.name

    def _source(self, row: StartOutcome):
        return self.s.exporter.source(self._row_plan(row))

    def _lanes(self, rows: list[StartOutcome], chosen: str) -> dict[str, str]:
        """Lane name -> start name, in descent order (see ``Config.start``)."""
        ok = {r.name: r for r in rows if r.usable}
        recipe_row = _recipe(rows)
        recipe = recipe_row.name if recipe_row is not None else None
        if self.mode == "float":
            return {MAIN_LANE: "float"}
        if self.mode == "recipe":
            return {MAIN_LANE: recipe or "float"}
        lanes = {MAIN_LANE: chosen}
        # a start that is the same model as one already descended from adds no lane (on
        # models where quantize_static quantizes every offered point, the recipe is "all")
        models = {ok[chosen].plan_key} if chosen in ok else set()
        if self.mode == "all":
            for name in sorted(ok, key=lambda n: ok[n].latency_ms):
                if ok[name].plan_key not in models:
                    lanes[_lane_name(name)] = name
                    models.add(ok[name].plan_key)
        elif recipe is not None and ok[recipe].plan_key not in models and \
                ok[recipe].latency_ms <= RECIPE_LANE_RATIO * ok[chosen].latency_ms and \
                not (ok[recipe].ab_vs_best or {}).get("beaten"):
            lanes[RECIPE_LANE] = recipe
        return lanes

    # -- the study -------------------------------------------------------------------------
    def _write_study(self, decided: AgreedStarts) -> None:
        """One trial per start in ``RUN/_starts`` (those not written yet)."""
        study = self.record.starts_study()
        written = {t.user_attrs.get(StartAttr.START) for t in study.get_trials(deepcopy=False)}
        for row in decided.rows:
            if row.name in written:
                continue
            if row.failure:
                study.add_trial(optuna.trial.create_trial(state=TrialState.FAIL,
                                                          user_attrs=row.trial_attrs()))
            else:
                study.add_trial(optuna.trial.create_trial(value=row.latency_ms,
                                                          user_attrs=row.trial_attrs()))


@dataclass(frozen=True)
class ForwardStart:
    """What the forward search did in the starts phase: the start its groups came from, its
    result, its measured start (None: it ended at float) and the float start."""

    source: str
    found: ForwardResult
    row: StartOutcome | None
    flt: StartOutcome

    def report(self, rows: list[StartOutcome], chosen: str) -> dict:
        """report.json's ``forward``: the search's result, what ships and the line that says
        why (the run then ends without a descent)."""
        row = next((r for r in rows if self.row is not None and r.name == self.row.name), None)
        speed = (self.flt.latency_ms / row.latency_ms if row is not None and row.latency_ms
                 else None)
        added, total = len(self.found.added), len(self.found.groups)
        if row is not None and chosen == row.name:
            why = (f"no quantized start within the accuracy bound is faster than float beyond "
                   f"noise; the most speed within it is {added} of {total} quantizer groups, "
                   f"{speed:.2f}x float: shipped")
        elif row is not None:
            why = (f"nothing within the accuracy bound is faster than float beyond noise (the "
                   f"forward search's {added} of {total} groups ran {speed:.2f}x float, not "
                   f"confirmed faster): {chosen} ships")
        else:
            why = (f"nothing within the accuracy bound is faster than float beyond noise "
                   f"({self.found.end.value}): {chosen} ships")
        return {**self.found.to_dict(), "from_start": self.source,
                "start": row.name if row is not None else None, "measured_speedup": speed,
                "shipped": chosen, "why": why + "; no descent"}


def _forward_inputs(s, plan, what, float_ms: float, noise: float) -> ForwardInputs:
    """The forward search's inputs in search ``s``: the guard's scorer and bound, the kernel
    table of ``plan`` (what the runtime ran ``what``), whole-model timing in the starts' phase,
    and ``noise`` as a share of the float start's ``float_ms``. It runs to its evaluation
    budget whatever the deadline, as the first repair does (:data:`KERNEL_FLOOR_S`)."""
    return ForwardInputs(
        s.exporter, plan, lambda p: s.guard.error(p)["error"], s.guard.bound.value, float_ms,
        noise * float_ms, _kernel_table(s, plan, what),
        lambda p: s.plans.measure(s.exporter.source(p), p.key, "starts", qdq=len(p))[0],
        len(plan) if s.plans.deterministic else FORWARD_TIMED_ALONE,
        what.float_nodes if what is not None else frozenset())


def _kernel_table(s, plan, what):
    """The kernel table of ``plan``'s integer kernels in search ``s`` (cached per machine),
    or None where the run times no kernels or the timing fails."""
    import onnx

    if s.plans.deterministic or s.kernel_timing is None \
            or not getattr(s.config, "kernel_evidence", False):
        return None
    exporter = s.exporter
    left = s.remaining()
    deadline = s.plans.measurer.deadline
    if left is not None:  # the kernels take a share of what is left: errors follow
        deadline = time.monotonic() + max(KERNEL_SHARE * left, KERNEL_FLOOR_S)
    try:
        with s.wall.step("starts", "kernel timing"):
            return s.kernel_timing(
                onnx.load_from_string(exporter.to_bytes(exporter.plan(set()))),
                onnx.load_from_string(exporter.to_bytes(plan)),
                cache=kernel_cache(s.kernel_cache),
                skip=what.float_nodes if what is not None else (),
                deadline=deadline)
    except Exception as exc:  # evidence is an optimisation: never the run's failure
        log.info("kernels could not be timed (%s): groups are timed whole", exc)
        return None


def _beats_float(phase: StartsPhase, rows: list[StartOutcome], row: StartOutcome,
                 flt: StartOutcome) -> str:
    """``row``'s name when it beats float as a commit must (on a measured backend an
    interleaved A/B, kept on its row as ``ab_vs_float``), else float's."""
    rule, plans = phase.s.rule, phase.s.plans
    if not row.usable:
        return flt.name
    if plans.deterministic:
        return row.name if rule.promising(row.latency_ms, flt.latency_ms,
                                          rule.threshold) else flt.name
    cmp = plans.compare(phase._source(row), phase._source(flt), "starts")
    rows[rows.index(row)] = replace(row, ab_vs_float=_ab(cmp))
    return row.name if rule.confirmed(cmp, rule.threshold, False) else flt.name


def _float_row(rows: list[StartOutcome]) -> StartOutcome | None:
    """The float start's row (None: not among ``rows``)."""
    return next((r for r in rows if r.name == "float"), None)


def _overlap(a: set, b: set) -> float:
    """Jaccard overlap of two sets of quantized uses."""
    return len(a & b) / max(len(a | b), 1)


def _recipe(rows: list[StartOutcome]) -> StartOutcome | None:
    """The runtime's recipe among ``rows``, when it is usable. Its repair is not the recipe
    (no user of the runtime gets it without us): given the recipe's standing, a repaired
    PP-OCRv4 recipe that ran 0.75x float stood unless float beat it in an A/B, and shipped."""
    return next((r for r in rows if r.usable and r.name.startswith("recipe")
                 and not r.name.endswith(REPAIRED)), None)


def _ab(cmp, inverse: bool = False) -> dict:
    """An A/B of two starts as stored on a start's row (``inverse``: the row's model was the
    reference, so the ratio and interval are turned round to read row / other)."""
    if inverse:
        def turn(x: float) -> float:
            return 1.0 / x if x > 0 else math.inf

        return {"ratio": turn(cmp.ratio), "ci": [turn(cmp.ci_high), turn(cmp.ci_low)],
                "rounds": cmp.rounds}
    return {"ratio": cmp.ratio, "ci": [cmp.ci_low, cmp.ci_high], "rounds": cmp.rounds}


def _lane_name(start: str) -> str:
    """A start's name as a lane (a path part of study names): ``recipe:tensorrt`` -> recipe."""
    return start.split(":")[0]
