"""How many builds does the plan-key cache save on a default run (30 schemes per pattern)?

Identical models are measured once per run: a trial whose exported model (plan key) was
measured before - the pattern's reference, a scheme that resolves to the same tensors as
another, a model an earlier pattern already built - takes the stored figure. This script runs
``qdq_optuna.tune`` in default mode and counts, from the run's storage:

* trials (finished), and of those *measured* (the backend built and timed the model) and
  *cache hits* (no build), split into hits on the pattern's reference and other hits;
* ``measurements`` (every time the backend was asked to time a model, references, commit
  confirmations and the final comparison included) and the measurer's session/engine loads.

The ``costmodel`` backend is deterministic and needs no GPU, so its figures are exact and
reproducible; ``--ort MODEL`` adds one ONNX Runtime run (robust timing, isolated worker).

    python benchmarks/cache_savings.py
    python benchmarks/cache_savings.py --models resnet:full yolo:medium --ort resnet:medium

The ORT run waits until the 1-minute load average is below 1.2 (polling every 10 s, up to
20 min) and records the load before and after; never run two benchmarks at once.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from _common import load_now, markdown_table, wait_quiet


def count(out: Path) -> dict:
    """Trials, measured trials and cache hits of a finished run, from its storage."""
    import optuna
    from optuna.trial import TrialState

    from qdq_optuna.record import open_storage, trial_measurement

    storage = open_storage(f"sqlite:///{out / 'studies.db'}", heartbeat=False)
    c = {"patterns": 0, "trials": 0, "measured": 0, "cache_hits": 0,
         "hits_on_reference": 0, "hits_other": 0, "failed_or_pruned": 0}
    for s in storage.get_all_studies():
        if s.study_name.endswith("/_run") or "/" not in s.study_name:
            continue  # the run's bookkeeping and its overview
        c["patterns"] += 1
        study = optuna.load_study(study_name=s.study_name, storage=storage)
        for t in study.get_trials(deepcopy=False):
            if t.state != TrialState.COMPLETE:
                c["failed_or_pruned"] += 1
                continue
            c["trials"] += 1
            m = trial_measurement(t)
            if m is not None and m.cached:
                c["cache_hits"] += 1
                c["hits_on_reference" if m.reference else "hits_other"] += 1
            else:
                c["measured"] += 1
    return c


def run(model_name: str, size: str, backend: str, work: Path, sampler: str = "qdq",
        **options) -> dict:
    import onnx

    from qdq_optuna import Config, tune
    from qdq_optuna.examples import zoo

    path = work / f"{model_name}-{size}.onnx"
    onnx.save(zoo.build(model_name, size), str(path))
    out = work / f"{model_name}-{size}-{backend}-{sampler}"
    t0 = time.monotonic()
    result = tune(path, out, benchmark=backend, config=Config.preset("default"), progress=False,
                  sampler=sampler, fresh=True, **options)
    wall = time.monotonic() - t0
    r = result.report
    c = count(out)
    row = {"model": f"{model_name} ({size})", "backend": backend, "sampler": sampler, **c,
           "measurements": r["measurements"], "builds_saved_by_cache": r["builds_saved_by_cache"],
           "loads": r["measurer"]["loads"], "speedup": r["speedup"], "wall_s": round(wall, 1),
           "search_statistics": r.get("search_statistics")}
    row["saved_pct"] = 100.0 * c["cache_hits"] / c["trials"] if c["trials"] else 0.0
    return row


def table(rows: list[dict]) -> str:
    header = ["model", "backend", "sampler", "patterns", "trials", "measured",
              "cache hits (reference + other)", "builds saved", "measurements", "loads", "run"]
    return markdown_table(header, [
        [r["model"], r["backend"], r["sampler"], r["patterns"], r["trials"], r["measured"],
         f"{r['cache_hits']} ({r['hits_on_reference']} + {r['hits_other']})",
         f"{r['saved_pct']:.0f} %", r["measurements"], r["loads"], f"{r['wall_s']} s"]
        for r in rows])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="*", metavar="NAME:SIZE[:SAMPLER]",
                    default=["resnet:medium", "mobilenet:medium", "transformer:medium",
                             "yolo:medium", "resnet:full", "resnet:medium:tpe",
                             "transformer:medium:tpe"],
                    help="costmodel runs; SAMPLER defaults to qdq (ours, never proposes a "
                         "model twice), tpe shows what the cache saves for a sampler that does")
    ap.add_argument("--ort", metavar="NAME:SIZE", help="also one ONNX Runtime run (robust)")
    ap.add_argument("--max-load", type=float, default=1.2)
    ap.add_argument("--out", help="folder for the runs (default: a temporary one)")
    ap.add_argument("--json", default="cache_savings.json")
    args = ap.parse_args()
    import onnxruntime
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    work = Path(args.out or tempfile.mkdtemp(prefix="qdq-cache-"))
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for spec in args.models:
        name, size, sampler = (spec.split(":") + ["medium", "qdq"])[:3]
        rows.append(run(name, size, "costmodel", work, sampler=sampler))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    if args.ort:
        name, _, size = args.ort.partition(":")
        gate = wait_quiet(args.max_load)
        row = run(name, size or "medium", "onnxruntime", work)
        row["load"] = {**gate, "load_after": load_now()}
        rows.append(row)
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(table(rows))
    result = {"machine": platform.machine(), "cpus": os.cpu_count(),
              "onnxruntime": onnxruntime.__version__, "command": " ".join(sys.argv),
              "schemes_per_region": 30, "rows": rows}
    Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
