"""The issue's table for a real model on real photos: ONNX Runtime's recipe file, every offered
point on, the recipe's placement (our export), each repaired start and what the run shipped,
each against FP32 in speed (interleaved, one thread, in this one run), with the error the run
claimed and the cosine on held-out photos the run never saw.

The model is tuned as a user tunes it (``python -m qdq_optuna tune``, ONNX Runtime CPU, one
thread, default mode, ``--timeout``), calibrated on 16 crops of ``photos.py``'s calibration
photos (the tool holds a quarter of them out for its guard); the starts are rebuilt from the
run folder (its calibration statistics and recipe file, the repair's returned groups in
report.json), each checked against the run's own claimed error. Held-out cosine: every output
over all 8 held-out crops concatenated (the worst output's), so crops with nothing to detect
do not decide it alone.

    python benchmarks/repair_table.py --models ppocr-det --timeout 300 --out /tmp/table
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import photos
import real_models

from qdq_optuna.measure.accuracy import hold_out, load_metric, run_model
from qdq_optuna.measure.repair import plan_groups
from qdq_optuna.model import calibration
from qdq_optuna.placement import starts as whole
from qdq_optuna.placement.export import plan_uses
from qdq_optuna.runtimes.prepared import PreparedModel


def tune(path: Path, out: Path, cal: Path, shapes: str | None, timeout: int,
         backend: str = "onnxruntime", more: tuple[str, ...] = ()) -> dict:
    extra = (["--input-shapes", shapes] if shapes else []) + list(more)
    start = time.time()
    proc = subprocess.run([sys.executable, "-m", "qdq_optuna", "tune", "--model", str(path),
                           "--output", str(out), "--backend", backend, "--runtime",
                           "onnxruntime", "--calibration-data", str(cal), "--threads", "1",
                           "--fresh", "--quiet", "--timeout", str(timeout), *extra],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{path.name}: tune failed: {proc.stderr.strip()[-400:]}")
    report = json.loads((out / "report.json").read_text())
    report["_seconds"] = round(time.time() - start, 1)
    return report


def rebuild(path: Path, out: Path, cal: dict, shapes: str | None, report: dict) -> dict:
    """Each start of the run as a model (bytes), from the run folder."""
    pm = PreparedModel.prepare(str(path), runtime="onnxruntime", input_shapes=shapes,
                               fed_inputs=tuple(cal))
    payload = json.loads((out / "calibration_stats.json").read_text())
    stats = calibration.load_statistics(out / "calibration_stats.json",
                                        fingerprint=payload["fingerprint"])
    exporter = pm.exporter(pm.run_scales(stats))
    recipe_file = out / "recipe_onnxruntime.onnx"
    bases = {"all": whole.all_on_start(pm)}
    if recipe_file.exists():
        bases["recipe:onnxruntime"] = whole.start_from_uses(
            pm, "recipe", whole.read_placement(pm, str(recipe_file))[0])
    # the tool's float: the graph the search works on (ONNX Runtime's preprocessing), no Q/DQ
    models = {"FP32": path.read_bytes(), "float (preprocessed)": exporter.to_bytes(
        exporter.plan(set()))}
    if recipe_file.exists():
        models["recipe file (ORT quantize_static)"] = recipe_file.read_bytes()
    for name, start in bases.items():
        plan = exporter.plan(whole.scheme_uses(pm, start.schemes))
        models["every point" if name == "all" else "recipe placement (ours)"] = \
            exporter.to_bytes(plan)
        row = next((s for s in report["starts"] if s["name"] == f"{name}-in-bound"), None)
        if row and row.get("repair"):
            gone = {g["group"] for g in row["repair"]["sensitivity"] if g["returned_to_float"]}
            kept = [u for g in plan_groups(pm.graph, plan) if g.name not in gone
                    for u in g.uses]
            # as the run places a start: its schemes and the uses they cannot express
            rep = whole.start_from_uses(pm, "repaired", kept)
            models[f"{name} repaired"] = exporter.to_bytes(exporter.plan(rep.uses))
            assert set(plan_uses(exporter.plan(rep.uses))) <= set(plan_uses(plan))
    models["shipped"] = (out / "optimized.onnx").read_bytes()
    return models


def errors(ref: dict, got: dict) -> dict:
    """Worst output's cosine and relative L2 over all samples concatenated."""
    cos, rel = 1.0, 0.0
    for name, r in ref.items():
        a, b = r.astype(np.float64).ravel(), got[name].astype(np.float64).ravel()
        na, nb = np.linalg.norm(a), np.linalg.norm(b)
        cos = min(cos, float(a @ b / (na * nb)) if na > 0 and nb > 0 else float(na == nb))
        rel = max(rel, float(np.linalg.norm(a - b) / max(na, 1e-12)))
    return {"cosine": cos, "relative_l2": rel}


