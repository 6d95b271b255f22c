"""SIGTERM and SIGKILL at random moments of a real run: is the run resumable every time, is
there a report every time SIGTERM stopped it, and is nothing committed lost?

One output folder, one ``qdq-optuna tune -b costmodel`` command on a zoo model (the yolo-like
model at its full size by default: about 40 s a run on 2 cores, so a signal drawn from the
window lands while the run is going), run over and over: each attempt
is sent ``--signal`` (SIGTERM, SIGKILL or both, in a shuffled order) at a moment drawn uniformly from
``--window`` seconds after its start (``--from-open``: after it opened the run). An attempt
that finished the run before its signal does not count: attempts go on until ``--kills``
signals of each kind landed while a run was going (at most three times as many attempts).
After each attempt the script checks

* the exit code: 143 for SIGTERM, -9 for SIGKILL (0: the run finished before the signal);
* SIGTERM: ``report.json`` holds ``stopped`` (the report of what was known), ``state.yaml``
  says ``interrupted`` with how to resume, no ``studies.db-wal``/``-shm`` beside the file;
* every COMPLETE trial of the storage before the attempt is there after it, unchanged;
* the next attempt (the same command) resumes: it does not start over (its trials add to
  the storage's); an attempt that finished the run before its signal is counted as such, and
  the next one starts a new run (``--fresh``).

A last run of the same command finishes the run and is checked the same way (exit 0, a
complete report, nothing lost).

    python benchmarks/signal_check.py --kills 10            # until 10 SIGTERM + 10 SIGKILL landed
    python benchmarks/signal_check.py --kills 10 --from-open --window 0 30

Writes ``benchmarks/results/signal_check.json`` (per attempt: signal, moment, exit code, the
checks' outcome; a summary per signal).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def _trials(db: Path) -> dict[tuple[str, int], tuple]:
    """(study, number) -> (state, params, values), read with a connection closed at once."""
    if not db.exists():
        return {}
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)
    try:
        rows = con.execute(
            "SELECT s.study_name, t.number, t.state, "
            "(SELECT group_concat(p.param_name || '=' || p.param_value, ',') "
            " FROM trial_params p WHERE p.trial_id = t.trial_id), "
            "(SELECT group_concat(v.value, ',') FROM trial_values v "
            " WHERE v.trial_id = t.trial_id) "
            "FROM trials t JOIN studies s ON s.study_id = t.study_id").fetchall()
    finally:
        con.close()
    return {(study, number): tuple(rest) for study, number, *rest in rows}


def _lost(before: dict, after: dict) -> list[str]:
    return [f"{s}#{n}" for (s, n), row in before.items()
            if row[0] == "COMPLETE" and after.get((s, n)) != row]


def _check(out: Path, sig: int | None, returncode: int, err: str, before: dict,
           started: float) -> tuple[dict, dict]:
    """What held after one attempt (``sig`` None: the final run), and the trials after it.
    A SIGTERM that lands before the attempt opened the run (``state.yaml`` not written by
    it: Python's start-up, the model's preparation) leaves the folder as the attempt before
    left it, and is counted as ``before_open``."""
    after = _trials(out / "studies.db")
    opened = (out / "state.yaml").exists() and (out / "state.yaml").stat().st_mtime >= started
    problems: list[str] = []
    lost = _lost(before, after)
    if lost:
        problems.append(f"committed trials lost or changed: {lost[:5]}")
    if "Traceback" in err:
        problems.append("a traceback on stderr")
    state = yaml.safe_load((out / "state.yaml").read_text()) if (out / "state.yaml").exists() \
        else None
    report = json.loads((out / "report.json").read_text()) if (out / "report.json").exists() \
        else None
    # exit 0; or -15 with the run done: the signal came as the process ended, after its work
    # (the handlers are the command's while it runs)
    finished = returncode == 0 or (
        returncode == -signal.SIGTERM and bool(report and report.get("complete"))
        and bool(state and state["status"] == "done"))
    if finished:
        if not (report and report.get("complete") and state and state["status"] == "done"):
            problems.append("exit 0 without a complete report and state 'done'")
    elif sig == signal.SIGTERM:
        # -15: the signal came before Python ran any of ours (its start-up, the imports):
        # the default action, which a shell reports as 143 too; nothing of this attempt's
        if returncode != 128 + signal.SIGTERM and not (returncode == -signal.SIGTERM
                                                       and not opened):
            problems.append(f"exit {returncode}, not 143")
        if opened:  # else nothing of this attempt's to report: the earlier files stand
            # the report of what was known; a complete one when the signal landed after it
            # was written (in the run's last bookkeeping)
            if not (report and ("stopped" in report or report.get("complete"))):
                problems.append("no report of what was known")
            done = bool(state and state["status"] == "done" and report
                        and report.get("complete"))  # stopped in the run's last bookkeeping
            if not (state and state["status"] == "interrupted" and "resume" in state) \
                    and not done:
                problems.append(f"state.yaml says {state and state.get('status')!r}")
            left = sorted(p.name for p in out.glob("studies.db-*"))
            if left:
                problems.append(f"left beside the database: {left}")
    elif sig == signal.SIGKILL:
        if returncode != -signal.SIGKILL:
            problems.append(f"exit {returncode}, not -9")
    else:
        problems.append(f"the final run exited {returncode}: {err.strip()[-300:]}")
    if problems:  # what the process said, to see why
        problems.append("stderr: " + " | ".join(err.strip().splitlines()[-12:]))
    return {"exit": returncode, "finished": finished, "before_open": not opened,
            "complete_trials": sum(row[0] == "COMPLETE" for row in after.values()),
            "problems": problems}, after


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=10, help="attempts per signal")
    ap.add_argument("--signal", choices=("both", "SIGTERM", "SIGKILL"), default="both")
    ap.add_argument("--model", default="yolo", help="a zoo model")
    ap.add_argument("--size", default="full", help="the zoo model's size (full, small)")
    ap.add_argument("--window", type=float, nargs=2, default=(4.0, 14.0),
                    metavar=("FROM", "TO"), help="seconds after the start a signal lands")
    ap.add_argument("--from-open", action="store_true",
                    help="count the window from when the attempt opened the run (wrote "
                         "state.yaml, after the baseline), not from its start: on a loaded "
                         "machine the start-up alone can outlast the window")
    ap.add_argument("--seed", type=int, default=44)
    ap.add_argument("--output", type=Path,
                    default=REPO / "benchmarks" / "results" / "signal_check.json")
    args = ap.parse_args(argv)

    from qdq_optuna.examples import zoo

    rng = random.Random(args.seed)
    signals = {"both": [signal.SIGTERM, signal.SIGKILL], "SIGTERM": [signal.SIGTERM],
               "SIGKILL": [signal.SIGKILL]}[args.signal]
    landed = {s: 0 for s in signals}  # signals that landed while a run was going
    attempts = []
    with tempfile.TemporaryDirectory(prefix="signal_check_") as tmp:
        model = Path(tmp) / f"{args.model}.onnx"
        import onnx

        onnx.save(zoo.build(args.model, args.size), str(model))
        out = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "qdq_optuna", "tune", "-m", str(model), "-o", str(out),
               "-b", "costmodel", "-q"]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        before: dict = {}
        fresh = False  # the last attempt finished the run: the next one starts a new run
        while (min(landed.values()) < args.kills
               and len(attempts) < 3 * args.kills * len(signals)):
            sig = rng.choice([s for s in signals if landed[s] < args.kills])
            moment = rng.uniform(*args.window)
            started = time.time()
            proc = subprocess.Popen([*cmd, "--fresh"] if fresh else cmd, cwd=REPO, env=env,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                    text=True)
            if fresh:
                before, fresh = {}, False
            if args.from_open:  # the clock starts once this attempt wrote state.yaml
                while proc.poll() is None and not (
                        (out / "state.yaml").exists()
                        and (out / "state.yaml").stat().st_mtime >= started):
                    time.sleep(0.05)
            try:
                proc.wait(timeout=moment)
            except subprocess.TimeoutExpired:
                proc.send_signal(sig)
            _, err = proc.communicate(timeout=300)
            result, before = _check(out, sig, proc.returncode, err, before, started)
            attempts.append({"signal": signal.Signals(sig).name, "moment_s": round(moment, 2),
                             **result})
            print(json.dumps(attempts[-1]), flush=True)
            fresh = result["finished"]
            landed[sig] += not (fresh or result["before_open"])
        final = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                               timeout=600)
        final_result, _ = _check(out, None, final.returncode, final.stderr, before, 0.0)
    summary = {}
    for name in {a["signal"] for a in attempts}:
        mine = [a for a in attempts if a["signal"] == name]
        summary[name] = {"attempts": len(mine),
                         "stopped": sum(not a["finished"] for a in mine),
                         "landed_while_running": sum(not (a["finished"] or a["before_open"])
                                                     for a in mine),
                         "before_open": sum(a["before_open"] and not a["finished"]
                                            for a in mine),
                         "before_python_handler": sum(a["exit"] == -signal.SIGTERM
                                                      for a in mine),
                         "passed": sum(not a["problems"] for a in mine)}
    result = {"model": f"zoo {args.model} ({args.size})", "backend": "costmodel",
              "machine": f"{platform.machine()}, {os.cpu_count()} cores",
              "python": platform.python_version(), "window_s": list(args.window),
              "window_from": "the run opened" if args.from_open else "the process started",
              "seed": args.seed, "summary": summary, "final": final_result,
              "attempts": attempts}
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({"summary": summary, "final": final_result}, indent=2))
    ok = (all(not a["problems"] for a in attempts) and not final_result["problems"]
          and min(landed.values()) >= args.kills)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
