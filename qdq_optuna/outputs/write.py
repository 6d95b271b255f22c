"""The run's written results: from what the search concluded to ``report.json`` /
``report.md`` (and ``pareto/`` for two objectives). The search imports none of this: the
pipeline (:mod:`qdq_optuna._tune`) hands the outcome over."""

from __future__ import annotations

from qdq_optuna.outputs.report import (
    accuracy_keys,
    build_report,
    header_keys,
    mode_keys,
    runtime_keys,
    stopped_report,
    write_reports,
)


def write_outputs(outcome) -> dict:
    """Build and write the report of ``outcome`` (a
    :class:`~qdq_optuna.search.SearchOutcome`); returns it. Two objectives: the
    latency/error front is measured here (with the run's plan measurer) and written first."""
    o = outcome
    report = build_report(header_keys(o.header), o.record, o.plans, o.prepared, o.plan, o.comparison,
                          rows=o.rows, baseline_ms=o.baseline_ms, partial=o.partial,
                          lane=o.lane)
    report.update(accuracy_keys(o.accuracy))
    if o.multi_objective:
        from qdq_optuna.outputs.pareto import model_front

        report["pareto"] = model_front(o.record, o.plans, o.exporter, o.rows, o.baseline_bytes,
                                       o.comparison, o.plan, o.out)
        report["measurements"] = o.plans.measurements
    report.update(runtime_keys(o))
    report.update(mode_keys(o.final_bytes, o.prepared.rules))
    if o.session_settings is not None:
        report["session_settings"] = o.session_settings
    report["elapsed_s"] = dict(o.elapsed)
    if o.wall_time is not None:
        report["wall_time"] = o.wall_time.to_dict()
    write_reports(o.out, report)
    return report


def write_stopped_outputs(outcome) -> dict:
    """The report of what a run stopped part way knows (a
    :class:`~qdq_optuna.search.StoppedOutcome`): nothing is measured; returns it."""
    report = stopped_report(outcome)
    write_reports(outcome.out, report)
    return report
