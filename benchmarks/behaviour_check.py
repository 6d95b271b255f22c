"""Behaviour check for refactors: the same ``tune`` (cost model, seed 0, default settings) on the
zoo models, and per model its final latency, measurement count per phase and the standing
placement's digest. Run it before and after a change and compare the two JSON files:

    python benchmarks/behaviour_check.py --out before.json
    python benchmarks/behaviour_check.py --out after.json --compare before.json

``--real NAME ...`` adds real third-party models of ``real_models.py`` (fetched into its cache
on first use), tuned with their ``--input-shapes`` and no data of their own, as the zoo is.
``--reports DIR`` keeps each run's report.json and report.md there (as ``MODEL-SAMPLER.*``), to
diff the two runs' reports too (their times and paths differ, nothing else should).

Deterministic (the cost model does not time anything), so any difference is a behaviour change.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path

import qdq_optuna
from qdq_optuna.examples import zoo

MODELS = ("resnet", "mobilenet", "yolo", "transformer")


def run(name: str, size: str, sampler: str, folder: Path, reports: Path | None = None) -> dict:
    """One ``tune`` of a zoo model (``size``) or, with ``size`` ``"real"``, of a real model."""
    t0 = time.monotonic()
    if size == "real":
        import real_models

        model, shapes = str(real_models.fetch(name)), real_models.MODELS[name].input_shapes
    else:
        model, shapes = zoo.build(name, size), None
    res = qdq_optuna.tune(model, folder, backend="costmodel", seed=0, input_shapes=shapes,
                          sampler=sampler, progress=False, fresh=True)
    r = res.report
    shipped = (folder / "optimized.onnx").read_bytes()
    if reports is not None:
        reports.mkdir(parents=True, exist_ok=True)
        for suffix in ("json", "md"):
            (reports / f"{name}-{size}-{sampler}.{suffix}").write_bytes(
                (folder / f"report.{suffix}").read_bytes())
    return {"model": f"{name}-{size}", "sampler": sampler, "final_ms": r["final_latency_ms"],
            "measurements": r["measurements"], "by_phase": r["measurements_by_phase"],
            "optimized_sha": hashlib.sha256(shipped).hexdigest()[:16],
            "wall_s": round(time.monotonic() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--sizes", nargs="+", default=["small", "medium"])
    ap.add_argument("--samplers", nargs="+", default=["qdq"])
    ap.add_argument("--real", nargs="*", default=[], metavar="NAME",
                    help="real models of real_models.py to tune too (e.g. mtcnn-rnet ppocr-cls)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--compare", type=Path, help="an earlier --out file: print what differs")
    ap.add_argument("--reports", type=Path, help="keep each run's report.json / report.md here")
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="qdq-behaviour-") as tmp:
        cases = [(n, s) for n in args.models for s in args.sizes] + [(n, "real") for n in args.real]
        for name, size in cases:
            for sampler in args.samplers:
                row = run(name, size, sampler, Path(tmp) / f"{name}-{size}-{sampler}",
                          args.reports)
                print(json.dumps(row), flush=True)
                rows.append(row)
    args.out.write_text(json.dumps(rows, indent=1) + "\n")
    if args.compare:
        before = {(r["model"], r["sampler"]): r for r in json.loads(args.compare.read_text())}
        print("| model | sampler | final ms before | after | measurements before | after | same model |")
        print("|---|---|---:|---:|---:|---:|---|")
        same = True
        for r in rows:
            b = before.get((r["model"], r["sampler"]))
            if b is None:
                continue
            eq = b["final_ms"] == r["final_ms"] and b["measurements"] == r["measurements"]
            same &= eq
            print(f"| {r['model']} | {r['sampler']} | {b['final_ms']:.6f} | {r['final_ms']:.6f} | "
                  f"{b['measurements']} | {r['measurements']} | "
                  f"{'yes' if b['optimized_sha'] == r['optimized_sha'] else 'no'} |")
        return 0 if same else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
