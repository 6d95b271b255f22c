"""``report.json`` (read by other tools: keys are stable) and ``report.md`` (read by people).

Built from the run record (what the storage holds) and the plan measurer (what this process
measured), never from the tuner itself."""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import math
import signal
from pathlib import Path
from typing import TYPE_CHECKING

from optuna.trial import TrialState

from qdq_optuna.accuracy_words import WITHIN_BOUND
from qdq_optuna.machine import current_cpu
from qdq_optuna.outputs.limit import limit_lines
from qdq_optuna.outputs.time_spent import time_spent_lines
from qdq_optuna.placement.dynamic import MODE_COUNT_KEYS, QuantMode, node_modes
from qdq_optuna.record import (
    PHASES,
    PatternAttr,
    PatternStanding,
    RunAttr,
    TrialAttr,
    trial_measurement,
)
from qdq_optuna.run_folder import RunFolder

if TYPE_CHECKING:  # an annotation: what the search concluded, which the report formats
    from qdq_optuna.search import RunHeader, SearchOutcome, ShippedAccuracy, StoppedOutcome


def header_keys(header: RunHeader) -> dict:
    """report.json's first fields, from the run's header (in its fields' order)."""
    return dataclasses.asdict(header)


def accuracy_keys(accuracy: ShippedAccuracy) -> dict:
    """report.json's accuracy keys: ``accuracy`` (the guard's figures), ``final_output_error(s)``,
    the recipe files measured (``recipe_file``: the classic recipe's), ``kept_your_model`` and
    the accuracy modes' ``objectives``, ``error_measure``, ``max_output_error``."""
    keys = {"accuracy": accuracy.guard, "final_output_error": accuracy.final_output_error,
            "final_output_errors": accuracy.final_output_errors}
    if accuracy.recipe_files:
        keys["recipe_file"] = accuracy.recipe_files[0]
        keys["recipe_files"] = accuracy.recipe_files
    if accuracy.kept_your_model is not None:
        keys["kept_your_model"] = accuracy.kept_your_model
    if accuracy.modes is not None:
        keys.update(dataclasses.asdict(accuracy.modes))
    return keys


def build_report(header: dict, record, counts, prepared, plan, comparison, *, rows: list[dict],
                 baseline_ms: float | None, partial: bool, lane: str = "") -> dict:
    """``report.json``'s content. ``header``: what was tuned, where, how (its keys come first);
    ``record``: the run record (:class:`~qdq_optuna.record.RunRecord`); ``counts``: the
    plan measurer's counters (:class:`~qdq_optuna.search._outcome.MeasurementCounts`); ``plan``/``comparison``: the saved model and its A/B against
    the baseline (the user's model); ``rows``: the patterns (:meth:`RunRecord.committed` of
    ``lane``, the lane whose standing model was saved)."""
    cmp = comparison
    speedup = 1.0 / cmp.ratio if cmp.ratio > 0 else float("nan")
    patterns, all_trials = pattern_entries(record, rows)
    stats = trial_statistics(all_trials, counts.screen_discard_ratio)
    run_attrs = record.run_study.user_attrs
    return {
        **header,
        "complete": not partial,
        "baseline_model": run_attrs.get(RunAttr.BASELINE_MODEL),
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
        "defaults_taken": list(prepared.graph.defaults_taken),
        "qdq_pairs": plan.qdq_pairs,
        "measurements": counts.measurements,
        "measurements_by_phase": {phase: counts.by_phase.get(phase, 0) for phase in PHASES},
        "builds_saved_by_cache": stats["cache_hits"],
        "search_statistics": stats,
        "measurer": counts.measurer,
        "starts": start_entries(record, baseline_ms),
        "forward": forward_entry(record),
        "lane": lane,
        "descent": descent_summary(record, lane),
        "patterns": patterns,
        "cpu": current_cpu().to_json(),
        "finished": _dt.datetime.now(_dt.timezone.utc).isoformat(),
    }


def stopped_report(o: StoppedOutcome) -> dict:
    """``report.json`` of a run a signal stopped: what the storage holds (the starts, the
    descent's committed visits, each pattern's standing scheme), nothing measured after the
    signal; ``stopped`` says by what and how to resume. The standing model's speedup is the
    descent's estimate (its start's ratio times its committed whole-model gains), not a
    final A/B: the run did not get that far."""
    patterns, _ = pattern_entries(o.record, o.rows)
    starts = start_entries(o.record, o.baseline_ms)
    descent = descent_summary(o.record, o.lane)
    chosen = next((s for s in starts if s.get("chosen")), None)
    lane = descent["lanes"].get(o.lane or "main")
    estimate = (chosen["speedup"] * (lane["gain"] if lane else 1.0)
                if chosen and chosen.get("speedup") else None)
    return {
        **header_keys(o.header),
        "complete": False,
        "stopped": {"signal": signal.Signals(o.signum).name,
                    "at": _dt.datetime.now(_dt.timezone.utc).isoformat(),
                    "optimized_onnx": "the standing model" if RunFolder(o.out).optimized.exists()
                    else None,
                    "resume": "rerun the same command"},
        "baseline_model": o.record.run_study.user_attrs.get(RunAttr.BASELINE_MODEL),
        "in_search_baseline_latency_ms": o.baseline_ms,
        "standing_speedup_estimate": estimate,
        "measurements": o.measurements,
        "measurements_by_phase": {phase: o.by_phase.get(phase, 0) for phase in PHASES},
        "starts": starts,
        "lane": o.lane,
        "descent": descent,
        "patterns": patterns,
        "cpu": current_cpu().to_json(),
        "elapsed_s": dict(o.elapsed),
    }


