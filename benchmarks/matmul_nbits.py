"""Weight-only MatMuls (ONNX Runtime's ``MatMulNBits``, int8 and int4 blocks) against float
and against dynamic int8 (``quantize_dynamic``'s DynamicQuantizeLinear + MatMulInteger) on
this CPU, at one thread: which weight-only setting (bits, ``block_size``, ``accuracy_level``)
is worth a quantization mode of its own.

Two parts, each timed in interleaved rounds (every variant one fresh session per round, the
order rotating; a session's score is its fastest of ``--runs`` runs after 5 warm-up runs; a
variant's speed is the geometric mean over rounds of FP32 / variant with its ~95 % interval):

* **kernels**: one MatMul ``[1, M, K] x [K, N]`` of each size of the zoo's transformer
  encoder (sequence 128, hidden 256, FFN 1024) and ViT-Ti/16 (196 tokens, hidden 192, FFN
  768); variants FP32, dynamic int8, and MatMulNBits at bits 4/8 x block 32/128 x
  accuracy_level 0 (float compute) / 4 (int8 compute);
* **models**: the whole zoo transformer and ViT with every MatMul of a constant weight as
  ``quantize_dynamic`` writes it (ONNX Runtime's own file) and as MatMulNBits (int8 and int4,
  block 128, accuracy_level 4), with each variant's output cosine vs FP32.

    nice -n 15 python benchmarks/matmul_nbits.py            # writes results/matmul_nbits.*
    python benchmarks/matmul_nbits.py --rounds 3 --only kernels --out /tmp/x
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import time
from pathlib import Path

import _common
import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from qdq_optuna.examples import zoo
from qdq_optuna.placement import weight_only
from qdq_optuna.runtimes import onnxruntime as ort_runtime

SIZES = {  # (model, layer): (M, K, N)
    ("transformer", "qkv/output"): (128, 256, 256),
    ("transformer", "fc1"): (128, 256, 1024),
    ("transformer", "fc2"): (128, 1024, 256),
    ("vit", "qkv/output"): (196, 192, 192),
    ("vit", "fc1"): (196, 192, 768),
    ("vit", "fc2"): (196, 768, 192),
    ("decoder step", "one token"): (1, 1024, 4096),  # where weight-only kernels are meant to win
}
NBITS = [(bits, block, level) for bits, block, level in itertools.product((4, 8), (32, 128),
                                                                          (0, 4))]


def _nbits_name(bits: int, block: int, level: int) -> str:
    return f"nbits{bits}_b{block}_acc{level}"


def matmul_model(m: int, k: int, n: int, seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((k, n)) / math.sqrt(k)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["A", "W"], ["Y"], name="matmul")], "matmul",
        [helper.make_tensor_value_info("A", TensorProto.FLOAT, [1, m, k])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, m, n])],
        [numpy_helper.from_array(w, "W")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def nbits_model(model: onnx.ModelProto, bits: int, block: int, level: int) -> onnx.ModelProto:
    """Every MatMul of a constant 2-D weight as MatMulNBits (the rest as it is)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    inits = {t.name: t for t in out.graph.initializer}
    nodes, used = [], set()
    for node in out.graph.node:
        w = inits.get(node.input[1]) if node.op_type == "MatMul" else None
        if w is None or len(w.dims) != 2:
            nodes.append(node)
            continue
        new, q = weight_only.matmul_nbits(numpy_helper.to_array(w), node.input[0], node.output[0],
                                          node.name or w.name, bits=bits, block_size=block,
                                          accuracy_level=level, name=node.name)
        out.graph.initializer.extend(new)
        nodes.append(q)
        used.add(w.name)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    keep = [t for t in out.graph.initializer if t.name not in used
            or any(t.name in n.input for n in nodes)]
    del out.graph.initializer[:]
    out.graph.initializer.extend(keep)
    out.opset_import.append(helper.make_opsetid(weight_only.MS_DOMAIN, 1))
    return out


def _session(data: bytes) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    return ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])


def _feed(model: onnx.ModelProto, seed: int = 1) -> dict:
    rng = np.random.default_rng(seed)
    feed = {}
    for vi in model.graph.input:
        shape = [d.dim_value or 1 for d in vi.type.tensor_type.shape.dim]
        if vi.type.tensor_type.elem_type == TensorProto.INT64:
            feed[vi.name] = rng.integers(0, 100, shape).astype(np.int64)
        else:
            feed[vi.name] = rng.standard_normal(shape).astype(np.float32)
    return feed


