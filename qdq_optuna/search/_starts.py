"""The starts phase: whole-model placements measured before any pattern is tuned.

Candidates (:mod:`qdq_optuna.placement.starts`): float; every offered point on; the runtime's
classic recipe (ONNX Runtime rules: ``quant_pre_process`` + ``quantize_static`` run on the
user's model with the user's calibration data, read back; TensorRT rules: Model Optimizer's
default INT8 placement); the user's seeds (``--qdq-baseline``, ``--pattern-cache``). Each is
projected onto the insertion points (the descent moves points), the uses no point expresses
*pinned* (measured with the start, kept by every model of its lane: ``Start.pinned``), measured
once (the plan memo), and checked by the accuracy guard: a start whose output error breaks the
bound is recorded as infeasible and never chosen (a default bound is first tightened to the
error of the fastest of the runtime's own recipes: :func:`under_recipe`); when it measured
faster than float, it comes back with the quantizer groups that cost the most error per unit of speed returned to float, as
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
from collections.abc import Callable
from dataclasses import replace

import optuna
from optuna.trial import TrialState

from qdq_optuna.backends.base import BackendError
from qdq_optuna.config import RECIPE_LANE_RATIO, StartFrom
from qdq_optuna.placement import starts as whole
from qdq_optuna.placement.starts import Start
from qdq_optuna.record import AgreedStarts, StartAttr, StartOutcome
from qdq_optuna.search._forward_start import float_row, forward_choice
from qdq_optuna.search._start_repairs import KEPT_NOTHING, NO_TIME, REPAIRED, StartRepairs

__all__ = ["KEPT_NOTHING", "NO_TIME", "REPAIRED", "StartsPhase"]

log = logging.getLogger("qdq_optuna")

#: the lane of the chosen start: its visits are ``RUN/P003/round1``
MAIN_LANE = ""
#: the lane of the runtime's recipe when it is not the chosen start (``RUN/P003/recipe/...``)
RECIPE_LANE = "recipe"
#: a start that reads less than this much faster than the runtime's recipe in the rounds they
#: were timed in together gets no second A/B against it: the recipe stands (and no second lane
#: descends from it). On DenseNet-121 and Inception v1 (ONNX Runtime, AMD EPYC) "all" and the
#: recipe are near-identical models: their A/Bs read 1.007, 0.989 (12 rounds, undecided) and
#: 0.999 and cost 6.5 s, 13 s and 5.7 s of a run to keep the recipe; a gain this small is left
#: to the descent, which starts from the recipe
START_TIE = 0.02


class StartsPhase:
    """Build, measure, check and choose the starts (see the module docstring). ``recipe``:
    builds the runtime's recipe start (only when the starts are not decided yet); ``seeds``:
    the user's seed starts."""

    def __init__(self, search, *, mode: str, recipe: Callable[[], Start | None],
                 seeds: Callable[[], list[Start]], worker: bool, baseline=None) -> None:
        self.s = search
        #: the baseline's model (bytes or a path): the starts are timed interleaved with it
        self.baseline = baseline
        self.mode = mode
        self.recipe = recipe
        self.seeds = seeds
        self.worker = worker

    def candidates(self) -> list[Start]:
        pm = self.s.prepared
        cands = [whole.float_start(pm), whole.all_on_start(pm)]
        recipe = self.recipe()
        if recipe is not None:
            cands.append(recipe)
        return cands + self.seeds()

    def run(self) -> AgreedStarts:
        """The agreed starts (whichever process decided them)."""
        decided = self.s.record.starts(self.decide)
        _stored_bound(self.s.guard, decided)  # decided before: resumed, a worker
        if not self.worker or self.s.record.claim("starts-study"):
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
        rows = under_recipe(self.s.guard, cands, [self._measured(start) for start in cands])
        with step("starts", "repair"):
            rows += self._repairs(cands, rows)
        with step("starts", "choice A/Bs"):
            chosen_start = self._choose(rows)
        chosen_start, forward = forward_choice(self, rows, chosen_start, ab=_ab)
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
                            forward.report(rows, chosen) if forward is not None else None,
                            _recipe_floor(self.s.guard))

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
        """The quantized starts faster than float but past the accuracy bound, repaired
        (:class:`~qdq_optuna.search._start_repairs.StartRepairs`); none when no guard checks
        the starts or the run starts from float."""
        s = self.s
        if s.guard is None or self.mode == StartFrom.FLOAT:
            return []

        def measure(start: Start) -> StartOutcome:
            self._together([start])
            return self._measured(start)

        return StartRepairs(
            guard=s.guard, exporter=s.exporter, prepared=s.prepared,
            backend=s.plans.measurer.backend, remaining=s.remaining,
            plan_of=lambda start: self._plan(self._schemes(start), start.pinned),
            row_plan=self._row_plan, measure=measure,
            stage=lambda total, done: s.progress.stage("starts", total, done=done),
        ).run(cands, rows)

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
        return self.s.exporter.plan(self.s.record.uses(schemes, pinned))

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
        the fastest, float measured fastest, or the fastest start's A/B could not confirm it
        beats float, float has to beat the recipe instead
        (:meth:`_recipe_unless_float_beats_it`)."""
        ok = sorted((r for r in rows if r.usable), key=lambda r: (r.latency_ms, r.name))
        flt = float_row(rows)
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
        cmp = _compare(self, best, flt)
        rows[rows.index(best)] = replace(best, ab_vs_float=_ab(cmp))
        if not rule.confirmed(cmp, rule.threshold, False):
            # not shown to beat float: the recipe still stands unless float beats it (a ViT
            # on a loaded machine: float stood, the recipe and dynamic start never compared)
            return "float" if recipe is None or recipe.plan_key == flt.plan_key \
                else self._recipe_unless_float_beats_it(rows, recipe, flt)
        return self._recipe_unless_beaten(rows, best)

    def _recipe_unless_float_beats_it(self, rows: list[StartOutcome], recipe: StartOutcome,
                                      flt: StartOutcome) -> str:
        """The runtime's recipe against float, on a measured backend: the recipe is what a
        user of that runtime deploys without us, so it stands unless an A/B confirms float
        faster (float the candidate: a tie, or an A/B that gives up, keeps the recipe).
        mtcnn-rnet on OpenVINO (0.15 ms): float measured fastest once, the recipe's A/B
        read 0.91x float's latency (0.81-1.01), and float shipped 7 % slower than NNCF."""
        rule = self.s.rule
        cmp = _compare(self, flt, recipe)
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
        cmp = _compare(self, best, recipe, settle_tie=True)
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
        if self.mode == StartFrom.FLOAT:
            return {MAIN_LANE: "float"}
        if self.mode == StartFrom.RECIPE:
            return {MAIN_LANE: recipe or "float"}
        lanes = {MAIN_LANE: chosen}
        # a start that is the same model as one already descended from adds no lane (on
        # models where quantize_static quantizes every offered point, the recipe is "all")
        models = {ok[chosen].plan_key} if chosen in ok else set()
        if self.mode == StartFrom.ALL:
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
        study = self.s.record.starts_study()
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


