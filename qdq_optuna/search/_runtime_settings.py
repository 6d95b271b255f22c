"""The session settings the shipped model runs with: a runtime's own graph optimizer can undo
or worsen a placement at session creation, and no placement can prevent it; a session setting
can. The runtime's profile lists the candidate settings (``Runtime.session_settings``); each
one that changes what the runtime runs for the model that ships is A/B-timed against the
model's default sessions, and the fastest one that is faster beyond noise and keeps the
accuracy bound ships with the model: the final A/B measures the model under it, and the
report gives the line a deployment adds where it creates its session.

Why: ONNX Runtime's ``QDQPropagationTransformer`` moves a QuantizeLinear in front of a
MaxPool that follows a float op, and the uint8 MaxPool then runs in a slow NCHW kernel; ONNX
Runtime's own ``quantize_static`` file of Inception v1 ran at 0.950x its latency (interval
0.940-0.961) with that one optimizer disabled (``benchmarks/session_settings.py``, a 2-core
Xeon with AVX512-VNNI and AMX), and nothing in a placement can say so.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from enum import Enum

from qdq_optuna.backends.base import BackendError, Configured, SessionSettings
from qdq_optuna.measure.accuracy import AccuracyError
from qdq_optuna.measure.bound import AccuracyBound

log = logging.getLogger("qdq_optuna")


class SettingsDecision(str, Enum):
    """What became of one candidate setting (report.json ``session_settings.candidates``)."""

    SHIPS = "ships"
    NOT_FASTER = "not faster beyond noise"
    SLOWER_THAN_ANOTHER = "another setting measured faster"
    SAME_KERNELS = "the runtime runs the same kernels with and without it"
    PAST_BOUND = "the output error under it is past the bound"
    NOT_SCORED = "the accuracy guard cannot run the model under it"
    FAILED = "the runtime refused it"
    BASELINE_SHIPS = "the baseline ships (the tuned model measured slower than it)"
    OUT_OF_TIME = "not timed: the run's time was up"


@dataclass
class SettingsTrial:
    """One candidate setting tried on the shipped model."""

    settings: SessionSettings
    decision: SettingsDecision
    #: the A/B: latency with the setting / without it (None: not timed)
    ratio: float | None = None
    ci: tuple[float, float] | None = None
    #: the guard's error of the model run with the setting (None: not scored)
    error: float | None = None
    detail: str = ""

    def to_dict(self) -> dict:
        out = {**self.settings.to_dict(), "decision": self.decision.value}
        if self.ratio is not None:
            out["ratio"] = self.ratio
            out["ci"] = list(self.ci) if self.ci else None
        if self.error is not None:
            out["error"] = self.error
        if self.detail:
            out["detail"] = self.detail
        return out


@dataclass
class SettingsChoice:
    """The settings that ship (None: the runtime's defaults) and every candidate's fate."""

    shipped: SessionSettings | None = None
    trials: list[SettingsTrial] = field(default_factory=list)
    #: whether the runtime's profile lists any (report.json has no key where it lists none)
    listed: bool = True

    def baseline_ships(self) -> None:
        """The user's model ships instead of the tuned one: as a user runs it, no settings."""
        for t in self.trials:
            if t.settings == self.shipped:
                t.decision = SettingsDecision.BASELINE_SHIPS
        self.shipped = None

    def source(self, model):
        """What the final A/B times: ``model`` under the shipped settings."""
        return model if self.shipped is None else Configured(model, self.shipped)

    def to_dict(self) -> dict:
        return {"shipped": None if self.shipped is None else self.shipped.to_dict(),
                "candidates": [t.to_dict() for t in self.trials]}

    def report(self) -> dict | None:
        """report.json's ``session_settings`` (None: the runtime lists no settings)."""
        return self.to_dict() if self.listed else None


def choose_settings(profile, backend, plans, bound: AccuracyBound, model) -> SettingsChoice:
    """Each of ``profile.session_settings`` tried on ``model`` (the bytes that ship): skipped
    where the runtime runs the same kernels under it (nothing to time), else A/B-timed against
    the default sessions (``plans``, phase ``final``) and scored by its error scorer against the accuracy ``bound``;
    the fastest one faster beyond noise within the bound ships."""
    candidates = profile.session_settings
    choice = SettingsChoice(listed=bool(candidates))
    if not candidates or not isinstance(model, bytes) or not backend.session_settings \
            or plans.deterministic:
        return choice
    for settings in candidates:
        choice.trials.append(_try(profile, plans, bound, model, settings))
    faster = [t for t in choice.trials if t.decision is SettingsDecision.SHIPS]
    if faster:
        best = min(faster, key=lambda t: t.ratio)
        for t in faster:
            if t is not best:
                t.decision = SettingsDecision.SLOWER_THAN_ANOTHER
        choice.shipped = best.settings
        log.info("session settings %s: the shipped model measured %.3fx its latency with "
                 "them (interval %.3f-%.3f); it ships with them", best.settings.name,
                 best.ratio, *best.ci)
    return choice


def _try(profile, plans, bound: AccuracyBound, model: bytes,
         settings: SessionSettings) -> SettingsTrial:
    if plans.measurer.out_of_time():  # --timeout: the final A/B gets what is left
        return SettingsTrial(settings, SettingsDecision.OUT_OF_TIME)
    try:
        if not profile.settings_matter(model, settings):
            return SettingsTrial(settings, SettingsDecision.SAME_KERNELS)
        cmp = plans.compare(Configured(model, settings), model, "final")
    except BackendError as exc:
        return SettingsTrial(settings, SettingsDecision.FAILED, detail=str(exc))
    trial = SettingsTrial(settings, SettingsDecision.NOT_FASTER, ratio=cmp.ratio,
                          ci=(cmp.ci_low, cmp.ci_high))
    if cmp.ci_high >= 1.0:  # not faster beyond noise
        return trial
    try:
        trial.error = plans.scorer.error_under(model, settings.entries)
    except AccuracyError as exc:
        trial.decision, trial.detail = SettingsDecision.FAILED, str(exc)
        return trial
    if trial.error is None:
        trial.decision = SettingsDecision.NOT_SCORED
    elif not bound.allows(trial.error):
        trial.decision = SettingsDecision.PAST_BOUND
    else:
        trial.decision = SettingsDecision.SHIPS
    return trial
