"""``report.json`` (read by other tools: keys are stable) and ``report.md`` (read by people).

Built from the run record (what the storage holds) and the plan measurer (what this process
measured), never from the tuner itself."""

from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path

from optuna.trial import TrialState

from .export import atomic_write_bytes
from .measure import SCREEN_DISCARD_RATIO
from .search._record import PatternAttr, TrialAttr


def build_report(header: dict, record, plans, prepared, plan, comparison, *, rows: list[dict],
                 baseline_ms: float | None, partial: bool) -> dict:
    """``report.json``'s content. ``header``: what was tuned, where, how (its keys come first);
    ``record``: the run record (:class:`~qdq_optuna.search._record.RunRecord`); ``plans``: the
    plan measurer (its counters); ``plan``/``comparison``: the saved model and its A/B against
    the float model; ``rows``: the committed patterns (:meth:`RunRecord.committed`)."""
    cmp = comparison
    speedup = 1.0 / cmp.ratio if cmp.ratio > 0 else float("nan")
    patterns, all_trials = pattern_entries(record, rows)
    stats = trial_statistics(all_trials)
    return {
        **header,
        "complete": not partial,
        "baseline_latency_ms": cmp.reference.score_ms,
        "final_latency_ms": cmp.candidate.score_ms,
        "speedup": speedup,
        "speedup_ci": [1.0 / cmp.ci_high if cmp.ci_high > 0 else None,
                       1.0 / cmp.ci_low if cmp.ci_low > 0 else None],
        "speedup_confidence": cmp.confidence,
        "final_comparison": cmp.to_dict(),
        "in_search_baseline_latency_ms": baseline_ms,
        "quantized_tensors": plan.tensors,
        "quantized_weights": sorted({prepared.graph.nodes[n].input[s] for n, s, _ in plan.weights}),
        "qdq_pairs": plan.qdq_pairs,
        "measurements": plans.measurements,
        "builds_saved_by_cache": stats["cache_hits"],
        "search_statistics": stats,
        "measurer": plans.measurer.counters(),
        "patterns": patterns,
        "finished": _dt.datetime.now(_dt.timezone.utc).isoformat(),
    }


def pattern_entries(record, rows: list[dict]) -> tuple[list[dict], list]:
    """One entry per tunable pattern (committed or not), and every trial of the run."""
    committed_by_id = {r.get(PatternAttr.PATTERN_ID): r for r in rows}
    patterns: list[dict] = []
    all_trials: list = []
    for pp in record.tunable:
        row = committed_by_id.get(pp.pattern.id) or {}
        trials = record.trials(pp)
        all_trials += trials or []
        entry = {
            "id": pp.pattern.id,
            "signature": pp.pattern.signature,
            "regions": list(pp.pattern.regions),
            "ops": list(pp.pattern.ops),
            "insertion_points": pp.ids,
            "trials": sum(t.state == TrialState.COMPLETE for t in trials or []),
            "status": "committed" if row else "not tuned",
            "committed_scheme": sorted(p for p, v in row.get(PatternAttr.COMMITTED, {}).items()
                                       if v),
            "gain": float(row.get(PatternAttr.GAIN, 1.0)),
            "reference_ms": row.get(PatternAttr.REFERENCE_MS),
            "commit_reason": row.get(PatternAttr.COMMIT_REASON),
        }
        # accuracy modes; converged_after: the study stopped before its budget (Config)
        for key in (PatternAttr.COMMITTED_ERROR, PatternAttr.REFERENCE_ERROR,
                    PatternAttr.COMMITTED_TYPES, PatternAttr.CONVERGED_AFTER):
            if key in row:
                entry[key] = row[key]
        # refinement rounds (Config.refine_rounds): committed_scheme and gain above are the
        # standing scheme and the product of every round's gain
        refinements = []
        for ref in row.get("refinements", []):
            ref = dict(ref)
            trials = record.trials(pp, ref["round"])
            ref["trials"] = sum(t.state == TrialState.COMPLETE for t in trials or [])
            all_trials += trials or []
            refinements.append(ref)
        if refinements:
            entry["refinements"] = refinements
        patterns.append(entry)
    return patterns, all_trials


