"""Several processes on one study: budget slots, twins, and the trials to redo.

Workers (``--worker``) share a run's studies through the storage. Each pattern study gets
exactly its budget across workers (:meth:`Workers.claim_slot`); two workers that draw the same
scheme at once measure it once (:meth:`Workers.twin`); a trial whose process died, timed out or
was interrupted is queued again once (:meth:`Workers.requeue`, :func:`retry_stale_trial`). A
single process uses the same paths: a rerun of a killed run redoes the trial it was running.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import optuna
from optuna.exceptions import UpdateFinishedTrialError
from optuna.trial import TrialState

from qdq_optuna.errors import Stopped
from qdq_optuna.record import (
    Agreed,
    PatternAttr,
    RunRecord,
    SystemAttr,
    TrialAttr,
    claim,
    run_study_of,
    storage_of,
    stored_trial,
    trial_id,
    trial_system_attrs,
)
from qdq_optuna.record import fail_trial as _fail

#: seconds between looks while a worker waits for other workers' trials to free a slot
SLOT_POLL_S = 0.25
#: a dead worker's scheme is queued again at most this many times
MAX_RETRY = 2
#: user attrs of a trial that describe its run, not its scheme (not copied to a retry)
_RUN_ATTRS = (TrialAttr.SLOT, TrialAttr.SKIPPED, TrialAttr.FAILURE, TrialAttr.TRANSIENT)
#: the live states a slot is counted in
_LIVE = (TrialState.COMPLETE, TrialState.RUNNING, TrialState.WAITING)


def queued(trial) -> bool:
    """A trial whose scheme was queued (a seed, a redo, a dead worker's retry), not sampled."""
    return bool(trial.system_attrs.get(SystemAttr.FIXED_PARAMS)) or (
        SystemAttr.FAILED_TRIAL in trial.system_attrs)


def fully_sampled(study: optuna.Study, params: dict) -> bool:
    """Whether ``params`` has every insertion point of a pattern study: a trial killed while
    its points were being suggested has only some, and measured nothing."""
    points = study.user_attrs.get(PatternAttr.POINTS)
    return points is None or set(points) <= set(params)


#: user attrs a redo of a trial carries over: what its scheme is (a descent move, with the
#: other patterns' points of a chain move)
_MOVE_ATTRS = (TrialAttr.MOVE, TrialAttr.MOVE_INDEX, TrialAttr.MOVE_SIGNATURE,
               TrialAttr.PARTNER, TrialAttr.PLAN_KEY)


def move_attrs(user_attrs: dict) -> dict:
    return {k: user_attrs[k] for k in _MOVE_ATTRS if k in user_attrs}


def enqueue_redo(study: optuna.Study, params: dict, user_attrs: dict | None = None) -> None:
    """Enqueue a failed trial's scheme again. ``enqueue_trial(skip_if_exists=True)`` would
    match the failed trial itself and never redo it; only a live or finished trial with the
    same params (and, for a descent move, the same model: ``plan_key``) makes the redo
    unnecessary. A trial that died before all its points were suggested measured nothing: it
    is not redone (its partial params would be filled with "off" and build another, possibly
    already measured, model)."""
    if not params or not fully_sampled(study, params):
        return
    key = (user_attrs or {}).get(TrialAttr.PLAN_KEY)
    for t in study.get_trials(deepcopy=False, states=(TrialState.WAITING, TrialState.RUNNING,
                                                      TrialState.COMPLETE)):
        if t.system_attrs.get(SystemAttr.FIXED_PARAMS, t.params) == params and (
                key is None or t.user_attrs.get(TrialAttr.PLAN_KEY) == key):
            return
    study.enqueue_trial(params, user_attrs=user_attrs)


def fail_trial(study: optuna.Study, tid: int, why: str, *, transient: bool = True) -> bool:
    """Fail one RUNNING trial (ours, on Ctrl-C); True if it was still running."""
    try:
        return _fail(study, tid, {TrialAttr.FAILURE: why, TrialAttr.TRANSIENT: transient})
    except Exception:  # finished meanwhile, or the storage is gone: nothing to do
        return False


def fail_running_trials(study: optuna.Study, with_attrs: bool = False) -> list:
    """Fail RUNNING trials left by a dead process; returns their params to redo them (with
    ``with_attrs``: ``(params, move attrs)``)."""
    redo = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        with contextlib.suppress(Exception):
            _fail(study, t, {TrialAttr.FAILURE: "process died while running"})
            redo.append((dict(t.params), move_attrs(t.user_attrs)) if with_attrs
                        else dict(t.params))
    return redo


def retry_stale_trial(study: optuna.Study, trial) -> None:
    """Queue a dead worker's trial again, at most :data:`MAX_RETRY` times per scheme, and
    exactly once per dead trial even when several workers notice it together (they agree on
    who enqueues; PostgreSQL already lets only one of them fail it, SQLite does not). A trial
    that died before all its points were suggested measured nothing and is not queued.
    (The storage's stale-trial callback, see :func:`qdq_optuna.record.storage.open_storage`.)"""
    history = list(trial.system_attrs.get(SystemAttr.RETRY_HISTORY, [])) + [trial.number]
    if len(history) > MAX_RETRY or not fully_sampled(study, trial.params):
        return
    try:
        mine = claim(run_study_of(study), Agreed.retry(study.study_name, trial.number))
    except KeyError:  # not one of our runs: behave like Optuna's retry callback
        mine = True
    if not mine or any(t.user_attrs.get(TrialAttr.RETRY_OF) == trial.number
                       for t in study.get_trials(deepcopy=False)):
        return  # another worker's to queue, or queued already (before Optuna failed it)
    # (the failed trial itself cannot take a note any more: Optuna freezes finished trials)
    system_attrs = {**trial.system_attrs, SystemAttr.FAILED_TRIAL: trial.system_attrs.get(
        SystemAttr.FAILED_TRIAL, trial.number), SystemAttr.RETRY_HISTORY: history}
    user_attrs = {**{k: v for k, v in trial.user_attrs.items() if k not in _RUN_ATTRS},
                  TrialAttr.RETRY_OF: trial.number,
                  TrialAttr.RETRY_REASON: f"trial {trial.number}'s worker stopped sending "
                                          "heartbeats"}
    study.add_trial(optuna.trial.create_trial(
        state=TrialState.WAITING, params=trial.params, distributions=trial.distributions,
        user_attrs=user_attrs, system_attrs=system_attrs,
    ))


class LostTrial(Exception):
    """Two workers popped the same queued trial (SQLite cannot lock the row); the one that did
    not claim it waits for the other to finish it and steps back (Optuna then cannot tell the
    finished trial: :meth:`Workers.lost` says that is why)."""


class Workers:
    """This process among the run's workers (``worker``: others may share its studies)."""

    def __init__(self, record: RunRecord, *, worker: bool,
                 remaining: Callable[[], float | None]) -> None:
        self.record = record
        self.worker = worker
        self.remaining = remaining
        #: this process stepped back from a trial another worker took (see :meth:`lost`)
        self._lost = False
        #: the study being optimized and this process's running trial in it (for Ctrl-C)
        self.study: optuna.Study | None = None
        self.live_trial: int | None = None
        #: what the objective of the live trial raised (its error, not its tell's)
        self._raised: BaseException | None = None
        #: what interrupted the run, in a failed trial's words
        self._stopped_by = "Ctrl-C"

    def requeue(self, study: optuna.Study) -> None:
        """Queue again what an earlier process left: the trials it was running (a single
        process: they died with it) and, once each, trials that failed transiently (a worker
        crash or timeout). A redo carries ``retry_of`` (a finished trial's attrs cannot be
        changed any more) and a failed redo is not retried again."""
        if not self.worker:
            for params, attrs in fail_running_trials(study, with_attrs=True):
                enqueue_redo(study, params, attrs or None)
        every = study.get_trials(deepcopy=False)
        retried = {t.user_attrs.get(TrialAttr.RETRY_OF) for t in every}
        for t in every:
            if t.state != TrialState.FAIL or not t.user_attrs.get(TrialAttr.TRANSIENT):
                continue
            if TrialAttr.RETRY_OF in t.user_attrs or t.number in retried:
                continue
            if not self.worker or self.record.claim(Agreed.redo(study.study_name, t.number)):
                enqueue_redo(study, dict(t.params), {**move_attrs(t.user_attrs),
                                                     TrialAttr.RETRY_OF: t.number})

    def claim_slot(self, study: optuna.Study, trial: optuna.Trial, budget: int) -> bool | None:
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
        rank = (not queued(stored_trial(study, trial)), number)
        while True:
            trials = study.get_trials(deepcopy=False, states=_LIVE)
            done = sum(1 for t in trials if t.state == TrialState.COMPLETE)
            ahead = sum(1 for t in trials if t.state == TrialState.RUNNING and t.number != number
                        and (t.user_attrs.get(TrialAttr.SLOT) or (not queued(t), t.number) < rank))
            waiting = sum(1 for t in trials if t.state == TrialState.WAITING) if rank[0] else 0
            if done + ahead < budget:
                if waiting and done + ahead + waiting >= budget:
                    time.sleep(SLOT_POLL_S)
                    return None
                if self.worker:  # trials that check after this one count it
                    trial.set_user_attr(TrialAttr.SLOT, True)
                return True
            remaining = self.remaining()
            if done >= budget or (remaining is not None and remaining <= 0):
                return False
            optuna.storages.fail_stale_trials(study)  # a dead worker's trial frees its slot
            time.sleep(SLOT_POLL_S)

    def admit(self, study: optuna.Study, trial: optuna.Trial, budget: int) -> None:
        """Prune ``trial`` unless it has a budget slot (see :meth:`claim_slot`)."""
        slot = self.claim_slot(study, trial, budget)
        if slot is None:
            trial.set_user_attr(TrialAttr.SKIPPED, "gave its slot to a queued (retried) trial")
            raise optuna.TrialPruned("gave its slot to a queued (retried) trial")
        if not slot:
            trial.set_user_attr(TrialAttr.SKIPPED, "the budget was filled by other workers")
            study.stop()
            raise optuna.TrialPruned("the budget was filled by other workers")

    def wait_for(self, study: optuna.Study, trial: optuna.Trial) -> None:
        """Wait until another worker finished ``trial`` (or its heartbeat went stale)."""
        while stored_trial(study, trial).state == TrialState.RUNNING:
            remaining = self.remaining()
            if remaining is not None and remaining <= 0:
                return
            time.sleep(SLOT_POLL_S)

    def lost(self) -> bool:
        """Whether the optimize call that just raised stepped back from a trial another worker
        took (Optuna then refuses to tell the finished trial); the note is cleared."""
        lost, self._lost = self._lost, False
        return lost

    def taken_over(self, study: optuna.Study, error: BaseException) -> bool:
        """Whether ``error``, raised by an optimize call but not by our objective, came from
        telling a trial another process had finished: failed as stale while it was still
        measured here (its heartbeat came late). Optuna's tell then raises ``ValueError``
        (or ``UpdateFinishedTrialError``; an ``AssertionError`` from its bookkeeping when the
        objective had returned). The optimize call steps back: the other worker queued the
        scheme again (:func:`retry_stale_trial`), so nothing is lost and nothing counted twice."""
        if self.live_trial is None or error is self._raised or not isinstance(
                error, (ValueError, AssertionError, UpdateFinishedTrialError)):
            return False
        try:
            return storage_of(study).get_trial(self.live_trial).state.is_finished()
        except Exception:  # the storage is gone: the caller's error stands
            return False

    def wait_for_others(self, study: optuna.Study, trial: optuna.Trial) -> bool:
        """Wait until no other trial of ``study`` measures a scheme; whether one did. Trials
        without a scheme yet (waiting for a budget slot, which this one holds) and trials that
        wait too (marked ``skipped``) do not count: they would wait for each other."""
        waited = False
        while any(t.number != trial.number and t.params and TrialAttr.SKIPPED not in t.user_attrs
                  for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))):
            waited = True
            remaining = self.remaining()
            if remaining is not None and remaining <= 0:
                break
            optuna.storages.fail_stale_trials(study)
            time.sleep(SLOT_POLL_S)
        return waited

    def twin(self, study: optuna.Study, trial: optuna.Trial, key: str) -> int | None:
        """Another finished, running or queued trial that builds the same model (two workers
        sampled the same scheme at once); None for a single process. Each trial stores its
        plan key before it looks, so of two twins at least one sees the other and steps back
        (rarely both: the scheme is then left out, never measured twice). Schemes the sampler
        knowingly repeats (``qdq:duplicate``) are not twins."""
        if not self.worker:
            return None
        if trial_system_attrs(study, trial).get(SystemAttr.DUPLICATE):
            return None
        for t in study.get_trials(deepcopy=False, states=_LIVE):
            if t.number != trial.number and t.user_attrs.get(TrialAttr.PLAN_KEY) == key:
                return t.number
        return None

    # -- Ctrl-C ------------------------------------------------------------------------------
    def interruptible(self, study: optuna.Study, objective: Callable) -> Callable:
        """The objective, noting which trial runs, and marking a Ctrl-C'd trial to be redone."""
        self.study = study

        def run(trial: optuna.Trial):
            self.live_trial, self._raised = trial_id(trial), None
            if self.worker and not self.record.claim(Agreed.run(study.study_name, trial.number)):
                self.wait_for(study, trial)  # another worker took the same queued trial
                self._lost = True
                raise LostTrial(f"trial {trial.number} runs in another worker")
            try:
                return objective(trial)
            except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM / SIGHUP (Stopped)
                self._stopped_by = str(exc) if isinstance(exc, Stopped) else "Ctrl-C"
                with contextlib.suppress(Exception):
                    trial.set_user_attr(TrialAttr.FAILURE, f"interrupted ({self._stopped_by})")
                    trial.set_user_attr(TrialAttr.TRANSIENT, True)  # redone by the next run
                raise
            except Exception as exc:  # the objective's own error (see taken_over)
                self._raised = exc
                raise
        return run

    def interrupted(self, by: str | None = None) -> None:
        """Ctrl-C (``by``: or the signal that stopped the run): no trial of ours stays RUNNING
        (the next run redoes it)."""
        self._stopped_by = by or self._stopped_by
        if self.study is None:
            return
        with contextlib.suppress(Exception):
            for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
                if not self.worker or trial_id(t) == self.live_trial:
                    fail_trial(self.study, trial_id(t), f"interrupted ({self._stopped_by})",
                               transient=True)
