"""Timing protocol: screening, interleaved A/B comparison with confidence intervals, top-k.

Why it looks like this (measured on 2-core CI-class machines, see the project notes): single
medians drift 10-20 % between repeats, so candidates that differ by less than that cannot be
ranked by timing them one after the other. What holds up:

* fresh sessions interleaved round-robin with the other candidates, so slow drifts (CPU
  frequency, neighbours, cache state) hit every candidate alike;
* each session scored by its *minimum* (noise only ever adds time), a model by the median of its
  session minimums; medians of raw runs are about twice as noisy;
* comparisons as paired per-round ratios, with a t interval on their logs and an adaptive number
  of rounds. The interval is widened for the repeated looks (Pocock boundaries), so stopping as
  soon as it excludes 1 does not inflate false "faster" verdicts;
* the process warmed up before the first figure (a fresh process reads 10-15 % off), and every
  round checked for other busy processes (``/proc/stat``) and re-measured once when it was not
  quiet.

What the search does with the figures lives here too: the screen that drops far-off candidates
(:data:`SCREEN_DISCARD_RATIO`) and the rule a measured candidate must pass to replace its
reference (:class:`CommitRule`).
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from enum import Enum
from typing import Any

from qdq_optuna.backends.base import Backend, BackendError, Configured, ModelSource, Runner
from qdq_optuna.errors import OptionChoice, OptionError

log = logging.getLogger(__name__)

__all__ = [
    "SCREEN_DISCARD_RATIO",
    "Comparison",
    "Measurement",
    "Measurer",
    "QuietProbe",
    "TimingProtocol",
    "ratio_interval",
    "t_quantile",
]

#: robust timing: a candidate whose one-session screen reads more than this many times the
#: reference's screen (checked against a fresh screen of the reference before discarding) is
#: *screened out*: no A/B comparison, its value is the screen estimate, flagged ``screened_out``.
#: A single screen resolves 14-24 % differences, so 1.3 only drops candidates far off; a
#: screened-out trial can never be committed (a commit needs an interleaved confirmation).
SCREEN_DISCARD_RATIO = 1.3
#: an interleaved A/B stops re-measuring busy rounds after this many repeats in a row were busy
#: too: the machine is loaded for good and a repeat only doubles the round's cost (a real
#: YOLOv8n's A/B took 74 s instead of about 35 s at load average 5 on 2 cores)
BUSY_STREAK = 2
#: rounds an A/B takes past :attr:`Measurer.deadline`: two leave one degree of freedom, and
#: Inception v1's final A/B cut at two read "1.07x, interval 0.00-10^13"
CUT_SHORT_ROUNDS = 3


def far_off(candidate_ms: float, reference_ms: float) -> bool:
    """Whether a candidate's screen is too slow against the reference's to be worth an A/B."""
    return candidate_ms > SCREEN_DISCARD_RATIO * reference_ms


def _r(x: float) -> float:
    return round(float(x), 6)


@dataclass
class Measurement:
    """One model's timing. ``score_ms`` is what candidates are ranked by."""

    score_ms: float
    median_ms: float
    min_ms: float
    #: per-session minimums (one per fresh session / round), in measurement order
    samples_ms: list[float]
    sessions: int
    #: timed inferences behind this figure
    runs: int
    #: within-session coefficient of variation (median over sessions)
    cv: float
    #: False when another process was busy during a round even after re-measuring it
    quiet: bool
    seconds: float
    #: rounds measured twice because the machine was busy
    remeasured: int = 0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for key in ("score_ms", "median_ms", "min_ms", "cv", "seconds"):
            d[key] = _r(d[key])
        d["samples_ms"] = [_r(x) for x in self.samples_ms]
        return d


