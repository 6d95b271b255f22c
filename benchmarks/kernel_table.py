"""The kernel table of a model on this machine: each integer kernel of a Q/DQ placement timed
against its float kernel (``qdq_optuna.measure.kernels``), as the search measures it.

The placement is ONNX Runtime's recipe read onto the prepared graph (``--placement recipe``,
every Conv/Gemm/MatMul integer as ``quantize_static`` places it) or every point on (``all``).
One row per node, and the distinct signatures grouped by kernel shape (1x1, 3x3, ...), so the
table says which layers run faster in float on this CPU. Run it under the bench lock:

    flock /tmp/qdq_bench.lock python benchmarks/kernel_table.py inception-v1-caffe2-light \\
        --input-shapes data_0:1x3x224x224 --json /some/folder/kernels.json

``--cache`` defaults to a fresh file (every kernel timed); pass the user cache
(``~/.cache/qdq_optuna/kernels.json``) to see what a run would reuse. ``--op-units`` times the
ops besides Conv/Gemm/MatMul that ONNX Runtime has integer kernels for too (its profile's
``OP_UNITS``: every MaxPool, Concat, Add, ... alone, integer against float).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import onnx
import real_models  # noqa: E402
from onnx import numpy_helper

from qdq_optuna.backends.onnxruntime import OnnxRuntimeBackend  # noqa: E402
from qdq_optuna.measure import kernels as K  # noqa: E402
from qdq_optuna.placement import starts  # noqa: E402
from qdq_optuna.runtimes import onnxruntime as ort_runtime
from qdq_optuna.runtimes.prepared import PreparedModel  # noqa: E402


def model_path(name: str) -> Path:
    """A file, or a real model's name (fetched into its cache)."""
    p = Path(name)
    return p if p.is_file() else real_models.fetch(name)


def folded(path: Path, out: Path) -> Path:
    """``path`` with its initializers no longer listed as graph inputs (IR 3 models list them:
    ONNX Runtime then treats them as overridable and folds nothing) and its constant subgraphs
    folded by ONNX Runtime's basic optimizations, at opset 13. The onnx test data's "light" models compute
    every Conv weight with ConstantOfShape from such an input, so no weight is a constant a
    Q/DQ placement can quantize until this is done."""
    import onnxruntime as ort

    model = onnx.load(path)
    inits = {t.name for t in model.graph.initializer}
    kept = [i for i in model.graph.input if i.name not in inits]
    del model.graph.input[:]
    model.graph.input.extend(kept)
    model.ir_version = max(model.ir_version, 4)  # initializers need not be inputs from IR 4
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    so.optimized_model_filepath = str(out)
    ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    done = onnx.load(out)  # as plain tensors, and only the opsets the graph uses
    tensors = [numpy_helper.from_array(numpy_helper.to_array(t), t.name)
               for t in done.graph.initializer]
    del done.graph.initializer[:]
    done.graph.initializer.extend(tensors)
    used = {n.domain for n in done.graph.node}
    keep = [o for o in done.opset_import if o.domain in used or o.domain == ""]
    del done.opset_import[:]
    done.opset_import.extend(keep)
    done = onnx.version_converter.convert_version(done, 13)  # per-channel weights need 13
    onnx.checker.check_model(done)
    onnx.save(done, out)
    return out


def placement(pm, path: Path, which: str, shapes: str | None) -> set:
    if which == "all":
        return set(starts.all_on_start(pm).scheme_uses)
    return set(ort_runtime.ort_recipe_start(pm, path, input_shapes=shapes).scheme_uses)


def by_kernel(table: K.KernelTable) -> list[dict]:
    """Per op and kernel size: nodes, summed int and float ms, and the decisions."""
    groups: dict[str, dict] = defaultdict(lambda: {"nodes": 0, "int_ms": 0.0, "float_ms": 0.0,
                                                   "float": 0, "integer": 0, "tie": 0})
    for t in table.timings.values():
        sig = json.loads(t.signature)
        attrs = sig[2] if sig[0] == "op unit" else sig[1]  # an op unit's: kind, op, attrs
        size = "x".join(map(str, attrs.get("kernel_shape", []))) or "-"
        g = groups[f"{t.op} {size}"]
        g["nodes"] += 1
        g["int_ms"] += t.int_ms
        g["float_ms"] += t.float_ms
        g[t.decision] += 1
    return [{"kernel": k, **v, "float_over_int": round(v["float_ms"] / v["int_ms"], 3)}
            for k, v in sorted(groups.items())]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", help="an .onnx file or a name from benchmarks/real_models.py")
    ap.add_argument("--input-shapes")
    ap.add_argument("--placement", choices=("recipe", "all"), default="recipe")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cache", help="kernel cache file (default: a fresh one)")
    ap.add_argument("--json", help="write the table here")
    ap.add_argument("--op-units", action="store_true",
                    help="time ONNX Runtime's op units too (MaxPool, Concat, Add, ... alone, "
                         "integer against float, every node whatever the placement)")
    ap.add_argument("--fold", metavar="OUT.onnx",
                    help="first fold the model's constant weights (see folded()) into this file")
    args = ap.parse_args(argv)
    path = model_path(args.model)
    if args.fold:
        path = folded(path, Path(args.fold))
    shapes = args.input_shapes or (real_models.MODELS[args.model].input_shapes
                                   if args.model in real_models.MODELS else None)
    pm = PreparedModel.prepare(path, input_shapes=shapes)
    ex = pm.exporter()
    qdq = onnx.load_from_string(ex.to_bytes(ex.plan(placement(pm, path, args.placement, shapes))))
    flt = onnx.load_from_string(ex.to_bytes(ex.plan(set())))
    with tempfile.TemporaryDirectory() as tmp:
        cache = K.KernelCache(args.cache or Path(tmp) / "kernels.json")
        table = K.kernel_table(OnnxRuntimeBackend(threads=args.threads), flt, qdq, cache=cache,
                               output_q=True,
                               op_units=ort_runtime.OP_UNITS if args.op_units else None)
    ops = table.op_units
    print(f"{args.model}: {len(table.timings)} integer kernel(s), {table.timed} signature(s) "
          f"timed, {table.cached} cached, {table.seconds:.1f} s (op units: {ops['timed']} "
          f"timed, {ops['cached']} cached, {ops['seconds']:.1f} s); CPU flags: "
          f"{', '.join(table.flags) or 'none read'}; runtime {table.runtime}")
    print("| node | op | int ms | float ms | float/int (interval) | faster |")
    print("|---|---|---:|---:|---|---|")
    for row in table.to_dict()["kernels"]:
        print(f"| {row['node']} | {row['op']} | {row['int_ms']:.4f} | {row['float_ms']:.4f} | "
              f"{row['ratio']:.3f} ({row['ci_low']:.3f}-{row['ci_high']:.3f}) | "
              f"{row['decision']} |")
    groups = by_kernel(table)
    print("\n| kernel | nodes | int ms (sum) | float ms (sum) | float/int | float / int / tie |")
    print("|---|---:|---:|---:|---:|---|")
    for g in groups:
        print(f"| {g['kernel']} | {g['nodes']} | {g['int_ms']:.3f} | {g['float_ms']:.3f} | "
              f"{g['float_over_int']} | {g['float']} / {g['integer']} / {g['tie']} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, **table.to_dict(),
                                               "by_kernel": groups}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
