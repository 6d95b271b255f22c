"""Progress of a tuning run on stderr: bars in a terminal, plain lines in a log.

In a terminal (stderr is a TTY) a run-level bar counts patterns (or a refinement round's
patterns) and a pattern-level bar counts its trials; a finished pattern leaves one summary line
above the bars. Anywhere else (a file, a pipe, a CI log) there are no bars and no carriage
returns: one line per finished pattern, plus a heartbeat line while a long pattern runs.

While a :class:`Progress` is open, log records (the root logger, and Optuna's own handler when
it has one) and Python warnings are written through tqdm, so they never land inside a bar.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
import warnings
from collections.abc import Callable
from typing import IO, Any

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

#: seconds between heartbeat lines of a pattern that is still running (log mode)
HEARTBEAT_S = 60.0


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes} min {secs:02d} s" if minutes < 60 else f"{minutes // 60} h {minutes % 60:02d} min"


class Progress:
    """One run's progress. ``enabled=False`` (``--quiet``, ``progress=False``) prints nothing.

    ``bars`` forces the terminal (True) or the log style (False); by default it follows
    ``stream.isatty()``. Use it as a context manager: it routes logging and warnings while it
    is open and closes its bars when it ends.
    """

    def __init__(self, enabled: bool = True, *, stream: IO[str] | None = None,
                 bars: bool | None = None, heartbeat_s: float = HEARTBEAT_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        if bars is None:
            isatty = getattr(self.stream, "isatty", None)
            bars = bool(isatty and isatty())
        self.bars = bars
        self.heartbeat_s = heartbeat_s
        self.clock = clock
        self._lock = threading.RLock()
        self._stage: tqdm | None = None
        self._stage_desc = ""
        self._stage_total = 0
        self._stage_done = 0
        self._routing: contextlib.ExitStack | None = None

    # -- context: routing of log records and warnings ---------------------------------------
    def __enter__(self) -> Progress:
        if self.enabled and self.bars:
            stack = contextlib.ExitStack()
            loggers = [logging.getLogger()]
            optuna_logger = logging.getLogger("optuna")
            if any(isinstance(h, logging.StreamHandler) for h in optuna_logger.handlers):
                loggers.append(optuna_logger)  # Optuna's default handler (no propagation)
            stack.enter_context(logging_redirect_tqdm(loggers=loggers))
            previous = warnings.showwarning

            def showwarning(*args: Any, **kwargs: Any) -> None:
                with tqdm.external_write_mode(file=self.stream):
                    previous(*args, **kwargs)

            warnings.showwarning = showwarning
            stack.callback(setattr, warnings, "showwarning", previous)
            self._routing = stack
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            if self._stage is not None:
                self._stage.close()
                self._stage = None
        if self._routing is not None:
            self._routing.close()
            self._routing = None

    # -- output ------------------------------------------------------------------------------
    def write(self, line: str) -> None:
        """One line of its own (above the bars in a terminal)."""
        if not self.enabled:
            return
        with self._lock:
            if self.bars:
                tqdm.write(line, file=self.stream)
            else:
                self.stream.write(line + "\n")
                self.stream.flush()

    # -- run level ---------------------------------------------------------------------------
    def stage(self, desc: str, total: int, done: int = 0) -> None:
        """Start a run-level count: ``"patterns"`` for the first pass, ``"refine 1"`` for a
        refinement round; ``done`` of them were finished before (a resumed run)."""
        with self._lock:
            if self._stage is not None:
                self._stage.close()
                self._stage = None
            self._stage_desc, self._stage_total, self._stage_done = desc, total, done
            if self.enabled and self.bars:
                self._stage = tqdm(total=total, initial=done, desc=desc, unit="pattern",
                                   file=self.stream, dynamic_ncols=True)

    def advance(self, n: int = 1) -> None:
        """``n`` more patterns of the current stage are done."""
        with self._lock:
            self._stage_done += n
            if self._stage is not None:
                self._stage.update(n)

    def skip(self, name: str, why: str) -> None:
        """A pattern of the current stage that is not measured: a line that says why (else the
        count seems to stop short), and it counts as done."""
        with self._lock:
            self.write(f"{self._position()}{name}: skipped, {why}")
            self.advance()

    # -- pattern level -----------------------------------------------------------------------
    def pattern(self, name: str, total: int, *, detail: str = "", done: int = 0) -> PatternProgress:
        """Progress of one pattern study of ``total`` trials, ``done`` of them finished before;
        use it as a context manager and call :meth:`PatternProgress.finish` with the result."""
        return PatternProgress(self, name, total, detail=detail, done=done)

    def _position(self) -> str:
        if not self._stage_total:
            return ""
        prefix = "" if self._stage_desc == "patterns" else f"{self._stage_desc} "
        return f"[{prefix}{min(self._stage_done + 1, self._stage_total)}/{self._stage_total}] "


class PatternProgress:
    """One pattern study: a bar of trials (terminal) or heartbeats and a summary line (log)."""

    def __init__(self, owner: Progress, name: str, total: int, *, detail: str, done: int) -> None:
        self.owner = owner
        self.name = name
        self.detail = detail
        self.total = total
        self.trials = done
        self.best = ""
        self.started = owner.clock()
        self._bar: tqdm | None = None
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._finished = False

    @property
    def label(self) -> str:
        return f"{self.name} ({self.detail})" if self.detail else self.name

    def __enter__(self) -> PatternProgress:
        o = self.owner
        if not o.enabled:
            return self
        if o.bars:
            self._bar = tqdm(total=self.total, initial=self.trials, desc=self.label,
                             unit="trial", leave=False, file=o.stream, dynamic_ncols=True)
        elif o.heartbeat_s > 0:
            self._heartbeat = threading.Thread(target=self._beat, name="qdq-heartbeat",
                                               daemon=True)
            self._heartbeat.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
        if self._bar is not None:
            with self.owner._lock:
                self._bar.close()
            self._bar = None

    def trial(self, best: str = "") -> None:
        """One more finished trial; ``best`` (e.g. ``"0.213 ms"``) is shown beside the bar and
        in heartbeats."""
        self.trials += 1
        if best:
            self.best = best
        if self._bar is not None:
            with self.owner._lock:
                self._bar.update(1)
                if best:
                    self._bar.set_postfix_str(f"best {best}", refresh=False)

    def finish(self, gain: float | None = None, note: str = "") -> None:
        """The summary line: what was tuned, trials, gain, elapsed time; counts one pattern
        of the current stage as done."""
        if self._finished:
            return
        self._finished = True
        parts = [f"{self.trials} trial{'s' if self.trials != 1 else ''}"]
        if gain is not None:
            parts.append(f"gain {gain:.3f}x")
        if note:
            parts.append(note)
        parts.append(_duration(self.owner.clock() - self.started))
        self.owner.write(f"{self.owner._position()}{self.label}: {', '.join(parts)}")
        self.owner.advance()

    def _beat(self) -> None:
        while not self._stop.wait(self.owner.heartbeat_s):
            elapsed = _duration(self.owner.clock() - self.started)
            best = f", best {self.best}" if self.best else ""
            self.owner.write(f"{self.owner._position()}{self.label}: still running, "
                             f"{self.trials}/{self.total} trials{best}, {elapsed}")
