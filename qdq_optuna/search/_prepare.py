"""Preparing a run, before anything is measured: the first of a run's three owners (prepare,
search, write outputs; see docs/architecture.md).

* :meth:`PreparedRun.from_options`: the backend made, the runtime's profile chosen once, the
  model prepared (regions, patterns, points, precision), the user's data read once, the timing
  protocol and the resolved settings;
* :func:`open_run`: the storage and the run record opened (a run of the earlier
  pattern-by-pattern search, or one stored with other settings, is refused in one line), the
  user's warm starts loaded and checked, and what the search measures with: the calibrated
  scales, the exporter, the error scorer, the plan measurer and the accuracy guard.

``tune()`` calls both and hands the results to the search
(:class:`~qdq_optuna.search._run.Tuner`), which only decides and records; nothing here
measures a latency.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from qdq_optuna._files import TRACEBACK_FILE, remove_stale_temps
from qdq_optuna._progress import Progress
from qdq_optuna.backends.base import Backend, measuring
from qdq_optuna.errors import UserError
from qdq_optuna.machine import measuring_machine
from qdq_optuna.measure.accuracy import ErrorScorer, hold_out, metric_drop_bound, validation_data
from qdq_optuna.measure.bias import CorrectedExports, corrected_exports
from qdq_optuna.measure.bound import AccuracyBound, AskedBound, MetricDrop
from qdq_optuna.measure.timing import Measurer, TimingProtocol
from qdq_optuna.model.data import data_id, fed_names, input_data
from qdq_optuna.model.graph import InputShapes
from qdq_optuna.placement.export import QDQExporter, Scales
from qdq_optuna.placement.seeds import PatternCache, baseline_tensors
from qdq_optuna.record import RunRecord, delete_run
from qdq_optuna.record.storage import default_storage_url, open_storage, quiet_optuna
from qdq_optuna.run_folder import RunFolder
from qdq_optuna.runtimes import Runtime
from qdq_optuna.runtimes.prepared import PreparedModel
from qdq_optuna.search._commit import CommitRule
from qdq_optuna.search._guard import Guard
from qdq_optuna.search._options import TuneOptions
from qdq_optuna.search._pattern import Search
from qdq_optuna.search._plans import PlanMeasurer
from qdq_optuna.search._settings import (
    Settings,
    backend_for,
    backend_name,
    check_runtime_named,
    digest,
    fingerprint,
    metric_label,
)
from qdq_optuna.search._workers import Workers, retry_stale_trial
from qdq_optuna.wall_time import WallTime

log = logging.getLogger("qdq_optuna")

#: the wall time's first phase: everything before the baseline is measured
PREPARING = "preparing"


@dataclass
class PreparedRun:
    """What a run is given before it opens its storage: the options, where its files go, the
    backend and the runtime's profile, the prepared model, the user's data (``(arrays, id)``,
    None: not given), the timing protocol and the resolved settings."""

    options: TuneOptions
    out: Path
    folder: RunFolder
    backend: Backend
    profile: Runtime
    prepared: PreparedModel
    calibration: tuple[dict, str] | None
    validation: tuple[dict, str] | None
    measurer: Measurer
    settings: Settings
    #: the accuracy bound as asked (the fingerprint's; :func:`accuracy_bound` resolves it)
    asked_bound: AskedBound
    run_id: str
    storage_url: str
    #: where the run's wall time went, preparing first (:mod:`qdq_optuna.wall_time`)
    wall: WallTime = field(default_factory=WallTime)

    @classmethod
    def from_options(cls, options: TuneOptions) -> PreparedRun:
        """Prepare ``options``' run: bad options, a bad model or bad data fail here, in one
        line, before any file is written or anything measured."""
        wall = WallTime()
        out = Path(options.output_dir)
        with wall.step(PREPARING, "backend"):
            backend = backend_for(options)
        check_runtime_named(options, backend)
        profile = Settings.profile_of(options, backend)
        precision = profile.high_precision(options.high_precision, backend_name(options, backend))
        modes = profile.searched_modes(options.modes, precision)
        with wall.step(PREPARING, "model"):
            prepared = PreparedModel.prepare(
                options.model, runtime=profile.rules_for_modes(modes),
                quant_type=options.quant_type, input_shapes=options.input_shapes,
                config=options.config, preprocess=options.preprocess, high_precision=precision,
                keep_io_types=options.keep_io_types, exclude_nodes=options.exclude_nodes,
                op_types=options.op_types, upgrade_opset=options.opset_upgrade,
                fed_inputs=fed_names(options.calibration_data),
            )
        with wall.step(PREPARING, "data"):  # the user's data, read once
            calibration = read_data(options.calibration_data, prepared, "calibration data")
            validation = read_data(options.validation_data, prepared, "validation data")
            if validation is None:  # the guard's errors on samples calibration never saw
                calibration, validation = hold_out(calibration)
        # a model whose weights stay on disk is exported into work folders of the output folder
        prepared.data_dir = out
        measurer = Measurer(backend, TimingProtocol.from_name(options.timing))
        wall.counters = measurer.counters
        settings = Settings.resolve(options, backend, prepared)
        return cls(options, out, RunFolder(out), backend, profile, prepared, calibration,
                   validation, measurer, settings, asked_bound(options), options.run_id_or_default,
                   options.storage or default_storage_url(out), wall)


@dataclass
class OpenedRun:
    """The run's storage opened: its record (settings agreed), the settings' digest, the
    user's warm starts (``--pattern-cache``; ``--qdq-baseline``'s quantized tensors), the
    calibrated activation scales (and how many ranges their readers cut), the trials'
    exporter, the plan measurer (latencies and errors) and the accuracy guard."""

    record: RunRecord
    fingerprint_digest: str
    cache: PatternCache | None
    baseline_q: set[str] | None
    scales: dict
    exporter: QDQExporter
    plans: PlanMeasurer
    guard: Guard
    #: how many activation ranges were cut to what their readers distinguish
    reader_clipped_ranges: int = 0


def open_run(run: PreparedRun) -> OpenedRun:
    """Open the storage and the run record of ``run`` (``--fresh`` deletes the stored run
    first); refuse a stored run it cannot resume; load the user's warm starts; build what the
    search measures with (bad validation data or a bad metric fails here)."""
    o, prepared, cfg, step = run.options, run.prepared, run.options.config, run.wall.step
    quiet_optuna(cfg.verbose)
    with step(PREPARING, "storage"):
        record, fingerprint_digest = _open_record(run)
        cache, baseline_q = warm_starts(run)
    scales: list[tuple[dict, int]] = []  # computed when first needed, once

    def scales_for(purpose: str) -> dict | None:
        if purpose == "trials" and run.settings.scales is Scales.DEFAULT:
            return None
        if not scales:
            with step(PREPARING, "calibration"):
                scales.append(calibrated_scales(prepared, o, run.folder, run.calibration))
        return scales[0][0]

    exporter = prepared.exporter(scales_for("trials"), cfg)
    with step(PREPARING, "error scorer"):
        scorer, data_name = error_scorer(prepared, o, run.profile, exporter, run.validation,
                                         run.calibration, run.backend)
    plans = PlanMeasurer(run.measurer, record.measured, scorer, record.errors,
                         regions=prepared.graph if cfg.subgraph_screen else None,
                         audit=cfg.subgraph_screen_audit)
    calibrated = (exporter if run.settings.scales is Scales.CALIBRATED
                  else prepared.exporter(scales_for("final"), cfg))
    bound = accuracy_bound(run.asked_bound, scorer, data_name)
    with step(PREPARING, "bias correction"):
        corrected = _bias_corrected(o, prepared, calibrated, run.calibration, scorer)
    guard = Guard(plans, calibrated, bound, corrected=corrected)
    with step(PREPARING, "noise floor"):
        guard.measure_floor()
    return OpenedRun(record, fingerprint_digest, cache, baseline_q, scales[0][0], exporter, plans,
                     guard, scales[0][1])


def search_context(run: PreparedRun, opened: OpenedRun, *, progress: Progress,
                   remaining: Callable[[], float | None],
                   on_commit: list[Callable]) -> Search:
    """What every pattern study of ``run`` shares, from what was prepared and opened: the
    commit rule, the workers' slots, the profile's kernel timing on this backend."""
    o, cfg = run.options, run.options.config
    return Search(
        prepared=run.prepared, exporter=opened.exporter, settings=run.settings, config=cfg,
        record=opened.record, rule=CommitRule(cfg.performance_threshold), sampler=o.sampler,
        seed=o.seed, plans=opened.plans,
        workers=Workers(opened.record, worker=o.worker, remaining=remaining),
        progress=progress, remaining=remaining, guard=opened.guard, on_commit=on_commit,
        kernel_timing=run.profile.kernel_timing(run.backend,
                                                run.prepared.rules.weight_only_modes),
        kernel_cache=o.kernel_cache)


def _bias_corrected(o: TuneOptions, prepared: PreparedModel, exporter: QDQExporter,
                    calibration, scorer: ErrorScorer) -> CorrectedExports | None:
    """``--bias-correction``: the guard's exports with their biases corrected on the
    calibration data the scales came from (the shifts measured the way the guard runs a
    model in ONNX Runtime: fused or as written), or None (off; one line saying why not)."""
    if not o.bias_correction:
        return None
    hp = prepared.high_precision
    corrected, why = corrected_exports(
        exporter, calibration, bf16=hp is not None and hp.precision == "bf16",
        fused=scorer.evaluator.optimize and scorer.evaluator.runner is None)
    if corrected is None:
        log.warning("--bias-correction: not applied (%s)", why)
    return corrected


def _open_record(run: PreparedRun) -> tuple[RunRecord, str]:
    """The storage and the run record, the settings agreed; their digest."""
    o = run.options
    run.out.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(run.out)  # half-written outputs of a killed process
    (run.out / TRACEBACK_FILE).unlink(missing_ok=True)  # an earlier attempt's: resumed past
    storage = open_storage(run.storage_url, heartbeat=o.worker, grace=o.heartbeat_grace,
                           on_stale=retry_stale_trial)
    fp = fingerprint(o, run.settings, run.prepared, run.backend, run.asked_bound,
                     validation_id=run.validation[1] if run.validation else None)
    fingerprint_digest = digest(fp)
    if o.fresh and not o.worker:
        delete_run(storage, run.run_id)
    record = RunRecord(storage, run.run_id, run.prepared.tunable, run.settings.space)
    record.check_layout(str(run.out))
    # before the settings: a worker on another machine hears what differs, not "backend"
    record.settle_machine(measuring_machine(measuring(run.backend.describe())), str(run.out))
    record.settle_fingerprint(fp, fingerprint_digest, str(run.out))
    return record, fingerprint_digest


def warm_starts(run: PreparedRun) -> tuple[PatternCache | None, set[str] | None]:
    """The user's warm starts (``--pattern-cache``, ``--qdq-baseline``), checked."""
    o, cache = run.options, None
    if o.pattern_cache:
        cache = PatternCache.load(o.pattern_cache)
        cache.check_matches(o.pattern_cache, run.prepared.tunable)
    baseline_q = baseline_tensors(o.qdq_baseline) if o.qdq_baseline else None
    if baseline_q is not None:
        known = set(run.prepared.candidate_tensors())
        if not baseline_q & known:
            raise UserError(f"--qdq-baseline {o.qdq_baseline}: none of its quantized "
                            "tensors exists in this model")
    return cache, baseline_q


