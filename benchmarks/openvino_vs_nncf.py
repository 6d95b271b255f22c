"""FP32 vs NNCF vs ONNX Runtime's recipe vs tuned, on OpenVINO CPU (1 thread, latency hint).

For each model: the user's FP32 file at OpenVINO's f32 and bf16 inference precision hints (which
is faster is reported), NNCF's ``nncf.quantize`` with its defaults, ONNX Runtime's
``quant_pre_process`` + ``quantize_static`` recipe, NNCF's placement read back as uses and
re-exported by our exporter (with NNCF's scales and activation type: must run the same layers,
see tests/test_openvino.py), and ``qdq-optuna tune --backend openvino`` (``--mode``, same
calibration inputs) unless ``--no-tune``. All variants are timed interleaved in one process:
every round compiles each variant afresh (rotating the order), 5 warm-up + ``--runs`` timed
inferences, keeps the round's minimum; the first ``--drop`` rounds warm the process up and are
dropped; the figure is the median over rounds and ratios get a 95% interval over the per-round
ratios. Output cosine vs FP32 (worst output, OpenVINO f32) on held-out inputs. Models with
attention (``attention_blocks``) also get NNCF with ``model_type=ModelType.TRANSFORMER``
(``nncf_transformer``), the preset OpenVINO documents for transformers. ``--photos``: the
calibration and held-out inputs are crops of real photographs (``photos.py``: text-line
strips for a recognizer) instead of generated ones.

    flock /tmp/qdq-bench.lock python benchmarks/openvino_vs_nncf.py \\
        --models nudenet-320n squeezenet-caffe2-light yolo@small --out benchmarks/results/openvino_vs_nncf.json

Models: zoo names with a size (``yolo@small``) and real models of ``benchmarks/real_models.py``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

import _common  # noqa: E402
import numpy as np
import onnx
import real_models
from _common import load_avg  # noqa: E402

from qdq_optuna.backends.base import BackendError  # noqa: E402
from qdq_optuna.backends.openvino import OpenVinoBackend, supported_hints  # noqa: E402
from qdq_optuna.model.graph import InputShapes  # noqa: E402
from qdq_optuna.placement import starts  # noqa: E402
from qdq_optuna.runtimes import onnxruntime as ort_runtime
from qdq_optuna.runtimes import openvino as ov_runtime
from qdq_optuna.runtimes.prepared import PreparedModel  # noqa: E402


def files(name: str, work: Path, samples: int, use_photos: bool = False
          ) -> tuple[Path, str | None, Path, dict, dict]:
    """(FP32 path, --input-shapes, calibration .npz, calibration inputs, held-out inputs)."""
    label, _, size = name.partition("@")
    path, shapes, cal, held, _ = real_models.benchmark_files(label, size or "medium", samples,
                                                             work)
    if use_photos:
        import photos

        cal, held = photos.saved_feeds(label, work, samples, samples)
    return path, shapes, work / "calibration.npz", cal, held


def variants(name: str, work: Path, args) -> tuple[dict[str, Path], dict]:
    """The files to time: fp32, nncf, ort_recipe, nncf_reexported, tuned."""
    model, shapes, cal_path, cal, held = files(name, work, args.samples, args.photos)
    out: dict[str, Path] = {"fp32": Path(model)}
    info: dict = {"input_shapes": shapes, "inputs": "photos" if args.photos else "generated"}
    nncf_model = ov_runtime.nncf_recipe_model(str(model), data=cal, input_shapes=shapes)
    onnx.save(nncf_model, str(work / "nncf.onnx"))
    out["nncf"] = work / "nncf.onnx"
    info["attention_blocks"] = ov_runtime.attention_blocks(onnx.load(str(model)))
    if info["attention_blocks"]:
        onnx.save(ov_runtime.nncf_recipe_model(str(model), data=cal, input_shapes=shapes,
                                               transformer=True),
                  str(work / "nncf_transformer.onnx"))
        out["nncf_transformer"] = work / "nncf_transformer.onnx"
    rw = work / "ort"
    rw.mkdir(exist_ok=True)
    try:
        out["ort_recipe"] = ort_runtime.ort_recipe_model(str(model), rw, data=cal,
                                                    input_shapes=shapes)
    except starts.ToolError as exc:  # a column less, the comparison with NNCF still stands
        info["ort_recipe_error"] = str(exc)
    pm = PreparedModel.prepare(str(model), runtime="openvino", input_shapes=shapes)
    start = ov_runtime.nncf_recipe_start(pm, str(model), data=cal, input_shapes=shapes)
    qtype = ov_runtime.nncf_activation_type(nncf_model)
    types = starts.activation_types(nncf_model)  # each tensor keeps NNCF's u8 or s8
    scales = starts.read_scales(nncf_model)
    scales.update({(t, types[t]): v for t, v in list(scales.items()) if t in types})
    exporter = pm.exporter(scales=scales, quant_type=qtype)
    src = exporter.source(exporter.plan({u: types.get(u[0], qtype) for u in start.scheme_uses}))
    (work / "nncf_reexported.onnx").write_bytes(src if isinstance(src, bytes) else
                                                Path(src).read_bytes())
    out["nncf_reexported"] = work / "nncf_reexported.onnx"
    # the same placement with u8 activations everywhere (the OpenVINO rules' default type):
    # an int8 (scale, 0) is the u8 (scale, 128), the same values
    exporter = pm.exporter(scales=as_uint8(nncf_model), quant_type="uint8")
    src = exporter.source(exporter.plan(set(start.scheme_uses)))
    (work / "nncf_placement_u8.onnx").write_bytes(src if isinstance(src, bytes) else
                                                  Path(src).read_bytes())
    out["nncf_placement_u8"] = work / "nncf_placement_u8.onnx"
    info["nncf_start"] = {"counts": start.counts, "exact": start.exact,
                          "activation_type": qtype}
    if not args.no_tune and args.keep_tuned and (work / "tune_info.json").is_file():
        info["tune"] = json.loads((work / "tune_info.json").read_text())
        out["tuned"] = work / "tuned" / "optimized.onnx"
    elif not args.no_tune:
        tdir = work / "tuned"
        cmd = [sys.executable, "-m", "qdq_optuna", "tune", "-m", str(model), "-o", str(tdir),
               "--backend", "openvino", "--mode", args.mode, "--calibration-data",
               str(cal_path), "--fresh", "-q"] + (["--input-shapes", shapes] if shapes else []) \
            + (["--timeout", str(args.tune_timeout)] if args.tune_timeout else [])
        t0 = time.monotonic()
        subprocess.run(cmd, check=True)
        report = json.loads((tdir / "report.json").read_text())
        info["tune"] = {"wall_s": round(time.monotonic() - t0, 1),
                        "speedup_reported": report.get("speedup"),
                        "measurements": report.get("measurements"),
                        "elapsed_s": report.get("elapsed_s"),
                        "chosen_start": next((x["name"] for x in report.get("starts") or []
                                              if x.get("chosen")), None),
                        "starts": {x["name"]: x.get("latency_ms")
                                   for x in report.get("starts") or []},
                        "shipped": report.get("accuracy", {}).get("shipped"),
                        "recipe_files": [
                            {k: f.get(k) for k in ("name", "shipped", "error", "against")}
                            | {"tuned_vs_file": (f.get("tuned_vs_file") or {}).get("ratio")}
                            for f in report.get("recipe_files") or []],
                        "backend": report.get("backend")}
        (work / "tune_info.json").write_text(json.dumps(info["tune"], indent=1) + "\n")
        out["tuned"] = tdir / "optimized.onnx"
    info["held"] = held
    return out, info


def as_uint8(qdq_model: onnx.ModelProto) -> dict[str, tuple[float, int]]:
    """NNCF's activation scales as uint8 ones (an int8 zero point z becomes z + 128)."""
    inits = {t.name: t.data_type for t in qdq_model.graph.initializer}
    signed = {n.input[0] for n in qdq_model.graph.node if n.op_type == "QuantizeLinear"
              and len(n.input) > 2 and inits.get(n.input[2]) == onnx.TensorProto.INT8}
    return {t: (s, z + 128 if t in signed else z)
            for t, (s, z) in starts.read_scales(qdq_model).items()}


