"""ONNX Runtime's own transformer tools on a ViT, side by side: which of them is the recipe to
beat on this CPU?

Variants of the zoo's ViT-Ti/16-like model (``zoo.vit_like``, 224x224), all timed in the same
interleaved rounds (one fresh session each, 1 thread, the fastest of ``--runs`` runs after 5
warm-up runs), speed = FP32 latency / variant latency (median over rounds), output cosine vs
FP32 on one random input:

* ``dynamic``: ``quantize_dynamic`` on MatMuls with constant weights (the recipe file the
  tuner measures, ``runtimes/onnxruntime.py: ort_dynamic_options``);
* ``dynamic_all``: the same with ``MatMulConstBOnly`` off (the attention's activation x
  activation MatMuls quantized per call too);
* ``fused``: ``onnxruntime.transformers.optimizer.optimize_model(model_type="vit",
  opt_level=0)`` (Attention, SkipLayerNormalization, BiasGelu contrib ops), float;
* ``fused_dynamic``: ``quantize_dynamic`` on the fused model (QAttention), ONNX Runtime's
  documented CPU path for BERT-like models.

    python benchmarks/ort_transformer_recipes.py --rounds 7 --out benchmarks/results/ort_transformer_recipes_vit.md
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from _common import load_avg, machine, markdown_table

from qdq_optuna.examples import zoo


def variants(work: Path) -> dict[str, Path]:
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.transformers import optimizer

    logging.getLogger().setLevel(logging.ERROR)
    src = work / "fp32.onnx"
    onnx.save(zoo.vit_like(), str(src))
    out = {"fp32": src}
    for name, const_b in (("dynamic", True), ("dynamic_all", False)):
        out[name] = work / f"{name}.onnx"
        quantize_dynamic(str(src), str(out[name]), weight_type=QuantType.QInt8,
                         op_types_to_quantize=["MatMul", "Gemm"],
                         extra_options={"MatMulConstBOnly": const_b})
    fused = optimizer.optimize_model(str(src), model_type="vit", num_heads=3, hidden_size=192,
                                     opt_level=0, use_gpu=False)
    out["fused"] = work / "fused.onnx"
    fused.save_model_to_file(str(out["fused"]))
    print("fused ops:", {k: v for k, v in fused.get_fused_operator_statistics().items() if v})
    out["fused_dynamic"] = work / "fused_dynamic.onnx"
    quantize_dynamic(str(out["fused"]), str(out["fused_dynamic"]), weight_type=QuantType.QInt8)
    return out


def session_min(path: Path, feed: np.ndarray, runs: int) -> tuple[float, np.ndarray]:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    for _ in range(5):
        sess.run(None, {name: feed})
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        sess.run(None, {name: feed})
        best = min(best, (time.perf_counter() - t0) * 1e3)
    return best, sess.run(None, {name: feed})[0].ravel()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    feed = np.random.default_rng(0).standard_normal((1, 3, 224, 224)).astype(np.float32)
    load = load_avg()
    with tempfile.TemporaryDirectory() as tmp:
        paths = variants(Path(tmp))
        times: dict[str, list[float]] = {k: [] for k in paths}
        outs = {}
        for r in range(args.rounds):
            order = list(paths) if r % 2 == 0 else list(reversed(paths))
            for k in order:
                ms, outs[k] = session_min(paths[k], feed, args.runs)
                times[k].append(ms)
    ref = outs["fp32"]
    base = statistics.median(times["fp32"])
    rows = []
    for k, ts in times.items():
        out = outs[k]
        cos = float(out @ ref / (np.linalg.norm(out) * np.linalg.norm(ref)))
        rows.append([k, f"{statistics.median(ts):.2f}", f"{base / statistics.median(ts):.3f}x",
                     f"{cos:.5f}"])
    table = markdown_table(["variant", "ms (median of session minimums)", "vs FP32",
                            "cosine vs FP32"], rows)
    import onnxruntime

    text = (f"# ONNX Runtime's transformer tools on a ViT-Ti/16-like model\n\n"
            f"`python benchmarks/ort_transformer_recipes.py --rounds {args.rounds}` on "
            f"{machine()}, onnxruntime {onnxruntime.__version__}, 1 thread, load {load} before / "
            f"{load_avg()} after; {args.rounds} interleaved rounds.\n\n{table}\n")
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
