"""Latency of the float, all-quantized and tuned model on a GPU backend.

For each model: ``qdq-optuna example NAME --size SIZE``; the all-quantized model (every
insertion point of every pattern on, the backend's rules); ``qdq-optuna tune --backend B``;
then one interleaved A/B comparison (the library's robust protocol, fresh engines/sessions
per round) of each of the all-quantized and the tuned model against the float model on the
same backend. Prints a Markdown table and writes ``OUT/gpu_figures.json``.

    python benchmarks/gpu_figures.py --backend tensorrt --models resnet transformer --out /tmp/g
    python benchmarks/gpu_figures.py --backend ort-cuda --models resnet transformer --out /tmp/g

``--backend onnxruntime`` runs the same script on the CPU (a dry run of the script itself).
The float baseline is what the backend makes of the FP32 model: TensorRT's strongly typed
network keeps it in FP32 (no FP16 flag exists in that mode).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from qdq_optuna import PreparedModel, zoo  # noqa: E402
from qdq_optuna.backends import make_backend, runtime_for_backend  # noqa: E402
from qdq_optuna.measure import Measurer, TimingProtocol  # noqa: E402


def all_quantized(model_path: Path, runtime: str) -> bytes:
    pm = PreparedModel.prepare(str(model_path), runtime=runtime)
    exporter = pm.exporter()
    uses = []
    for pp in pm.tunable:
        uses.extend(pp.uses(pp.ids))
    return exporter.to_bytes(exporter.plan(uses))


def tune(model: Path, out: Path, backend: str, mode: str) -> dict:
    t0 = time.monotonic()
    cmd = [sys.executable, "-m", "qdq_optuna", "tune", "--model", str(model), "--output",
           str(out), "--backend", backend, "--mode", mode, "--fresh", "-q"]
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
    float_bytes = model_path.read_bytes()
    allq = all_quantized(model_path, runtime)
    (out / "all_quantized.onnx").write_bytes(allq)
    report = tune(model_path, out / "tuned", args.backend, args.mode)
    tuned = (out / "tuned" / "optimized.onnx").read_bytes()
    measurer = Measurer(backend, TimingProtocol.robust())
    row = {
        "model": name, "size": args.size, "backend": args.backend, "runtime": runtime,
        "all_quantized": compare(measurer, allq, float_bytes),
        "tuned": compare(measurer, tuned, float_bytes),
        "report_speedup": report.get("speedup"), "report_ci": report.get("speedup_ci"),
        "tune_wall_s": report["_wall_s"], "measurements": report.get("measurements"),
        "quantized_tensors": len(report.get("quantized_tensors") or []),
    }
    a, t = row["all_quantized"], row["tuned"]
    print(f"| {name} ({args.size}) | {a['reference_ms']:.4f} ms | {a['candidate_ms']:.4f} ms "
          f"({1 / a['ratio']:.2f}x) | {t['candidate_ms']:.4f} ms ({1 / t['ratio']:.2f}x, "
          f"CI {1 / t['ci'][1]:.2f}-{1 / t['ci'][0]:.2f}) | {row['tune_wall_s']:.0f} s |",
          flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", default="tensorrt")
    ap.add_argument("--models", nargs="+", default=["resnet", "transformer"])
    ap.add_argument("--size", default="medium", choices=["small", "medium", "full"])
    ap.add_argument("--mode", default="quick", choices=["quick", "default", "extensive"])
    ap.add_argument("--out", default="gpu-figures-out")
    args = ap.parse_args()
    backend = make_backend(args.backend)
    rows: list[dict] = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print("| model | float | all quantized (speedup) | tuned (speedup, 95% CI) | tune time |")
    print("|---|---|---|---|---|", flush=True)
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
