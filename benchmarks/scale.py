"""Does the model side scale to a 5000+ node graph?

Builds a deep, narrow transformer stack (``zoo.transformer_like``; 160 layers of hidden size 64
give ~5300 nodes) and measures, stage by stage, what ``PreparedModel.prepare`` and one search
trial cost:

* load (checks, shape inference), region discovery, pattern grouping (WL signatures plus the
  isomorphism check), insertion points of every pattern; target: regions + patterns <= 2 s;
* per-trial export (``QDQExporter.plan`` + ``to_bytes``) of trials as the search makes them:
  each pattern in order, a random scheme of the pattern on top of the schemes committed for the
  patterns before it; target: <= 50 ms;
* peak memory: the process's peak RSS growth over the whole pipeline (load from the .onnx
  file to the last export) and, in another process, the peak of Python allocations
  (tracemalloc), against the serialized model size; target: <= 2x the model size. Each in a
  process of its own (tracemalloc slows allocation-heavy code down several times and its
  bookkeeping inflates RSS, so the timings and the RSS are taken without it). Models whose
  weights reach ``QDQ_OPTUNA_FILE_EXPORT_BYTES`` (256 MiB) are exported to files, as in a
  tune run; the export time then includes writing the file.

    python benchmarks/scale.py                      # 160 layers, hidden 64
    python benchmarks/scale.py --layers 300 --json scale.json
    python benchmarks/scale.py --hidden 256 --heads 4 --ffn 1024   # ~480 MB of weights

Run it on an otherwise idle machine; never two benchmarks at once.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

from qdq_optuna import Config
from qdq_optuna.examples import zoo  # noqa: E402
from qdq_optuna.model.graph import load_model  # noqa: E402
from qdq_optuna.placement.export import QDQExporter, upgrade_for  # noqa: E402
from qdq_optuna.placement.patterns import PatternIndex  # noqa: E402
from qdq_optuna.placement.points import enumerate_points  # noqa: E402
from qdq_optuna.placement.regions import RegionConfig, discover_regions  # noqa: E402
from qdq_optuna.runtimes import profile_for  # noqa: E402

TARGET_ANALYSIS_S = 2.0
TARGET_EXPORT_MS = 50.0
TARGET_MEMORY_X = 2.0


def rss_kib(field: str = "VmRSS") -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def reset_peak_rss() -> None:
    """Start the peak RSS (VmHWM) over from the current RSS. (getrusage's ru_maxrss is no use
    in a child process: Linux carries the parent's over fork and exec.)"""
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def timed(fn, *args, **kwargs):
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t0


def pipeline(path: Path, runtime: str, trials: int, seed: int) -> dict:
    """load -> regions -> patterns -> points -> ``trials`` trial exports, timed by stage."""
    rules = profile_for(runtime).rules
    graph, t_load = timed(load_model, path)
    graph, t_upgrade = timed(upgrade_for, graph, [rules.default_quant_type])
    cfg = Config()  # the region sizes tune uses
    tree, t_regions = timed(discover_regions, graph, RegionConfig(
        cfg.maximum_sequence_region_size, cfg.minimum_topdown_search_size))
    index, t_patterns = timed(PatternIndex, graph, tree)
    t0 = time.perf_counter()
    points = [enumerate_points(graph, tree, index, p, rules) for p in index.patterns]
    t_points = time.perf_counter() - t0
    tunable = [pp for pp in points if pp.points]
    exporter, t_exporter = timed(QDQExporter, graph, rules, rules.default_quant_type)

    # trials as the search makes them: pattern by pattern, on top of earlier commits
    rng = random.Random(seed)
    base: set = set()
    samples: list[float] = []
    plan_ms: list[float] = []
    per_pattern = max(1, trials // max(1, len(tunable)))
    while len(samples) < trials:
        for pp in tunable:
            for _ in range(per_pattern):
                on = [p for p in pp.ids if rng.random() < 0.5]
                t0 = time.perf_counter()
                plan = exporter.plan(base | pp.uses(on))
                t1 = time.perf_counter()
                exporter._recent.clear()  # a new scheme: never the cached bytes
                data = None  # a trial's model is gone once the trial is (as in the search)
                data = exporter.source(plan)  # what the search hands a backend
                if not isinstance(data, bytes):  # a big model: the file is written now
                    data = Path(os.fspath(data))
                t2 = time.perf_counter()
                plan_ms.append((t1 - t0) * 1e3)
                samples.append((t2 - t0) * 1e3)
                assert data
            if rng.random() < 0.5:  # about half of the patterns commit their full scheme
                base |= pp.uses(pp.ids)
            if len(samples) >= trials:
                break
    samples.sort()
    return {
        "model": {"nodes": len(graph.nodes), "regions": len(tree.regions),
                  "patterns": len(index.patterns), "tunable_patterns": len(tunable),
                  "insertion_points": sum(len(pp.ids) for pp in tunable)},
        "seconds": {"load": t_load, "upgrade": t_upgrade, "regions": t_regions,
                    "patterns": t_patterns, "regions_plus_patterns": t_regions + t_patterns,
                    "points": t_points, "exporter_init": t_exporter},
        "export_ms": {"trials": len(samples), "p50": statistics.median(samples),
                      "p95": samples[int(0.95 * (len(samples) - 1))], "max": samples[-1],
                      "plan_p50": statistics.median(plan_ms),
                      "last_export_bytes": len(data) if isinstance(data, bytes)
                      else data.stat().st_size, "to_files": exporter.to_files},
    }


def memory(path: Path, runtime: str, trials: int, seed: int, traced: bool) -> dict:
    """Peak RSS growth of the pipeline since before the model was loaded (the libraries are
    imported and onnx's checker and shape inference warmed up on a tiny model first: their
    one-off tables are no part of the model's cost); or, ``traced``, the peak of Python
    allocations (tracemalloc's own bookkeeping inflates RSS, so never both at once)."""
    import onnx

    tiny = zoo.build("tiny_chain")
    onnx.checker.check_model(tiny)
    onnx.shape_inference.infer_shapes(tiny, strict_mode=True, data_prop=True)
    rss0 = rss_kib()
    reset_peak_rss()
    if traced:
        tracemalloc.start()
    pipeline(path, runtime, trials, seed)
    if traced:
        _, py_peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        return {"tracemalloc_peak_bytes": py_peak}
    return {"rss_peak_growth_bytes": (rss_kib("VmHWM") - rss0) * 1024}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=160)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=256)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--runtime", choices=["tensorrt", "onnxruntime"], default="tensorrt")
    ap.add_argument("--trials", type=int, default=300, help="trial exports to time")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--memory-of", help=argparse.SUPPRESS)  # the second process
    ap.add_argument("--traced", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.memory_of:
        print(json.dumps(memory(Path(args.memory_of), args.runtime, args.trials, args.seed,
                                args.traced)))
        return 0

    model = zoo.transformer_like(layers=args.layers, hidden=args.hidden, heads=args.heads,
                                 ffn=args.ffn, seq=args.seq, vocab=100)
    with tempfile.TemporaryDirectory(prefix="qdq-scale-") as tmp:
        path = Path(tmp) / "transformer.onnx"
        path.write_bytes(model.SerializeToString())
        model_bytes = path.stat().st_size
        del model
        result = pipeline(path, args.runtime, args.trials, args.seed)
        mem = {}
        for extra in ([], ["--traced"]):
            child = subprocess.run(
                [sys.executable, __file__, "--memory-of", str(path), "--runtime", args.runtime,
                 "--trials", str(args.trials), "--seed", str(args.seed), *extra],
                capture_output=True, text=True, check=True)
            mem.update(json.loads(child.stdout.strip().splitlines()[-1]))
    mem["tracemalloc_x_model"] = mem["tracemalloc_peak_bytes"] / model_bytes
    mem["rss_growth_x_model"] = mem["rss_peak_growth_bytes"] / model_bytes
    result["model"].update(layers=args.layers, hidden=args.hidden, serialized_bytes=model_bytes)
    result.update(
        machine={"python": platform.python_version(), "platform": platform.platform(),
                 "processor": platform.processor() or platform.machine()},
        runtime=args.runtime, memory=mem,
        targets={"regions_plus_patterns_s": TARGET_ANALYSIS_S, "export_ms": TARGET_EXPORT_MS,
                 "memory_x_model": TARGET_MEMORY_X},
    )
    s, e, m = result["seconds"], result["export_ms"], result["model"]
    result["met"] = {
        "regions_plus_patterns": s["regions_plus_patterns"] <= TARGET_ANALYSIS_S,
        "export": e["p95"] <= TARGET_EXPORT_MS,
        "memory": mem["rss_peak_growth_bytes"] <= TARGET_MEMORY_X * model_bytes,
    }
    print(f"transformer_like: {m['layers']} layers, hidden {m['hidden']}: {m['nodes']} nodes, "
          f"{model_bytes / 2**20:.1f} MiB, {m['regions']} regions, {m['patterns']} patterns "
          f"({m['tunable_patterns']} tunable, {m['insertion_points']} points); {args.runtime}")
    print(f"load {s['load']:.2f} s | regions {s['regions']:.2f} s + patterns "
          f"{s['patterns']:.2f} s = {s['regions_plus_patterns']:.2f} s (target <= "
          f"{TARGET_ANALYSIS_S} s) | points {s['points']:.2f} s | exporter init "
          f"{s['exporter_init']:.2f} s")
    print(f"per-trial export (plan + {'file' if e['to_files'] else 'bytes'}, {e['trials']} trials): p50 {e['p50']:.1f} ms, "
          f"p95 {e['p95']:.1f} ms, max {e['max']:.1f} ms (target <= {TARGET_EXPORT_MS} ms); "
          f"plan alone p50 {e['plan_p50']:.1f} ms")
    print(f"memory: tracemalloc peak {mem['tracemalloc_peak_bytes'] / 2**20:.1f} MiB "
          f"({mem['tracemalloc_x_model']:.2f}x model), peak RSS growth "
          f"{mem['rss_peak_growth_bytes'] / 2**20:.1f} MiB ({mem['rss_growth_x_model']:.2f}x) "
          f"(target <= {TARGET_MEMORY_X}x)")
    print("targets met:", ", ".join(f"{k}={v}" for k, v in result["met"].items()))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0 if all(result["met"].values()) else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
