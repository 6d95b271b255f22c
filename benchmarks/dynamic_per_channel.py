"""Dynamic int8 MatMuls with one weight scale per tensor or one per output column: speed and
held-out accuracy, ONNX Runtime CPU, one thread.

Per model: ONNX Runtime's ``quantize_dynamic`` with the recipe's options
(``runtimes.onnxruntime.ort_dynamic_options``), once as it is (a weight scale per tensor) and
once with ``per_channel=True`` (what the search's dynamic mode writes,
``placement.dynamic.dynamic_node``); each file's output cosine vs FP32 over held-out inputs
(mean and minimum over samples) and the two files' latency ratio in interleaved rounds of
fresh sessions (per column / per tensor, geometric mean and 95 % interval).

    python benchmarks/dynamic_per_channel.py --models vit transformer ppocr-rec \\
        --json benchmarks/results/dynamic_per_channel.json \\
        --md benchmarks/results/dynamic_per_channel.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import real_models
from _common import markdown_table, report_rows
from onnxruntime.quantization import quantize_dynamic

from qdq_optuna.examples import zoo
from qdq_optuna.measure.timing import ratio_interval
from qdq_optuna.runtimes.onnxruntime import ort_dynamic_options


def model_and_inputs(name: str, work: Path, samples: int):
    if name == "vit":
        model = zoo.vit_like()
        path = work / "vit.onnx"
        onnx.save(model, str(path))
        return path, real_models.zoo_inputs(model, samples, 1)
    path, _, _, held, _ = real_models.benchmark_files(name, "full", samples, work / name)
    return Path(path), held


def session(path: Path) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def outputs(s: ort.InferenceSession, inputs: dict) -> np.ndarray:
    n = len(next(iter(inputs.values())))
    return np.stack([np.concatenate([o.ravel() for o in s.run(
        None, {k: v[i:i + 1] for k, v in inputs.items()})]) for i in range(n)])


def cosines(ref: np.ndarray, out: np.ndarray) -> list[float]:
    return [float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-12))
            for a, b in zip(ref.astype(np.float64), out.astype(np.float64))]


def measure(name: str, work: Path, samples: int, rounds: int, runs: int) -> dict:
    path, held = model_and_inputs(name, work, samples)
    files = {}
    for per_channel in (False, True):
        out = work / f"{name}_dynamic_{'column' if per_channel else 'tensor'}.onnx"
        quantize_dynamic(str(path), str(out), **{**ort_dynamic_options(),
                                                  "per_channel": per_channel})
        files[per_channel] = out
    ref = outputs(session(path), held)
    row: dict = {"model": name}
    for per_channel, f in files.items():
        cos = cosines(ref, outputs(session(f), held))
        row["column" if per_channel else "tensor"] = {"cosine_mean": statistics.fmean(cos),
                                                      "cosine_min": min(cos)}
    one = {k: v[:1] for k, v in held.items()}
    best: dict[bool, list[float]] = {False: [], True: []}
    for r in range(rounds):
        for per_channel in ((False, True) if r % 2 == 0 else (True, False)):
            s = session(files[per_channel])
            for _ in range(3):
                s.run(None, one)
            times = []
            for _ in range(runs):
                t = time.perf_counter()
                s.run(None, one)
                times.append(time.perf_counter() - t)
            best[per_channel].append(min(times) * 1e3)
    center, low, high = ratio_interval([c / t for c, t in zip(best[True], best[False])])
    row.update(tensor_ms=statistics.median(best[False]), column_ms=statistics.median(best[True]),
               column_vs_tensor=center, ci=[low, high])
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["vit", "transformer", "ppocr-rec"])
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--json")
    ap.add_argument("--md")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="dynamic-per-channel-") as tmp:
        for name in args.models:
            rows.append(measure(name, Path(tmp), args.samples, args.rounds, args.runs))
            print(json.dumps(rows[-1]), flush=True)
    header = ["model", "1 - cosine, scale per tensor (min cosine)", "1 - cosine, per column (min)",
              "latency ms per tensor / per column", "per column / per tensor (95 % CI)"]
    cells = [[r["model"], f"{1 - r['tensor']['cosine_mean']:.5f} ({r['tensor']['cosine_min']:.5f})",
              f"{1 - r['column']['cosine_mean']:.5f} ({r['column']['cosine_min']:.5f})",
              f"{r['tensor_ms']:.3f} / {r['column_ms']:.3f}",
              f"{r['column_vs_tensor']:.3f} ({r['ci'][0]:.3f}-{r['ci'][1]:.3f})"] for r in rows]
    report_rows(markdown_table(header, cells), rows, args.json, args.md)

if __name__ == "__main__":
    main()
