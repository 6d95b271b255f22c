"""What a run spends outside its measurements: the same cost-model ``tune`` (the estimate is
instant, so the wall time is the run's own bookkeeping: storage commits, error evaluations,
the dashboard's pictures) with the bookkeeping of before and after a change, interleaved.

Arms:

* ``before``: every commit drawn at once (the dashboard's pictures and the run's note), SQLite
  with its default rollback journal (every commit synced);
* ``after``: the defaults (drawn at most every ``REDRAW_S``, write-ahead log).

    python benchmarks/run_overhead.py --work DIR [--models yolo:small resnet:small] [--reps 2]
        [--json F]

Each model runs ``before, after`` ``--reps`` times in turn, so a machine's load drifts over
both arms alike; the summary is the median wall time per arm and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import onnx
from _common import load_now

import qdq_optuna
from qdq_optuna.config import Config
from qdq_optuna.examples import zoo
from qdq_optuna.model.calibration import random_calibration_data
from qdq_optuna.outputs import dashboard
from qdq_optuna.record import storage

ARMS = ("before", "after")
_REDRAW_S = dashboard.REDRAW_S


def _arm(name: str) -> None:
    """Set the bookkeeping of arm ``name`` (module attributes the run reads when it opens)."""
    storage.SQLITE_WRITE_AHEAD = name == "after"
    dashboard.REDRAW_S = _REDRAW_S if name == "after" else 0.0


def _model(work: Path, spec: str) -> tuple[Path, Path, Path]:
    """The zoo model ``kind[:size]`` and random calibration (8) and validation (4) inputs."""
    kind, _, size = spec.partition(":")
    model = zoo.build(kind, size) if size else zoo.build(kind)
    path = work / f"{kind}_{size or 'default'}.onnx"
    onnx.save(model, str(path))
    files = []
    for part, samples, seed in (("cal", 8, 3), ("val", 4, 4)):
        files.append(work / f"{path.stem}_{part}.npz")
        np.savez(files[-1], **random_calibration_data(model, samples=samples, seed=seed))
    return path, files[0], files[1]


def run(spec: str, work: Path, arm: str, rep: int, backend: str, rules: str) -> dict:
    path, cal, val = _model(work, spec)
    _arm(arm)
    out = work / f"{path.stem}_{arm}_{rep}"
    load = load_now()
    t0 = time.monotonic()
    res = qdq_optuna.tune(str(path), str(out), backend=backend, runtime=rules,
                          calibration_data=str(cal), validation_data=str(val), seed=0,
                          config=Config(schemes_per_region=2, refine_rounds=0), timing="fast",
                          progress=False, fresh=True)
    wall = time.monotonic() - t0
    r = res.report
    return {"model": spec, "arm": arm, "rep": rep, "wall_s": round(wall, 2),
            "measurements": r["measurements"], "speedup": r["speedup"],
            "load_1min": [load, load_now()]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", required=True, type=Path)
    ap.add_argument("--models", nargs="+", default=["yolo:small", "resnet:small"])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--backend", default="costmodel")
    ap.add_argument("--runtime", default="tensorrt", help="the rules the cost model follows")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    rows = []
    try:
        for spec in args.models:
            for rep in range(args.reps):
                for arm in ARMS:
                    row = run(spec, args.work, arm, rep, args.backend, args.runtime)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    finally:
        _arm("after")
    summary = []
    for spec in args.models:
        med = {arm: statistics.median(r["wall_s"] for r in rows
                                      if r["model"] == spec and r["arm"] == arm) for arm in ARMS}
        speed = {arm: sorted({r["speedup"] for r in rows
                              if r["model"] == spec and r["arm"] == arm}) for arm in ARMS}
        summary.append({"model": spec, **{f"{a}_wall_s": med[a] for a in ARMS},
                        "after_over_before": round(med["after"] / med["before"], 3),
                        "speedups": speed})
    print("| model | before (s) | after (s) | after / before | speedup found (before; after) |")
    print("|---|---|---|---|---|")
    for s in summary:
        print(f"| {s['model']} | {s['before_wall_s']:.1f} | {s['after_wall_s']:.1f} | "
              f"{s['after_over_before']:.2f} | {s['speedups']['before']}; "
              f"{s['speedups']['after']} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
