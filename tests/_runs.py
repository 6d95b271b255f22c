"""What a finished run must contain, computed independently of the search."""

from __future__ import annotations

import itertools
from pathlib import Path

from qdq_optuna.model import PreparedModel


def first_pass_scheme(row: dict) -> list[str]:
    """A report pattern entry's scheme as the pattern-by-pattern pass committed it (before any
    refinement round changed it)."""
    refinements = row.get("refinements") or []
    return refinements[0]["from_scheme"] if refinements else row["committed_scheme"]


def distinct_models(model: Path, patterns: list[dict], *, runtime: str = "onnxruntime",
                    quant_type: str | None = None) -> dict[str, int]:
    """Distinct models each pattern's schemes build, on top of the earlier commits (of the
    pattern-by-pattern pass)."""
    pm = PreparedModel.prepare(str(model), runtime=runtime, quant_type=quant_type)
    exporter = pm.exporter()
    by_id = {pp.pattern.id: pp for pp in pm.tunable}
    base: set = set()
    counts = {}
    for row in patterns:
        pp = by_id[row["id"]]
        keys = {exporter.plan(base | pp.uses([p for p, b in zip(pp.ids, bits) if b])).key
                for bits in itertools.product((0, 1), repeat=len(pp.ids))}
        counts[row["id"]] = len(keys)
        base |= pp.uses(first_pass_scheme(row))
    return counts


def expected_trials(model: Path, report: dict, budget: int) -> dict[str, int]:
    """Finished trials per pattern study: min(budget, distinct models the pattern's schemes
    build on top of earlier commits); a refinement study (``P000/refine1``) at most
    min(budget, twice the pattern's points), one study per entry of ``refinements``."""
    counts = distinct_models(model, report["patterns"], runtime=report["runtime"],
                             quant_type=report["quant_type"])
    want = {pid: min(budget, n) for pid, n in counts.items()}
    for row in report["patterns"]:
        for ref in row.get("refinements") or []:
            want[f"{row['id']}/refine{ref['round']}"] = min(budget, 2 * len(row["insertion_points"]))
    return want


def is_refinement(study_key: str) -> bool:
    return "/refine" in study_key


def standing_schemes(study_attrs: list[dict]) -> list[tuple[dict, dict]]:
    """Per pattern, in pass order: its first-pass study's attrs and the scheme that stands
    (``committed`` of its last committed round), from the user attrs of a run's pattern
    studies (first pass and refinements, in any order)."""
    by_pattern: dict[str, list[dict]] = {}
    for a in study_attrs:
        assert "committed" in a, f"{a.get('pattern_id')} round {a.get('refine_round')}: not committed"
        by_pattern.setdefault(a["pattern_id"], []).append(a)
    out = []
    for rounds in by_pattern.values():
        rounds.sort(key=lambda a: a.get("refine_round", 0))
        out.append((rounds[0], rounds[-1]["committed"]))
    return sorted(out, key=lambda pair: pair[0]["order"])
