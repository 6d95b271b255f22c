"""What a relative L2 output error costs in boxes and classes: evidence for the guard's default
bound (``qdq_optuna.measure.bound.DEFAULT_MAX_OUTPUT_ERROR``).

Real models of ``real_models.py`` that take pictures, calibrated on crops of real photographs
and scored on held-out photos (``photos.py``). For each, placements that span the range of
errors: every offered Q/DQ on (ONNX Runtime's rules, the run's default calibration), then the
same with more and more quantizer groups returned to float in the repair's order
(``qdq_optuna.measure.repair``: error alone per latency cost), and only the worst groups on.
Each placement runs in ONNX Runtime CPU with all optimizations (the fused integer kernels) on
the held-out photos; its worst output's relative L2 and cosine vs FP32 are set against what a
user of the model sees:

* a text detector (``ppocr-det``, a DB probability map): its text boxes (map > 0.3, connected
  regions of 16+ pixels) matched to FP32's at IoU >= 0.5: box F1;
* an object detector (``nudenet-320n``, YOLOv8): its detections (score >= 0.25, NMS at 0.45)
  matched to FP32's by class at IoU >= 0.5: box F1;
* a classifier (``ppocr-cls``, ``open-nsfw``, ...): top-1 agreement with FP32.

    python benchmarks/bound_evidence.py --json benchmarks/results/bound_evidence.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import photos
import real_models

from qdq_optuna.measure.accuracy import AccuracyEvaluator, output_errors, run_model, summarize
from qdq_optuna.measure.repair import latency_costs, measure_contributions, plan_groups
from qdq_optuna.placement.export import plan_uses

MODELS = ("ppocr-det", "nudenet-320n", "ppocr-cls")
BINS = (0.05, 0.1, 0.2, 0.3, 0.5, 1.0, float("inf"))


# -- what a user sees ---------------------------------------------------------------------------
def _iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU of every box of ``a`` with every box of ``b`` (x0, y0, x1, y1)."""
    x0 = np.maximum(a[:, None, 0], b[None, :, 0])
    y0 = np.maximum(a[:, None, 1], b[None, :, 1])
    x1 = np.minimum(a[:, None, 2], b[None, :, 2])
    y1 = np.minimum(a[:, None, 3], b[None, :, 3])
    inter = np.clip(x1 - x0, 0, None) * np.clip(y1 - y0, 0, None)
    area = lambda z: (z[:, 2] - z[:, 0]) * (z[:, 3] - z[:, 1])  # noqa: E731
    return inter / np.maximum(area(a)[:, None] + area(b)[None, :] - inter, 1e-9)


def box_f1(ref: np.ndarray, got: np.ndarray, ref_cls=None, got_cls=None) -> float:
    """F1 of ``got``'s boxes against ``ref``'s (greedy matching at IoU >= 0.5, same class)."""
    if len(ref) == 0 and len(got) == 0:
        return 1.0
    if len(ref) == 0 or len(got) == 0:
        return 0.0
    iou = _iou(ref, got)
    if ref_cls is not None:
        iou = np.where(ref_cls[:, None] == got_cls[None, :], iou, 0.0)
    matched, used = 0, set()
    for i in np.argsort(-iou.max(axis=1)):
        j = int(np.argmax(np.where([k in used for k in range(len(got))], -1, iou[i])))
        if iou[i, j] >= 0.5 and j not in used:
            matched += 1
            used.add(j)
    return 2 * matched / (len(ref) + len(got))


def text_boxes(prob: np.ndarray) -> np.ndarray:
    """A DB text detector's boxes: connected regions of ``prob > 0.3`` of 16+ pixels."""
    from scipy import ndimage

    labels, _ = ndimage.label(prob > 0.3)
    boxes = []
    for k, sl in enumerate(ndimage.find_objects(labels), start=1):
        if sl is not None and (labels[sl] == k).sum() >= 16:
            boxes.append([sl[1].start, sl[0].start, sl[1].stop, sl[0].stop])
    return np.array(boxes, dtype=np.float32).reshape(-1, 4)


def yolo_detections(out: np.ndarray, conf: float = 0.25, nms: float = 0.45):
    """YOLOv8's (4 + classes) x anchors output -> boxes, classes after per-class NMS."""
    scores = out[4:]
    cls, score = scores.argmax(axis=0), scores.max(axis=0)
    keep = score >= conf
    cx, cy, w, h = out[:4, keep]
    boxes = np.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], axis=1)
    cls, score = cls[keep], score[keep]
    chosen = []
    for i in np.argsort(-score):
        if all(cls[j] != cls[i] or _iou(boxes[i:i + 1], boxes[j:j + 1])[0, 0] < nms
               for j in chosen):
            chosen.append(i)
    return boxes[chosen].reshape(-1, 4), cls[chosen]