def under_recipe(guard, cands: list[Start], rows: list[StartOutcome]) -> list[StartOutcome]:
    """The ``guard``'s bound tightened by the fastest of the runtime's recipes among the
    starts ``cands`` (measured as ``rows``) that keeps it and runs faster than float (a recipe
    slower than float is no model anyone deploys), and every row's feasibility read again
    under it (:meth:`~qdq_optuna.measure.bound.AccuracyBound.under_recipe`: a default bound
    only)."""
    recipes = {c.name for c in cands if c.recipe}
    flt = float_row(rows)
    if guard is None or flt is None or flt.latency_ms is None:
        return rows
    fast = sorted((r for r in rows if r.name in recipes and r.usable
                   and r.error is not None and r.latency_ms < flt.latency_ms),
                  key=lambda r: (r.latency_ms, r.name))
    if not fast:
        return rows
    guard.bound = guard.bound.under_recipe(fast[0].name, fast[0].error)
    if guard.bound.recipe is not None:
        log.info("accuracy bound %.4g: the error of the fastest recipe start %s (the default "
                 "%g)", guard.bound.value, fast[0].name, guard.bound.recipe.default)
    return [r if r.error is None else replace(r, feasible=guard.bound.allows(r.error))
            for r in rows]


def _recipe_floor(guard) -> dict | None:
    """The recipe that tightened the bound, as the agreed starts store it."""
    return None if guard is None or guard.bound.recipe is None else guard.bound.recipe.to_dict()


def _stored_bound(guard, decided: AgreedStarts) -> None:
    """The bound as the agreed starts left it: tightened as they say (idempotent: tightened
    once), and binding where it refused one of them (a start past it)."""
    if guard is None:
        return
    floor = decided.recipe_floor
    if floor:
        guard.bound = guard.bound.under_recipe(floor["start"], floor["error"])
    guard.binds |= any(r.error is not None and not r.feasible for r in decided.rows)


def _compare(phase: StartsPhase, candidate: StartOutcome, reference: StartOutcome,
             settle_tie: bool = False):
    """An A/B of two starts: the rounds they were timed in together, when those already
    decide it (the candidate confirmed faster by the run's commit rule, or its interval above
    one: slower; with ``settle_tie``, also when they read it less than :data:`START_TIE`
    faster: the reference stands); else an interleaved A/B now (more rounds may confirm what
    five could not). DenseNet-121 (ONNX Runtime, 2-core Xeon): its recipe start read 0.52x
    float's latency in the starts' own five rounds, and a second A/B of three rounds spent
    6 s to say so again; Inception v1 asked whether float beat a recipe start it was 1.4x
    slower than."""
    s, rule = phase.s, phase.s.rule
    cmp = s.plans.together_comparison(candidate.plan_key, reference.plan_key)
    if cmp is not None and (rule.confirmed(cmp, rule.threshold, False) or cmp.ci_low > 1.0
                            or (settle_tie and cmp.ratio * (1.0 + START_TIE) > 1.0)):
        return cmp
    return s.plans.compare(phase._source(candidate), phase._source(reference), "starts")


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
