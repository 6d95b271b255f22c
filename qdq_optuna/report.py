"""``report.json`` (read by other tools: keys are stable) and ``report.md`` (read by people)."""

from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path

from .export import atomic_write_bytes


def build_report(tuner, plan, comparison, rows: list[dict], *, partial: bool) -> dict:
    cmp = comparison
    speedup = 1.0 / cmp.ratio if cmp.ratio > 0 else float("nan")
    baseline = cmp.reference.score_ms
    final = cmp.candidate.score_ms
    patterns = []
    committed_by_id = {r.get("pattern_id"): r for r in rows}
    import optuna
    from optuna.trial import TrialState

    for pp in tuner.prepared.tunable:
        row = committed_by_id.get(pp.pattern.id)
        trials = 0
        try:
            s = optuna.load_study(study_name=tuner._study_name(pp), storage=tuner.storage)
            trials = len(s.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))
        except KeyError:
            pass
        patterns.append({
            "id": pp.pattern.id,
            "signature": pp.pattern.signature,
            "regions": list(pp.pattern.regions),
            "ops": list(pp.pattern.ops),
            "insertion_points": pp.ids,
            "trials": trials,
            "status": "committed" if row else "not tuned",
            "committed_scheme": sorted(p for p, v in (row or {}).get("committed", {}).items() if v),
            "gain": float((row or {}).get("gain", 1.0)),
            "reference_ms": (row or {}).get("reference_ms"),
            "commit_reason": (row or {}).get("commit_reason"),
        })
    return {
        "model": tuner.prepared.source,
        "output": str(tuner.out),
        "run_id": tuner.run_id,
        "storage": tuner.storage_url,
        "backend": tuner.backend.describe(),
        "runtime": tuner.runtime,
        "quant_type": tuner.prepared.quant_type,
        "sampler": tuner.o.sampler,
        "timing": tuner.o.timing,
        "scales": tuner.scales_mode,
        "complete": not partial,
        "baseline_latency_ms": baseline,
        "final_latency_ms": final,
        "speedup": speedup,
        "speedup_ci": [1.0 / cmp.ci_high if cmp.ci_high > 0 else None,
                       1.0 / cmp.ci_low if cmp.ci_low > 0 else None],
        "speedup_confidence": cmp.confidence,
        "final_comparison": cmp.to_dict(),
        "in_search_baseline_latency_ms": tuner.baseline_ms,
        "quantized_tensors": plan.tensors,
        "quantized_weights": sorted({tuner.prepared.graph.nodes[n].input[s] for n, s, _ in plan.weights}),
        "qdq_pairs": plan.qdq_pairs,
        "measurements": tuner.measurements,
        "builds_saved_by_cache": tuner.cache_hits,
        "measurer": tuner.measurer.counters(),
        "patterns": patterns,
        "finished": _dt.datetime.now(_dt.timezone.utc).isoformat(),
    }


def write_reports(out: Path, report: dict) -> None:
    atomic_write_bytes(out / "report.json", json.dumps(report, indent=2, default=str).encode())
    atomic_write_bytes(out / "report.md", render_markdown(report).encode())


def _f(x, fmt="{:.3f}") -> str:
    return "n/a" if x is None else fmt.format(x)


def render_markdown(r: dict) -> str:
    lo, hi = r["speedup_ci"]
    lines = [
        "# qdq-optuna report",
        "",
        f"- model: `{r['model']}`",
        f"- backend: `{r['backend'].get('name')}` (rules: {r['runtime']}), quant type `{r['quant_type']}`,"
        f" sampler `{r['sampler']}`, timing `{r['timing']}`, scales `{r['scales']}`",
        f"- run: `{r['run_id']}` in `{r['storage']}`" + ("" if r["complete"] else " — **incomplete (timeout)**"),
        "",
        "| | latency (ms) |",
        "|---|---|",
        f"| baseline (no Q/DQ) | {_f(r['baseline_latency_ms'])} |",
        f"| tuned (`optimized.onnx`) | {_f(r['final_latency_ms'])} |",
        "",
        f"**Speedup {_f(r['speedup'])}x** ({int(r['speedup_confidence'] * 100)} % interval "
        f"{_f(lo)}–{_f(hi)}, interleaved re-measurement of the saved model against the baseline).",
        "",
        f"{len(r['quantized_tensors'])} activation tensors and {len(r['quantized_weights'])} weights carry "
        f"Q/DQ. {r['measurements']} measurements; {r['builds_saved_by_cache']} builds saved by the cache.",
        "",
        "## Patterns",
        "",
        "| pattern | regions | points | trials | committed | gain | note |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in r["patterns"]:
        lines.append(
            f"| {p['id']} ({'/'.join(p['ops'][:4])}{'…' if len(p['ops']) > 4 else ''}) | "
            f"{len(p['regions'])} | {len(p['insertion_points'])} | {p['trials']} | "
            f"{', '.join(p['committed_scheme']) or '—'} | {_f(p['gain'])} | {p.get('commit_reason') or ''} |"
        )
    return "\n".join(lines) + "\n"
