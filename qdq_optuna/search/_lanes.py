"""Which lane's standing model ships, once the descent ends (moved out of the Tuner as is)."""

from __future__ import annotations

from qdq_optuna.record import AgreedStarts
from qdq_optuna.search._pattern import Search
from qdq_optuna.search._starts import RECIPE_LANE


def final_lane(s: Search, starts: AgreedStarts | None, partial: bool) -> str:
    """The lane whose standing model ships: the only one, else the fastest (agreed once
    every lane finished; a run cut short picks among the standing models it has)."""
    lanes = (starts.order if starts is not None else None) or [""]
    if len(lanes) == 1:
        return lanes[0]
    if partial:
        return fastest_lane(s, lanes)

    def pick() -> tuple[str, int]:
        before = s.plans.measurements
        return fastest_lane(s, lanes), s.plans.measurements - before

    return s.record.winner(pick)


def fastest_lane(s: Search, lanes: list[str]) -> str:
    """The first lane's standing model ships unless another lane's beats it as a commit
    must (the run's commit rule: measured once on a deterministic backend, an interleaved
    A/B on a measured one). On a measured backend the recipe's lane stands first unless
    the first lane's model is still float (a quantized model must beat float; among
    quantized ones the runtime's recipe, the model to match, stands unless beaten)."""
    rule = s.rule
    sources = {}
    for lane in lanes:
        plan = s.exporter.plan(s.record.standing_uses(lane))
        sources[lane] = (plan, s.exporter.source(plan))
    if not s.plans.deterministic and RECIPE_LANE in lanes and len(sources[lanes[0]][0]):
        lanes = [RECIPE_LANE] + [lane for lane in lanes if lane != RECIPE_LANE]
    best = lanes[0]
    for lane in lanes[1:]:
        (plan, src), (best_plan, best_src) = sources[lane], sources[best]
        if plan.key == best_plan.key:
            continue
        if s.plans.deterministic:
            ms = s.plans.measure(src, plan.key, "lanes", qdq=len(plan))[0]
            best_ms = s.plans.measure(best_src, best_plan.key, "lanes", qdq=len(best_plan))[0]
            better = rule.promising(ms, best_ms, rule.threshold)
        else:
            better = rule.confirmed(s.plans.compare(src, best_src, "lanes"), rule.threshold,
                                    False)
        if better:
            best = lane
    return best
