"""A two-objective run's latency/error front (``--objectives latency,error``) as the outputs
give it: the search measured it (:attr:`~qdq_optuna.search.SearchOutcome.front`, a greedy chain
of the committed schemes, each prefix a real, measured model); the non-dominated points are
written to ``OUT/pareto/NN_latency_<ms>_error_<error>.onnx`` and every point is listed in
``report.json`` under ``pareto`` with ``on_front``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from qdq_optuna.run_folder import RunFolder

if TYPE_CHECKING:  # annotations: the measured front and the exporter that saves its models
    from qdq_optuna.placement.export import QDQExporter
    from qdq_optuna.search import FrontPoint


def write_front(points: list[FrontPoint], exporter: QDQExporter, out: Path) -> list[dict]:
    """Save the models on the front to ``out/pareto/`` (replacing an earlier run's) and
    return report.json's ``pareto`` entries."""
    folder = RunFolder(out)
    folder.clear_pareto()
    entries = []
    for p in points:
        file = None
        if p.on_front:
            name = f"{p.index:02d}_latency_{p.latency_ms:.4f}_error_{p.error:.4g}.onnx"
            file = folder.save_pareto_model(exporter, p.plan, name)
        entries.append(p.to_dict(file))
    return entries


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