def interleaved(models: dict[str, tuple[Path, str]], shapes: str | None, rounds: int,
                runs: int, drop: int) -> dict[str, list[float]]:
    """Per-round minimum ms of every (file, hint), fresh compiled model each round."""
    input_shapes = InputShapes.parse(shapes).shapes
    backends = {h: OpenVinoBackend(precision=h, input_shapes=input_shapes)
                for h in {h for _, h in models.values()}}
    names = list(models)
    mins: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for i in range(len(names)):
            n = names[(r + i) % len(names)]
            path, hint = models[n]
            with backends[hint].load(str(path)) as runner:
                best = min(runner.time(5, runs))
            if r >= drop:
                mins[n].append(best)
    return mins


def ratio(a: list[float], b: list[float]) -> dict:
    """b/a per round (how much faster a is than b): median and 95% interval."""
    rs = [y / x for x, y in zip(a, b)]
    med = statistics.median(rs)
    if len(rs) < 3:
        return {"ratio": round(med, 4)}
    sd = statistics.stdev(rs) / math.sqrt(len(rs))
    return {"ratio": round(med, 4), "ci95": [round(med - 2.1 * sd, 4), round(med + 2.1 * sd, 4)]}


def cosine(fp32: Path, other: Path, held: dict, shapes: str | None) -> float:
    """Worst output cosine similarity of ``other`` vs ``fp32`` (OpenVINO, f32 hint), per
    held-out sample."""
    backend = OpenVinoBackend(input_shapes=InputShapes.parse(shapes).shapes)
    ref, out = backend.outputs(str(fp32), held), backend.outputs(str(other), held)
    worst = 1.0
    for name, a_all in ref.items():
        for a, b in zip(a_all, out[name]):
            a, b = np.ravel(a), np.ravel(b)
            den = float(np.linalg.norm(a) * np.linalg.norm(b)) or 1.0
            worst = min(worst, float(np.dot(a, b)) / den)
    return round(worst, 5)