def runtime_keys(outcome: SearchOutcome) -> dict:
    """``what_ran``: for the shipped model, per pattern, which Q/DQ the runtime fused, which
    stayed standalone, where float ran next to integer and where it reformatted (read from the
    runtime itself: the thing a TensorRT user opens an engine explorer for); and
    ``descent_skipped``: the visits the runtime's report of the standing model skipped (with
    what the descent read: ``what_ran_reads``, ``kernel_table``)."""
    out: dict = {}
    what, error, prepared = outcome.what_ran, outcome.what_ran_error, outcome.prepared
    descent = outcome.descent
    if descent is not None:
        out["descent_skipped"] = [{"lane": lane, "round": rnd, "pattern": pid, "reason": why}
                                  for lane, rnd, pid, why in descent.skipped]
        if descent.what_ran_reads is not None:
            out["what_ran_reads"] = descent.what_ran_reads
            if descent.kernel_table is not None:
                out["kernel_table"] = descent.kernel_table
        if descent.limit is not None:
            out["limit"] = descent.limit
        if descent.plans:
            out["descent_plan"] = descent.plans
    if error is not None:  # the search could not read it: the report still ships
        out["what_ran"] = {"how": None, "error": error}
        return out
    if what is None:
        return out
    g = prepared.graph
    patterns = []
    for pp in prepared.tunable:
        tensors = {u[0] for u in pp.uses(pp.ids)}
        nodes = {g.nodes[u[1]].name for u in pp.uses(pp.ids)}
        nodes |= {g.nodes[g.producer[t][0]].name for t in tensors if t in g.producer}
        patterns.append({"id": pp.pattern.id, "fused": sorted(tensors & what.fused),
                         "standalone": sorted(tensors & what.standalone),
                         "float_nodes": sorted(nodes & what.float_nodes),
                         "reformats": sorted(tensors & what.reformats)})
    out["what_ran"] = {"how": what.how, "fused": len(what.fused),
                       "standalone": len(what.standalone), "float_nodes": len(what.float_nodes),
                       "reformats": len(what.reformats), "patterns": patterns}
    return out


def mode_keys(final_bytes, rules) -> dict:
    """``modes``: the modes searched (``static``; ``dynamic`` where the rules have dynamic
    ops; the rules' weight-only modes); ``node_modes``: each MatMul/Gemm/Conv's mode in
    ``optimized.onnx``, and ``mode_counts`` (every mode's count, and ``float``)."""
    searched = ["static"] + (["dynamic"] if rules.dynamic_ops else []) \
        + [m.value for m in rules.weight_only_modes]
    if not isinstance(final_bytes, bytes):  # a model too big for bytes: read where written
        return {"modes": searched}
    modes = node_modes(final_bytes)
    counts = {m: list(modes.values()).count(m) for m in MODE_COUNT_KEYS}
    return {"modes": searched, "node_modes": modes, "mode_counts": counts}


def start_entries(record, baseline_ms: float | None) -> list[dict]:
    """The whole-model starts as the run decided them: latency, speedup over the baseline,
    output error, whether feasible, chosen, the lane that descended from it, notes."""
    out = []
    for row in record.start_outcomes():
        entry = {k: getattr(row, k) for k in ("name", "latency_ms", "error", "feasible",
                                               "chosen", "lane", "exact", "qdq", "notes")}
        entry["points_on"] = sum(len(v) for v in (row.points_on or {}).values())
        if row.latency_ms and baseline_ms:
            entry["speedup"] = baseline_ms / row.latency_ms
        if row.failure:
            entry["failure"] = row.failure
        if row.ab_vs_float:
            entry["ab_vs_float"] = row.ab_vs_float
        if row.ab_vs_best:
            entry["ab_vs_best"] = row.ab_vs_best
        if row.repair:
            entry["repair"] = row.repair
        if row.repair_outcome:
            entry["repair_outcome"] = row.repair_outcome
        out.append(entry)
    return out


def forward_entry(record) -> dict | None:
    """What the forward search did (None: it did not run: a quantized start within the bound
    was faster than float, or none broke the bound)."""
    starts = record.starts()
    return starts.forward if starts is not None else None


def descent_summary(record, lane: str) -> dict:
    """Per lane: rounds run, visits (decided, changed the standing model), moves queued, moves
    left out because their kind kept failing, and ``gain``: the descent's gain over the lane's
    start, the product of the whole-model gains its committed visits measured."""
    starts = record.starts()
    lanes = {}
    for name in starts.order if starts is not None else []:
        visits = record.visits(name)
        lanes[name or "main"] = {
            "start": starts.lane_starts.get(name),
            "rounds": max((int(v.round or 0) for v in visits), default=0),
            "visits": len(visits),
            "changed": sum(1 for v in visits if v.changed),
            "moves": sum(int(v.moves) for v in visits),
            "moves_skipped": sum(int(v.moves_skipped) for v in visits),
            "gain": math.prod(float(v.gain or 1.0) for v in visits if v.changed),
        }
    return {"lanes": lanes, "shipped": lane or "main"}


def pattern_entries(record, rows: list[PatternStanding]) -> tuple[list[dict], list]:
    """One entry per tunable pattern, and every trial of the run's visits."""
    by_id = {r.pattern_id: r for r in rows}
    trials_of: dict[str, list] = {}
    done_in: dict[tuple, int] = {}  # (pattern, lane, round) -> finished trials
    all_trials: list = []
    for visit in record.visits():
        trials = record.visit_trials(visit)
        all_trials += trials
        trials_of.setdefault(visit.pattern_id, []).extend(trials)
        done_in[(visit.pattern_id, visit.lane, visit.round)] = sum(
            t.state == TrialState.COMPLETE for t in trials)
    patterns: list[dict] = []
    for pp in record.tunable:
        row = by_id.get(pp.pattern.id)
        last = row.last if row is not None else None
        visits = [{**v.to_dict(), "trials": done_in.get((v.pattern, v.lane, v.round), 0)}
                  for v in (row.visits if row is not None else ())]
        entry = {
            "id": pp.pattern.id,
            "signature": pp.pattern.signature,
            "regions": list(pp.pattern.regions),
            "ops": list(pp.pattern.ops),
            "insertion_points": pp.ids,
            "trials": sum(t.state == TrialState.COMPLETE for t in trials_of.get(pp.pattern.id, [])),
            "status": "committed" if any(v["status"] == "committed" for v in visits)
                      else ("running" if visits else "not tuned"),
            "start_scheme": row.start_scheme if row is not None else [],
            "committed_scheme": sorted(p for p, v in (row.scheme if row is not None else {}
                                                      ).items() if v),
            "gain": float(row.gain if row is not None else 1.0),
            "reference_ms": last.reference_ms if last is not None else None,
            "commit_reason": last.reason if last is not None else None,
            "visits": visits,
            # the rounds after the first (as the earlier pattern-by-pattern search reported
            # its refinement rounds)
            "refinements": [v for v in visits if v["round"] and v["round"] > 1
                            and v["pattern"] == pp.pattern.id],
        }
        # accuracy modes; converged_after: the last visit stopped before its budget
        if last is not None:
            for key, value in ((PatternAttr.COMMITTED_ERROR, last.committed_error),
                               (PatternAttr.REFERENCE_ERROR, last.reference_error),
                               (PatternAttr.COMMITTED_TYPES, last.committed_types),
                               (PatternAttr.CONVERGED_AFTER, last.converged_after)):
                if value is not None:
                    entry[key] = value
        patterns.append(entry)
    return patterns, all_trials


