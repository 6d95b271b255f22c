"""The one module that touches Optuna's private attributes.

Optuna's public API has no way to reach a study's storage (``study._storage``), a study's
or a trial's id in it (``study._study_id``, ``trial._trial_id``), or to run code while the
storage finds a dead worker's trials (``RDBStorage._get_stale_trial_ids``). The stored run
needs all four: the run study's system attrs, a trial's current state while another worker
measures it, failing a trial of a dead process, queuing a dead worker's trial again before its
budget slot looks free. Everything else in the package goes through the functions here, so an
Optuna release that renames one of them is fixed in this file alone
(``tests/test_structure.py`` checks that no other module names them).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import optuna
from optuna.storages import BaseStorage, RDBStorage
from optuna.trial import FrozenTrial, TrialState

#: called with (study, trial) for a dead worker's trial, before and after Optuna fails it
StaleTrialCallback = Callable[[optuna.Study, FrozenTrial], None]


# -- studies -------------------------------------------------------------------------------------
def storage_of(study: optuna.Study) -> BaseStorage:
    """The storage a study lives in."""
    return study._storage


def study_id(study: optuna.Study) -> int:
    """The study's id in its storage (the dashboard's artifact URLs name it)."""
    return study._study_id


def study_system_attrs(study: optuna.Study) -> dict[str, Any]:
    return study._storage.get_study_system_attrs(study._study_id)


def study_attrs(study: optuna.Study) -> dict[str, Any]:
    """A study's user and system attrs in one view, read from the storage now (a key is in
    one or the other; user attrs win)."""
    storage, sid = study._storage, study._study_id
    return {**storage.get_study_system_attrs(sid), **storage.get_study_user_attrs(sid)}


def set_study_system_attr(study: optuna.Study, key: str, value: Any) -> None:
    study._storage.set_study_system_attr(study._study_id, key, value)


def load_sibling(study: optuna.Study, study_name: str) -> optuna.Study:
    """Another study of the same storage (KeyError when there is none)."""
    return optuna.load_study(study_name=study_name, storage=study._storage)


# -- trials --------------------------------------------------------------------------------------
def trial_id(trial: optuna.Trial | FrozenTrial) -> int:
    """A trial's id in its storage (unlike its number, unique across studies)."""
    return trial._trial_id


def stored_trial(study: optuna.Study, trial: optuna.Trial | FrozenTrial) -> FrozenTrial:
    """The trial as the storage holds it now (another worker may have changed it)."""
    return study._storage.get_trial(trial._trial_id)


def trial_system_attrs(study: optuna.Study, trial: optuna.Trial | FrozenTrial) -> dict[str, Any]:
    return study._storage.get_trial_system_attrs(trial._trial_id)


def set_trial_system_attr(study: optuna.Study, trial: optuna.Trial | FrozenTrial, key: str,
                          value: Any) -> None:
    study._storage.set_trial_system_attr(trial._trial_id, key, value)


def fail_trial(study: optuna.Study, trial: int | optuna.Trial | FrozenTrial,
               user_attrs: dict[str, Any]) -> bool:
    """Set a RUNNING trial's ``user_attrs`` and fail it (a trial of a dead or interrupted
    process); ``trial``: the trial or its id. True if it was still running; raises when the
    storage refuses (the trial finished meanwhile, or the storage is gone)."""
    tid = trial if isinstance(trial, int) else trial._trial_id
    storage = study._storage
    for key, value in user_attrs.items():
        storage.set_trial_user_attr(tid, key, value)
    return bool(storage.set_trial_state_values(tid, TrialState.FAIL))


# -- the storage ---------------------------------------------------------------------------------
class RequeueingRDBStorage(RDBStorage):
    """An RDB storage that queues a dead worker's trial again *before* Optuna fails it.

    Optuna fails a stale trial, then calls the stale-trial callback: in between, the trial's
    budget slot looks free and a waiting worker would take it with a scheme of its own, leaving
    the retry queued for ever. Queued first, the slot is always held by the dead trial or by
    its retry. (Optuna's callback runs ``on_stale`` again afterwards, as a fallback; it must
    queue each dead trial at most once.)"""

    def __init__(self, url: str, *, on_stale: StaleTrialCallback | None = None,
                 **kwargs: Any) -> None:
        super().__init__(url, **kwargs)
        self._on_stale = on_stale

    def record_heartbeat(self, trial_id: int) -> None:
        """One beat; one that fails (SQLite busy past its timeout under load, a dropped
        connection) is logged and the next tries again. Optuna's heartbeat thread ends at its
        first exception: the live trial would go stale and another worker would fail it while
        this one still measures it (then ``UpdateFinishedTrialError`` at its tell)."""
        try:
            super().record_heartbeat(trial_id)
        except Exception:
            logging.getLogger("qdq_optuna").debug("heartbeat failed", exc_info=True)

    def _get_stale_trial_ids(self, study_id: int) -> list[int]:
        ids = super()._get_stale_trial_ids(study_id)
        if ids and self._on_stale is not None:
            study = optuna.load_study(study_name=self.get_study_name_from_id(study_id),
                                      storage=self)
            for tid in ids:
                try:
                    self._on_stale(study, self.get_trial(tid))
                except Exception:  # Optuna's callback tries again once it has failed the trial
                    logging.getLogger("qdq_optuna").debug("requeue failed", exc_info=True)
        return ids
