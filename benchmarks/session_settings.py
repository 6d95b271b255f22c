"""Does a runtime session setting change how fast a Q/DQ model runs? Measured, interleaved.

For each Q/DQ file (ONNX Runtime's recipe on a real model, made here with
``runtimes.onnxruntime.ort_recipe_model``, plus any ``--qdq`` files such as a run's
``optimized.onnx``) and each setting of the ONNX Runtime profile
(``runtimes.onnxruntime.SESSION_SETTINGS``): what ONNX Runtime runs with and without it
(the optimized graph's kernels, ``backends.onnxruntime_kernels``), the interleaved A/B of the
file with the setting against the file without it (the search's own protocol,
``measure.timing.Measurer.compare``, 1 thread), and ONNX Runtime's own profiler's time per
op type (median over runs) in both, for the op types whose kernels differ.

    flock /tmp/qdq_bench.lock python benchmarks/session_settings.py inception-v1-caffe2-light \\
        --json benchmarks/results/session_settings.json --md benchmarks/results/session_settings.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import _common
import numpy as np
import real_models  # noqa: E402

from qdq_optuna.backends import Configured
from qdq_optuna.backends.onnxruntime import OnnxRuntimeBackend
from qdq_optuna.backends.onnxruntime_kernels import kernels_of
from qdq_optuna.measure.timing import Measurer, TimingProtocol, Until
from qdq_optuna.runtimes.onnxruntime import SESSION_SETTINGS, ort_recipe_model


def op_times(path: str, shapes: dict, entries: tuple, runs: int) -> dict[str, float]:
    """ONNX Runtime's profiler: op type -> median over ``runs`` of its summed kernel time
    per inference (ms), 1 thread, with the session config ``entries`` (5 runs first, not
    counted)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    so.enable_profiling = True
    for key, value in entries:
        so.add_session_config_entry(key, value)
    with tempfile.TemporaryDirectory() as tmp:
        so.profile_file_prefix = os.path.join(tmp, "profile")
        session = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
        rng = np.random.default_rng(0)
        feed = {i.name: rng.standard_normal(shapes[i.name]).astype(np.float32)
                for i in session.get_inputs()}
        for _ in range(runs + 5):
            session.run(None, feed)
        events = json.loads(Path(session.end_profiling()).read_text())
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                   if e.get("cat") == "Session" and e.get("name") == "model_run")[5:]
    per_run = [defaultdict(float) for _ in spans]
    for e in events:
        if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time"):
            for i, (lo, hi) in enumerate(spans):
                if lo <= e["ts"] <= hi:
                    per_run[i][e["args"]["op_name"]] += e["dur"] / 1000.0
                    break
    ops = {op for run in per_run for op in run}
    return {op: statistics.median(run.get(op, 0.0) for run in per_run) for op in sorted(ops)}


def measure(path: str, shapes: dict, rounds: int, profile_runs: int) -> list[dict]:
    backend = OnnxRuntimeBackend(threads=1, input_shapes=shapes)
    protocol = TimingProtocol.robust().with_(max_rounds=rounds, final_sessions=rounds,
                                             process_warmup_rounds=3)
    measurer = Measurer(backend, protocol)
    out = []
    for settings in SESSION_SETTINGS:
        diff = kernels_of(path).diff(kernels_of(path, settings.entries))
        row = {"setting": settings.name, "entries": dict(settings.entries),
               "kernels_without_vs_with": {k: list(v) for k, v in diff.items()}}
        if diff:
            load = _common.load_avg()
            t0 = time.perf_counter()
            c = measurer.compare(Configured(path, settings), path, until=Until.PRECISION)
            row.update({"ratio_with_over_without": round(c.ratio, 4),
                        "ci": [round(c.ci_low, 4), round(c.ci_high, 4)], "rounds": c.rounds,
                        "without_ms": round(c.reference.score_ms, 3),
                        "with_ms": round(c.candidate.score_ms, 3),
                        "quiet": c.candidate.quiet, "load_avg_before": load,
                        "seconds": round(time.perf_counter() - t0, 1)})
            ops = {k.split(":")[-1] for k in diff} - {"ReorderInput", "ReorderOutput"}
            without = op_times(path, shapes, (), profile_runs)
            with_ = op_times(path, shapes, settings.entries, profile_runs)
            row["profiler_ms_per_run"] = {
                op: {"without": round(without.get(op, 0.0), 3),
                     "with": round(with_.get(op, 0.0), 3)}
                for op in sorted(ops | {"ReorderInput", "ReorderOutput"})}
        out.append(row)
    return out


def markdown(result: dict) -> str:
    lines = [f"# Session settings A/B: {result['model']}", "",
             f"Machine: {result['machine']}; ONNX Runtime {result['onnxruntime']}, 1 thread; "
             f"load average before {result['load_avg']}.", "",
             "Each Q/DQ file timed with the setting against without it: interleaved fresh "
             "sessions (the search's robust protocol, each session's minimum, paired ratio per "
             "round, 95 % interval). Per-op times: ONNX Runtime's profiler, median over runs.", ""]
    rows = []
    for f in result["files"]:
        for r in f["settings"]:
            if "ratio_with_over_without" not in r:
                rows.append([f["file"], r["setting"], "same kernels", "—", "—", "—"])
                continue
            prof = "; ".join(f"{op} {v['without']} -> {v['with']} ms"
                             for op, v in r["profiler_ms_per_run"].items()
                             if v["without"] or v["with"])
            rows.append([f["file"], r["setting"],
                         f"{r['without_ms']} -> {r['with_ms']} ms",
                         f"{r['ratio_with_over_without']} ({r['ci'][0]}–{r['ci'][1]}, "
                         f"{r['rounds']} rounds{'' if r['quiet'] else ', busy'})",
                         ", ".join(f"{k}: {v[0]} -> {v[1]}"
                                   for k, v in r["kernels_without_vs_with"].items()), prof])
    lines.append(_common.markdown_table(
        ["file", "setting", "latency without -> with", "with / without (95 % interval)",
         "kernels without -> with", "profiler per op"], rows))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    import onnxruntime as ort

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default="inception-v1-caffe2-light")
    ap.add_argument("--qdq", nargs="*", default=[], help="more Q/DQ files of that model")
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--profile-runs", type=int, default=30)
    ap.add_argument("--json")
    ap.add_argument("--md")
    args = ap.parse_args(argv)
    src = real_models.fetch(args.model)
    shapes = real_models.shapes_of(args.model)
    spec = ",".join(f"{k}:{'x'.join(map(str, v))}" for k, v in shapes.items())
    result = {"model": args.model, "machine": _common.machine(),
              "onnxruntime": ort.__version__, "load_avg": _common.load_avg(), "files": []}
    with tempfile.TemporaryDirectory() as tmp:
        recipe = ort_recipe_model(str(src), Path(tmp), input_shapes=spec)
        files = [("quantize_static recipe", str(recipe))] + [(Path(q).name, q) for q in args.qdq]
        for label, path in files:
            print(f"{label}: measuring", flush=True)
            result["files"].append({"file": label, "settings": measure(
                path, shapes, args.rounds, args.profile_runs)})
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    if args.md:
        Path(args.md).write_text(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