def timings(models: dict, feed: dict, rounds: int, runs: int) -> dict:
    """Median over rounds of each round's fastest run, the models interleaved round by
    round (one intra-op thread, all optimizations); the first round is warm-up."""
    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads = 1, 1
    sessions = {k: ort.InferenceSession(v, opts, providers=["CPUExecutionProvider"])
                for k, v in models.items()}
    best: dict[str, list[float]] = {k: [] for k in models}
    for r in range(rounds + 1):
        for k, s in sessions.items():
            times = []
            for _ in range(runs):
                t = time.perf_counter()
                s.run(None, feed)
                times.append(time.perf_counter() - t)
            if r:
                best[k].append(min(times))
    return {k: float(np.median(v)) * 1e3 if v else float("nan") for k, v in best.items()}


def one(name: str, args) -> list[dict]:
    work = args.out / name
    path = photos.write(name, work)
    shapes = real_models.MODELS[name].input_shapes
    cal = dict(np.load(work / "calibration.npz"))
    held = dict(np.load(work / "heldout.npz"))
    more = tuple(shlex.split(args.tune_args))
    report = tune(path, work / "run", work / "calibration.npz", shapes, args.timeout,
                  "costmodel" if args.dry_run else "onnxruntime", more)
    metric = load_metric(more[more.index("--metric") + 1]) if "--metric" in more else None
    models = rebuild(path, work / "run", cal, shapes, report)
    part = hold_out((cal, "cal"))[1][0]  # the samples the run's guard scored
    ref_held, ref_part = run_model(str(path), held), run_model(str(path), part)
    first = {k: v[:1] for k, v in held.items()}
    ms = timings(models, first, 0 if args.dry_run else args.rounds, args.runs)
    starts = {s["name"]: s for s in report["starts"]}
    claimed = {"recipe placement (ours)": starts.get("recipe:onnxruntime", {}).get("error"),
               "every point": starts.get("all", {}).get("error"),
               "all repaired": starts.get("all-in-bound", {}).get("error"),
               "recipe:onnxruntime repaired":
                   starts.get("recipe:onnxruntime-in-bound", {}).get("error"),
               "shipped": report["accuracy"]["error"]}
    rows = []
    for k, data in models.items():
        own = errors(ref_part, run_model(data, part))["relative_l2"]
        got = run_model(data, held)
        e = errors(ref_held, got)
        rows.append({"model": name, "placement": k, "vs_fp32": ms["FP32"] / ms[k],
                     "ms": ms[k], "claimed_error": claimed.get(k), "error_on_guard_part": own,
                     "held_out_cosine": e["cosine"], "held_out_relative_l2": e["relative_l2"],
                     **({"held_out_metric": float(metric(ref_held, got))} if metric else {})})
    rows.append({"model": name, "placement": "(run)", "seconds": report["_seconds"],
                 "speedup_claimed": report.get("speedup"), "shipped": report["accuracy"][
                     "shipped"], "data": report["accuracy"]["data"],
                 "repairs": {s["name"]: {k: s["repair"][k] for k in (
                     "returned", "groups_total", "evaluations", "estimated_speed",
                     "exclude_nodes")} | {"returned_groups": [
                         g["group"] for g in s["repair"]["sensitivity"]
                         if g["returned_to_float"]]}
                     for s in report["starts"] if s.get("repair")},
                 "tune_args": list(more),
                 "noise_floor": report["accuracy"].get("input_noise_floor"),
                 "starts": [{k: s.get(k) for k in ("name", "speedup", "error", "feasible",
                                                   "chosen", "qdq", "repair_outcome")}
                            for s in report["starts"]]})
    return rows


def table(rows: list[dict]) -> str:
    metric = any("held_out_metric" in r for r in rows)
    out = ["| model | placement | vs FP32 | claimed error (guard's measure and data) | rel. L2 "
           "recomputed there | held-out cosine | held-out rel. L2 |"
           + (" held-out metric |" if metric else ""),
           "|---|---|---|---|---|---|---|" + ("---|" if metric else "")]
    for r in rows:
        if r["placement"] == "(run)":
            continue
        c = "-" if r["claimed_error"] is None else f"{r['claimed_error']:.4g}"
        out.append(f"| {r['model']} | {r['placement']} | {r['vs_fp32']:.3f}x | {c} | "
                   f"{r['error_on_guard_part']:.3f} | {r['held_out_cosine']:.3f} | "
                   f"{r['held_out_relative_l2']:.3f} |"
                   + (f" {r.get('held_out_metric', float('nan')):.4g} |" if metric else ""))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="ppocr-det")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--timeout", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--tune-args", default="",
                    help="more options for the tune command, e.g. \"--metric "
                         "benchmarks/det_metric.py:flips --max-metric-drop 0.002\" (the "
                         "metric is then also computed on the held-out photos)")
    ap.add_argument("--dry-run", action="store_true",
                    help="tune on the cost model, time nothing (checks this script quickly)")
    args = ap.parse_args(argv)
    rows = []
    for name in args.models.split(","):
        rows += one(name, args)
        print(table(rows), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
