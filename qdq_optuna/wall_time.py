"""Where a run's wall time went: seconds per phase (and per step inside a phase), and the
sessions the timing created in it.

Why: a run's time is only worth what it decides. A phase that spends a minute and changes
nothing (a descent with no commit, a repair of a start that still loses to float) is what
to cut; without the figures per phase nobody can tell which one it is. report.json
``wall_time`` and report.md's "Where the time went" table are built from :meth:`WallTime.to_dict`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class PhaseTime:
    """One phase: its seconds, its steps' seconds, the timing sessions it created."""

    seconds: float = 0.0
    steps: dict[str, float] = field(default_factory=dict)
    #: the timing's counters over the phase (sessions created, their seconds, timed runs)
    timing: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict:
        out: dict = {"seconds": round(self.seconds, 2)}
        if self.steps:
            out["steps"] = {k: round(v, 2) for k, v in self.steps.items()}
        if any(self.timing.values()):
            out["timing"] = {k: round(v, 2) if isinstance(v, float) else v
                             for k, v in self.timing.items()}
        return out


class WallTime:
    """Phases in the order they ran. ``counters``: the timing's running totals (a
    :meth:`~qdq_optuna.measure.timing.Measurer.counters`), read at each :meth:`lap`."""

    def __init__(self, counters: Callable[[], dict] | None = None) -> None:
        self.phases: dict[str, PhaseTime] = {}
        self.counters = counters
        #: where the current lap began (:meth:`lap`), and the counters then
        self._lap_at = time.perf_counter()
        self._lap_counters: dict = {}
        #: per open step, the seconds of the steps inside it
        self._inner: list[float] = []

    def lap(self, name: str) -> float:
        """End the phase ``name`` now: the seconds since the last lap (or since this clock
        was made) and the timing's counters over them are added to it; returns the seconds."""
        now = time.perf_counter()
        seconds, self._lap_at = now - self._lap_at, now
        entry = self._phase(name)
        entry.seconds += seconds
        if self.counters is not None:
            after = self.counters()
            _add_counters(entry, self._lap_counters, after)
            self._lap_counters = after
        return seconds

    def _phase(self, name: str) -> PhaseTime:
        return self.phases.setdefault(name, PhaseTime())

    @contextmanager
    def step(self, phase: str, step: str) -> Iterator[None]:
        """Time one step inside ``phase`` (the phase's own seconds are its :meth:`lap`'s).
        Steps are disjoint: a step inside another (a repaired start's timing inside the
        repair) counts for itself only, not for the outer one too."""
        t0 = time.perf_counter()
        self._inner.append(0.0)
        try:
            yield
        finally:
            seconds = time.perf_counter() - t0
            inner = self._inner.pop()
            if self._inner:
                self._inner[-1] += seconds
            self.add(phase, step, seconds - inner)

    def add(self, phase: str, step: str, seconds: float) -> None:
        entry = self._phase(phase)
        entry.steps[step] = entry.steps.get(step, 0.0) + seconds

    def to_dict(self) -> dict:
        """``{phase: {"seconds", "steps", "timing"}}``; a phase timed only by its steps has
        their sum as its seconds."""
        out = {}
        for name, entry in self.phases.items():
            if not entry.seconds and entry.steps:
                entry = PhaseTime(sum(entry.steps.values()), entry.steps, entry.timing)
            out[name] = entry.to_dict()
        return out


def _add_counters(entry: PhaseTime, before: dict, after: dict) -> None:
    """Add the counters' growth from ``before`` to ``after`` to ``entry.timing``."""
    for key, value in after.items():
        if isinstance(value, (int, float)):
            entry.timing[key] = entry.timing.get(key, 0) + value - before.get(key, 0)
