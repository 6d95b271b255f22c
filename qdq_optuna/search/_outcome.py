"""What a run gives back: :class:`TuneResult` (``tune()``'s answer) and what the search
concluded for the outputs (:class:`SearchOutcome` with its :class:`FrontPoint` s,
:class:`StoppedOutcome`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from qdq_optuna.backends.base import Backend
from qdq_optuna.backends.what_ran import WhatRan
from qdq_optuna.record import PatternStanding, RunRecord
from qdq_optuna.run_folder import OPTIMIZED
from qdq_optuna.runtimes.prepared import PreparedModel
from qdq_optuna.wall_time import WallTime

if TYPE_CHECKING:  # the search's own types, listed above this module (annotations only)
    from qdq_optuna.measure.timing import Comparison
    from qdq_optuna.placement.export import ExportedModel, QDQExporter, QuantPlan
    from qdq_optuna.search._plans import PlanMeasurer


@dataclass
class TuneResult:
    """What ``tune()`` returns: where the outputs are, and ``report.json`` as a dict.

    ``result.speedup`` is your model's latency over the tuned one's (the final interleaved A/B;
    ``report["final_comparison"]`` has its interval), ``result.optimized_model`` the path of
    ``optimized.onnx``. Every key of ``report``: the docs' "Outputs and schemas" page.
    """

    output_dir: Path
    report: dict
    #: the run had finished before: ``report`` is its stored report, nothing was measured
    finished_before: bool = False

    @property
    def speedup(self) -> float:
        return self.report["speedup"]

    @property
    def optimized_model(self) -> Path:
        return self.output_dir / OPTIMIZED


@dataclass(frozen=True)
class RunHeader:
    """What was tuned, where, how: report.json's first fields
    (:func:`~qdq_optuna.outputs.report.header_keys`)."""

    model: str
    output: str
    run_id: str
    storage: str
    #: the backend's own description (its name, runtime, options)
    backend: dict
    runtime: str
    quant_type: str
    sampler: str
    timing: str
    scales: str
    #: activation ranges cut to what their readers distinguish
    reader_clipped_ranges: int
    #: the float part's precision (None: the model as given)
    high_precision: dict | None


@dataclass(frozen=True)
class AccuracyModes:
    """The accuracy modes' settings (any accuracy option given), as the report states them."""

    objectives: list[str]
    #: what the error is: a measure, or ``metric MODULE:NAME``
    error_measure: str
    #: the trials' error budget (None: trials are not constrained)
    max_output_error: float | None


@dataclass
class ShippedAccuracy:
    """What the accuracy guard measured of the model that ships
    (:func:`~qdq_optuna.outputs.report.accuracy_keys` words it)."""

    #: the guard's figures (report.json ``accuracy``: the bound, the errors, the repair, ...)
    guard: dict
    final_output_error: float
    final_output_errors: dict
    #: the runtime's recipe files as measured (the classic recipe's first; None: none)
    recipe_files: list[dict] | None = None
    #: the user's model shipped because the tuned one measured slower (None: it did not)
    kept_your_model: dict | None = None
    #: the accuracy modes' settings (None: no accuracy option given)
    modes: AccuracyModes | None = None


@dataclass(frozen=True)
class DescentFindings:
    """What the descent read of the runtime, for the report: the visits the runtime's report
    of the standing model skipped (lane, round, pattern id, why); how many standing models'
    reports it read and the kernel table it timed (None: it read none, pruning was off), with
    how the shipped model placed each node."""

    skipped: list[tuple[str, int, str, str]]
    what_ran_reads: int | None = None
    kernel_table: dict | None = None
    #: the limit estimate and the shipped model's gap to it (:mod:`~qdq_optuna.search._limit`)
    limit: dict | None = None
    #: each round's visits as the gap planned them (order, skipped, gaps, noise)
    plans: list[dict] | None = None


