"""Run a backend in a persistent worker process, so a crash or hang fails one call, not the run.

TensorRT builders and some execution providers can segfault or spin forever on odd graphs; a
search that tries thousands of candidates will meet one. The worker is a plain ``python -c``
subprocess (not ``multiprocessing``), so user scripts need no ``if __name__ == "__main__"``
guard. Messages are length-prefixed pickles over stdin/stdout; the worker's own stdout is
redirected to stderr so library prints cannot corrupt the channel. Deadlines are enforced here:
a call that outlives its timeout kills the worker, raises :class:`TransientBackendError`, and the
next call starts a fresh worker (its runners are gone with it).
"""

from __future__ import annotations

import collections
import importlib
import os
import pickle
import queue
import signal
import struct
import subprocess
import sys
import threading
import weakref
from pathlib import Path
from typing import Any, BinaryIO

from qdq_optuna.backends.base import (
    Backend,
    BackendError,
    BackendUnavailable,
    Configured,
    ModelSource,
    Runner,
    TransientBackendError,
)
from qdq_optuna.errors import ModelError, OptionError

#: (module path, class name, keyword arguments): everything must be picklable
Factory = tuple[str, str, dict]

_HEADER = struct.Struct("!Q")
_EOF = object()
_ERRORS: dict[str, type[Exception]] = {
    cls.__name__: cls
    for cls in (BackendError, TransientBackendError, BackendUnavailable, OptionError, ModelError)
}
_BOOTSTRAP = "from qdq_optuna.backends.isolated import _worker_main; _worker_main()"
#: model bytes the worker keeps, so that the fresh sessions of one measurement send a model of
#: megabytes through the pipe once (the parent mirrors the worker's LRU order exactly)
KEEP_MODELS = 4


def _keep(kept: collections.OrderedDict, key: Any, value: Any = None) -> None:
    if key in kept:
        kept.move_to_end(key)
    else:
        kept[key] = value
        while len(kept) > KEEP_MODELS:
            kept.popitem(last=False)


def _send(stream: BinaryIO, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)))
    stream.write(data)
    stream.flush()


def _recv(stream: BinaryIO) -> Any:
    head = stream.read(_HEADER.size)
    if len(head) < _HEADER.size:
        return _EOF
    (size,) = _HEADER.unpack(head)
    data = stream.read(size)
    if len(data) < size:
        return _EOF
    return pickle.loads(data)


def _error_reply(exc: BaseException) -> tuple:
    for cls in type(exc).__mro__:
        if _ERRORS.get(cls.__name__) is cls:
            return ("err", cls.__name__, str(exc))
    return ("err", "BackendError", f"{type(exc).__name__}: {exc}")


def _worker_main() -> None:
    """Worker loop: build the backend from the factory, then serve load/time/close."""
    import faulthandler

    channel = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # C-level prints land on stderr, not in the message stream
    sys.stdout = sys.stderr
    faulthandler.enable()  # a Python traceback in the crash report, then the signal
    for sig in ("SIGINT", "SIGTERM", "SIGHUP"):  # the parent's to handle (it stops us: EOF)
        if hasattr(signal, sig):
            signal.signal(getattr(signal, sig), signal.SIG_IGN)
    inbox = sys.stdin.buffer
    init = _recv(inbox)
    if init is _EOF:
        return
    _, sys_path, module, cls_name, kwargs = init
    sys.path[:] = list(dict.fromkeys([*sys_path, *sys.path]))
    try:
        backend = getattr(importlib.import_module(module), cls_name)(**kwargs)
        info = {
            "name": backend.name,
            "deterministic": bool(backend.deterministic),
            "fresh_sessions": bool(getattr(backend, "fresh_sessions", True)),
            "session_settings": bool(getattr(backend, "session_settings", False)),
            "describe": backend.describe(),
        }
        _send(channel, ("ok", info))
    except BaseException as exc:  # report, then exit: the parent restarts on next use
        _send(channel, _error_reply(exc))
        return
    runners: dict[int, Runner] = {}
    kept: collections.OrderedDict = collections.OrderedDict()
    next_id = 0
    while True:
        msg = _recv(inbox)
        if msg is _EOF:
            break
        op = msg[0]
        try:
            if op in ("load", "load_kept"):
                if op == "load_kept":
                    source = kept[msg[1]]
                    _keep(kept, msg[1])
                else:
                    source = msg[1]
                    if len(msg) > 2 and msg[2] is not None:
                        _keep(kept, msg[2], source)  # before building: a failure keeps it too
                settings = msg[3] if len(msg) > 3 else None
                runners[next_id] = backend.load(
                    source if settings is None else Configured(source, settings))
                reply: tuple = ("ok", next_id)
                next_id += 1
            elif op == "time":
                reply = ("ok", list(runners[msg[1]].time(msg[2], msg[3])))
            elif op == "what_ran":
                reply = ("ok", backend.what_ran(msg[1]))
            elif op == "close_runner":
                runner = runners.pop(msg[1], None)
                if runner is not None:
                    runner.close()
                reply = ("ok", None)
            elif op == "close":
                for runner in runners.values():
                    runner.close()
                runners.clear()
                backend.close()
                _send(channel, ("ok", None))
                break
            else:
                reply = ("err", "BackendError", f"unknown worker request {op!r}")
        except BaseException as exc:
            reply = _error_reply(exc)
        _send(channel, reply)
    channel.close()