def _score_ms(data: bytes, feed: dict, runs: int) -> float:
    s = _session(data)
    for _ in range(5):
        s.run(None, feed)
    best = math.inf
    for _ in range(runs):
        t0 = time.perf_counter()
        s.run(None, feed)
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def interleaved(variants: dict[str, bytes], feed: dict, rounds: int, runs: int) -> dict:
    """Each variant's speed vs ``fp32`` over rounds in rotating order (one throw-away round
    first: a fresh process reads slow for its first seconds)."""
    names = list(variants)
    per: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds + 1):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            ms = _score_ms(variants[n], feed, runs)
            if r:
                per[n].append(ms)
    return _common.speedups(per, digits=3)


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def kernels(rounds: int, runs: int) -> list[dict]:
    rows = []
    for (model, layer), (m, k, n) in SIZES.items():
        base = matmul_model(m, k, n)
        variants = {"fp32": base.SerializeToString(),
                    "dynamic": ort_runtime.ort_dynamic_recipe_bytes(base)}
        for bits, block, level in NBITS:
            variants[_nbits_name(bits, block, level)] = nbits_model(
                base, bits, block, level).SerializeToString()
        speed = interleaved(variants, _feed(base), rounds, runs)
        rows.append({"model": model, "layer": layer, "m": m, "k": k, "n": n, "speed": speed})
        best = max((v for v in speed if v != "fp32"), key=lambda v: speed[v]["speedup"])
        print(f"{model:12s} {layer:11s} {m}x{k}x{n}: dynamic {speed['dynamic']['speedup']}x, "
              f"best {best} {speed[best]['speedup']}x", flush=True)
    return rows


def models(rounds: int, runs: int) -> list[dict]:
    rows = []
    for name, model in (("transformer", zoo.build("transformer")), ("vit", zoo.vit_like())):
        variants = {"fp32": model.SerializeToString(),
                    "dynamic_recipe": ort_runtime.ort_dynamic_recipe_bytes(model)}
        for bits in (8, 4):
            variants[f"nbits{bits}_b128_acc4"] = nbits_model(
                model, bits, 128, 4).SerializeToString()
        feed = _feed(model)
        ref = _session(variants["fp32"]).run(None, feed)[0]
        cos = {v: round(_cosine(ref, _session(d).run(None, feed)[0]), 6)
               for v, d in variants.items()}
        speed = interleaved(variants, feed, rounds, max(runs // 4, 5))
        rows.append({"model": name, "speed": speed, "cosine": cos})
        print(name, {v: (speed[v]["speedup"], cos[v]) for v in variants}, flush=True)
    return rows


def markdown(result: dict) -> str:
    lines = ["# Weight-only MatMuls (MatMulNBits) vs float and dynamic int8 on ONNX Runtime CPU",
             "",
             f"`nice -n 15 python benchmarks/matmul_nbits.py` on {result['machine']}, "
             f"onnxruntime {result['onnxruntime']}, one thread, 1-minute load "
             f"{result['load_before']} before / {result['load_after']} after (a shared "
             f"machine: only ratios of variants timed in the same rounds are compared). Speed: "
             f"FP32 latency / variant latency, geometric mean over {result['rounds']} rounds "
             f"(~95 % interval); each session's fastest run.", ""]
    if result.get("kernels"):
        names = ["dynamic"] + [_nbits_name(*c) for c in NBITS]
        lines += ["## One MatMul [1, M, K] x [K, N]", "",
                  _common.markdown_table(
                      ["model", "layer", "M x K x N", *names],
                      [[r["model"], r["layer"], f"{r['m']}x{r['k']}x{r['n']}",
                       *(f"{r['speed'][v]['speedup']:.2f}x" for v in names)]
                       for r in result["kernels"]]), ""]
    if result.get("models"):
        names = list(result["models"][0]["speed"])[1:]
        lines += ["## Whole models (every MatMul of a constant weight in that mode)", "",
                  _common.markdown_table(
                      ["model", *names],
                      [[r["model"], *(f"{r['speed'][v]['speedup']:.2f}x "
                                      f"({r['speed'][v]['ci'][0]:.2f}-{r['speed'][v]['ci'][1]:.2f}),"
                                      f" cos {r['cosine'][v]:.5f}" for v in names)]
                       for r in result["models"]]), ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--only", choices=("kernels", "models"))
    ap.add_argument("--out", type=Path, default=_common.RESULTS)
    args = ap.parse_args()
    result = {"machine": _common.machine(), "onnxruntime": ort.__version__,
              "rounds": args.rounds, "runs": args.runs, "load_before": _common.load_now()}
    if args.only != "models":
        result["kernels"] = kernels(args.rounds, args.runs)
    if args.only != "kernels":
        result["models"] = models(args.rounds, args.runs)
    result["load_after"] = _common.load_now()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "matmul_nbits.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "matmul_nbits.md").write_text(markdown(result) + "\n")
    print(markdown(result))


if __name__ == "__main__":
    main()