@dataclass
class Comparison:
    """Candidate vs reference: ``ratio`` < 1 means the candidate is faster."""

    #: geometric mean of the per-round paired ratios candidate / reference
    ratio: float
    ci_low: float
    ci_high: float
    candidate: Measurement
    reference: Measurement
    rounds: int
    #: True when the stopping rule fired (interval excludes 1 or is narrow enough);
    #: False when ``max_rounds`` ran out first or the comparison gave up
    decided: bool
    #: per-round paired ratios
    ratios: list[float] = field(default_factory=list)
    #: nominal level of the interval (simultaneous over the looks taken)
    confidence: float = 0.95
    #: stopped early because the candidate was not faster at all (TimingProtocol.give_up_at)
    gave_up: bool = False
    #: candidate and reference are the same file: nothing was compared, the model was
    #: measured once (:meth:`Measurer.same_model`)
    same_model: bool = False
    #: stopped at fewer rounds than the protocol asks because the run's time was up
    #: (:attr:`Measurer.deadline`): the interval is what those rounds give
    cut_short: bool = False

    @property
    def significant(self) -> bool:
        """The interval excludes 1: the two models really differ."""
        return self.ci_high < 1.0 or self.ci_low > 1.0

    @property
    def verdict(self) -> str:
        if self.ci_high < 1.0:
            return "faster"
        if self.ci_low > 1.0:
            return "slower"
        if self.same_model:
            return "same model"
        if self.gave_up:
            return "not faster"
        return "same" if self.decided else "undecided"

    def turned(self) -> Comparison:
        """The same A/B read the other way round (reference / candidate). A comparison that
        gave up (the candidate not faster at all) reads as decided: the reference is not
        slower."""
        def turn(x: float) -> float:
            return 1.0 / x if x > 0 else math.inf

        return Comparison(
            ratio=turn(self.ratio), ci_low=turn(self.ci_high), ci_high=turn(self.ci_low),
            candidate=self.reference, reference=self.candidate, rounds=self.rounds,
            decided=self.decided or self.gave_up, ratios=[turn(x) for x in self.ratios],
            confidence=self.confidence, same_model=self.same_model, cut_short=self.cut_short)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ratio": _r(self.ratio),
            "ci_low": _r(self.ci_low),
            "ci_high": _r(self.ci_high),
            "rounds": self.rounds,
            "decided": self.decided,
            "gave_up": self.gave_up,
            "same_model": self.same_model,
            "cut_short": self.cut_short,
            "verdict": self.verdict,
            "confidence": self.confidence,
            "ratios": [_r(x) for x in self.ratios],
            "candidate": self.candidate.to_dict(),
            "reference": self.reference.to_dict(),
        }


class Timing(OptionChoice):
    """How much a run measures (``--timing``): the preset :class:`TimingProtocol` it uses."""

    __option__ = "--timing"

    #: one short timing per candidate and no A/B, for a quiet, dedicated machine
    FAST = "fast"
    #: every candidate A/B-compared with its reference in interleaved fresh sessions
    ROBUST = "robust"


