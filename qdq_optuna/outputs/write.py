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
    :class:`~qdq_optuna.search.SearchOutcome`); returns it. Two objectives: the models on
    the latency/error front the search measured are written first."""
    o = outcome
    report = build_report(header_keys(o.header), o.record, o.counts, o.prepared, o.plan,
                          o.comparison, rows=o.rows, baseline_ms=o.baseline_ms,
                          partial=o.partial, lane=o.lane)
    report.update(accuracy_keys(o.accuracy))
    if o.front is not None:
        from qdq_optuna.outputs.pareto import write_front

        report["pareto"] = write_front(o.front, o.exporter, o.out)
        report["measurements"] = o.plans.measurements  # the front's A/Bs too
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
