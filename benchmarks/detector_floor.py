"""Why a text detector's quantized placements break the default accuracy bound on real photos:
the FP32 model's own noise floor, where the error sits, and what a repair could keep even if it
chose on the very photos it is judged on. No timing: what stays integer is read as the share of
the model's multiply-adds in nodes that read quantized inputs and that ONNX Runtime's optimized
graph runs integer.

Data as a run has it (``photos.py``): 16 calibration crops, of which the tool's guard holds out
4 (``hold_out``) and calibrates on 12; 8 held-out crops of other photos. Errors: relative L2
and cosine of every output over all crops concatenated (worst output).

    python benchmarks/detector_floor.py --models ppocrv5-det --out /tmp/floor --json floor.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import onnx
import photos
import real_models
import repair_table

from qdq_optuna.backends.onnxruntime_kernels import what_onnxruntime_ran
from qdq_optuna.backends.what_ran import WhatRan, quantized_tensors
from qdq_optuna.measure.accuracy import ErrorScorer, hold_out, input_noise, run_model
from qdq_optuna.measure.repair import node_weights, rank_repair
from qdq_optuna.model import calibration
from qdq_optuna.model.graph import node_label
from qdq_optuna.placement.export import plan_uses
from qdq_optuna.runtimes.prepared import PreparedModel

BOUND = 0.2
EVALUATIONS = 64


def concat_errors(ref: dict, got: dict) -> tuple[float, float]:
    """(cosine, relative L2) of the worst output over all samples concatenated."""
    e = repair_table.errors(ref, got)
    return e["cosine"], e["relative_l2"]


def one(name: str, out: Path) -> dict:
    path = photos.write(name, out / name)
    cal_all = dict(np.load(out / name / "calibration.npz"))
    held = dict(np.load(out / name / "heldout.npz"))
    (cal, _), (guard, _) = hold_out((cal_all, "calibration"))
    pm = PreparedModel.prepare(str(path), runtime="onnxruntime",
                               input_shapes=real_models.MODELS[name].input_shapes)
    stats = calibration.collect_statistics(pm.graph.full_model(), pm.candidate_tensors(), cal)
    exporter = pm.exporter(pm.run_scales(stats))
    full = exporter.plan(set().union(*(pp.uses(pp.ids) for pp in pm.tunable)))
    uses = set(plan_uses(full))
    fp32 = exporter.to_bytes(exporter.plan(set()))
    refs = {"guard": (guard, run_model(fp32, guard)), "held_out": (held, run_model(fp32, held))}

    def errs(plan) -> dict:
        data = exporter.to_bytes(plan)
        return {k: concat_errors(ref, run_model(data, d)) for k, (d, ref) in refs.items()}

    row: dict = {"model": name, "tensors": len(full.tensors), "uses": len(uses)}
    # the floor: the FP32 model under half an 8-bit step of input noise
    row["floor"] = {k: concat_errors(ref, run_model(fp32, input_noise(d, 0)[0]))
                    for k, (d, ref) in refs.items()}
    # per crop (a text-free crop's map is near 0: its cosine is the first to go)
    ref = refs["held_out"][1]
    noisy = run_model(fp32, input_noise(held, 0)[0])
    row["floor_held_out_per_crop_cosine"] = [
        float(a.ravel() @ b.ravel() / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-30))
        for name_ in ref for a, b in zip(ref[name_], noisy[name_])]
    scorer = ErrorScorer(fp32, guard, metric=None, error_measure="relative_l2", optimize=True)
    row["floor_as_the_run_measures_it"] = scorer.noise_floor()["error"]
    row["every_point"] = errs(full)
    # where the error sits: each reader op type's uses alone, and each sixth of the graph alone
    by_op: dict[str, set] = defaultdict(set)
    for u in uses:
        by_op[pm.graph.nodes[u[1]].op_type if u[1] >= 0 else "graph output"].add(u)
    row["alone_by_reader_op"] = {op: {"uses": len(us), **errs(exporter.plan(us))}
                                 for op, us in sorted(by_op.items(), key=lambda kv: -len(kv[1]))}
    nodes = sorted({n for _, n, _ in uses if n >= 0})
    row["alone_by_graph_sixth"] = []
    for part in np.array_split(nodes, 6):
        part_set = set(part.tolist())
        us = {u for u in uses if u[1] in part_set}
        row["alone_by_graph_sixth"].append({"nodes": [int(part[0]), int(part[-1])],
                                            "uses": len(us), **errs(exporter.plan(us))})
    # what a repair keeps: choosing on the guard's crops (what a run can do), and choosing on
    # the held-out photos themselves (no run can: an upper bound on what any ranking finds)
    proto = onnx.load_from_string(exporter.to_bytes(full))
    what = WhatRan("ONNX Runtime optimized graph",
                   **what_onnxruntime_ran(proto, quantized_tensors(proto)))
    weights = node_weights(pm.graph)
    total = sum(weights.values())

    def integer_share(plan) -> float:
        p = onnx.load_from_string(exporter.to_bytes(plan))
        ran = what_onnxruntime_ran(p, quantized_tensors(p))
        read = {node_label(pm.graph.nodes[n], n) for _, n, _ in plan_uses(plan) if n >= 0}
        return sum(weights[n] for n in read if n not in ran["float_nodes"]) / total

    row["integer_mac_share_every_point"] = integer_share(full)
    for chooser, (d, ref) in refs.items():
        start = time.time()

        def error(plan, d=d, ref=ref) -> float:
            return concat_errors(ref, run_model(exporter.to_bytes(plan), d))[1]

        rep = rank_repair(exporter, full, error, BOUND, what=what,
                          max_evaluations=EVALUATIONS)
        row[f"repair_choosing_on_{chooser}"] = {
            "returned": len(rep.returned), "groups": len(rep.groups),
            "evaluations": rep.evaluations, "seconds": round(time.time() - start, 1),
            "integer_mac_share": integer_share(rep.kept), **errs(rep.kept)}
    return row


def table(rows: list[dict]) -> str:
    out = ["| model | FP32 floor: guard / held-out rel. L2 | every point: guard / held-out rel. "
           "L2 (held-out cosine) | repair choosing on | groups returned | integer MACs kept | "
           "guard / held-out rel. L2 after |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        for chooser in ("guard", "held_out"):
            rep = r[f"repair_choosing_on_{chooser}"]
            out.append(
                f"| {r['model']} | {r['floor']['guard'][1]:.3f} / {r['floor']['held_out'][1]:.3f}"
                f" (worst held-out crop's cosine "
                f"{min(r['floor_held_out_per_crop_cosine']):.3f})"
                f" | {r['every_point']['guard'][1]:.3f} / {r['every_point']['held_out'][1]:.3f} "
                f"({r['every_point']['held_out'][0]:.3f}) | {chooser.replace('_', '-')} | "
                f"{rep['returned']} of {rep['groups']} | {rep['integer_mac_share']:.0%} (every "
                f"point {r['integer_mac_share_every_point']:.0%}) | {rep['guard'][1]:.3f} / "
                f"{rep['held_out'][1]:.3f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="ppocrv5-det")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    rows = [one(name, args.out) for name in args.models.split(",")]
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