def task_score(kind: str, ref: dict, got: dict) -> float:
    """Mean over samples of box F1 (detectors) or top-1 agreement (classifiers) vs FP32."""
    name = next(iter(ref))
    r, g = ref[name], got[name]
    if kind == "page":
        return float(np.mean([box_f1(text_boxes(r[i, 0]), text_boxes(g[i, 0]))
                              for i in range(len(r))]))
    if kind == "scene01":
        return float(np.mean([_yolo_f1(r[i], g[i]) for i in range(len(r))]))
    flat = lambda x: x.reshape(len(x), -1)  # noqa: E731
    return float(np.mean(flat(r).argmax(axis=1) == flat(g).argmax(axis=1)))


def _yolo_f1(r: np.ndarray, g: np.ndarray) -> float:
    rb, rc = yolo_detections(r)
    gb, gc = yolo_detections(g)
    return box_f1(rb, gb, rc, gc)


# -- placements across the range of errors -------------------------------------------------------
def placements(name: str, folder: Path, rank_evaluations: int,
               held_out: int) -> tuple[list, dict, str, str]:
    """(label, model bytes, Q/DQ count) rows, the held-out inputs, the input kind, the
    model's path."""
    cal, held, pm, exporter, full, path = photos.every_point(name, folder, held_out)
    few = {k: v[:4] for k, v in cal.items()}
    ranker = AccuracyEvaluator(exporter.to_bytes(exporter.plan(set())), few)
    groups = plan_groups(exporter.graph, full)
    latency_costs(exporter.graph, full, groups)
    spent = []

    def err(plan):
        spent.append(1)
        return ranker.evaluate(exporter.to_bytes(plan))[0]

    measure_contributions(exporter, groups, err, 0.5,
                          budget=lambda: len(spent) < rank_evaluations)
    groups.sort(key=lambda g: (-g.score, g.cost, g.name))
    out = [("every point on", full)]
    k = 1
    while k < len(groups):
        gone = {u for g in groups[:k] for u in g.uses}
        out.append((f"top {k} groups float",
                    exporter.plan({u: q for u, q in plan_uses(full).items() if u not in gone})))
        k *= 2
    for k in (1, 2, 4, 8):
        only = {u: q for g in groups[:k] for u, q in g.uses.items()}
        out.append((f"only top {k} groups on", exporter.plan(only)))
    out.append(("float", exporter.plan(set())))
    return [(label, exporter.to_bytes(p), len(p)) for label, p in out], held, \
        real_models.MODELS[name].inputs, str(path)


def measure(name: str, folder: Path, rank_evaluations: int, held_out: int) -> list[dict]:
    plans, held, kind, path = placements(name, folder, rank_evaluations, held_out)
    ref = run_model(path, held, optimize=True)
    rows = []
    for label, data, qdq in plans:
        got = run_model(data, held, optimize=True)
        worst = summarize(output_errors(ref, got))
        rows.append({"model": name, "placement": label, "qdq_tensors": qdq,
                     "relative_l2": worst["worst_relative_l2"],
                     "cosine": worst["worst_cosine"], "task": task_score(kind, ref, got),
                     "task_measure": {"page": "text-box F1 vs FP32",
                                      "scene01": "detection F1 vs FP32"}.get(
                                          kind, "top-1 agreement with FP32")})
        print(f"{name:<14} {label:<24} rel L2 {rows[-1]['relative_l2']:.3f} cos "
              f"{rows[-1]['cosine']:.3f} task {rows[-1]['task']:.3f}", flush=True)
    return rows


def summary(rows: list[dict]) -> list[str]:
    """Task agreement by relative L2 bin, per model (markdown)."""
    lines = ["| model | task measure | " + " | ".join(
        f"rel L2 <= {b:g}" for b in BINS[:-1]) + " | > 1 |", "|---|---|" + "---|" * len(BINS)]
    for name in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == name]
        cells, lo = [], 0.0
        for hi in BINS:
            inside = [r["task"] for r in mine if lo < r["relative_l2"] <= hi
                      or (lo == 0 and r["relative_l2"] == 0)]
            cells.append(f"{min(inside):.2f} (n={len(inside)})" if inside else "-")
            lo = hi
        lines.append(f"| {name} | worst {mine[0]['task_measure']} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--out", default="runs/bound_evidence", help="work folder")
    ap.add_argument("--rank-evaluations", type=int, default=24)
    ap.add_argument("--held-out", default="ppocr-det:8,nudenet-320n:16,ppocr-cls:48",
                    help="held-out photos per model (MODEL:N,...; 8 for others)")
    ap.add_argument("--json", help="write the rows and the summary here")
    args = ap.parse_args(argv)
    start, rows = time.time(), []
    held = {k: int(v) for k, v in (x.split(":") for x in args.held_out.split(","))}
    for name in args.models.split(","):
        rows += measure(name, Path(args.out) / name, args.rank_evaluations, held.get(name, 8))
    table = summary(rows)
    print("\n".join(table))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(
            {"rows": rows, "summary": table, "seconds": round(time.time() - start)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