def trial_statistics(trials, screen_discard_ratio: float) -> dict:
    """How a run's trials were measured, from their ``measurement`` records (so resumed runs
    count every process): ``measured`` = ``ab_compared`` + ``screened_out`` + ``screen_only`` +
    ``deterministic``; ``cache_hits`` are trials whose model was measured before (builds saved);
    ``screen_discard_ratio``: the screen's threshold the search measured with."""
    out = {"trials": 0, "complete": 0, "failed": 0, "failed_transient": 0,
           "pruned_known_failure": 0, "measured": 0, "ab_compared": 0, "ab_decided": 0,
           "ab_gave_up": 0,
           "screened_out": 0, "screen_only": 0, "deterministic": 0, "cache_hits": 0,
            "screen_discard_ratio": screen_discard_ratio,
            "subgraph_screened_out": 0, "subgraph_compared": 0, "subgraph_agreed": 0,
            "subgraph_slower_audited": 0, "subgraph_slower_right": 0}
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
            m = trial_measurement(t)
            if m is not None and m.cached:
                out["cache_hits"] += 1
                continue
            key = kinds.get(m.kind or "") if m is not None else None
            if key is None:
                continue
            out["measured"] += 1
            out[key] += 1
            sub = m.extra.get("subgraph")
            if isinstance(sub, dict):  # the region's A/B: alone, or beside the whole model's
                out["subgraph_screened_out"] += key == "screened_out"
                out["subgraph_compared"] += "agrees" in sub
                out["subgraph_agreed"] += bool(sub.get("agrees"))
                if key == "ab_compared" and sub.get("verdict") == "slower":  # an audited drop:
                    out["subgraph_slower_audited"] += 1  # right unless the whole model is faster
                    out["subgraph_slower_right"] += sub.get("whole_verdict") != "faster"
            out["ab_decided"] += key == "ab_compared" and bool(m.decided)
            out["ab_gave_up"] += key == "ab_compared" and m.verdict == "not faster"
    return out


def write_reports(out: Path, report: dict) -> None:
    render = render_stopped_markdown if "stopped" in report else render_markdown
    RunFolder(out).write_reports(json.dumps(report, indent=2, default=str).encode(),
                                 render(report))


def _statistics_lines(st: dict | None) -> list[str]:
    if not st:
        return []
    failed = ""
    if st["failed"]:
        failed = (f" {st['failed']} trials failed ({st['failed_transient']} of them a worker "
                  "crash or timeout).")
    return ["", f"Trials: {st['complete']} finished: {st['ab_compared']} A/B-compared against "
            f"their pattern's reference ({st['ab_decided']} decided, {st.get('ab_gave_up', 0)} given "
            f"up at half their rounds as not faster), {st['screened_out']} screened "
            f"out (screen over {st['screen_discard_ratio']}x the reference; their value is the "
            f"screen estimate), {st['screen_only']} screen-only, {st['deterministic']} "
            f"deterministic, {st['cache_hits']} cache hits (builds saved).{failed}"] + (
        [f"Subgraph screen: {st['subgraph_screened_out']} candidate(s) screened out by their "
         f"changed region alone; of {st['subgraph_compared']} also A/B-compared as whole "
         f"models, the region ranked {st['subgraph_agreed']} as the whole model did (faster "
         "or not)."] if st.get("subgraph_screened_out") or st.get("subgraph_compared") else []) + (
        [f"Subgraph screen audit: {st['subgraph_slower_audited']} region(s) measured slower "
         f"were A/B-compared as whole models anyway; {st['subgraph_slower_right']} of those "
         "whole models were not faster either (a drop would have been right)."]
        if st.get("subgraph_slower_audited") else [])


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


def bias_correction_lines(bc: dict | None) -> list[str]:
    """``--bias-correction``'s line: applied (to how many layers) or not."""
    if bc is None:
        return []
    if not bc.get("applied"):
        return ["Bias correction: on, but not applied to what ships (no quantized layer "
                "with a bias to correct in it).", ""]
    return [f"Bias correction: applied to {bc['layers']} quantized layers of `optimized.onnx` "
            f"(each layer's mean output shift from float, per channel, measured on the "
            f"calibration data, folded into its bias; mean |shift| {bc['mean_abs_shift']:.3g}); "
            "the error above is the corrected model's.", ""]


def floor_lines(floor: dict | None, bound: float) -> list[str]:
    """The FP32 model's own noise floor on the guard's data, and what it means for the bound."""
    from qdq_optuna.accuracy_words import share_words

    if not floor:
        return []
    share = floor.get("share_of_bound")
    line = (f"Noise floor: the FP32 model's own output error is {floor['error']:.4g} when its "
            f"inputs move by up to half an 8-bit step of their range ({floor['draws']} noise "
            "draws)" + (f": {share_words(share)} what the bound {bound:g} allows."
                        if share is not None else "."))
    if share is not None and share >= 0.5:
        line += (" 8-bit placements will hardly stay within such a bound: each quantized "
                 "tensor adds noise of about that order. A task-level `--metric` with "
                 "`--max-metric-drop` (what the user's task sees) or a looser "
                 "`--max-output-error` lets the guard keep a quantized model.")
    return [line, ""]


def claim_lines(claim: dict | None, bound: float) -> list[str]:
    """The shipped model's per-sample errors on the guard's data, and whether the upper
    bound of their mean supports the claim."""
    if not claim:
        return []
    p = f"{100 * claim['confidence']:g}%"
    held = (f"the guard held the bound on this upper bound (`--accuracy-confidence "
            f"{claim['confidence']:g}`)" if claim["held_on"] == "upper" else
            "the guard held the bound on the error over all samples")
    if claim["upper_within_bound"]:
        verdict = "within the bound"
    elif claim.get("samples_needed"):
        verdict = (f"**past the bound {bound:g}: these {claim['samples']} samples do not "
                   f"support the claim**; about {claim['samples_needed']} samples with this "
                   "spread would")
    else:
        verdict = f"**past the bound {bound:g}**: no number of samples with this mean would be"
    return [f"Per sample ({claim['samples']} samples): min {claim['min']:.4g}, median "
            f"{claim['median']:.4g}, worst {claim['worst']:.4g}, mean {claim['mean']:.4g}; "
            f"the upper {p} bound of the mean (one-sided t) is {claim['upper']:.4g}, {verdict} "
            f"({held}).", ""]


