"""A tuning run, phase by phase: open -> baseline -> starts -> descent -> finish, on what
:mod:`~qdq_optuna.search._prepare` prepared (the options, backend, profile, model and data).

* **open**: the storage and the run record, opened by :func:`~qdq_optuna.search._prepare.open_run`
  (settings that differ from a stored run's are refused, and so is a run of the earlier
  pattern-by-pattern search; the user's seeds loaded); scales, the error scorer, the plan
  measurer and the guard are set up;
* **baseline**: the user's model as given (with ``--high-precision fp16/bf16``: converted to
  that precision, no Q/DQ), measured once for all workers: every speedup is against it;
* **starts** (:mod:`~qdq_optuna.search._starts`): whole-model placements measured and checked
  by the accuracy guard; the fastest feasible one becomes the standing model;
* **descent** (:mod:`~qdq_optuna.search._descent`): rounds over the patterns, each visit tuned
  against the whole standing model, from the chosen start and, when it is close, from the
  runtime's recipe too (each such *lane* is a descent of its own);
* **conclude**: the best lane's standing model guarded and saved, and its independent A/B
  against the baseline: a :class:`~qdq_optuna.search._options.SearchOutcome`, which
  :func:`qdq_optuna.outputs.write.write_outputs` turns into the report (the search imports no
  output module; :mod:`qdq_optuna._tune` runs prepare -> search -> write outputs);
* **close**: the pattern cache, ``state.yaml`` and the finished mark, once the report is written.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial

import onnx

from qdq_optuna._progress import Progress
from qdq_optuna.errors import ToolError, UserError, interrupted_by, interrupting_signal
from qdq_optuna.measure.timing import Until
from qdq_optuna.model.data import describe_model
from qdq_optuna.model.graph import InputShapes
from qdq_optuna.placement.export import QDQExporter, Scales, plan_uses
from qdq_optuna.placement.points import PatternPoints
from qdq_optuna.placement.scheme import compute_inputs_scheme
from qdq_optuna.placement.seeds import PatternCache, baseline_seed
from qdq_optuna.record import (
    Agreed,
    AgreedStarts,
    RunRecord,
    release,
    write_pattern_cache,
    write_state,
)
from qdq_optuna.runtimes import Runtime
from qdq_optuna.runtimes.prepared import PreparedModel
from qdq_optuna.search._commit import CommitRule
from qdq_optuna.search._descent import Descent
from qdq_optuna.search._guard import check_default_session
from qdq_optuna.search._lanes import final_lane
from qdq_optuna.search._options import (
    SearchOutcome,
    StoppedOutcome,
    TuneOptions,
)
from qdq_optuna.search._pattern import OutOfTime, Search, Seed
from qdq_optuna.search._prepare import OpenedRun, PreparedRun
from qdq_optuna.search._recipe_file import (
    RecipeFile,
    conclude_recipe_files,
    shipped_accuracy,
    shipped_recipe_file,
)
from qdq_optuna.search._starts import StartsPhase
from qdq_optuna.search._workers import Workers
from qdq_optuna.search.samplers import is_ours, sampler_name
from qdq_optuna.wall_time import WallTime

log = logging.getLogger("qdq_optuna")

#: ``--timeout``: the share of the timeout the conclusion may keep at most; the search stops
#: that much earlier. Inception v1 (300 s) once concluded 560 s past its deadline.
CONCLUSION_SHARE = 0.15
#: the conclusion's rounds (two sessions each) it is sized to: the final A/B's 8, and the
#: lanes' and the recipe file's A/Bs at about their minimum
CONCLUSION_ROUNDS = 16


class Tuner:
    """Runs (or resumes) one tuning run; see :func:`qdq_optuna.tune`."""

    def __init__(self, run: PreparedRun) -> None:
        """``run``: what :mod:`~qdq_optuna.search._prepare` prepared (the search prepares
        nothing itself: it opens the run's storage through :func:`open_run` too)."""
        self.run = run
        self.o, self.cfg, self.out = run.options, run.options.config, run.out
        #: every file the run leaves there (the search names none)
        self.folder = run.folder
        #: the runtime's profile, chosen once (rules, defaults, recipe, how the guard runs)
        self.backend, self.profile, self.prepared = run.backend, run.profile, run.prepared
        self.calibration, self.validation = run.calibration, run.validation
        self.measurer, self.settings = run.measurer, run.settings
        self.run_id, self.storage_url = run.run_id, run.storage_url
        self.started = time.monotonic()
        #: where the wall time went, phase by phase (preparing's steps already in)
        self.wall = run.wall
        self.fingerprint_digest: str | None = None
        self.record: RunRecord | None = None  # these four once the run is open
        self.search_state: Search | None = None
        self.cache: PatternCache | None = None
        self.baseline_q: set[str] | None = None
        self._calibrated: dict | None = None
        self._reader_clipped = 0
        self._baseline: tuple | None = None
        #: the report, state.yaml and the finished mark are written (a signal after this
        #: leaves them as they are)
        self.closed = False
        #: the agreed starts, once decided
        self.starts: AgreedStarts | None = None
        self.descent: Descent | None = None
        #: phase -> seconds from this process's start to the phase's end (the report's
        #: ``elapsed_s``: when the standing model was known, when the descent ended)
        self.elapsed: dict[str, float] = {}
        #: seconds of ``--timeout`` kept for the conclusion (:func:`conclusion_reserve`)
        self.reserve = 0.0
        #: called with (study, pattern) after each stored decision (given by the caller: the
        #: dashboard's pictures, see :mod:`qdq_optuna._tune`)
        self.on_commit: list[Callable] = []

    def remaining(self) -> float | None:
        """Seconds the search has left: ``--timeout`` less what the conclusion keeps."""
        if self.o.timeout is None:
            return None
        return self.o.timeout - self.reserve - (time.monotonic() - self.started)

    def _deadlines(self, concluding: bool) -> None:
        """``--timeout``: measurements take their minimum rounds past the search's deadline
        (the conclusion's: the timeout itself), and the conclusion's share is sized to what
        a round of this model cost (:func:`conclusion_reserve`)."""
        if self.o.timeout is None:
            return
        if not concluding:
            self.reserve = conclusion_reserve(self.o.timeout, self.measurer.session_s)
        self.search_state.plans.set_deadline(
            self.started + self.o.timeout - (0.0 if concluding else self.reserve))

    # -- the run ---------------------------------------------------------------------------
    @contextmanager
    def session(self) -> Iterator[Tuner]:
        """Progress output for the run; on Ctrl-C no trial of ours stays RUNNING; the
        backend's worker process (ours) stops at the end. A run that fails before its first
        measurement leaves no files behind (a resumed run's earlier files stay)."""
        before = self.folder.listing()
        failed_unmeasured = False
        try:
            with Progress(self.o.progress) as progress:
                self.progress = progress
                yield self
        except KeyboardInterrupt as exc:
            self._interrupted(exc)
            raise
        except Exception as exc:
            if not interrupted_by(exc):
                failed_unmeasured = (self.search_state is None
                                     or self.search_state.baseline_ms is None)
                raise
            self._interrupted(exc)
            raise KeyboardInterrupt from exc
        finally:
            if isinstance(self.o.backend, str):  # ours: stop its worker process now
                self.backend.close()
            if self.record is not None:  # a SQLite log folded into its file
                release(self.record.storage)
            if failed_unmeasured:  # after its storage let go of its files
                self.folder.remove_new(before)

    def open(self, opened: OpenedRun) -> dict | None:
        """Take the opened run (:func:`~qdq_optuna.search._prepare.open_run`); a run that
        finished with these settings returns its stored report (nothing is measured again),
        else None."""
        self._open(opened)
        return None if self.o.remeasure else self._finished_report()

    def search(self) -> SearchOutcome:
        """Baseline, starts, descent and the conclusion: what ships, measured."""
        search = self.search_state
        search.wall = self.wall
        self.wall.lap("preparing")
        self._say_resuming()
        search.baseline_ms = self._measure_baseline(search)
        self._mark("baseline")
        self._write_state("running")
        try:
            self.starts = self._starts(search)
            self._mark("starts")
            # the starts' A/Bs run whole: cut short, none confirmed a quantized start and a
            # YOLOv8n run with --timeout 60 shipped float (1.04x) instead of "all" (1.87x)
            self._deadlines(concluding=False)
            self._write_state("running")
            self._write_standing(self.starts.order[0])
            if self.starts.forward is not None:
                # the forward search found the most speed within the bound (or none): a
                # descent from it would A/B near-float models until the timeout
                self.progress.write(f"forward search: {self.starts.forward['why']}")
            else:
                self.descent = Descent(search, rounds=self.settings.rounds,
                                       lanes=self.starts.order, cache=self.cache,
                                       seeds=self._seeds, on_change=self._write_standing)
                self.descent.run()
            self._mark("descent")
        except OutOfTime:
            self._mark("descent")
            self._write_state("timeout")
            return self._conclude(partial=True)
        return self._conclude(partial=False)

    def _open(self, opened: OpenedRun) -> Search:
        """The run record and what the pattern studies share."""
        self.record, self.fingerprint_digest = opened.record, opened.fingerprint_digest
        self.cache, self.baseline_q = opened.cache, opened.baseline_q
        self._calibrated = opened.scales
        self._reader_clipped = opened.reader_clipped_ranges
        self.search_state = Search(
            prepared=self.prepared, exporter=opened.exporter, settings=self.settings,
            config=self.cfg, record=self.record, rule=CommitRule(self.cfg.performance_threshold),
            sampler=self.o.sampler, seed=self.o.seed, plans=opened.plans,
            workers=Workers(self.record, worker=self.o.worker, remaining=self.remaining),
            progress=self.progress, remaining=self.remaining, guard=opened.guard,
            on_commit=self.on_commit, kernel_timing=self.profile.kernel_timing(self.backend),
            kernel_cache=self.o.kernel_cache)
        return self.search_state

    def _say_resuming(self) -> None:
        """A resumed run says so: what is done and what is left."""
        line = self.record.resume_line(self.settings.rounds, remeasure=self.o.remeasure)
        if line:
            self.progress.write(line)

    # -- the baseline ----------------------------------------------------------------------
    def baseline_source(self) -> tuple[object, str, str]:
        """What every speedup is measured against: ``(source, memo key, description)``: the
        user's model as given, or converted to the run's high precision (no Q/DQ)."""
        if self._baseline is None:
            exporter = self.search_state.exporter
            hp = self.prepared.high_precision
            if hp is not None:
                data = hp.model.SerializeToString()
                self._baseline = (data, "baseline:" + _sha(data),
                                  f"the user's model converted to {hp.precision} (no Q/DQ)")
            elif self.prepared.preprocess == "none":  # the graph searched on is the model
                plan = exporter.plan(set())
                self._baseline = (exporter.source(plan), plan.key, "the user's model as given")
            else:  # ONNX Runtime's preprocessing changed the graph: the user's file
                data = user_model(self.o.model, self.o.input_shapes).SerializeToString()
                self._baseline = (data, "baseline:" + _sha(data), "the user's model as given")
        return self._baseline

    def _measure_baseline(self, search: Search) -> float:
        """The baseline's latency, measured once for all workers."""
        source, key, what = self.baseline_source()
        return self.record.baseline(lambda: search.plans.baseline(
            source, key, self.settings.backend, describe_model(self.o.model)), what)

    # -- starts ----------------------------------------------------------------------------
    def _starts(self, search: Search) -> AgreedStarts:
        keep = (partial(self.folder.keep, self.folder.recipe_file(self.profile.name))
                if self.profile.has_recipe_file else None)
        recipe = partial(recipe_start, self.prepared, self.o, self.profile, self.calibration, keep,
                         wall=self.wall)
        return StartsPhase(search, mode=self.settings.start, recipe=recipe,
                           seeds=self._seed_starts, worker=self.o.worker,
                           baseline=self.baseline_source()[0]).run()

    def _seed_starts(self) -> list:
        """The user's seeds as starts: ``--qdq-baseline``, ``--pattern-cache``."""
        from qdq_optuna.placement import starts

        found = []
        dynamic = starts.dynamic_start(self.prepared)  # the dynamic mode searched: its recipe
        if dynamic is not None:
            found.append(dynamic)
        if self.o.qdq_baseline:
            found.append(starts.baseline_start(self.prepared, self.o.qdq_baseline))
        if self.cache is not None:
            cached = starts.cache_start(self.prepared, self.cache)
            if cached is not None:
                found.append(cached)
        return found

    def _seeds(self, pp: PatternPoints) -> list[Seed]:
        """Two objectives: one pass from float whose studies try these first: the empty scheme
        (samplers other than ours, which proposes it itself), the user's seeds, then the
        classic recipe (ours)."""
        space = self.settings.space
        seeds = []
        if not is_ours(self.o.sampler):
            seeds.append(Seed(space.seed(dict.fromkeys(pp.ids, 0))))
        if self.cache is not None:
            seeds += [Seed(space.seed(s)) for s in self.cache.seeds_for(pp)]
        if self.baseline_q:
            s = baseline_seed(pp, self.baseline_q)
            if s is not None:
                seeds.append(Seed(space.seed(s)))
        if is_ours(self.o.sampler) and self.cfg.seed_compute_inputs:  # after user seeds
            compute = compute_inputs_scheme(pp)
            if compute is not None:
                seeds.append(Seed(space.seed(compute)))
        return seeds

    def _mark(self, phase: str) -> None:
        self.elapsed[phase] = round(time.monotonic() - self.started, 1)
        self.wall.lap(phase)

    # -- finish ----------------------------------------------------------------------------
    def _conclude(self, partial: bool) -> SearchOutcome:
        """The lane that ships, guarded and saved as ``optimized.onnx``, and its independent
        A/B against the baseline (the multi-objective front is measured by the outputs)."""
        plans = self.search_state.plans
        self._deadlines(concluding=True)
        lane = final_lane(self.search_state, self.starts or self.record.starts(), partial)
        self._mark("lanes")  # the conclusion's steps too: where the time after a deadline goes
        uses, rows = self.record.committed(lane)
        final_exporter = self.prepared.exporter(self._scales("final"), self.cfg)
        guard = self.search_state.guard
        verdict = guard.ship(guard.exporter.plan(plan_uses(final_exporter.plan(uses))),
                             self.prepared.high_precision.precision
                             if self.prepared.high_precision else "fp32")
        plan = final_exporter.plan(plan_uses(verdict.plan))  # what ships
        final_bytes = self._save_final(guard.shipped_exporter(final_exporter), plan)
        corrected = guard.correction_keys(plan)
        self._mark("guard")
        plan, final_bytes, recipe_files = conclude_recipe_files(
            run_recipe_files(self), plan, final_bytes, final_exporter)
        self._mark("recipe_file")
        base_bytes, base_key, _ = self.baseline_source()
        cmp = (plans.same_model(final_bytes, "final") if plan.key == base_key  # no Q/DQ added
               else plans.compare(final_bytes, base_bytes, "final", until=Until.PRECISION))
        self._mark("final")
        kept = None
        if cmp.verdict == "slower" and isinstance(base_bytes, bytes) \
                and not self.settings.multi_objective:
            kept, plan, final_bytes, cmp, verdict = self._keep_users_model(cmp, final_exporter)
        evaluator = plans.scorer.evaluator
        accuracy = shipped_accuracy(guard.report_keys(
            verdict, scored_as=self.profile.scored_as(plans.scorer.bf16, evaluator.optimize,
                                             evaluator.runner)), recipe_files)
        if kept is not None:
            accuracy["kept_your_model"] = kept
        elif shipped_recipe_file(recipe_files) is None:  # the guard's plan ships
            accuracy["accuracy"]["sensitivity"] = guard.sensitivity(verdict.plan, self._in_time)
        if guard.corrected is not None:  # what ships: the recipe file, or no Q/DQ, has none
            accuracy["accuracy"]["bias_correction"] = (
                corrected if kept is None and shipped_recipe_file(recipe_files) is None
                else {"applied": False})
        check_default_session(accuracy["accuracy"], plans.scorer, final_bytes)
        if self.settings.accuracy:  # the accuracy modes' keys, as before
            accuracy.update({"objectives": list(self.settings.objectives),
                             "error_measure": guard.bound.label,
                             "max_output_error": guard.bound.trial_budget})
        self._mark("finish")
        return SearchOutcome(
            out=self.out, header=self._header(), record=self.record, plans=plans,
            prepared=self.prepared, backend=self.backend, lane=lane,
            descent=self.descent.findings(final_bytes if isinstance(final_bytes, bytes) else None)
            if self.descent is not None else None,
            rows=rows, plan=plan, exporter=final_exporter, final_bytes=final_bytes,
            baseline_bytes=base_bytes, comparison=cmp, baseline_ms=self.search_state.baseline_ms,
            accuracy=accuracy, partial=partial, multi_objective=self.settings.multi_objective,
            elapsed=dict(self.elapsed), wall_time=self.wall, **read_what_ran(self.profile, self.backend, final_bytes))

    def _in_time(self) -> bool:
        """Whether the run's ``--timeout`` (the conclusion's deadline) has not passed."""
        return self.o.timeout is None or time.monotonic() < self.started + self.o.timeout

    def stopped(self, signum: int) -> StoppedOutcome | None:
        """What the run knows when a signal stops it (read from the storage, nothing
        measured); None before the run was opened (its earlier files stand)."""
        search = self.search_state
        if self.record is None or search is None:
            return None
        starts = self.starts or self.record.starts()
        lane = starts.order[0] if starts is not None else ""
        rows = self.record.committed(lane)[1] if starts is not None else []
        return StoppedOutcome(out=self.out, header=self._header(), record=self.record,
                              signum=signum, lane=lane, rows=rows,
                              baseline_ms=search.baseline_ms,
                              measurements=search.plans.measurements,
                              by_phase=dict(search.plans.by_phase), elapsed=dict(self.elapsed))

    def _keep_users_model(self, cmp, final_exporter):
        """The search's model measured slower than the baseline (the user's model, or its
        high-precision conversion; a graph the preprocessing or the opset upgrade made slower
        can do that): the baseline ships instead, re-measured the same way, and the report
        says what the tuned model measured."""
        source, _, what = self.baseline_source()
        log.warning("the tuned model measured %.3fx the latency of %s (95%% interval %.3f-%.3f): "
                    "optimized.onnx is that model instead", cmp.ratio, what, cmp.ci_low,
                    cmp.ci_high)
        self.folder.write_optimized(source)
        kept = {"baseline_model": what, "tuned_comparison": cmp.to_dict()}
        plans, guard = self.search_state.plans, self.search_state.guard
        plan = final_exporter.plan(set())
        cmp = plans.same_model(source, "final")
        verdict = guard.ship(guard.exporter.plan(set()), self.prepared.high_precision.precision
                             if self.prepared.high_precision else "fp32")
        return kept, plan, source, cmp, verdict

    def close(self, outcome: SearchOutcome, report: dict) -> None:
        """After the report is written: the pattern cache, ``state.yaml`` and (a complete run)
        the finished mark that a rerun with the same settings returns."""
        write_pattern_cache(
            self.record, self.folder,
            minimum_distance=self.cfg.pattern_cache_minimum_distance,
            max_entries=self.cfg.pattern_cache_max_entries_per_pattern, lane=outcome.lane)
        self._write_state("timeout" if outcome.partial else "done")
        if not outcome.partial:
            self.record.mark_finished(self.fingerprint_digest, report)
        self.closed = True

    def _finished_report(self) -> dict | None:
        """The report of this run when it finished with these settings and this output
        folder holds that report and its model (a worker's own folder may not: it finishes)."""
        done = self.record.finished()
        if done is None or done.fingerprint != self.fingerprint_digest:
            return None
        text = self.folder.finished_report(done.report_sha256)
        if text is None:
            return None
        log.info("run %r finished on %s (speedup %.3fx): its report stands; --remeasure "
                 "measures the final model again, --fresh starts over", self.run_id,
                 done.at, done.speedup or float("nan"))
        return json.loads(text)

    def _write_standing(self, lane: str) -> None:
        """The anytime result (:meth:`RunFolder.save_standing`), for the first lane (the fastest start)."""
        if self.starts is not None and lane == self.starts.order[0] \
                and not self.settings.multi_objective:
            exporter = self.prepared.exporter(self._scales("final"), self.cfg)
            guard = self.search_state.guard if self.search_state is not None else None
            self.folder.save_standing(guard.shipped_exporter(exporter) if guard else exporter,
                                      self.record.standing_uses(lane))

    def _save_final(self, exporter: QDQExporter, plan) -> bytes:
        """Write ``optimized.onnx``; returns what the final comparison times."""
        return self.folder.save_optimized(exporter, plan)

    def _header(self) -> dict:
        """The report's first fields: what was tuned, where, how."""
        return {"model": self.prepared.source, "output": str(self.out), "run_id": self.run_id,
                "storage": self.storage_url, "backend": self.backend.describe(),
                "runtime": self.settings.runtime, "quant_type": self.prepared.quant_type,
                "sampler": sampler_name(self.o.sampler), "timing": self.o.timing,
                "scales": self.settings.scales.value, "reader_clipped_ranges": self._reader_clipped,
                "high_precision": high_precision_summary(self.prepared)}

    # -- scales and errors -----------------------------------------------------------------
    def _scales(self, purpose: str) -> dict | None:
        """Calibrated activation scales, as the run was opened with (None: the default scale
        inside trials)."""
        if purpose == "trials" and self.settings.scales is Scales.DEFAULT:
            return None
        return self._calibrated

    # -- state -----------------------------------------------------------------------------
    def _write_state(self, status: str) -> None:
        plans = self.search_state.plans if self.search_state is not None else None
        order = self.starts.order if self.starts is not None else None
        write_state(self.record, self.out, status, {
            "storage": self.storage_url,
            "fingerprint": self.fingerprint_digest,
            "baseline_latency_ms": self.search_state.baseline_ms if self.search_state is not None else None,
            "measurements": plans.measurements if plans is not None else 0,
            "cache_hits": plans.cache_hits if plans is not None else 0,
        }, lane=order[0] if order else None)

    def _interrupted(self, exc: BaseException) -> None:
        """Ctrl-C (SIGTERM, SIGHUP): no trial of ours stays RUNNING, and state.yaml says how
        to resume (a run already closed keeps its state: it finished)."""
        signum = interrupting_signal(exc)
        if self.search_state is not None and self.search_state.workers is not None:
            self.search_state.workers.interrupted(
                None if signum in (None, signal.SIGINT) else signal.Signals(signum).name)
        if self.record is not None and not self.closed:
            try:
                self._write_state("interrupted")
            except Exception:  # the storage may be gone; the message still says how to resume
                log.debug("state.yaml not written", exc_info=True)


def conclusion_reserve(timeout: float, session_s: float | None) -> float:
    """Seconds of ``timeout`` the conclusion keeps (which lane ships, the recipe file's A/Bs,
    the final A/B): :data:`CONCLUSION_ROUNDS` rounds of two sessions as long as the last one
    measured, at most :data:`CONCLUSION_SHARE` of the timeout (that share when nothing was
    measured yet)."""
    share = CONCLUSION_SHARE * timeout
    return share if session_s is None else min(share, CONCLUSION_ROUNDS * 2 * session_s)


def run_recipe_files(tuner: Tuner) -> list[RecipeFile]:
    """The run's recipe files, as the profile lists them (none for two objectives: a front
    has no one model to match)."""
    if tuner.settings.multi_objective:
        return []
    o, calibration = tuner.o, tuner.calibration
    data = calibration[0] if calibration else None
    return [RecipeFile(tuner.search_state, tuner.folder, tuner.folder.recipe_file(spec.name),
                       partial(spec.make, o.model, input_shapes=o.input_shapes, data=data),
                       name=spec.name, tool=spec.tool, placement=spec.placement,
                       agreed=Agreed.RECIPE_FILE if i == 0 else Agreed.recipe_file(spec.name))
            for i, spec in enumerate(tuner.profile.recipe_files())]


def recipe_start(pm: PreparedModel, options: TuneOptions, profile: Runtime, calibration,
                 keep: Callable[[bytes], None] | None = None, wall: WallTime | None = None):
    """The runtime's classic recipe as a start (None when it cannot be made); ``keep``: the run
    folder's writer its own file is handed to as the tool wrote it; ``wall``: its time is the
    starts' "recipe" step."""
    try:
        with (wall or WallTime()).step("starts", "recipe"):
            return profile.recipe_start(pm, options.model, input_shapes=options.input_shapes,
                                        data=calibration[0] if calibration else None,
                                        keep=keep)
    except ToolError as exc:  # the quantizer refused this model: no recipe start
        log.warning("%s; starting without the recipe", exc)
        return None
    except UserError:
        raise
    except Exception as exc:  # the quantizer failed on this model: no recipe start
        log.warning("the %s recipe could not be made for this model (%s: %s); starting "
                    "without it", profile.name, type(exc).__name__, exc)
        return None


def read_what_ran(profile: Runtime, backend, model) -> dict:
    """What the runtime ran for the shipped model, read by its profile (``what_ran``), or
    why it could not be (``what_ran_error``: the report still ships without it)."""
    try:
        return {"what_ran": profile.what_ran(backend, model) if isinstance(model, bytes)
                else None}
    except Exception as exc:  # the report still ships without it
        return {"what_ran_error": str(exc)}


def high_precision_summary(prepared: PreparedModel) -> dict:
    """report.json's ``high_precision``: the float part's precision, whether the graph's
    inputs and outputs kept their types, the opsets and the nodes kept FP32 (with why)."""
    hp = prepared.high_precision
    if hp is None:
        return {"precision": "fp32", "keep_io_types": True, "kept_fp32": {}}
    return hp.describe()


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:24]


def user_model(model: str | os.PathLike | onnx.ModelProto, input_shapes: str | None
               ) -> onnx.ModelProto:
    """The user's model as given (its weights in memory), with ``--input-shapes`` applied:
    the baseline when ONNX Runtime's preprocessing changed the graph the search works on."""
    from qdq_optuna.model.graph import add_shapes_by_running, apply_input_shapes

    if isinstance(model, onnx.ModelProto):
        proto = onnx.ModelProto()
        proto.CopyFrom(model)
    else:
        proto = onnx.load(str(model))
    for vi in proto.graph.input:  # a stored dim <= 0 is symbolic (paddle2onnx writes -1)
        for d in vi.type.tensor_type.shape.dim:
            if d.HasField("dim_value") and d.dim_value <= 0:
                d.ClearField("dim_value")
    apply_input_shapes(proto, InputShapes.parse(input_shapes), "<model>")
    del proto.graph.value_info[:]  # inferred again by the runtime, from the fixed inputs
    # ... except where static inference cannot (a Reshape to a computed shape, as paddle2onnx
    # writes): the cost model reads shapes from the file alone
    add_shapes_by_running(proto)
    return proto
