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
  against the baseline (two objectives: then the latency/error front,
  :mod:`~qdq_optuna.search._pareto`): a :class:`~qdq_optuna.search._outcome.SearchOutcome`, which
  :func:`qdq_optuna.outputs.write.write_outputs` turns into the report (the search imports no
  output module; :mod:`qdq_optuna._tune` runs prepare -> search -> write outputs);
* **close**: the pattern cache, ``state.yaml`` and the finished mark, once the report is written.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial

from qdq_optuna.errors import ToolError, interrupting_signal
from qdq_optuna.model.data import describe_model
from qdq_optuna.placement.points import PatternPoints
from qdq_optuna.placement.seeds import PatternCache
from qdq_optuna.record import (
    Agreed,
    AgreedStarts,
    RunRecord,
    release,
    write_pattern_cache,
    write_state,
)
from qdq_optuna.search._conclusion import (
    baseline_of,
    conclude,
    finished_report,
    read_what_ran,
    run_header,
    state_counters,
    stopped_outcome,
)
from qdq_optuna.search._descent import Descent
from qdq_optuna.search._lanes import final_lane
from qdq_optuna.search._outcome import (
    RunHeader,
    SearchOutcome,
    StoppedOutcome,
)
from qdq_optuna.search._pareto import with_measured_front
from qdq_optuna.search._pattern import OutOfTime, Search, Seed
from qdq_optuna.search._plans import measure_baseline
from qdq_optuna.search._prepare import OpenedRun, PreparedRun, search_context
from qdq_optuna.search._recipe_file import (
    RecipeFile,
)
from qdq_optuna.search._seeds import recipe_start, seed_starts, study_seeds
from qdq_optuna.search._session import run_session
from qdq_optuna.search._starts import StartsPhase
from qdq_optuna.search.samplers import is_ours

log = logging.getLogger("qdq_optuna")

