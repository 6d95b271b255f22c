"""Transformers on ONNX Runtime CPU: FP32, ONNX Runtime's two recipes (``quantize_static``
and ``quantize_dynamic``) and the tuned model (default mode: static placement and dynamic
MatMul/Gemm modes), at one thread.

Per model: each variant's speed ratio vs FP32 (fresh sessions, every variant timed in each
round in a rotating order, so the four share the machine's state; the ratio's geometric mean
and 95 % interval over rounds), its output cosine and relative L2 vs FP32 on held-out inputs
(inputs the calibration never saw), the tuned run's wall time, the modes it chose and which
model it shipped (its own, or one of the recipe files it measured).

Models: a ViT-Ti/16-like classifier (``zoo.vit_like``, 224x224, generated scenes as inputs),
the zoo's transformer encoder (``qdq-optuna example transformer``, token ids) and PP-OCRv4's
text recognizer (``real_models`` ``ppocr-rec``: an SVTR neck with attention blocks, rendered
text lines as inputs) and PP-OCRv5's (``ppocrv5-rec``); ``--only`` takes any other model of
``real_models.py`` too (``vit-s-focus``: a ViT-S/16 with real weights). ``--photos``: a real
model is calibrated and checked on crops of real photographs (text-line strips of print for a
text recognizer; ``photos.py``) instead of generated inputs.

    nice -n 5 python benchmarks/transformer_modes.py --out /tmp/tm
    python benchmarks/transformer_modes.py --only vit --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import _common
import numpy as np
import onnx
import real_models

from qdq_optuna.examples import zoo
from qdq_optuna.runtimes import onnxruntime as ort_runtime

RESULTS = Path(__file__).parent / "results"
MODELS = ("vit", "transformer", "ppocr-rec", "ppocrv5-rec")
VARIANTS = ("fp32", "static_recipe", "dynamic_recipe", "tuned")


def model_files(name: str, work: Path, samples: int, cache: str | None,
                use_photos: bool = False):
    """(model path, --input-shapes or None, calibration inputs, held-out inputs, which)."""
    work.mkdir(parents=True, exist_ok=True)
    if name == "vit":
        model = zoo.vit_like()
        path = work / "vit.onnx"
        onnx.save(model, str(path))
        cal, held = (real_models.zoo_inputs(model, samples, s) for s in (0, 1))
        np.savez(work / "calibration.npz", **cal)
        np.savez(work / "heldout.npz", **held)
        return path, None, cal, held, "generated scenes"
    path, shapes, cal, held, kind = real_models.benchmark_files(name, "full", samples, work,
                                                                cache)
    if use_photos:
        import photos

        cal, held = photos.saved_feeds(name, work, samples, samples)
        kind = ("text-line strips of real photographs (photos.py)"
                if real_models.MODELS[name].inputs == "textline"
                else "crops of real photographs (photos.py)")
    return path, shapes, cal, held, kind


def tune(path: Path, shapes: str | None, work: Path, extra: list[str]) -> tuple[Path, float]:
    out = work / "tuned"
    cmd = [sys.executable, "-m", "qdq_optuna", "tune", "--model", str(path), "--output",
           str(out), "--calibration-data", str(work / "calibration.npz"), "--fresh", "-q",
           "--threads", "1", *(["--input-shapes", shapes] if shapes else []), *extra]
    t0 = time.monotonic()
    subprocess.run(cmd, check=True)
    return out, time.monotonic() - t0


def _session(path: Path, shapes: str | None):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _feed(session, data: dict[str, np.ndarray], i: int) -> dict:
    names = {x.name for x in session.get_inputs()}
    return {k: v[i:i + 1] for k, v in data.items() if k in names}


def _timed_ms(path: Path, feed: dict, runs: int) -> float:
    """A fresh session's median run time (ms) after warm-up runs."""
    s = _session(path, None)
    for _ in range(3):
        s.run(None, feed)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        s.run(None, feed)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def speed(paths: dict[str, Path], held: dict, rounds: int, runs: int) -> dict:
    """Each variant's speed ratio vs FP32 over interleaved rounds (rotating order)."""
    feed = _feed(_session(paths["fp32"], None), held, 0)
    names = list(paths)
    per_round: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            per_round[n].append(_timed_ms(paths[n], feed, runs))
    return _common.speedups(per_round)