#: report.md's line under an error measured on the samples the scales came from
CALIBRATION_DATA_CAVEAT = (
    "These are the samples the scales were calibrated on: on inputs the calibration never saw "
    "the error can be several times larger (two PP-OCR text recognizers on photographed text "
    "lines: 0.149 and 0.125 on their 8 calibration strips, 0.41 and 0.28 on 8 others; holding "
    "2 of the 8 out did not catch it). Pass `--validation-data` with inputs like those you "
    "will run, or 16 or more calibration samples (a quarter is then held out and scored).")


def accuracy_lines(acc: dict, budget: float | None = None) -> list[str]:
    """The accuracy guard's section: the errors of what ships, the data they were measured on,
    the bound and whether the guard stepped in."""
    from qdq_optuna.accuracy_words import CALIBRATION_DATA, data_phrase, default_session_lines

    lines = ["## Accuracy", "",
             f"Output error of `optimized.onnx` vs FP32 ({acc['measure']}, worst output, "
             f"calibrated scales): **{acc['error']:.4g}**, measured on {data_phrase(acc['data'])}. "
             f"Bound {acc['bound']:g} ({acc['bound_from']}"
             + ("" if budget is None else f"; the trials' error budget {budget:g} too") + "): "
             f"**{acc['status']}**.", ""]
    lines += claim_lines(acc.get("claim"), acc["bound"])
    drop = acc.get("metric_drop")
    if drop:
        per = " of the FP32 model's value" if drop["drop_type"] == "relative" else ""
        lines += [f"The bound is the FP32 model's own metric {drop['fp32_metric']:.6g} plus the "
                  f"allowed drop {drop['max_metric_drop']:g}{per} ({drop['drop_type']}).", ""]
    floor = acc.get("recipe_floor")
    if floor:
        lines += [f"The default bound {floor['default']:g} was tightened to the error of the "
                  f"runtime's fastest recipe, start `{floor['start']}` ({floor['error']:.4g}; "
                  "never below cosine 0.999, 0.9995 on the calibration samples themselves): "
                  "the tuned model is at least as accurate as the recipe it is compared with. "
                  "Give `--max-output-error` to set the bound yourself.", ""]
    if acc.get("scored_as"):
        lines += [f"Scored as {acc['scored_as']}.", ""]
    lines += floor_lines(acc.get("input_noise_floor"), acc["bound"])
    lines += bias_correction_lines(acc.get("bias_correction"))
    for line in default_session_lines(acc.get("onnxruntime_cpu_default"), acc["error"]):
        lines += [line, ""]
    if acc.get("data_kind") == CALIBRATION_DATA:
        lines += [CALIBRATION_DATA_CAVEAT, ""]
    if acc.get("data_kind") == "random inputs":
        lines += ["Random inputs show only that nothing is badly broken; pass "
                  "`--validation-data` or `--calibration-data` for errors that mean something.",
                  ""]
    if acc["status"] != WITHIN_BOUND and not acc.get("tuned_tensors"):
        lines += ["**Even the model without Q/DQ is past the bound** (the high-precision "
                  "conversion alone drifts that far): `optimized.onnx` is that model. Raise "
                  "`--max-output-error` or choose another `--high-precision`.", ""]
    elif acc["status"] != WITHIN_BOUND:
        culprits = ", ".join(f"`{t}`" for t in acc.get("responsible_tensors", [])) or "none"
        lines += [f"**The tuned placement broke the bound** (error {acc['tuned_error']:.4g}). "
                  f"Q/DQ taken out by the repair ({acc.get('repair', 'bisection')}, "
                  f"{acc['bisection_evaluations']} error evaluations): {culprits}. "
                  f"`optimized.onnx` is the {acc['shipped']}; every "
                  "figure in this report is that model's.", ""]
    lines += ["| output | cosine | relative L2 | max abs |", "|---|---|---|---|"]
    for name, e in acc.get("output_errors", {}).items():
        lines.append(f"| `{name}` | {e.get('cosine', float('nan')):.5f} | "
                     f"{e.get('relative_l2', float('nan')):.4g} | "
                     f"{e.get('max_abs', float('nan')):.4g} |")
    return lines + [""] + sensitivity_lines(acc.get("sensitivity"), acc["measure"])


def sensitivity_lines(sens: dict | None, measure: str, limit: int = 20) -> list[str]:
    """Which quantizer groups of ``optimized.onnx`` cost the most output error (each group:
    the Q/DQ on one node's inputs, ``--exclude-nodes NODE`` keeps it float)."""
    if not sens:
        return []
    lines = ["## Sensitivity", "",
             f"How much the output error ({measure}, worst output; {sens['error']:.4g} in "
             "all) drops when one node's quantized inputs go back to float, most first: "
             f"{sens['groups_total']} groups, {sens['evaluations']} plans scored (sets of "
             "neighbouring groups first, split where the error is; a group still in a set "
             "shows its share of the set's drop). Latency cost: what the node's integer "
             f"kernels save ({sens['costs_from']}).", ""]
    if sens.get("exclude_nodes"):
        lines += ["To keep the most sensitive nodes float in a new run:", "", "```",
                  sens["exclude_nodes"], "```", ""]
    rows = sens.get("groups") or []
    modes = any(g.get("fix") for g in rows)
    if modes:
        lines += ["For the most sensitive nodes that can run dynamically (activations quantized "
                  "per call), the drop with the node switched to that mode instead, and the "
                  "fix: `dynamic` where that removes nearly as much error as float does "
                  "(the node keeps an integer kernel).", ""]
    lines += ["| group | tensors | error drop | share of the error | latency cost |"
              + (" drop as dynamic | fix |" if modes else ""),
              "|---|---|---|---|---|" + ("---|---|" if modes else "")]
    for g in rows[:limit]:
        drop = g.get("error_drop")
        share = drop / sens["error"] if drop is not None and sens["error"] > 0 else None
        shared = f" (set of {g['shared_by']})" if g.get("shared_by", 1) > 1 else ""
        lines.append(f"| {g['group']} | {_short(', '.join(g['tensors']), 80)} | "
                     f"{_f(drop, '{:.3g}')}{shared} | {_f(share, '{:.1%}')} | "
                     f"{g['latency_cost']:.3g} |" + (
                         f" {_f(g.get('dynamic_error_drop'), '{:.3g}')} | "
                         f"{g.get('fix', '-')} |" if modes else ""))
    return lines + _more_rows(rows, limit, 7 if modes else 5) + [""]


