"""Does a session loaded from ONNX Runtime's own optimized copy of a model run as fast as one
created from the model, and how much creation time does it save?

The ONNX Runtime backend (``backends.onnxruntime.OptimizedCopies``) loads a model from its
second load on from the optimized graph ONNX Runtime wrote for it, with every optimization
off. Here two backends time the same model file in interleaved rounds (ABBA, one thread), each
round a fresh session in each: ``plain`` (copies off: every session created from the model)
and ``copied`` (the backend as it runs, copies on). Per model: the median creation time of
each (the copied backend's from its third load on, the ones that read the copy), and the
latency ratio copied / plain (minimum of each session's runs; geometric mean and 95 %
interval over rounds).

    python benchmarks/optimized_copy.py FILE.onnx [FILE.onnx ...] --rounds 10 \\
        --json benchmarks/results/optimized_copy.json --md benchmarks/results/optimized_copy.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from _common import markdown_table, report_rows

from qdq_optuna.backends.onnxruntime import OnnxRuntimeBackend
from qdq_optuna.measure.timing import ratio_interval


def measure(path: Path, rounds: int, runs: int, warmup: int) -> dict:
    data = path.read_bytes()
    plain, copied = OnnxRuntimeBackend(), OnnxRuntimeBackend()
    plain.copies = None
    created: dict[str, list[float]] = {"plain": [], "copied": []}
    best: dict[str, list[float]] = {"plain": [], "copied": []}
    for r in range(rounds):
        order = [("plain", plain), ("copied", copied)]
        for name, backend in (order if r % 2 == 0 else order[::-1]):
            start = time.perf_counter()
            runner = backend.load(data)
            created[name].append(time.perf_counter() - start)
            best[name].append(min(runner.time(warmup, runs)))
            runner.close()
    ratios = [c / p for c, p in zip(best["copied"], best["plain"])]
    center, low, high = ratio_interval(ratios)
    label = f"{path.parent.name}/{path.name}" if path.name == "optimized.onnx" else path.name
    out = {"model": label, "size_mb": round(os.path.getsize(path) / 2**20, 1),
           "rounds": rounds, "runs": runs,
           "create_plain_s": statistics.median(created["plain"]),
           "create_copied_s": statistics.median(created["copied"][2:]),
           "loaded_from_copy": copied.copies.loaded_from_copy,
           "latency_plain_ms": statistics.median(best["plain"]),
           "latency_copied_ms": statistics.median(best["copied"]),
           "ratio": center, "ci": [low, high]}
    copied.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+", type=Path)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--runs", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json")
    ap.add_argument("--md")
    args = ap.parse_args()
    rows = []
    for path in args.models:
        row = measure(path, args.rounds, args.runs, args.warmup)
        rows.append(row)
        print(json.dumps(row), flush=True)
    header = ["model", "MB", "session created s (plain -> from the copy)",
              "latency ms (plain / copied)", "copied / plain (95 % CI)"]
    cells = [[r["model"], r["size_mb"], f"{r['create_plain_s']:.3f} -> {r['create_copied_s']:.3f}",
              f"{r['latency_plain_ms']:.3f} / {r['latency_copied_ms']:.3f}",
              f"{r['ratio']:.3f} ({r['ci'][0]:.3f}-{r['ci'][1]:.3f})"] for r in rows]
    report_rows(markdown_table(header, cells), rows, args.json, args.md)

if __name__ == "__main__":
    main()