@dataclass(frozen=True)
class TimingProtocol:
    """How much to measure. Use :meth:`fast` or :meth:`robust` unless you have figures."""

    name: str = Timing.ROBUST.value
    #: fresh sessions per model in :meth:`Measurer.measure`
    sessions: int = 5
    warmup: int = 5
    runs: int = 20
    screen_warmup: int = 5
    screen_runs: int = 20
    #: sessions per model in :meth:`Measurer.interleaved` (final top-k)
    final_sessions: int = 8
    min_rounds: int = 3
    max_rounds: int = 12
    #: stop comparing once the interval's relative half-width is below this
    target: float = 0.015
    #: ranking (``until="verdict"``): after this fraction of ``max_rounds``, stop when the
    #: candidate is not faster at all (paired ratio >= 1); it would almost never end faster,
    #: and a move with no effect no longer costs every round (None: never give up)
    give_up_at: float | None = 0.5
    confidence: float = 0.95
    #: rounds thrown away once per process before the first figure
    process_warmup_rounds: int = 2
    #: warm up again after this long without measuring (None: never)
    rewarm_after_s: float | None = 60.0
    #: a measurement of models (:meth:`Measurer.interleaved`, :meth:`Measurer.compare`) first
    #: throws away one session of each when one of them was not timed in this process yet or
    #: nothing was timed for this long (the worker idled while the search built, exported or
    #: scored models): such first sessions read slow, and the float start, the baseline's own
    #: model, read 0.77-0.87x of the baseline measured right after its warm-up (None: never)
    model_warmup_after_s: float | None = 2.0
    #: CPU used by other processes, in cores, above which a round counts as not quiet
    quiet_threshold: float = 0.25
    remeasure_noisy: bool = True
    #: once the run's model latency is known (:meth:`Measurer.pace`, the baseline's), a
    #: session times ``ceil(session_budget_s / latency)`` runs, at least ``min_runs`` and at
    #: most ``runs`` (``screen_runs`` likewise): a session is scored by its fastest run, and
    #: on a 25 ms pair 11 runs found it as well as 20 (``benchmarks/timing_protocol.py
    #: --rows 2560 --timing robust robust@session_budget_s=none``); fewer runs were not
    #: checked, hence ``min_runs`` 12. None: always ``runs``
    session_budget_s: float | None = 0.3
    min_runs: int = 12

    def __post_init__(self) -> None:
        ints = ("sessions", "runs", "screen_runs", "final_sessions", "min_rounds", "max_rounds",
                "min_runs")
        for key in ints:
            if int(getattr(self, key)) < 1:
                raise OptionError(f"timing protocol: {key} must be >= 1")
        for key in ("warmup", "screen_warmup", "process_warmup_rounds"):
            if int(getattr(self, key)) < 0:
                raise OptionError(f"timing protocol: {key} must be >= 0")
        if self.min_rounds > self.max_rounds:
            raise OptionError("timing protocol: min_rounds must be <= max_rounds")
        if not 0.5 < self.confidence < 1:
            raise OptionError("timing protocol: confidence must be in (0.5, 1)")
        if self.target <= 0:
            raise OptionError("timing protocol: target must be > 0")
        if self.give_up_at is not None and not 0 < self.give_up_at <= 1:
            raise OptionError("timing protocol: give_up_at must be in (0, 1] or None")
        if self.session_budget_s is not None and self.session_budget_s <= 0:
            raise OptionError("timing protocol: session_budget_s must be > 0 or None")

    def paced(self, runs: int, latency_ms: float | None) -> int:
        """Timed runs of a session, ``runs`` paced by the model latency ``latency_ms`` (see
        :attr:`session_budget_s`; None: not known yet, ``runs``)."""
        if self.session_budget_s is None or not latency_ms or latency_ms <= 0:
            return runs
        wanted = math.ceil(self.session_budget_s * 1000.0 / latency_ms)
        return max(min(self.min_runs, runs), min(runs, wanted))

    @classmethod
    def fast(cls) -> TimingProtocol:
        """Screen-like: one short session per model; resolves only ~15-25 % differences."""
        return cls(
            name=Timing.FAST.value,
            sessions=1,
            warmup=3,
            runs=15,
            screen_warmup=3,
            screen_runs=15,
            final_sessions=2,
            min_rounds=2,
            max_rounds=4,
            target=0.03,
            process_warmup_rounds=1,
        )

    @classmethod
    def robust(cls) -> TimingProtocol:
        """Interleaved fresh sessions; p95 ratio error ~2 % on a quiet 2-core machine."""
        return cls(name=Timing.ROBUST.value)

    @classmethod
    def from_name(cls, name: str | Timing) -> TimingProtocol:
        return {Timing.FAST: cls.fast, Timing.ROBUST: cls.robust}[Timing.parse(name)]()

    def with_(self, **changes: Any) -> TimingProtocol:
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# -- statistics ------------------------------------------------------------------------------


