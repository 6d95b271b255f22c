"""Do the shortcut Convs of ResNet downsampling blocks pay, on the TensorRT-like cost model?

The TensorRT rules offer Q/DQ on the output of a downsampling block's 1x1 shortcut Conv (the
residual that the main path's last Conv reads when the Add is fused into it) and never on the
main path's. This script finds, by hill climbing over every insertion point of every pattern
(single points and fusion groups, first improvement, from the empty, the full and the
compute-inputs schemes), the fastest placement with those shortcut points and the fastest
without them, on the zoo ResNets converted to FP16, and prints both.

    python benchmarks/resnet_shortcut.py [--models resnet18 resnet34] [--precision fp16]

Deterministic (the cost model is an analytical model, not a measurement).
"""

from __future__ import annotations

import argparse
import time

from qdq_optuna import PreparedModel
from qdq_optuna.backends.costmodel import estimate  # noqa: E402
from qdq_optuna.examples import zoo  # noqa: E402
from qdq_optuna.placement.rules import residual_conv  # noqa: E402

#: name -> (blocks, BatchNorm folded into the Convs as exporters do in eval mode)
MODELS = {"resnet18": ((2, 2, 2, 2), False), "resnet18-folded": ((2, 2, 2, 2), True),
          "resnet34": ((3, 4, 6, 3), False), "resnet34-folded": ((3, 4, 6, 3), True)}


def points(pm: PreparedModel) -> dict[tuple[str, str], set]:
    return {(pp.pattern.id, pid): pp.uses([pid]) for pp in pm.tunable for pid in pp.ids}


def shortcut_points(pm: PreparedModel, pts: dict) -> set:
    """Points that cover the residual (shortcut) input of an Add of two Conv outputs."""
    g = pm.graph
    found = set()
    for key, uses in pts.items():
        for _, n, s in uses:
            if g.nodes[n].op_type == "Add" and residual_conv(g, n) == s:
                found.add(key)
    return found


class Climber:
    def __init__(self, pm: PreparedModel, pts: dict, groups: list[set]) -> None:
        self.exporter, self.pts, self.groups = pm.exporter(), pts, groups
        self.cache: dict = {}

    def ms(self, scheme: frozenset) -> float:
        uses = set().union(*(self.pts[k] for k in scheme)) if scheme else set()
        plan = self.exporter.plan(uses)
        if plan.key not in self.cache:
            self.cache[plan.key] = estimate(self.exporter.to_bytes(plan)).total_ms
        return self.cache[plan.key]

    def climb(self, start: frozenset) -> tuple[frozenset, float]:
        best, best_ms = start, self.ms(start)
        moves = [{k} for k in self.pts] + self.groups
        improved = True
        while improved:
            improved = False
            for move in moves:
                cand = frozenset(best ^ move)
                ms = self.ms(cand)
                if ms < best_ms * (1 - 1e-9):
                    best, best_ms, improved = cand, ms, True
        return best, best_ms


def run(name: str, precision: str) -> dict:
    blocks, fold = MODELS[name]
    model = zoo.resnet_like(blocks=blocks, fold_bn=fold)
    pm = PreparedModel.prepare(model, runtime="tensorrt", high_precision=precision)
    pts = points(pm)
    shortcut = shortcut_points(pm, pts)
    groups = [{(pp.pattern.id, pid) for pid in group}
              for pp in pm.tunable for group in pp.fusion_groups + pp.concat_groups]
    compute = {k for k, uses in pts.items()
               if any(pm.graph.nodes[n].op_type in ("Conv", "Gemm") and s == 0
                      for _, n, s in uses)}
    results = {}
    for label, allowed in (("without", set(pts) - shortcut), ("with", set(pts))):
        sub = {k: v for k, v in pts.items() if k in allowed}
        climber = Climber(pm, sub, [g & allowed for g in groups if g & allowed])
        starts = [frozenset(), frozenset(allowed), frozenset(compute & allowed)]
        results[label] = min((climber.climb(s) for s in starts), key=lambda r: r[1])
    base = Climber(pm, pts, []).ms(frozenset())
    return {"model": name, "precision": precision, "baseline_ms": base,
            "best_without_ms": results["without"][1], "best_with_ms": results["with"][1],
            "shortcut_points": len(shortcut),
            "best_uses_shortcut": bool(results["with"][0] & shortcut)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["resnet18", "resnet34"], choices=list(MODELS))
    ap.add_argument("--precision", default="fp16", choices=["fp32", "fp16", "bf16"])
    args = ap.parse_args()
    print("| model | float baseline | best without shortcut Q/DQ | best with them "
          "| best uses them | without vs with |")
    print("|---|---:|---:|---:|---|---:|")
    for name in args.models:
        t0 = time.monotonic()
        r = run(name, args.precision)
        print(f"| {name} ({args.precision}) | {r['baseline_ms'] * 1e3:.1f} us "
              f"| {r['best_without_ms'] * 1e3:.1f} us "
              f"| {r['best_with_ms'] * 1e3:.1f} us | {r['best_uses_shortcut']} "
              f"| +{(r['best_without_ms'] / r['best_with_ms'] - 1) * 100:.1f} % |"
              f"  <!-- {time.monotonic() - t0:.0f} s -->", flush=True)


if __name__ == "__main__":
    main()
