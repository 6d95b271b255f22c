"""A text detector's 8-bit error crop by crop: where the FP32 map finds text, does the model
with every insertion point quantized still find it?

Per crop of ``photos.py``'s calibration set (the 4 the guard holds out marked) and its
held-out set: the FP32 map's text pixels (probability above ``--threshold``, DB's binarization
threshold in PaddleOCR), the quantized map's, their mask IoU, and cosine / relative L2 of the
maps. Optionally (``--bias-correction``) the same model after the guard's bias correction.
No timing: any machine's run reads the same but for its CPU's integer rules.

    python benchmarks/detector_crops.py --models ppocrv5-det,ppocr-det --out DIR [--json F]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import photos
import real_models

from qdq_optuna.measure.accuracy import hold_out, run_model
from qdq_optuna.model import calibration
from qdq_optuna.runtimes.prepared import PreparedModel

#: PaddleOCR's DB post-processing binarizes the probability map at 0.3
THRESHOLD = 0.3


def _crops(ref: np.ndarray, got: np.ndarray, threshold: float) -> list[dict]:
    rows = []
    for r, c in zip(ref.astype(np.float64), got.astype(np.float64)):
        a, b = r > threshold, c > threshold
        union = int(np.logical_or(a, b).sum())
        nr, nc = float(np.linalg.norm(r)), float(np.linalg.norm(c))
        rows.append({
            "fp32_text_px": int(a.sum()), "int8_text_px": int(b.sum()),
            "mask_iou": round(float(np.logical_and(a, b).sum() / union), 3) if union else None,
            "cosine": round(float((r.ravel() @ c.ravel()) / (nr * nc)), 3) if nr and nc else None,
            "relative_l2": round(float(np.linalg.norm(c - r) / nr), 3) if nr else None,
            "fp32_norm": round(nr, 4)})
    return rows


def one(name: str, out: Path, threshold: float, bias: bool) -> dict:
    path = photos.write(name, out / name)
    cal_all = dict(np.load(out / name / "calibration.npz"))
    held = dict(np.load(out / name / "heldout.npz"))
    (cal, _), (guard, guard_id) = hold_out((cal_all, "calibration"))
    n = min(len(a) for a in cal_all.values())
    guard_rows = [i for i in range(n)
                  if any(np.array_equal(cal_all[k][i], g) for k in cal_all for g in guard[k])]
    pm = PreparedModel.prepare(str(path), runtime="onnxruntime",
                               input_shapes=real_models.MODELS[name].input_shapes)
    stats = calibration.collect_statistics(pm.graph.full_model(), pm.candidate_tensors(), cal)
    exporter = pm.exporter(pm.run_scales(stats))
    every = exporter.plan(set().union(*(pp.uses(pp.ids) for pp in pm.tunable)))
    fp32 = exporter.to_bytes(exporter.plan(set()))
    models = {"every point": exporter.to_bytes(every)}
    if bias:
        from qdq_optuna.measure.bias import corrected_exports

        corrected, why = corrected_exports(exporter, (cal, "calibration"), fused=True)
        if corrected is not None:
            models["every point, bias-corrected"] = corrected.to_bytes(every)
    result = {"model": name, "threshold": threshold, "guard_crops": guard_rows, "sets": {}}
    for split, data in (("calibration", cal_all), ("held_out", held)):
        ref = next(iter(run_model(fp32, data).values()))
        result["sets"][split] = {
            label: _crops(ref, next(iter(run_model(blob, data).values())), threshold)
            for label, blob in models.items()}
    return result


def table(result: dict) -> str:
    lines = []
    for split, by_model in result["sets"].items():
        for label, rows in by_model.items():
            lines += [f"{result['model']}, {split}, {label}:", "",
                      "| crop | FP32 text px | 8-bit text px | mask IoU | cosine | rel. L2 |",
                      "|---|---|---|---|---|---|"]
            for i, r in enumerate(rows):
                mark = " (guard)" if split == "calibration" and i in result["guard_crops"] else ""
                lines.append(f"| {i}{mark} | {r['fp32_text_px']} | {r['int8_text_px']} | "
                             f"{r['mask_iou']} | {r['cosine']} | {r['relative_l2']} |")
            lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="ppocrv5-det")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--threshold", type=float, default=THRESHOLD)
    ap.add_argument("--bias-correction", action="store_true")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    results = [one(name, args.out, args.threshold, args.bias_correction)
               for name in args.models.split(",")]
    for r in results:
        print(table(r))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
