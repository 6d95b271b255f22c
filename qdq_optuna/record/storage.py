"""The Optuna storage a run lives in: opening it, heartbeats, and agreeing on a value.

The storage is the truth of a run (``state.yaml`` is only a readable snapshot): every pattern
study, each committed scheme and every measured model lives there, so a resumed process or
another worker sees it all. What is stored where (study names, user attributes) is the run
record's business (:mod:`qdq_optuna.record.schema`, :mod:`qdq_optuna.record.run`); this module
knows only Optuna's public API (its private parts are :mod:`qdq_optuna.record._optuna`'s).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optuna
from optuna.storages import RDBStorage
from optuna.trial import TrialState

from qdq_optuna.errors import OptionError, install_hint
from qdq_optuna.record._optuna import RequeueingRDBStorage, StaleTrialCallback
from qdq_optuna.run_folder import STUDIES_DB

HEARTBEAT_INTERVAL_S = 15
#: a trial (session builds + interleaved timing) can take minutes on a busy machine
GRACE_PERIOD_S = 180
#: seconds without a heartbeat after which a worker's RUNNING trial counts as dead
#: (``TuneOptions.heartbeat_grace`` / this environment variable override GRACE_PERIOD_S)
GRACE_ENV = "QDQ_OPTUNA_HEARTBEAT_GRACE"
#: user attrs of the run-study trials that record agreed values (see :func:`agree`)
AGREE_KEY = "qdq:agree"
AGREE_VALUE = "qdq:value"
#: this process, as the one that claims a key (see :func:`claim`)
_PROCESS_TOKEN = uuid.uuid4().hex
#: tries to open a storage (concurrent first opens of a new database can collide)
OPEN_ATTEMPTS = 3


def default_storage_url(output_dir: Path) -> str:
    return f"sqlite:///{(Path(output_dir) / STUDIES_DB).resolve()}"


def _with_driver(url: str) -> str:
    """``postgresql://`` with the PostgreSQL driver that is installed.

    SQLAlchemy 2.1 maps a bare ``postgresql://`` to psycopg 3, while the ``postgres`` extra
    installs psycopg2: name psycopg2 explicitly when only it is there.
    """
    if not url.startswith("postgresql://"):
        return url
    import importlib.util

    if importlib.util.find_spec("psycopg") is None and importlib.util.find_spec("psycopg2"):
        return "postgresql+psycopg2://" + url[len("postgresql://"):]
    return url


def heartbeat_grace(grace: float | None = None) -> int:
    """The grace period in whole seconds: ``grace``, else $QDQ_OPTUNA_HEARTBEAT_GRACE, else
    :data:`GRACE_PERIOD_S`. Short values (a few seconds) are for tests and fast backends."""
    if grace is None and os.environ.get(GRACE_ENV):
        try:
            grace = float(os.environ[GRACE_ENV])
        except ValueError:
            raise OptionError(f"${GRACE_ENV}: expected seconds, got {os.environ[GRACE_ENV]!r}") from None
    if grace is None:
        return GRACE_PERIOD_S
    if not grace >= 2 or grace != grace or grace == float("inf"):
        raise OptionError(f"heartbeat grace period must be at least 2 seconds, got {grace}")
    return int(round(grace))


#: SQLite files in write-ahead-log mode (:func:`_write_ahead`); off, SQLite's default rollback
#: journal (``benchmarks/run_overhead.py`` compares the two)
SQLITE_WRITE_AHEAD = True


def open_storage(url: str, *, heartbeat: bool = True, grace: float | None = None,
                 on_stale: StaleTrialCallback | None = None) -> RDBStorage:
    """An RDB storage with heartbeats, so a dead worker's trials go stale and are retried.

    A RUNNING trial whose worker has not beaten for ``grace`` seconds (see
    :func:`heartbeat_grace`) is failed by the next worker that looks, and ``on_stale`` queues it
    again (the search's ``retry_stale_trial``; default:
    Optuna's :class:`~optuna.storages.RetryHeartbeatStaleTrialCallback`)."""
    if not url.startswith(("sqlite://", "postgresql", "mysql")):
        raise OptionError(
            f"--storage: {url!r} is not an Optuna RDB URL (sqlite:///path.db, postgresql://...)"
        )
    kwargs = {}
    if heartbeat:
        grace_s = heartbeat_grace(grace)
        kwargs = dict(
            # several beats per grace period, so one late beat never kills a live trial
            heartbeat_interval=max(1, min(HEARTBEAT_INTERVAL_S, grace_s // 3)),
            grace_period=grace_s,
            heartbeat_stale_trial_callback=(on_stale
                                           or optuna.storages.RetryHeartbeatStaleTrialCallback()),
        )
    engine_kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {"pool_pre_ping": True}
    from sqlalchemy.exc import IntegrityError, OperationalError

    for attempt in range(OPEN_ATTEMPTS):
        try:
            storage = RequeueingRDBStorage(_with_driver(url), engine_kwargs=engine_kwargs,
                                           on_stale=on_stale if heartbeat else None, **kwargs)
            if url.startswith("sqlite") and SQLITE_WRITE_AHEAD:
                _write_ahead(storage.engine)
            return storage
        except (IntegrityError, OperationalError) as exc:
            # workers starting together on a new database race to create its tables
            error = exc
            time.sleep(0.2 * (attempt + 1))
        except ImportError:  # Optuna's own text only says "Please install appropriate one"
            need = (install_hint("postgres") if url.startswith("postgres")
                    else "install the database's SQLAlchemy driver")
            raise OptionError(f"--storage {url}: its database driver is not installed "
                              f"({need})") from None
        except Exception as exc:
            error = exc
            break
    msg = str(error).strip().splitlines()
    raise OptionError(f"--storage {url}: cannot open ({msg[0] if msg else type(error).__name__})") from None


def _write_ahead(engine) -> None:
    """SQLite in write-ahead-log mode, synced at checkpoints rather than at every commit.

    A run commits a few rows per trial (its scheme, timings, errors, heartbeats); with SQLite's
    default rollback journal each commit waits for the disk twice: a cost-model run on a small
    YOLO-like model spent about a fifth of its time committing. A committed transaction
    still survives the process being killed (the log is replayed when the file is next
    opened); only a power cut may lose the last commits, never the file. Readers (other
    workers, optuna-dashboard) no longer block the writer. Like any SQLite file it needs a
    local disk: on a network filesystem use PostgreSQL."""
    from sqlalchemy import event

    def pragmas(connection, _record) -> None:
        cursor = connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    event.listen(engine, "connect", pragmas)
    engine.dispose()  # connections opened while the tables were made get the pragmas too


def release(storage) -> None:
    """Close the storage's connections (it reconnects if used again). A SQLite file goes back
    to the default rollback journal, its log folded in: a finished run's ``studies.db`` is one
    self-contained file while its process lives on (a notebook), and opens from a read-only
    copy (a write-ahead file needs a writable folder to be read). Where another worker still
    has the file open, it stays in write-ahead mode: the last one out switches it back."""
    engine = getattr(storage, "engine", None)
    if engine is None:
        return
    engine.dispose()
    database = engine.url.database
    if engine.dialect.name == "sqlite" and database and Path(database).is_file():  # never made
        with contextlib.suppress(Exception), engine.connect() as connection:
            connection.exec_driver_sql("PRAGMA busy_timeout=0")  # busy: another worker is in
            connection.exec_driver_sql("PRAGMA journal_mode=DELETE")
        engine.dispose()


class _NoInterruptTraceback(logging.Filter):
    """Optuna logs a trial that Ctrl-C failed with the KeyboardInterrupt's traceback; the CLI
    already says what happened and how to resume, in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, KeyboardInterrupt)


_INTERRUPT_FILTER = _NoInterruptTraceback()


def quiet_optuna(verbose: bool) -> None:
    optuna.logging.set_verbosity(logging.INFO if verbose else logging.WARNING)
    # heartbeats and metric names are marked experimental; we rely on them knowingly
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    logging.getLogger("optuna.study._optimize").addFilter(_INTERRUPT_FILTER)


#: the state of a proposal trial: not COMPLETE, so the run study has no trial values to plot
#: or to compute importances of (runs made before kept their COMPLETE proposals of value 0)
PROPOSAL_STATE = TrialState.PRUNED


def _claims(run_study: optuna.Study, key: str) -> list:
    return [t for t in run_study.get_trials(deepcopy=False,
                                            states=(TrialState.COMPLETE, PROPOSAL_STATE))
            if t.user_attrs.get(AGREE_KEY) == key]


def agreed(run_study: optuna.Study, key: str) -> dict | None:
    """The value workers agreed on for ``key`` (``{"value": ...}``), or None if none yet."""
    claims = _claims(run_study, key)
    if not claims:
        return None
    first = min(claims, key=lambda t: t.number)
    if AGREE_VALUE in first.user_attrs:  # a proposal stored by an earlier version
        return {"value": first.user_attrs[AGREE_VALUE]}
    return {"value": first.system_attrs.get(AGREE_VALUE)}


def agree(run_study: optuna.Study, key: str, value: Any | Callable[[], Any]) -> Any:
    """The first value stored for ``key`` in this run: a compare-and-set over the storage.

    Each proposal is one trial of the run study (:data:`PROPOSAL_STATE`, its key in its user
    attrs, the value in its system attrs), created in a single transaction. Optuna numbers a
    study's trials under a lock on the study row (PostgreSQL) or the database write lock
    (SQLite), so a later proposal always gets a higher number: the lowest-numbered proposal is
    the decision, the same for every worker and every resumed process, and a process that dies
    part way leaves either a whole proposal or none.
    ``value`` may be a function, called only when no decision exists yet.
    """
    found = agreed(run_study, key)
    if found is not None:
        return found["value"]
    if callable(value):
        value = value()
    run_study.add_trial(optuna.trial.create_trial(
        state=PROPOSAL_STATE, user_attrs={AGREE_KEY: key}, system_attrs={AGREE_VALUE: value},
    ))
    found = agreed(run_study, key)
    assert found is not None, f"the proposal for {key!r} is not in the storage"
    return found["value"]


def claim(run_study: optuna.Study, key: str) -> bool:
    """True in exactly one process of all that claim ``key`` (the first to store its claim)."""
    return agree(run_study, key, _PROCESS_TOKEN) == _PROCESS_TOKEN
