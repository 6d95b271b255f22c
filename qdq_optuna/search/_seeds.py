"""Where a run starts from besides the candidates every run has: the runtime's recipe start,
the user's seeds as whole-model starts (``--qdq-baseline``, ``--pattern-cache``, the dynamic
mode's recipe), and the schemes a two-objective pattern study tries first. Each takes what it
reads explicitly."""

from __future__ import annotations

import logging
from collections.abc import Callable

from qdq_optuna.errors import ToolError, UserError
from qdq_optuna.placement import starts
from qdq_optuna.placement.points import PatternPoints
from qdq_optuna.placement.scheme import ChoiceSpace, compute_inputs_scheme
from qdq_optuna.placement.seeds import PatternCache, baseline_seed
from qdq_optuna.placement.starts import Start
from qdq_optuna.runtimes import Runtime
from qdq_optuna.runtimes.prepared import PreparedModel
from qdq_optuna.search._options import TuneOptions
from qdq_optuna.search._pattern import Seed
from qdq_optuna.wall_time import WallTime

log = logging.getLogger("qdq_optuna")


def recipe_start(pm: PreparedModel, options: TuneOptions, profile: Runtime, calibration,
                 keep: Callable[[bytes], None] | None = None, wall: WallTime | None = None):
    """The runtime's classic recipe as a start (None when it cannot be made); ``keep``: the run
    folder's writer its own file is handed to as the tool wrote it; ``wall``: its time is the
    starts' "recipe" step."""
    try:
        with (wall or WallTime()).step("starts", "recipe"):
            start = profile.recipe_start(pm, options.model, input_shapes=options.input_shapes,
                                         data=calibration[0] if calibration else None,
                                         keep=keep)
        return start.as_recipe() if start is not None else None
    except ToolError as exc:  # the quantizer refused this model: no recipe start
        log.warning("%s; starting without the recipe", exc)
        return None
    except UserError:
        raise
    except Exception as exc:  # the quantizer failed on this model: no recipe start
        log.warning("the %s recipe could not be made for this model (%s: %s); starting "
                    "without it", profile.name, type(exc).__name__, exc)
        return None


def seed_starts(prepared: PreparedModel, qdq_baseline: str | None,
                cache: PatternCache | None) -> list[Start]:
    """The per-node modes' starts (every point of a mode on; dynamic: the recipe, when
    searched) and the user's seeds: ``--qdq-baseline``, ``--pattern-cache``."""
    found = [s for s in (starts.dynamic_start(prepared),
                         *(starts.mode_start(prepared, m)
                           for m in prepared.rules.weight_only_modes)) if s is not None]
    if qdq_baseline:
        found.append(starts.baseline_start(prepared, qdq_baseline))
    if cache is not None:
        cached = starts.cache_start(prepared, cache)
        if cached is not None:
            found.append(cached)
    return found


def study_seeds(pp: PatternPoints, space: ChoiceSpace, *, ours: bool,
                cache: PatternCache | None, baseline_q: set[str] | None,
                compute_inputs: bool) -> list[Seed]:
    """Two objectives: one pass from float whose studies try these first: the empty scheme
    (samplers other than ours, which proposes it itself: ``ours``), the user's seeds, then the
    classic recipe (ours, with ``compute_inputs``)."""
    seeds = []
    if not ours:
        seeds.append(Seed(space.seed(dict.fromkeys(pp.ids, 0))))
    if cache is not None:
        seeds += [Seed(space.seed(s)) for s in cache.seeds_for(pp)]
    if baseline_q:
        s = baseline_seed(pp, baseline_q)
        if s is not None:
            seeds.append(Seed(space.seed(s)))
    if ours and compute_inputs:  # after user seeds
        compute = compute_inputs_scheme(pp)
        if compute is not None:
            seeds.append(Seed(space.seed(compute)))
    return seeds