def _signal_name(returncode: int | None) -> str:
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            return f"signal {-returncode}, {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit status {returncode}"


def _model_label(model: ModelSource) -> str:
    if isinstance(model, bytes):
        return f"a model of {len(model)} bytes"
    return os.path.basename(os.fspath(model))


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:  # pragma: no cover - unkillable process
        pass


class _Worker:
    """One worker process with reader threads for its replies and its stderr tail."""

    def __init__(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _BOOTSTRAP],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        self.replies: queue.Queue = queue.Queue()
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=30)
        self._finalizer = weakref.finalize(self, _kill, self.proc)
        threading.Thread(target=self._read_replies, daemon=True).start()
        self._stderr_thread = threading.Thread(target=self._read_stderr, daemon=True)
        self._stderr_thread.start()

    def _read_replies(self) -> None:
        stdout = self.proc.stdout
        assert stdout is not None
        while True:
            try:
                msg = _recv(stdout)
            except Exception:  # truncated pickle from a dying worker
                msg = _EOF
            self.replies.put(msg)
            if msg is _EOF:
                return

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr_tail.append(line.decode("utf-8", "replace").rstrip())

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        self._finalizer()
        self._stderr_thread.join(timeout=2)  # collect the crash report's last lines


class IsolatedBackend(Backend):
    """Proxies another backend (given as an importable factory) that lives in a worker."""

    def __init__(
        self,
        factory: Factory,
        *,
        load_timeout_s: float = 600,
        time_timeout_s: float = 600,
        start_timeout_s: float | None = None,
        name: str | None = None,
    ) -> None:
        module, cls_name, kwargs = factory
        self.factory: Factory = (str(module), str(cls_name), dict(kwargs or {}))
        pickle.dumps(self.factory)  # fail here, not in the worker, on unpicklable options
        self.load_timeout_s = float(load_timeout_s)
        self.time_timeout_s = float(time_timeout_s)
        self.start_timeout_s = float(start_timeout_s or load_timeout_s)
        self._name = name
        self._info: dict | None = None
        self._worker: _Worker | None = None
        self._lock = threading.RLock()
        #: keys of the models the current worker keeps (see :data:`KEEP_MODELS`)
        self._kept: collections.OrderedDict = collections.OrderedDict()
        #: bumped on every worker start; runners of an older generation are gone
        self.generation = 0
        self.restarts = 0

    # -- worker lifecycle -------------------------------------------------------------------
    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])  # so the child finds this package
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        return env

    def _ensure_worker(self) -> _Worker:
        if self._worker is not None and self._worker.alive():
            return self._worker
        if self._worker is not None:
            self._worker.kill()
        self._worker = _Worker(self._env())
        self.generation += 1
        self._kept.clear()
        module, cls_name, kwargs = self.factory
        sys_path = [p for p in sys.path if p]
        info = self._exchange(
            ("init", sys_path, module, cls_name, kwargs),
            self.start_timeout_s,
            f"starting {module}.{cls_name}",
        )
        self._info = info
        return self._worker

    def _retire(self, worker: _Worker) -> None:
        if self._worker is worker:
            self._worker = None
        worker.kill()

    def _fail(self, what: str, why: str) -> TransientBackendError:
        worker, self._worker = self._worker, None
        self.restarts += 1
        tail = ""
        if worker is not None:
            worker.kill()
            lines = [ln for ln in worker.stderr_tail if ln.strip()][-8:]
            if lines:
                tail = "; worker stderr: " + " | ".join(lines)
        return TransientBackendError(f"worker {why} while {what}{tail}")

    def _exchange(self, msg: tuple, timeout: float, what: str) -> Any:
        worker = self._worker
        assert worker is not None and worker.proc.stdin is not None
        try:
            _send(worker.proc.stdin, msg)
        except OSError:  # broken pipe: the worker is gone
            try:
                worker.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            raise self._fail(what, f"crashed ({_signal_name(worker.proc.returncode)})") from None
        except BaseException:  # a message cut half-way leaves the worker's stream unreadable
            self._retire(worker)
            raise
        try:
            reply = worker.replies.get(timeout=timeout)
        except queue.Empty:
            raise self._fail(what, f"timed out after {timeout:g} s (killed)") from None
        except BaseException:
            # Ctrl-C or SIGTERM while the worker works: its reply would answer the next call,
            # and a held measurement would keep every later call (closing included) waiting.
            self._retire(worker)
            raise
        if reply is _EOF:
            try:
                worker.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            raise self._fail(what, f"crashed ({_signal_name(worker.proc.returncode)})")
        if reply[0] == "ok":
            return reply[1]
        _, cls_name, text = reply
        if msg[0] == "init":  # the worker exits after a failed start
            self._worker = None
            worker.kill()
        raise _ERRORS.get(cls_name, BackendError)(text)

    def _call(self, msg: tuple, timeout: float, what: str) -> Any:
        with self._lock:
            self._ensure_worker()
            return self._exchange(msg, timeout, what)

    def _ensure_info(self) -> dict:
        with self._lock:
            if self._info is None:
                self._ensure_worker()
            assert self._info is not None
            return self._info

    # -- Backend interface ------------------------------------------------------------------
    @property
    def name(self) -> str:  # type: ignore[override]
        return self._name or self._ensure_info()["name"]

    @property
    def deterministic(self) -> bool:  # type: ignore[override]
        return self._ensure_info()["deterministic"]

    @property
    def fresh_sessions(self) -> bool:  # type: ignore[override]
        return self._ensure_info()["fresh_sessions"]

    @property
    def session_settings(self) -> bool:  # type: ignore[override]
        return bool(self._ensure_info().get("session_settings"))

    def describe(self) -> dict:
        return {**self._ensure_info()["describe"], "isolated": True}

    def worker_generation(self) -> int:
        """Starts the worker if none is running; a new number means a new, cold process
        (timing protocols warm a process up before trusting its figures)."""
        with self._lock:
            self._ensure_worker()
            return self.generation

    def what_ran(self, model: bytes):
        """The worker's backend reads it (a TensorRT engine build belongs in the worker)."""
        return self._call(("what_ran", model), self.load_timeout_s, "reading what ran")

    def worker_pids(self) -> list[int]:
        worker = self._worker
        return [worker.proc.pid] if worker is not None and worker.alive() else []

    def load(self, model: ModelSource | Configured) -> Runner:
        settings = model.settings if isinstance(model, Configured) else None
        if isinstance(model, Configured):
            model = model.model
        with self._lock:
            self._ensure_worker()
            if isinstance(model, bytes):
                key = (hash(model), len(model))  # a bytes object caches its hash
                msg: tuple = (("load_kept", key, None, settings) if key in self._kept
                              else ("load", model, key, settings))
                _keep(self._kept, key)
            else:
                msg = ("load", os.fspath(model), None, settings)
            runner_id = self._exchange(msg, self.load_timeout_s, f"building {_model_label(model)}")
            return _ProxyRunner(self, runner_id, self.generation, _model_label(model))

    def close(self) -> None:
        with self._lock:
            worker, self._worker = self._worker, None
            if worker is None:
                return
            try:
                if worker.alive():
                    self._worker = worker
                    self._exchange(("close",), 60, "closing the backend")
                    self._worker = None
                    worker.proc.wait(timeout=10)
            except (BackendError, subprocess.TimeoutExpired):
                pass
            finally:
                self._worker = None
                worker.kill()


class _ProxyRunner(Runner):
    """A runner living in the worker; invalid once that worker has been restarted."""

    def __init__(self, owner: IsolatedBackend, runner_id: int, generation: int, label: str):
        self.owner = owner
        self.runner_id = runner_id
        self.generation = generation
        self.label = label
        self.closed = False

    def _check(self) -> None:
        if self.closed:
            raise BackendError("runner used after close()")
        if self.generation != self.owner.generation or self.owner._worker is None:
            raise TransientBackendError(
                f"the worker holding {self.label} was restarted; load the model again"
            )

    def time(self, warmup: int, iterations: int) -> list[float]:
        with self.owner._lock:
            self._check()
            return self.owner._exchange(
                ("time", self.runner_id, int(warmup), int(iterations)),
                self.owner.time_timeout_s,
                f"timing {self.label}",
            )

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        owner = self.owner
        with owner._lock:
            if self.generation != owner.generation or owner._worker is None:
                return
            if not owner._worker.alive():
                return
            try:
                owner._exchange(("close_runner", self.runner_id), 60, f"closing {self.label}")
            except BackendError:
                pass