#: ``--timeout``: the share of the timeout the conclusion may keep at most; the search stops
#: that much earlier. Inception v1 (300 s) once concluded 560 s past its deadline.
CONCLUSION_SHARE = 0.15
#: the conclusion's rounds (two sessions each) it is sized to: the final A/B's 8 and the
#: lanes' A/Bs at about their minimum, and :data:`FILE_ROUNDS` per recipe file
CONCLUSION_ROUNDS = 14
#: a recipe file's A/B runs to its verdict past the deadline: three rounds when the file is
#: far off, six when it is not faster (the give-up point)
FILE_ROUNDS = 6


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
        #: calibrated activation scales, as the run was opened with (what ships is exported
        #: with them, whatever scales the trials use)
        self._calibrated: dict | None = None
        self._reader_clipped = 0
        #: what every speedup is against, ``(source, memo key, description)``
        #: (:func:`~qdq_optuna.search._conclusion.baseline_of`), once the search starts
        self.baseline: tuple[object, str, str] | None = None
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
        if self.o.timeout is not None:
            if not concluding:
                self.reserve = conclusion_reserve(self.o.timeout, self.measurer.session_s,
                                                  len(self.profile.recipe_files()))
            self.search_state.plans.set_deadline(
                self.started + self.o.timeout - (0.0 if concluding else self.reserve))

    # -- the run ---------------------------------------------------------------------------
    @contextmanager
    def session(self) -> Iterator[Tuner]:
        """Progress output for the run; on Ctrl-C no trial of ours stays RUNNING; the
        backend's worker process (ours) stops at the end. A run that fails before its first
        measurement leaves no files behind (a resumed run's earlier files stay)."""
        def measured() -> bool:
            return self.search_state is not None and self.search_state.baseline_ms is not None

        with run_session(show_progress=self.o.progress, folder=self.folder, measured=measured,
                         interrupted=self._interrupted, release=self._release) as progress:
            self.progress = progress
            yield self

    def _release(self) -> None:
        if isinstance(self.o.backend, str):  # ours: stop its worker process now
            self.backend.close()
        if self.record is not None:  # a SQLite log folded into its file
            release(self.record.storage)

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
        line = self.record.resume_line(self.settings.rounds, remeasure=self.o.remeasure)
        if line:  # a resumed run says so: what is done and what is left
            self.progress.write(line)
        self.baseline = source, key, what = baseline_of(
            self.prepared, search.exporter, self.o.model, self.o.input_shapes)
        search.baseline_ms = self.record.baseline(lambda: measure_baseline(
            search.plans, source, key, self.settings.backend, describe_model(self.o.model)),
            what)
        # every later session paced by it (alike in every worker: the stored figure)
        search.plans.measurer.pace(search.baseline_ms)
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
            descend(self, search)
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
        self.search_state = search_context(self.run, opened, progress=self.progress,
                                           remaining=self.remaining, on_commit=self.on_commit)
        return self.search_state

    # -- starts ----------------------------------------------------------------------------
    def _starts(self, search: Search) -> AgreedStarts:
        keep = (partial(self.folder.keep, self.folder.recipe_file(self.profile.name))
                if self.profile.has_recipe_file else None)
        recipe = partial(recipe_start, self.prepared, self.o, self.profile, self.calibration, keep,
                         wall=self.wall)
        return StartsPhase(search, mode=self.settings.start, recipe=recipe,
                           seeds=lambda: [*recipe_file_starts(self), *self._seed_starts()],
                           worker=self.o.worker, baseline=self.baseline[0]).run()

    def _seed_starts(self) -> list:
        return seed_starts(self.prepared, self.o.qdq_baseline, self.cache)

    def _seeds(self, pp: PatternPoints) -> list[Seed]:
        return study_seeds(pp, self.settings.space, ours=is_ours(self.o.sampler),
                           cache=self.cache, baseline_q=self.baseline_q,
                           compute_inputs=self.cfg.seed_compute_inputs)

    def _mark(self, phase: str) -> None:
        self.elapsed[phase] = round(time.monotonic() - self.started, 1)
        self.wall.lap(phase)

    # -- finish ----------------------------------------------------------------------------
    def _conclude(self, partial: bool) -> SearchOutcome:
        """The lane that ships, guarded, saved and A/B-tested; two objectives: the front, last."""
        self._deadlines(concluding=True)
        lane = final_lane(self.search_state, self.starts or self.record.starts(), partial)
        self._mark("lanes")  # the conclusion's steps too: where the time after a deadline goes
        search, descent = self.search_state, self.descent
        shipped = conclude(
            lane, record=self.record, plans=search.plans, guard=search.guard,
            final_exporter=self.prepared.exporter(self._calibrated, self.cfg),
            precision=self._precision(), recipe_files=run_recipe_files(self),
            baseline=self.baseline, folder=self.folder, profile=self.profile,
            settings=self.settings, in_time=self._in_time, mark=self._mark)
        findings = (descent.findings(shipped.final_bytes if isinstance(shipped.final_bytes, bytes)
                                     else None) if descent is not None else None)
        return with_measured_front(SearchOutcome(
            out=self.out, header=self._header(), record=self.record, plans=search.plans,
            prepared=self.prepared, backend=self.backend, lane=lane, descent=findings,
            rows=shipped.rows, plan=shipped.plan, exporter=shipped.exporter,
            final_bytes=shipped.final_bytes, baseline_bytes=self.baseline[0],
            comparison=shipped.comparison, baseline_ms=search.baseline_ms,
            accuracy=shipped.accuracy, partial=partial,
            multi_objective=self.settings.multi_objective, elapsed=dict(self.elapsed),
            wall_time=self.wall, session_settings=shipped.session.report(),
            **read_what_ran(self.profile, self.backend, shipped.final_bytes, shipped.session)))

    def _in_time(self) -> bool:
        """Whether the run's ``--timeout`` (the conclusion's deadline) has not passed."""
        return self.o.timeout is None or time.monotonic() < self.started + self.o.timeout

    def stopped(self, signum: int) -> StoppedOutcome | None:
        """What the run knows when a signal stops it (read from the storage, nothing
        measured); None before the run was opened (its earlier files stand)."""
        if self.record is None or self.search_state is None:
            return None
        return stopped_outcome(self.out, self._header(), self.record, self.search_state.plans,
                               self.starts or self.record.starts(), signum=signum,
                               baseline_ms=self.search_state.baseline_ms,
                               elapsed=self.elapsed)

    def _precision(self) -> str:
        """The run's high precision (named when even its float model drifts)."""
        hp = self.prepared.high_precision
        return hp.precision if hp else "fp32"

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
        return finished_report(self.record, self.folder, self.fingerprint_digest, self.run_id)

    def _write_standing(self, lane: str) -> None:
        """The anytime result (:meth:`RunFolder.save_standing`), for the first lane (the fastest start)."""
        if self.starts is not None and lane == self.starts.order[0] \
                and not self.settings.multi_objective:
            exporter = self.prepared.exporter(self._calibrated, self.cfg)
            guard = self.search_state.guard if self.search_state is not None else None
            self.folder.save_standing(guard.shipped_exporter(exporter) if guard else exporter,
                                      self.record.standing_uses(lane))

    def _header(self) -> RunHeader:
        """The report's first fields: what was tuned, where, how."""
        return run_header(self.prepared, self.backend, self.settings, self.o, out=self.out,
                          run_id=self.run_id, storage=self.storage_url,
                          reader_clipped=self._reader_clipped)

    # -- state -----------------------------------------------------------------------------
    def _write_state(self, status: str) -> None:
        search, order = self.search_state, self.starts.order if self.starts else None
        write_state(self.record, self.out, status, state_counters(
            self.storage_url, self.fingerprint_digest, search.baseline_ms if search else None,
            search.plans if search else None), lane=order[0] if order else None)

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


