"""How well does the timing protocol rank two close models?

Runs ``Measurer.compare`` many times on a pair whose true ratio is known (by default a MatMul
chain and the same chain with one more layer, ~7 % slower) and on a null pair (a model against
itself), and reports the spread of the measured ratios, how often the verdict is right, wrong or
undecided, and the cost per comparison. A naive baseline (one session each, median of the runs,
back to back) shows what the protocol buys.

    python benchmarks/timing_protocol.py --repeats 10
    python benchmarks/timing_protocol.py --model a.onnx --candidate b.onnx --timing robust
    python benchmarks/timing_protocol.py --rows 1024 --timing robust robust@session_budget_s=none

Run it on an otherwise idle machine; never two benchmarks at once.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from qdq_optuna.backends import OnnxRuntimeBackend  # noqa: E402
from qdq_optuna.examples.zoo import matmul_chain  # noqa: E402
from qdq_optuna.measure.timing import Measurer, TimingProtocol  # noqa: E402


def chain_model(layers: int, width: int, rows: int) -> bytes:
    """MatMul/Relu chain: run time grows linearly with ``layers``."""
    return matmul_chain(layers, width, rows)

def naive_ratio(backend, candidate: bytes, reference: bytes, runs: int) -> float:
    """What a single back-to-back measurement would report."""
    out = []
    for model in (reference, candidate):
        with backend.load(model) as runner:
            out.append(statistics.median(runner.time(5, runs)))
    return out[1] / out[0]


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def summarize(rows: list[dict], truth: float, expect: str) -> dict:
    ratios = [r["ratio"] for r in rows]
    errors = [abs(r / truth - 1) for r in ratios]
    verdicts = [r.get("verdict", "") for r in rows]
    n = len(rows)
    return {
        "n": n,
        "ratio_median": statistics.median(ratios),
        "ratio_p5": pct(ratios, 5),
        "ratio_p95": pct(ratios, 95),
        "error_p50": pct(errors, 50),
        "error_p95": pct(errors, 95),
        "correct": sum(v == expect or (expect == "same" and v == "undecided") for v in verdicts)
        / n,
        "wrong": sum(v in ("faster", "slower") and v != expect for v in verdicts) / n,
        "no_verdict": sum(v in ("same", "undecided") for v in verdicts) / n,
        "rounds_mean": statistics.fmean(r.get("rounds", 1) for r in rows),
        "seconds_mean": statistics.fmean(r["seconds"] for r in rows),
        "loads_mean": statistics.fmean(r.get("loads", 2) for r in rows),
        "remeasured_rounds": sum(r.get("remeasured", 0) for r in rows),
        "not_quiet": sum(not r.get("quiet", True) for r in rows),
    }


def protocol_of(preset: str) -> TimingProtocol:
    """``robust`` or ``robust@key=value,key=value`` (a protocol field changed; ``none``:
    None), e.g. ``robust@session_budget_s=none`` (every session ``runs`` runs)."""
    name, _, changes = preset.partition("@")
    protocol = TimingProtocol.from_name(name)
    for item in filter(None, changes.split(",")):
        key, _, value = item.partition("=")
        current = getattr(protocol, key)
        if value == "none":
            parsed = None
        elif isinstance(current, bool):
            parsed = value == "true"
        elif isinstance(current, int):
            parsed = int(value)
        else:
            parsed = float(value)
        protocol = protocol.with_(**{key: parsed})
    return protocol


def run_presets(args, backend, pairs: dict, truth: dict, reference: bytes):
    """Each preset's comparisons of every pair, interleaved across pairs."""
    results: dict[str, dict] = {}
    raw: dict[str, list] = {}
    for preset in ["naive", *args.timing]:
        measurer = None if preset == "naive" else Measurer(backend, protocol_of(preset))
        if measurer is not None:
            measurer.warm_up([reference])
            if args.pace_ms:
                measurer.pace(args.pace_ms)
        rows: dict[str, list[dict]] = {k: [] for k in pairs}
        for _ in range(args.repeats):
            for label, (cand, ref, _expect) in pairs.items():
                t0 = time.perf_counter()
                if measurer is None:
                    ratio = naive_ratio(backend, cand, ref, 20)
                    verdict = "slower" if ratio > 1.03 else "faster" if ratio < 0.97 else "same"
                    row = {"ratio": ratio, "verdict": verdict}
                else:
                    loads = measurer.loads
                    c = measurer.compare(cand, ref)
                    row = {
                        "ratio": c.ratio,
                        "ci_low": c.ci_low,
                        "ci_high": c.ci_high,
                        "verdict": c.verdict,
                        "rounds": c.rounds,
                        "decided": c.decided,
                        "loads": measurer.loads - loads,
                        "remeasured": c.candidate.remeasured,
                        "quiet": c.candidate.quiet,
                    }
                row["seconds"] = time.perf_counter() - t0
                rows[label].append(row)
        for label, (_c, _r, expect) in pairs.items():
            key = f"{preset} | {label}"
            results[key] = summarize(rows[label], truth[label], expect)
            raw[key] = rows[label]

    return results, raw


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, help="reference model (default: generated chain)")
    ap.add_argument("--candidate", type=Path, help="candidate model (default: one layer more)")
    ap.add_argument("--layers", type=int, default=14)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=10, help="comparisons per pair and preset")
    ap.add_argument("--timing", nargs="+", default=["fast", "robust"], help="presets to try")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--pace-ms", type=float, help="pace sessions by this latency, as a run "
                    "paces them by its baseline (default: the reference's, measured first)")
    ap.add_argument("--truth-sessions", type=int, default=30)
    ap.add_argument("--out", type=Path, default=Path("timing_protocol_results.json"))
    ap.add_argument(
        "--hog",
        type=int,
        default=0,
        help="busy-loop processes to run beside the comparisons (a noisy neighbour)",
    )
    args = ap.parse_args(argv)

    if args.model:
        reference = args.model.read_bytes()
        candidate = args.candidate.read_bytes() if args.candidate else None
    else:
        reference = chain_model(args.layers, args.width, args.rows)
        candidate = chain_model(args.layers + 1, args.width, args.rows)

    backend = OnnxRuntimeBackend(threads=args.threads)
    pairs = {"null (A vs A)": (reference, reference, "same")}
    truth = {"null (A vs A)": 1.0}
    if candidate is not None:
        # the best estimate we can afford: many interleaved sessions after a warm-up
        long = Measurer(backend, TimingProtocol.robust().with_(process_warmup_rounds=3))
        ref_m, cand_m = long.interleaved([reference, candidate], sessions=args.truth_sessions)
        truth["B vs A"] = cand_m.score_ms / ref_m.score_ms
        expect = "slower" if truth["B vs A"] > 1 else "faster"
        pairs["B vs A"] = (candidate, reference, expect)
        print(
            f"reference {ref_m.score_ms:.4f} ms, candidate {cand_m.score_ms:.4f} ms, "
            f"reference ratio {truth['B vs A']:.4f} ({args.truth_sessions} sessions)"
        )

    if args.pace_ms is None:  # as a run paces: by the slower (float) model's latency
        first = Measurer(backend, TimingProtocol.robust())
        first.warm_up([reference])
        args.pace_ms = max(m.score_ms for m in first.interleaved(
            [reference] + ([candidate] if candidate is not None else []), sessions=3))
        print(f"sessions paced by {args.pace_ms:.3f} ms")
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.hog)]
    try:
        results, raw = run_presets(args, backend, pairs, truth, reference)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    header = (
        f"{'protocol | pair':<24} {'ratio p50':>9} {'p5':>7} {'p95':>7} {'err p95':>8} "
        f"{'right':>6} {'wrong':>6} {'none':>6} {'rounds':>6} {'s/cmp':>6}"
    )
    print(header)
    print("-" * len(header))
    for key, s in results.items():
        print(
            f"{key:<24} {s['ratio_median']:9.4f} {s['ratio_p5']:7.4f} {s['ratio_p95']:7.4f} "
            f"{s['error_p95']:8.2%} {s['correct']:6.0%} {s['wrong']:6.0%} "
            f"{s['no_verdict']:6.0%} {s['rounds_mean']:6.1f} {s['seconds_mean']:6.2f}"
        )
    print(
        "right: verdict matches the reference ratio (for the null pair: no significant "
        "difference); naive calls >3 % a difference"
    )
    payload = {
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "python": platform.python_version(),
        },
        "backend": backend.describe(),
        "args": {k: str(v) for k, v in vars(args).items()},
        "reference_ratio": truth,
        "summary": results,
        "comparisons": raw,
    }
    args.out.write_text(json.dumps(payload, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
