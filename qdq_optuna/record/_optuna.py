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
        if url.startswith("sqlite"):
            connect_args = (kwargs.get("engine_kwargs") or {}).get("connect_args", {})
            create_sqlite_schema(url, timeout_s=connect_args.get("timeout", 60))
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


# -- the SQLite schema ---------------------------------------------------------------------------
def create_sqlite_schema(url: str, *, timeout_s: float = 60) -> None:
    """Optuna's tables and indexes in a SQLite file, all made in one transaction.

    Optuna makes them with SQLAlchemy's ``create_all``, and Python's sqlite3 driver commits
    each ``CREATE`` on its own: a process killed between ``CREATE TABLE studies`` and the
    table's unique index on the study name leaves a table that takes a second study of the
    same name, and since ``create_all`` skips a table that exists, the index never comes.
    Every resume then stored another copy of the run study and failed on it
    (``MultipleResultsFound``). Made here first, inside one explicit transaction, the schema is
    there whole or not at all. A file that lost an index that way gets it back; the empty
    copies of a study those resumes left are deleted first (a copy with trials is refused:
    nothing stored is dropped)."""
    from optuna.storages._rdb import models
    from sqlalchemy import create_engine, event, inspect, orm
    from sqlalchemy.exc import IntegrityError

    metadata = models.BaseModel.metadata
    engine = create_engine(url, connect_args={"timeout": timeout_s})
    try:  # read first: a whole schema needs no write lock (a read-only copy of a finished run)
        found = inspect(engine)
        tables = set(found.get_table_names())
        whole = all(table.name in tables
                    and {i.name for i in table.indexes} <= {i["name"] for i in found.get_indexes(table.name)}
                    for table in metadata.sorted_tables)
    finally:
        engine.dispose()
    if whole:
        return

    @event.listens_for(engine, "connect")
    def _no_implicit_transactions(dbapi_connection, _record) -> None:
        dbapi_connection.isolation_level = None  # the driver then begins nothing by itself

    @event.listens_for(engine, "begin")
    def _begin(connection) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")  # DDL and repair under the write lock

    try:
        with engine.begin() as connection:
            metadata.create_all(connection)
            for table in metadata.sorted_tables:
                for index in table.indexes:
                    try:
                        with connection.begin_nested():
                            index.create(connection, checkfirst=True)
                    except IntegrityError:  # a unique index over rows that break it
                        _drop_empty_copies(orm.Session(bind=connection))
                        index.create(connection, checkfirst=True)
    finally:
        engine.dispose()


def _drop_empty_copies(session) -> None:
    """Delete the later copies of each study name that holds several, when they hold no trial."""
    from optuna.storages._rdb import models
    from sqlalchemy import func

    study = models.StudyModel
    names = [name for (name,) in session.query(study.study_name).group_by(study.study_name)
             .having(func.count(study.study_id) > 1)]
    for name in names:
        first, *copies = session.query(study).filter(study.study_name == name).order_by(study.study_id)
        for copy in copies:
            if copy.trials:
                raise RuntimeError(f"the storage holds two studies named {name!r}, both with "
                                   "trials; keep one (optuna.delete_study) and run again")
            session.delete(copy)
    session.flush()
