"""The subgraph screen measured on real models: agreement, wall time and result, screen off vs on.

For each model, ``qdq-optuna tune`` (ONNX Runtime CPU, one thread, default mode, ``--timeout``)
runs once with ``Config.subgraph_screen`` off and once on (``--audit``: on, and every
candidate whose region measured slower still gets its whole-model A/B, so the table says how
often a drop was right). Per run: the best start and the final model against FP32, the
descent's gain (final over best start), wall time, measurements, the ORT recipe start's
speedup, and from the run's trial records how often the region's A/B ranked a candidate as
the whole model's A/B did (same side of 1: ``agreed``; a region measured slower whose whole
model was not faster either: ``drops right``).

    flock /tmp/qdq_bench.lock python benchmarks/subgraph_screen.py \\
        --models inception-v1-caffe2-light nudenet-320n ppocr-det --timeout 300 \\
        --out benchmarks/results/subgraph_screen

``--pairs K`` measures the agreement alone, without a tune (a tune's starts can take its whole
``--timeout`` on a large model): K activation tensors drawn from the model's every-point
placement, each pair (every point on, and the same without that tensor's Q/DQ: a descent
move, both ways) timed as its changed region and as whole models, both interleaved A/Bs; a
region's verdict agrees when the whole model's is the same (faster, slower, or neither).

Writes ``OUT.json`` (every run's figures) and ``OUT.md`` (the table). Never run two
benchmarks at once: the timings mean nothing on a busy machine.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import _common
import real_models

import qdq_optuna
from qdq_optuna.config import Config
from qdq_optuna.machine import current_cpu


def summarize(report: dict, wall_s: float) -> dict:
    """The figures of one run's report.json that the table shows."""
    starts = report.get("starts") or []
    best = max((s for s in starts if s.get("speedup") and s.get("feasible")),
               key=lambda s: s["speedup"], default=None)
    recipe = next((s for s in starts if str(s.get("name", "")).startswith("recipe")), None)
    st = report.get("search_statistics") or {}
    rf = report.get("recipe_file") or {}
    tuned_vs_file = (rf.get("tuned_vs_file") or {}).get("ratio")
    return {
        "speedup": report.get("speedup"),
        "speedup_ci": report.get("speedup_ci"),
        "final_cut_short": (report.get("final_comparison") or {}).get("cut_short", False),
        "best_start": best and best["name"],
        "best_start_speedup": best and best["speedup"],
        "float_start_speedup": next((s.get("speedup") for s in starts
                                     if s.get("name") == "float"), None),
        "descent_gain": (report["speedup"] / best["speedup"]
                         if best and report.get("speedup") else None),
        "recipe_start_speedup": recipe and recipe.get("speedup"),
        "recipe_file_vs_tuned": 1.0 / tuned_vs_file if tuned_vs_file else None,
        "wall_s": round(wall_s, 1),
        "elapsed_s": report.get("elapsed_s"),
        "measurements": report.get("measurements"),
        "measurements_by_phase": report.get("measurements_by_phase"),
        "trials": st.get("complete"),
        "ab_compared": st.get("ab_compared"),
        "subgraph": {k: st.get(k, 0) for k in (
            "subgraph_screened_out", "subgraph_compared", "subgraph_agreed",
            "subgraph_slower_audited", "subgraph_slower_right")},
    }


def tune_once(name: str, config: Config, timeout: float, work: Path) -> dict:
    model = real_models.fetch(name)
    t0 = time.monotonic()
    result = qdq_optuna.tune(str(model), work, config=config, timeout=timeout, fresh=True,
                             input_shapes=real_models.MODELS[name].input_shapes or None,
                             progress=False)
    return summarize(result.report, time.monotonic() - t0)


def pairs(name: str, k: int, seed: int = 0) -> dict:
    """The region's and the whole model's A/B verdicts of ``k`` one-tensor moves."""
    import random

    import onnx

    from qdq_optuna import PreparedModel
    from qdq_optuna.backends import make_backend
    from qdq_optuna.measure import kernels
    from qdq_optuna.measure.timing import Measurer, TimingProtocol
    from qdq_optuna.placement import starts

    pm = PreparedModel.prepare(str(real_models.fetch(name)),
                               input_shapes=real_models.MODELS[name].input_shapes or None)
    ex = pm.exporter()
    uses = set(starts.all_on_start(pm).scheme_uses)
    full = ex.plan(uses)
    tensors = sorted({u[0] for u in uses})
    backend = make_backend("onnxruntime")
    whole = Measurer(backend, TimingProtocol.robust())
    region = Measurer(backend, kernels.KERNEL_PROTOCOL)
    full_bytes = ex.to_bytes(full)
    rows = []
    for tensor in random.Random(seed).sample(tensors, min(k, len(tensors))):
        less = ex.plan({u for u in uses if u[0] != tensor})
        less_bytes = ex.to_bytes(less)
        t0 = time.monotonic()
        sub = kernels.time_region(region, pm.graph, onnx.load_from_string(full_bytes),
                                  onnx.load_from_string(less_bytes), full, less)
        t1 = time.monotonic()
        whole.screen(full_bytes)  # as in the descent: the candidate's screen, then its A/B
        cmp = whole.compare(full_bytes, less_bytes)
        t2 = time.monotonic()
        rows.append({"tensor": tensor, "region": sub and sub.to_dict(),
                     "region_s": round(t1 - t0, 2), "whole_s": round(t2 - t1, 2),
                     "whole": {"ratio": cmp.ratio, "ci": [cmp.ci_low, cmp.ci_high],
                               "rounds": cmp.rounds, "verdict": cmp.verdict},
                     "agrees": sub is not None and _side(sub.verdict) == _side(cmp.verdict),
                     "same_direction": sub is not None and (sub.ratio < 1) == (cmp.ratio < 1),
                     "contradicts": sub is not None and {_side(sub.verdict), _side(cmp.verdict)}
                     == {"faster", "slower"}})
        print(json.dumps(rows[-1]), flush=True)
    timed = [r for r in rows if r["region"]]
    slower = [r for r in timed if r["region"]["verdict"] == "slower"]
    return {"model": name, "pairs": rows, "timed": len(timed),
            "agreed": sum(r["agrees"] for r in timed),
            "same_direction": sum(r["same_direction"] for r in timed),
            "contradicts": sum(r["contradicts"] for r in timed),
            "region_slower": len(slower),
            "drops_right": sum(r["whole"]["verdict"] != "faster" for r in slower),
            "region_s": round(sum(r["region_s"] for r in rows), 1),
            "whole_s": round(sum(r["whole_s"] for r in rows), 1)}


