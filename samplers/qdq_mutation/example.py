"""Toy Q/DQ placement search: 12 binary insertion points with a needle-like latency."""

from __future__ import annotations

import os

import optuna
import optunahub

POINTS = [f"p{i}" for i in range(12)]
# All inputs and the output of an op: quantizing only part of it just adds reformat cost.
FUSION_GROUPS = [["p0", "p1", "p2"], ["p3", "p4", "p5"]]
# All inputs of one Concat: they must share a scale, so they move together.
CONCAT_GROUPS = [["p6", "p7"]]
# Inputs of ops that stay in high precision: a Q/DQ there is pure overhead.
HARMFUL = ["p8", "p9", "p10", "p11"]


def latency(x: dict[str, int]) -> float:
    """Needle-like: random half placements are no better than the empty scheme."""
    value = 10.0
    covered: set[str] = set()
    for gain, groups in ((3.0, FUSION_GROUPS), (1.0, CONCAT_GROUPS)):
        for group in groups:
            if all(x[p] for p in group):
                value -= gain
                covered.update(group)
    value += 0.6 * sum(x[p] for p in HARMFUL)
    return value + 0.3 * sum(1 for p in POINTS if x[p] and p not in covered and p not in HARMFUL)


def objective(trial: optuna.Trial) -> float:
    return latency({p: trial.suggest_int(p, 0, 1) for p in POINTS})


def main() -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    # Loaded from the local registry so the script runs from a plain checkout; from OptunaHub use
    # optunahub.load_module("samplers/qdq_mutation") instead.
    module = optunahub.load_local_module(
        package="qdq_mutation", registry_root=os.path.dirname(os.path.dirname(__file__)) or "."
    )
    study = optuna.create_study(sampler=module.QDQMutationSampler(seed=0))
    study.set_user_attr("qdq_points", POINTS)
    study.set_user_attr("qdq_fusion_groups", FUSION_GROUPS)
    study.set_user_attr("qdq_concat_groups", CONCAT_GROUPS)
    study.optimize(objective, n_trials=60)

    for trial in study.trials[:5]:
        scheme = "".join(str(trial.params[p]) for p in POINTS)
        origin = trial.system_attrs["qdq:origin"]
        moves = trial.system_attrs["qdq:moves"]
        print(f"trial {trial.number:2d} {scheme} {trial.value:5.2f} {origin} {moves}")
    best = study.best_trial
    scheme = "".join(str(best.params[p]) for p in POINTS)
    print(f"best latency {best.value:.2f} at trial {best.number}: {scheme}")
    print(f"(empty scheme {study.trials[0].value:.2f}, full scheme {study.trials[1].value:.2f})")


if __name__ == "__main__":
    main()
