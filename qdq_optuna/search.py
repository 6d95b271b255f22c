"""The search: one Optuna study per pattern, committed pattern by pattern.

Order: patterns are tuned in order of first appearance in the graph (the order of
``inspect``). Each study's objective applies the trial's scheme to every region of the pattern
on top of the schemes committed for earlier patterns, exports the model and measures it. Every
trial of a pattern is timed against the same *reference* (the model before this pattern), so
machine drift cancels in the ratio; the objective returns ``reference_ms * ratio``.

A pattern's best scheme is committed only when an interleaved re-measurement confirms it beats
the reference by ``performance_threshold``; otherwise the pattern commits the empty scheme.
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

from .backends.base import Backend, BackendError
from .cache import PatternCache, baseline_seed, baseline_tensors
from .config import Config
from .errors import OptionError, UserError
from .export import QuantPlan, atomic_write_bytes
from .graph import InputShapes, Use
from .insertion.points import PatternPoints
from .measure import Measurer, TimingProtocol
from .model import PreparedModel
from .sampling import make_sampler
from .storage import (
    MeasurementCache,
    default_storage_url,
    delete_run,
    fail_running_trials,
    open_storage,
    quiet_optuna,
)

log = logging.getLogger("qdq_optuna")

#: runtimes whose fusion rules apply, by backend name
TENSORRT_BACKENDS = frozenset({"tensorrt", "trtexec", "costmodel", "ort-trt"})
METRIC = "latency_ms"
SCREEN_DISCARD_RATIO = 1.3
#: seconds between looks while a worker waits for other workers' trials to free a slot
SLOT_POLL_S = 0.25


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
    isolate: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
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
    if options.isolate and ":" not in b:
        kwargs["isolate"] = True
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
        self.protocol = TimingProtocol.from_name(options.timing)
        self.measurer = Measurer(self.backend, self.protocol)
        self.measurements = 0
        self.cache_hits = 0
        self.run_id = options.run_id or self.out.resolve().name or "run"
        self.scales_mode = options.scales
        if self.scales_mode == "auto":
            self.scales_mode = "calibrated" if self.runtime == "onnxruntime" else "default"
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
        }

    def _open(self) -> None:
        quiet_optuna(self.cfg.verbose)
        self.out.mkdir(parents=True, exist_ok=True)
        self.storage_url = self.o.storage or default_storage_url(self.out)
        self.storage = open_storage(self.storage_url, heartbeat=self.o.worker)
        fp = self.fingerprint()
        digest = hashlib.sha256(json.dumps(fp, sort_keys=True, default=str).encode()).hexdigest()[:16]
        if self.o.fresh and not self.o.worker:
            delete_run(self.storage, self.run_id)
        self.run_study = optuna.create_study(
            study_name=f"{self.run_id}/_run", storage=self.storage, load_if_exists=True
        )
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
        if "fingerprint" not in attrs:
            self.run_study.set_user_attr("fingerprint", digest)
            self.run_study.set_user_attr("settings", json.loads(json.dumps(fp, default=str)))
            self.run_study.set_user_attr("created", _dt.datetime.now(_dt.timezone.utc).isoformat())
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
            stats = calibration.collect_statistics(model, tensors, data)
            calibration.save_statistics(stats_path, stats, fingerprint=fp)
        self._calibrated = calibration.activation_scales(
            stats, method=self.o.calibration_method, quant_type=self.prepared.quant_type
        )
        return self._calibrated

    # -- measuring -------------------------------------------------------------------------
    def _measure_plan(self, exporter, plan: QuantPlan) -> tuple[float, dict]:
        cached = self.mcache.get(plan.key)
        if cached is not None:
            self.cache_hits += 1
            return cached["latency_ms"], {**cached, "cached": True}
        data = exporter.to_bytes(plan)
        m = self.measurer.measure(data) if not self.measurer.deterministic else self.measurer.screen(data)
        self.measurements += 1
        record = {"latency_ms": m.score_ms, "stats": m.to_dict(), "qdq": len(plan)}
        self.mcache.put(plan.key, record)
        return m.score_ms, record

    def _compare(self, exporter, plan: QuantPlan, reference: bytes, ref_ms: float,
                 ref_screen: float | None) -> tuple[float, dict]:
        cached = self.mcache.get(plan.key)
        if cached is not None:
            self.cache_hits += 1
            return cached["latency_ms"], {**cached, "cached": True}
        data = exporter.to_bytes(plan)
        if self.measurer.deterministic:
            m = self.measurer.screen(data)
            record = {"latency_ms": m.score_ms, "ratio": m.score_ms / ref_ms, "deterministic": True}
        elif self.protocol.name == "fast" or ref_screen is None:
            m = self.measurer.screen(data)
            record = {"latency_ms": m.score_ms, "ratio": m.score_ms / ref_ms, "stats": m.to_dict()}
        else:
            screen = self.measurer.screen(data)
            self.measurements += 1
            if screen.score_ms > SCREEN_DISCARD_RATIO * ref_screen:
                est = ref_ms * screen.score_ms / ref_screen
                record = {"latency_ms": est, "ratio": est / ref_ms, "screened_out": True,
                          "stats": screen.to_dict()}
                self.mcache.put(plan.key, record)
                return est, record
            cmp = self.measurer.compare(data, reference)
            record = {"latency_ms": ref_ms * cmp.ratio, "ratio": cmp.ratio,
                      "ci": [cmp.ci_low, cmp.ci_high], "rounds": cmp.rounds,
                      "decided": cmp.decided, "screen_ms": screen.score_ms}
        self.measurements += 1
        record["qdq"] = len(plan)
        self.mcache.put(plan.key, record)
        return record["latency_ms"], record

    # -- patterns --------------------------------------------------------------------------
    def _study_name(self, pp: PatternPoints) -> str:
        return f"{self.run_id}/{pp.pattern.id}"

    def _committed(self) -> tuple[set[Use], list[dict]]:
        uses: set[Use] = set()
        rows = []
        for pp in self.prepared.tunable:
            try:
                s = optuna.load_study(study_name=self._study_name(pp), storage=self.storage)
            except KeyError:
                break
            attrs = s.user_attrs
            if "committed" not in attrs:
                break
            on = [p for p, v in attrs["committed"].items() if v]
            uses |= pp.uses(on)
            rows.append(attrs)
        return uses, rows

    def _distinct_schemes(self, pp: PatternPoints, exporter, base: set[Use]) -> int | None:
        if len(pp.ids) > 10:
            return None
        keys = set()
        for bits in itertools.product((0, 1), repeat=len(pp.ids)):
            on = [p for p, b in zip(pp.ids, bits) if b]
            keys.add(exporter.plan(base | pp.uses(on)).key)
        return len(keys)

    def _tune_pattern(self, pp: PatternPoints, idx: int, exporter, base: set[Use],
                      seeds_cache: PatternCache | None, baseline_q: set[str] | None,
                      bar_total) -> dict:
        cfg = self.cfg
        sampler = make_sampler(
            self.o.sampler, seed=None if self.o.seed is None else self.o.seed + idx, config=cfg,
            scheme_key=lambda params: exporter.plan(
                base | pp.uses([p for p, v in params.items() if v])).key,
        )
        study = optuna.create_study(
            study_name=self._study_name(pp), storage=self.storage, sampler=sampler,
            direction="minimize", load_if_exists=True,
        )
        if "committed" in study.user_attrs:
            return dict(study.user_attrs)
        g = self.prepared.graph
        if "signature" not in study.user_attrs:
            study.set_metric_names([METRIC])
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
                "order": idx,
                "baseline_latency_ms": self.baseline_ms,
            }
            uses_index = {u: i for i, u in enumerate(sorted(pp.uses(pp.ids)))}
            attrs["qdq_point_uses"] = {
                pid: sorted(uses_index[u] for us in pp.resolved[pid].values() for u in us)
                for pid in pp.ids
            }
            for k, v in attrs.items():
                study.set_user_attr(k, v)
        if not self.o.worker:
            for params in fail_running_trials(study):
                _enqueue_redo(study, params)
        # transient failures of an earlier process are retried once
        for t in study.get_trials(deepcopy=False, states=(TrialState.FAIL,)):
            if t.user_attrs.get("transient") and not t.system_attrs.get("qdq:retried"):
                study._storage.set_trial_system_attr(t._trial_id, "qdq:retried", True)
                _enqueue_redo(study, dict(t.params))
        empty = dict.fromkeys(pp.ids, 0)
        if self.o.sampler != "qdq":
            study.enqueue_trial(empty, skip_if_exists=True)
        if seeds_cache is not None:
            for s in seeds_cache.seeds_for(pp):
                study.enqueue_trial(s, skip_if_exists=True)
        if baseline_q:
            s = baseline_seed(pp, baseline_q)
            if s is not None:
                study.enqueue_trial(s, skip_if_exists=True)

        # the reference: everything committed so far, nothing of this pattern
        ref_plan = exporter.plan(base)
        ref_bytes = exporter.to_bytes(ref_plan)
        if "reference_ms" not in study.user_attrs:
            if self.measurer.deterministic:
                ref = self.measurer.screen(ref_bytes)
                ref_ms, ref_screen = ref.score_ms, ref.score_ms
            else:
                ref_ms = self.measurer.measure(ref_bytes).score_ms
                ref_screen = self.measurer.screen(ref_bytes).score_ms
            self.measurements += 1
            study.set_user_attr("reference_ms", ref_ms)
            study.set_user_attr("reference_screen_ms", ref_screen)
        ref_ms = study.user_attrs["reference_ms"]
        ref_screen = study.user_attrs.get("reference_screen_ms")
        self.mcache.put(ref_plan.key, {"latency_ms": ref_ms, "ratio": 1.0, "reference": True})

        budget = cfg.schemes_per_region
        distinct = self._distinct_schemes(pp, exporter, base)
        if distinct is not None:
            budget = min(budget, distinct)

        def objective(trial: optuna.Trial) -> float:
            if not self._claim_slot(study, trial.number, budget):
                trial.set_user_attr("skipped", "the budget was filled by other workers")
                study.stop()
                raise optuna.TrialPruned("the budget was filled by other workers")
            params = {pid: trial.suggest_int(pid, 0, 1) for pid in pp.ids}
            on = [p for p, v in params.items() if v]
            plan = exporter.plan(base | pp.uses(on))
            trial.set_user_attr("scheme", on)
            trial.set_user_attr("plan_key", plan.key)
            trial.set_user_attr("qdq_count", len(plan))
            trial.set_user_attr("tensors", sorted({u[0] for u in pp.uses(on)}))
            try:
                latency, record = self._compare(exporter, plan, ref_bytes, ref_ms, ref_screen)
            except BackendError as exc:
                trial.set_user_attr("failure", str(exc)[:2000])
                trial.set_user_attr("transient", bool(getattr(exc, "transient", False)))
                raise
            trial.set_user_attr("measurement", record)
            return latency

        counter = optuna.study.MaxTrialsCallback(budget, states=(TrialState.COMPLETE,))

        def stop_on_failures(study: optuna.Study, trial) -> None:
            fails = len(study.get_trials(deepcopy=False, states=(TrialState.FAIL,)))
            if fails >= max(5, budget):
                study.stop()

        bar = None
        if self.o.progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=budget, desc=f"{pp.pattern.id} ({len(pp.pattern.regions)} regions, "
                       f"{len(pp.ids)} points)", leave=False, unit="trial")
            bar.update(len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))))

        def progress(study: optuna.Study, trial) -> None:
            if bar is not None and trial.state == TrialState.COMPLETE:
                bar.update(1)
                with contextlib.suppress(ValueError):
                    bar.set_postfix(best=f"{study.best_value:.3f}ms", ref=f"{ref_ms:.3f}ms")

        done = len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))
        try:
            if done < budget:
                study.optimize(
                    objective, callbacks=[counter, stop_on_failures, progress],
                    timeout=self._remaining(), catch=(BackendError,),
                    gc_after_trial=False,
                )
        finally:
            if bar is not None:
                bar.close()
        if self._remaining() is not None and self._remaining() <= 0:
            done = len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))
            if done < budget:
                raise _OutOfTime()
        return self._commit(study, pp, exporter, base, ref_plan, ref_bytes, ref_ms)

    def _claim_slot(self, study: optuna.Study, number: int, budget: int) -> bool:
        """Whether trial ``number`` may be measured: fewer than ``budget`` trials are COMPLETE or
        RUNNING ahead of it (lower number). Without this, workers sharing a study each finish
        their running trial after the last slot was taken and the study overshoots its budget.
        A trial without a slot waits while a trial ahead of it may still fail and free one."""
        while True:
            trials = study.get_trials(deepcopy=False,
                                      states=(TrialState.COMPLETE, TrialState.RUNNING))
            done = sum(1 for t in trials if t.state == TrialState.COMPLETE)
            ahead = sum(1 for t in trials if t.state == TrialState.RUNNING and t.number < number)
            if done + ahead < budget:
                return True
            remaining = self._remaining()
            if done >= budget or (remaining is not None and remaining <= 0):
                return False
            optuna.storages.fail_stale_trials(study)  # a dead worker's trial frees its slot
            time.sleep(SLOT_POLL_S)

    def _commit(self, study, pp, exporter, base, ref_plan, ref_bytes, ref_ms) -> dict:
        if "committed" in study.user_attrs:  # another worker committed this pattern already
            return dict(study.user_attrs)
        complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        empty = dict.fromkeys(pp.ids, 0)
        decision = {"committed": empty, "gain": 1.0, "reason": "no trial beat the reference"}
        if complete:
            best = min(complete, key=lambda t: (t.value, t.number))
            plan = exporter.plan(base | pp.uses([p for p, v in best.params.items() if v]))
            if plan.key == ref_plan.key:
                decision["reason"] = "best scheme is the reference"
            elif best.value < ref_ms / self.cfg.performance_threshold:
                cmp = self.measurer.compare(exporter.to_bytes(plan), ref_bytes)
                self.measurements += 1
                speedup = 1.0 / cmp.ratio
                confirmed = speedup >= self.cfg.performance_threshold and (
                    self.measurer.deterministic or cmp.ci_high < 1.0
                )
                decision = {
                    "committed": {p: int(best.params.get(p, 0)) for p in pp.ids} if confirmed else empty,
                    "gain": speedup if confirmed else 1.0,
                    "candidate_trial": best.number,
                    "confirmation": {"ratio": cmp.ratio, "ci": [cmp.ci_low, cmp.ci_high],
                                     "rounds": cmp.rounds, "speedup": speedup},
                    "reason": "confirmed" if confirmed else
                              f"re-measured speedup {speedup:.3f} below threshold "
                              f"{self.cfg.performance_threshold} or not significant",
                }
            else:
                decision["reason"] = (f"best {best.value:.4f} ms not {self.cfg.performance_threshold}x "
                                      f"faster than reference {ref_ms:.4f} ms")
        for k, v in decision.items():
            study.set_user_attr(k if k != "reason" else "commit_reason", v)
        from .dashboard import save_pattern_note

        save_pattern_note(study)
        return dict(study.user_attrs)

    def _remaining(self) -> float | None:
        if self.o.timeout is None:
            return None
        return self.o.timeout - (time.monotonic() - self.started)

    # -- the run ---------------------------------------------------------------------------
    def run(self) -> TuneResult:
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
        empty_plan = exporter.plan(set())
        attrs = self.run_study.user_attrs
        if "baseline_latency_ms" not in attrs:
            self.measurer.warm_up([exporter.to_bytes(empty_plan)])
            base_ms, record = self._measure_plan(exporter, empty_plan)
            self.run_study.set_user_attr("baseline_latency_ms", base_ms)
            self.run_study.set_user_attr("baseline_measurement", record)
        self.baseline_ms = self.run_study.user_attrs["baseline_latency_ms"]
        self._write_state("running")

        patterns = self.prepared.tunable
        bar = None
        if self.o.progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(patterns), desc="patterns", unit="pattern")
        try:
            for idx, pp in enumerate(patterns):
                base, _ = self._committed()
                self._tune_pattern(pp, idx, exporter, base, cache, baseline_q, bar)
                self._write_state("running")
                if bar is not None:
                    bar.update(1)
        except _OutOfTime:
            self._write_state("timeout")
            return self._finish(exporter, partial=True)
        finally:
            if bar is not None:
                bar.close()
        return self._finish(exporter, partial=False)

    def _finish(self, exporter, partial: bool) -> TuneResult:
        from .report import build_report, write_reports

        uses, rows = self._committed()
        final_exporter = self.prepared.exporter(self._scales("final"), self.cfg)
        plan = final_exporter.plan(uses)
        optimized = final_exporter.to_model(plan)
        import onnx

        onnx.checker.check_model(optimized)
        atomic_write_bytes(self.out / "optimized.onnx", optimized.SerializeToString())
        final_bytes = optimized.SerializeToString()
        base_bytes = final_exporter.to_bytes(final_exporter.plan(set()))
        cmp = self.measurer.compare(final_bytes, base_bytes)
        self.measurements += 1
        report = build_report(self, plan, cmp, rows, partial=partial)
        write_reports(self.out, report)
        self._write_pattern_cache()
        self._write_state("timeout" if partial else "done")
        return TuneResult(self.out, report)

    def _write_pattern_cache(self) -> None:
        cache = PatternCache()
        for pp in self.prepared.tunable:
            try:
                s = optuna.load_study(study_name=self._study_name(pp), storage=self.storage)
            except KeyError:
                continue
            schemes = [
                ([p for p, v in t.params.items() if v], t.value)
                for t in s.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            ]
            if schemes:
                cache.add(pp.pattern.signature, schemes,
                          minimum_distance=self.cfg.pattern_cache_minimum_distance,
                          max_entries=self.cfg.pattern_cache_max_entries_per_pattern)
        cache.save(self.out / "pattern_cache.yaml")

    def _write_state(self, status: str) -> None:
        patterns = []
        for pp in self.prepared.tunable:
            row = {"id": pp.pattern.id, "signature": pp.pattern.signature,
                   "regions": len(pp.pattern.regions), "points": len(pp.ids), "status": "pending"}
            with contextlib.suppress(KeyError):
                s = optuna.load_study(study_name=self._study_name(pp), storage=self.storage)
                a = s.user_attrs
                row["trials"] = len(s.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))
                row["status"] = "committed" if "committed" in a else "running"
                if "committed" in a:
                    row["committed"] = sorted(p for p, v in a["committed"].items() if v)
                    row["gain"] = round(float(a.get("gain", 1.0)), 4)
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


def _enqueue_redo(study: optuna.Study, params: dict) -> None:
    """Enqueue a failed trial's scheme again. ``enqueue_trial(skip_if_exists=True)`` would
    match the failed trial itself and never redo it; only a live or finished trial with the
    same params makes the redo unnecessary."""
    if not params:
        return
    for t in study.get_trials(deepcopy=False, states=(TrialState.WAITING, TrialState.RUNNING,
                                                      TrialState.COMPLETE)):
        if t.system_attrs.get("fixed_params", t.params) == params:
            return
    study.enqueue_trial(params)


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


def _isfinite(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)
