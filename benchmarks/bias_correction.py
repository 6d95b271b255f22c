"""Bias correction on real models and real photos: held-out cosine and relative L2 against FP32
of each placement before and after folding the quantized layers' mean shift into their biases
(``qdq_optuna.measure.bias``), in each way of measuring the shift, and the speed of the corrected
file against the uncorrected one (interleaved, one thread, in one run).

Placements, built from one calibration (``photos.py``: 16 calibration crops, 8 held out; no
tuning): every offered point on, and ONNX Runtime's recipe placement exported by us. The
correction is measured on the 16 calibration crops; the held-out crops never reach it.

    python benchmarks/bias_correction.py --models ppocr-det,ppocr-cls --out /tmp/bc --json x.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import photos
import real_models
from repair_table import errors, timings

from qdq_optuna.measure.accuracy import run_model
from qdq_optuna.measure.bias import FloatMeans, correct_biases
from qdq_optuna.placement import starts as whole
from qdq_optuna.runtimes import onnxruntime as ort_runtime


def placements(name: str, folder: Path):
    """(calibration, held out, FP32 path, float proto, {placement: Q/DQ bytes})."""
    cal, held, pm, exporter, plan_all, path = photos.every_point(name, folder)
    shapes = real_models.MODELS[name].input_shapes
    recipe = ort_runtime.ort_recipe_start(pm, str(path), data=cal, input_shapes=shapes)
    plans = {"every point": plan_all,
             "recipe placement (ours)": exporter.plan(whole.scheme_uses(pm, recipe.schemes))}
    return cal, held, path, pm.graph.full_model(), {
        k: exporter.to_bytes(p) for k, p in plans.items()}


def speed(name: str, args) -> list[dict]:
    """The timing alone, of the files an accuracy run saved: FP32, each placement as exported
    and as corrected (the first mode), interleaved in this one process."""
    folder = args.out / name
    held = dict(np.load(folder / "heldout.npz"))
    timed = {"FP32": real_models.fetch(name, None).read_bytes()}
    for f in sorted(folder.glob("model__*.onnx")):
        label = f.stem.removeprefix("model__").replace("__", ", ")
        timed[label] = f.read_bytes()
    first = {k: v[:1] for k, v in held.items()}
    ms = timings(timed, first, args.rounds, args.runs)
    row = {"model": name, "placement": "(speed)", "ms": ms,
           "vs_fp32": {k: ms["FP32"] / v for k, v in ms.items()}}
    print(json.dumps(row), flush=True)
    return [row]


def one(name: str, args) -> list[dict]:
    if args.time_only:
        return speed(name, args)
    cal, held, path, float_proto, models = placements(name, args.out / name)
    ref_held = run_model(str(path), held)
    ref_cal = run_model(str(path), cal)
    t = time.perf_counter()
    fmeans = FloatMeans(float_proto, cal)
    fmeans.means()
    float_seconds = time.perf_counter() - t
    rows, timed = [], {"FP32": path.read_bytes()}
    for placement, data in models.items():
        proto = onnx.load_from_string(data)
        variants = {"none": (data, None, 0.0)}
        for mode in args.modes:
            t = time.perf_counter()
            res = correct_biases(proto, fmeans, cal, mode=mode.removesuffix("+fused"),
                                 optimize=mode.endswith("+fused"))
            variants[mode] = (res.model.SerializeToString(), res, time.perf_counter() - t)
        for mode, (blob, res, seconds) in variants.items():
            e = errors(ref_held, run_model(blob, held))
            e_plain = errors(ref_held, run_model(blob, held, optimize=False))
            c = errors(ref_cal, run_model(blob, cal))
            rows.append({
                "model": name, "placement": placement, "correction": mode,
                "layers_corrected": len(res.layers) if res else 0,
                "layers_skipped": len(res.skipped) if res else 0,
                "mean_abs_shift": res.mean_abs_shift if res else 0.0,
                "seconds": round(seconds, 2), "float_means_seconds": round(float_seconds, 2),
                "held_out_cosine": e["cosine"], "held_out_relative_l2": e["relative_l2"],
                "held_out_cosine_onnx_semantics": e_plain["cosine"],
                "held_out_relative_l2_onnx_semantics": e_plain["relative_l2"],
                "calibration_relative_l2": c["relative_l2"]})
            print(json.dumps(rows[-1]), flush=True)
        timed[f"{placement}"] = data
        timed[f"{placement}, corrected"] = variants[args.modes[0]][0]
        for label, blob in ((placement, data),
                            (f"{placement}__{args.modes[0]}", variants[args.modes[0]][0])):
            (args.out / name / f"model__{label.replace(' ', '_')}.onnx").write_bytes(blob)
    if args.rounds:
        first = {k: v[:1] for k, v in held.items()}
        ms = timings(timed, first, args.rounds, args.runs)
        rows.append({"model": name, "placement": "(speed)", "ms": ms,
                     "vs_fp32": {k: ms["FP32"] / v for k, v in ms.items()}})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def table(rows: list[dict]) -> str:
    out = ["| model | placement | correction | layers | held-out cosine | held-out rel. L2 | "
           "same, ONNX semantics (cos / rel. L2) | calibration rel. L2 | seconds |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["placement"] == "(speed)" or "correction" not in r:
            continue
        out.append(f"| {r['model']} | {r['placement']} | {r['correction']} | "
                   f"{r['layers_corrected']} | {r['held_out_cosine']:.4f} | "
                   f"{r['held_out_relative_l2']:.3f} | "
                   f"{r['held_out_cosine_onnx_semantics']:.4f} / "
                   f"{r['held_out_relative_l2_onnx_semantics']:.3f} | "
                   f"{r['calibration_relative_l2']:.3f} | {r['seconds']:.1f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="ppocr-det")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--modes", default="sequential,sequential+fused,isolated,joint",
                    help="correction modes to compare (MODE+fused: the Q/DQ model measured "
                         "with ONNX Runtime's fusions); the first is the one timed")
    ap.add_argument("--rounds", type=int, default=0, help="timing rounds (0: no timing)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--time-only", action="store_true",
                    help="time the files an earlier run of this script saved in --out")
    args = ap.parse_args(argv)
    args.modes = args.modes.split(",")
    rows = []
    for name in args.models.split(","):
        rows += one(name, args)
        print(table(rows), flush=True)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