def layer_profiles(paths: dict[str, Path], shapes: str | None, runs: int = 40) -> dict:
    """Per variant, OpenVINO's per-layer timing (PERF_COUNT, ``OpenVinoBackend.profile``): the
    sum of each layer's minimum over ``runs`` inferences (a figure a shared machine disturbs
    far less than wall-clock latency), Convolutions by kernel precision, Reorders and f32
    Subgraphs (a Q/DQ computed in float on its own)."""
    backend = OpenVinoBackend(input_shapes=InputShapes.parse(shapes).shapes)
    out = {}
    for name, path in paths.items():
        rows = backend.profile(str(path), runs=runs)

        def count(layer: str, suffix: str = "", rows=rows) -> int:
            return sum(1 for r in rows if r["layer_type"] == layer
                       and r["exec_type"].endswith(suffix))

        out[name] = {"layer_sum_ms": round(sum(r["min_us"] for r in rows) / 1000.0, 3),
                     "conv_int8": count("Convolution", "I8"),
                     "conv_f32": count("Convolution", "f32"),
                     "reorders": count("Reorder"), "subgraph_f32": count("Subgraph", "f32")}
    return out


def compilable(paths: dict[str, Path], info: dict, hint: str = "f32") -> dict[str, Path]:
    """The variants OpenVINO compiles; each other one is left out with its error in
    ``info["not_compiled"]`` (oww-embedding: ONNX Runtime's recipe puts a per-channel
    DequantizeLinear OpenVINO's shape check rejects; NNCF's transformer file on PP-OCRv4's
    recognizer at the bf16 hint: "No suitable implementations")."""
    backend = OpenVinoBackend(precision=hint,
                              input_shapes=InputShapes.parse(info.get("input_shapes")).shapes)
    kept = {}
    for name, path in paths.items():
        try:
            backend.compile(str(path))
            kept[name] = path
        except BackendError as exc:
            if name == "fp32":
                raise
            info.setdefault("not_compiled", {})[name] = str(exc)
    return kept