def trial_statistics(trials) -> dict:
    """How a run's trials were measured, from their ``measurement`` records (so resumed runs
    count every process): ``measured`` = ``ab_compared`` + ``screened_out`` + ``screen_only`` +
    ``deterministic``; ``cache_hits`` are trials whose model was measured before (builds saved)."""
    out = {"trials": 0, "complete": 0, "failed": 0, "failed_transient": 0,
           "pruned_known_failure": 0, "measured": 0, "ab_compared": 0, "ab_decided": 0,
           "screened_out": 0, "screen_only": 0, "deterministic": 0, "cache_hits": 0,
           "screen_discard_ratio": SCREEN_DISCARD_RATIO}
    kinds = {"ab": "ab_compared", "screened_out": "screened_out", "screen": "screen_only",
             "deterministic": "deterministic"}
    for t in trials:
        out["trials"] += 1
        attrs = t.user_attrs
        if t.state == TrialState.FAIL:
            out["failed"] += 1
            out["failed_transient"] += bool(attrs.get(TrialAttr.TRANSIENT))
        elif t.state == TrialState.PRUNED and TrialAttr.KNOWN_FAILURE in attrs:
            out["pruned_known_failure"] += 1
        elif t.state == TrialState.COMPLETE:
            out["complete"] += 1
            rec = attrs.get(TrialAttr.MEASUREMENT) or {}
            if rec.get("cached"):
                out["cache_hits"] += 1
                continue
            key = kinds.get(rec.get("kind", ""))
            if key is None:
                continue
            out["measured"] += 1
            out[key] += 1
            out["ab_decided"] += key == "ab_compared" and bool(rec.get("decided"))
    return out


def write_reports(out: Path, report: dict) -> None:
    atomic_write_bytes(out / "report.json", json.dumps(report, indent=2, default=str).encode())
    atomic_write_bytes(out / "report.md", render_markdown(report).encode())


def _statistics_lines(st: dict | None) -> list[str]:
    if not st:
        return []
    failed = ""
    if st["failed"]:
        failed = (f" {st['failed']} trials failed ({st['failed_transient']} of them a worker "
                  "crash or timeout).")
    return ["", f"Trials: {st['complete']} finished: {st['ab_compared']} A/B-compared against "
            f"their pattern's reference ({st['ab_decided']} decided), {st['screened_out']} screened "
            f"out (screen over {st['screen_discard_ratio']}x the reference; their value is the "
            f"screen estimate), {st['screen_only']} screen-only, {st['deterministic']} "
            f"deterministic, {st['cache_hits']} cache hits (builds saved).{failed}"]


def _f(x, fmt="{:.3f}") -> str:
    return "n/a" if x is None else fmt.format(x)


def _precision_line(hp: dict | None) -> str:
    """What ran at which precision: the float part, the graph's inputs and outputs, the nodes
    kept FP32."""
    if not hp or hp.get("precision", "fp32") == "fp32":
        return "FP32 (the model's float part as given)"
    kept = hp.get("kept_fp32") or {}
    io = "kept FP32" if hp.get("keep_io_types", True) else f"{hp['precision'].upper()} too"
    shown = ", ".join(f"`{n}`" for n in list(kept)[:5]) + (f" … (+{len(kept) - 5})"
                                                            if len(kept) > 5 else "")
    return (f"{hp['precision'].upper()} (converted before the search; graph inputs and outputs "
            f"{io}; {len(kept)} nodes kept FP32{': ' + shown if kept else ''})")


