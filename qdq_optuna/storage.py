"""The run's Optuna storage: studies, the run record and the shared measurement cache.

The storage is the truth of a run (``state.yaml`` is only a readable snapshot): every pattern
study, each committed scheme (study user attrs) and every measured model (run-study user attrs
keyed by the model's plan key) lives there, so a resumed process or another worker sees it all.
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from pathlib import Path

import optuna
from optuna.storages import RDBStorage
from optuna.trial import TrialState

from .errors import OptionError

HEARTBEAT_INTERVAL_S = 15
#: a trial (session builds + interleaved timing) can take minutes on a busy machine
GRACE_PERIOD_S = 180
MAX_RETRY = 2
#: tries to open a storage (concurrent first opens of a new database can collide)
OPEN_ATTEMPTS = 3


def default_storage_url(output_dir: Path) -> str:
    return f"sqlite:///{(Path(output_dir) / 'studies.db').resolve()}"


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


def open_storage(url: str, *, heartbeat: bool = True) -> RDBStorage:
    """An RDB storage with heartbeats, so a dead worker's trials go stale and are retried."""
    if not url.startswith(("sqlite://", "postgresql", "mysql")):
        raise OptionError(
            f"--storage: {url!r} is not an Optuna RDB URL (sqlite:///path.db, postgresql://...)"
        )
    kwargs = {}
    if heartbeat:
        kwargs = dict(
            heartbeat_interval=HEARTBEAT_INTERVAL_S,
            grace_period=GRACE_PERIOD_S,
            heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(
                max_retry=MAX_RETRY
            ),
        )
    engine_kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {"pool_pre_ping": True}
    from sqlalchemy.exc import IntegrityError, OperationalError

    for attempt in range(OPEN_ATTEMPTS):
        try:
            return RDBStorage(_with_driver(url), engine_kwargs=engine_kwargs, **kwargs)
        except (IntegrityError, OperationalError) as exc:
            # workers starting together on a new database race to create its tables
            error = exc
            time.sleep(0.2 * (attempt + 1))
        except Exception as exc:
            error = exc
            break
    msg = str(error).strip().splitlines()
    raise OptionError(f"--storage {url}: cannot open ({msg[0] if msg else type(error).__name__})") from None


def quiet_optuna(verbose: bool) -> None:
    optuna.logging.set_verbosity(logging.INFO if verbose else logging.WARNING)
    # heartbeats and metric names are marked experimental; we rely on them knowingly
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)


def study_names(storage: RDBStorage) -> list[str]:
    return [s.study_name for s in storage.get_all_studies()]


def delete_run(storage: RDBStorage, run_id: str) -> int:
    """Remove every study of a run (``--fresh``)."""
    n = 0
    for name in study_names(storage):
        if name == f"{run_id}/_run" or name.startswith(f"{run_id}/"):
            optuna.delete_study(study_name=name, storage=storage)
            n += 1
    return n


def fail_running_trials(study: optuna.Study) -> list[dict]:
    """Fail RUNNING trials left by a dead process; returns their params to redo them."""
    redo = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        with contextlib.suppress(Exception):
            study._storage.set_trial_user_attr(t._trial_id, "failure", "process died while running")
            study._storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
            redo.append(dict(t.params))
    return redo


class MeasurementCache:
    """Plan key -> measured result, stored in the run study's user attrs (shared, persistent)."""

    PREFIX = "measured:"

    def __init__(self, run_study: optuna.Study) -> None:
        self.study = run_study
        self._local: dict[str, dict] = {}
        self.hits = 0

    def refresh(self) -> None:
        attrs = self.study._storage.get_study_user_attrs(self.study._study_id)
        for k, v in attrs.items():
            if k.startswith(self.PREFIX):
                self._local[k[len(self.PREFIX):]] = v

    def get(self, key: str) -> dict | None:
        if key not in self._local:
            self.refresh()
        return self._local.get(key)

    def put(self, key: str, record: dict) -> None:
        self._local[key] = record
        self.study.set_user_attr(self.PREFIX + key, record)

    def __len__(self) -> int:
        return len(self._local)
