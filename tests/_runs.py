"""What a finished run must contain, computed independently of the search."""

from __future__ import annotations

import itertools
from pathlib import Path

from qdq_optuna.model import PreparedModel


def distinct_models(model: Path, patterns: list[dict], *, runtime: str = "onnxruntime",
                    quant_type: str | None = None) -> dict[str, int]:
    """Distinct models each pattern's schemes build, on top of the earlier commits."""
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
        base |= pp.uses(row["committed_scheme"])
    return counts


def expected_trials(model: Path, report: dict, budget: int) -> dict[str, int]:
    """min(budget, distinct models the pattern's schemes build on top of earlier commits)."""
    counts = distinct_models(model, report["patterns"], runtime=report["runtime"],
                             quant_type=report["quant_type"])
    return {pid: min(budget, n) for pid, n in counts.items()}