def accuracy(paths: dict[str, Path], held: dict) -> dict:
    """Output cosine (mean and worst over held-out samples) and relative L2 vs FP32."""
    sessions = {n: _session(p, None) for n, p in paths.items()}
    count = len(next(iter(held.values())))
    out = {}
    for n, s in sessions.items():
        cos, rel = [], []
        for i in range(count):
            ref = sessions["fp32"].run(None, _feed(sessions["fp32"], held, i))[0].ravel()
            got = s.run(None, _feed(s, held, i))[0].ravel()
            ref, got = ref.astype(np.float64), got.astype(np.float64)
            cos.append(float(ref @ got / (np.linalg.norm(ref) * np.linalg.norm(got))))
            rel.append(float(np.linalg.norm(got - ref) / np.linalg.norm(ref)))
        out[n] = {"cosine_mean": round(statistics.fmean(cos), 6), "cosine_min": round(min(cos), 6),
                  "rel_l2_mean": round(statistics.fmean(rel), 5)}
    return out


def one(name: str, args) -> dict:
    work = Path(args.out) / name
    path, shapes, cal, held, kind = model_files(name, work, args.samples, args.cache,
                                                args.photos)
    static = ort_runtime.ort_recipe_model(path, work, data=cal, input_shapes=shapes)
    dyn = ort_runtime.ort_dynamic_recipe_model(path, work, input_shapes=shapes)
    if dyn is None:
        raise SystemExit(f"{name}: no MatMul with constant weights for quantize_dynamic")
    out, timing = work / "tuned", work / "tune_wall.json"
    if args.keep_tuned and (out / "report.json").exists():  # tuned before (resumed runs add up)
        wall = json.loads(timing.read_text()) if timing.exists() else None
    else:
        _common.wait_quiet(args.max_load)
        out, wall = tune(path, shapes, work, args.tune_args)
        timing.write_text(json.dumps(wall))
    report = json.loads((out / "report.json").read_text())
    paths = {"fp32": path, "static_recipe": static, "dynamic_recipe": dyn,
             "tuned": out / "optimized.onnx"}
    _common.wait_quiet(args.max_load)
    row = {"model": name, "machine": _common.machine(), "inputs": kind,
           "tune_s": None if wall is None else round(wall, 1),
           "tune_args": args.tune_args, "complete": report["complete"],
           "tuned_claimed_speedup": round(report["speedup"], 4),
           "modes": report.get("modes"), "mode_counts": report.get("mode_counts"),
           "shipped": report["accuracy"].get("shipped"),
           "recipe_files": [{k: f.get(k) for k in ("name", "shipped", "error", "against")}
                            | {"tuned_vs_file": (f.get("tuned_vs_file") or {}).get("ratio")}
                            for f in report.get("recipe_files", [])],
           "speed": speed(paths, held, args.rounds, args.runs),
           "accuracy": accuracy(paths, held)}
    return row


def table(rows: list[dict]) -> str:
    body = []
    for r in rows:
        s, a = r["speed"], r["accuracy"]
        cells = [r["model"]]
        for v in VARIANTS[1:]:
            cells.append(f"{s[v]['speedup']:.3f}x ({s[v]['ci'][0]:.3f}-{s[v]['ci'][1]:.3f}), "
                         f"cos {a[v]['cosine_mean']:.5f}")
        mc = r.get("mode_counts") or {}
        weight_only = mc.get("weight_int8", 0) + mc.get("weight_int4", 0)
        cells += [f"{mc.get('dynamic', 0)} dyn / {mc.get('static', 0)} static / "
                  + (f"{weight_only} weight-only / " if weight_only else "")
                  + f"{mc.get('float', 0)} float", str(r["shipped"]),
                  "?" if r["tune_s"] is None else f"{r['tune_s']:.0f} s"
                  + ("" if r["complete"] else " (stopped at --timeout)")]
        body.append(cells)
    return _common.markdown_table(
        ["model", "quantize_static (vs FP32, cosine)", "quantize_dynamic", "tuned (default mode)",
         "tuned: MatMul/Gemm/Conv modes", "shipped", "tune wall"], body)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="/tmp/transformer_modes")
    ap.add_argument("--only", help="comma-separated: " + ",".join(MODELS))
    ap.add_argument("--cache", help="real models' cache folder (real_models.py)")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--photos", action="store_true",
                    help="real models: inputs cut from real photographs (photos.py)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--max-load", type=float, default=100.0,
                    help="wait until the 1-minute load is below this before each step")
    ap.add_argument("--keep-tuned", action="store_true",
                    help="measure a model tuned before (its run folder under --out) as it is; "
                         "its wall time from tune_wall.json there")
    ap.add_argument("--tune-args", nargs=argparse.REMAINDER, default=[],
                    help="extra 'qdq-optuna tune' arguments (last)")
    ap.add_argument("--results", default=str(RESULTS / "transformer_modes"))
    args = ap.parse_args(argv)
    rows = []
    for name in (args.only.split(",") if args.only else MODELS):
        rows.append(one(name, args))
        print(json.dumps(rows[-1]), flush=True)
        Path(args.results + ".json").write_text(json.dumps(rows, indent=1) + "\n")
    text = table(rows)
    Path(args.results + ".md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
