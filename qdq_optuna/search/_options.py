"""A run's options: each defined once, as a field of :class:`TuneOptions` and its command-line
flag (:func:`option`)."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Any

import onnx

from qdq_optuna.backends import BACKEND_HELP, DEFAULT_BACKEND
from qdq_optuna.backends.base import Backend
from qdq_optuna.config import Config
from qdq_optuna.errors import OptionError
from qdq_optuna.measure.accuracy import ERROR_MEASURES, DropType
from qdq_optuna.measure.bound import DEFAULT_MAX_OUTPUT_ERROR
from qdq_optuna.measure.kernels import KERNEL_CACHE_HELP
from qdq_optuna.measure.timing import Timing
from qdq_optuna.model.calibration import DEFAULT_METHOD, METHODS, QUANT_TYPES
from qdq_optuna.placement.export import Scales
from qdq_optuna.placement.rules import Preprocess
from qdq_optuna.runtimes import RUNTIME_NAMES
from qdq_optuna.search.objectives import check_error_options, check_metric_drop, parse_objectives
from qdq_optuna.search.samplers import SAMPLERS, SamplerArg


def option(default: Any = MISSING, *, help: str, group: str | None, flag: str | None = None,
           short: str | None = None, choices: Sequence[str] | None = None,
           type: str | None = None, metavar: str | None = None, nargs: str | None = None,
           default_factory: Any = MISSING) -> Any:
    """One tune option, defined once: the field of :class:`TuneOptions` and its command-line
    flag (``group`` None: no flag), built by :func:`qdq_optuna.cli.commands.add_options`. ``type``
    names one of the CLI's checked number types (``positive_int``, ``positive_float``, ``int``).
    """
    meta = {"help": help, "group": group, "flag": flag, "short": short, "choices": choices,
            "type": type, "metavar": metavar, "nargs": nargs}
    return field(default=default, default_factory=default_factory, metadata=meta)


#: the command line's option groups, in the order ``tune -h`` shows them
OPTION_GROUPS = {
    "model": None,
    "search": None,
    "measurement": None,
    "accuracy": ("any of these turns accuracy on: trials use calibrated scales and record "
                 "their output errors"),
    "storage and workers": None,
    "output": None,
}


@dataclass
class TuneOptions:
    """Everything a tuning run takes besides :class:`~qdq_optuna.config.Config`; each field is
    also the ``qdq-optuna tune`` flag its metadata describes."""

    #: a path, or an ``onnx.ModelProto`` (see :func:`qdq_optuna.model.data.model_argument`)
    model: str | onnx.ModelProto = option(
        group="model", short="-m", help="float ONNX model (never modified)")
    output_dir: str = option(
        group="output", short="-o", flag="--output", metavar="DIR",
        help="output folder, also holds the studies (default ./qdq_optuna_output)")
    #: what measures latency: a ``--backend`` name, a Backend, or ``fn(onnx.ModelProto) -> ms``
    backend: str | Backend | Callable = option(
        DEFAULT_BACKEND, group="measurement", short="-b", help=BACKEND_HELP)
    runtime: str | None = option(
        None, group="model", choices=RUNTIME_NAMES,
        help="whose fusion rules place the Q/DQ (default: follows --backend; a --backend "
             "package.module:function must name it)")
    quant_type: str | None = option(
        None, group="model", choices=(*QUANT_TYPES, "mixed"),
        help="activation type (default: uint8 on ONNX Runtime CPU and OpenVINO, int8 on "
             "TensorRT); mixed: each point chooses none/int8/fp8 (TensorRT) or none/uint8/int8")
    input_shapes: str | None = option(
        None, group="model", metavar="NAME:DxD,...",
        help="fix symbolic input dims, e.g. input:1x3x224x224")
    config: Config = option(default_factory=Config, group=None,
                            help="search settings (the CLI: --config FILE.yaml and the flags "
                                 "of the search group)")
    #: a ``--sampler`` name, an ``optuna.samplers.BaseSampler`` (each pattern's study gets a
    #: copy) or ``fn(seed) -> sampler``
    sampler: SamplerArg = option(
        "qdq", group="search", short="-s", metavar="NAME", choices=SAMPLERS,
        help="qdq: ours, a visit (one pattern's study in one descent round) ends when its "
             "moves are done (default); tpe, cmaes, random, gp (needs torch), nsga2, "
             "bruteforce: Optuna's, which spend the rest of each visit's budget after the "
             "moves")
    storage: str | None = option(
        None, group="storage and workers", metavar="URL",
        help="Optuna RDB URL (default sqlite:///OUTPUT/studies.db; PostgreSQL for several "
             "workers)")
    seed: int | None = option(
        0, group="search", type="int",
        help="sampler seed: the same seed and settings propose the same schemes (default 0)")
    timing: Timing | str = option(
        Timing.ROBUST.value, group="measurement", choices=tuple(m.value for m in Timing),
        help="robust: every candidate A/B-compared with its pattern's reference in interleaved "
             "fresh sessions (default); fast: one short timing per candidate and no A/B, for a "
             "quiet, dedicated machine")
    scales: Scales | str = option(
        Scales.AUTO.value, group="measurement", choices=tuple(m.value for m in Scales),
        help="scales used in trials (auto: calibrated for ONNX Runtime and OpenVINO, default "
             "for TensorRT); default: one placeholder scale for every tensor, which times the "
             "same where the scale does not change the kernels (TensorRT)")
    #: an .npz path, a dict of arrays, an iterable of feeds or a CalibrationDataReader
    #: (:func:`qdq_optuna.model.data.input_data`)
    calibration_data: Any = option(
        None, group="measurement", metavar="FILE.npz",
        help=".npz of input name -> array (samples on axis 0); random inputs otherwise")
    calibration_method: str = option(
        DEFAULT_METHOD, group="measurement", choices=METHODS,
        help=f"how activation statistics become scales (default {DEFAULT_METHOD}: the lowest "
             "output error in benchmarks/calibration_methods.py)")
    pattern_cache: str | None = option(
        None, group="search", metavar="FILE.yaml",
        help="pattern cache of an earlier run: its schemes seed the studies")
    qdq_baseline: str | None = option(
        None, group="search", metavar="MODEL.onnx",
        help="a Q/DQ model whose placement seeds the search")
    fresh: bool = option(False, group="output",
                         help="discard this run's studies and start over")
    timeout: float | None = option(
        None, group="search", type="positive_float", metavar="S",
        help="seconds for the whole run; what is committed by then is saved")
    run_id: str | None = option(
        None, group="storage and workers",
        help="name of the run in the storage (default: output folder name)")
    worker: bool = option(False, group="storage and workers",
                          help="cooperate with other workers on the same --storage run")
    measuring_group: str | None = option(
        None, group="storage and workers", metavar="NAME",
        help="measure as a group of its own within --run-id (its own studies and standing "
             "model in the storage, named RUN@NAME): for workers on a machine unlike the "
             "run's, whose timings must never be compared with the run's")
    preprocess: Preprocess | str = option(
        Preprocess.AUTO.value, group="model", choices=tuple(m.value for m in Preprocess),
        help="float-model preprocessing; auto = ONNX Runtime basic fusions for the ONNX "
             "Runtime rules, none for TensorRT")
    threads: int = option(
        1, group="measurement", type="positive_int", metavar="N",
        help="inference threads of the measuring runtime (default 1: ranks most reliably)")
    kernel_cache: str | None = option(
        None, group="measurement", metavar="PATH|off", help=KERNEL_CACHE_HELP)
    isolate: bool = option(
        True, group="measurement",
        help="build and time in a worker subprocess, so a crash or hang fails only that trial "
             "(default; --no-isolate runs the backend in this process; a callable or Backend "
             "object runs as given)")
    progress: bool = option(True, group=None, help="progress bars (the CLI: -q turns them off)")
    #: accuracy (see qdq_optuna.search.objectives): data the output errors are measured on
    validation_data: Any = option(
        None, group="accuracy", metavar="FILE.npz",
        help="inputs the output errors are measured on (default: the calibration data; random "
             "inputs with a warning otherwise)")
    #: ``module:function``, or in Python the callable itself
    metric: str | Callable | None = option(
        None, group="accuracy", metavar="MODULE:FUNCTION",
        help="user metric fn(reference_outputs, candidate_outputs) -> float, lower is better "
             "(replaces --error-measure)")
    error_measure: str = option(
        "relative_l2", group="accuracy", choices=ERROR_MEASURES,
        help="error of a trial's model vs FP32, worst output (default relative_l2)")
    max_output_error: float | None = option(
        None, group="accuracy", type="positive_float", metavar="X",
        help="error budget: trials above it are infeasible; commits take the fastest feasible "
             f"scheme (default {DEFAULT_MAX_OUTPUT_ERROR:g}, tightened to the fastest runtime "
             "recipe's own error where lower, on the starts, commits and the saved model "
             "only; given, it is never tightened and bounds every trial too)")
    max_metric_drop: float | None = option(
        None, group="accuracy", type="positive_float", metavar="X",
        help="with --metric: how much the metric may worsen from the FP32 model's own value "
             "(metric(reference, reference)); no start, commit or shipped model goes past it "
             "(replaces --max-output-error's bound; NNCF's max_drop)")
    metric_drop_type: DropType | str = option(
        DropType.ABSOLUTE.value, group="accuracy", choices=tuple(m.value for m in DropType),
        help="--max-metric-drop in the metric's units (absolute, default) or as a share of "
             "the FP32 model's value (relative: 0.01 = one percent)")
    accuracy_confidence: float | None = option(
        None, group="accuracy", type="positive_float", metavar="P",
        help="hold the accuracy bound on the upper P-confidence bound of the mean per-sample "
             "error on the guard's data (one-sided Student t, e.g. 0.9), not on the error "
             "over all its samples (default): a claim that holds on more data like it")
    objectives: str = option(
        "latency", group="accuracy", metavar="latency[,error]",
        help="latency (default) or latency,error (two-objective studies, Pareto front of the "
             "whole model in OUTPUT/pareto/)")
    heartbeat_grace: float | None = option(
        None, group="storage and workers", type="positive_float", metavar="S",
        help="seconds without a heartbeat before a worker's trial is failed and retried "
             "(default 180, or $QDQ_OPTUNA_HEARTBEAT_GRACE; workers only)")
    high_precision: str | None = option(
        None, group="model", choices=("fp32", "fp16", "bf16"),
        help="precision of the float part, converted before the search (tune's default: the "
             "backend's, fp16 for TensorRT-like backends and ort-cuda, fp32 for ONNX Runtime "
             "CPU and OpenVINO; inspect's: fp32, the model as given)")
    keep_io_types: bool = option(
        True, group="model",
        help="with fp16/bf16, graph inputs and outputs keep their FP32 type (default; "
             "--no-keep-io-types converts them too)")
    exclude_nodes: list[str] | None = option(
        None, group="model", nargs="+", metavar="NAME",
        help="nodes whose inputs never carry Q/DQ: names or regular expressions matching a "
             "whole name (as 'inspect' prints them; unnamed nodes are #INDEX), like "
             "quantize_static's nodes_to_exclude")
    op_types: list[str] | None = option(
        None, group="model", nargs="+", metavar="OP",
        help="quantize only the inputs of these op types (space- or comma-separated, e.g. "
             "Conv,MatMul), like quantize_static's op_types_to_quantize")
    modes: str | None = option(
        None, group="search", metavar="MODE[,MODE]",
        help="quantization modes the search chooses per node: static (Q/DQ placement), "
             "dynamic (a MatMul/Gemm of constant weights with activations quantized per call "
             "and int8 weights, as quantize_dynamic writes it), weight_int8 and weight_int4 "
             "(such a node as ONNX Runtime's MatMulNBits: int8 or int4 weight blocks, float "
             "activations; where the installed onnxruntime has the kernel); default: "
             "onnxruntime static,dynamic (the weight-only modes on request: slower than float "
             "at a transformer's token counts where measured), openvino and tensorrt static. "
             "Static is always searched; 'static' alone searches Q/DQ placement only")
    remeasure: bool = option(
        False, group="output",
        help="a finished run: measure the final model again and rewrite the report (otherwise "
             "a rerun prints the stored result and exits)")
    opset_upgrade: bool = option(
        True, group="model",
        help="upgrade the model's opset when the precision or the quant type needs it "
             "(default; --no-opset-upgrade refuses such a model instead)")
    bias_correction: bool = option(
        False, group="model",
        help="fold each quantized Conv/Gemm/MatMul's mean output shift from float (per "
             "channel, measured on the calibration data) into its bias, in every model the "
             "accuracy guard scores and in optimized.onnx; the kernels, and so the speed, "
             "stay the same")

    def __post_init__(self) -> None:
        check_error_options(self.error_measure, self.max_output_error)
        parse_objectives(self.objectives)
        self.scales = Scales.parse(self.scales)
        self.timing = Timing.parse(self.timing)
        self.preprocess = Preprocess.parse(self.preprocess)
        self.metric_drop_type = DropType.parse(self.metric_drop_type)
        if self.timeout is not None and not self.timeout > 0:
            raise OptionError(f"--timeout must be positive seconds, got {self.timeout}")
        if self.threads < 1:
            raise OptionError(f"--threads must be >= 1, got {self.threads}")
        check_metric_drop(self.max_metric_drop, self.metric, self.max_output_error)
        if self.measuring_group is not None and not re.fullmatch(r"[\w.-]+",
                                                                  self.measuring_group):
            raise OptionError("--measuring-group takes a name of letters, digits, '.', '_' "
                              f"and '-', got {self.measuring_group!r}")
        if self.accuracy_confidence is not None and not 0.5 <= self.accuracy_confidence < 1:
            raise OptionError("--accuracy-confidence must be at least 0.5 and below 1, got "
                              f"{self.accuracy_confidence:g}")

    @property
    def run_id_or_default(self) -> str:
        """The run's name in the storage; a measuring group's studies are a run of their
        own beside it (``RUN@GROUP``), so no timing of one is compared with the other's."""
        run = self.run_id or Path(self.output_dir).resolve().name or "run"
        return f"{run}@{self.measuring_group}" if self.measuring_group else run
