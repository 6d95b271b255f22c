"""The search: one Optuna study per pattern, committed pattern by pattern.

Order: patterns are tuned in order of first appearance in the graph (the order of
``inspect``). Each study's objective applies the trial's scheme to every region of the pattern
on top of the schemes committed for earlier patterns, exports the model and measures it. Every
trial of a pattern is timed against the same *reference* (the model before this pattern), so
machine drift cancels in the ratio; the objective returns ``reference_ms * ratio``.

A pattern's best scheme is committed only when an interleaved re-measurement confirms it beats
the reference by ``performance_threshold``; otherwise the pattern commits the empty scheme.

Refinement (``Config.refine_rounds``): a pattern tuned early saw only the patterns before it, so
a later pattern's Q/DQ can make another of its schemes better (a region-output point and the next
pattern's input point quantize the same tensor). After the pass, each pattern whose surroundings
changed is tuned again in a study of its own (``PATTERN/refine1``), with every other pattern's
scheme in place, starting from its committed scheme (the reference then) and climbing from it. A
new scheme that only removes Q/DQ needs to be confirmed faster, not ``performance_threshold``
faster: it costs nothing in accuracy.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import itertools
import json
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import optuna
import yaml
from optuna.trial import TrialState

from .accuracy import AccuracyError
from .backends.base import Backend, BackendError, BackendUnavailable
from .cache import PatternCache, baseline_seed, baseline_tensors
from .config import Config
from .errors import OptionError, UserError
from .export import QuantPlan, atomic_write_bytes, remove_stale_temps
from .graph import InputShapes, Use
from .insertion.points import NODE_INPUT, PatternPoints
from .insertion.rules import WEIGHTED_OPS
from .measure import Measurer, TimingProtocol
from .model import PreparedModel
from .objectives import (
    CATEGORICAL_SAMPLERS,
    METRIC_NAMES,
    ChoiceSpace,
    ErrorScorer,
    check_error_options,
    check_sampler,
    choose_candidate,
    combine,
    parse_objectives,
    validation_data,
)
from .sampling import make_sampler
from .storage import (
    MeasurementCache,
    agree,
    claim,
    default_storage_url,
    delete_run,
    fail_running_trials,
    fail_trial,
    fully_sampled,
    open_storage,
    quiet_optuna,
)

log = logging.getLogger("qdq_optuna")

#: the committed uses (-> quant type) of the patterns before one pattern and after it
Around = tuple[dict[Use, str], dict[Use, str]]

#: runtimes whose fusion rules apply, by backend name
TENSORRT_BACKENDS = frozenset({"tensorrt", "trtexec", "costmodel", "ort-trt"})
METRIC = "latency_ms"
#: robust timing: a candidate whose one-session screen reads more than this many times the
#: reference's screen (checked against a fresh screen of the reference before discarding) is
#: *screened out*: no A/B comparison, its value is the screen estimate, flagged ``screened_out``.
#: A single screen resolves 14-24 % differences, so 1.3 only drops candidates far off; a
#: screened-out trial can never be committed (a commit needs an interleaved confirmation).
SCREEN_DISCARD_RATIO = 1.3
#: seconds between looks while a worker waits for other workers' trials to free a slot
SLOT_POLL_S = 0.25


def compute_inputs_scheme(pp: PatternPoints) -> dict[str, int] | None:
    """The classic post-training recipe as one scheme: Q/DQ on the activation inputs of the
    pattern's Conv / Gemm / MatMul nodes only; None when that is no scheme of its own (no such
    input, or every point is one)."""
    on = {p.id for p in pp.points if p.kind == NODE_INPUT and p.label in WEIGHTED_OPS}
    if not on or len(on) == len(pp.ids):
        return None
    return {pid: int(pid in on) for pid in pp.ids}


def runtime_for_backend(name: str) -> str:
    return "tensorrt" if name in TENSORRT_BACKENDS else "onnxruntime"


@dataclass
class TuneOptions:
    model: str
    output_dir: str
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
    calibration_data: str | None = None
    calibration_method: str = "minmax"
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
    #: accuracy (see qdq_optuna.objectives): data the output errors are measured on (default:
    #: the calibration data), a user metric ``module:function`` (lower is better), the error
    #: measure, an error budget, and the objectives (``latency`` or ``latency,error``)
    validation_data: str | None = None
    metric: str | None = None
    error_measure: str = "relative_l2"
    max_output_error: float | None = None
    objectives: str = "latency"
    #: seconds without a heartbeat after which a ``worker``'s RUNNING trial counts as dead and
    #: is retried (default: $QDQ_OPTUNA_HEARTBEAT_GRACE, else storage.GRACE_PERIOD_S)
    heartbeat_grace: float | None = None

    def __post_init__(self) -> None:
        check_error_options(self.error_measure, self.max_output_error)
        parse_objectives(self.objectives)
        if self.scales not in ("auto", "default", "calibrated"):
            raise OptionError(f"--scales: unknown {self.scales!r} (choose auto, default, calibrated)")
        if self.timeout is not None and not self.timeout > 0:
            raise OptionError(f"--timeout must be positive seconds, got {self.timeout}")
        if self.threads < 1:
            raise OptionError(f"--threads must be >= 1, got {self.threads}")


@dataclass
class TuneResult:
    output_dir: Path
    report: dict

    @property
    def speedup(self) -> float:
        return self.report["speedup"]

    @property
    def optimized_model(self) -> Path:
        return self.output_dir / "optimized.onnx"


def _backend_from(options: TuneOptions) -> Backend:
    from .backends import make_backend
    from .backends.callable import CallableBackend

    b = options.backend
    if isinstance(b, Backend):
        return b
    if callable(b):
        return CallableBackend(b)
    shapes = InputShapes.parse(options.input_shapes).shapes or None
    kwargs: dict = {}
    if b in ("onnxruntime", "ort", "ort-cuda", "ort-trt"):
        kwargs = {"threads": options.threads, "input_shapes": shapes}
    elif b in ("costmodel", "tensorrt", "trtexec"):
        kwargs = {"input_shapes": shapes}
    if ":" not in b:
        kwargs["isolate"] = bool(options.isolate)
    return make_backend(b, **kwargs)


def _backend_name(options: TuneOptions, backend: Backend) -> str:
    return options.backend if isinstance(options.backend, str) else backend.name


class Tuner:
    """Runs (or resumes) one tuning run; see :func:`qdq_optuna.tune`."""

    def __init__(self, options: TuneOptions) -> None:
        self.o = options
        self.cfg = options.config
        self.out = Path(options.output_dir)
        self.backend = _backend_from(options)
        name = _backend_name(options, self.backend)
        self.runtime = options.runtime or runtime_for_backend(name)
        self.prepared = PreparedModel.prepare(
            options.model, runtime=self.runtime, quant_type=options.quant_type,
            input_shapes=options.input_shapes, config=self.cfg, preprocess=options.preprocess,
        )
        # a model whose weights stay on disk is exported into work folders of the output folder
        self.prepared.data_dir = self.out
        self.protocol = TimingProtocol.from_name(options.timing)
        self.measurer = Measurer(self.backend, self.protocol)
        self.measurements = 0
        self.cache_hits = 0
        #: plan key -> where that model failed in this process; the sampler does not avoid
        #: failed schemes, so a re-proposal is pruned instead of crashing the worker again
        self._failed_plans: dict[str, str] = {}
        self.run_id = options.run_id or self.out.resolve().name or "run"
        self.scales_mode = options.scales
        if self.scales_mode == "auto":
            self.scales_mode = "calibrated" if self.runtime == "onnxruntime" else "default"
        self.objectives = parse_objectives(options.objectives)
        self.multi_objective = len(self.objectives) > 1
        self.constrained = options.max_output_error is not None
        self.accuracy_on = (self.multi_objective or self.constrained
                            or options.validation_data is not None or options.metric is not None)
        if self.accuracy_on:  # errors with placeholder scales say nothing about the real model
            if options.scales == "default":
                raise OptionError("--scales default cannot be combined with accuracy options "
                                  "(--max-output-error, --objectives latency,error, "
                                  "--validation-data, --metric): errors need calibrated scales")
            self.scales_mode = "calibrated"
        self.space = ChoiceSpace(self.prepared.mixed_types or (self.prepared.quant_type,),
                                 categorical=options.sampler in CATEGORICAL_SAMPLERS)
        check_sampler(options.sampler, multi_objective=self.multi_objective,
                      mixed=self.space.mixed, constrained=self.constrained)
        self.scorer: ErrorScorer | None = None
        self.started = time.monotonic()

    # -- fingerprint, storage --------------------------------------------------------------
    def fingerprint(self) -> dict:
        o = self.o
        return {
            "model_sha256": self.prepared.source_sha256,
            "backend": self.backend.describe(),
            "runtime": self.runtime,
            "quant_type": self.prepared.quant_type,
            "input_shapes": str(InputShapes.parse(o.input_shapes)),
            "config": self.cfg.search_relevant(),
            "sampler": o.sampler,
            "seed": o.seed,
            "timing": o.timing,
            "scales": self.scales_mode,
            "calibration_method": o.calibration_method,
            "preprocess": self.prepared.preprocess,
            **self._objective_settings(),
        }

    def _objective_settings(self) -> dict:
        """Fingerprint entries of the accuracy / mixed-precision modes (absent when off, so
        runs made before these options existed still resume)."""
        o = self.o
        extra: dict = {}
        if self.space.mixed:
            extra["mixed_types"] = list(self.space.types)
        if self.accuracy_on:
            extra["accuracy"] = {
                "objectives": list(self.objectives),
                "max_output_error": o.max_output_error,
                "error_measure": o.error_measure,
                "metric": o.metric,
                "validation_data": (
                    Path(o.validation_data).name + ":" + _sha_file(o.validation_data)
                    if o.validation_data and Path(o.validation_data).is_file()
                    else o.validation_data),
            }
        return extra

    def _open(self) -> None:
        quiet_optuna(self.cfg.verbose)
        self.out.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(self.out)  # half-written outputs of a killed process
        self.storage_url = self.o.storage or default_storage_url(self.out)
        self.storage = open_storage(self.storage_url, heartbeat=self.o.worker,
                                    grace=self.o.heartbeat_grace)
        fp = self.fingerprint()
        digest = hashlib.sha256(json.dumps(fp, sort_keys=True, default=str).encode()).hexdigest()[:16]
        if self.o.fresh and not self.o.worker:
            delete_run(self.storage, self.run_id)
        self.run_study = optuna.create_study(
            study_name=f"{self.run_id}/_run", storage=self.storage, load_if_exists=True
        )
        attrs = self.run_study.user_attrs
        if "fingerprint" not in attrs:
            # workers starting together agree on one set of settings (a worker started with
            # other settings is refused below, whichever was first)
            won = agree(self.run_study, "fingerprint",
                        {"digest": digest, "settings": json.loads(json.dumps(fp, default=str))})
            self.run_study.set_user_attr("settings", won["settings"])
            self.run_study.set_user_attr("created", _dt.datetime.now(_dt.timezone.utc).isoformat())
            self.run_study.set_user_attr("fingerprint", won["digest"])
            attrs = self.run_study.user_attrs
        if "fingerprint" in attrs and attrs["fingerprint"] != digest:
            old = attrs.get("settings", {})
            changed = sorted(k for k in fp if json.dumps(fp[k], sort_keys=True, default=str)
                             != json.dumps(old.get(k), sort_keys=True, default=str))
            raise UserError(
                f"{self.out}: holds run {self.run_id!r} with other settings "
                f"(changed: {', '.join(changed) or 'unknown'}); rerun with the same settings to "
                "resume, add --fresh to start over, or pick another --output"
            )
        self.fingerprint_digest = digest
        self.mcache = MeasurementCache(self.run_study)

    # -- scales ----------------------------------------------------------------------------
    def _scales(self, purpose: str) -> dict | None:
        if purpose == "trials" and self.scales_mode == "default":
            return None
        if getattr(self, "_calibrated", None) is not None:
            return self._calibrated
        from . import calibration

        model = self.prepared.graph.model
        tensors = self.prepared.candidate_tensors()
        shapes = InputShapes.parse(self.o.input_shapes).shapes
        if self.o.calibration_data:
            data = calibration.load_calibration_data(self.o.calibration_data, model)
            data_id = Path(self.o.calibration_data).name + ":" + _sha_file(self.o.calibration_data)
        else:
            log.warning("no --calibration-data: calibrating on random inputs (scales are only "
                        "placeholders; pass real data for a deployable model)")
            data = calibration.random_calibration_data(model, shapes or None, samples=4, seed=0)
            data_id = "random:4:0"
        fp = hashlib.sha256(json.dumps([self.prepared.source_sha256, self.prepared.preprocess,
                                        data_id, tensors], default=str).encode()).hexdigest()[:16]
        stats_path = self.out / "calibration_stats.json"
        stats = calibration.load_statistics(stats_path, fingerprint=fp)
        if stats is None:
            stats = calibration.collect_statistics(
                self.prepared.graph.full_model(), tensors, data,
                external_data_dir=self.prepared.graph.external_dir)
            calibration.save_statistics(stats_path, stats, fingerprint=fp)
        self._calibrated = calibration.activation_scales(
            stats, method=self.o.calibration_method, quant_type=self.prepared.quant_type
        )
        for qtype in self.prepared.mixed_types:  # mixed precision: one scale per (tensor, type)
            scales = calibration.activation_scales(stats, method=self.o.calibration_method,
                                                   quant_type=qtype)
            self._calibrated.update({(t, qtype): v for t, v in scales.items()})
        return self._calibrated

    def _scorer(self, exporter) -> ErrorScorer | None:
        """Output errors vs FP32 on the validation data (accuracy modes only)."""
        if not self.accuracy_on:
            return None
        if self.scorer is None:
            shapes = InputShapes.parse(self.o.input_shapes).shapes
            data, _ = validation_data(self.prepared.graph.model, validation=self.o.validation_data,
                                      calibration_data=self.o.calibration_data,
                                      input_shapes=shapes)
            self.scorer = ErrorScorer(
                exporter.to_bytes(exporter.plan(set())), data, metric=self.o.metric,
                error_measure=self.o.error_measure, optimize=self.runtime == "onnxruntime",
                run_study=self.run_study,
            )
        return self.scorer

    def _typed(self, base: Around, pp: PatternPoints, params: dict) -> dict:
        """The uses (-> quant type) of ``params`` for pattern ``pp`` between the committed
        uses of the patterns before it and after it (:meth:`_around`). Where two patterns cover
        one use, the earlier pattern's type stands, as in the final model."""
        before, after = base
        uses = combine(before, self.space.typed_uses(pp, params))
        return combine(uses, after) if after else uses

    # -- measuring -------------------------------------------------------------------------
    def _measure_plan(self, exporter, plan: QuantPlan) -> tuple[float, dict]:
        cached = self._cached(plan)
        if cached is not None:
            return cached["latency_ms"], cached
        data = exporter.source(plan)
        m = self.measurer.measure(data) if not self.measurer.deterministic else self.measurer.screen(data)
        self.measurements += 1
        record = {"latency_ms": m.score_ms, "stats": m.to_dict(), "qdq": len(plan)}
        self.mcache.put(plan.key, record)
        return m.score_ms, record

    def _cached(self, plan: QuantPlan, ref_ms: float | None = None) -> dict | None:
        """The record of the same model measured earlier in this run (any pattern or process)."""
        cached = self.mcache.get(plan.key)
        if cached is None:
            return None
        self.cache_hits += 1
        record = {**cached, "cached": True}
        then = cached.get("reference_ms")
        if ref_ms is not None and then is not None and not math.isclose(then, ref_ms):
            # measured against another pattern's reference: only the latency carries over
            record.update(ratio=cached["latency_ms"] / ref_ms, ci=None, decided=False,
                          reference_ms=ref_ms, measured_against_ms=then)
        return record

    def _compare(self, exporter, plan: QuantPlan, reference: bytes, ref_ms: float,
                 ref_screen: float | None) -> tuple[float, dict]:
        """The objective's latency of ``plan``: ``ref_ms`` times its ratio to the reference.

        The record (the trial's ``measurement`` user attr) always has ``kind`` (``ab``:
        interleaved A/B against the pattern's reference; ``screened_out``: dropped by the screen,
        see :data:`SCREEN_DISCARD_RATIO`; ``screen``: one session, fast timing;
        ``deterministic``), ``latency_ms``, ``ratio``, ``ci`` (of the ratio; ``None`` where
        there is none), ``rounds``, ``decided``, ``screened_out``, ``sessions`` (timed sessions
        of the candidate), ``reference_ms``; ``cached: true`` when the model was measured before.
        """
        cached = self._cached(plan, ref_ms)
        if cached is not None:
            return cached["latency_ms"], cached
        data = exporter.source(plan)
        base = {"reference_ms": ref_ms, "screened_out": False, "ci": None, "decided": False}
        if self.measurer.deterministic:
            m = self.measurer.screen(data)
            ratio = m.score_ms / ref_ms
            record = {**base, "kind": "deterministic", "latency_ms": m.score_ms, "ratio": ratio,
                      "ci": [ratio, ratio], "rounds": 1, "decided": True, "sessions": 1,
                      "deterministic": True}
        elif self.protocol.name == "fast" or ref_screen is None:
            m = self.measurer.screen(data)
            record = {**base, "kind": "screen", "latency_ms": m.score_ms,
                      "ratio": m.score_ms / ref_ms, "rounds": 1, "sessions": m.sessions,
                      "stats": m.to_dict()}
        else:
            screen = self.measurer.screen(data)
            self.measurements += 1
            if screen.score_ms > SCREEN_DISCARD_RATIO * ref_screen:
                # the reference's screen dates from the start of the pattern: screen it again
                # now, so that drift since then cannot discard a candidate
                now = self.measurer.screen(reference)
                self.measurements += 1
                if screen.score_ms > SCREEN_DISCARD_RATIO * now.score_ms:
                    ratio = screen.score_ms / now.score_ms
                    record = {**base, "kind": "screened_out", "screened_out": True,
                              "latency_ms": ref_ms * ratio, "ratio": ratio, "rounds": 1,
                              "sessions": screen.sessions, "screen_ms": screen.score_ms,
                              "reference_screen_ms": now.score_ms,
                              "screen_threshold": SCREEN_DISCARD_RATIO,
                              "stats": screen.to_dict(), "qdq": len(plan)}
                    self.mcache.put(plan.key, record)
                    return record["latency_ms"], record
            cmp = self.measurer.compare(data, reference)
            record = {**base, "kind": "ab", "latency_ms": ref_ms * cmp.ratio, "ratio": cmp.ratio,
                      "ci": [cmp.ci_low, cmp.ci_high], "rounds": cmp.rounds,
                      "decided": cmp.decided, "verdict": cmp.verdict,
                      "sessions": screen.sessions + cmp.candidate.sessions,
                      "screen_ms": screen.score_ms}
        self.measurements += 1
        record["qdq"] = len(plan)
        self.mcache.put(plan.key, record)
        return record["latency_ms"], record

    # -- patterns --------------------------------------------------------------------------
    def _study_name(self, pp: PatternPoints, rnd: int = 0) -> str:
        name = f"{self.run_id}/{pp.pattern.id}"
        return f"{name}/refine{rnd}" if rnd else name

    @property
    def refine_rounds(self) -> int:
        """Refinement rounds this run makes (none with two objectives: the Pareto chain of
        the report is built from one decision per pattern)."""
        return 0 if self.multi_objective else self.cfg.refine_rounds

    def _rounds(self) -> list[tuple[PatternPoints, list[dict]]]:
        """The committed patterns, in order up to the first that is not: per pattern the
        user attrs of its studies, first pass then refinement rounds, in round order."""
        attrs = {s.study_name: s.user_attrs for s in self.storage.get_all_studies()
                 if s.study_name.startswith(f"{self.run_id}/")}
        out = []
        for pp in self.prepared.tunable:
            first = attrs.get(self._study_name(pp))
            if first is None or "committed" not in first:
                break
            later = [attrs[n] for n in (self._study_name(pp, r)
                                        for r in range(1, self.refine_rounds + 1)) if n in attrs]
            out.append((pp, [first, *later]))
        return out

    @staticmethod
    def _standing(rounds: list[dict]) -> dict:
        """The attrs of the round whose decision stands for a pattern: its last committed."""
        return next(a for a in reversed(rounds) if "committed" in a)

    def _committed(self) -> tuple[dict[Use, str], list[dict]]:
        """The uses of every standing scheme, and one report row per committed pattern: its
        first-pass attrs, the standing scheme, the product of its rounds' gains and the
        refinement rounds (``refinements``)."""
        uses: dict[Use, str] = {}
        rows = []
        for pp, rounds in self._rounds():
            last = self._standing(rounds)
            uses = combine(uses, self.space.typed_uses(pp, last["committed"]))
            row = dict(rounds[0])
            if len(rounds) > 1:
                for key in ("committed", "committed_types", "committed_error",
                            "committed_output_errors"):
                    if key in last:
                        row[key] = last[key]
                row["gain"] = math.prod(float(a.get("gain", 1.0)) for a in rounds
                                        if "committed" in a)
                row["refinements"] = [self._refinement_entry(a) for a in rounds[1:]]
            rows.append(row)
        return uses, rows

    def _refinement_entry(self, attrs: dict) -> dict:
        """One refinement round of a pattern, for the report (from its study's attrs)."""
        entry = {"round": attrs.get("refine_round"),
                 "status": "committed" if "committed" in attrs else "running",
                 "from_scheme": attrs.get("refines", []),
                 "committed_scheme": self.space.on(attrs.get("committed", {})),
                 "gain": float(attrs.get("gain", 1.0)),
                 "commit_reason": attrs.get("commit_reason")}
        if "converged_after" in attrs:
            entry["converged_after"] = attrs["converged_after"]
        return entry

    def _around(self, pp: PatternPoints, rounds_of: list | None = None) -> Around:
        """The uses of the standing schemes of the committed patterns before ``pp`` and after
        it (``rounds_of``: :meth:`_rounds`, when the caller has it). In the first pass nothing
        after ``pp`` is committed yet."""
        before: dict[Use, str] = {}
        after: dict[Use, str] = {}
        seen = False
        for other, rounds in self._rounds() if rounds_of is None else rounds_of:
            seen = seen or other.pattern.id == pp.pattern.id
            if other.pattern.id != pp.pattern.id:
                typed = self.space.typed_uses(other, self._standing(rounds)["committed"])
                if seen:
                    after = combine(after, typed)
                else:
                    before = combine(before, typed)
        return before, after

    def _context_key(self, pp: PatternPoints, base: Around) -> str:
        """The Q/DQ of other patterns near ``pp``'s regions: on tensors that its nodes, or the
        nodes next to them, read or write. A pattern whose context key is unchanged since it
        was last tuned has nothing new to find in a refinement round."""
        near = self.__dict__.setdefault("_near", {})
        if pp.pattern.id not in near:
            g = self.prepared.graph
            nodes = {n for r in pp.pattern.regions for n in self.prepared.tree[r].all_nodes}

            def tensors_of(idxs) -> set[str]:
                return {t for i in idxs for t in (*g.nodes[i].input, *g.nodes[i].output) if t}

            first = tensors_of(nodes)
            hop = {g.producer[t][0] for t in first if t in g.producer}
            hop |= {c for t in first for c, _ in g.consumers.get(t, [])}
            near[pp.pattern.id] = tensors_of(nodes | hop)
        tensors = near[pp.pattern.id]
        others = combine(*base)
        items = sorted((list(u), q) for u, q in others.items() if u[0] in tensors)
        return hashlib.sha256(json.dumps(items).encode()).hexdigest()[:24]

    def _distinct_schemes(self, pp: PatternPoints, exporter, base: Around) -> int | None:
        if self.space.n ** len(pp.ids) > 1024:
            return None
        keys = set()
        for bits in itertools.product(range(self.space.n), repeat=len(pp.ids)):
            keys.add(exporter.plan(self._typed(base, pp, dict(zip(pp.ids, bits)))).key)
        return len(keys)

    def _tune_pattern(self, pp: PatternPoints, idx: int, exporter, base: Around,
                      seeds_cache: PatternCache | None, baseline_q: set[str] | None,
                      bar_total, rnd: int = 0, current: dict | None = None) -> dict:
        """Tune one pattern between the committed schemes around it (``base``). A refinement
        round (``rnd`` > 0) starts from the pattern's ``current`` scheme: the reference is
        ``base`` with it, and it stays when nothing is confirmed faster."""
        cfg = self.cfg
        order = rnd * len(self.prepared.tunable) + idx
        sampler = make_sampler(
            self.o.sampler, seed=None if self.o.seed is None else self.o.seed + order, config=cfg,
            scheme_key=lambda params: exporter.plan(self._typed(base, pp, params)).key,
            multi_objective=self.multi_objective, refine=rnd > 0,
        )
        study = optuna.create_study(
            study_name=self._study_name(pp, rnd), storage=self.storage, sampler=sampler,
            directions=["minimize"] * len(self.objectives), load_if_exists=True,
        )
        if "committed" in study.user_attrs:
            return dict(study.user_attrs)
        self._current_study = study
        g = self.prepared.graph
        if "attrs_complete" not in study.user_attrs:  # a killed process may have left only some
            study.set_metric_names([METRIC_NAMES[o] for o in self.objectives])
            attrs = {
                "signature": pp.pattern.signature,
                "pattern_id": pp.pattern.id,
                "regions": pp.pattern.regions,
                "region_nodes": {str(r): [g.name_of(n) for n in self.prepared.tree[r].all_nodes]
                                 for r in pp.pattern.regions},
                "ops": pp.pattern.ops,
                "qdq_points": pp.ids,
                "qdq_point_kinds": {p.id: p.kind for p in pp.points},
                "qdq_concat_groups": pp.concat_groups,
                "qdq_fusion_groups": pp.fusion_groups,
                "qdq_point_tensors": {pid: sorted({u[0] for us in pp.resolved[pid].values() for u in us})
                                      for pid in pp.ids},
                "run_id": self.run_id,
                "order": order,
                "refine_round": rnd,
                "context_key": self._context_key(pp, base),
                "baseline_latency_ms": self.baseline_ms,
            }
            if rnd:
                attrs["refines"] = self.space.on(current)
            uses_index = {u: i for i, u in enumerate(sorted(pp.uses(pp.ids)))}
            attrs["qdq_point_uses"] = {
                pid: sorted(uses_index[u] for us in pp.resolved[pid].values() for u in us)
                for pid in pp.ids
            }
            attrs.update(self.space.study_attrs())
            for k, v in attrs.items():
                study.set_user_attr(k, v)
            study.set_user_attr("attrs_complete", True)
        if not self.o.worker:
            for params in fail_running_trials(study):
                _enqueue_redo(study, params)
        # transient failures (worker crash or timeout) of an earlier process are retried once:
        # the redo carries ``retry_of`` (a finished trial's attrs cannot be changed any more)
        # and a failed redo is not retried again
        every = study.get_trials(deepcopy=False)
        retried = {t.user_attrs.get("retry_of") for t in every}
        for t in every:
            if t.state != TrialState.FAIL or not t.user_attrs.get("transient"):
                continue
            if "retry_of" in t.user_attrs or t.number in retried:
                continue
            if not self.o.worker or claim(self.run_study, f"redo/{study.study_name}/{t.number}"):
                _enqueue_redo(study, dict(t.params), {"retry_of": t.number})
        empty = self.space.seed(dict.fromkeys(pp.ids, 0))
        if rnd:  # a refinement starts from the standing scheme, and only from it
            study.enqueue_trial({pid: self.space.value(i) for pid, i
                                 in self.space.indices(current, pp.ids).items()},
                                skip_if_exists=True)
        elif self.o.sampler != "qdq":
            study.enqueue_trial(empty, skip_if_exists=True)
        if seeds_cache is not None:
            for s in seeds_cache.seeds_for(pp):
                study.enqueue_trial(self.space.seed(s), skip_if_exists=True)
        if baseline_q:
            s = baseline_seed(pp, baseline_q)
            if s is not None:
                study.enqueue_trial(self.space.seed(s), skip_if_exists=True)
        if not rnd and self.o.sampler == "qdq" and self.cfg.seed_compute_inputs:  # after user seeds
            compute = compute_inputs_scheme(pp)
            if compute is not None:
                study.enqueue_trial(self.space.seed(compute), skip_if_exists=True)

        # the reference: everything committed so far, nothing of this pattern (in a
        # refinement: everything, this pattern's standing scheme included)
        ref_plan = exporter.plan(self._typed(base, pp, current or {}))
        ref_bytes = exporter.source(ref_plan)  # bytes, or a path for a model in external mode
        if "reference_ms" not in study.user_attrs:
            def measure_reference() -> list[float]:
                if self.measurer.deterministic:
                    ref = self.measurer.screen(ref_bytes)
                    ref_ms, ref_screen = ref.score_ms, ref.score_ms
                else:
                    ref_ms = self.measurer.measure(ref_bytes).score_ms
                    ref_screen = self.measurer.screen(ref_bytes).score_ms
                self.measurements += 1
                return [ref_ms, ref_screen]

            # every worker times its trials against the same reference figure
            ref_ms, ref_screen = agree(self.run_study, f"reference/{study.study_name}",
                                       measure_reference)
            study.set_user_attr("reference_screen_ms", ref_screen)
            study.set_user_attr("reference_ms", ref_ms)
        ref_ms = study.user_attrs["reference_ms"]
        ref_screen = study.user_attrs.get("reference_screen_ms")
        # a trial that builds the reference itself is not measured: its ratio is 1 exactly
        self.mcache.put(ref_plan.key, {"kind": "reference", "latency_ms": ref_ms, "ratio": 1.0,
                                       "ci": [1.0, 1.0], "rounds": 0, "decided": True,
                                       "screened_out": False, "sessions": 0, "reference": True,
                                       "reference_ms": ref_ms})
        scorer = self._scorer(exporter)
        if scorer is not None and "reference_error" not in study.user_attrs:
            ref_err = scorer.score(exporter, ref_plan)
            study.set_user_attr("reference_error", ref_err["error"])
            study.set_user_attr("reference_output_errors", ref_err["output_errors"])

        budget = cfg.schemes_per_region
        if rnd:  # a local search: every point flipped once, and as many trials again
            budget = min(budget, 2 * len(pp.ids))
        distinct = self._distinct_schemes(pp, exporter, base)
        if distinct is not None:
            budget = min(budget, distinct)

        def objective(trial: optuna.Trial) -> float:
            slot = self._claim_slot(study, trial, budget)
            if slot is None:
                trial.set_user_attr("skipped", "gave its slot to a queued (retried) trial")
                raise optuna.TrialPruned("gave its slot to a queued (retried) trial")
            if not slot:
                trial.set_user_attr("skipped", "the budget was filled by other workers")
                study.stop()
                raise optuna.TrialPruned("the budget was filled by other workers")
            params = {pid: self.space.suggest(trial, pid) for pid in pp.ids}
            on = [p for p, v in params.items() if v]
            plan = exporter.plan(self._typed(base, pp, params))
            trial.set_user_attr("scheme", on)
            if self.space.mixed:
                trial.set_user_attr("scheme_types", self.space.describe(params))
            trial.set_user_attr("plan_key", plan.key)
            trial.set_user_attr("qdq_count", len(plan))
            trial.set_user_attr("tensors", sorted({u[0] for u in pp.uses(on)}))
            twin = self._twin(study, trial, plan.key) if self.o.worker else None
            if twin is not None:  # two workers drew the same scheme at once: measure it once
                trial.set_user_attr("duplicate_of", twin)
                raise optuna.TrialPruned(f"trial {twin} measures the same model")
            failed_in = self._failed_plans.get(plan.key)
            if failed_in is not None:
                trial.set_user_attr("known_failure", failed_in)
                raise optuna.TrialPruned(f"the same model failed in {failed_in}")
            before = self.measurements  # what this trial cost (0 when cached); see bench.py
            try:
                latency, record = self._compare(exporter, plan, ref_bytes, ref_ms, ref_screen)
            except BackendError as exc:
                self._failed_plans[plan.key] = f"{pp.pattern.id} trial {trial.number}"
                trial.set_user_attr("failure", str(exc)[:2000])
                trial.set_user_attr("transient", bool(getattr(exc, "transient", False)))
                trial.set_user_attr("measurements", self.measurements - before)
                raise
            trial.set_user_attr("measurements", self.measurements - before)
            trial.set_user_attr("measurement", record)
            if scorer is None:
                return latency
            err = scorer.score(exporter, plan)
            trial.set_user_attr("error", err["error"])  # the scalar objective / constraint
            trial.set_user_attr("output_errors", err["output_errors"])  # per output: cosine, ...
            if self.constrained:
                excess = err["error"] - float(self.o.max_output_error)
                trial.set_constraint("max_output_error", excess)
                trial.set_user_attr("feasible", excess <= 0)
            return (latency, err["error"]) if self.multi_objective else latency

        counter = optuna.study.MaxTrialsCallback(budget, states=(TrialState.COMPLETE,))

        def stop_on_failures(study: optuna.Study, trial) -> None:
            fails = sum(1 for t in study.get_trials(deepcopy=False, states=(TrialState.FAIL,
                                                                            TrialState.PRUNED))
                        if t.state == TrialState.FAIL or "known_failure" in t.user_attrs)
            if fails >= max(5, budget):
                study.stop()

        bar = None
        if self.o.progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=budget, desc=f"{pp.pattern.id}{f' refine{rnd}' if rnd else ''} "
                       f"({len(pp.pattern.regions)} regions, "
                       f"{len(pp.ids)} points)", leave=False, unit="trial")
            bar.update(len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))))

        def progress(study: optuna.Study, trial) -> None:
            if bar is not None and trial.state == TrialState.COMPLETE:
                bar.update(1)
                with contextlib.suppress(ValueError, RuntimeError):  # none feasible / 2 objectives
                    bar.set_postfix(best=f"{study.best_value:.3f}ms", ref=f"{ref_ms:.3f}ms")

        callbacks = [counter, stop_on_failures, progress]
        patience = cfg.converged_patience
        if patience and not self.o.worker and hasattr(sampler, "converged"):
            # workers keep exact budgets: one worker cannot know the others' trials are done
            def stop_when_converged(study: optuna.Study, trial) -> None:
                if trial.state == TrialState.COMPLETE and sampler.converged(study, patience):
                    study.set_user_attr("converged_after", trial.number + 1)
                    study.stop()

            callbacks.append(stop_when_converged)
        done = len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))
        try:
            if done < budget and "converged_after" not in study.user_attrs:
                study.optimize(
                    self._interruptible(objective), callbacks=callbacks,
                    timeout=self._remaining(), catch=(BackendError, AccuracyError),
                    gc_after_trial=False,
                )
        finally:
            if bar is not None:
                bar.close()
        if self._remaining() is not None and self._remaining() <= 0:
            done = len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))
            if done < budget and "converged_after" not in study.user_attrs:
                raise _OutOfTime()
        return self._commit(study, pp, exporter, base, ref_plan, ref_bytes, ref_ms, current)

    def _claim_slot(self, study: optuna.Study, trial: optuna.Trial, budget: int) -> bool | None:
        """Whether ``trial`` may be measured: fewer than ``budget`` trials are COMPLETE, hold a
        slot, or are RUNNING ahead of it. Without this, workers sharing a study each finish
        their running trial after the last slot was taken and the study overshoots its budget.
        A trial without a slot waits while a trial ahead of it may still fail and free one
        (a dead worker's trial fails once its heartbeat is older than the grace period).

        Queued trials (a dead worker's retried trial, seeds) go ahead of the sampler's own
        trials whatever their number, so a retry is never crowded out by waiting workers.
        None: a slot is free but queued trials need the last slots; a trial of the sampler's
        own gives its slot up, so that the next ``ask`` runs a queued one."""
        number = trial.number
        mine = study._storage.get_trial(trial._trial_id)
        rank = (not _queued(mine), number)
        while True:
            trials = study.get_trials(deepcopy=False, states=(
                TrialState.COMPLETE, TrialState.RUNNING, TrialState.WAITING))
            done = sum(1 for t in trials if t.state == TrialState.COMPLETE)
            ahead = sum(1 for t in trials if t.state == TrialState.RUNNING and t.number != number
                        and (t.user_attrs.get("slot") or (not _queued(t), t.number) < rank))
            queued = sum(1 for t in trials if t.state == TrialState.WAITING) if rank[0] else 0
            if done + ahead < budget:
                if queued and done + ahead + queued >= budget:
                    time.sleep(SLOT_POLL_S)
                    return None
                if self.o.worker:  # trials that check after this one count it
                    trial.set_user_attr("slot", True)
                return True
            remaining = self._remaining()
            if done >= budget or (remaining is not None and remaining <= 0):
                return False
            optuna.storages.fail_stale_trials(study)  # a dead worker's trial frees its slot
            time.sleep(SLOT_POLL_S)

    @staticmethod
    def _twin(study: optuna.Study, trial: optuna.Trial, key: str) -> int | None:
        """Another finished, running or queued trial that builds the same model (two workers
        sampled the same scheme at once). Each trial stores its plan key before it looks, so of
        two twins at least one sees the other and steps back (rarely both: the scheme is then
        left out, never measured twice). Schemes the sampler knowingly repeats
        (``qdq:duplicate``) are not twins."""
        if study._storage.get_trial_system_attrs(trial._trial_id).get("qdq:duplicate"):
            return None
        for t in study.get_trials(deepcopy=False, states=(
                TrialState.COMPLETE, TrialState.RUNNING, TrialState.WAITING)):
            if t.number != trial.number and t.user_attrs.get("plan_key") == key:
                return t.number
        return None

    def _interruptible(self, objective: Callable) -> Callable:
        """The objective, noting which trial runs, and marking a Ctrl-C'd trial to be redone."""
        def run(trial: optuna.Trial):
            self._live_trial = trial._trial_id
            try:
                return objective(trial)
            except KeyboardInterrupt:
                with contextlib.suppress(Exception):
                    trial.set_user_attr("failure", "interrupted (Ctrl-C)")
                    trial.set_user_attr("transient", True)  # redone by the next run
                raise
        return run

    def _interrupted(self) -> None:
        """Ctrl-C: no trial of ours stays RUNNING, and state.yaml says how to resume."""
        study = getattr(self, "_current_study", None)
        if study is not None:
            with contextlib.suppress(Exception):
                live = getattr(self, "_live_trial", None)
                for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
                    if not self.o.worker or t._trial_id == live:
                        fail_trial(study, t._trial_id, "interrupted (Ctrl-C)", transient=True)
        if hasattr(self, "run_study"):
            with contextlib.suppress(Exception):
                self._write_state("interrupted")

    def _commit(self, study, pp, exporter, base, ref_plan, ref_bytes, ref_ms,
                current: dict | None = None) -> dict:
        """Store the pattern's decision. With several workers, or a process killed part way,
        the first decision stored in the run wins (:func:`~qdq_optuna.storage.agree`): every
        worker builds the next patterns on the same commits."""
        if "committed" in study.user_attrs:  # another worker committed this pattern already
            return dict(study.user_attrs)
        decision = agree(self.run_study, f"commit/{study.study_name}", lambda: self._decide(
            study, pp, exporter, base, ref_plan, ref_bytes, ref_ms, current))
        # "committed" last: its presence means the whole decision is stored
        for k, v in sorted(decision.items(), key=lambda kv: kv[0] == "committed"):
            study.set_user_attr(k if k != "reason" else "commit_reason", v)
        from .dashboard import save_pattern_artifacts, save_pattern_note

        save_pattern_artifacts(study, self.out, pp, self.prepared)  # logs, never raises
        save_pattern_note(study)
        return dict(study.user_attrs)

    def _decide(self, study, pp, exporter, base, ref_plan, ref_bytes, ref_ms,
                current: dict | None = None) -> dict:
        """The decision for one pattern: its best scheme if a re-measurement confirms it
        (else the empty scheme; in a refinement round the ``current`` one)."""
        complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        keep = self.space.indices(current, pp.ids) if current else dict.fromkeys(pp.ids, 0)
        decision = {"committed": keep, "gain": 1.0, "reason": "no trial beat the reference"}
        best, why = choose_candidate(complete, multi_objective=self.multi_objective,
                                     constrained=self.constrained,
                                     threshold=self.cfg.performance_threshold)
        if best is None and complete:
            decision["reason"] = why
        if best is not None:
            plan = exporter.plan(self._typed(base, pp, best.params))
            # a scheme that only takes Q/DQ away costs no accuracy: faster is enough
            threshold = (1.0 if _quantized_uses(plan) < _quantized_uses(ref_plan)
                         else self.cfg.performance_threshold)
            if plan.key == ref_plan.key:
                decision["reason"] = "best scheme is the reference"
            elif best.values[0] < ref_ms / threshold:
                cmp = self.measurer.compare(exporter.source(plan), ref_bytes)
                self.measurements += 1
                speedup = 1.0 / cmp.ratio
                confirmed = speedup >= threshold and speedup > 1.0 and (
                    self.measurer.deterministic or cmp.ci_high < 1.0
                )
                decision = {
                    "committed": self.space.indices(best.params, pp.ids) if confirmed else keep,
                    "gain": speedup if confirmed else 1.0,
                    "candidate_trial": best.number,
                    "confirmation": {"ratio": cmp.ratio, "ci": [cmp.ci_low, cmp.ci_high],
                                     "rounds": cmp.rounds, "speedup": speedup},
                    "reason": "confirmed" if confirmed else
                              f"re-measured speedup {speedup:.3f} below threshold "
                              f"{threshold} or not significant",
                }
            else:
                decision["reason"] = (f"best {best.values[0]:.4f} ms not "
                                      f"{threshold}x faster than reference {ref_ms:.4f} ms")
            if self.accuracy_on or self.multi_objective:
                decision["candidate"] = why
        if self.accuracy_on:  # the whole-model error after this commit
            chosen = exporter.plan(self._typed(base, pp, decision["committed"]))
            err = self._scorer(exporter).score(exporter, chosen)
            decision["committed_error"] = err["error"]
            decision["committed_output_errors"] = err["output_errors"]
        if self.space.mixed:
            decision["committed_types"] = self.space.describe(decision["committed"])
        return decision

    def _remaining(self) -> float | None:
        if self.o.timeout is None:
            return None
        return self.o.timeout - (time.monotonic() - self.started)

    # -- the run ---------------------------------------------------------------------------
    def run(self) -> TuneResult:
        try:
            return self._run()
        except KeyboardInterrupt:
            self._interrupted()
            raise
        finally:
            if isinstance(self.o.backend, str):  # ours: stop its worker process now
                self.backend.close()

    def _measure_baseline(self, exporter, empty_plan: QuantPlan) -> tuple[float, dict]:
        """The float model's measurement. A backend that cannot run it ends the run with one
        clear line; a crashed or hung worker is given one more try first."""
        for attempt in (1, 2):
            try:
                self.measurer.warm_up([exporter.source(empty_plan)])
                return self._measure_plan(exporter, empty_plan)
            except BackendUnavailable:
                raise
            except BackendError as exc:
                if attempt == 1 and getattr(exc, "transient", False):
                    log.warning("measuring the float model failed (%s); trying once more", exc)
                    continue
                raise UserError(f"backend {_backend_name(self.o, self.backend)} cannot run the "
                                f"float model {self.o.model}: {exc}") from exc
        raise AssertionError("unreachable")

    def _run(self) -> TuneResult:
        quiet_optuna(self.cfg.verbose)
        self._open()
        cache = None
        if self.o.pattern_cache:
            cache = PatternCache.load(self.o.pattern_cache)
            cache.check_matches(self.o.pattern_cache, self.prepared.tunable)
        baseline_q = baseline_tensors(self.o.qdq_baseline) if self.o.qdq_baseline else None
        if baseline_q is not None:
            known = set(self.prepared.candidate_tensors())
            if not baseline_q & known:
                raise UserError(f"--qdq-baseline {self.o.qdq_baseline}: none of its quantized "
                                "tensors exists in this model")
        exporter = self.prepared.exporter(self._scales("trials"), self.cfg)
        self._scorer(exporter)  # bad validation data or metric: fail before any measurement
        empty_plan = exporter.plan(set())
        attrs = self.run_study.user_attrs
        if "baseline_latency_ms" not in attrs:  # one figure for all workers
            base_ms, record = agree(self.run_study, "baseline",
                                    lambda: list(self._measure_baseline(exporter, empty_plan)))
            self.run_study.set_user_attr("baseline_measurement", record)
            self.run_study.set_user_attr("baseline_latency_ms", base_ms)
        self.baseline_ms = self.run_study.user_attrs["baseline_latency_ms"]
        self._write_state("running")

        patterns = self.prepared.tunable
        bar = None
        if self.o.progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(patterns), desc="patterns", unit="pattern")
        try:
            for idx, pp in enumerate(patterns):
                self._tune_pattern(pp, idx, exporter, self._around(pp), cache, baseline_q, bar)
                self._write_state("running")
                if bar is not None:
                    bar.update(1)
            for rnd in range(1, self.refine_rounds + 1):
                self._refine(rnd, exporter)
        except _OutOfTime:
            self._write_state("timeout")
            return self._finish(exporter, partial=True)
        finally:
            if bar is not None:
                bar.close()
        return self._finish(exporter, partial=False)

    def _refine(self, rnd: int, exporter) -> None:
        """One refinement round over every pattern, in order (see the module docstring)."""
        names = {s.study_name for s in self.storage.get_all_studies()}
        tuned = 0
        for idx, pp in enumerate(self.prepared.tunable):
            rounds_of = self._rounds()
            others = self._around(pp, rounds_of)
            rounds = rounds_of[idx][1]  # every pattern is committed after the first pass
            if self._study_name(pp, rnd) not in names:  # not started: is there news for it?
                last = rounds[-1]  # the context this pattern was last tuned in
                if last.get("context_key") == self._context_key(pp, others):
                    continue
            tuned += 1
            self._tune_pattern(pp, idx, exporter, others, None, None, None, rnd=rnd,
                               current=self._standing(rounds)["committed"])
            self._write_state("running")
        if tuned:
            log.info("refinement round %d: %d of %d patterns tuned again", rnd, tuned,
                     len(self.prepared.tunable))

    def _finish(self, exporter, partial: bool) -> TuneResult:
        from .report import build_report, write_reports

        uses, rows = self._committed()
        final_exporter = self.prepared.exporter(self._scales("final"), self.cfg)
        plan = final_exporter.plan(uses)
        if final_exporter.external or final_exporter.to_files:  # written piece by piece
            final_bytes = final_exporter.save(plan, self.out / "optimized.onnx")
        else:
            optimized = final_exporter.to_model(plan)
            import onnx

            onnx.checker.check_model(optimized)
            atomic_write_bytes(self.out / "optimized.onnx", optimized.SerializeToString())
            final_bytes = optimized.SerializeToString()
        base_bytes = final_exporter.source(final_exporter.plan(set()))
        cmp = self.measurer.compare(final_bytes, base_bytes, until="precision")
        self.measurements += 1
        report = build_report(self, plan, cmp, rows, partial=partial)
        if self.accuracy_on:
            err = self._scorer(final_exporter).score(final_exporter, plan)
            report.update({
                "objectives": list(self.objectives),
                "error_measure": (f"metric {self.o.metric}" if self.o.metric
                                  else self.o.error_measure),
                "max_output_error": self.o.max_output_error,
                "final_output_error": err["error"],
                "final_output_errors": err["output_errors"],
            })
        if self.multi_objective:
            from .pareto import model_front

            report["pareto"] = model_front(self, final_exporter, rows, base_bytes, cmp, plan)
            report["measurements"] = self.measurements
        write_reports(self.out, report)
        self._write_pattern_cache()
        self._write_state("timeout" if partial else "done")
        return TuneResult(self.out, report)

    def _write_pattern_cache(self) -> None:
        cache = PatternCache()
        for pp in self.prepared.tunable:
            schemes = []
            for rnd in range(self.refine_rounds + 1):  # refinements: the schemes that stood
                try:
                    s = optuna.load_study(study_name=self._study_name(pp, rnd),
                                          storage=self.storage)
                except KeyError:
                    continue
                schemes += [(self.space.on(t.params), t.values[0])
                            for t in s.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))]
            if schemes:
                cache.add(pp.pattern.signature, schemes,
                          minimum_distance=self.cfg.pattern_cache_minimum_distance,
                          max_entries=self.cfg.pattern_cache_max_entries_per_pattern)
        cache.save(self.out / "pattern_cache.yaml")

    def _write_state(self, status: str) -> None:
        patterns = []
        committed = {r["pattern_id"]: r for r in self._committed()[1]}  # standing schemes
        for pp in self.prepared.tunable:
            row = {"id": pp.pattern.id, "signature": pp.pattern.signature,
                   "regions": len(pp.pattern.regions), "points": len(pp.ids), "status": "pending"}
            with contextlib.suppress(KeyError):
                s = optuna.load_study(study_name=self._study_name(pp), storage=self.storage)
                row["trials"] = len(s.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))
                row["status"] = "running"
            r = committed.get(pp.pattern.id)
            if r is not None:
                row["status"] = "committed"
                row["committed"] = sorted(self.space.on(r["committed"]))
                row["gain"] = round(float(r.get("gain", 1.0)), 4)
                if "refinements" in r:
                    row["refinements"] = len(r["refinements"])
            patterns.append(row)
        state = {
            "status": status,
            "run_id": self.run_id,
            "storage": self.storage_url,
            "fingerprint": self.fingerprint_digest,
            "baseline_latency_ms": getattr(self, "baseline_ms", None),
            "measurements": self.measurements,
            "cache_hits": self.cache_hits,
            "patterns": patterns,
            "resume": "rerun the same command to continue",
        }
        atomic_write_bytes(self.out / "state.yaml", yaml.safe_dump(state, sort_keys=False).encode())


