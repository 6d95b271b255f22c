"""Errors that reach the user as one clear line (exit code 2), never as a traceback."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from enum import Enum


class UserError(Exception):
    """Bad input: a file, tensor, option or setting the user can fix.

    The message must name the offending file / tensor / option. The CLI prints
    ``qdq-optuna: error: <message>`` and exits with status 2.
    """

    exit_code = 2


class ModelError(UserError):
    """The ONNX model cannot be used (unreadable, invalid, unsupported)."""


class OptionError(UserError):
    """A command-line option or Config value is invalid."""


class OptionChoice(str, Enum):
    """A closed choice of an option: its members are the words the option takes, and
    :meth:`parse` turns a word into a member or one line naming the option (a subclass says
    which: ``__option__ = "--timing"``)."""

    @classmethod
    def parse(cls, name):
        try:
            return cls(name)
        except ValueError:
            raise OptionError(f"{cls.__option__}: unknown {name!r} (choose from "
                              f"{', '.join(m.value for m in cls)})") from None


class ToolError(UserError):
    """A third-party tool (ONNX Runtime's quantizer, Model Optimizer) failed on the model: one
    line when the user asked for that tool's output; a search that only wanted it as one
    start among several goes on without it."""


def install_hint(extra: str) -> str:
    """How to add an optional extra: no package index has qdq-optuna, so the command a user can
    run is the one from the checkout (the same extra works on a wheel built from it)."""
    return f'pip install ".[{extra}]" in the qdq_optuna checkout'


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP (what Slurm, Kubernetes, CI and a closed terminal send), raised in
    the main thread so that the run ends as Ctrl-C ends it: the running trial failed and
    redone on resume, the report of what is known, ``state.yaml`` saying how to resume, the
    SQLite file whole. A KeyboardInterrupt, so every Ctrl-C path takes it as one."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


#: the signals :func:`stop_signals_as_interrupt` turns into :class:`Stopped`
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP")
                     if hasattr(signal, name))


#: modules a signal never interrupts: a KeyboardInterrupt raised inside the storage's
#: database code can leave a connection checked out (the SQLite log then stays beside the
#: file) and makes SQLAlchemy log a traceback; the signal waits until the call returns
_DEFER_IN = ("sqlalchemy", "sqlite3", "optuna.storages")
#: seconds between looks at whether the main thread left the storage's code
_DEFER_S = 0.02


def _in_storage_code(frame) -> bool:
    while frame is not None:
        if frame.f_globals.get("__name__", "").startswith(_DEFER_IN):
            return True
        frame = frame.f_back
    return False


@contextmanager
def stop_signals_as_interrupt() -> Iterator[None]:
    """SIGTERM and SIGHUP raise :class:`Stopped` in the main thread while the block runs (and
    Ctrl-C its KeyboardInterrupt, as Python's own handler does), never inside the storage's
    database code (:data:`_DEFER_IN`: the signal is delivered again once that returns); then
    the previous handlers come back. A handler the caller set (a library user's, a batch
    system wrapper's) is left alone, and so is an ignored signal (``nohup``); outside the
    main thread nothing is installed (Python delivers signals only there). A second signal
    while the first is being handled is ignored: the clean-up it started finishes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    main = threading.main_thread().ident
    raised = False
    pending: list[int] = []  # a signal deferred and not raised yet
    ended = threading.Event()

    def again(signum: int) -> None:
        if not ended.is_set():
            signal.pthread_kill(main, signum)

    def interrupt(signum: int) -> BaseException:
        return KeyboardInterrupt() if signum == signal.SIGINT else Stopped(signum)

    def stop(signum, frame) -> None:
        nonlocal raised
        if raised:
            return
        if _in_storage_code(frame):  # again in a moment, once the call returned
            pending[:] = [signum]
            threading.Timer(_DEFER_S, again, (signum,)).start()
            return
        raised = True
        raise interrupt(signum)

    defaults = {sig: signal.SIG_DFL for sig in STOP_SIGNALS}
    defaults[signal.SIGINT] = signal.default_int_handler
    previous = {sig: signal.getsignal(sig) for sig in defaults}
    ours = [sig for sig, handler in previous.items() if handler is defaults[sig]]
    for sig in ours:
        signal.signal(sig, stop)
    try:
        yield
    finally:
        ended.set()
        for sig in ours:
            signal.signal(sig, previous[sig])
    if pending and not raised:  # the block ended while a signal waited: it still stops us
        raise interrupt(pending[0])


def _interruptions(exc: BaseException | None) -> Iterator[KeyboardInterrupt]:
    """The KeyboardInterrupts in ``exc`` and its causes and contexts."""
    seen: set[int] = set()
    chain: list[BaseException | None] = [exc]
    while chain:
        exc = chain.pop()
        if exc is None or id(exc) in seen:
            continue
        if isinstance(exc, KeyboardInterrupt):
            yield exc
        seen.add(id(exc))
        chain += [exc.__cause__, exc.__context__]


def interrupted_by(exc: BaseException) -> bool:
    """Whether ``exc`` is, or was raised while handling, a Ctrl-C (or a :class:`Stopped`
    signal): a KeyboardInterrupt that lands inside a library's own clean-up (Optuna's tell,
    for one) can come out as another error, and the run must still end as interrupted, not
    as an internal error."""
    return next(_interruptions(exc), None) is not None


def interrupting_signal(exc: BaseException) -> int | None:
    """The signal that interrupted: SIGTERM/SIGHUP for a :class:`Stopped` in ``exc``'s
    chain, SIGINT for a plain Ctrl-C, None when nothing interrupted."""
    found = list(_interruptions(exc))
    if not found:
        return None
    stopped = [e for e in found if isinstance(e, Stopped)]
    return stopped[0].signum if stopped else int(signal.SIGINT)
