"""Which activation calibration method should be the default: output error after full
quantization, per runtime.

For every model (zoo ``resnet``, ``mobilenet``, ``yolo``, ``transformer`` and the real
third-party models of ``benchmarks/real_models.py``) and both runtimes' rules (TensorRT: int8,
the model run with its plain ONNX semantics; ONNX Runtime CPU: uint8, run with ORT's full
optimizations, i.e. the fused integer kernels), every insertion point the rules offer is
switched on (the most Q/DQ any search can choose), scales come from ``minmax``,
``percentile`` (99.99), ``entropy`` and ``mse`` calibration on one set of inputs, and the error
against the FP32 model is measured on *another* set (held out): worst output's cosine, relative
L2 and max abs error.

Inputs: the real models get ``real_models.natural_inputs`` (generated scenes, rendered text,
real file bytes, synthesized speech-like audio; see there); the zoo image models get the same
generated scenes, ImageNet-normalized; the zoo transformer gets uniform random token ids. The
zoo models have random weights, so their errors say how quantization-friendly their activations
are, not more.

Where every method breaks the bound (``--bound``, worst-output relative L2), the Q/DQ pairs
responsible are named by ``qdq_optuna.measure.bisect.bisect_plan`` under each method: a tensor named
under all of them is an outlier no method handles.

    python benchmarks/calibration_methods.py                       # everything (~20 min, 2 cores)
    python benchmarks/calibration_methods.py --models resnet,ppocr-det --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import real_models  # noqa: E402

from qdq_optuna.measure.accuracy import AccuracyEvaluator  # noqa: E402
from qdq_optuna.measure.bisect import bisect_plan, plan_error_function  # noqa: E402
from qdq_optuna.measure.bound import DEFAULT_MAX_OUTPUT_ERROR  # noqa: E402
from qdq_optuna.model import calibration  # noqa: E402
from qdq_optuna.runtimes import profile_for  # noqa: E402
from qdq_optuna.runtimes.prepared import PreparedModel  # noqa: E402

METHODS = calibration.METHODS
ZOO = real_models.ZOO
RUNTIMES = {"tensorrt": "int8", "onnxruntime": "uint8"}


def measure(name: str, runtime: str, args) -> dict:
    """Every method's worst-output errors for one model under one runtime's rules."""
    model, shapes, cal, held, data_kind = real_models.benchmark_model(name, args.size,
                                                                      args.samples, args.cache)
    qtype = RUNTIMES[runtime]
    pm = PreparedModel.prepare(model, runtime=runtime, quant_type=qtype, input_shapes=shapes)
    uses = set().union(*(pp.uses(pp.ids) for pp in pm.tunable)) if pm.tunable else set()
    stats = calibration.collect_statistics(pm.graph.full_model(), pm.candidate_tensors(), cal)
    optimize = profile_for(runtime).scores_fused(None)  # ONNX Runtime's fused kernels
    float_bytes = pm.exporter().to_bytes(pm.exporter().plan(set()))
    evaluator = AccuracyEvaluator(float_bytes, held, optimize=optimize)
    row = {"model": name, "runtime": runtime, "quant_type": qtype, "data": data_kind,
           "tensors": len(pm.candidate_tensors()), "methods": {}}
    exporters = {}
    for method in METHODS:
        exporter = exporters[method] = pm.exporter(pm.run_scales(stats, method))
        plan = exporter.plan(uses)
        _, details = evaluator.evaluate(exporter.to_bytes(plan))
        row["methods"][method] = {"cosine": details["worst_cosine"],
                                  "relative_l2": details["worst_relative_l2"],
                                  "max_abs": details["worst_max_abs"],
                                  "worst_output": max(details["outputs"], key=lambda o:
                                                      details["outputs"][o]["relative_l2"])}
    row["tail"] = heavy_tails(stats)
    best = min(METHODS, key=lambda m: row["methods"][m]["relative_l2"])
    if row["methods"][best]["relative_l2"] > args.bound and uses:
        row["outliers"] = outliers(exporters, uses, evaluator, args)
    return row


def heavy_tails(stats, top: int = 3) -> list[dict]:
    """The tensors whose max |x| is farthest above their 99.9th percentile of |x|."""
    found = []
    for name, s in stats.items():
        if s.count == 0 or s.amax <= 0:
            continue
        cdf = np.cumsum(s.hist)
        p999 = (int(np.searchsorted(cdf, cdf[-1] * 0.999)) + 1) * s.bin_width
        found.append({"tensor": name, "min": s.min, "max": s.max, "p99.9_abs": p999,
                      "ratio": s.amax / max(p999, 1e-12)})
    return sorted(found, key=lambda f: -f["ratio"])[:top]


def outliers(exporters: dict, uses, evaluator, args) -> dict:
    """Per method, the tensors whose Q/DQ break the bound; the ones every method names."""
    named = {}
    for method, exporter in exporters.items():
        plan = exporter.plan(uses)
        found = bisect_plan(exporter, plan, plan_error_function(exporter, evaluator), args.bound,
                            max_evaluations=args.max_evaluations)
        named[method] = {"responsible": found.responsible, "error_without": found.error,
                         "evaluations": found.evaluations}
    common = set.intersection(*(set(v["responsible"]) for v in named.values()))
    return {"by_method": named, "no_method_handles": sorted(common)}


def print_table(rows: list[dict]) -> None:
    print("\nworst output vs FP32 after quantizing every offered point "
          "(cosine / relative L2); * = best relative L2 of the row")
    head = f"| model | rules | data | {' | '.join(METHODS)} |"
    print(head)
    print("|" + "---|" * (3 + len(METHODS)))
    for r in rows:
        best = min(METHODS, key=lambda m: r["methods"][m]["relative_l2"])
        cells = [f"{r['methods'][m]['cosine']:.3f} / {r['methods'][m]['relative_l2']:.3f}"
                 + ("*" if m == best else "") for m in METHODS]
        print(f"| {r['model']} | {r['runtime']} {r['quant_type']} | {r['data']} | "
              + " | ".join(cells) + " |")
    print("\nwins (best relative L2) and median relative L2 per runtime:")
    for runtime in RUNTIMES:
        sub = [r for r in rows if r["runtime"] == runtime]
        if not sub:
            continue
        wins = {m: sum(min(METHODS, key=lambda k: r["methods"][k]["relative_l2"]) == m
                       for r in sub) for m in METHODS}
        med = {m: float(np.median([r["methods"][m]["relative_l2"] for r in sub])) for m in METHODS}
        within = {m: sum(r["methods"][m]["relative_l2"] <= DEFAULT_MAX_OUTPUT_ERROR for r in sub)
                  for m in METHODS}
        print(f"  {runtime}: " + ", ".join(
            f"{m} {wins[m]} wins, median {med[m]:.3f}, {within[m]}/{len(sub)} within "
            f"{DEFAULT_MAX_OUTPUT_ERROR}" for m in METHODS))
    print("\nheaviest tails (max |x| / p99.9 |x|) and outliers no method handles:")
    for r in rows:
        tail = r["tail"][0] if r["tail"] else None
        line = f"  {r['model']} ({r['runtime']}): "
        if tail:
            line += (f"{tail['tensor']} min {tail['min']:.3g} max {tail['max']:.3g} "
                     f"p99.9|x| {tail['p99.9_abs']:.3g} (x{tail['ratio']:.0f})")
        if "outliers" in r:
            common = r["outliers"]["no_method_handles"]
            line += f"; every method above {DEFAULT_MAX_OUTPUT_ERROR}: " + (
                f"no method handles {', '.join(common)}" if common else
                "different tensors per method: " + "; ".join(
                    f"{m}: {', '.join(v['responsible'][:4]) or '-'}"
                    for m, v in r["outliers"]["by_method"].items()))
        print(line)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(ZOO + tuple(real_models.MODELS)))
    ap.add_argument("--runtimes", default=",".join(RUNTIMES))
    ap.add_argument("--size", default="medium", help="zoo model size")
    ap.add_argument("--samples", type=int, default=8, help="calibration and held-out samples")
    ap.add_argument("--bound", type=float, default=DEFAULT_MAX_OUTPUT_ERROR,
                    help="worst-output relative L2 above which the culprits are bisected")
    ap.add_argument("--max-evaluations", type=int, default=40)
    ap.add_argument("--cache", help="real models' cache folder")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    rows = []
    for name in args.models.split(","):
        for runtime in args.runtimes.split(","):
            start = time.time()
            row = measure(name, runtime, args)
            row["seconds"] = round(time.time() - start, 1)
            rows.append(row)
            best = min(METHODS, key=lambda m: row["methods"][m]["relative_l2"])
            print(f"{name} {runtime}: " + ", ".join(
                f"{m} {v['cosine']:.3f}/{v['relative_l2']:.3f}" for m, v in row["methods"].items())
                + f"; best {best} ({row['seconds']} s)", flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps(rows, indent=1, default=float))
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
