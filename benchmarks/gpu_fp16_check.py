"""The shipped FP16 Q/DQ models (TensorRT rules' default) on the GPU runtimes at hand.

For each ``NAME=FP32.onnx,OPTIMIZED.onnx,INPUTS.npz`` triple: the FP32 model's outputs on the
inputs (ONNX Runtime CPU, the reference), then the shipped model on every GPU provider this
ONNX Runtime offers (CUDA; TensorRT when its libraries load) and on ONNX Runtime CPU with
graph optimizations off (how the run's guard scores it): loads or not, worst output's relative
L2 and cosine vs FP32, and the median of 20 timed runs. Also says what the machine has:
GPU, providers, whether the ``tensorrt`` module imports. Writes ``OUT/gpu_fp16_check.json``.

    python benchmarks/gpu_fp16_check.py --out /tmp/g ddddocr-det=fp32.onnx,optimized.onnx,in.npz
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from qdq_optuna.measure.accuracy import output_errors, summarize  # noqa: E402


def machine() -> dict:
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True)
        gpu = smi.stdout.strip() or smi.stderr.strip()[:200]
    except FileNotFoundError:
        gpu = "none (no nvidia-smi)"
    try:
        import tensorrt

        trt = tensorrt.__version__
    except Exception as exc:  # not installed, or its libraries do not load
        trt = f"unavailable ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})"
    return {"gpu": gpu, "onnxruntime": ort.__version__,
            "providers": ort.get_available_providers(), "tensorrt_module": trt}


def session(path: Path, provider: str, **config: str) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if provider == "CPU-as-written":
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        provider = "CPUExecutionProvider"
    for key, value in config.items():
        so.add_session_config_entry(key, value)
    return ort.InferenceSession(str(path), so, providers=[provider, "CPUExecutionProvider"])


def run_all(sess: ort.InferenceSession, feeds: list[dict]) -> dict:
    names = [o.name for o in sess.get_outputs()]
    outs = [dict(zip(names, sess.run(names, f))) for f in feeds]
    return {n: np.concatenate([np.asarray(o[n], np.float32) for o in outs]) for n in names}


def timed_ms(sess: ort.InferenceSession, feed: dict, runs: int = 20) -> float:
    for _ in range(5):
        sess.run(None, feed)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        sess.run(None, feed)
        times.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(times))


def check(name: str, fp32: Path, optimized: Path, inputs: Path, providers: list[str]) -> list:
    data = np.load(inputs)
    feeds = [{k: data[k][i:i + 1] for k in data.files} for i in range(len(data[data.files[0]]))]
    reference = run_all(session(fp32, "CPUExecutionProvider"), feeds)
    rows = []
    for provider in ["CPU-as-written", *providers]:
        row = {"model": name, "provider": provider}
        try:
            sess = session(optimized, provider)
            row["ran_on"] = sess.get_providers()[0]
            worst = summarize(output_errors(reference, run_all(sess, feeds)))
            row.update(relative_l2=worst["worst_relative_l2"], cosine=worst["worst_cosine"],
                       median_ms=timed_ms(sess, feeds[0]))
            if provider != "CPU-as-written":
                row["fp32_median_ms"] = timed_ms(session(fp32, provider), feeds[0])
        except Exception as exc:  # ONNX Runtime's own exception types
            row["error"] = str(exc).splitlines()[0][:300]
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="+", help="NAME=FP32.onnx,OPTIMIZED.onnx,INPUTS.npz")
    ap.add_argument("--out", default="gpu-fp16-check")
    args = ap.parse_args()
    facts = machine()
    print(json.dumps(facts), flush=True)
    gpu = [p for p in ("TensorrtExecutionProvider", "CUDAExecutionProvider")
           if p in facts["providers"]]
    rows = []
    for spec in args.models:
        name, paths = spec.split("=", 1)
        fp32, optimized, inputs = (Path(p) for p in paths.split(","))
        rows += check(name, fp32, optimized, inputs, gpu)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_fp16_check.json").write_text(json.dumps({"machine": facts, "rows": rows},
                                                        indent=1))


if __name__ == "__main__":
    main()
