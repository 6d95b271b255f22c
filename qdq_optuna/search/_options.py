"""A run's options, what they resolve to, and the fingerprint a resumed run must match."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx

from qdq_optuna.backends import BACKENDS, make_backend, runtime_for_backend
from qdq_optuna.backends.base import Backend
from qdq_optuna.backends.callable import CallableBackend
from qdq_optuna.config import Config
from qdq_optuna.errors import OptionError
from qdq_optuna.measure.bisect import DEFAULT_MAX_OUTPUT_ERROR
from qdq_optuna.model.calibration import DEFAULT_METHOD
from qdq_optuna.model.graph import InputShapes
from qdq_optuna.placement.prepared import PreparedModel
from qdq_optuna.placement.scheme import ChoiceSpace
from qdq_optuna.record.attrs import FLOW, WHOLE_MODEL
from qdq_optuna.search.objectives import (
    CATEGORICAL_SAMPLERS,
    check_error_options,
    check_sampler,
    parse_objectives,
)


@dataclass
class TuneOptions:
    #: a path, or an ``onnx.ModelProto`` (see :func:`qdq_optuna.model.data.model_argument`)
    model: str | onnx.ModelProto
    output_dir: str
    #: what measures latency: a ``--backend`` name, a Backend, or ``fn(onnx.ModelProto) -> ms``
    backend: str | Backend | Callable = "onnxruntime"
    runtime: str | None = None
    quant_type: str | None = None
    input_shapes: str | None = None
    config: Config = field(default_factory=Config)
    sampler: str = "qdq"
    storage: str | None = None
    seed: int | None = 0
    timing: str = "robust"
    scales: str = "auto"
    #: an .npz path, a dict of arrays, an iterable of feeds or a CalibrationDataReader
    #: (:func:`qdq_optuna.model.data.input_data`)
    calibration_data: Any = None
    calibration_method: str = DEFAULT_METHOD
    pattern_cache: str | None = None
    qdq_baseline: str | None = None
    fresh: bool = False
    timeout: float | None = None
    run_id: str | None = None
    worker: bool = False
    preprocess: str = "auto"
    threads: int = 1
    #: build and time in a worker subprocess, so a crash or hang fails one trial, not the run
    #: (names of ONNX Runtime / TensorRT backends; a callable or Backend object runs as given)
    isolate: bool = True
    progress: bool = True
    #: accuracy (see qdq_optuna.search.objectives): data the output errors are measured on (default:
    #: the calibration data), a user metric ``module:function`` (lower is better), the error
    #: measure, an error budget, and the objectives (``latency`` or ``latency,error``)
    validation_data: Any = None
    metric: str | None = None
    error_measure: str = "relative_l2"
    max_output_error: float | None = None
    objectives: str = "latency"
    #: seconds without a heartbeat after which a ``worker``'s RUNNING trial counts as dead and
    #: is retried (default: $QDQ_OPTUNA_HEARTBEAT_GRACE, else storage.GRACE_PERIOD_S)
    heartbeat_grace: float | None = None
    #: the float part's precision (``fp32``, ``fp16``, ``bf16``; None: the backend's default,
    #: see :func:`qdq_optuna.model.precision.resolve_high_precision`) and whether the graph's inputs
    #: and outputs keep their types
    high_precision: str | None = None
    keep_io_types: bool = True
    #: nodes (names or regular expressions) whose inputs never get Q/DQ, and the op types whose
    #: inputs may (``--exclude-nodes``, ``--op-types``; :mod:`qdq_optuna.placement.filters`)
    exclude_nodes: list[str] | None = None
    op_types: list[str] | None = None
    #: a run that finished already is measured again (its final A/B and report); without it
    #: a rerun returns the stored report unchanged
    remeasure: bool = False
    #: the model's opset may be upgraded (high precision, per-channel weights, FP8); when
    #: False a model below the opset its options need is refused
    opset_upgrade: bool = True

    def __post_init__(self) -> None:
        check_error_options(self.error_measure, self.max_output_error)
        parse_objectives(self.objectives)
        if self.scales not in ("auto", "default", "calibrated"):
            raise OptionError(f"--scales: unknown {self.scales!r} (choose auto, default, calibrated)")
        if self.timeout is not None and not self.timeout > 0:
            raise OptionError(f"--timeout must be positive seconds, got {self.timeout}")
        if self.threads < 1:
            raise OptionError(f"--threads must be >= 1, got {self.threads}")

    @property
    def run_id_or_default(self) -> str:
        return self.run_id or Path(self.output_dir).resolve().name or "run"


@dataclass
class TuneResult:
    output_dir: Path
    report: dict
    #: the run had finished before: ``report`` is its stored report, nothing was measured
    finished_before: bool = False

    @property
    def speedup(self) -> float:
        return self.report["speedup"]

    @property
    def optimized_model(self) -> Path:
        return self.output_dir / "optimized.onnx"


@dataclass
class SearchOutcome:
    """What a search concluded, for the outputs (:func:`qdq_optuna.outputs.write.write_outputs`):
    the model that ships (saved as ``out/optimized.onnx``), its A/B against the baseline, its
    accuracy, and the objects the report reads (the run record, the plan measurer)."""

    out: Path
    #: report.json's first fields: what was tuned, where, how
    header: dict
    record: Any  # qdq_optuna.record.attrs.RunRecord
    plans: Any  # the plan measurer: every measurement, counted per phase
    prepared: PreparedModel
    backend: Backend
    descent: Any  # the descent (None when the run stopped before it)
    lane: str
    rows: list[dict]
    plan: Any  # the shipped QuantPlan
    exporter: Any  # the exporter with the final scales
    final_bytes: bytes | None
    baseline_bytes: Any
    comparison: Any  # the final A/B (shipped model vs baseline)
    baseline_ms: float
    #: report.json's ``accuracy`` and ``final_output_error(s)`` (and the accuracy modes' keys)
    accuracy: dict
    partial: bool
    multi_objective: bool
    elapsed: dict[str, float]


def backend_for(options: TuneOptions) -> Backend:
    """The backend that measures this run (see :data:`~qdq_optuna.backends.BACKENDS`)."""
    b = options.backend
    if isinstance(b, Backend):
        return b
    if callable(b):
        return CallableBackend(b)
    spec = BACKENDS.get(b)
    given = {"threads": options.threads,
             "input_shapes": InputShapes.parse(options.input_shapes).shapes or None}
    kwargs = {k: given[k] for k in spec.takes} if spec is not None else {}
    if spec is not None and spec.runtime == "openvino":  # the float part: its precision hint
        kwargs["precision"] = options.high_precision or "fp32"
    if ":" not in b:
        kwargs["isolate"] = bool(options.isolate)
    return make_backend(b, **kwargs)


def backend_name(options: TuneOptions, backend: Backend) -> str:
    return options.backend if isinstance(options.backend, str) else backend.name


def check_runtime_named(options: TuneOptions, backend: Backend) -> None:
    """A backend whose runtime we cannot know (``--backend package.module:function``, a
    callable, a Backend of a name outside the table) must name it: ONNX Runtime's rules and
    preprocessing on a TensorRT-like callable would place Q/DQ for the wrong runtime."""
    if options.runtime is not None:
        return
    name = backend_name(options, backend)
    if name in BACKENDS:
        return
    what = (f"--backend {name}" if isinstance(options.backend, str)
            else f"backend {getattr(backend, 'describe', lambda: {})().get('callable') or name}")
    raise OptionError(f"{what}: name the runtime it measures with --runtime onnxruntime or "
                      "--runtime tensorrt (whose rules place the Q/DQ)")


@dataclass(frozen=True)
class Settings:
    """What a run's options resolve to once its backend and model are known."""

    backend: str
    runtime: str
    #: scales inside trials: ``calibrated`` or ``default``
    scales: str
    objectives: tuple[str, ...]
    constrained: bool
    #: output errors are measured (any accuracy option)
    accuracy: bool
    space: ChoiceSpace
    #: descent rounds at most (1 + ``Config.refine_rounds``; 1 with two objectives)
    rounds: int
    max_output_error: float | None = None
    #: the accuracy guard's bound on the output error (``--max-output-error``, else
    #: :data:`~qdq_optuna.measure.bisect.DEFAULT_MAX_OUTPUT_ERROR`)
    error_bound: float = DEFAULT_MAX_OUTPUT_ERROR
    #: where the descent starts (``Config.start``; ``float`` with two objectives)
    start: str = "best"
    #: two objectives (latency, error)
    multi_objective: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "multi_objective", len(self.objectives) > 1)

    @staticmethod
    def runtime_of(options: TuneOptions, backend: Backend) -> str:
        return options.runtime or runtime_for_backend(backend_name(options, backend))

    @classmethod
    def resolve(cls, options: TuneOptions, backend: Backend, prepared: PreparedModel) -> Settings:
        runtime = cls.runtime_of(options, backend)
        scales = options.scales
        if scales == "auto":
            scales = "calibrated" if runtime in ("onnxruntime", "openvino") else "default"
        objectives = parse_objectives(options.objectives)
        multi = len(objectives) > 1
        constrained = options.max_output_error is not None
        accuracy = (multi or constrained or options.validation_data is not None
                    or options.metric is not None)
        if accuracy:  # errors with placeholder scales say nothing about the real model
            if options.scales == "default":
                raise OptionError("--scales default cannot be combined with accuracy options "
                                  "(--max-output-error, --objectives latency,error, "
                                  "--validation-data, --metric): errors need calibrated scales")
            scales = "calibrated"
        space = ChoiceSpace(prepared.mixed_types or (prepared.quant_type,),
                            categorical=options.sampler in CATEGORICAL_SAMPLERS)
        check_sampler(options.sampler, multi_objective=multi, mixed=space.mixed,
                      constrained=constrained)
        # two objectives: one pass from float (the report's Pareto chain is built from one
        # decision per pattern, added to the float model)
        rounds = 1 if multi else 1 + options.config.refine_rounds
        bound = (float(options.max_output_error) if options.max_output_error is not None
                 else DEFAULT_MAX_OUTPUT_ERROR)
        return cls(backend_name(options, backend), runtime, scales, objectives, constrained,
                   accuracy, space, rounds, options.max_output_error, bound,
                   "float" if multi else options.config.start)


