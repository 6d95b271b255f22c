"""Accuracy and ONNX Runtime CPU latency: FP32 vs ``quantize_static`` vs a tuned model.

For each model (zoo ``resnet``, ``transformer``, ``yolo`` at ``--size medium``):

* calibration data: ``--samples`` (32) synthetic inputs (standard normal floats, uniform token ids
  for integer inputs), saved as ``cal.npz``; a second synthetic set of the same size with another
  seed (``heldout.npz``) is where every model's accuracy is reported. **The data are synthetic**:
  the errors say how far each quantized model drifts from FP32 on these inputs, not task accuracy.
* ``onnxruntime.quantization.quantize_static`` with QuantFormat.QDQ, every op type, uint8
  activations / int8 weights (passed explicitly: ORT's own default activation type is int8, slow
  on x86 CPUs), ``per_channel=True``, MinMax calibration on ``cal.npz``: once on the model as
  given (``quantize_static``) and once after ORT's recommended ``quant_pre_process`` (shape
  inference + graph optimization, e.g. BatchNormalization folded: ``pre+quantize_static``).
* ours: ``qdq_optuna.tune(..., calibration_data=cal.npz, max_output_error=B, mode quick)`` with
  the ONNX Runtime CPU backend; the error budget ``B`` (worst-output relative L2, measured by the
  search on the calibration data) is ``--budget-factor`` (2) x quantize_static's relative L2 on
  the same data, or ``--budget`` if given.
* accuracy on ``heldout.npz``: worst-output cosine and relative L2 vs FP32, ONNX Runtime with full
  graph optimizations (the kernels a deployment runs).
* latency: interleaved A/B of each model against FP32 (``Measurer.compare(until="precision")``,
  1 intra-op thread, fresh sessions), so machine drift cancels in the ratio.

    python benchmarks/accuracy_vs_ptq.py --out /tmp/acc_vs_ptq
    python benchmarks/accuracy_vs_ptq.py --models resnet --size small   # a quick smoke run

Waits (up to 15 min) for a quiet machine (1-min load average < 1.2) before it times anything and
records the load; never run two benchmarks at once.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import _common
import numpy as np
import onnx  # noqa: E402

from qdq_optuna import Config, tune
from qdq_optuna.backends import OnnxRuntimeBackend  # noqa: E402
from qdq_optuna.examples import zoo  # noqa: E402
from qdq_optuna.measure.accuracy import output_errors, run_model, summarize  # noqa: E402
from qdq_optuna.measure.timing import Measurer, TimingProtocol  # noqa: E402

QUIET_LOAD = 1.2


def synthetic_data(model: onnx.ModelProto, samples: int, seed: int) -> dict[str, np.ndarray]:
    """``samples`` inputs on axis 0 (the model's fixed batch of 1 each)."""
    rng = np.random.default_rng(seed)
    inits = {i.name: i for i in model.graph.initializer}
    vocab = min((int(onnx.numpy_helper.to_array(i).shape[0]) for i in inits.values()
                 if i.name.lower().find("emb") >= 0), default=100)
    data = {}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        dims = [d.dim_value if d.dim_value > 0 else 1 for d in tt.shape.dim]
        shape = (samples * dims[0], *dims[1:])
        if tt.elem_type == onnx.TensorProto.FLOAT:
            data[vi.name] = rng.standard_normal(shape).astype(np.float32)
        else:
            dtype = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type)
            data[vi.name] = rng.integers(0, vocab, size=shape).astype(dtype)
    return data


quantize_static_ptq = _common.quantize_static_qdq


def errors(reference: dict, path: Path, data: dict) -> dict:
    s = summarize(output_errors(reference, run_model(str(path), data)))
    return {"worst_cosine": s["worst_cosine"], "worst_relative_l2": s["worst_relative_l2"]}


