"""make_sampler's ``qdq_args``: our sampler's constructor arguments over the config's, the public
way an ablation changes the sampler (no writes to its private attributes)."""

from __future__ import annotations

import pytest

from qdq_optuna import Config
from qdq_optuna.errors import OptionError
from qdq_optuna.search.samplers import make_sampler


def test_qdq_args_reach_the_constructor():
    with pytest.raises(ValueError, match="hill_climb_parents"):
        make_sampler("qdq", seed=0, config=Config(), qdq_args={"hill_climb_parents": -1})
    with pytest.raises(TypeError, match="no_such_argument"):
        make_sampler("qdq", seed=0, config=Config(), qdq_args={"no_such_argument": 1})


def test_qdq_args_override_the_configs():
    """An argument make_sampler already sets from the config or ``refine`` is replaced, not
    passed twice."""
    with pytest.raises(ValueError, match="fusion_group_probability"):
        make_sampler("qdq", seed=0, config=Config(), qdq_args={"fusion_group_probability": 2.0})
    sampler = make_sampler("qdq", seed=0, config=Config(), refine=True,
                           qdq_args={"seed_full_scheme": True, "hill_climb_parents": 0})
    assert type(sampler).__name__ == "QDQMutationSampler"


def test_qdq_args_for_another_sampler_is_one_clear_error():
    with pytest.raises(OptionError, match="'tpe'.*hill_climb_parents.*'qdq' only"):
        make_sampler("tpe", seed=0, config=Config(), qdq_args={"hill_climb_parents": 0})