@dataclass
class FrontPoint:
    """One measured model of a two-objective run's latency/error front
    (:func:`~qdq_optuna.search._pareto.measure_front`): a prefix of the chain of committed
    schemes (FP32 first), re-measured as a whole model."""

    index: int
    #: the patterns whose committed schemes it adds, in the chain's order
    patterns: list[str]
    latency_ms: float
    #: FP32's latency over its own (None: a zero ratio), with its 95% interval
    speedup: float | None
    speedup_ci: list[float | None]
    #: its output error on the validation data, and the worst output's figures
    error: float
    worst_cosine: float | None
    worst_relative_l2: float | None
    #: its Q/DQ (the outputs save the models on the front)
    plan: QuantPlan
    #: not dominated in (latency, error) by another point of the chain
    on_front: bool = False

    def to_dict(self, file: str | None) -> dict:
        """report.json's entry (``file``: where the outputs saved its model, None: off the front)."""
        return {"index": self.index, "patterns": list(self.patterns),
                "latency_ms": self.latency_ms, "speedup": self.speedup,
                "speedup_ci": list(self.speedup_ci), "error": self.error,
                "worst_cosine": self.worst_cosine, "worst_relative_l2": self.worst_relative_l2,
                "quantized_tensors": len(self.plan.tensors), "plan_key": self.plan.key,
                "on_front": self.on_front, "file": file}


@dataclass(frozen=True)
class MeasurementCounts:
    """The plan measurer's counters as the shipped model's A/B left them (report.json's
    ``measurements_by_phase`` and ``measurer``; a front's own A/Bs count in ``measurements``)."""

    measurements: int
    by_phase: dict[str, int]
    measurer: dict[str, int | float]
    #: the screen's threshold the search measured with
    screen_discard_ratio: float

    @classmethod
    def of(cls, plans: PlanMeasurer) -> MeasurementCounts:
        return cls(plans.measurements, dict(plans.by_phase), plans.measurer.counters(),
                   plans.screen_discard_ratio)


@dataclass
class SearchOutcome:
    """What a search concluded, for the outputs (:func:`qdq_optuna.outputs.write.write_outputs`):
    the model that ships (saved as ``out/optimized.onnx``), its A/B against the baseline, its
    accuracy, and the objects the report reads (the run record, the plan measurer)."""

    out: Path
    #: report.json's first fields: what was tuned, where, how
    header: RunHeader
    record: RunRecord
    #: every measurement, counted per phase
    plans: PlanMeasurer
    prepared: PreparedModel
    backend: Backend
    #: what the descent read of the runtime (None when the run stopped before it)
    descent: DescentFindings | None
    lane: str
    #: each pattern's place in the shipped lane's standing model
    rows: list[PatternStanding]
    #: the shipped model's Q/DQ
    plan: QuantPlan
    #: the exporter with the final scales
    exporter: QDQExporter
    final_bytes: bytes | None
    #: what every speedup is against (a model written piece by piece: its files)
    baseline_bytes: bytes | ExportedModel
    #: the final A/B (shipped model vs baseline)
    comparison: Comparison
    baseline_ms: float
    #: what the guard measured of what ships (report.json's ``accuracy``, ``final_output_error(s)``
    #: and the accuracy modes' keys)
    accuracy: ShippedAccuracy
    partial: bool
    multi_objective: bool
    elapsed: dict[str, float]
    #: where the wall time went, phase by phase (the report's "Where the time went")
    wall_time: WallTime | None = None
    #: what the runtime ran for the shipped model (its profile's reader; None: no report)
    what_ran: WhatRan | None = None
    #: why it could not be read (the report ships without it)
    what_ran_error: str | None = None
    #: report.json's ``session_settings``: the runtime settings the model ships with and
    #: every candidate's A/B (None: the runtime's profile lists none)
    session_settings: dict | None = None
    #: two objectives: the whole-model latency/error front, measured last (None: one objective)
    front: list[FrontPoint] | None = None
    #: the plan measurer's counters when the outcome was concluded, before any front
    counts: MeasurementCounts = field(init=False)

    def __post_init__(self) -> None:
        self.counts = MeasurementCounts.of(self.plans)


@dataclass
class StoppedOutcome:
    """What a run stopped part way (Ctrl-C, SIGTERM, SIGHUP) knows, for the report of what is
    known (:func:`qdq_optuna.outputs.write.write_stopped_outputs`): nothing is measured
    after the signal; ``optimized.onnx`` is the standing model the search last saved."""

    out: Path
    header: RunHeader
    record: RunRecord
    #: the signal that stopped the run (``signal.SIGINT`` for Ctrl-C)
    signum: int
    #: the lane whose standing model ``optimized.onnx`` holds ("" before the starts agreed)
    lane: str
    rows: list[PatternStanding]
    #: None: stopped before the baseline was measured
    baseline_ms: float | None
    #: this process's measurements, counted per phase
    measurements: int
    by_phase: dict[str, int]
    elapsed: dict[str, float]