def bench_model(name: str, size: str, out: Path, samples: int, budget: float | None,
                factor: float, measurer: Measurer, max_wait: float, fresh: bool) -> dict:
    work = out / name
    work.mkdir(parents=True, exist_ok=True)
    model = zoo.build(name, size)
    fp32 = work / "fp32.onnx"
    onnx.save(model, str(fp32))
    cal = synthetic_data(model, samples, seed=0)
    held = synthetic_data(model, samples, seed=1)
    np.savez(work / "cal.npz", **cal)
    np.savez(work / "heldout.npz", **held)

    ptq = work / "quantize_static.onnx"
    quantize_static_ptq(fp32, ptq, cal)
    pre = work / "fp32_preprocessed.onnx"
    _common.pre_process(fp32, pre, symbolic=False)  # static shapes
    ptq_pre = work / "pre_quantize_static.onnx"
    quantize_static_ptq(pre, ptq_pre, cal)
    ref_cal = run_model(str(fp32), cal)
    ptq_cal_rel = errors(ref_cal, ptq, cal)["worst_relative_l2"]
    b = budget if budget is not None else factor * ptq_cal_rel

    t0 = time.monotonic()
    # a rerun with the same settings resumes the finished search (only re-measures)
    result = tune(fp32, work / "tuned", benchmark="onnxruntime",
                  config=Config.preset("quick"), calibration_data=str(work / "cal.npz"),
                  max_output_error=b, progress=False, fresh=fresh)
    tune_s = time.monotonic() - t0
    tuned = result.optimized_model

    ref_held = run_model(str(fp32), held)
    rows = {"fp32": {"worst_cosine": 1.0, "worst_relative_l2": 0.0}}
    rows["quantize_static"] = errors(ref_held, ptq, held)
    rows["pre+quantize_static"] = errors(ref_held, ptq_pre, held)
    rows["qdq_optuna"] = errors(ref_held, tuned, held)

    load = _common.wait_quiet(QUIET_LOAD, limit_s=max_wait)["load_before"]
    fp32_bytes = fp32.read_bytes()
    measurer.warm_up([fp32_bytes], force=True)
    for key, path in (("fp32", fp32), ("quantize_static", ptq),
                      ("pre+quantize_static", ptq_pre), ("qdq_optuna", tuned)):
        cmp = measurer.compare(path.read_bytes(), fp32_bytes, until="precision")
        rows[key].update({
            "latency_ms": cmp.candidate.score_ms,
            "fp32_ms_same_run": cmp.reference.score_ms,
            "speedup": 1.0 / cmp.ratio,
            "speedup_ci": [1.0 / cmp.ci_high, 1.0 / cmp.ci_low],
            "rounds": cmp.rounds,
        })
    rep = result.report
    return {
        "model": f"{name} ({size})",
        "nodes": len(model.graph.node),
        "error_budget_relative_l2": b,
        "budget_rule": "fixed" if budget is not None else f"{factor} x quantize_static on cal.npz",
        "quantize_static_relative_l2_on_cal": ptq_cal_rel,
        "pre_quantize_static_relative_l2_on_cal": errors(ref_cal, ptq_pre, cal)[
            "worst_relative_l2"],
        "tuned_final_output_error_on_cal": rep.get("final_output_error"),
        "tuned_quantized_tensors": len(rep["quantized_tensors"]),
        "tuned_in_search_speedup": rep["speedup"],
        "tune_seconds": tune_s,
        "load_before_timing": load,
        "results": rows,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="resnet,transformer,yolo")
    ap.add_argument("--size", default="medium", choices=["small", "medium", "full"])
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--budget", type=float, help="fixed error budget (relative L2)")
    ap.add_argument("--budget-factor", type=float, default=2.0)
    ap.add_argument("--out", default="accuracy_vs_ptq_out")
    ap.add_argument("--fresh", action="store_true",
                    help="tune again instead of resuming a finished search in OUT")
    ap.add_argument("--max-wait", type=float, default=900.0,
                    help="seconds to wait for a quiet machine before timing (default 900)")
    ap.add_argument("--json", help="where to write the results (default OUT/results.json)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    measurer = Measurer(OnnxRuntimeBackend(threads=1), TimingProtocol.robust())
    load_start = _common.wait_quiet(QUIET_LOAD, limit_s=args.max_wait)["load_before"]
    results = []
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        print(f"[{name}] tuning and measuring ...", file=sys.stderr, flush=True)
        results.append(bench_model(name, args.size, out, args.samples, args.budget,
                                   args.budget_factor, measurer, args.max_wait, args.fresh))
    doc = {
        "note": "calibration and held-out data are SYNTHETIC (random normal / uniform ids): "
                "errors are drift from FP32 on these inputs, not task accuracy",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "load_at_start": load_start},
        "timing": "interleaved A/B vs FP32, 1 intra-op thread, ONNX Runtime CPU",
        "models": results,
    }
    path = Path(args.json) if args.json else out / "results.json"
    path.write_text(json.dumps(doc, indent=2))
    print("Data are synthetic (random normal / uniform token ids): errors are drift from FP32, "
          "not task accuracy.")
    print(f"{'model':<22} {'variant':<20} {'cosine':>9} {'rel L2':>8} {'ms':>8} "
          f"{'speedup (95% CI)':>22}")
    for r in results:
        for key, v in r["results"].items():
            lo, hi = v["speedup_ci"]
            print(f"{r['model']:<22} {key:<20} {v['worst_cosine']:>9.5f} "
                  f"{v['worst_relative_l2']:>8.4f} {v['latency_ms']:>8.3f} "
                  f"{v['speedup']:>7.3f} ({lo:.3f}-{hi:.3f})")
        print(f"{'':<22} budget rel L2 {r['error_budget_relative_l2']:.4f} "
              f"({r['budget_rule']}); tuning {r['tune_seconds']:.0f} s; load before timing "
              f"{r['load_before_timing']:.2f}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
