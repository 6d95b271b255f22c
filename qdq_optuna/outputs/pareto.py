"""A model-level latency/error front after a two-objective run (``--objectives latency,error``).

Every pattern ends with one committed scheme; combining every pattern's Pareto points is
exponential, so the front is a *greedy chain*: start from the FP32 model and add the patterns'
committed schemes one at a time, in order of latency gain per error added (as measured during
the search, see :func:`chain_order`). Each prefix of the chain is exported
and measured again as a whole model: latency by an interleaved A/B against FP32 (like the final
figure), error on the validation data. The non-dominated prefixes are written to
``OUT/pareto/NN_latency_<ms>_error_<error>.onnx``; every prefix is listed in ``report.json``
under ``pareto`` with ``on_front``. The chain is a heuristic: it is not the exact front over
all combinations, but every listed point is a real, measured model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from qdq_optuna.placement.scheme import combine
from qdq_optuna.record import PatternStanding
from qdq_optuna.run_folder import RunFolder
from qdq_optuna.search.objectives import pareto_indices


def chain_order(rows: Sequence[PatternStanding]) -> list[PatternStanding]:
    """Patterns with a non-empty commit, ordered by latency gain per error added.

    Gain is ``log(gain)`` of the confirmed commits, the error added is ``committed_error -
    reference_error`` of the pattern's last visit (both whole-model errors measured during the
    search); patterns that add no error come first, fastest gain first.
    """
    picked = []
    for r in rows:
        if not any(int(v) for v in r.scheme.values()):
            continue
        last = r.last
        gain = math.log(max(float(r.gain), 1.0 + 1e-9))
        added = (_or_zero(last and last.committed_error) - _or_zero(last and last.reference_error))
        picked.append((added <= 0, gain / max(added, 1e-12), int(last.order if last else 0), r))
    picked.sort(key=lambda x: (not x[0], -x[1], x[2]))
    return [r for *_, r in picked]


def _or_zero(value: float | None) -> float:
    return float(value) if value is not None else 0.0


def chain_steps(record, rows: list[PatternStanding]) -> list[tuple[list[str], dict]]:
    """The chain's prefixes: (patterns added, their typed uses), FP32 first."""
    by_id = {pp.pattern.id: pp for pp in record.tunable}
    steps: list[tuple[list[str], dict]] = [([], {})]
    added: list[str] = []
    for r in chain_order(rows):
        if r.pattern_id not in by_id:
            continue
        added = [*added, r.pattern_id]
        uses: dict = {}
        for row in rows:  # in pattern order, as the search combined them
            if row.pattern_id in added:
                uses = combine(uses, record.space.typed_uses(by_id[row.pattern_id], row.scheme))
        steps.append((added, uses))
    return steps


def model_front(record, plans, exporter, rows: list[PatternStanding], fp32: bytes, final_cmp,
                final_plan, out: Path) -> list[dict]:
    """Measure every prefix of the chain (``plans``: the plan measurer) and write the
    non-dominated ones to ``out/pareto/``."""
    steps = chain_steps(record, rows)
    fp32_ms = final_cmp.reference.score_ms
    points: list[dict] = []
    for i, (patterns, step_uses) in enumerate(steps):
        plan = exporter.plan(step_uses)
        data = exporter.to_bytes(plan)
        if not patterns:
            ratio, ci = 1.0, [1.0, 1.0]
        elif plan.key == final_plan.key:  # the optimized model: measured just before
            ratio, ci = final_cmp.ratio, [final_cmp.ci_low, final_cmp.ci_high]
        else:
            cmp = plans.compare(data, fp32, "pareto")
            ratio, ci = cmp.ratio, [cmp.ci_low, cmp.ci_high]
        err = plans.error(exporter, plan)
        points.append({
            "index": i,
            "patterns": list(patterns),
            "latency_ms": fp32_ms * ratio,
            "speedup": 1.0 / ratio if ratio > 0 else None,
            "speedup_ci": [1.0 / ci[1] if ci[1] > 0 else None, 1.0 / ci[0] if ci[0] > 0 else None],
            "error": err["error"],
            "worst_cosine": err.get("worst_cosine"),
            "worst_relative_l2": err.get("worst_relative_l2"),
            "quantized_tensors": len(plan.tensors),
            "plan_key": plan.key,
            "on_front": False,
            "file": None,
        })

    front = set(pareto_indices([(p["latency_ms"], p["error"]) for p in points]))
    folder = RunFolder(out)
    folder.clear_pareto()
    for p in points:
        if p["index"] not in front:
            continue
        p["on_front"] = True
        name = f"{p['index']:02d}_latency_{p['latency_ms']:.4f}_error_{p['error']:.4g}.onnx"
        plan = exporter.plan(steps[p["index"]][1])
        p["file"] = folder.save_pareto_model(exporter, plan, name)
    return points


def write_front_table(points: list[dict]) -> list[str]:
    """Markdown lines for report.md."""
    if not points:
        return []
    lines = [
        "",
        "## Latency / error front (whole model)",
        "",
        "Greedy chain: FP32, then the committed schemes added pattern by pattern in order of "
        "latency gain per error; each row is a model re-measured as a whole (latency: "
        "interleaved A/B vs FP32; error on the validation data).",
        "",
        "| # | patterns added | latency (ms) | speedup | error | worst cosine | front | file |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in points:
        cos = "n/a" if p.get("worst_cosine") is None else f"{p['worst_cosine']:.5f}"
        lines.append(
            f"| {p['index']} | {', '.join(p['patterns']) or 'none (FP32)'} | "
            f"{p['latency_ms']:.4f} | {p['speedup']:.3f} | {p['error']:.4g} | {cos} | "
            f"{'yes' if p['on_front'] else ''} | {p['file'] or ''} |"
        )
    return lines