def fingerprint(options: TuneOptions, settings: Settings, prepared: PreparedModel,
                backend: Backend, validation_id: str | None = None) -> dict:
    """The settings that change a run's result: a resumed run must have the same."""
    o = options
    fp = {
        FLOW: WHOLE_MODEL,
        "model_sha256": prepared.source_sha256,
        "backend": backend.describe(),
        "runtime": settings.runtime,
        "quant_type": prepared.quant_type,
        "input_shapes": str(InputShapes.parse(o.input_shapes)),
        "config": o.config.search_relevant(),
        "sampler": o.sampler,
        "seed": o.seed,
        "timing": o.timing,
        "scales": settings.scales,
        "calibration_method": o.calibration_method,
        "preprocess": prepared.preprocess,
    }
    # the accuracy / mixed-precision modes are absent when off, so runs made before these
    # options existed still resume
    if settings.space.mixed:
        fp["mixed_types"] = list(settings.space.types)
    if prepared.high_precision is not None:
        fp["high_precision"] = prepared.high_precision.describe()
    if prepared.node_filter:
        fp["node_filter"] = prepared.node_filter.to_dict()
    if settings.accuracy:
        fp["accuracy"] = {
            "objectives": list(settings.objectives),
            "max_output_error": o.max_output_error,
            "error_measure": o.error_measure,
            "metric": o.metric,
            "validation_data": validation_id,
        }
    return fp


def digest(fp: dict) -> str:
    return hashlib.sha256(json.dumps(fp, sort_keys=True, default=str).encode()).hexdigest()[:16]