def one(name: str, args) -> dict:
    work = Path(args.work) / name.replace("@", "_")
    work.mkdir(parents=True, exist_ok=True)
    load = load_avg()
    paths, info = variants(name, work, args)
    info["load_avg_1_5_15"] = {"start": load}
    held = info.pop("held")
    paths = compilable(paths, info, args.hint)
    timed = {k: (v, args.hint) for k, v in paths.items()}
    other = "bf16" if args.hint == "f32" else "f32"
    if other in supported_hints():
        timed[f"fp32_{other}"] = (paths["fp32"], other)
    info["hint"] = args.hint
    mins = interleaved(timed, info["input_shapes"], args.rounds, args.runs, args.drop)
    info["load_avg_1_5_15"]["after_timing"] = load_avg()
    fp32 = mins["fp32"]
    row = {"model": name, **info,
           "ms": {k: round(statistics.median(v), 3) for k, v in mins.items()},
           "speedup_vs_fp32_f32": {k: ratio(v, fp32) for k, v in mins.items() if k != "fp32"},
           "cosine_vs_fp32": {k: cosine(paths["fp32"], p, held, info["input_shapes"])
                              for k, p in paths.items() if k != "fp32"}}
    row["layer_profile"] = layer_profiles(paths, info["input_shapes"])
    if "nncf" in mins:
        for variant in ("tuned", "nncf_reexported"):
            if variant in mins:
                row[f"{variant}_vs_nncf"] = ratio(mins[variant], mins["nncf"])
    if "nncf_transformer" in mins and "tuned" in mins:
        row["tuned_vs_nncf_transformer"] = ratio(mins["tuned"], mins["nncf_transformer"])
    return row


def _ci(r: dict | None) -> str:
    if not r:
        return "-"
    lo, hi = r.get("ci95", [None, None])
    return f"{r['ratio']:.3f}" + (f" ({lo:.2f}-{hi:.2f})" if lo is not None else "")


