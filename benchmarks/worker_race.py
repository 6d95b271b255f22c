"""Several ``--worker`` processes on one run, over and over: any internal error, lost trial or
trial counted twice?

Each run starts ``--workers`` ``qdq-optuna tune --worker`` processes on one run id in a shared
storage (a fresh SQLite file, or ``--postgres URL``), on the zoo's tiny residual model with the
``costmodel`` backend (trials take milliseconds, so the workers race on every trial), while
``--busy`` processes of this script keep the CPUs busy and a short heartbeat grace period
(``--grace``) lets a worker that falls behind look dead to the others. A run passes when every
worker exits 0 with no traceback on stderr, writes a report of the whole run, and the storage
holds every pattern visit within its budget with no model measured twice, nothing left running
and no trial failed (the checks of ``qdq_optuna.record.visit_problems``).

    python benchmarks/worker_race.py --runs 50                       # SQLite
    python benchmarks/worker_race.py --runs 50 --postgres postgresql://u:p@127.0.0.1/db

Writes ``benchmarks/results/worker_race.json`` (per storage: runs, failures and what failed).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _burn(stop) -> None:  # a busy CPU until told to stop
    while not stop.is_set():
        sum(i * i for i in range(20000))


def _studies(url: str, run_id: str) -> dict:
    import optuna

    from qdq_optuna.record.storage import open_storage

    storage = open_storage(url, heartbeat=False)
    return {s.study_name.split("/", 1)[1]: optuna.load_study(study_name=s.study_name,
                                                             storage=storage)
            for s in storage.get_all_studies() if s.study_name.startswith(run_id + "/")}


def check_run(url: str, run_id: str, budget: int) -> list[str]:
    """What is wrong with the stored run (empty: nothing)."""
    from optuna.trial import TrialState

    from qdq_optuna.record import is_visit, visit_problems

    problems = []
    studies = _studies(url, run_id)
    visits = {k: s for k, s in studies.items() if is_visit(k)}
    if not visits:
        return ["no visit stored"]
    starts = studies.get("_starts")
    if starts is not None:
        names = [t.user_attrs.get("start") for t in starts.get_trials(deepcopy=False)]
        if len(names) != len(set(names)):
            problems.append("a start was written twice")
    for name, study in visits.items():
        problems += visit_problems(name, study, budget)
        for t in study.get_trials(deepcopy=False, states=(TrialState.FAIL,)):
            problems.append(f"{name}: trial {t.number} failed: {t.user_attrs.get('failure')}")
    return problems


def one_run(model: Path, work: Path, url: str, args) -> dict:
    run_id = f"race-{uuid.uuid4().hex[:10]}"
    env = {**os.environ, "QDQ_OPTUNA_HEARTBEAT_GRACE": str(args.grace)}
    procs = []
    for w in range(args.workers):
        argv = [sys.executable, "-m", "qdq_optuna", "tune", "--model", str(model),
                "--output", str(work / run_id / f"w{w}"), "--backend", "costmodel",
                "--runtime", "tensorrt", "--storage", url, "--worker", "--run-id", run_id,
                "--schemes-per-region", str(args.budget), "-q"]
        procs.append(subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    problems, started = [], time.monotonic()
    for w, p in enumerate(procs):
        try:
            _, err = p.communicate(timeout=max(1.0, args.timeout - (time.monotonic() - started)))
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
            problems.append(f"worker {w} still running after {args.timeout} s")
        if p.returncode != 0 or "Traceback" in err or "Error" in err:
            last = [ln for ln in err.splitlines() if ln.strip()][-3:]
            problems.append(f"worker {w} exit {p.returncode}: {' | '.join(last)}")
        elif not (work / run_id / f"w{w}" / "report.json").exists():
            problems.append(f"worker {w} wrote no report")
    if not problems:
        problems = check_run(url, run_id, args.budget)
    return {"run_id": run_id, "seconds": round(time.monotonic() - started, 1),
            "problems": problems}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--budget", type=int, default=6, help="--schemes-per-region")
    ap.add_argument("--grace", type=int, default=3, help="heartbeat grace period, seconds")
    ap.add_argument("--busy", type=int, default=1, help="busy processes beside the workers")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per run")
    ap.add_argument("--postgres", help="a PostgreSQL URL: race there instead of SQLite")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results"
                    / "worker_race.json")
    args = ap.parse_args()

    import onnx

    from qdq_optuna._files import atomic_write_bytes
    from qdq_optuna.examples import zoo

    storage = "postgresql" if args.postgres else "sqlite"
    stop = multiprocessing.Event()
    burners = [multiprocessing.Process(target=_burn, args=(stop,), daemon=True)
               for _ in range(args.busy)]
    for b in burners:
        b.start()
    runs = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            model = work / "tiny_residual.onnx"
            onnx.save(zoo.build("tiny_residual"), str(model))
            for i in range(args.runs):
                url = args.postgres or f"sqlite:///{work / f'race{i}.db'}"
                runs.append(one_run(model, work, url, args))
                r = runs[-1]
                print(f"{storage} run {i + 1}/{args.runs}: {r['seconds']} s, "
                      f"{'ok' if not r['problems'] else r['problems']}", flush=True)
    finally:
        stop.set()
        for b in burners:
            b.join(timeout=10)
    failed = [r for r in runs if r["problems"]]
    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    results[storage] = {"runs": len(runs), "workers": args.workers, "budget": args.budget,
                        "grace_s": args.grace, "busy": args.busy, "failed_runs": len(failed),
                        "failures": failed, "machine": platform.processor() or platform.machine(),
                        "cpus": os.cpu_count(), "median_s": sorted(
                            r["seconds"] for r in runs)[len(runs) // 2] if runs else None}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(args.out, (json.dumps(results, indent=1) + "\n").encode())
    print(f"{storage}: {len(failed)} of {len(runs)} runs failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
