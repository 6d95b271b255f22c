"""Activation ranges cut at their readers' saturation, before and after, on real models and
real photos: every offered point on and ONNX Runtime's recipe placement, each exported with
the run's scales made from one calibration with and without the cut, scored against FP32 on
the held-out photos (every output over all held-out crops concatenated; the worst output's)
and on the quarter of the calibration crops a run holds out for its guard. No tuning, no
timing: the placements and the calibration are the run's, only the scales differ.

    python benchmarks/reader_ranges.py --models ppocr-det,ppocr-cls,nudenet-320n \\
        --out /tmp/rr --json benchmarks/results/reader_ranges.json

``--weight-bits NAME`` splits the error of that model's every-point placement between this
CPU's arithmetic and 7-bit weights; ``--leave-one-in NAME`` adds, for that model's every-point placement with the cut, each
quantized tensor's own error alone (only it quantized) on the held-out text crops: which
tensors still carry the error.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import photos
import real_models
from repair_table import errors

from qdq_optuna.measure.accuracy import hold_out, run_model
from qdq_optuna.model import calibration
from qdq_optuna.placement import starts as whole
from qdq_optuna.runtimes import onnxruntime as ort_runtime
from qdq_optuna.runtimes.prepared import PreparedModel


def scales(pm: PreparedModel, stats: dict, cut: bool) -> dict:
    """The run's scales (``search/_prepare.py``): percentile, Concat sharing, with or without
    the readers' cut."""
    bounds = calibration.reader_bounds(pm.graph) if cut else None
    out = calibration.activation_scales(stats, method=calibration.DEFAULT_METHOD,
                                        quant_type=pm.quant_type, bounds=bounds)
    if pm.rules.concat_share_ratio is not None:
        out = calibration.share_concat_scales(pm.graph.nodes, out, pm.quant_type,
                                              ratio=pm.rules.concat_share_ratio)
    return out


def prepared(name: str, work: Path):
    path = photos.write(name, work)
    shapes = real_models.MODELS[name].input_shapes
    cal = dict(np.load(work / "calibration.npz"))
    held = dict(np.load(work / "heldout.npz"))
    (fit, _), (guard, _) = hold_out((cal, "cal"))  # as a run splits its calibration data
    pm = PreparedModel.prepare(str(path), runtime="onnxruntime", input_shapes=shapes,
                               fed_inputs=tuple(cal))
    return path, shapes, fit, guard, held, pm


def one(name: str, work: Path) -> list[dict]:
    path, shapes, fit, guard, held, pm = prepared(name, work)
    stats = calibration.collect_statistics(pm.graph.full_model(), pm.candidate_tensors(), fit)
    bounds = calibration.reader_bounds(pm.graph)
    cut = calibration.clipped_by_readers(stats, bounds)
    recipe = ort_runtime.ort_recipe_start(pm, str(path), input_shapes=shapes,
                                    data={k: v[:4] for k, v in fit.items()})
    placements = {"every point": whole.all_on_start(pm), "recipe placement (ours)": recipe}
    ref_held, ref_guard = run_model(str(path), held), run_model(str(path), guard)
    rows = []
    for label, start in placements.items():
        uses = whole.scheme_uses(pm, start.schemes)
        for clip in (False, True):
            exporter = pm.exporter(scales(pm, stats, clip))
            plan = exporter.plan(uses)
            data = exporter.to_bytes(plan)
            e, g = errors(ref_held, run_model(data, held)), errors(ref_guard,
                                                                    run_model(data, guard))
            rows.append({"model": name, "placement": label,
                         "ranges": "cut at readers" if clip else "own statistics",
                         "qdq_tensors": len(plan.tensors),
                         "cut_tensors_quantized": len(set(cut) & set(plan.tensors)),
                         "held_out_cosine": e["cosine"],
                         "held_out_relative_l2": e["relative_l2"],
                         "guard_part_relative_l2": g["relative_l2"]})
            print(json.dumps(rows[-1]), flush=True)
    rows.append({"model": name, "placement": "(cut)", "tensors_cut": len(cut),
                 "by_reader": _by_reader(pm, cut, bounds, stats)})
    return rows


def _by_reader(pm: PreparedModel, cut: list[str], bounds: dict, stats: dict) -> dict:
    """Reader op -> tensors cut, with the widest observed range among them and the bound."""
    out: dict[str, dict] = {}
    for t in cut:
        ops = sorted({pm.graph.nodes[n].op_type for n, _ in pm.graph.consumers.get(t, [])})
        row = out.setdefault("+".join(ops), {"tensors": 0, "widest_observed": [0.0, 0.0],
                                             "bound": list(bounds[t])})
        row["tensors"] += 1
        s = stats[t]
        if s.max - s.min > row["widest_observed"][1] - row["widest_observed"][0]:
            row["widest_observed"] = [round(s.min, 3), round(s.max, 3)]
    return out


