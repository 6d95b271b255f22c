"""Time to result: the same ``tune`` with and without the runtime's "what ran" pruning
(``Config.prune_by_runtime``), side by side per model: measurements, wall time, final latency,
visits skipped and why.

Cost model (deterministic, cheap): every zoo model at the given sizes. ONNX Runtime or
OpenVINO CPU: a real model from ``benchmarks/real_models.py`` (run under the bench lock; interleave A/B yourself by
running both arms in one invocation, as this script does).

    python benchmarks/time_to_result.py costmodel --sizes medium full --work DIR
    python benchmarks/time_to_result.py onnxruntime --real nudenet-320n \\
        --input-shapes images:1x3x320x320 --work DIR [--arms after] [--timeout S]

``--timeout`` is ``tune``'s own: a run cut short still finishes (final A/B, report) and its
row says ``complete: false``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from _common import load_now

import qdq_optuna
from qdq_optuna.config import Config
from qdq_optuna.examples import zoo

MODELS = ("resnet", "mobilenet", "yolo", "transformer")


def run_arm(model, work: Path, arm: str, backend: str, **kwargs) -> dict:
    cfg = Config(prune_by_runtime=arm == "after")
    load = load_now()
    t0 = time.monotonic()
    res = qdq_optuna.tune(model, work / arm, backend=backend, seed=0, config=cfg,
                          progress=False, fresh=True, **kwargs)
    wall = time.monotonic() - t0
    r = res.report
    return {"arm": arm, "wall_s": round(wall, 1), "measurements": r["measurements"],
            "by_phase": r["measurements_by_phase"], "final_ms": r["final_latency_ms"],
            "speedup": r["speedup"], "elapsed_s": r.get("elapsed_s"),
            "skipped": r.get("descent_skipped", []), "what_ran_reads": r.get("what_ran_reads"),
            "standalone": (r.get("what_ran") or {}).get("standalone"),
            "complete": r.get("complete", True), "measurer": r.get("measurer"),
            "load_1min": [load, load_now()]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("backend", choices=("costmodel", "onnxruntime", "openvino"))
    ap.add_argument("--sizes", nargs="+", default=["medium", "full"])
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--real", nargs="*", default=[])
    ap.add_argument("--input-shapes")
    ap.add_argument("--arms", nargs="+", default=["before", "after"])
    ap.add_argument("--work", required=True)
    ap.add_argument("--json")
    ap.add_argument("--timeout", type=float, help="tune's timeout per arm, in seconds")
    a = ap.parse_args()
    work = Path(a.work)
    jobs = []
    if a.real:
        from real_models import fetch

        jobs = [(name, str(fetch(name))) for name in a.real]
    else:
        jobs = [(f"{m} {s}", zoo.build(m, s)) for s in a.sizes for m in a.models]
    rows = []
    for label, model in jobs:
        for arm in a.arms:
            extra = {"input_shapes": a.input_shapes} if a.input_shapes else {}
            if a.timeout:
                extra["timeout"] = a.timeout
            row = {"model": label, "backend": a.backend,
                   **run_arm(model, work / label.replace(" ", "_"), arm, a.backend, **extra)}
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "skipped"}),
                  f"skipped={len(row['skipped'])}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