def _starts_lines(r: dict) -> list[str]:
    starts = r.get("starts") or []
    if not starts:
        return []
    lines = ["## Starts", "",
             "Whole-model placements measured before the descent; the fastest feasible one is "
             "the standing model every pattern starts from.", "",
             "| start | latency (ms) | vs baseline | output error | feasible | descent | notes |",
             "|---|---|---|---|---|---|---|"]
    for s in starts:
        lane = "" if s.get("lane") is None else ("**standing model**" if s.get("chosen")
                                                 else f"lane `{s['lane']}`")
        notes = s.get("failure") or "; ".join(s.get("notes") or [])
        lines.append(f"| {s['name']} ({s.get('points_on', 0)} points) | "
                     f"{_f(s.get('latency_ms'), '{:.4f}')} | {_f(s.get('speedup'))}x | "
                     f"{_f(s.get('error'), '{:.3g}')} | {'yes' if s.get('feasible') else 'no'} | "
                     f"{lane} | {_short(notes, 160)} |")
    lines += _ab_lines(starts)
    lanes = (r.get("descent") or {}).get("lanes") or {}
    shipped = lanes.get((r.get("descent") or {}).get("shipped") or "main")
    if shipped:
        lines += ["", f"The descent from `{shipped.get('start') or 'its start'}` gained {_f(shipped['gain'])}x over "
                  f"it ({shipped['changed']} of {shipped['visits']} visits changed the standing "
                  "model; each visit's gain is a whole-model A/B)."]
    return lines + [""]


def _forward_lines(fw: dict | None, limit: int = 30) -> list[str]:
    """The forward search: why the run ended where it did, and its groups in the order they
    were added (gain alone per unit of error alone)."""
    if not fw:
        return []
    rows = fw.get("groups") or []
    modes = (" and each node the run offers the dynamic mode run dynamically (a node goes in "
             "one mode)" if any(g.get("mode") == QuantMode.DYNAMIC.value for g in rows) else "")
    lines = ["## Forward search", "", f"**{fw['why'][:1].upper()}{fw['why'][1:]}.**", "",
             f"Quantized starts broke the accuracy bound, so the run built up from float: each "
             f"quantizer group of `{fw['from_start']}`{modes} measured alone (speed gain, output "
             f"error), {fw['groups_with_gain']} of {fw['groups_total']} gain speed; "
             f"{fw['added']} added in order of gain per unit of error, the longest such prefix "
             f"whose whole plan keeps the bound (error {fw['error']:.4g}, bound {fw['bound']:g}, "
             f"{fw['evaluations']} error evaluations, {fw['timings']} whole-model timings); "
             f"stopped: {fw['end']}. Estimated {fw['estimated_speedup']:.3f}x float from the "
             "groups' own gains.", "",
             "| group | gain alone (ms) | from | error alone | added |", "|---|---|---|---|---|"]
    for g in rows[:limit]:
        lines.append(f"| {g['group']} | {g['gain_ms']:.4g} | {g['gain_from']} | "
                     f"{_f(g.get('error_alone'), '{:.3g}')} | "
                     f"{'**yes**' if g['added'] else 'no'} |")
    return lines + _more_rows(rows, limit, 5) + [""]


def _ab_lines(starts: list[dict]) -> list[str]:
    """What the A/Bs that decided the standing model read: a start measured faster than float
    once ships only when an interleaved A/B confirms it (on a noisy machine it may not)."""
    lines = []
    for s in starts:
        ab = s.get("ab_vs_float")
        if not ab:
            continue
        verdict = "faster" if ab["ci"][1] < 1.0 else "not confirmed faster"
        lines.append(f"- `{s['name']}` against float, interleaved A/B: latency ratio "
                     f"{ab['ratio']:.3f} (interval {ab['ci'][0]:.3f}-{ab['ci'][1]:.3f}, "
                     f"{ab['rounds']} rounds), {verdict}; "
                     f"{'chosen' if s.get('chosen') else 'not chosen'}.")
    return ["", *lines] if lines else []


def _repair_lines(r: dict, limit: int = 40) -> list[str]:
    """Each repair's sensitivity table (on the repaired start, or on the start that broke the
    bound when no repaired start was measured, with what its repair came to): its quantizer
    groups in the order the repair would return them to float, and the ``--exclude-nodes``
    line for those it returned."""
    lines: list[str] = []
    for s in r.get("starts") or []:
        rep, outcome = s.get("repair"), s.get("repair_outcome")
        # a repaired start's own row has the table and no outcome; the row of a start that
        # broke the bound has its outcome, and the table when no repaired start was measured
        if outcome and not outcome.startswith("repaired"):
            lines += [f"## Repair of {s['name']}", "",
                      f"{s['name']} broke the accuracy bound: {outcome}.", ""]
        elif rep and not outcome:
            lines += [f"## Repair: {s['name']}", ""]
        if not rep:
            continue
        lines += [f"{rep['returned']} of {rep['groups_total']} quantizer groups returned to "
                  "float, ranked by the output error drop (that group alone returned to "
                  "float from the quantized plan) per latency cost "
                  f"({rep['costs_from']}); output error {rep['full_error']:.4g} -> "
                  f"{rep['error']:.4g} (bound {rep['bound']:g}), {rep['evaluations']} error "
                  "evaluations.", ""]
        if rep.get("exclude_nodes"):
            lines += ["The same placement from a new run (paste into `qdq-optuna tune`):", "",
                      "```", rep["exclude_nodes"], "```", ""]
        if not outcome:  # measured: say whether it runs faster than float
            lines += _repair_speed_lines(s, r, rep)
        lines += ["| group | tensors | error drop | share of the error | integer nodes lost | "
                  "latency cost | fixed by |", "|---|---|---|---|---|---|---|"]
        rows = rep.get("sensitivity") or []
        full = rep.get("full_error") or 0.0
        for g in rows[:limit]:
            share = g["error"] / full if g.get("error") is not None and full > 0 else None
            lines.append(f"| {g['group']} | {_short(', '.join(g['tensors']), 80)} | "
                         f"{_f(g.get('error'), '{:.3g}')} | {_f(share, '{:.1%}')} | "
                         f"{_short(', '.join(g['lost_integer_nodes']), 80)} | "
                         f"{g['latency_cost']:.3g} | "
                         f"{_fixed_by(g)} |")
        lines += _more_rows(rows, limit, 7) + [""]
    return lines