def leave_one_in(name: str, work: Path, top: int) -> dict:
    """Every point on with the cut: each quantized tensor alone (everything else float), its
    held-out error on the crops with text; the ``top`` worst, and all of them summed."""
    path, _, fit, _, held, pm = prepared(name, work)
    text = {k: v[0::2] for k, v in held.items()}  # photos.HELD_OUT: every other crop is text
    stats = calibration.collect_statistics(pm.graph.full_model(), pm.candidate_tensors(), fit)
    exporter = pm.exporter(scales(pm, stats, True))
    full = exporter.plan(whole.scheme_uses(pm, whole.all_on_start(pm).schemes))
    ref = run_model(str(path), text)
    by_tensor = {}
    everything = errors(ref, run_model(exporter.to_bytes(full), text))
    groups: dict[str, set] = {}
    for use in whole.scheme_uses(pm, whole.all_on_start(pm).schemes):
        groups.setdefault(use[0], set()).add(use)
    for i, (tensor, uses) in enumerate(groups.items()):
        e = errors(ref, run_model(exporter.to_bytes(exporter.plan(uses)), text))
        by_tensor[tensor] = {"relative_l2": e["relative_l2"], "cosine": e["cosine"],
                             "producer": pm.graph.producer_op(tensor),
                             "readers": sorted({pm.graph.nodes[n].op_type for n, _ in
                                                pm.graph.consumers.get(tensor, [])})}
        if i % 25 == 0:
            print(f"{i}/{len(groups)}", flush=True)
    worst = sorted(by_tensor.items(), key=lambda kv: -kv[1]["relative_l2"])
    squares = sum(v["relative_l2"] ** 2 for v in by_tensor.values())
    return {"model": name, "text_crops": int(len(next(iter(text.values())))),
            "every_point": everything, "tensors": len(by_tensor),
            "root_sum_of_squares": squares ** 0.5,
            "worst": [{"tensor": t, **v} for t, v in worst[:top]]}


def weight_bits(name: str, work: Path) -> list[dict]:
    """Every point on with the cut, its weights at 7 bits (ONNX Runtime's ``reduce_range``,
    what this project writes for a CPU without VNNI) and at 8 (a VNNI CPU, simulated), each run
    with ONNX Runtime's fused kernels (this machine's u8 x s8 arithmetic) and as written (the
    ONNX semantics, exact integer products: what a VNNI CPU computes); held-out errors, all
    crops and the text crops alone."""
    from qdq_optuna.machine import simulated_cpu

    path, _, fit, _, held, pm = prepared(name, work)
    text = {k: v[0::2] for k, v in held.items()}
    stats = calibration.collect_statistics(pm.graph.full_model(), pm.candidate_tensors(), fit)
    uses = whole.scheme_uses(pm, whole.all_on_start(pm).schemes)
    refs = {"all": run_model(str(path), held), "text": run_model(str(path), text)}
    rows = []
    for cpu in ("avx2", "vnni"):
        with simulated_cpu(cpu):
            exporter = pm.exporter(scales(pm, stats, True))
            data = exporter.to_bytes(exporter.plan(uses))
        for fused in (True, False):
            row = {"model": name, "weights": "7-bit" if cpu == "avx2" else "8-bit",
                   "run": "fused (this CPU)" if fused else "as written (exact)"}
            for part, feeds in (("all", held), ("text", text)):
                e = errors(refs[part], run_model(data, feeds, optimize=fused))
                row[f"{part}_cosine"], row[f"{part}_relative_l2"] = e["cosine"], e["relative_l2"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="ppocr-det")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--leave-one-in", help="a model: each tensor's own error on text crops")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--weight-bits", help="a model: 7- vs 8-bit weights, fused vs as written")
    args = ap.parse_args(argv)
    result: dict = {"rows": []}
    for name in [m for m in args.models.split(",") if m]:
        result["rows"] += one(name, args.out / name)
    if args.weight_bits:
        result["weight_bits"] = weight_bits(args.weight_bits, args.out / args.weight_bits)
    if args.leave_one_in:
        result["leave_one_in"] = leave_one_in(args.leave_one_in, args.out / args.leave_one_in,
                                              args.top)
        print(json.dumps(result["leave_one_in"], indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
