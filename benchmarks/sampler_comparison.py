"""Race samplers on the cost model's per-pattern landscapes, in memory (a sampler-development aid).

``qdq-optuna bench studies/sampler_comparison.yaml`` is the comparison of record: whole tuning
runs, committed pattern by pattern, stored and resumable. This script is its quick cousin for
iterating on a sampler: every pattern of a zoo model is one in-memory Optuna study whose objective
exports the pattern's scheme on top of the *float* model (earlier patterns are not committed, so
every sampler sees the same landscapes) and asks the analytical ``costmodel`` backend; models
already measured are free, as in the search. Per pattern, the best-known gain is the best any
sampler/seed found; a run *reaches* a pattern once its best gain is within 1 % of it.

    python benchmarks/sampler_comparison.py --models resnet,mobilenet,yolo --size full \\
        --samplers qdq,tpe,random --seeds 10 --budget 30
    python benchmarks/sampler_comparison.py --samplers "qdq,qdq[hill_climb_parents=0]"  # ablation

``NAME@stopN`` stops each study once ``QDQMutationSampler.converged(study, N)`` holds (the
early stop ``tune`` uses). ``qdq[arg=value;...]`` passes QDQMutationSampler's constructor
arguments over the config's (``hill_climb_parents``, ``fusion_group_probability``,
``seed_full_scheme``, ...), for ablations.

Printed per model and sampler: the measurements (distinct models timed) until every pattern with
a real gain (best known >= the commit threshold) was reached, summed over those patterns, with a
missed pattern counted as its whole budget; how many (pattern, seed) pairs missed; and the
geometric mean of the per-pattern final gains.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import optuna

from qdq_optuna.backends.costmodel import CostModelBackend  # noqa: E402
from qdq_optuna.config import Config  # noqa: E402
from qdq_optuna.examples import zoo  # noqa: E402
from qdq_optuna.runtimes.prepared import PreparedModel  # noqa: E402
from qdq_optuna.search.samplers import make_sampler  # noqa: E402


def pattern_attrs(pm, pp) -> dict:
    """The study user attributes the search sets for a pattern (its sampler reads them)."""
    from qdq_optuna.placement.scheme import ChoiceSpace
    from qdq_optuna.record import pattern_attrs as stored

    return stored(pp, pm, ChoiceSpace((pm.quant_type,)))


def build_sampler(spec: str, **kwargs) -> optuna.samplers.BaseSampler:
    """A sampler by name; ``qdq[key=value;...]`` passes QDQMutationSampler constructor
    arguments (ablations)."""
    if not spec.startswith("qdq["):
        return make_sampler(spec, **kwargs)
    import yaml

    args = dict(item.split("=", 1) for item in spec[4:-1].split(";"))
    return make_sampler("qdq", qdq_args={k: yaml.safe_load(v) for k, v in args.items()}, **kwargs)


def race(model_name: str, size: str, samplers: list[str], seeds: int, budget: int,
         threshold: float) -> dict:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.onnx"
        path.write_bytes(zoo.build(model_name, size).SerializeToString())
        pm = PreparedModel.prepare(str(path), runtime="tensorrt", preprocess="none")
    exporter = pm.exporter(None, Config())
    backend = CostModelBackend()
    cache: dict[str, float] = {}

    def latency(plan) -> float:
        if plan.key not in cache:
            cache[plan.key] = backend.estimate(exporter.to_bytes(plan)).total_ms
        return cache[plan.key]

    ref = latency(exporter.plan(set()))
    # results[(pattern, sampler, seed)] = list of best gain after each measurement
    results: dict[tuple[str, str, int], list[float]] = {}
    for idx, pp in enumerate(pm.tunable):
        cfg = Config(schemes_per_region=budget)
        for name in samplers:
            for seed in range(seeds):
                spec, _, patience = name.partition("@stop")
                sampler = build_sampler(
                    spec, seed=seed + idx, config=cfg,
                    scheme_key=lambda params, pp=pp: exporter.plan(
                        pp.uses([p for p, v in params.items() if v])).key)
                study = optuna.create_study(sampler=sampler, direction="minimize")
                for k, v in pattern_attrs(pm, pp).items():
                    study.set_user_attr(k, v)
                if not name.startswith("qdq"):
                    study.enqueue_trial(dict.fromkeys(pp.ids, 0))
                seen = {exporter.plan(set()).key}
                curve = [1.0]

                def objective(trial: optuna.Trial, pp=pp, seen=seen, curve=curve) -> float:
                    params = {p: trial.suggest_int(p, 0, 1) for p in pp.ids}
                    plan = exporter.plan(pp.uses([p for p, v in params.items() if v]))
                    ms = latency(plan)
                    if plan.key not in seen:
                        seen.add(plan.key)
                        curve.append(max(curve[-1], ref / ms))
                    return ms

                callbacks = []
                if patience:
                    def stop(study, trial, sampler=sampler, n=int(patience)):
                        if sampler.converged(study, n):
                            study.stop()
                    callbacks.append(stop)
                study.optimize(objective, n_trials=budget, callbacks=callbacks)
                results[(pp.pattern.id, name, seed)] = curve
    return {"patterns": [pp.pattern.id for pp in pm.tunable], "results": results,
            "threshold": threshold, "budget": budget}


def summarize(model: str, race_out: dict, samplers: list[str], seeds: int) -> list[str]:
    res, budget, threshold = race_out["results"], race_out["budget"], race_out["threshold"]
    lines = []
    best = {p: max(c[-1] for (q, _, _), c in res.items() if q == p) for p in race_out["patterns"]}
    live = [p for p in race_out["patterns"] if best[p] >= threshold]
    lines.append(f"{model}: {len(race_out['patterns'])} patterns, {len(live)} with a gain >= "
                 f"{threshold}: " + ", ".join(f"{p} {best[p]:.3f}x" for p in live))
    for name in samplers:
        totals, misses, gains, spent = [], 0, [], []
        missed: dict[str, int] = {}
        for seed in range(seeds):
            total = 0
            for p in live:
                curve = res[(p, name, seed)]
                hit = next((i for i, g in enumerate(curve) if g >= 0.99 * best[p]), None)
                if hit is None:
                    misses += 1
                    missed[p] = missed.get(p, 0) + 1
                    hit = budget
                total += hit
            totals.append(total)
            spent.append(sum(len(res[(p, name, seed)]) - 1 for p in race_out["patterns"]))
            gains.append(math.prod(res[(p, name, seed)][-1] for p in live))
        lines.append(f"  {name:<8} measurements to reach all: median {statistics.median(totals):6.1f}"
                     f"  mean {statistics.mean(totals):6.1f}  misses {misses:3d}/{seeds * len(live)}"
                     f"  product of gains: median {statistics.median(gains):.3f}"
                     f"  measured in all: median {statistics.median(spent):.0f}"
                     + (f"  missed: {missed}" if missed else ""))
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="resnet,mobilenet,yolo,transformer")
    ap.add_argument("--size", default="full", choices=["small", "medium", "full"])
    ap.add_argument("--samplers", default="qdq,tpe,random")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--budget", type=int, default=30)
    ap.add_argument("--threshold", type=float, default=1.02)
    args = ap.parse_args(argv)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    samplers = args.samplers.split(",")
    for model in args.models.split(","):
        t0 = time.monotonic()
        out = race(model, args.size, samplers, args.seeds, args.budget, args.threshold)
        for line in summarize(model, out, samplers, args.seeds):
            print(line)
        print(f"  ({time.monotonic() - t0:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