def _side(verdict: str) -> str:
    """faster, slower, or neither (same, undecided, not faster)."""
    return verdict if verdict in ("faster", "slower") else "neither"


def drops(pairs_: list[dict]) -> tuple[int, int]:
    """Both ways of each pair (adding the Q/DQ, and removing it: the inverse verdicts): how
    often the region measured the move slower, and how often the whole model then was not
    faster either (the screen's drop was right)."""
    inverse = {"faster": "slower", "slower": "faster"}
    slower = right = 0
    for p in pairs_:
        if not p["region"]:
            continue
        for region, whole in ((p["region"]["verdict"], p["whole"]["verdict"]),
                              (inverse.get(p["region"]["verdict"]),
                               inverse.get(p["whole"]["verdict"]))):
            if region == "slower":
                slower += 1
                right += whole != "faster"
    return slower, right


def pairs_table(results: list[dict]) -> str:
    head = ["model", "pairs timed", "verdicts agreed", "same side of 1", "opposite verdicts",
            "region slower (both ways)", "drops right", "region A/B s", "whole A/B s"]
    rows = []
    for r in results:
        slower, right = drops(r["pairs"])
        rows.append([r["model"], str(r["timed"]), f"{r['agreed']}/{r['timed']}",
                     f"{r['same_direction']}/{r['timed']}", str(r["contradicts"]), str(slower),
                     f"{right}/{slower}", str(r["region_s"]), str(r["whole_s"])])
    return _common.markdown_table(head, rows)


def table(rows: list[dict]) -> str:
    head = ["model", "screen", "best start", "final", "descent", "recipe start", "wall s",
            "measured", "trials", "screened out", "agreed", "drops right"]
    lines = []
    for r in rows:
        s, sub = r["run"], r["run"]["subgraph"]
        agreed = (f"{sub['subgraph_agreed']}/{sub['subgraph_compared']}"
                  if sub["subgraph_compared"] else "-")
        right = (f"{sub['subgraph_slower_right']}/{sub['subgraph_slower_audited']}"
                 if sub["subgraph_slower_audited"] else "-")
        lines.append([r["model"], r["screen"],
                      f"{s['best_start']} {_x(s['best_start_speedup'])}", _x(s["speedup"]),
                      _x(s["descent_gain"]), _x(s["recipe_start_speedup"]),
                      f"{s['wall_s']:.0f}", str(s["measurements"]), str(s["trials"]),
                      str(sub["subgraph_screened_out"]), agreed, right])
    return _common.markdown_table(head, lines)


def _x(v) -> str:
    return "-" if v is None else f"{v:.3f}x"



def write_results(out: Path, key: str, rows: list, title: str, markdown_table: str) -> None:
    """The results so far as JSON and Markdown (rewritten after each row: a cut run keeps
    what it measured)."""
    data = {"cpu": current_cpu().to_json(), "runtime": "onnxruntime CPU, 1 thread", key: rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(data, indent=2, default=str))
    out.with_suffix(".md").write_text(f"# {title}, ONNX Runtime CPU (1 thread)\n\nCPU: "
                                      f"{json.dumps(data['cpu'])}\n\n{markdown_table}\n")

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["inception-v1-caffe2-light", "nudenet-320n",
                                                     "ppocr-det"])
    ap.add_argument("--timeout", type=float, nargs="+", default=[300.0],
                    help="seconds per run: one value, or one per model")
    ap.add_argument("--screens", nargs="+", default=["off", "on"],
                    choices=["off", "on", "audit"])
    ap.add_argument("--out", type=Path, default=_common.RESULTS / "subgraph_screen")
    ap.add_argument("--max-load", type=float, default=1.5)
    ap.add_argument("--pairs", type=int, default=0,
                    help="measure K one-tensor moves per model instead of tuning")
    args = ap.parse_args()
    if args.pairs:
        results = []
        for name in args.models:
            load = _common.wait_quiet(args.max_load)
            results.append({**pairs(name, args.pairs), "load": load})
            write_results(args.out, "pairs", results, "Subgraph screen agreement",
                          pairs_table(results))
        return
    timeouts = (args.timeout * len(args.models))[:len(args.models)] \
        if len(args.timeout) == 1 else args.timeout
    configs = {"off": Config(), "on": Config(subgraph_screen=True),
               "audit": Config(subgraph_screen=True, subgraph_screen_audit=True)}
    rows = []
    for name, timeout in zip(args.models, timeouts):
        for screen in args.screens:
            load = _common.wait_quiet(args.max_load)
            with tempfile.TemporaryDirectory() as work:
                run = tune_once(name, configs[screen], timeout, Path(work) / "run")
            rows.append({"model": name, "screen": screen, "timeout_s": timeout, "load": load,
                         "run": run})
            print(json.dumps(rows[-1]), flush=True)
            write_results(args.out, "rows", rows, "Subgraph screen", table(rows))


if __name__ == "__main__":
    main()