def table(results: list[dict]) -> str:
    """Markdown: per model, speed vs FP32 (f32 hint) of NNCF, ONNX Runtime's recipe and tuned,
    tuned vs NNCF (median per-round ratio, 95% interval), cosine vs FP32, tune wall time, layer
    profile sums and the load average."""
    lines = ["| model | NNCF vs FP32 | ORT recipe vs FP32 | tuned vs FP32 | **tuned vs NNCF** | "
             "layer sum ms FP32 / NNCF / tuned | conv int8/f32 NNCF, tuned | cosine NNCF / "
             "tuned | tune wall s | load 1-min |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        for row in res["rows"]:
            if "error" in row:
                lines.append(f"| {row['model']} | {row['error'][:90]} |" + " |" * 8)
                continue
            sp, cos = row["speedup_vs_fp32_f32"], row["cosine_vs_fp32"]
            prof = row.get("layer_profile") or {}

            def lay(k: str, prof=prof) -> str:
                return f"{prof[k]['layer_sum_ms']:.2f}" if k in prof else "-"

            def conv(k: str, prof=prof) -> str:
                return f"{prof[k]['conv_int8']}/{prof[k]['conv_f32']}" if k in prof else "-"

            load = row.get("load_avg_1_5_15") or {}
            loads = "-".join(f"{v[0]:.1f}" for v in load.values())
            lines.append(
                f"| {row['model']} | {_ci(sp.get('nncf'))} | {_ci(sp.get('ort_recipe'))} | "
                f"{_ci(sp.get('tuned'))} | **{_ci(row.get('tuned_vs_nncf'))}** | "
                f"{lay('fp32')} / {lay('nncf')} / {lay('tuned')} | "
                f"{conv('nncf')}, {conv('tuned')} | {cos.get('nncf', '-')} / "
                f"{cos.get('tuned', '-')} | {(row.get('tune') or {}).get('wall_s', '-')} | "
                f"{loads or '-'} |")
    return "\n".join(lines) + "\n"


def transformer_table(results: list[dict]) -> str:
    """Markdown for models with attention: NNCF's default and transformer presets and the
    tuned model against FP32 (f32 hint; cosine vs FP32 on held-out inputs), the tuned model
    against each preset, the start it chose, what shipped and the tune's wall time."""
    rows = []
    for res in results:
        for row in res["rows"]:
            if "error" in row or not row.get("attention_blocks"):
                continue
            sp, cos, tune = row["speedup_vs_fp32_f32"], row["cosine_vs_fp32"], row.get("tune", {})

            def vs(k: str, sp=sp, cos=cos, row=row) -> str:
                if k in (row.get("not_compiled") or {}):
                    return "does not compile"
                return f"{_ci(sp.get(k))}, cos {cos[k]:.4f}" if k in sp else "-"

            rows.append([row["model"], row.get("hint", "f32"), vs("nncf"),
                         vs("nncf_transformer"), vs("tuned"), _ci(row.get("tuned_vs_nncf")),
                         _ci(row.get("tuned_vs_nncf_transformer")),
                         str(tune.get("chosen_start", "-")), str(tune.get("shipped", "-")),
                         str(tune.get("wall_s", "-"))])
    return _common.markdown_table(
        ["model", "hint", "NNCF default vs FP32", "NNCF TRANSFORMER vs FP32",
         "tuned vs FP32", "tuned vs NNCF default", "tuned vs NNCF TRANSFORMER",
         "chosen start", "shipped", "tune wall s"], rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["nudenet-320n", "yolo@small"])
    ap.add_argument("--work", default="/tmp/qdq-openvino-bench")
    ap.add_argument("--out", default=None)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--drop", type=int, default=3)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--mode", default="quick")
    ap.add_argument("--tune-timeout", type=float, help="tune's --timeout (its anytime result)")
    ap.add_argument("--no-tune", action="store_true")
    ap.add_argument("--hint", choices=("f32", "bf16"), default="f32",
                    help="the inference precision hint every variant is timed at (bf16: "
                         "OpenVINO's own default on CPUs that have it; the speedup keys keep "
                         "their names, the row's 'hint' says which)")
    ap.add_argument("--keep-tuned", action="store_true",
                    help="time the model tuned before under --work as it is (tune_info.json)")
    ap.add_argument("--photos", action="store_true",
                    help="calibrate and check on crops of real photographs (photos.py)")
    ap.add_argument("--table", nargs="+", metavar="RESULT.json",
                    help="print the markdown table of earlier results and exit")
    ap.add_argument("--transformers", action="store_true",
                    help="with --table: the table of the models with attention (NNCF's "
                         "default and transformer presets against the tuned model)")
    args = ap.parse_args(argv)
    if args.table:
        results = [json.loads(Path(p).read_text()) for p in args.table]
        print(transformer_table(results) if args.transformers else table(results), end="")
        return 0
    import nncf
    import openvino

    rows = []
    for name in args.models:
        try:
            rows.append(one(name, args))
        except starts.ToolError as exc:  # NNCF refused the model: no comparison to make
            rows.append({"model": name, "error": str(exc)})
        print(json.dumps(rows[-1], indent=1), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(
                {"openvino": openvino.__version__, "nncf": nncf.__version__,
                 "machine": _common.machine(), "args": vars(args), "rows": rows}, indent=1) + "\n")
    return 0



if __name__ == "__main__":
    sys.exit(main())
