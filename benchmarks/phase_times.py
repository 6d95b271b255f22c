"""Where a tune's wall time goes, per phase, and what it bought: before/after a change.

Runs ``qdq-optuna tune`` (ONNX Runtime CPU, default mode, one thread, seed 0, no calibration
data: random inputs) on real models of ``benchmarks/real_models.py`` with the checkout given by
``--checkout`` (its ``qdq_optuna`` on ``PYTHONPATH``), one model after the other, and writes
one row per model: wall time, report.json's ``wall_time`` per phase, the descent's visits,
commits and gain, the final speedup and its interval. Each arm gets a kernel cache of its own
(empty at the start), so no arm reads timings another one paid for.

Then ``--ab BEFORE AFTER`` times the two arms' ``optimized.onnx`` against each other in a
fresh process (``verify_speedup.remeasure``: plain onnxruntime, ABBA rounds of fresh
sessions, each file with the session settings its run shipped it with; a run tuned for
OpenVINO (``--tune-args "-b openvino"``): OpenVINO CPU with the run's precision hint,
alternating fresh compiled models), which is the only fair way to
compare two finals: each run's own speedup is against its own baseline, measured minutes
apart on a shared machine.

    python benchmarks/phase_times.py run --arm before --checkout /path/to/old --work DIR
    python benchmarks/phase_times.py run --arm after --checkout . --work DIR
    python benchmarks/phase_times.py ab --work DIR --arms before after \
        --out benchmarks/results/phase_times.json
    python benchmarks/phase_times.py table benchmarks/results/phase_times.json

Never run two benchmarks at once: every figure here is a wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import real_models
import verify_speedup
from _common import load_now, machine, markdown_table

MODELS = ("inception-v1-caffe2-light", "inception-v2-caffe2-light", "densenet121-caffe2-light",
          "shufflenet-caffe2-light", "squeezenet-caffe2-light", "nudenet-320n")
PHASES = ("preparing", "baseline", "starts", "descent", "recipe_file", "session_settings",
          "final")


def run_arm(arm: str, checkout: Path, work: Path, models: list[str],
            tune_args: list[str] = ()) -> list[dict]:
    rows = []
    work = work.resolve()
    for name in models:
        out = work / arm / name
        env = {**os.environ, "PYTHONPATH": str(checkout.resolve()),
               "QDQ_OPTUNA_KERNEL_CACHE": str(work / arm / "kernels.json")}
        shapes = real_models.MODELS[name].input_shapes
        load = load_now()
        t0 = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "qdq_optuna", "tune", "-m", real_models.fetch(name), "-o",
             out, "--input-shapes", shapes, "--seed", "0", "-q", "--fresh",
             *tune_args],
            # in the checkout: ``python -m`` puts the working folder ahead of PYTHONPATH, so
            # an arm started from another checkout ran that one's code
            env=env, capture_output=True, text=True, cwd=checkout.resolve())
        wall = time.monotonic() - t0
        row = {"model": name, "arm": arm, "rc": done.returncode, "wall_s": round(wall, 1),
               "load_1min": [load, load_now()]}
        if done.returncode == 0:
            row.update(summarize(out))
        else:
            row["stderr"] = done.stderr[-2000:]
        print(json.dumps(row), flush=True)
        rows.append(row)
    (work / f"{arm}.json").write_text(json.dumps(rows, indent=1))
    return rows


def summarize(out: Path) -> dict:
    """One run folder's figures (report.json)."""
    r = json.loads((out / "report.json").read_text())
    lanes = (r.get("descent") or {}).get("lanes") or {}
    lane = next(iter(lanes.values()), {})
    return {"phases_s": {k: v["seconds"] for k, v in (r.get("wall_time") or {}).items()},
            "visits": lane.get("visits"), "commits": lane.get("changed"),
            "descent_gain": lane.get("gain"), "start": lane.get("start"),
            "speedup": r["speedup"], "speedup_ci": r.get("speedup_ci"),
            "final_ms": r["final_latency_ms"], "baseline_ms": r["baseline_latency_ms"],
            "limit": limit_terms(r), "folder": str(out)}


def limit_terms(r: dict) -> dict | None:
    """The limit estimate in the final A/B's terms, as report.md gives it (``final_terms``):
    the limit, the shipped model's gap to it, and the conversions priced in it (None: no
    limit)."""
    from qdq_optuna.outputs.limit import final_terms

    t = final_terms(r)
    if t is None:
        return None
    lim = r["limit"]
    return {"limit_ms": round(t["limit_ms"], 4), "gap": round(t["gap"], 4),
            "conversions": lim.get("conversions"), "conversions_ms": lim.get("conversions_ms"),
            "kept_for_conversions": len(lim.get("kept_for_conversions") or ())}


def ab(work: Path, models: list[str], rounds: int, arms: tuple[str, str]) -> list[dict]:
    """The second arm's optimized.onnx against the first's, in a fresh process (speedup > 1:
    the second is faster)."""
    out = []
    args = argparse.Namespace(rounds=rounds, warmup_rounds=2, runs=20)
    for name in models:
        before = work / arms[0] / name / "optimized.onnx"
        after = work / arms[1] / name / "optimized.onnx"
        if before.is_file() and after.is_file():
            first, second = (json.loads((f.parent / "report.json").read_text())
                             for f in (before, after))
            backend = second.get("backend")
            timer = AB_BY_RUNTIME.get(backend.get("name")) if isinstance(backend, dict) else None
            # each file with the session settings its run shipped it with
            m = (timer(before, after, backend, rounds) if timer is not None
                 else verify_speedup.remeasure_in_fresh_process(
                     before, after, args, first_config=verify_speedup.shipped_settings(first),
                     second_config=verify_speedup.shipped_settings(second)))
            out.append({"model": name, "after_vs_before": m})
            print(name, round(m["speedup"], 4), [round(x, 4) for x in m["speedup_ci"]],
                  flush=True)
    return out


