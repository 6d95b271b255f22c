"""What a run's options resolve to once its backend and model are known (:class:`Settings`), the
backend they make, and the fingerprint a resumed run must match."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field

from qdq_optuna.backends import BACKENDS, make_backend
from qdq_optuna.backends.base import Backend
from qdq_optuna.backends.callable import CallableBackend
from qdq_optuna.errors import OptionError
from qdq_optuna.measure.bias import DEFAULT_MODE as BIAS_MODE
from qdq_optuna.measure.bound import AskedBound
from qdq_optuna.model.graph import InputShapes
from qdq_optuna.placement.export import Scales
from qdq_optuna.placement.points import DYNAMIC, WEIGHT_ONLY
from qdq_optuna.placement.scheme import ChoiceSpace
from qdq_optuna.placement.weight_only import ACCURACY_LEVEL
from qdq_optuna.placement.weight_only import BLOCK_SIZE as WEIGHT_ONLY_BLOCK
from qdq_optuna.record import FLOW, WHOLE_MODEL
from qdq_optuna.runtimes import Runtime, profile_for, profile_for_backend
from qdq_optuna.runtimes.prepared import PreparedModel
from qdq_optuna.search._options import TuneOptions
from qdq_optuna.search.objectives import check_sampler, parse_objectives
from qdq_optuna.search.samplers import sampler_name, takes_categorical


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
    if spec is not None:  # the runtime's own options (OpenVINO: its precision hint)
        kwargs.update(profile_for(spec.runtime).backend_options(
            options.model, options.high_precision, options.threads, given["input_shapes"]))
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
    #: scales inside trials: calibrated or placeholders (never ``AUTO``: resolved)
    scales: Scales
    objectives: tuple[str, ...]
    #: output errors are measured (any accuracy option; the bound itself is the guard's
    #: :class:`~qdq_optuna.measure.bound.AccuracyBound`)
    accuracy: bool
    space: ChoiceSpace
    #: descent rounds at most (1 + ``Config.refine_rounds``; 1 with two objectives)
    rounds: int
    #: where the descent starts (``Config.start``; ``float`` with two objectives)
    start: str = "best"
    #: two objectives (latency, error)
    multi_objective: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "multi_objective", len(self.objectives) > 1)

    @staticmethod
    def profile_of(options: TuneOptions, backend: Backend) -> Runtime:
        """The run's runtime profile, chosen once: ``--runtime``, else the backend's."""
        if options.runtime is not None:
            return profile_for(options.runtime)
        return profile_for_backend(backend_name(options, backend))

    @classmethod
    def resolve(cls, options: TuneOptions, backend: Backend, prepared: PreparedModel) -> Settings:
        profile = cls.profile_of(options, backend)
        runtime = profile.name
        asked = Scales.parse(options.scales)
        scales = Scales.parse(profile.default_scales) if asked is Scales.AUTO else asked
        objectives = parse_objectives(options.objectives)
        multi = len(objectives) > 1
        constrained = options.max_output_error is not None  # trials carry the bound
        accuracy = (multi or constrained or options.validation_data is not None
                    or options.metric is not None)
        if accuracy:  # errors with placeholder scales say nothing about the real model
            if asked is Scales.DEFAULT:
                raise OptionError("--scales default cannot be combined with accuracy options "
                                  "(--max-output-error, --objectives latency,error, "
                                  "--validation-data, --metric): errors need calibrated scales")
            scales = Scales.CALIBRATED
        space = ChoiceSpace(prepared.mixed_types or (prepared.quant_type,),
                            categorical=takes_categorical(options.sampler))
        check_sampler(options.sampler, multi_objective=multi, mixed=space.mixed,
                      constrained=constrained)
        # two objectives: one pass from float (the report's Pareto chain is built from one
        # decision per pattern, added to the float model)
        rounds = 1 if multi else 1 + options.config.refine_rounds
        return cls(backend_name(options, backend), runtime, scales, objectives, accuracy,
                   space, rounds, "float" if multi else options.config.start)


def fingerprint(options: TuneOptions, settings: Settings, prepared: PreparedModel,
                backend: Backend, bound: AskedBound, validation_id: str | None = None) -> dict:
    """The settings that change a run's result (the accuracy bound's as asked): a resumed run
    must have the same."""
    o = options
    fp = {
        FLOW: WHOLE_MODEL,
        "model_sha256": prepared.source_sha256,
        "backend": backend.describe(),
        "runtime": settings.runtime,
        "quant_type": prepared.quant_type,
        "input_shapes": str(InputShapes.parse(o.input_shapes)),
        "config": o.config.search_relevant(),
        "sampler": sampler_name(o.sampler),
        "seed": o.seed,
        "timing": o.timing.value,
        "scales": settings.scales.value,
        "calibration_method": o.calibration_method,
        # scales are made from the cached statistics each time: a run stored before activation
        # ranges were cut at their readers' saturation measured other scales, and must not
        # resume with these
        "activation_ranges": "cut at readers",
        "preprocess": prepared.preprocess.value,
    }
    # the accuracy / mixed-precision modes are absent when off, so runs made before these
    # options existed still resume
    if settings.space.mixed:
        fp["mixed_types"] = list(settings.space.types)
    if o.bias_correction:
        fp["bias_correction"] = BIAS_MODE
    if bound.confidence is not None:  # absent when off: older runs still resume
        fp["accuracy_confidence"] = bound.confidence
    if prepared.high_precision is not None:
        fp["high_precision"] = prepared.high_precision.describe()
    if prepared.node_filter:
        fp["node_filter"] = prepared.node_filter.to_dict()
    if any(point.kind == DYNAMIC for pp in prepared.tunable for point in pp.points):
        # absent without a dynamic point (static only, or a model with no MatMul/Gemm of
        # constant weights): earlier runs still resume
        fp["dynamic_ops"] = sorted(prepared.rules.dynamic_ops)
    if any(point.kind == WEIGHT_ONLY for pp in prepared.tunable for point in pp.points):
        # likewise absent without a weight-only point; the kernel's settings with the modes
        fp["weight_only"] = {"modes": [m.value for m in prepared.rules.weight_only_modes],
                             "block_size": WEIGHT_ONLY_BLOCK, "accuracy_level": ACCURACY_LEVEL}
    if settings.accuracy:
        # max_metric_drop is absent when unset: older runs still resume
        fp["accuracy"] = {"objectives": list(settings.objectives), **bound.fingerprint_keys(),
                          "validation_data": validation_id}
    return fp


def metric_label(metric: str | Callable | None) -> str | None:
    """``--metric``'s text, or a callable's ``module:name`` (its repr holds an address, which
    would change the fingerprint of every process and the report's wording)."""
    if metric is None or isinstance(metric, str):
        return metric
    return (f"{getattr(metric, '__module__', None) or '?'}:"
            f"{getattr(metric, '__qualname__', type(metric).__name__)}")


def digest(fp: dict) -> str:
    return hashlib.sha256(json.dumps(fp, sort_keys=True, default=str).encode()).hexdigest()[:16]
