"""What each repair returns to float on a real model: bisection over tensors (the old starts
repair, ``measure/bisect.py``) against quantizer groups ranked by error per latency cost
(``measure/repair.py``), from every offered Q/DQ on, calibrated and scored on real photos
(``photos.py``). No timing: what ONNX Runtime CPU runs for each result is read from its fully
optimized graph (integer kernels, float kernels between them; ``onnxruntime_kernels``) and the
multiply-adds left integer, then both are checked on held-out photos.

    python benchmarks/repair_vs_bisect.py --models ppocr-cls,ppocr-det --bound 0.2
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import photos

from qdq_optuna.backends.onnxruntime_kernels import kernels_of, what_onnxruntime_ran
from qdq_optuna.backends.what_ran import WhatRan, quantized_tensors
from qdq_optuna.measure.accuracy import AccuracyEvaluator, output_errors, run_model, summarize
from qdq_optuna.measure.bisect import bisect_plan
from qdq_optuna.measure.repair import node_weights, rank_repair
from qdq_optuna.model.graph import node_label


def _what(data: bytes) -> WhatRan:
    import onnx

    proto = onnx.load_from_string(data)
    return WhatRan("ONNX Runtime optimized graph", **what_onnxruntime_ran(
        proto, quantized_tensors(proto)))


def compare(name: str, folder: Path, bound: float, samples: int, evaluations: int,
            metric: str | None = None) -> dict:
    cal, held, pm, exporter, full, path = photos.every_point(name, folder)
    scorer = AccuracyEvaluator(exporter.to_bytes(exporter.plan(set())),
                               {k: v[:samples] for k, v in cal.items()}, metric=metric)

    def err(plan):
        return scorer.evaluate(exporter.to_bytes(plan))[0]

    reference = run_model(str(path), held, optimize=True)
    weights = node_weights(pm.graph)
    label_of = {i: node_label(nd, i) for i, nd in enumerate(pm.graph.nodes)}
    total = sum(weights.values())
    held_metric = AccuracyEvaluator(exporter.to_bytes(exporter.plan(set())), held,
                                    metric=metric) if metric else None
    out = {"model": name, "bound": bound, "metric": metric or "relative L2",
           "error_samples": samples, "rows": []}
    t0 = time.time()
    bis = bisect_plan(exporter, full, err, bound, max_evaluations=evaluations)
    t1 = time.time()
    rep = rank_repair(exporter, full, err, bound, what=_what(exporter.to_bytes(full)),
                      max_evaluations=evaluations)
    t2 = time.time()
    for label, plan, evals, secs in (("every point on", full, 0, 0.0),
                                     ("bisection (tensors)", bis.kept, bis.evaluations, t1 - t0),
                                     ("ranked groups", rep.kept, rep.evaluations, t2 - t1)):
        data = exporter.to_bytes(plan)
        kernels = kernels_of(data)
        what = _what(data)
        read = {label_of[n] for _, n, _ in _uses(plan) if n >= 0}
        integer = [n for n in read if n not in what.float_nodes]
        held_err = summarize(output_errors(reference, run_model(data, held, optimize=True)))
        out["rows"].append({
            "placement": label, "qdq_tensors": len(plan.tensors), "evaluations": evals,
            "seconds": round(secs, 1), "error": err(plan),
            "held_out_relative_l2": held_err["worst_relative_l2"],
            "held_out_cosine": held_err["worst_cosine"],
            "held_out_metric": held_metric.evaluate(data)[0] if held_metric else None,
            "integer_kernels": kernels.integer, "float_kernels": kernels.float_kernels,
            "qdq_nodes_left": kernels.qdq,
            "integer_mac_share": sum(weights[n] for n in integer) / total})
    out["repair"] = rep.to_dict()
    out["bisection_removed"] = bis.responsible
    return out


def _uses(plan):
    return {(t, n, s) for t, consumers, _ in plan.activations for n, s in consumers}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="ppocr-cls,ppocr-det")
    ap.add_argument("--bound", type=float, default=0.2)
    ap.add_argument("--samples", type=int, default=4, help="calibration photos scored")
    ap.add_argument("--evaluations", type=int, default=40)
    ap.add_argument("--metric", help="module:function scoring the repairs instead of relative L2 "
                    "(e.g. det_metric:flips for a text detector)")
    ap.add_argument("--out", default="runs/repair_vs_bisect")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    results = []
    for name in args.models.split(","):
        r = compare(name, Path(args.out) / name, args.bound, args.samples, args.evaluations,
                    args.metric)
        results.append(r)
        for row in r["rows"]:
            print(f"{name:<12} {row['placement']:<20} tensors {row['qdq_tensors']:>4} "
                  f"evals {row['evaluations']:>3} err {row['error']:.3f} held-out rel L2 "
                  f"{row['held_out_relative_l2']:.3f} cos {row['held_out_cosine']:.3f} "
                  f"integer kernels {row['integer_kernels']:>3} float {row['float_kernels']:>3} "
                  f"integer MACs {row['integer_mac_share']:.2f}", flush=True)
        print("  " + r["repair"]["exclude_nodes"][:300], flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
