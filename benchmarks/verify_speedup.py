"""Does the speedup in report.json hold up when someone else measures it?

For each model: ``qdq-optuna example NAME --size medium``, ``qdq-optuna tune --mode quick``
(default robust timing, isolated worker), then an *independent* re-measurement in a fresh
process that does not use qdq_optuna's timing code: plain onnxruntime, 1 intra-op thread,
ORT_ENABLE_ALL, sequential execution; ABBA-ordered rounds of one fresh session per model (5
warm-up runs, then the minimum of ``--runs`` timed runs); the first ``--warmup-rounds`` rounds
are dropped (a fresh process reads slow); speedup = 1 / geometric mean of the per-round ratios
tuned / float, with a t interval. The float model is the original file, not the preprocessed
copy the report times.

Verdicts: ``agree`` when the re-measured speedup is within ``--tolerance`` (3 %) of the
report's; ``not slower`` when the re-measured speedup is >= 1 or inside the reported interval.

    python benchmarks/verify_speedup.py --models resnet transformer mobilenet --out /tmp/verify
    python benchmarks/verify_speedup.py --isolation-overhead resnet --out /tmp/iso

Timing figures mean nothing on a busy machine: before every tuning run and re-measurement the
script waits until the 1-minute load average is below ``--max-load`` (1.2), polling every 10 s
for up to 20 min, and records the load before and after. Never run two benchmarks at once.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _common import REPO, load_now, markdown_table, wait_quiet  # noqa: F401  (shared)

# -- the independent re-measurement (runs in a fresh process) ----------------------------------


def _feeds(session, seed: int = 0) -> dict:
    import numpy as np

    rng = np.random.default_rng(seed)
    feeds = {}
    for inp in session.get_inputs():
        shape = [d if isinstance(d, int) and d > 0 else 1 for d in inp.shape]
        if inp.type == "tensor(float)":
            feeds[inp.name] = rng.standard_normal(shape).astype(np.float32)
        elif inp.type == "tensor(int64)":
            feeds[inp.name] = np.zeros(shape, np.int64)
        elif inp.type == "tensor(int32)":
            feeds[inp.name] = np.zeros(shape, np.int32)
        else:
            raise SystemExit(f"input {inp.name}: type {inp.type} not handled by this script")
    return feeds


#: inputs the re-measurement feeds (one sample of each input, from --feeds FILE.npz); random
#: inputs with dynamic dims set to 1 otherwise
FEEDS: dict | None = None
#: session config entries for the first and the second model of a re-measurement
#: (``--a-config``, ``--b-config``): the settings a tuned model shipped with (report.json
#: ``session_settings.shipped.entries``)
A_CONFIG: dict[str, str] = {}
B_CONFIG: dict[str, str] = {}


def shipped_settings(report: dict) -> dict[str, str]:
    """The session config entries a run shipped its model with (none: {})."""
    shipped = (report.get("session_settings") or {}).get("shipped") or {}
    return dict(shipped.get("entries") or {})


def config_args(entries: dict[str, str], which: str) -> list[str]:
    """``--a-config KEY=VALUE`` (``which`` "a") or ``--b-config`` arguments for
    :func:`remeasure_in_fresh_process`."""
    return [a for k, v in entries.items() for a in (f"--{which}-config", f"{k}={v}")]


def _session_min(path: str, warmup: int, runs: int, config: dict[str, str] | None = None
                 ) -> float:
    import onnxruntime as ort

    so = ort.SessionOptions()
    for key, value in (config or {}).items():
        so.add_session_config_entry(key, value)
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    sess = ort.InferenceSession(path, sess_options=so, providers=["CPUExecutionProvider"])
    feeds = dict(FEEDS) if FEEDS is not None else _feeds(sess)
    for _ in range(warmup):
        sess.run(None, feeds)
    best = math.inf
    for _ in range(runs):
        t0 = time.perf_counter()
        sess.run(None, feeds)
        best = min(best, (time.perf_counter() - t0) * 1e3)
    return best


def _t975(df: int) -> float:
    try:
        from scipy.stats import t

        return float(t.ppf(0.975, df))
    except ImportError:  # pragma: no cover - scipy is in the test extras
        return 1.96 + 2.4 / max(df, 1)


def remeasure(float_path: str, tuned_path: str, rounds: int, warmup_rounds: int,
              runs: int) -> dict:
    """ABBA rounds of fresh sessions; ratio tuned / float per round."""
    ratios, f_mins, t_mins = [], [], []
    t0 = time.perf_counter()
    for r in range(warmup_rounds + rounds):
        order = ("f", "t") if r % 2 == 0 else ("t", "f")
        got = {k: _session_min(float_path, 5, runs, A_CONFIG) if k == "f" else
               _session_min(tuned_path, 5, runs, B_CONFIG) for k in order}
        if r < warmup_rounds:
            continue
        f_mins.append(got["f"])
        t_mins.append(got["t"])
        ratios.append(got["t"] / got["f"])
    logs = [math.log(x) for x in ratios]
    mean = statistics.fmean(logs)
    half = _t975(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return {
        "float_ms": statistics.median(f_mins),
        "tuned_ms": statistics.median(t_mins),
        "speedup": math.exp(-mean),
        "speedup_ci": [math.exp(-(mean + half)), math.exp(-(mean - half))],
        "rounds": rounds,
        "dropped_warmup_rounds": warmup_rounds,
        "runs_per_session": runs,
        "ratios": [round(x, 5) for x in ratios],
        "seconds": round(time.perf_counter() - t0, 1),
        "a_config": dict(A_CONFIG),
        "b_config": dict(B_CONFIG),
    }


def remeasure_in_fresh_process(float_path: Path, tuned_path: Path, args,
                               feeds: Path | None = None,
                               second_config: dict[str, str] | None = None,
                               first_config: dict[str, str] | None = None) -> dict:
    """``first_config`` / ``second_config``: session config entries for the first / second
    model's sessions (the settings its run shipped it with)."""
    cmd = [sys.executable, __file__, "--remeasure", str(float_path), str(tuned_path),
           "--rounds", str(args.rounds), "--warmup-rounds", str(args.warmup_rounds),
           "--runs", str(args.runs)] + (["--feeds", str(feeds)] if feeds else []) + \
        config_args(first_config or {}, "a") + config_args(second_config or {}, "b")
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- driving qdq-optuna -------------------------------------------------------------------------


