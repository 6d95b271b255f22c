"""Would static Q/DQ on a ViT's attention MatMuls add speed to its dynamic MatMuls?

ONNX Runtime's dynamic mode quantizes MatMul/Gemm nodes of a constant weight only; the
attention's two activation-by-activation MatMuls (scores = Q Kᵀ, context = softmax · V) stay
float. Static Q/DQ on their inputs and outputs lets ONNX Runtime run them as QLinearMatMul.
This times, in interleaved fresh sessions of plain onnxruntime (1 thread, ORT_ENABLE_ALL,
ABBA order, the first two rounds dropped), the zoo's ViT-like model (ViT-Ti/16 shape):

* ``dynamic``: every MatMul/Gemm of a constant weight dynamic (what ``quantize_dynamic`` and
  the tuned model run);
* ``dynamic+attn_static``: the same, and static Q/DQ on the attention MatMuls' inputs and
  outputs (the insertion points the search offers there);
* ``all_static``: every static insertion point on.

    python benchmarks/attention_static.py --rounds 12
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
from pathlib import Path

import onnx
from verify_speedup import _session_min

from qdq_optuna.examples import zoo
from qdq_optuna.model import calibration
from qdq_optuna.placement import starts
from qdq_optuna.placement.dynamic import QuantMode, mode_use
from qdq_optuna.runtimes import profile_for
from qdq_optuna.runtimes.prepared import PreparedModel


def variants(model: onnx.ModelProto) -> tuple[dict[str, bytes], dict]:
    """The three variants' bytes (scales calibrated on random inputs: speed only) and counts."""
    modes = (QuantMode.STATIC, QuantMode.DYNAMIC)
    pm = PreparedModel.prepare(model, runtime=profile_for("onnxruntime").rules_for_modes(modes))
    g = pm.graph
    data = calibration.random_calibration_data(g.full_model(), None, samples=4, seed=0)
    stats = calibration.collect_statistics(g.full_model(), pm.candidate_tensors(), data)
    ex = pm.exporter(calibration.activation_scales(stats, method="minmax",
                                                   quant_type=pm.quant_type))
    dyn = [i for i in range(len(g.nodes)) if pm.rules.offers_mode(g, i, QuantMode.DYNAMIC)]
    attention = [i for i, n in enumerate(g.nodes) if n.op_type == "MatMul" and i not in dyn]
    static = {u for u in starts.all_on_start(pm).scheme_uses if u[2] >= 0}
    outs = {t for i in attention for t in g.nodes[i].output}
    attn_static = {u for u in static if u[1] in attention or u[0] in outs}
    dynamic = {mode_use(g, i, QuantMode.DYNAMIC) for i in dyn}
    plans = {"dynamic": ex.plan(dynamic), "dynamic+attn_static": ex.plan(dynamic | attn_static),
             "all_static": ex.plan(static)}
    counts = {"dynamic_nodes": len(dyn), "attention_matmuls": len(attention),
              **{f"{k}_qdq": len(p) for k, p in plans.items()}}
    return {k: ex.to_bytes(p) for k, p in plans.items()}, counts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="attention_static_") as tmp:
        model = zoo.vit_like()
        files = {"float": Path(tmp) / "float.onnx"}
        onnx.save(model, files["float"])
        built, counts = variants(model)
        for name, data in built.items():
            files[name] = Path(tmp) / f"{name}.onnx"
            files[name].write_bytes(data)
        names = list(files)
        mins: dict[str, list[float]] = {k: [] for k in names}
        for r in range(args.rounds + 2):
            for k in (names if r % 2 == 0 else names[::-1]):
                mins[k].append(_session_min(str(files[k]), 5, args.runs))
    rows = {}
    for k in names[1:]:
        logs = [math.log(f / t) for f, t in zip(mins["float"][2:], mins[k][2:])]
        mu = statistics.fmean(logs)
        half = 2.2 * statistics.stdev(logs) / math.sqrt(len(logs))
        rows[k] = {"speedup": math.exp(mu), "ci": [math.exp(mu - half), math.exp(mu + half)],
                   "ms": statistics.median(mins[k][2:])}
        print(f"{k:22s} {rows[k]['speedup']:.3f}x float ({rows[k]['ci'][0]:.3f}-"
              f"{rows[k]['ci'][1]:.3f}), {rows[k]['ms']:.2f} ms")
    print(json.dumps(counts))
    if args.json:
        args.json.write_text(json.dumps({"counts": counts, "float_ms": statistics.median(
            mins["float"][2:]), "rows": rows, "rounds": args.rounds}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