def conclusion_reserve(timeout: float, session_s: float | None, files: int = 1) -> float:
    """Seconds of ``timeout`` the conclusion keeps (which lane ships, the recipe files' A/Bs,
    the final A/B): :data:`CONCLUSION_ROUNDS` rounds and :data:`FILE_ROUNDS` per recipe file
    (``files``), of two sessions as long as the last one measured, at most
    :data:`CONCLUSION_SHARE` of the timeout (that share when nothing was measured yet)."""
    share = CONCLUSION_SHARE * timeout
    rounds = CONCLUSION_ROUNDS + FILE_ROUNDS * files
    return share if session_s is None else min(share, rounds * 2 * session_s)


def descend(tuner: Tuner, search: Search) -> None:
    """The descent over the patterns from the agreed starts (``tuner.descent``), or none where
    the forward search ran: it found the most speed within the bound (or none), and a descent
    from it would A/B near-float models until the timeout."""
    if tuner.starts.forward is not None:
        tuner.progress.write(f"forward search: {tuner.starts.forward['why']}")
        return
    tuner.descent = Descent(search, rounds=tuner.settings.rounds, lanes=tuner.starts.order,
                            cache=tuner.cache, seeds=tuner._seeds,
                            on_change=tuner._write_standing)
    tuner.descent.run()  # set first: a timeout inside still concludes from what it read


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


def recipe_file_starts(tuner: Tuner) -> list:
    """The placements of the runtime's further recipe files that are starts too (NNCF's
    transformer preset on OpenVINO: ``RecipeFileSpec.start``), each file kept in the run
    folder as it is made (the conclusion measures that file as written)."""
    found = []
    data = tuner.calibration[0] if tuner.calibration else None
    for spec in tuner.profile.recipe_files()[1:]:
        if spec.start is None:
            continue
        try:
            with tuner.wall.step("starts", "recipe"):
                start = spec.start(tuner.prepared, tuner.o.model,
                                   input_shapes=tuner.o.input_shapes, data=data,
                                   keep=partial(tuner.folder.keep,
                                                tuner.folder.recipe_file(spec.name)))
        except ToolError as exc:  # the tool refused this model: no such start
            log.warning("%s; starting without it", exc)
            continue
        if start is not None:
            found.append(start.as_recipe())
    return found