def asked_bound(options: TuneOptions) -> AskedBound:
    """The accuracy bound as ``options`` ask for it (checked by :class:`TuneOptions`)."""
    return AskedBound(options.max_output_error, options.error_measure,
                      metric_label(options.metric), options.max_metric_drop,
                      options.metric_drop_type, options.accuracy_confidence)


def accuracy_bound(asked: AskedBound, scorer: ErrorScorer, data: str) -> AccuracyBound:
    """The run's accuracy bound, built once (the guard owns it): with ``--max-metric-drop`` the
    FP32 model's own metric (measured here) plus the drop, else ``--max-output-error``, else
    the default; ``data``: what the guard's errors are measured on."""
    drop = None
    if asked.max_metric_drop is not None:
        drop = MetricDrop(**metric_drop_bound(scorer.evaluator, asked.max_metric_drop,
                                              asked.drop_type))
    return AccuracyBound.resolve(asked, data, drop)


def error_scorer(prepared: PreparedModel, options: TuneOptions, profile: Runtime,
                 exporter: QDQExporter, validation, calibration,
                 backend=None) -> tuple[ErrorScorer, str]:
    """Output errors vs FP32 on the validation data (every run: the accuracy guard), and
    which data they are measured on; bad validation data or a bad metric fails here, before
    any measurement. The runtime's profile says how a candidate runs: through ONNX Runtime's
    fused kernels, as written, or in the runtime itself (OpenVINO)."""
    shapes = InputShapes.parse(options.input_shapes).shapes
    data, data_name = validation_data(prepared.graph.model, validation=validation,
                                      calibration=calibration, input_shapes=shapes)
    hp = prepared.high_precision  # errors are against FP32, whatever runs
    reference = (hp.source.full_model().SerializeToString() if hp is not None
                 else exporter.source(exporter.plan(set())))
    return ErrorScorer(reference, data, metric=options.metric,
                       error_measure=options.error_measure, optimize=profile.scores_fused(hp),
                       bf16=hp is not None and hp.precision == "bf16",
                       runner=profile.error_runner(shapes, backend),
                       confidence=options.accuracy_confidence), data_name