def cli(*args: str | Path, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "qdq_optuna", *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return proc


def trial_seconds(out: Path) -> list[float]:
    """Durations of the run's finished trials, from its storage."""
    import optuna
    from optuna.trial import TrialState

    from qdq_optuna.record.storage import open_storage

    storage = open_storage(f"sqlite:///{out / 'studies.db'}", heartbeat=False)
    secs = []
    for s in storage.get_all_studies():
        if s.study_name.endswith("/_run") or "/" not in s.study_name:
            continue  # the run's bookkeeping and its overview
        study = optuna.load_study(study_name=s.study_name, storage=storage)
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            if t.datetime_start and t.datetime_complete:
                secs.append((t.datetime_complete - t.datetime_start).total_seconds())
    return secs


def tune(model: Path, out: Path, args, *extra: str) -> dict:
    gate = wait_quiet(args.max_load)
    t0 = time.monotonic()
    cli("tune", "--model", model, "--output", out, "--mode", args.mode, "--fresh", "-q", *extra)
    wall = time.monotonic() - t0
    report = json.loads((out / "report.json").read_text())
    secs = trial_seconds(out)
    return {"report": report, "wall_s": round(wall, 1), "load": {**gate, "load_after":
            load_now()}, "trial_seconds_mean": statistics.fmean(secs) if secs else None,
            "trials": len(secs)}


def verify(args) -> dict:
    rows = []
    for name in args.models:
        work = Path(args.out) / name
        work.mkdir(parents=True, exist_ok=True)
        model = work / f"{name}.onnx"
        cli("example", name, model, "--size", args.size)
        print(f"{name}: tuning ({args.mode}) ...", flush=True)
        run = tune(model, work / "run", args)
        report = run["report"]
        print(f"{name}: re-measuring in a fresh process ...", flush=True)
        gate = wait_quiet(args.max_load)
        again = remeasure_in_fresh_process(model, work / "run" / "optimized.onnx", args)
        again["load"] = {**gate, "load_after": load_now()}
        claimed, (lo, hi) = report["speedup"], report["speedup_ci"]
        diff = (again["speedup"] / claimed - 1) * 100
        agree = abs(diff) <= args.tolerance
        not_slower = again["speedup"] >= 1.0 or (lo is not None and again["speedup"] >= lo)
        rows.append({
            "model": f"{name} ({args.size})",
            "claimed": {"speedup": claimed, "ci": [lo, hi],
                        "baseline_ms": report["baseline_latency_ms"],
                        "tuned_ms": report["final_latency_ms"],
                        "rounds": report["final_comparison"]["rounds"]},
            "remeasured": again,
            "difference_pct": diff,
            "agree": agree,
            "not_slower_than_reported": not_slower,
            "verdict": "PASS" if agree and not_slower else "FAIL",
            "tune": {"wall_s": run["wall_s"], "load": run["load"], "trials": run["trials"],
                     "trial_seconds_mean": run["trial_seconds_mean"],
                     "search_statistics": report.get("search_statistics"),
                     "measurements": report["measurements"],
                     "quantized_tensors": len(report["quantized_tensors"])},
        })
        print_row(rows[-1])
    return {"rows": rows}


def print_row(r: dict) -> None:
    c, m = r["claimed"], r["remeasured"]
    print(f"  {r['model']:<22} claimed {c['speedup']:.3f}x ({c['ci'][0]:.3f}-{c['ci'][1]:.3f})  "
          f"re-measured {m['speedup']:.3f}x ({m['speedup_ci'][0]:.3f}-{m['speedup_ci'][1]:.3f})  "
          f"diff {r['difference_pct']:+.1f} %  {r['verdict']}", flush=True)


def table(rows: list[dict]) -> str:
    header = ["model", "claimed speedup (95 % CI)", "re-measured speedup (95 % CI)", "difference",
              "verdict", "load before/after tune, re-measure"]
    cells = []
    for r in rows:
        c, m, tl = r["claimed"], r["remeasured"], r["tune"]["load"]
        cells.append([
            r["model"], f"{c['speedup']:.3f}x ({c['ci'][0]:.3f}–{c['ci'][1]:.3f})",
            f"{m['speedup']:.3f}x ({m['speedup_ci'][0]:.3f}–{m['speedup_ci'][1]:.3f})",
            f"{r['difference_pct']:+.1f} %", r["verdict"],
            f"{tl['load_before']}/{tl['load_after']}, "
            f"{m['load']['load_before']}/{m['load']['load_after']}"])
    return markdown_table(header, cells)


# -- isolation overhead --------------------------------------------------------------------------


def isolation_overhead(args) -> dict:
    """Seconds per trial of a quick run with and without the worker process, and seconds per
    interleaved comparison of the same two models through each backend (alternating)."""
    name = args.isolation_overhead
    work = Path(args.out) / f"isolation-{name}"
    work.mkdir(parents=True, exist_ok=True)
    model = work / f"{name}.onnx"
    cli("example", name, model, "--size", args.size)
    runs = {}
    for label, flag in (("isolated", "--isolate"), ("in-process", "--no-isolate")):
        print(f"{name}: tune {flag} ...", flush=True)
        r = tune(model, work / label, args, flag)
        runs[label] = {k: r[k] for k in ("wall_s", "trials", "trial_seconds_mean", "load")}
        runs[label]["speedup"] = r["report"]["speedup"]
    # the same comparison through both backends, alternating, so drift hits both alike
    from qdq_optuna.backends import make_backend
    from qdq_optuna.measure.timing import Measurer, TimingProtocol

    float_bytes = model.read_bytes()
    tuned_bytes = (work / "isolated" / "optimized.onnx").read_bytes()
    backends = {"isolated": make_backend("onnxruntime", isolate=True),
                "in-process": make_backend("onnxruntime", isolate=False)}
    gate = wait_quiet(args.max_load)
    per: dict[str, list[float]] = {k: [] for k in backends}
    try:
        measurers = {k: Measurer(b, TimingProtocol.robust()) for k, b in backends.items()}
        for m in measurers.values():
            m.warm_up([float_bytes, tuned_bytes])
        for _ in range(args.overhead_repeats):
            for k, m in measurers.items():
                t0 = time.perf_counter()
                m.compare(tuned_bytes, float_bytes)
                per[k].append(time.perf_counter() - t0)
    finally:
        for b in backends.values():
            b.close()
    compare = {k: {"median_s": statistics.median(v), "samples_s": [round(x, 3) for x in v]}
               for k, v in per.items()}
    iso, inp = runs["isolated"]["trial_seconds_mean"], runs["in-process"]["trial_seconds_mean"]
    out = {"model": f"{name} ({args.size})", "runs": runs, "compare": compare,
           "compare_load": {**gate, "load_after": load_now()},
           "trial_overhead_pct": (iso / inp - 1) * 100 if iso and inp else None,
           "compare_overhead_pct": (compare["isolated"]["median_s"]
                                    / compare["in-process"]["median_s"] - 1) * 100}
    print(json.dumps({k: v for k, v in out.items() if k != "runs"}, indent=1))
    for label, r in runs.items():
        print(f"  {label:<11} {r['trials']} trials, {r['trial_seconds_mean']:.3f} s/trial, "
              f"run {r['wall_s']} s, load {r['load']['load_before']}->{r['load']['load_after']}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["resnet", "transformer", "mobilenet"])
    ap.add_argument("--size", default="medium", choices=["small", "medium", "full"])
    ap.add_argument("--mode", default="quick", choices=["quick", "default", "extensive"])
    ap.add_argument("--out", default="verify-speedup-out")
    ap.add_argument("--json", help="results file (default OUT/verify_speedup.json)")
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--warmup-rounds", type=int, default=3)
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--tolerance", type=float, default=3.0, help="agreement band in %%")
    ap.add_argument("--max-load", type=float, default=1.2)
    ap.add_argument("--isolation-overhead", metavar="MODEL",
                    help="measure the worker process's cost instead (tune with and without)")
    ap.add_argument("--overhead-repeats", type=int, default=6)
    ap.add_argument("--remeasure", nargs=2, metavar=("FLOAT", "TUNED"), help=argparse.SUPPRESS)
    ap.add_argument("--feeds", help=argparse.SUPPRESS)
    ap.add_argument("--a-config", action="append", default=[], help=argparse.SUPPRESS)
    ap.add_argument("--b-config", action="append", default=[], help=argparse.SUPPRESS)
    args = ap.parse_args()
    A_CONFIG.update(item.split("=", 1) for item in args.a_config)
    B_CONFIG.update(item.split("=", 1) for item in args.b_config)
    if args.feeds:
        import numpy as np

        global FEEDS
        with np.load(args.feeds) as data:
            FEEDS = {k: data[k][:1] for k in data.files}
    if args.remeasure:
        print(json.dumps(remeasure(*args.remeasure, args.rounds, args.warmup_rounds, args.runs)))
        return
    import onnxruntime

    meta = {"machine": platform.machine(), "cpus": os.cpu_count(), "python": sys.version.split()[0],
            "onnxruntime": onnxruntime.__version__, "command": " ".join(sys.argv),
            "max_load": args.max_load}
    if args.isolation_overhead:
        result = {**meta, **isolation_overhead(args)}
        path = Path(args.json or Path(args.out) / "isolation_overhead.json")
    else:
        result = {**meta, **verify(args)}
        print()
        print(table(result["rows"]))
        path = Path(args.json or Path(args.out) / "verify_speedup.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
