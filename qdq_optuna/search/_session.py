"""A run's session: progress output, and what a stop or a failure leaves. On Ctrl-C (SIGTERM,
SIGHUP) the run is told (no trial of ours stays RUNNING); at the end what the run holds is let
go; a run that fails before its first measurement leaves no files behind (a resumed run's
earlier files stay)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from qdq_optuna._progress import Progress
from qdq_optuna.errors import interrupted_by
from qdq_optuna.run_folder import RunFolder


@contextmanager
def run_session(*, show_progress: bool, folder: RunFolder, measured: Callable[[], bool],
                interrupted: Callable[[BaseException], None],
                release: Callable[[], None]) -> Iterator[Progress]:
    """The run's progress output; ``interrupted`` is told of a stop (a signal turned into an
    exception counts as Ctrl-C), ``release`` runs at the end, and the files new since the
    start are removed when the run failed before ``measured()``."""
    before = folder.listing()
    failed_unmeasured = False
    try:
        with Progress(show_progress) as progress:
            yield progress
    except KeyboardInterrupt as exc:
        interrupted(exc)
        raise
    except Exception as exc:
        if not interrupted_by(exc):
            failed_unmeasured = not measured()
            raise
        interrupted(exc)
        raise KeyboardInterrupt from exc
    finally:
        release()
        if failed_unmeasured:  # after its storage let go of its files
            folder.remove_new(before)
