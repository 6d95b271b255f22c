"""Speed of two things every run does many times, measured here rather than in timed tests:
the cost model's estimate (a 60-node and a 5000-node model) and the dashboard's per-pattern
pictures (CPU seconds of this process, the better of three).

    python benchmarks/estimate_and_drawing_speed.py

Targets: estimate < 30 ms (60 nodes) and < 1 s (5000 nodes); drawing < 0.3 s CPU per pattern.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path


def best_of(fn, repeat: int = 3, clock=time.perf_counter) -> float:
    times = []
    for _ in range(repeat):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return min(times)


def main() -> int:
    from qdq_optuna.backends.costmodel import estimate
    from qdq_optuna.examples import zoo
    from qdq_optuna.examples.costmodel_cases import big_residual_chain, resnet_variants
    from qdq_optuna.outputs.dashboard import convergence_png, region_svg
    from qdq_optuna.runtimes.prepared import PreparedModel

    small, big = resnet_variants()["conv_inputs_weights"], big_residual_chain(1250)
    estimate(small)
    rows = [("estimate, 60+ nodes", best_of(lambda: estimate(small)), 0.03),
            ("estimate, 5000 nodes", best_of(lambda: estimate(big)), 1.0)]
    pm = PreparedModel.prepare(zoo.build("yolo", "small"))
    worst = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        convergence_png(Path(tmp) / "warm.png", [(0, 1.0)], reference_ms=1.0, title="warm")
        for pp in pm.tunable:
            rep = pp.pattern.representative

            def draw(pp=pp, rep=rep):
                convergence_png(Path(tmp) / "p.png", [(i, 10 - 0.01 * i) for i in range(30)],
                                reference_ms=10.0, title=pp.pattern.id)
                region_svg(pm.graph, pm.tree[rep].all_nodes,
                           {p: pp.resolved[p].get(rep, []) for p in pp.ids},
                           chosen=set(pp.ids[:2]), committed=set(pp.ids[:1]),
                           kinds={p.id: p.kind for p in pp.points}, title=pp.pattern.id)

            worst = max(worst, best_of(draw, clock=time.process_time))
    rows.append(("drawing, worst pattern (CPU s)", worst, 0.3))
    print("| what | seconds | target | met |\n|---|---:|---:|---|")
    for name, s, target in rows:
        print(f"| {name} | {s:.4f} | {target} | {'yes' if s < target else 'no'} |")
    return 0 if all(s < target for _, s, target in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