def _fixed_by(group: dict) -> str:
    """The sensitivity table's last cell: the mode the repair gave the group's node (float, or
    one that keeps it integer, such as dynamic), or ``-`` where the repair left it as placed."""
    mode = group.get("fixed_by") or ("float" if group.get("returned_to_float") else None)
    return f"**{mode}**" if mode else "-"


def _repair_speed_lines(s: dict, r: dict, rep: dict) -> list[str]:
    """Whether the repaired start runs faster than float, and when not, why: the float islands
    the returns left between integer chains (each with a stand-alone Q/DQ on its borders) cost
    more than the integer kernels kept save (the search prefers float to such a start)."""
    est = rep.get("estimated_speed") or {}
    flt = next((x for x in r.get("starts") or [] if x["name"] == "float"), None)
    if not flt or flt.get("latency_ms") is None or s.get("latency_ms") is None:
        return []
    ratio = flt["latency_ms"] / s["latency_ms"]
    if ratio > 1.0:
        return [f"It runs {ratio:.3f}x float's speed (measured).", ""]
    why = ("the float islands between its integer chains (a stand-alone Q/DQ on each border) "
           "cost more than the integer kernels kept save")
    if est.get("kept") is not None and est["kept"] <= 0:
        why += " (the repair's own estimate said so too)"
    return [f"It runs {ratio:.3f}x float's speed (measured), no faster than float: {why}; "
            "the search prefers float to it.", ""]


def _kernel_lines(k: dict | None, limit: int = 80) -> list[str]:
    """The kernel table: which layers run faster in float on this machine."""
    if not k or not k.get("kernels"):
        return []
    rows = k["kernels"]
    rt = k.get("runtime") or {}
    # MatMul/Gemm's per-node mode kernels: a column pair per mode timed in any row
    modes = [m for m in ("dynamic", "weight_int8", "weight_int4")
             if any(r.get(f"{m}_ms") is not None for r in rows)]
    lines = ["", "## Kernels: integer vs float on this machine", "",
             f"{rt.get('name', 'the backend')} ({', '.join(f'{a}={b}' for a, b in rt.items() if a != 'name')}); "
             f"CPU flags: {', '.join(k.get('cpu_flags') or []) or 'none read'}. Each node's "
             f"integer kernel (its Q/DQ model cut at the Q outputs) against its float kernel, "
             f"interleaved A/B; {k['timed']} signature(s) timed in this run, {k['cached']} "
             f"from the cache. Float faster at "
             f"{sum(r['decision'] == 'float' for r in rows)} of {len(rows)} node(s)."
             + (f" Each MatMul/Gemm's kernel in the {', '.join(modes)} mode(s) (dynamic: "
                f"activations quantized per call; weight_int8/int4: MatMulNBits) is timed "
                f"against float too." if modes else ""), "",
             "| node | op | int ms | float ms | float/int (interval) | evidence | shipped |"
             + "".join(f" {m} ms | float/{m} (interval) |" for m in modes),
             "|---|---|---:|---:|---|---|---|" + "---:|---|" * len(modes)]
    for r in rows[:limit]:
        cells = "".join(
            f" {r[f'{m}_ms']:.4g} | {r[f'{m}_ratio']:.3f} ({r[f'{m}_ci'][0]:.3f}-"
            f"{r[f'{m}_ci'][1]:.3f}) |" if r.get(f"{m}_ms") is not None else " — | — |"
            for m in modes)
        lines.append(f"| {r['node']} | {r['op']} | {r['int_ms']:.4g} | {r['float_ms']:.4g} | "
                     f"{r['ratio']:.3f} ({r['ci_low']:.3f}-{r['ci_high']:.3f}) | "
                     f"{r['action']} | {r.get('shipped', '?')} |" + cells)
    return lines + _more_rows(rows, limit, 7 + 2 * len(modes), "rows")


def _what_ran_lines(r: dict) -> list[str]:
    """The runtime's own account of the shipped model, per pattern, and the skipped visits."""
    lines = []
    w = r.get("what_ran") or {}
    if w.get("patterns"):
        lines += ["", "## What the runtime ran", "",
                  f"Read from {w['how']} for `optimized.onnx`: {w['fused']} Q/DQ fused into "
                  f"integer kernels, {w['standalone']} standalone, {w['float_nodes']} float "
                  f"node(s) next to integer ones, {w['reformats']} reformat(s).", "",
                  "| pattern | fused | standalone | float next to integer | reformats |",
                  "|---|---|---|---|---|"]
        for p in w["patterns"]:
            cells = [f"{len(p[k])}" + (f": {_short(', '.join(p[k]), 120)}"
                                       if p[k] and k != "fused" else "")
                     for k in ("fused", "standalone", "float_nodes", "reformats")]
            lines.append(f"| {p['id']} | " + " | ".join(cells) + " |")
    lines += _kernel_lines(r.get("kernel_table"))
    skipped = r.get("descent_skipped") or []
    if skipped:  # one row each: the reasons carry each pattern's own figures
        lines += ["", f"{len(skipped)} visit(s) skipped by the runtime's report, the gap or "
                  "what the lane's visits realized of the limit estimate:", "",
                  "| pattern | round | why |", "|---|---|---|"]
        lines += [f"| {s['pattern']} | {s['round']} | {s['reason']} |" for s in skipped[:40]]
        if len(skipped) > 40:
            lines.append(f"| … | | {len(skipped) - 40} more in report.json `descent_skipped` |")
    if not r.get("complete", True):
        lines += ["", "**Partial result**: the run was cut short; `optimized.onnx` is the best "
                  "standing model found so far."]
    return lines


