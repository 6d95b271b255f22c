"""ONNX Runtime's recipe (``quant_pre_process`` + ``quantize_static``) with and without the
indexed name lookups of ``qdq_optuna/runtimes/_ort_indexed.py``: the same file, and how long
each takes.

For each model: ``ort_recipe_model`` once with the tool's own helpers, once with the indexed
ones (both forced, whatever the graph's size), the SHA-256 of each file and its seconds. The
models: real ones of ``benchmarks/real_models.py`` and generated decoders
(``decoder:LAYERS``, ``qdq_optuna.examples.zoo.transformer_like`` with width 64, 4 heads,
FFN 256, sequence 64; 144 layers is 4,755 nodes).

    python benchmarks/recipe_indexed.py --models decoder:144 densenet121-caffe2-light ... \
        --out benchmarks/results/recipe_indexed.json

Seconds are one wall time each on whatever the machine is doing: read ratios of several-fold,
not percents.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path

import onnx
import real_models
from _common import load_now, machine, markdown_table


def _model(name: str, work: Path) -> tuple[str, str | None, int]:
    """(path, --input-shapes, node count)."""
    if name.startswith("decoder:"):
        from qdq_optuna.examples.zoo import transformer_like

        proto = transformer_like(layers=int(name.split(":")[1]), hidden=64, heads=4, ffn=256,
                                 seq=64)
        path = work / "decoder.onnx"
        onnx.save(proto, str(path))
        return str(path), None, len(proto.graph.node)
    path = real_models.fetch(name)
    shapes = real_models.shapes_of(name)
    spec = ",".join(f"{k}:{'x'.join(map(str, v))}" for k, v in shapes.items()) or None
    return str(path), spec, len(onnx.load(str(path), load_external_data=False).graph.node)


def measure(name: str) -> dict:
    from qdq_optuna.runtimes import _ort_indexed
    from qdq_optuna.runtimes.onnxruntime import ort_recipe_model

    row: dict = {"model": name}
    with tempfile.TemporaryDirectory() as tmp:
        path, shapes, nodes = _model(name, Path(tmp))
        row["nodes"] = nodes
        for arm, min_nodes in (("tool", 10**12), ("indexed", 0)):
            _ort_indexed.MIN_NODES = min_nodes
            work = Path(tmp) / arm
            work.mkdir()
            t0 = time.perf_counter()
            try:
                out = ort_recipe_model(path, work, input_shapes=shapes)
            except Exception as exc:  # a model the recipe itself refuses: the same either way
                row[arm] = {"error": f"{type(exc).__name__}: {str(exc)[:160]}"}
                continue
            row[arm] = {"seconds": round(time.perf_counter() - t0, 2),
                        "sha256": hashlib.sha256(out.read_bytes()).hexdigest()}
    tool, indexed = row.get("tool", {}), row.get("indexed", {})
    row["same_file"] = (tool.get("sha256") == indexed.get("sha256")
                        if "sha256" in tool else tool.get("error") == indexed.get("error"))
    row["applies"] = _ort_indexed.applies()
    return row


def table(rows: list[dict]) -> str:
    body = []
    for r in rows:
        t, i = r.get("tool", {}), r.get("indexed", {})
        body.append([r["model"], r["nodes"], t.get("seconds", t.get("error", "-")),
                     i.get("seconds", i.get("error", "-")),
                     f"{t['seconds'] / i['seconds']:.1f}x" if "seconds" in t and "seconds" in i
                     else "-", "yes" if r["same_file"] else "**no**"])
    return markdown_table(["model", "nodes", "tool's own helpers (s)", "indexed (s)", "ratio",
                           "same file"], body)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    import onnxruntime

    rows = []
    for name in args.models:
        rows.append(measure(name))
        print(json.dumps(rows[-1]), flush=True)
    result = {"machine": machine(), "onnxruntime": onnxruntime.__version__,
              "load_before": load_now(), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    md = args.out.with_suffix(".md")
    md.write_text(f"# ONNX Runtime's recipe, indexed lookups vs its own\n\n{result['machine']}; "
                  f"onnxruntime {result['onnxruntime']}; 1-minute load {result['load_before']}"
                  f" before.\n\n{table(rows)}\n")
    print(table(rows))
    return 0 if all(r["same_file"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