def _t_two_sided_mass(t: float, df: int) -> float:
    """P(|T| < t) for Student's t with integer ``df`` (exact finite series)."""
    theta = math.atan(t / math.sqrt(df))
    c2 = math.cos(theta) ** 2
    if df % 2 == 1:
        acc, term = 0.0, 1.0
        if df > 1:
            acc = term
            for k in range(1, (df - 3) // 2 + 1):
                term *= c2 * (2 * k) / (2 * k + 1)
                acc += term
            acc *= math.sin(theta) * math.cos(theta)
        return 2 / math.pi * (theta + acc)
    acc, term = 1.0, 1.0
    for k in range(1, (df - 2) // 2 + 1):
        term *= c2 * (2 * k - 1) / (2 * k)
        acc += term
    return math.sin(theta) * acc


def t_quantile(p: float, df: int) -> float:
    """Two-sided critical value: P(|T| < t) = ``p``. No scipy needed."""
    if df < 1:
        raise ValueError("df must be >= 1")
    lo, hi = 0.0, 1.0
    while _t_two_sided_mass(hi, df) < p:
        hi *= 2
    for _ in range(100):
        mid = (lo + hi) / 2
        if _t_two_sided_mass(mid, df) < p:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


# Pocock critical z values for an overall two-sided 5 % level with K equally spaced looks.
_POCOCK_Z = {
    1: 1.960,
    2: 2.178,
    3: 2.289,
    4: 2.361,
    5: 2.413,
    6: 2.453,
    7: 2.485,
    8: 2.512,
    9: 2.535,
    10: 2.555,
    11: 2.572,
    12: 2.588,
    15: 2.626,
    20: 2.672,
}


def per_look_confidence(confidence: float, looks: int) -> float:
    """Confidence each look must use so that ``looks`` looks keep ``confidence`` overall."""
    looks = max(1, looks)
    if looks == 1:
        return confidence
    if abs(confidence - 0.95) < 1e-9:
        keys = sorted(_POCOCK_Z)
        k = next((k for k in keys if k >= looks), None)
        z = _POCOCK_Z[k] if k is not None else _POCOCK_Z[20] + 0.1 * math.log(looks / 20)
        return 2 * statistics.NormalDist().cdf(z) - 1
    return 1 - (1 - confidence) / looks  # Bonferroni: conservative, any level


def ratio_interval(ratios: Sequence[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """Geometric-mean ratio and its t interval (on log ratios): ``(center, low, high)``."""
    logs = [math.log(r) for r in ratios]
    n = len(logs)
    mean = statistics.fmean(logs)
    if n < 2:
        return math.exp(mean), 0.0, math.inf
    sd = statistics.stdev(logs)
    half = t_quantile(confidence, n - 1) * sd / math.sqrt(n)
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def paired_comparison(candidate: Measurement, reference: Measurement,
                      protocol: TimingProtocol) -> Comparison | None:
    """The A/B two models had when :meth:`Measurer.interleaved` timed them in the same rounds
    (fresh sessions of each in every round): their per-round ratios, the interval at the
    level of one look of :meth:`Measurer.compare`, so a confirmation here is as strict as one
    there (None: under two rounds, or rounds that do not pair)."""
    if len(candidate.samples_ms) != len(reference.samples_ms) or len(candidate.samples_ms) < 2:
        return None
    ratios = [max(c, 1e-9) / max(r, 1e-9)
              for c, r in zip(candidate.samples_ms, reference.samples_ms)]
    level = per_look_confidence(protocol.confidence, protocol.max_rounds - protocol.min_rounds + 1)
    center, lo, hi = ratio_interval(ratios, level)
    return Comparison(ratio=center, ci_low=lo, ci_high=hi, candidate=candidate,
                      reference=reference, rounds=len(ratios), decided=hi < 1.0 or lo > 1.0,
                      ratios=ratios, confidence=protocol.confidence)


# -- quietness -------------------------------------------------------------------------------


def _read_proc_stat_busy() -> int:
    with open("/proc/stat") as f:
        parts = f.readline().split()
    # user nice system idle iowait irq softirq steal [guest guest_nice]: guest is within user;
    # steal counts as busy because a hypervisor neighbour slows us just the same
    vals = [int(x) for x in parts[1:9]]
    return vals[0] + vals[1] + vals[2] + vals[5] + vals[6] + vals[7]


def _proc_cpu_jiffies(pid: int | str, children: bool) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return 0
    rest = text[text.rfind(")") + 2 :].split()
    total = int(rest[11]) + int(rest[12])  # utime, stime
    if children:
        total += int(rest[13]) + int(rest[14])  # waited-for children
    return total


class QuietProbe:
    """Tells whether other processes used the CPU while we measured (Linux ``/proc``)."""

    def __init__(
        self,
        threshold_cores: float = 0.25,
        pids: Callable[[], Sequence[int]] = lambda: (),
    ) -> None:
        self.threshold = threshold_cores
        self.pids = pids
        self.available = os.path.exists("/proc/stat") and os.path.exists("/proc/self/stat")
        self.hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.last_other_cores = 0.0

    def _own(self) -> int:
        return _proc_cpu_jiffies("self", True) + sum(
            _proc_cpu_jiffies(p, False) for p in self.pids()
        )

    def start(self) -> tuple[float, int, int] | None:
        if not self.available:
            return None
        return time.perf_counter(), _read_proc_stat_busy(), self._own()

    def stop(self, token: tuple[float, int, int] | None) -> bool:
        if token is None:
            return True
        t0, busy0, own0 = token
        wall = max(time.perf_counter() - t0, 1e-3)
        others = (_read_proc_stat_busy() - busy0) - (self._own() - own0)
        # jiffies are coarse: allow two ticks of rounding before blaming anyone
        others = max(0, others - 2)
        self.last_other_cores = others / self.hz / wall
        return self.last_other_cores <= self.threshold


# -- the measurer ----------------------------------------------------------------------------


@dataclass
class _Acc:
    """Per-model accumulator across rounds."""

    mins: list[float] = field(default_factory=list)
    raw: list[float] = field(default_factory=list)
    cvs: list[float] = field(default_factory=list)
    runs: int = 0

    def add(self, samples: list[float]) -> None:
        self.mins.append(min(samples))
        self.raw.extend(samples)
        self.runs += len(samples)
        if len(samples) > 1:
            mean = statistics.fmean(samples)
            self.cvs.append(statistics.stdev(samples) / mean if mean > 0 else 0.0)

    def measurement(self, quiet: bool, seconds: float, remeasured: int) -> Measurement:
        return Measurement(
            score_ms=statistics.median(self.mins),
            median_ms=statistics.median(self.raw),
            min_ms=min(self.raw),
            samples_ms=list(self.mins),
            sessions=len(self.mins),
            runs=self.runs,
            cv=statistics.median(self.cvs) if self.cvs else 0.0,
            quiet=quiet,
            seconds=seconds,
            remeasured=remeasured,
        )


def _as_source(model: Any) -> ModelSource | Configured:
    if isinstance(model, (bytes, str, os.PathLike, Configured)):
        return model
    if hasattr(model, "SerializeToString"):  # onnx.ModelProto
        return model.SerializeToString()
    raise TypeError(f"expected model bytes, a path or a ModelProto, got {type(model).__name__}")


def _key(model: ModelSource | Configured):
    """A model as :attr:`Measurer._seen` knows it: its path, or its bytes' length and hash
    (and its session settings)."""
    if isinstance(model, Configured):
        return _key(model.model), model.settings.entries
    if isinstance(model, (str, os.PathLike)):
        return os.fspath(model)
    return len(model), hash(model)



class Until(str, Enum):
    """When an A/B comparison stops (:meth:`Measurer.compare`)."""

    #: ranking candidates: as soon as the interval excludes 1 or is narrow enough
    VERDICT = "verdict"
    #: a figure to report: at least ``final_sessions`` rounds, and only once it is that narrow
    PRECISION = "precision"


class Measurer:
    """Applies a :class:`TimingProtocol` to any :class:`Backend`.

    ``loads`` counts sessions / engines built and ``timed_runs`` timed inferences, warm-up
    rounds included, so callers can report what the measurements cost.
    """

    def __init__(self, backend: Backend, protocol: TimingProtocol | None = None) -> None:
        self.backend = backend
        self.protocol = protocol or TimingProtocol.robust()
        self.loads = 0
        self.timed_runs = 0
        self.remeasured = 0
        #: seconds spent creating sessions (``load``) and in timed and warm-up runs (``time``)
        self.load_s = 0.0
        self.timing_s = 0.0
        self.probe = QuietProbe(self.protocol.quiet_threshold, pids=backend.worker_pids)
        self._warm_at: float | None = None
        #: the backend's worker process that the warm-up was done in (isolated backends)
        self._warm_generation: int | None = None
        self._last_model: ModelSource | None = None
        #: ``time.monotonic()`` past which measurements take their minimum rounds (an A/B
        #: :data:`CUT_SHORT_ROUNDS`, a model one session) and re-measure no busy round (None: no limit). A ``--timeout``
        #: run's conclusion once spent 560 s past its deadline in full-length A/Bs.
        self.deadline: float | None = None
        #: seconds the last session took (load, warm-up and timed runs): what a round costs
        self.session_s: float | None = None
        #: the models timed in this process (:func:`_key`), oldest first
        self._seen: dict = {}
        #: the latency sessions are paced by (:meth:`pace`; None: every session ``runs``)
        self.paced_ms: float | None = None

    def pace(self, latency_ms: float | None) -> None:
        """Pace every later session by ``latency_ms`` (``TimingProtocol.session_budget_s``):
        the run's baseline, so every model of a run, and every worker of it, times the same
        number of runs (a minimum over fewer runs reads higher: two sides of an A/B must
        time alike)."""
        self.paced_ms = latency_ms if latency_ms and latency_ms > 0 else None

    def _runs(self, runs: int) -> int:
        return self.protocol.paced(runs, self.paced_ms)

    def out_of_time(self) -> bool:
        """Past :attr:`deadline`."""
        return self.deadline is not None and time.monotonic() > self.deadline

    # -- low level ---------------------------------------------------------------------------
    @property
    def deterministic(self) -> bool:
        return bool(getattr(self.backend, "deterministic", False))

    @property
    def fresh(self) -> bool:
        return bool(getattr(self.backend, "fresh_sessions", True))

    def _load(self, model: ModelSource) -> Runner:
        t0 = time.perf_counter()
        runner = self.backend.load(model)
        self.load_s += time.perf_counter() - t0
        self.loads += 1
        return runner

    def _time(self, runner: Runner, warmup: int, runs: int) -> list[float]:
        t0 = time.perf_counter()
        samples = [float(x) for x in runner.time(warmup, runs)]
        self.timing_s += time.perf_counter() - t0
        if not samples or not all(math.isfinite(x) and x >= 0 for x in samples):
            raise BackendError(f"backend {self.backend.name!r} returned bad timings {samples!r}")
        self.timed_runs += len(samples)
        self._warm_at = time.monotonic()
        return samples

    def _session(self, model: ModelSource, warmup: int, runs: int, runners: dict | None):
        """One fresh session (or one more ``time`` call on a kept runner)."""
        t0 = time.monotonic()
        if runners is not None:
            out = self._time(runners[id(model)], warmup, runs)
        else:
            runner = self._load(model)
            try:
                out = self._time(runner, warmup, runs)
            finally:
                runner.close()
        self.session_s = time.monotonic() - t0
        self._seen[_key(model)] = None
        if len(self._seen) > 512:  # the oldest go: a model timed long ago is cold again
            del self._seen[next(iter(self._seen))]
        return out

    def _round(self, models: Sequence[ModelSource], warmup: int, runs: int, runners,
               repeat: bool = True):
        """Time each model once; re-measure the round once if the machine was busy (and
        ``repeat``: an A/B whose interval already separates does not repeat its rounds)."""
        attempts = 2 if self.protocol.remeasure_noisy and repeat and not self.out_of_time() else 1
        best: tuple[float, list] | None = None
        for attempt in range(attempts):
            token = self.probe.start()
            out = [self._session(m, warmup, runs, runners) for m in models]
            if self.probe.stop(token):
                return out, True, attempt
            others = self.probe.last_other_cores
            log.debug("machine busy (%.2f cores used by others); round %d", others, attempt)
            if best is None or others < best[0]:
                best = (others, out)  # keep the less disturbed attempt
        assert best is not None
        return best[1], False, attempts - 1

    def _open_all(self, models: Sequence[ModelSource]) -> dict | None:
        if self.fresh:
            return None
        runners: dict[int, Runner] = {}
        try:
            for m in models:
                if id(m) not in runners:
                    runners[id(m)] = self._load(m)
        except BaseException:
            self._close_all(runners)
            raise
        return runners

    @staticmethod
    def _close_all(runners: dict | None) -> None:
        for r in (runners or {}).values():
            try:
                r.close()
            except Exception:  # closing must not mask the measurement's own error
                log.debug("closing a runner failed", exc_info=True)

    def _deterministic(self, model: ModelSource) -> Measurement:
        t0 = time.perf_counter()
        runner = self._load(model)
        try:
            value = self._time(runner, 0, 1)[0]
        finally:
            runner.close()
        return Measurement(value, value, value, [value], 1, 1, 0.0, True, time.perf_counter() - t0)

    # -- warm-up -----------------------------------------------------------------------------
    def _generation(self) -> int | None:
        fn = getattr(self.backend, "worker_generation", None)
        return fn() if callable(fn) else None

    def _warm_rounds(self, force: bool = False, models: Sequence[ModelSource] = ()) -> int:
        """Rounds to throw away before measuring ``models``: the process's first ones, after
        a long idle one, and one before models not timed yet or after a short idle
        (``protocol.model_warmup_after_s``; ``models`` empty: the process rules only)."""
        p = self.protocol
        if self.deterministic:
            return 0
        if force or self._warm_at is None or self._generation() != self._warm_generation:
            return p.process_warmup_rounds  # a new worker process is as cold as a new process
        idle = time.monotonic() - self._warm_at
        if p.rewarm_after_s is not None and idle > p.rewarm_after_s:
            return min(1, p.process_warmup_rounds)
        if models and p.model_warmup_after_s is not None and (
                idle > p.model_warmup_after_s or self._unseen(models)):
            return min(1, p.process_warmup_rounds)
        return 0

    def _unseen(self, models: Sequence[ModelSource]) -> list[ModelSource]:
        return [m for m in models if _key(m) not in self._seen]

    def _cold(self, models: Sequence[ModelSource]) -> list[ModelSource]:
        """The models a warm-up round must cover: all of them after an idle spell, else only
        those not timed yet (a descent's A/B meets a new candidate every trial; its reference
        was timed moments ago and needs no session thrown away)."""
        idle = self._warm_at is None or self._generation() != self._warm_generation or (
            time.monotonic() - self._warm_at > (self.protocol.model_warmup_after_s or 0.0))
        return list(models) if idle else self._unseen(models)

    def _warm(self, models: Sequence[ModelSource], runners: dict | None, rounds: int) -> None:
        p = self.protocol
        for _ in range(rounds):
            for m in models:
                self._session(m, p.warmup, self._runs(p.runs), runners)
        self._warm_at = time.monotonic()
        if rounds:
            self._warm_generation = self._generation()

    def warm_up(self, models: Sequence[Any] | Any | None = None, *, force: bool = False) -> bool:
        """Throw away the protocol's first rounds once per process (or after a long idle).

        Measurements call this themselves; call it directly to pay the cost up front.
        """
        rounds = self._warm_rounds(force)
        if models is None:
            models = [self._last_model] if self._last_model is not None else []
        elif not isinstance(models, (list, tuple)):
            models = [models]
        srcs = [_as_source(m) for m in models]
        if not rounds or not srcs:
            return False
        runners = self._open_all(srcs)
        try:
            self._warm(srcs, runners, rounds)
        finally:
            self._close_all(runners)
        return True

    # -- public measurements -----------------------------------------------------------------
    def screen(self, model: Any) -> Measurement:
        """One short session: enough to discard candidates that are far off."""
        src = _as_source(model)
        self._last_model = src
        if self.deterministic:
            return self._deterministic(src)
        p = self.protocol
        self.warm_up([src])
        t0 = time.perf_counter()
        acc = _Acc()
        (samples,), quiet, again = self._round([src], p.screen_warmup,
                                                 self._runs(p.screen_runs), None)
        acc.add(samples)
        self.remeasured += again
        return acc.measurement(quiet, time.perf_counter() - t0, again)

    def same_model(self, model: Any) -> Comparison:
        """A model against itself, as a :class:`Comparison` (ratio 1 by definition): no A/B
        rounds, the model measured once (``protocol.final_sessions`` fresh sessions) for its
        figure. A run that ships its baseline spent 157 s comparing dnsmos (450 ms an
        inference) with itself."""
        m = self.interleaved([model])[0]
        return Comparison(1.0, 1.0, 1.0, m, m, 0, True, [], self.protocol.confidence,
                          same_model=True, cut_short=m.sessions < self.protocol.final_sessions)

    def measure(self, model: Any) -> Measurement:
        """``protocol.sessions`` fresh sessions of one model."""
        return self.interleaved([model], sessions=self.protocol.sessions)[0]

    def interleaved(
        self, models: Sequence[Any], *, sessions: int | None = None
    ) -> list[Measurement]:
        """Round-robin fresh sessions of k models (rotating who goes first): a fair top-k."""
        srcs = [_as_source(m) for m in models]
        if not srcs:
            return []
        self._last_model = srcs[0]
        if self.deterministic:
            return [self._deterministic(m) for m in srcs]
        p = self.protocol
        n_rounds = sessions or p.final_sessions
        warm, cold = self._warm_rounds(models=srcs), self._cold(srcs)
        accs = [_Acc() for _ in srcs]
        quiet, remeasured = True, 0
        runners = self._open_all(srcs)
        try:
            self._warm(cold, runners, 0 if self.out_of_time() else warm)
            t0 = time.perf_counter()
            for r in range(n_rounds):
                if r and self.out_of_time():
                    break
                order = [(r + i) % len(srcs) for i in range(len(srcs))]
                results, ok, again = self._round(
                    [srcs[i] for i in order], p.warmup, self._runs(p.runs), runners
                )
                quiet &= ok
                remeasured += again
                for i, samples in zip(order, results):
                    accs[i].add(samples)
        finally:
            self._close_all(runners)
        self.remeasured += remeasured
        seconds = time.perf_counter() - t0
        return [a.measurement(quiet, seconds / len(srcs), remeasured) for a in accs]

    def compare(self, candidate: Any, reference: Any, *,
                until: Until | str = Until.VERDICT) -> Comparison:
        """Interleaved A/B rounds until the ratio is known well enough (or rounds run out).

        ``until="verdict"`` (ranking candidates) stops as soon as the interval excludes 1 or is
        narrower than ``protocol.target``, or gives up once ``protocol.give_up_at`` of the
        rounds show the candidate not faster at all; ``until="precision"`` (a figure to report)
        runs at least ``final_sessions`` rounds and stops only once the interval is that narrow.
        """
        until = Until(until)  # ValueError for another word
        cand, ref = _as_source(candidate), _as_source(reference)
        self._last_model = ref
        p = self.protocol
        min_rounds = p.min_rounds
        if until is Until.PRECISION:
            min_rounds = max(p.min_rounds, min(p.final_sessions, p.max_rounds))
        if self.deterministic:
            mc, mr = self._deterministic(cand), self._deterministic(ref)
            ratio = max(mc.score_ms, 1e-9) / max(mr.score_ms, 1e-9)
            return Comparison(ratio, ratio, ratio, mc, mr, 1, True, [ratio], p.confidence)
        looks = p.max_rounds - min_rounds + 1
        level = per_look_confidence(p.confidence, looks)
        give_up = (max(min_rounds, math.ceil(p.give_up_at * p.max_rounds))
                   if until is Until.VERDICT and p.give_up_at is not None else None)
        warm, cold = self._warm_rounds(models=[ref, cand]), self._cold([ref, cand])
        acc_ref, acc_cand = _Acc(), _Acc()
        ratios: list[float] = []
        quiet, remeasured, decided, gave_up, busy, cut = True, 0, False, False, 0, False
        center, lo, hi = 1.0, 0.0, math.inf
        runners = self._open_all([ref, cand])
        try:
            self._warm(cold, runners, 0 if self.out_of_time() else warm)
            t0 = time.perf_counter()
            for r in range(p.max_rounds):
                order = [ref, cand] if r % 2 == 0 else [cand, ref]  # ABBA: cancel order bias
                # a busy round is measured again only while the interval still includes 1 (once
                # it separates, a repeat cannot change the verdict) and while repeats can find
                # a quiet moment (not after BUSY_STREAK repeats in a row were busy too)
                repeat = not (hi < 1.0 or lo > 1.0) and busy < BUSY_STREAK
                results, ok, again = self._round(order, p.warmup, self._runs(p.runs), runners,
                                                 repeat=repeat)
                busy = 0 if ok else busy + again
                quiet &= ok
                remeasured += again
                s_ref, s_cand = (results[0], results[1]) if r % 2 == 0 else (results[1], results[0])
                acc_ref.add(s_ref)
                acc_cand.add(s_cand)
                ratios.append(max(min(s_cand), 1e-9) / max(min(s_ref), 1e-9))
                if len(ratios) >= 2:
                    center, lo, hi = ratio_interval(ratios, level)
                significant = until is Until.VERDICT and (hi < 1.0 or lo > 1.0)
                enough = len(ratios) >= max(2, min_rounds)
                if enough and (significant or (hi - lo) / (2 * center) < p.target):
                    decided = True
                    break
                cut = len(ratios) >= CUT_SHORT_ROUNDS and self.out_of_time()
                gave_up = enough and give_up is not None and len(ratios) >= give_up \
                    and center >= 1.0
                if cut or gave_up:
                    break
        finally:
            self._close_all(runners)
        if len(ratios) < 2:
            center, lo, hi = ratio_interval(ratios, level)
        self.remeasured += remeasured
        seconds = (time.perf_counter() - t0) / 2
        return Comparison(
            ratio=center,
            ci_low=lo,
            ci_high=hi,
            candidate=acc_cand.measurement(quiet, seconds, remeasured),
            reference=acc_ref.measurement(quiet, seconds, remeasured),
            rounds=len(ratios),
            decided=decided,
            ratios=ratios,
            confidence=p.confidence,
            gave_up=gave_up,
            cut_short=cut,
        )

    def counters(self) -> dict[str, int | float]:
        """Sessions created (``loads``) and their seconds (``load_s``), timed inferences
        (warm-ups included) and their seconds (``timing_s``), rounds re-measured."""
        return {"loads": self.loads, "load_s": round(self.load_s, 3),
                "timed_runs": self.timed_runs, "timing_s": round(self.timing_s, 3),
                "remeasured": self.remeasured}