def accuracy_lines(acc: dict, budget: float | None = None) -> list[str]:
    """The accuracy guard's section: the errors of what ships, the data they were measured on,
    the bound and whether the guard stepped in."""
    from .search._guard import data_phrase

    lines = ["## Accuracy", "",
             f"Output error of `optimized.onnx` vs FP32 ({acc['measure']}, worst output, "
             f"calibrated scales): **{acc['error']:.4g}**, measured on {data_phrase(acc['data'])}. "
             f"Bound {acc['bound']:g} ({acc['bound_from']}"
             + ("" if budget is None else f"; the trials' error budget {budget:g} too") + "): "
             f"**{acc['status']}**.", ""]
    if acc.get("scored_as", "").startswith("BF16"):
        lines += [f"Scored as {acc['scored_as']}.", ""]
    if acc.get("data_kind") == "random inputs":
        lines += ["Random inputs show only that nothing is badly broken; pass "
                  "`--validation-data` or `--calibration-data` for errors that mean something.",
                  ""]
    if acc["status"] != "within bound":
        culprits = ", ".join(f"`{t}`" for t in acc.get("responsible_tensors", [])) or "none"
        lines += [f"**The tuned placement broke the bound** (error {acc['tuned_error']:.4g}). "
                  f"Q/DQ responsible (found by bisection, {acc['bisection_evaluations']} error "
                  f"evaluations): {culprits}. `optimized.onnx` is the {acc['shipped']}; every "
                  "figure in this report is that model's.", ""]
    lines += ["| output | cosine | relative L2 | max abs |", "|---|---|---|---|"]
    for name, e in acc.get("output_errors", {}).items():
        lines.append(f"| `{name}` | {e.get('cosine', float('nan')):.5f} | "
                     f"{e.get('relative_l2', float('nan')):.4g} | "
                     f"{e.get('max_abs', float('nan')):.4g} |")
    return lines + [""]


def render_markdown(r: dict) -> str:
    lo, hi = r["speedup_ci"]
    lines = [
        "# qdq-optuna report",
        "",
        f"- model: `{r['model']}`",
        f"- backend: `{r['backend'].get('name')}` (rules: {r['runtime']}), quant type `{r['quant_type']}`,"
        f" sampler `{r['sampler']}`, timing `{r['timing']}`, scales `{r['scales']}`",
        f"- high precision: {_precision_line(r.get('high_precision'))}",
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
        *_statistics_lines(r.get("search_statistics")),
        "",
    ]
    if r.get("accuracy"):
        lines += accuracy_lines(r["accuracy"], r.get("max_output_error"))
    accuracy = any("committed_error" in p for p in r["patterns"])
    lines += [
        "## Patterns",
        "",
        "| pattern | regions | points | trials | committed | gain |"
        + (" error after commit |" if accuracy else "") + " note |",
        "|---|---|---|---|---|---|" + ("---|" if accuracy else "") + "---|",
    ]
    for p in r["patterns"]:
        scheme = [f"{k}:{p['committed_types'][k]}" if k in p.get("committed_types", {}) else k
                  for k in p["committed_scheme"]]
        err = f" {_f(p.get('committed_error'), '{:.4g}')} |" if accuracy else ""
        refs = p.get("refinements", [])
        trials = " + ".join(str(n) for n in [p["trials"], *(f["trials"] for f in refs)])
        note = "; ".join([p.get("commit_reason") or "", *(
            f"refinement {f['round']}: {f.get('commit_reason') or f['status']}"
            + (f" ({_f(f['gain'])}x)" if f.get("gain", 1.0) != 1.0 else "") for f in refs)])
        lines.append(
            f"| {p['id']} ({'/'.join(p['ops'][:4])}{'…' if len(p['ops']) > 4 else ''}) | "
            f"{len(p['regions'])} | {len(p['insertion_points'])} | {trials} | "
            f"{', '.join(scheme) or '—'} | {_f(p['gain'])} |{err} {note} |"
        )
    if r.get("pareto"):
        from .pareto import write_front_table

        lines += write_front_table(r["pareto"])
    return "\n".join(lines) + "\n"
