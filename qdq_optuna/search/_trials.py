"""A pattern study's finished trials: how they rank, which may be committed, whether a new one
improves on them, and when the study stops (its budget spent, too many trials failed, our
sampler's climb converged, its visit has no move left). Each takes the study and what it reads
explicitly."""

from __future__ import annotations

from collections.abc import Callable

import optuna
from optuna.trial import TrialState

from qdq_optuna.record import PatternAttr, TrialAttr
from qdq_optuna.search.objectives import feasible


def trial_rank(t) -> tuple:
    """How finished trials compare: latency, then fewer Q/DQ (a removal that is not slower
    wins), then the earlier trial."""
    return (t.values[0], t.user_attrs.get(TrialAttr.QDQ_COUNT, 0), t.number)


def commit_pool(study: optuna.Study, *, constrained: bool) -> list:
    """Finished single-objective trials that may be committed (feasible ones under a
    budget: ``constrained``)."""
    done = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if t.values]
    return [t for t in done if feasible(t)] if constrained else done


def best_trial(study: optuna.Study, *, constrained: bool):
    """The best committable trial (:func:`trial_rank`), None when none finished."""
    pool = commit_pool(study, constrained=constrained)
    return min(pool, key=trial_rank) if pool else None


def improves(number: int, latency: float, qdq: int, excess: float | None, best,
             reference_ms: float) -> bool:
    """Whether trial ``number`` (``latency``, ``qdq`` pairs, its constraint ``excess``)
    improves on the ``best`` trial so far (None: on the reference's ``reference_ms``)."""
    if excess is not None and excess > 0:
        return False
    if best is None:
        return latency < reference_ms * (1 - 1e-9)
    return (latency, qdq, number) < trial_rank(best) and (
        latency < best.values[0] * (1 - 1e-9) or qdq < best.user_attrs.get(
            TrialAttr.QDQ_COUNT, 0))


def visit_over(study: optuna.Study, sampler) -> bool:
    """Whether our ``sampler`` has no move left for the study's visit (it then stopped the
    study); noted once (``converged_after``, the moves passed over as hopeless). A trial
    still waiting or running may change that: not over."""
    if any(t.state in (TrialState.WAITING, TrialState.RUNNING)
           for t in study.get_trials(deepcopy=False)):
        return False
    found = sampler.next_move(study)
    if found is None or found.move is not None:
        return False
    if PatternAttr.CONVERGED_AFTER not in study.user_attrs:
        study.set_user_attr(PatternAttr.MOVES_SKIPPED, found.skipped)
        study.set_user_attr(PatternAttr.CONVERGED_AFTER, len(study.trials))
    return True


def stopping_callbacks(budget: int, *, sampler, patience: int | None, converges: bool,
                       on_complete: Callable[[], None] | None = None) -> list:
    """Optuna callbacks of a pattern study: ``budget`` finished trials at most; stopped once
    ``max(5, budget)`` trials failed; with ``converges``, stopped when the ``sampler``'s climb
    converged (``patience`` trials without a better one, noted as ``converged_after``);
    ``on_complete`` after each finished trial (the progress bar)."""

    def after_trial(study: optuna.Study, trial) -> None:
        fails = sum(1 for t in study.get_trials(deepcopy=False, states=(TrialState.FAIL,
                                                                        TrialState.PRUNED))
                    if t.state == TrialState.FAIL or TrialAttr.KNOWN_FAILURE in t.user_attrs)
        if fails >= max(5, budget):
            study.stop()
        if trial.state == TrialState.COMPLETE and on_complete is not None:
            on_complete()
        if trial.state == TrialState.COMPLETE and converges and \
                sampler.converged(study, patience):
            study.set_user_attr(PatternAttr.CONVERGED_AFTER, trial.number + 1)
            study.stop()

    return [optuna.study.MaxTrialsCallback(budget, states=(TrialState.COMPLETE,)), after_trial]