class _OutOfTime(Exception):
    pass


def _quantized_uses(plan: QuantPlan) -> set[tuple]:
    """(tensor, consumer, slot, type) of every activation use that reads through Q/DQ."""
    return {(t, n, s, q) for t, consumers, q in plan.activations for n, s in consumers}


def _queued(trial) -> bool:
    """A trial whose scheme was queued (a seed, a redo, a dead worker's retry), not sampled."""
    return bool(trial.system_attrs.get("fixed_params")) or "failed_trial" in trial.system_attrs


def _enqueue_redo(study: optuna.Study, params: dict, user_attrs: dict | None = None) -> None:
    """Enqueue a failed trial's scheme again. ``enqueue_trial(skip_if_exists=True)`` would
    match the failed trial itself and never redo it; only a live or finished trial with the
    same params makes the redo unnecessary. A trial that died before all its points were
    suggested measured nothing: it is not redone (its partial params would be filled with
    "off" and build another, possibly already measured, model)."""
    if not params or not fully_sampled(study, params):
        return
    for t in study.get_trials(deepcopy=False, states=(TrialState.WAITING, TrialState.RUNNING,
                                                      TrialState.COMPLETE)):
        if t.system_attrs.get("fixed_params", t.params) == params:
            return
    study.enqueue_trial(params, user_attrs=user_attrs)


def _sha_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


def tune(model: str | os.PathLike, output_dir: str | os.PathLike, *,
         benchmark: Callable | Backend | str | None = None, config: Config | None = None,
         **options) -> TuneResult:
    """Tune ``model``; results go to ``output_dir`` (see README: outputs).

    ``benchmark`` is a backend name (``"onnxruntime"``, ``"tensorrt"``, ``"costmodel"``, ...), a
    :class:`~qdq_optuna.backends.base.Backend`, or any callable ``fn(model: onnx.ModelProto) -> ms``.
    Other keyword arguments are the fields of :class:`TuneOptions`.
    """
    opts = TuneOptions(model=str(model), output_dir=str(output_dir),
                       backend=benchmark if benchmark is not None else options.pop("backend", "onnxruntime"),
                       config=config or Config(), **options)
    return Tuner(opts).run()
