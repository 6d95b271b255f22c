"""How far a Q/DQ candidate's outputs drift from the FP32 model's.

The search trades latency against this error, so it must be cheap per candidate (the FP32
reference is computed once) and never NaN: a candidate that produces non-finite outputs gets the
worst possible error instead, which an optimizer can still rank. :class:`ErrorScorer` is what the
search calls: errors of candidate models on the validation data.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import logging
import math
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from enum import Enum
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from qdq_optuna.errors import ModelError, OptionChoice, OptionError, UserError
from qdq_optuna.model.calibration import iter_batches, make_session, one_line

log = logging.getLogger("qdq_optuna")


class ErrorMeasure(str, Enum):
    """The scalar output error of a model vs FP32, worst output (``--error-measure``; see
    :func:`error_value`)."""

    RELATIVE_L2 = "relative_l2"
    ONE_MINUS_COSINE = "1-cosine"
    MAX_ABS = "max_abs"


#: Scalar error measures for the objective / constraint, as ``--error-measure`` spells them.
ERROR_MEASURES = tuple(m.value for m in ErrorMeasure)

Metric = Callable[[dict, dict], float]

_EPS = 1e-12


class AccuracyError(RuntimeError):
    """A candidate model could not be run (the trial fails; the user's input is fine)."""


def run_model(
    model: bytes | onnx.ModelProto | str | os.PathLike,
    data: Mapping[str, np.ndarray],
    *,
    batch_size: int = 1,
    threads: int = 1,
    optimize: bool = True,
    config: Sequence[tuple[str, str]] = (),
) -> dict[str, np.ndarray]:
    """All outputs of ``model`` over ``data``, batches concatenated on axis 0.

    By default runs with all ORT optimizations so a Q/DQ model executes with the fused integer
    kernels an ONNX Runtime deployment would use; ``optimize=False`` runs the model's ONNX
    semantics node by node (the better proxy for other runtimes, and the only correct one for
    FP8 Q/DQ: ONNX Runtime's Relu->QuantizeLinear fusion drops a Relu in front of a float8 Q).
    A path keeps external weights next to the model loadable; ``config``: session config
    entries the session is created with (the settings a model ships with).
    """
    if isinstance(model, onnx.ModelProto):
        try:
            model = model.SerializeToString()
        except ValueError as exc:
            raise ModelError(
                f"model too large to serialize in memory; pass its path ({one_line(exc)})"
            ) from exc
    session = make_session(model, optimize=optimize, threads=threads, config=config)
    names = [o.name for o in session.get_outputs()]
    parts: dict[str, list[np.ndarray]] = {name: [] for name in names}
    for feed in iter_batches(session, data, batch_size):
        for name, value in zip(names, session.run(names, feed)):
            parts[name].append(np.asarray(value))
    return {name: _join(chunks) for name, chunks in parts.items()}


def _join(chunks: list[np.ndarray]) -> np.ndarray:
    if len(chunks) == 1:
        return chunks[0]
    if all(c.ndim >= 1 for c in chunks):
        return np.concatenate(chunks, axis=0)
    return np.stack(chunks)


def output_errors(
    reference: Mapping[str, np.ndarray], candidate: Mapping[str, np.ndarray]
) -> dict[str, dict[str, float]]:
    """Per output: mean per-sample ``cosine``, ``relative_l2`` and ``max_abs`` of the difference.

    Non-finite candidate values (where the reference is finite) give the worst values
    (cosine -1, inf) rather than NaN.
    """
    errors: dict[str, dict[str, float]] = {}
    for name, ref in reference.items():
        if name not in candidate:
            raise KeyError(f"candidate outputs lack {name!r}")
        errors[name] = _compare(np.asarray(ref), np.asarray(candidate[name]), name)
    return errors


def _compare(ref: np.ndarray, cand: np.ndarray, name: str) -> dict[str, float]:
    worst = {"cosine": -1.0, "relative_l2": math.inf, "max_abs": math.inf}
    if ref.shape != cand.shape:
        raise ValueError(f"output {name!r}: shape {cand.shape} differs from {ref.shape}")
    r = ref.astype(np.float64)
    c = cand.astype(np.float64)
    # positions where the reference itself is non-finite only count if the candidate differs
    ref_bad = ~np.isfinite(r)
    if ref_bad.any():
        same = (r == c) | (np.isnan(r) & np.isnan(c))
        if (ref_bad & ~same).any():
            return worst
        r = np.where(ref_bad, 0.0, r)
        c = np.where(ref_bad, 0.0, c)
    if not np.isfinite(c).all():
        return worst
    if r.size == 0:
        return {"cosine": 1.0, "relative_l2": 0.0, "max_abs": 0.0}
    diff = c - r
    # one vector per sample; a 0-d or 1-d output (one value per sample) is a single vector
    rows_r = r.reshape(r.shape[0], -1) if r.ndim >= 2 else r.reshape(1, -1)
    rows_c = c.reshape(rows_r.shape)
    return {
        "cosine": float(np.mean(_cosine_rows(rows_r, rows_c))),
        "relative_l2": float(np.linalg.norm(diff) / max(float(np.linalg.norm(r)), _EPS)),
        "max_abs": float(np.max(np.abs(diff))),
    }


def _cosine_rows(r: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Cosine per sample; two zero vectors agree (1), one zero vector does not (0)."""
    nr = np.linalg.norm(r, axis=1)
    nc = np.linalg.norm(c, axis=1)
    dot = np.einsum("ij,ij->i", r, c)
    both_zero = (nr == 0) & (nc == 0)
    with np.errstate(invalid="ignore", divide="ignore"):
        cos = np.where((nr > 0) & (nc > 0), dot / (nr * nc), 0.0)
    cos = np.where(both_zero, 1.0, cos)
    return np.clip(cos, -1.0, 1.0)


def summarize(errors: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """Worst value of each measure across outputs (the model is as good as its worst output)."""
    if not errors:
        raise ValueError("no outputs to summarize")
    return {
        "worst_cosine": min(e["cosine"] for e in errors.values()),
        "worst_relative_l2": max(e["relative_l2"] for e in errors.values()),
        "worst_max_abs": max(e["max_abs"] for e in errors.values()),
    }


#: each error measure from :func:`summarize`'s figures
_ERROR_OF = {"relative_l2": lambda s: s["worst_relative_l2"],
             "1-cosine": lambda s: 1.0 - s["worst_cosine"],
             "max_abs": lambda s: s["worst_max_abs"]}


def error_value(errors: Mapping[str, Mapping[str, float]], name: str = "relative_l2") -> float:
    """The scalar "error" objective / constraint (lower is better)."""
    of_summary = _ERROR_OF.get(name)
    if of_summary is not None:
        return of_summary(summarize(errors))
    raise OptionError(
        f"--error-measure: unknown error measure {name!r} (choose {', '.join(ERROR_MEASURES)})"
    )


#: the confidence of the upper bound the report states when ``--accuracy-confidence`` is not
#: given (the guard then holds the bound on the error over all its samples, as measured)
REPORT_CONFIDENCE = 0.9
#: how many samples :func:`samples_needed` looks up to
MOST_SAMPLES = 100_000


def error_spread(errors: np.ndarray, confidence: float) -> dict:
    """How the per-sample errors spread: ``samples``, ``min``, ``median``, ``worst``,
    ``mean``, ``sd`` and ``upper``, the one-sided Student-t upper bound of the mean at
    ``confidence`` (scipy.stats): what the mean error of more samples like these stays under
    with that confidence (infinite from one sample or a non-finite error)."""
    from scipy import stats

    e = np.asarray(errors, dtype=np.float64)
    n = int(e.size)
    finite = bool(np.isfinite(e).all())
    mean = float(e.mean()) if finite else math.inf
    sd = float(e.std(ddof=1)) if n > 1 and finite else math.inf
    upper = (mean + float(stats.t.ppf(confidence, n - 1)) * sd / math.sqrt(n)
             if n > 1 and finite else math.inf)
    return {"samples": n, "min": float(e.min()), "median": float(np.median(e)),
            "worst": float(e.max()), "mean": mean, "sd": sd, "confidence": confidence,
            "upper": upper}


def samples_needed(spread: dict, bound: float) -> int | None:
    """How many samples with this mean and spread would put the upper bound of the mean
    within ``bound`` (None: the mean itself is past it, or not within
    :data:`MOST_SAMPLES`)."""
    from scipy import stats

    mean, sd, p = spread["mean"], spread["sd"], spread["confidence"]
    if not (math.isfinite(mean) and mean < bound):
        return None
    if not math.isfinite(sd):  # one sample: its error as the spread's scale is a guess
        sd = abs(mean) or bound
    if sd == 0:
        return 2
    n = np.arange(2, MOST_SAMPLES + 1)
    fits = mean + stats.t.ppf(p, n - 1) * sd / np.sqrt(n) <= bound
    return int(n[np.argmax(fits)]) if fits.any() else None


def load_metric(spec: str) -> Metric:
    """Import ``module:function`` (or ``path/to/file.py:function``) as a user metric.

    The function gets ``(reference_outputs, candidate_outputs)`` dicts and returns a float,
    lower is better. Modules resolve from the working directory and ``PYTHONPATH``.
    """
    module_name, sep, func_name = str(spec).rpartition(":")
    if not sep or not module_name or not func_name:
        raise OptionError(f"--metric {spec!r}: expected module:function")
    try:
        module = _import_metric_module(module_name)
    except Exception as exc:  # the user's module may raise anything while importing
        raise OptionError(
            f"--metric {spec!r}: cannot import {module_name!r} "
            f"({type(exc).__name__}: {one_line(exc)})"
        ) from exc
    func = getattr(module, func_name, None)
    if func is None:
        raise OptionError(f"--metric {spec!r}: {module_name!r} has no attribute {func_name!r}")
    if not callable(func):
        raise OptionError(f"--metric {spec!r}: {func_name!r} is not callable")
    return func


def _import_metric_module(module_name: str) -> Any:
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_file():
            raise FileNotFoundError(f"no file {path}")
        mod_spec = importlib.util.spec_from_file_location(f"_qdq_metric_{path.stem}", path)
        if mod_spec is None or mod_spec.loader is None:
            raise ImportError(f"cannot load {path}")
        module = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(module)
        return module
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(module_name)
    finally:
        if added:
            sys.path.remove(cwd)


class AccuracyEvaluator:
    """Scores candidates against FP32 reference outputs computed once up front.

    ``metric`` is a callable or a ``module:function`` spec (see :func:`load_metric`); without
    one the error is :func:`error_value` of ``error_measure``.
    """

    def __init__(
        self,
        reference_model: bytes | onnx.ModelProto | str | os.PathLike,
        data: Mapping[str, np.ndarray],
        *,
        metric: str | Metric | None = None,
        batch_size: int = 1,
        error_measure: str = "relative_l2",
        threads: int = 1,
        optimize: bool = True,
        runner: Callable[[Any, Mapping[str, np.ndarray]], dict[str, np.ndarray]] | None = None,
        confidence: float | None = None,
    ) -> None:
        if error_measure not in ERROR_MEASURES:
            raise OptionError(
                f"--error-measure: unknown error measure {error_measure!r} "
                f"(choose {', '.join(ERROR_MEASURES)})"
            )
        self.metric_name = metric if isinstance(metric, str) else getattr(metric, "__name__", None)
        self.metric: Metric | None = load_metric(metric) if isinstance(metric, str) else metric
        self.data = dict(data)
        self.batch_size = batch_size
        self.error_measure = error_measure
        self.threads = threads
        self.optimize = optimize
        #: runs the candidates instead of ONNX Runtime (``runner(model, data)`` -> outputs:
        #: OpenVINO on OpenVINO runs); the FP32 reference always comes from ONNX Runtime
        self.runner = runner
        #: ``--accuracy-confidence``: the error is the upper bound of the mean per-sample
        #: error at this confidence (:func:`error_spread`); None: the error over all samples
        self.confidence = confidence
        #: session config entries the candidates run with (ONNX Runtime scoring only)
        self.session_config: tuple[tuple[str, str], ...] = ()
        try:
            self.reference = run_model(
                reference_model, self.data, batch_size=batch_size, threads=threads,
                optimize=optimize,
            )
        except UserError:
            raise
        except Exception as exc:  # ORT raises its own exception types
            raise ModelError(f"the FP32 model fails in ONNX Runtime: {one_line(exc)}") from exc

    def evaluate(self, candidate_model: bytes | onnx.ModelProto | str) -> tuple[float, dict]:
        """``(error, details)``; details hold per-output errors and their worst values."""
        try:
            if self.runner is not None:
                outputs = self.runner(candidate_model, self.data)
            else:
                outputs = run_model(
                    candidate_model, self.data, batch_size=self.batch_size,
                    threads=self.threads, optimize=self.optimize, config=self.session_config,
                )
        except UserError:
            raise
        except Exception as exc:  # ORT (or the runner) raises its own exception types
            where = "the runtime" if self.runner is not None else "ONNX Runtime"
            raise AccuracyError(f"candidate model failed in {where}: {one_line(exc)}") from exc
        return self.score(outputs)

    def score(self, outputs: Mapping[str, np.ndarray]) -> tuple[float, dict]:
        """:meth:`evaluate` of outputs already computed on :attr:`data`."""
        missing = [name for name in self.reference if name not in outputs]
        if missing:
            raise AccuracyError(f"candidate model lacks outputs {missing}")
        outputs = dict(outputs)
        errors = output_errors(self.reference, outputs)
        details: dict[str, Any] = {"outputs": errors, **summarize(errors)}
        if self.metric is None:
            error = error_value(errors, self.error_measure)
        else:
            error = self._user_metric(outputs)
            details["metric"] = error
        per_sample = self.sample_errors(outputs)
        if per_sample is not None:
            details["spread"] = error_spread(per_sample, self.confidence or REPORT_CONFIDENCE)
            if self.confidence is not None:  # the bound holds on the upper bound
                details["all_samples_error"] = error
                error = details["spread"]["upper"]
        details["error"] = error
        return error, details

    def sample_errors(self, outputs: Mapping[str, np.ndarray]) -> np.ndarray | None:
        """Each sample's error alone, in the same measure (the worst output's; the metric on
        one sample's outputs); None where the samples cannot be told apart: fewer than two,
        an output without them on its first axis, a metric that cannot score one sample (a
        metric over labels of the whole data)."""
        n = min((len(a) for a in self.data.values()), default=0)
        arrays = [np.asarray(v) for v in self.reference.values()]
        arrays += [np.asarray(outputs[k]) for k in self.reference]
        if n < 2 or any(a.ndim == 0 or a.shape[0] != n for a in arrays):
            return None
        values = []
        for i in range(n):
            ref = {k: np.asarray(v)[i:i + 1] for k, v in self.reference.items()}
            out = {k: np.asarray(outputs[k])[i:i + 1] for k in self.reference}
            if self.metric is None:
                values.append(error_value(output_errors(ref, out), self.error_measure))
                continue
            try:
                value = float(self.metric(ref, out))
            except Exception:  # scores whole data sets only: no spread, not an error
                return None
            values.append(math.inf if math.isnan(value) else value)
        return np.asarray(values)

    def _user_metric(self, outputs: dict[str, np.ndarray]) -> float:
        try:
            value = self.metric(dict(self.reference), outputs)
        except Exception as exc:  # the user's code may raise anything
            raise OptionError(
                f"--metric {self.metric_name!r} raised {type(exc).__name__}: {one_line(exc)}"
            ) from exc
        try:
            value = float(value)
        except (TypeError, ValueError) as exc:
            raise OptionError(
                f"--metric {self.metric_name!r} returned {type(value).__name__}, not a number"
            ) from exc
        # NaN would make the trial incomparable; a broken candidate is simply the worst one
        return math.inf if math.isnan(value) else value


class DropType(OptionChoice):
    """How ``--max-metric-drop`` counts (``--metric-drop-type``; NNCF's ``DropType``)."""

    __option__ = "--metric-drop-type"

    #: in the metric's units
    ABSOLUTE = "absolute"
    #: as a share of the FP32 model's own value
    RELATIVE = "relative"


#: ``--metric-drop-type``'s words
DROP_TYPES = tuple(m.value for m in DropType)


def metric_drop_bound(evaluator: AccuracyEvaluator, max_drop: float,
                      drop_type: str | DropType) -> dict:
    """The bound on a user metric (lower is better) that allows it to worsen by at most
    ``max_drop`` from the FP32 model's own value ``metric(reference, reference)`` (a metric
    that closes over labels scores FP32's task error there; return ``-accuracy`` for an
    accuracy): ``fp32 + max_drop`` (absolute) or ``fp32 + max_drop * |fp32|`` (relative)."""
    if evaluator.metric is None:
        raise OptionError("--max-metric-drop needs --metric (the function whose drop it bounds)")
    drop_type = DropType.parse(drop_type)
    fp32 = evaluator._user_metric(dict(evaluator.reference))
    if not math.isfinite(fp32):
        raise OptionError(f"--metric {evaluator.metric_name!r} is {fp32} for the FP32 model "
                          "itself: no drop from it can be bounded")
    relative = drop_type is DropType.RELATIVE
    if relative and fp32 == 0:
        raise OptionError(f"--metric {evaluator.metric_name!r} is 0 for the FP32 model, so a "
                          "relative --max-metric-drop allows nothing: use --metric-drop-type "
                          "absolute")
    allowed = max_drop * (abs(fp32) if relative else 1.0)
    return {"fp32_metric": fp32, "max_metric_drop": max_drop, "drop_type": drop_type.value,
            "bound": fp32 + allowed}


# -- scoring the search's candidates -------------------------------------------------------------
def error_record(error: float, details: Mapping) -> dict:
    """JSON-safe error record (inf becomes a large number Optuna and JSON both accept)."""
    def clean(x: float) -> float:
        return float(x) if math.isfinite(float(x)) else 1e30

    outputs = {name: {k: clean(v) for k, v in e.items()}
               for name, e in details.get("outputs", {}).items()}
    rec = {"error": clean(error), "output_errors": outputs}
    for k in ("worst_cosine", "worst_relative_l2", "worst_max_abs", "metric",
              "all_samples_error"):
        if k in details:
            rec[k] = clean(details[k])
    spread = details.get("spread")
    if spread is not None:  # the sample count stays an int
        rec["spread"] = {**{k: clean(v) for k, v in spread.items()}, "samples": spread["samples"]}
    return rec


#: calibration data of at least this many samples, given without ``--validation-data``, has a
#: quarter of its samples held out of calibration and scored by the guard instead, so the error
#: a run claims is one on samples its scales never saw (ppocr-cls on real photos: 0.053 claimed
#: on the calibration photos, 0.29 on others); below it, too few would be left for either
HOLD_OUT_MIN = 16
#: how a held-out part's id starts (``held-out:4/16:cal.npz:1a2b...``)
HELD_OUT = "held-out:"


def hold_out(calibration: tuple[dict, str] | None
             ) -> tuple[tuple[dict, str] | None, tuple[dict, str] | None]:
    """``(calibration, held-out part)`` of calibration data ``(arrays, id)``: a quarter of its
    samples (a fixed draw, whatever their order) left out of calibration for the guard when
    it has :data:`HOLD_OUT_MIN` or more; else the data as given and None, with a warning (two
    PP-OCR recognizers on photographed text lines: 0.149 and 0.125 claimed on 8 calibration
    strips, 0.41 and 0.28 on 8 others; 2 of the 8 held out claimed 0.164 and read 0.43, so
    the minimum stays)."""
    if calibration is None:
        return None, None
    arrays, given = calibration
    n = min(len(a) for a in arrays.values())
    if n < HOLD_OUT_MIN:
        log.warning("--calibration-data has %d samples and no --validation-data is given: the "
                    "output errors this run claims are measured on the samples its scales come "
                    "from, and inputs it never saw can read several times more (give "
                    "--validation-data, or %d or more calibration samples: a quarter is then "
                    "held out)", n, HOLD_OUT_MIN)
        return calibration, None
    k = n // 4
    held = np.zeros(n, dtype=bool)
    held[np.random.default_rng(0).choice(n, size=k, replace=False)] = True
    return ({name: a[:n][~held] for name, a in arrays.items()},
            f"{given} less {k} held out"), \
        ({name: a[:n][held] for name, a in arrays.items()}, f"{HELD_OUT}{k}/{n}:{given}")


def validation_data(model, *, validation: tuple[dict, str] | None,
                    calibration: tuple[dict, str] | None, input_shapes: Mapping | None,
                    samples: int = 8) -> tuple[dict, str]:
    """The data trials are scored on, and an id for fingerprints and reports: the validation
    data, else the calibration data (each ``(arrays, id)``, loaded by
    :func:`qdq_optuna.model.data.input_data`), else random inputs (with a warning: errors on noise are
    only a sanity check)."""
    from qdq_optuna.model import calibration as _calibration

    if validation is not None and validation[1].startswith(HELD_OUT):
        part, given = validation[1][len(HELD_OUT):].split(":", 1)
        k, n = part.split("/")
        return validation[0], (f"--calibration-data held out ({k} of its {n} samples, not "
                               f"calibrated on) {given}")
    if validation is not None:
        return validation[0], f"--validation-data {validation[1]}"
    if calibration is not None:
        return calibration[0], f"--calibration-data {calibration[1]}"
    log.warning("no --validation-data or --calibration-data: output errors are measured on "
                "random inputs (a sanity check only; pass real data for meaningful errors)")
    data = _calibration.random_calibration_data(model, input_shapes or None, samples=samples,
                                                seed=1)
    return data, f"random:{samples}:1"


#: the floor's input noise: uniform, up to half a step of an 8-bit grid over each float input's
#: range on the guard's data (a photo's own 8-bit rounding, and what a Q/DQ on the input adds)
FLOOR_LEVELS = 255
#: noise draws the floor averages
FLOOR_DRAWS = 2


def input_noise(data: Mapping[str, np.ndarray], seed: int,
                levels: int = FLOOR_LEVELS) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """``data`` with each floating-point input moved by uniform noise of up to half a step of a
    ``levels``-step grid over its range (integer inputs, token ids, left as they are), and
    each noised input's step."""
    rng = np.random.default_rng(seed)
    noisy, steps = {}, {}
    for name, a in data.items():
        a = np.asarray(a)
        if not np.issubdtype(a.dtype, np.floating) or a.size == 0:
            noisy[name] = a
            continue
        finite = a[np.isfinite(a)]
        step = float(finite.max() - finite.min()) / levels if finite.size else 0.0
        steps[name] = step
        noisy[name] = (a + rng.uniform(-step / 2, step / 2, a.shape)).astype(a.dtype)
    return noisy, steps


class ErrorScorer:
    """Output errors of candidate models against the FP32 model, as JSON-safe records.

    ``optimize``: run candidates with ONNX Runtime's full graph optimizations (its fused integer
    kernels, what an ONNX Runtime deployment runs) or with none (the ONNX semantics of the Q/DQ
    model: the better proxy for TensorRT, and the only correct one for FP8, see
    :func:`run_model`).
    """

    def __init__(self, reference: bytes, data: Mapping, *, metric: str | None,
                 error_measure: str, optimize: bool, bf16: bool = False,
                 runner: Callable | None = None, confidence: float | None = None) -> None:
        self.evaluator = AccuracyEvaluator(reference, data, metric=metric,
                                           error_measure=error_measure, optimize=optimize,
                                           runner=runner, confidence=confidence)
        #: the FP32 model the errors are against
        self.reference = reference
        self.evaluations = 0
        #: candidates are BF16 models: scored as :func:`~qdq_optuna.model.precision.
        #: bf16_computed_in_fp32` (ONNX Runtime's CPU provider has no BF16 kernels)
        self.bf16 = bf16

    def score_bytes(self, data: bytes | os.PathLike) -> dict:
        """The errors of a model given as bytes (or as a path, when its weights stay on
        disk)."""
        self.evaluations += 1
        if self.bf16:
            from qdq_optuna.model.precision import bf16_computed_in_fp32

            data = bf16_computed_in_fp32(data if isinstance(data, bytes)
                                         else onnx.load(os.fspath(data)))
        error, details = self.evaluator.evaluate(data)
        return error_record(error, details)

    def noise_floor(self, draws: int = FLOOR_DRAWS) -> dict | None:
        """The FP32 model's own error, in the guard's measure, when its floating-point inputs
        move by up to half an 8-bit step of their range (:func:`input_noise`; the mean of
        ``draws`` draws): the error a photo's own 8-bit rounding already causes, and about what
        quantizing the input alone adds. A bound near it leaves no room for any 8-bit
        placement: PP-OCRv5's text detector reads relative L2 0.15 on text crops from this
        noise alone, against the default bound 0.2. None when no input is floating-point."""
        values, steps = [], {}
        ev = self.evaluator
        for seed in range(draws):
            noisy, steps = input_noise(ev.data, seed)
            if not steps:
                return None
            outputs = run_model(self.reference, noisy, batch_size=ev.batch_size,
                                threads=ev.threads, optimize=ev.optimize)
            values.append(ev.score(outputs)[0])
        if not all(math.isfinite(v) for v in values):
            return None
        return {"error": float(np.mean(values)), "draws": draws, "levels": FLOOR_LEVELS,
                "steps": steps}

    def error_under(self, model: bytes, config: tuple[tuple[str, str], ...]) -> float | None:
        """The guard's error of ``model`` run with the session ``config`` entries (the
        settings it would ship with: a runtime optimizer turned off may change its outputs);
        None where the guard does not score through ONNX Runtime's fused kernels (it cannot
        say what those settings do)."""
        if not self.evaluator.optimize or self.bf16 or self.evaluator.runner is not None:
            return None
        configured = copy.copy(self.evaluator)  # the same reference outputs and data
        configured.session_config = tuple(config)
        self.evaluations += 1
        return float(configured.evaluate(model)[0])

    def default_session_check(self, model: bytes) -> dict | None:
        """What a user who checks the shipped model on ONNX Runtime CPU with default options
        sees, when the guard measured something else (the Q/DQ as written, for TensorRT): the
        worst output's error there, or ONNX Runtime's refusal in one line. None when the guard
        already measured that way, or when the model is BF16 (no BF16 kernels on the CPU)."""
        if self.evaluator.optimize or self.bf16 or self.evaluator.runner is not None:
            return None
        fused = copy.copy(self.evaluator)  # the same reference outputs and data
        fused.optimize = True
        try:
            error, details = fused.evaluate(model)
        except AccuracyError as exc:
            return {"loads": False, "refused": str(exc)}
        return {"loads": True, "error": float(error), "output_errors": details["outputs"]}
