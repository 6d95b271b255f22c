"""Latency of the FP32, high-precision (FP16/BF16), all-quantized and tuned model on a GPU backend.

For each model: ``qdq-optuna example NAME --size SIZE``; with ``--high-precision fp16|bf16``
its float part converted (``PreparedModel.prepare(..., high_precision=)``: the deployed
baseline, no Q/DQ); the all-quantized model (every insertion point of every pattern on, the
backend's rules, exported into the converted graph); ``qdq-optuna tune --backend B``; then one
interleaved A/B comparison (the library's robust protocol, fresh engines/sessions per round)
of the high-precision model against FP32, and of the all-quantized and the tuned model against
the high-precision baseline, on the same backend. Prints a Markdown table and writes
``OUT/gpu_figures.json``.

    python benchmarks/gpu_figures.py --backend tensorrt --high-precision fp16 --out /tmp/g
    python benchmarks/gpu_figures.py --backend ort-cuda --high-precision fp16 --out /tmp/g

``--backend onnxruntime`` runs the same script on the CPU (a dry run of the script itself).
TensorRT builds strongly typed networks: the FP32 model runs FP32 (TF32), so INT8 must be
compared with the FP16 baseline users deploy. ``--skip-tune`` leaves the tuned row out; the
tuned run gets ``--high-precision`` only when the CLI has that option.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

from qdq_optuna import PreparedModel  # noqa: E402
from qdq_optuna.backends import make_backend, runtime_for_backend  # noqa: E402
from qdq_optuna.examples import zoo  # noqa: E402
from qdq_optuna.measure.timing import Measurer, TimingProtocol  # noqa: E402


def baseline_and_all_quantized(model_path: Path, runtime: str,
                               high_precision: str) -> tuple[bytes, bytes]:
    """The float model at ``high_precision`` (no Q/DQ) and every point quantized in it."""
    pm = PreparedModel.prepare(str(model_path), runtime=runtime, high_precision=high_precision)
    exporter = pm.exporter()
    uses = []
    for pp in pm.tunable:
        uses.extend(pp.uses(pp.ids))
    return exporter.to_bytes(exporter.plan(set())), exporter.to_bytes(exporter.plan(uses))


def tune(model: Path, out: Path, backend: str, mode: str, high_precision: str) -> dict:
    t0 = time.monotonic()
    cmd = [sys.executable, "-m", "qdq_optuna", "tune", "--model", str(model), "--output",
           str(out), "--backend", backend, "--mode", mode, "--fresh", "-q"]
    help_text = subprocess.run([sys.executable, "-m", "qdq_optuna", "tune", "-h"],
                               capture_output=True, text=True).stdout
    if high_precision != "fp32" and "--high-precision" in help_text:
        cmd += ["--high-precision", high_precision]
    elif high_precision != "fp32":
        print(f"note: this CLI has no --high-precision; the tuned model of {model.name} is "
              "searched on FP32", file=sys.stderr)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"tune failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    report = json.loads((out / "report.json").read_text())
    report["_wall_s"] = round(time.monotonic() - t0, 1)
    return report


def compare(measurer: Measurer, candidate: bytes, reference: bytes) -> dict:
    c = measurer.compare(candidate, reference, until="precision")
    return {"ratio": round(c.ratio, 4), "ci": [round(c.ci_low, 4), round(c.ci_high, 4)],
            "candidate_ms": round(c.candidate.score_ms, 4),
            "reference_ms": round(c.reference.score_ms, 4), "rounds": c.rounds}


def run_model(name: str, args, backend) -> dict:
    out = Path(args.out) / name
    out.mkdir(parents=True, exist_ok=True)
    model_path = out / "model.onnx"
    model_path.write_bytes(zoo.build(name, args.size).SerializeToString())
    runtime = runtime_for_backend(args.backend)
    fp32_bytes = model_path.read_bytes()
    base, allq = baseline_and_all_quantized(model_path, runtime, args.high_precision)
    (out / f"baseline_{args.high_precision}.onnx").write_bytes(base)
    (out / "all_quantized.onnx").write_bytes(allq)
    measurer = Measurer(backend, TimingProtocol.robust())
    row = {
        "model": name, "size": args.size, "backend": args.backend, "runtime": runtime,
        "high_precision": args.high_precision,
        "high_precision_vs_fp32": compare(measurer, base, fp32_bytes),
        "all_quantized": compare(measurer, allq, base),
    }
    cells = [f"{row['high_precision_vs_fp32']['reference_ms']:.4f} ms", _cell(
        row["high_precision_vs_fp32"]), _cell(row["all_quantized"])]
    if not args.skip_tune:
        report = tune(model_path, out / "tuned", args.backend, args.mode, args.high_precision)
        tuned = (out / "tuned" / "optimized.onnx").read_bytes()
        row.update({
            "tuned": compare(measurer, tuned, base),
            "report_speedup": report.get("speedup"), "report_ci": report.get("speedup_ci"),
            "tune_wall_s": report["_wall_s"], "measurements": report.get("measurements"),
            "quantized_tensors": len(report.get("quantized_tensors") or []),
        })
        cells += [_cell(row["tuned"]), f"{row['tune_wall_s']:.0f} s"]
    print(f"| {name} ({args.size}) | " + " | ".join(cells) + " |", flush=True)
    return row


def _cell(c: dict) -> str:
    return (f"{c['candidate_ms']:.4f} ms ({1 / c['ratio']:.2f}x, "
            f"CI {1 / c['ci'][1]:.2f}-{1 / c['ci'][0]:.2f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", default="tensorrt")
    ap.add_argument("--models", nargs="+", default=["resnet", "transformer"])
    ap.add_argument("--size", default="medium", choices=["small", "medium", "full"])
    ap.add_argument("--mode", default="quick", choices=["quick", "default", "extensive"])
    ap.add_argument("--out", default="gpu-figures-out")
    ap.add_argument("--high-precision", default="fp16", choices=["fp32", "fp16", "bf16"],
                    help="the baseline's float precision (default fp16, what GPUs deploy)")
    ap.add_argument("--skip-tune", action="store_true", help="no tuned row (no search run)")
    args = ap.parse_args()
    backend = make_backend(args.backend)
    rows: list[dict] = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    hp = args.high_precision.upper()
    head = ["model", "FP32", f"{hp} (vs FP32, 95% CI)", f"all quantized (vs {hp})"]
    if not args.skip_tune:
        head += [f"tuned (vs {hp})", "tune time"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head), flush=True)
    try:
        for name in args.models:
            rows.append(run_model(name, args, backend))
            record = {"machine": platform.node(), "python": platform.python_version(),
                      "backend": backend.describe(), "rows": rows}
            (out / "gpu_figures.json").write_text(json.dumps(record, indent=2, default=str))
    finally:
        backend.close()


if __name__ == "__main__":
    main()
