"""What a run shows while it works: one bar over the patterns, one per pattern study (tqdm).

The search talks to :class:`Progress` only, so how progress is shown can change in one place.
"""

from __future__ import annotations

import contextlib


class Progress:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def patterns(self, total: int) -> Bar:
        """The run's bar: one step per pattern of the first pass."""
        return Bar(self.enabled, total=total, desc="patterns", unit="pattern")

    def pattern(self, pattern_id: str, rnd: int, regions: int, points: int, *, budget: int,
                done: int, reference_ms: float) -> Bar:
        """A pattern study's bar: one step per finished trial, up to its budget."""
        bar = Bar(self.enabled, total=budget, leave=False, unit="trial",
                  desc=f"{pattern_id}{f' refine{rnd}' if rnd else ''} "
                       f"({regions} regions, {points} points)")
        bar.reference_ms = reference_ms
        bar.step(done)
        return bar


class Bar:
    """A tqdm bar, or nothing at all when progress is off."""

    def __init__(self, enabled: bool, **kwargs) -> None:
        self.tqdm = None
        self.reference_ms: float | None = None
        if enabled:
            from tqdm.auto import tqdm

            self.tqdm = tqdm(**kwargs)

    def step(self, n: int = 1) -> None:
        if self.tqdm is not None:
            self.tqdm.update(n)

    def trial_done(self, study) -> None:
        """One more finished trial; shows the study's best latency against the reference."""
        if self.tqdm is None:
            return
        self.tqdm.update(1)
        with contextlib.suppress(ValueError, RuntimeError):  # none feasible / 2 objectives
            self.tqdm.set_postfix(best=f"{study.best_value:.3f}ms", ref=f"{self.reference_ms:.3f}ms")

    def close(self) -> None:
        if self.tqdm is not None:
            self.tqdm.close()
