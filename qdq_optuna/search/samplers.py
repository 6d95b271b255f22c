"""Samplers by name (ours by default, Optuna's own to compare), or given as Optuna users give
them: a sampler object, or a function of the seed that makes one."""

from __future__ import annotations

import copy
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any

import optuna

from qdq_optuna.config import Config
from qdq_optuna.errors import OptionError, install_hint


@dataclass(frozen=True)
class SamplerTraits:
    """What a sampler can search: categorical parameters (mixed precision's choice names),
    two objectives, and whether it honours Optuna's trial constraints while sampling."""

    categorical: bool
    multi_objective: bool
    constrained: bool


#: every sampler by name, with what it can search: the one table of sampler capabilities
SAMPLER_TRAITS = {
    "qdq": SamplerTraits(categorical=True, multi_objective=True, constrained=True),
    "tpe": SamplerTraits(categorical=True, multi_objective=True, constrained=True),
    "cmaes": SamplerTraits(categorical=False, multi_objective=False, constrained=False),
    "random": SamplerTraits(categorical=True, multi_objective=True, constrained=False),
    "gp": SamplerTraits(categorical=False, multi_objective=True, constrained=True),
    "nsga2": SamplerTraits(categorical=True, multi_objective=True, constrained=True),
    "bruteforce": SamplerTraits(categorical=True, multi_objective=True, constrained=False),
}
SAMPLERS = tuple(SAMPLER_TRAITS)
#: Optuna's samplers that take categorical parameters (ours encodes choices itself)
CATEGORICAL_SAMPLERS = tuple(n for n, s in SAMPLER_TRAITS.items() if s.categorical and n != "qdq")
#: Optuna's sampler classes by the name that makes them (a sampler object's traits)
_CLASSES: Mapping[type, str] = {
    optuna.samplers.TPESampler: "tpe", optuna.samplers.CmaEsSampler: "cmaes",
    optuna.samplers.RandomSampler: "random", optuna.samplers.GPSampler: "gp",
    optuna.samplers.NSGAIISampler: "nsga2", optuna.samplers.BruteForceSampler: "bruteforce",
}
#: what unknown sampler objects are taken to search (any Optuna sampler takes categorical and
#: two-objective studies; whether it reads the constraints is not known)
_UNKNOWN = SamplerTraits(categorical=True, multi_objective=True, constrained=False)

#: what ``sampler=`` takes: a name (the command line's), an Optuna sampler (each pattern's
#: study gets a copy of it), or ``fn(seed) -> sampler`` (called once per study)
SamplerArg = (str | optuna.samplers.BaseSampler
              | Callable[[int | None], optuna.samplers.BaseSampler])


def sampler_name(sampler: SamplerArg) -> str:
    """The sampler as the report and the run's fingerprint name it: the name given, else the
    object's class (the function's name for a factory)."""
    if isinstance(sampler, str):
        return sampler
    if isinstance(sampler, optuna.samplers.BaseSampler):
        return type(sampler).__name__
    return getattr(sampler, "__name__", type(sampler).__name__)


def is_ours(sampler: SamplerArg) -> bool:
    """Our sampler, by name (it is made per study with the study's scheme key and moves)."""
    return sampler == "qdq"


def sampler_traits(sampler: SamplerArg) -> SamplerTraits | None:
    """What ``sampler`` can search; None for an unknown name (refused where it is made)."""
    if isinstance(sampler, str):
        return SAMPLER_TRAITS.get(sampler)
    if isinstance(sampler, optuna.samplers.BaseSampler):
        known = _CLASSES.get(type(sampler))
        return SAMPLER_TRAITS[known] if known else _UNKNOWN
    return _UNKNOWN


def takes_categorical(sampler: SamplerArg) -> bool:
    """Whether the studies suggest choices as categorical parameters for ``sampler`` (ours
    encodes them itself)."""
    traits = sampler_traits(sampler)
    return not is_ours(sampler) and traits is not None and traits.categorical


def make_sampler(
    name: SamplerArg,
    *,
    seed: int | None,
    config: Config,
    scheme_key: Callable[[dict[str, int]], Hashable] | None = None,
    multi_objective: bool = False,
    refine: bool = False,
    qdq_args: Mapping[str, Any] | None = None,
) -> optuna.samplers.BaseSampler:
    """``refine``: the study starts from an enqueued scheme (a refinement round), so our
    sampler does not propose the empty and full schemes first. ``qdq_args``: constructor
    arguments of our sampler over the config's (an ablation, e.g. ``hill_climb_parents=0``).
    A sampler object is copied (each study samples on its own, from the same state); a
    factory is called with ``seed``."""
    if isinstance(name, optuna.samplers.BaseSampler):
        return copy.deepcopy(name)
    if not isinstance(name, str):
        made = name(seed)
        if not isinstance(made, optuna.samplers.BaseSampler):
            raise OptionError(f"sampler {sampler_name(name)}: returned {type(made).__name__}, "
                              "not an optuna.samplers.BaseSampler")
        return made
    if qdq_args and name != "qdq":
        raise OptionError(f"sampler {name!r}: arguments {sorted(qdq_args)} are for 'qdq' only")
    if name == "qdq":
        from qdq_optuna.samplers.qdq_mutation import QDQMutationSampler

        args = dict(
            seed=seed,
            top_percent_to_mutate=config.top_percent_to_mutate,
            minimum_schemes_to_mutate=config.minimum_schemes_to_mutate,
            maximum_mutations=config.maximum_mutations,
            maximum_generation_attempts=config.maximum_generation_attempts,
            concat_group_min_samples=config.concat_group_min_samples,
            schemes_per_region=config.schemes_per_region,
            fusion_group_probability=config.fusion_group_probability,
            seed_empty_scheme=not refine,
            seed_full_scheme=not refine,
            scheme_key=scheme_key,
        )
        return QDQMutationSampler(**{**args, **(qdq_args or {})})
    if name == "tpe":
        return optuna.samplers.TPESampler(seed=seed, multivariate=True)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if name == "cmaes":
        if multi_objective:
            raise OptionError("--sampler cmaes supports one objective only; use qdq or nsga2")
        try:
            import cmaes  # noqa: F401
        except ImportError:
            raise OptionError("--sampler cmaes needs the 'cmaes' package: pip install cmaes") from None
        return optuna.samplers.CmaEsSampler(seed=seed, with_margin=True, warn_independent_sampling=False)
    if name == "gp":
        try:
            import scipy  # noqa: F401
            import torch  # noqa: F401
        except ImportError:
            raise OptionError(
                f"--sampler gp needs torch and scipy: {install_hint('gp')}"
            ) from None
        return optuna.samplers.GPSampler(seed=seed)
    if name == "nsga2":
        return optuna.samplers.NSGAIISampler(seed=seed)
    if name == "bruteforce":
        return optuna.samplers.BruteForceSampler(seed=seed)
    raise OptionError(f"--sampler: unknown {name!r} (choose from {', '.join(SAMPLERS)})")
