"""Where the every-point start's Concat inputs are copied or requantized by ONNX Runtime, and
what sharing a Concat's scale is worth, against ONNX Runtime's recipe.

For one model (default: the YOLO-like zoo model at medium size, natural-looking calibration
inputs as ``vs_recipe.py`` makes them): the every-point placement exported with (a) each
tensor's own percentile scale tied only through SAME_SCALE ops (``share_input_scales``, the code
before Concat sharing) and (b) with ``share_concat_scales``, and the recipe's model
(``quant_pre_process`` + ``quantize_static``). For each: the Concat inputs ONNX Runtime's
optimized graph copies / requantizes, the worst output's cosine vs FP32 on held-out inputs, and
its speed vs the recipe (``verify_speedup.py``'s ABBA rounds of fresh sessions in a fresh
process, 1 thread; a quiet machine only).

    python benchmarks/concat_scales.py --out DIR [--model yolo@medium] [--json F]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import _common
import numpy as np
import onnx
import verify_speedup  # noqa: E402
import vs_recipe  # noqa: E402

from qdq_optuna.model import calibration
from qdq_optuna.placement import starts  # noqa: E402
from qdq_optuna.runtimes.prepared import PreparedModel  # noqa: E402


def concat_copies(path: Path, work: Path) -> tuple[int, int]:
    """(copied, requantized) QLinearConcat inputs in ONNX Runtime's optimized graph."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.optimized_model_filepath = str(work / f"{path.stem}.ort.onnx")
    so.intra_op_num_threads = 1
    ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    graph = onnx.load(so.optimized_model_filepath).graph
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in graph.initializer}
    copied = requantized = 0
    for node in graph.node:
        if node.op_type == "QLinearConcat":
            for j in range(2, len(node.input), 3):
                same = (inits[node.input[j + 1]] == inits[node.input[0]]
                        and inits[node.input[j + 2]] == inits[node.input[1]])
                copied, requantized = copied + bool(same), requantized + (not same)
    return copied, requantized


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="yolo@medium")
    ap.add_argument("--out", required=True)
    ap.add_argument("--cache", help="real models' cache folder")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--warmup-rounds", type=int, default=2)
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--max-load", type=float, default=1.5)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    work = Path(args.out)
    path, shapes, cal, held, _ = vs_recipe.prepare(args.model, work, args.cache, args.samples)
    recipe_path, _ = vs_recipe.usable_recipe(path, cal, work, shapes)
    pm = PreparedModel.prepare(str(path), runtime="onnxruntime", input_shapes=shapes)
    stats = calibration.collect_statistics(pm.graph.full_model(), pm.candidate_tensors(), cal)
    own = calibration.activation_scales(stats, method="percentile", quant_type=pm.quant_type,
                                        bounds=calibration.reader_bounds(pm.graph))
    variants = {"own scales, SAME_SCALE ties": calibration.share_input_scales(pm.graph.nodes, own),
                "Concat sharing": calibration.share_concat_scales(pm.graph.nodes, own,
                                                                  pm.quant_type)}
    uses = set(starts.all_on_start(pm).scheme_uses)
    files = {}
    for i, (name, scales) in enumerate(variants.items()):
        exporter = pm.exporter(scales)
        source = exporter.source(exporter.plan(uses))
        files[name] = work / f"every_point_{i}.onnx"
        files[name].write_bytes(source if isinstance(source, bytes)
                                else source.SerializeToString())
    files["recipe"] = Path(recipe_path)
    rows = []
    for name, file in files.items():
        copied, requantized = concat_copies(file, work)
        row = {"model": args.model, "variant": name, "concat_copied": copied,
               "concat_requantized": requantized, **vs_recipe.errors(path, file, held)}
        if name != "recipe":
            row["load_before"] = _common.wait_quiet(args.max_load)["load_before"]
            m = verify_speedup.remeasure_in_fresh_process(files["recipe"], file, args)
            row["vs_recipe"], row["vs_recipe_ci"] = m["speedup"], m["speedup_ci"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("\n| variant | Concat inputs copied / requantized | cosine vs FP32 | vs recipe (95 % CI) |")
    print("|---|---:|---:|---:|")
    for r in rows:
        ab = (f"{r['vs_recipe']:.3f}x ({r['vs_recipe_ci'][0]:.3f}-{r['vs_recipe_ci'][1]:.3f})"
              if "vs_recipe" in r else "1")
        print(f"| {r['variant']} | {r['concat_copied']} / {r['concat_requantized']} | "
              f"{r['cosine']:.4f} | {ab} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    np.seterr(all="ignore")
    sys.exit(main())