def _short(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _phases(r: dict) -> str:
    by = r.get("measurements_by_phase") or {}
    return ", ".join(f"{k} {v}" for k, v in by.items() if v)


def _elapsed(r: dict) -> str:
    """When each phase ended, in seconds of this process (a resumed run counts from its
    resumption)."""
    at = r.get("elapsed_s") or {}
    return (" Phases ended at " + ", ".join(f"{k} {v:.0f} s" for k, v in at.items()) + "."
            if at else "")


def _how_to_run_lines(backend: dict) -> list[str]:
    """The backend's one-line how-to-run (OpenVINO: the compile properties every measurement
    used, the inference precision hint included) and why that hint."""
    out = []
    if backend.get("inference_precision"):
        out.append(f"- inference precision: `{backend['inference_precision']}` "
                   f"({backend.get('inference_precision_why') or 'given'})")
    if backend.get("how_to_run"):
        out.append(f"- run it: `{backend['how_to_run']}`")
    return out


def _cpu_lines(cpu: dict | None) -> list[str]:
    """The CPU flags the run decided by (7-bit weights, the precision hint, the timings)."""
    if not cpu:
        return []
    flags = ", ".join(cpu["flags"]) or "none that change an answer"
    return [f"- cpu: {cpu.get('model_name') or cpu['arch']} ({cpu['source']}); decided by its "
            f"flags: {flags} (VNNI {'yes' if cpu['vnni'] else 'no'}, BF16 "
            f"{'yes' if cpu['bf16'] else 'no'}, AMX {'yes' if cpu['amx'] else 'no'}; 7-bit "
            f"weights where u8 x s8 saturates: {'yes' if cpu['saturates_u8s8'] else 'no'})"]


def _kept_lines(kept: dict | None) -> list[str]:
    """The tuned model measured slower than the baseline, which ships instead."""
    if not kept:
        return []
    c = kept["tuned_comparison"]
    return [f"**`optimized.onnx` is {kept['baseline_model']}**: the search's best model measured "
            f"{_f(c['ratio'])}x its latency (interval {_f(c['ci_low'])}–{_f(c['ci_high'])}), "
            "so no placement found beat it; the figures above re-measure the shipped file.", ""]


def _mode_lines(r: dict) -> list[str]:
    """How the MatMul/Gemm/Conv nodes of ``optimized.onnx`` run, when a per-node mode
    (dynamic, weight-only) was searched."""
    counts = r.get("mode_counts")
    if r.get("modes", []) == [QuantMode.STATIC.value] or not counts:
        return []
    shown = [m for m in MODE_COUNT_KEYS if m in {*r["modes"], "float"} or counts.get(m)]
    return ["", f"Modes searched: {', '.join(r['modes'])}; the MatMul/Gemm/Conv nodes of "
                f"`optimized.onnx`: "
                f"{', '.join(f'{counts.get(m, 0)} {m}' for m in shown)}."]


def _recipe_file_lines(rf: dict | None) -> list[str]:
    """One recipe file as written: against what would ship (the tuned model, or an earlier
    file that ships) and, for a file with a placement, against its re-export; what differs in
    their Q/DQ, and whether it ships."""
    if not rf:
        return []
    name = f"`{rf['file']}`" + (f", {rf['tool']}'s" if rf.get("tool") else "")
    if rf.get("failure"):
        return [f"The recipe's own file ({name}) could not be measured: {rf['failure']}", ""]
    if rf.get("not_timed"):
        return [f"The recipe's own file ({name}): its output error "
                f"{_f(rf['error'], '{:.4g}')} is past the bound, so it was not timed (it "
                "cannot ship).", ""]

    def ab(c: dict) -> str:
        return f"{_f(c['ratio'])}x (interval {_f(c['ci_low'])}–{_f(c['ci_high'])})"

    against = rf.get("against", "the tuned model")
    head = (f"**`optimized.onnx` is the recipe's own file** ({name}): {against} "
            f"measured {ab(rf['tuned_vs_file'])} its latency." if rf["shipped"] else
            f"The recipe's own file ({name}, measured as written): {against} measured "
            f"{ab(rf['tuned_vs_file'])} its latency.")
    if "reexport_vs_file" in rf:
        head += (f" The re-export of its placement with our scales measured "
                 f"{ab(rf['reexport_vs_file'])} the file's.")
    lines = [head + f" Its output error {_f(rf['error'], '{:.4g}')} is "
                    f"{'within' if rf['within_bound'] else 'past'} the bound."]
    if rf.get("differences"):
        lines += ["", "The re-export is slower than the file beyond noise; their Q/DQ differ "
                      "(re-export vs file):", ""] + [f"- {d}" for d in rf["differences"]]
    return lines + [""]


def _speedup_line(r: dict, lo, hi) -> str:
    final = r.get("final_comparison") or {}
    if final.get("same_model"):
        return (f"**Speedup {_f(r['speedup'])}x**: `optimized.onnx` is the baseline itself, "
                f"measured once more ({final['candidate']['sessions']} fresh sessions"
                + (", cut short: the run's time was up" if final.get("cut_short") else "")
                + "); there is nothing to compare.")
    cut = (f" The run's time was up: this A/B was cut short at {final.get('rounds')} rounds."
           if final.get("cut_short") else "")
    return (f"**Speedup {_f(r['speedup'])}x** ({int(r['speedup_confidence'] * 100)} % interval "
            f"{_f(lo)}–{_f(hi)}, interleaved re-measurement of the saved model against the "
            "baseline)." + cut)


def _session_settings_lines(ss: dict | None) -> list[str]:
    """The runtime settings the model ships with (and the line a deployment adds), or what
    became of each one tried."""
    if not ss or not ss.get("candidates"):
        return []

    def ab(c: dict) -> str:
        if c.get("ratio") is None:
            return ""
        lo, hi = c.get("ci") or (None, None)
        return f" ({_f(c['ratio'])}x the latency with it, interval {_f(lo)}–{_f(hi)})"

    shipped = ss.get("shipped")
    lines = []
    if shipped:
        chosen = next(c for c in ss["candidates"] if c["name"] == shipped["name"])
        lines += [f"**`optimized.onnx` ships with runtime session settings** "
                  f"`{shipped['name']}`{ab(chosen)}: {shipped['why']}. The speedup above is "
                  "measured with them; create each session with them, as this line does "
                  "(`so`: the session options):", "", "```python", *shipped["code"], "```", ""]
    tried = [c for c in ss["candidates"] if not shipped or c["name"] != shipped["name"]]
    if tried:
        lines += ["Runtime session settings tried on the shipped model: "
                  + "; ".join(f"`{c['name']}`: {c['decision']}{ab(c)}" for c in tried) + ".",
                  ""]
    return lines


def _defaults_lines(taken: list[str] | None) -> list[str]:
    """One line: the file's graph inputs that were initializers nobody fed, tuned as constants."""
    if not taken:
        return []
    return [f"{len(taken)} initializers the model lists as graph inputs (default values, not "
            "fed by the calibration data) were tuned as constants and are no inputs of "
            "`optimized.onnx`.", ""]


def _reader_clipped_lines(count: int | None) -> list[str]:
    """One line: how many activation ranges calibration cut where every reader saturates."""
    if not count:
        return []
    return [f"- activation ranges cut to what their readers distinguish: {count} tensors "
            "(read only by ops that saturate or clip them: Sigmoid, Tanh, HardSigmoid, Clip, "
            "Relu, HardSwish, also written out as x * Clip(x + 3, 0, 6))"]


def _pattern_lines(r: dict) -> list[str]:
    """The patterns table: each pattern's standing scheme, gain and visits."""
    accuracy = any("committed_error" in p for p in r["patterns"])
    lines = [
        "## Patterns",
        "",
        "Each visit tunes the pattern against the whole standing model; its gain is the whole "
        "model's.",
        "",
        "| pattern | regions | points | trials | start | standing scheme | gain |"
        + (" error after commit |" if accuracy else "") + " visits |",
        "|---|---|---|---|---|---|---|" + ("---|" if accuracy else "") + "---|",
    ]
    for p in r["patterns"]:
        scheme = [f"{k}:{p['committed_types'][k]}" if k in p.get("committed_types", {}) else k
                  for k in p["committed_scheme"]]
        err = f" {_f(p.get('committed_error'), '{:.4g}')} |" if accuracy else ""
        visits = "; ".join(
            f"{(v['lane'] + ' ') if v.get('lane') else ''}round {v['round']}"
            + (f" (as {v['pattern']}'s chain partner)" if v.get("pattern") != p["id"] else "")
            + f": {v.get('commit_reason') or v['status']}" for v in p.get("visits", []))
        lines.append(
            f"| {p['id']} ({'/'.join(p['ops'][:4])}{'…' if len(p['ops']) > 4 else ''}) | "
            f"{len(p['regions'])} | {len(p['insertion_points'])} | {p['trials']} | "
            f"{len(p.get('start_scheme', []))} on | {', '.join(scheme) or '—'} | "
            f"{_f(p['gain'])} |{err} {visits or 'not visited'} |"
        )
    return lines


def render_stopped_markdown(r: dict) -> str:
    """report.md of a run a signal stopped (:func:`stopped_report`)."""
    st = r["stopped"]
    model = ("`optimized.onnx` is the standing model the search last saved (every decision in "
             "it passed the accuracy guard)" if st.get("optimized_onnx")
             else "no `optimized.onnx` yet (the starts were not decided)")
    estimate = r.get("standing_speedup_estimate")
    standing = ("the standing model's speedup is not known yet" if estimate is None else
                f"standing model about {_f(estimate)}x (its start's ratio times the descent's "
                "committed gains, not a final A/B)")
    lines = [
        f"# qdq-optuna report: stopped by {st['signal']}, incomplete",
        "",
        f"- model: `{r['model']}`",
        f"- backend: `{r['backend'].get('name')}` (rules: {r['runtime']}), quant type "
        f"`{r['quant_type']}`",
        *_cpu_lines(r.get("cpu")),
        f"- run: `{r['run_id']}` in `{r['storage']}`",
        "",
        f"The run was stopped by {st['signal']} before it concluded: nothing here was measured "
        f"after the signal and the final A/B against the baseline did not run; {model}. "
        "**Rerun the same command to resume**: every committed measurement is kept, the trial "
        "that was running is redone.",
        "",
        (f"Baseline {_f(r['in_search_baseline_latency_ms'], '{:.4f}')} ms as the search "
         f"measured it; {standing}." if r.get("in_search_baseline_latency_ms") is not None
         else "Stopped before the baseline was measured.")
        + f" {r['measurements']} measurements in this process ({_phases(r) or 'none'}).",
        "",
        *_starts_lines(r),
        *_pattern_lines(r),
    ]
    return "\n".join(lines) + "\n"


def render_markdown(r: dict) -> str:
    lo, hi = r["speedup_ci"]
    lines = [
        "# qdq-optuna report",
        "",
        f"- model: `{r['model']}`",
        f"- backend: `{r['backend'].get('name')}` (rules: {r['runtime']}), quant type `{r['quant_type']}`,"
        f" sampler `{r['sampler']}`, timing `{r['timing']}`, scales `{r['scales']}`",
        f"- high precision: {_precision_line(r.get('high_precision'))}",
        *_reader_clipped_lines(r.get("reader_clipped_ranges")),
        *_how_to_run_lines(r.get("backend") or {}),
        *_cpu_lines(r.get("cpu")),
        f"- run: `{r['run_id']}` in `{r['storage']}`" + ("" if r["complete"] else " — **incomplete (timeout)**"),
        "",
        "| | latency (ms) |",
        "|---|---|",
        f"| baseline ({r.get('baseline_model') or 'no Q/DQ'}) | {_f(r['baseline_latency_ms'])} |",
        f"| tuned (`optimized.onnx`) | {_f(r['final_latency_ms'])} |",
        "",
        _speedup_line(r, lo, hi),
        "",
        *_session_settings_lines(r.get("session_settings")),
        f"{len(r['quantized_tensors'])} activation tensors and {len(r['quantized_weights'])} weights carry "
        f"Q/DQ. {r['measurements']} measurements ({_phases(r)}); {r['builds_saved_by_cache']} "
        "builds saved by the cache." + _elapsed(r),
        *_statistics_lines(r.get("search_statistics")),
        *_mode_lines(r),
        "",
        *_kept_lines(r.get("kept_your_model")),
        *[line for rf in (r.get("recipe_files") or [r.get("recipe_file")])
          for line in _recipe_file_lines(rf)],
        *_defaults_lines(r.get("defaults_taken")),
        *_starts_lines(r),
        *_forward_lines(r.get("forward")),
        *_repair_lines(r),
    ]
    if r.get("accuracy"):
        lines += accuracy_lines(r["accuracy"], r.get("max_output_error"))
    lines += _pattern_lines(r)
    lines += _what_ran_lines(r)
    lines += ["", *limit_lines(r), *time_spent_lines(r)]
    if r.get("pareto"):
        from qdq_optuna.outputs.pareto import write_front_table

        lines += write_front_table(r["pareto"])
    return "\n".join(lines) + "\n"


def _more_rows(rows: list, limit: int, columns: int, what: str = "groups") -> list[str]:
    """The line of a report.md table cut at ``limit`` rows that says how many more
    report.json has (none when nothing was cut)."""
    if len(rows) <= limit:
        return []
    return [f"| ... {len(rows) - limit} more {what} in report.json |" + " |" * (columns - 1)]