def read_data(given, prepared: PreparedModel, what: str) -> tuple[dict, str] | None:
    """``(arrays, id)`` of calibration or validation data given as a path or from Python (read
    once: a CalibrationDataReader can be drained only once)."""
    if given is None:
        return None
    option = "--" + what.replace(" ", "-")
    try:
        arrays = input_data(given, prepared.graph.model, what=what)
    except UserError as exc:
        raise type(exc)(f"{option}: {exc}") from exc
    return arrays, data_id(given, arrays)


def calibrated_scales(prepared: PreparedModel, options: TuneOptions, folder: RunFolder | None,
                      data: tuple[dict, str] | None) -> tuple[dict, int]:
    """Activation scales from one calibration pass on the FP32 model (statistics cached in
    ``OUT/calibration_stats.json``, keyed by the model, its preprocessing and the data; the
    scales are made from them each time, so a change of how is never served from the cache;
    ``folder`` None: not cached), and how many ranges their readers cut."""
    from qdq_optuna.model import calibration

    hp = prepared.high_precision
    source = hp.source if hp is not None else prepared.graph  # statistics of FP32 values
    tensors = prepared.candidate_tensors()
    if hp is not None:
        tensors = hp.source_tensors(tensors)
    shapes = InputShapes.parse(options.input_shapes).shapes
    if data is not None:
        arrays, data_name = data
    else:
        log.warning("no --calibration-data: calibrating on random inputs (scales are only "
                    "placeholders; pass real data for a deployable model)")
        arrays = calibration.random_calibration_data(source.model, shapes or None, samples=4,
                                                     seed=0)
        data_name = "random:4:0"
    fp = hashlib.sha256(json.dumps([prepared.source_sha256, prepared.preprocess.value, data_name,
                                    tensors], default=str).encode()).hexdigest()[:16]
    stats_path = folder.calibration_stats if folder is not None else None
    stats = calibration.load_statistics(stats_path, fingerprint=fp) if stats_path else None
    if stats is None:
        stats = calibration.collect_statistics(source.full_model(), tensors, arrays,
                                               external_data_dir=source.external_dir)
        if folder is not None:
            folder.write_calibration_stats(calibration.statistics_json(stats, fingerprint=fp))
    # counted for the report; the cut itself is run_scales'
    clipped = calibration.clipped_by_readers(stats, calibration.reader_bounds(source))
    if clipped:
        log.info("%d activation ranges cut to what their readers distinguish (Sigmoid, Tanh, "
                 "Clip, Relu, ...)", len(clipped))
    return prepared.run_scales(stats, options.calibration_method), len(clipped)