def openvino_ab(before: Path, after: Path, runtime: dict, rounds: int) -> dict:
    """The two files on OpenVINO CPU as the run measured them (``runtime``: its report.json
    ``backend``, for the precision hint and input shapes; one thread): alternating fresh
    compiled models, two warm-up rounds dropped."""
    import math
    import statistics

    from openvino_vs_nncf import interleaved

    shapes = ",".join(f"{k}:{'x'.join(map(str, v))}"
                      for k, v in (runtime.get("input_shapes") or {}).items()) or None
    hint = runtime.get("inference_precision") or "f32"
    mins = interleaved({"before": (before, hint), "after": (after, hint)}, shapes,
                       rounds + 2, 20, 2)
    logs = [math.log(a / b) for a, b in zip(mins["after"], mins["before"])]
    mean = statistics.fmean(logs)
    half = verify_speedup._t975(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return {"speedup": math.exp(-mean), "speedup_ci": [math.exp(-(mean + half)),
                                                        math.exp(-(mean - half))],
            "runtime": f"openvino {hint}", "rounds": rounds}


#: runtimes whose files are A/B-timed on that runtime (any other: ONNX Runtime)
AB_BY_RUNTIME = {"openvino": openvino_ab}


def table(result: dict) -> str:
    first, second = result.get("arms", ("before", "after"))
    by = {(r["model"], r["arm"]): r for r in result["runs"]}
    abs_ = {r["model"]: r["after_vs_before"] for r in result.get("ab", [])}
    rows = []
    for name in dict.fromkeys(r["model"] for r in result["runs"]):
        b, a = by.get((name, first)), by.get((name, second))
        if not b or not a or "phases_s" not in b or "phases_s" not in a:
            continue
        cells = [name]
        for key in ("wall_s",):
            cells.append(f"{b[key]:.0f} -> {a[key]:.0f}")
        for phase in ("starts", "descent", "recipe_file", "final"):
            cells.append(f"{b['phases_s'].get(phase, 0):.0f} -> {a['phases_s'].get(phase, 0):.0f}")
        cells.append(f"{b['visits']}/{b['commits']} -> {a['visits']}/{a['commits']}")
        cells.append(f"{b['descent_gain']:.3f} -> {a['descent_gain']:.3f}")
        cells.append(f"{b['speedup']:.3f} -> {a['speedup']:.3f}")
        cells.append(" -> ".join(f"{x['limit']['gap']:+.1%}" if x.get("limit") else "-"
                                 for x in (b, a)))
        m = abs_.get(name)
        cells.append(f"{m['speedup']:.3f} ({m['speedup_ci'][0]:.3f}-{m['speedup_ci'][1]:.3f})"
                     if m else "-")
        rows.append(cells)
    return f"{first} -> {second}\n\n" + markdown_table(
        ["model", "wall s", "starts s", "descent s", "recipe file s", "final A/B s",
         "visits/commits", "descent gain", "speedup (own run)", "gap to the limit",
         "after vs before (A/B)"], rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--arm", required=True)
    r.add_argument("--checkout", type=Path, required=True)
    r.add_argument("--work", type=Path, required=True)
    r.add_argument("--models", nargs="+", default=list(MODELS))
    r.add_argument("--tune-args", default="", help="more options for every tune, one string "
                   "(e.g. \"--max-output-error 0.2 --calibration-data cal.npz\")")
    c = sub.add_parser("collect", help="rows from run folders WORK/ARM/MODEL already tuned")
    c.add_argument("--work", type=Path, required=True)
    c.add_argument("--arm", required=True)
    c.add_argument("--walls", type=Path, help="a 'MODEL rc=0 wall=S' line per model")
    c.add_argument("--models", nargs="+", default=list(MODELS))
    a = sub.add_parser("ab")
    a.add_argument("--work", type=Path, required=True)
    a.add_argument("--models", nargs="+", default=list(MODELS))
    a.add_argument("--rounds", type=int, default=10)
    a.add_argument("--arms", nargs=2, default=["before", "after"])
    a.add_argument("--out", type=Path, required=True)
    t = sub.add_parser("table")
    t.add_argument("result", type=Path)
    args = ap.parse_args()
    if args.cmd == "run":
        run_arm(args.arm, args.checkout, args.work, args.models, args.tune_args.split())
    elif args.cmd == "collect":
        walls = {}
        if args.walls:
            for line in args.walls.read_text().splitlines():
                parts = dict(p.split("=", 1) for p in line.split()[1:] if "=" in p)
                if "wall" in parts:
                    walls[line.split()[0]] = float(parts["wall"])
        rows = [{"model": m, "arm": args.arm, "rc": 0, "wall_s": walls.get(m),
                 **summarize(args.work / args.arm / m)} for m in args.models
                if (args.work / args.arm / m / "report.json").is_file()]
        (args.work / f"{args.arm}.json").write_text(json.dumps(rows, indent=1))
    elif args.cmd == "ab":
        runs = [row for arm in args.arms
                for row in json.loads((args.work / f"{arm}.json").read_text())]
        result = {"machine": machine(), "arms": args.arms, "runs": runs,
                  "ab": ab(args.work, args.models, args.rounds, tuple(args.arms))}
        args.out.write_text(json.dumps(result, indent=1))
        print(table(result))
    else:
        print(table(json.loads(args.result.read_text())))


if __name__ == "__main__":
    main()
