"""Timing protocol: statistics, adaptive A/B comparison, counters and quietness checks."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time

import numpy as np
import onnx
import pytest

from qdq_optuna.backends import CallableBackend, OnnxRuntimeBackend
from qdq_optuna.backends.base import Backend, BackendError, Runner
from qdq_optuna.errors import OptionError
from qdq_optuna.examples.zoo import matmul_chain
from qdq_optuna.measure import timing as measure
from qdq_optuna.measure.timing import (
    Comparison,
    Measurement,
    Measurer,
    QuietProbe,
    TimingProtocol,
    per_look_confidence,
    ratio_interval,
    t_quantile,
)


def chain_model(layers: int = 4, width: int = 128, rows: int = 32) -> bytes:
    return matmul_chain(layers, width, rows)

FAST_MODEL = chain_model(width=128)
SLOW_MODEL = chain_model(width=256)  # 4x the MatMul work


class _FakeRunner(Runner):
    def __init__(self, backend: FakeBackend, base: float) -> None:
        self.backend, self.base = backend, base

    def time(self, warmup: int, iterations: int) -> list[float]:
        self.backend.calls += 1
        noise = self.backend.rng.lognormal(0.0, self.backend.sigma, iterations)
        return list(self.base * noise)

    def close(self) -> None:
        self.backend.closed += 1


class FakeBackend(Backend):
    """Seeded log-normal timings around ``len(model)`` ms: exact, repeatable statistics."""

    name = "fake"

    def __init__(self, sigma: float = 0.03, seed: int = 0, fresh: bool = True) -> None:
        self.sigma = sigma
        self.rng = np.random.default_rng(seed)
        self.fresh_sessions = fresh
        self.loads = self.calls = self.closed = 0

    def load(self, model):
        self.loads += 1
        # a per-session offset, like memory layout differences between real sessions
        return _FakeRunner(self, len(model) * self.rng.lognormal(0.0, self.sigma))


class NullProbe:
    def __init__(self, answers=()):
        self.answers = list(answers)
        self.last_other_cores = 0.0

    def start(self):
        return object()

    def stop(self, token):
        return self.answers.pop(0) if self.answers else True


class BusyProbe(NullProbe):
    """Every round finds another process on the cores."""

    def stop(self, token):
        self.last_other_cores = 1.0
        return False


# -- protocol and statistics ---------------------------------------------------------------


def test_presets():
    fast, robust = TimingProtocol.fast(), TimingProtocol.robust()
    assert (fast.sessions, fast.warmup, fast.runs) == (1, 3, 15)
    assert (robust.sessions, robust.warmup, robust.runs) == (5, 5, 20)
    assert robust.max_rounds == 12 and robust.target == 0.015
    assert robust.process_warmup_rounds == 2
    assert TimingProtocol.from_name("fast") == fast
    assert TimingProtocol.from_name("robust") == robust
    with pytest.raises(OptionError, match="--timing"):
        TimingProtocol.from_name("quick")
    with pytest.raises(OptionError):
        TimingProtocol(min_rounds=5, max_rounds=3)
    assert json.dumps(robust.to_dict())


def test_t_quantiles_match_tables():
    table = {1: 12.706, 2: 4.303, 4: 2.776, 9: 2.262, 29: 2.045}
    for df, value in table.items():
        assert t_quantile(0.95, df) == pytest.approx(value, abs=1e-3)
    assert t_quantile(0.99, 5) == pytest.approx(4.032, abs=1e-3)


def test_per_look_confidence_is_stricter_with_more_looks():
    levels = [per_look_confidence(0.95, k) for k in (1, 2, 5, 10, 30)]
    assert levels[0] == 0.95
    assert all(a < b for a, b in zip(levels, levels[1:]))
    assert levels[3] == pytest.approx(0.9894, abs=2e-4)  # Pocock, 10 looks


def test_ratio_interval():
    center, lo, hi = ratio_interval([1.1, 1.1, 1.1])
    assert center == pytest.approx(1.1) and lo == pytest.approx(1.1) and hi == pytest.approx(1.1)
    center, lo, hi = ratio_interval([0.9, 1.1, 1.0, 1.02])
    assert lo < 1.0 < hi and lo < center < hi
    assert ratio_interval([1.2])[2] == math.inf


# -- comparisons on a controlled backend ----------------------------------------------------


def test_compare_decides_a_five_percent_difference_on_fake_timings():
    backend = FakeBackend(sigma=0.01, seed=1)
    m = Measurer(backend, TimingProtocol.robust())
    m.probe = NullProbe()
    c = m.compare(b"x" * 105, b"x" * 100)
    assert c.decided and c.significant and c.verdict == "slower"
    assert c.ci_low > 1.0 and c.ratio == pytest.approx(1.05, abs=0.02)
    assert 3 <= c.rounds <= 12 and len(c.ratios) == c.rounds
    assert c.candidate.sessions == c.reference.sessions == c.rounds
    # fresh session per model per round, plus two warm-up rounds of both
    assert backend.loads == 2 * c.rounds + 4 == m.loads
    assert backend.closed == backend.loads


def test_compare_same_model_on_fake_timings_is_not_significant():
    undecided = 0
    for seed in range(20):
        m = Measurer(FakeBackend(sigma=0.01, seed=seed), TimingProtocol.robust())
        m.probe = NullProbe()
        c = m.compare(b"y" * 100, b"y" * 100)
        assert not c.significant, (seed, c.ci_low, c.ci_high)
        undecided += not c.decided
    assert undecided < 20


def test_compare_gives_up_on_a_candidate_that_is_not_faster_at_half_its_rounds():
    # noisy fake timings (the spread of a loaded 2-core machine): a move with no effect used
    # to run every round undecided; now it stops at half of them, while a candidate that
    # really is 6 % faster is found as often as before
    def runs(give_up_at, size, seeds=range(30)):
        out = []
        for seed in seeds:
            protocol = TimingProtocol.robust().with_(give_up_at=give_up_at)
            m = Measurer(FakeBackend(sigma=0.06, seed=seed), protocol)
            m.probe = NullProbe()
            out.append(m.compare(b"z" * size, b"z" * 100))
        return out

    never, halfway = runs(None, 100), runs(0.5, 100)
    assert not any(c.gave_up for c in never)
    gave_up = [c for c in halfway if c.gave_up]
    assert len(gave_up) >= 5
    for c in gave_up:
        assert 6 <= c.rounds < 12 and c.ratio >= 1.0 and not c.decided
        assert c.verdict == "not faster" and c.to_dict()["gave_up"]
    assert sum(c.rounds for c in halfway) < 0.85 * sum(c.rounds for c in never)
    assert not any(c.verdict == "faster" for c in halfway + never)

    found = [sum(c.verdict == "faster" for c in runs(g, 94)) for g in (None, 0.5)]
    assert found[0] >= 10 and found[1] >= found[0] - 2, found
    # a figure to report never gives up
    m = Measurer(FakeBackend(sigma=0.06, seed=3), TimingProtocol.robust())
    m.probe = NullProbe()
    assert not m.compare(b"z" * 103, b"z" * 100, until="precision").gave_up
    with pytest.raises(OptionError, match="give_up_at"):
        TimingProtocol(give_up_at=0)


def test_non_fresh_backend_keeps_one_runner_per_model():
    backend = FakeBackend(fresh=False)
    m = Measurer(backend, TimingProtocol.robust())
    m.probe = NullProbe()
    c = m.compare(b"a" * 120, b"a" * 100)
    assert backend.loads == 2 and backend.closed == 2
    assert c.ratio == pytest.approx(1.2, abs=0.05)
    ms = m.interleaved([b"a" * 10, b"a" * 30, b"a" * 20])
    assert backend.loads == 5
    assert [round(x.score_ms / 10) for x in ms] == [1, 3, 2]


def test_noisy_rounds_are_remeasured_once():
    m = Measurer(FakeBackend(), TimingProtocol.fast().with_(process_warmup_rounds=0))
    m.probe = NullProbe([False, True])
    r = m.screen(b"z" * 10)
    assert r.quiet and r.remeasured == 1 and m.loads == 2
    m.probe = NullProbe([False, False])
    r = m.screen(b"z" * 10)
    assert not r.quiet and m.remeasured == 2
    m = Measurer(FakeBackend(), TimingProtocol.fast().with_(remeasure_noisy=False))
    m.probe = NullProbe([False])
    m.warm_up(b"z")
    assert not m.screen(b"z" * 10).quiet and m.remeasured == 0



def test_a_busy_round_is_not_repeated_once_the_interval_separates():
    protocol = TimingProtocol.robust().with_(process_warmup_rounds=0)
    m = Measurer(FakeBackend(sigma=0.01), protocol)
    m.probe = BusyProbe()
    c = m.compare(b"x" * 200, b"x" * 100, until="precision")
    assert c.ci_low > 1.0 and c.rounds >= protocol.final_sessions
    # rounds 1 and 2 are repeated (no interval yet after the first); none after it separated
    assert c.candidate.remeasured == 2 and m.loads == 2 * (c.rounds + 2)
    m = Measurer(FakeBackend(sigma=0.01), protocol)
    m.probe = BusyProbe()
    c = m.compare(b"y" * 100, b"y" * 100)  # never separates, but the machine stays busy:
    assert not c.significant and c.rounds > measure.BUSY_STREAK
    assert c.candidate.remeasured == measure.BUSY_STREAK  # no repeat after the busy streak


def test_a_busy_round_is_repeated_while_repeats_find_quiet_moments():
    protocol = TimingProtocol.robust().with_(process_warmup_rounds=0)
    m = Measurer(FakeBackend(sigma=0.01), protocol)
    m.probe = NullProbe([False, True] * 20)  # every first attempt busy, every repeat quiet
    c = m.compare(b"y" * 100, b"y" * 100)
    assert c.candidate.quiet and c.candidate.remeasured == c.rounds

def test_past_its_deadline_a_measurement_takes_its_minimum_rounds_and_says_so():
    protocol = TimingProtocol.robust().with_(process_warmup_rounds=2)
    m = Measurer(FakeBackend(sigma=0.05), protocol)
    m.probe = NullProbe()
    full = m.compare(b"y" * 100, b"y" * 101, until="precision")
    assert not full.cut_short and full.rounds >= protocol.final_sessions
    m = Measurer(FakeBackend(sigma=0.05), protocol)
    m.probe = BusyProbe()  # no busy round is measured again either
    m.deadline = time.monotonic() - 1.0
    c = m.compare(b"y" * 100, b"y" * 101, until="precision")
    assert c.cut_short and c.rounds == measure.CUT_SHORT_ROUNDS and c.to_dict()["cut_short"]
    assert m.loads == 2 * c.rounds and m.remeasured == 0  # no warm-up rounds, no repeats
    one = m.same_model(b"y" * 100)
    assert one.cut_short and one.candidate.sessions == 1
    m.deadline = time.monotonic() + 3600  # not yet: the protocol's rounds
    assert not m.same_model(b"y" * 100).cut_short


def test_bad_timings_are_backend_errors():
    class Liar(FakeBackend):
        def load(self, model):
            runner = super().load(model)
            runner.time = lambda w, n: [float("nan")] * n  # type: ignore[method-assign]
            return runner

    m = Measurer(Liar(), TimingProtocol.fast())
    with pytest.raises(BackendError, match="bad timings"):
        m.screen(b"q")


# -- deterministic backends -----------------------------------------------------------------


def test_deterministic_backend_needs_one_load_per_model():
    backend = CallableBackend(lambda model: float(len(model.graph.node)), deterministic=True)
    m = Measurer(backend, TimingProtocol.robust())
    small, big = chain_model(layers=2, width=8), chain_model(layers=4, width=8)
    c = m.compare(big, small)
    assert c.ratio == 2.0 and c.ci_low == c.ci_high == 2.0
    assert c.decided and c.rounds == 1 and c.verdict == "slower"
    assert (m.loads, m.timed_runs) == (2, 2)
    r = m.measure(small)
    assert (r.score_ms, r.sessions, r.runs, r.cv, r.quiet) == (4.0, 1, 1, 0.0, True)
    assert [x.score_ms for x in m.interleaved([small, big])] == [4.0, 8.0]
    assert m.screen(big).score_ms == 8.0
    assert (m.loads, m.timed_runs) == (6, 6)
    assert json.dumps(c.to_dict())


# -- real ONNX Runtime timings --------------------------------------------------------------


@pytest.fixture(scope="module")
def ort_measurer():
    return Measurer(OnnxRuntimeBackend(), TimingProtocol.robust())


def test_compare_clearly_slower_model_is_decided(ort_measurer):
    c = ort_measurer.compare(SLOW_MODEL, FAST_MODEL)
    assert isinstance(c, Comparison)
    assert c.decided and c.significant
    assert c.ratio > 1.5 and c.ci_low > 1.0
    assert c.candidate.score_ms > c.reference.score_ms
    flipped = ort_measurer.compare(FAST_MODEL, SLOW_MODEL)
    assert flipped.ci_high < 1.0 and flipped.verdict == "faster"
    d = c.to_dict()
    assert json.loads(json.dumps(d))["candidate"]["sessions"] == c.rounds


def test_compare_model_with_itself_contains_one():
    # 99 % overall (Bonferroni over the looks): a spurious verdict here is a ~1 % event
    m = Measurer(OnnxRuntimeBackend(), TimingProtocol.robust().with_(confidence=0.99))
    c = m.compare(FAST_MODEL, FAST_MODEL)
    assert c.ci_low <= 1.0 <= c.ci_high, c.to_dict()
    assert 0.9 < c.ratio < 1.1


def test_measure_screen_interleaved_and_counters():
    protocol = TimingProtocol.robust().with_(sessions=3, runs=10, final_sessions=3)
    m = Measurer(OnnxRuntimeBackend(), protocol)
    r = m.measure(onnx.load_from_string(FAST_MODEL))  # a ModelProto is accepted too
    assert isinstance(r, Measurement)
    assert r.sessions == 3 and r.runs == 30 and len(r.samples_ms) == 3
    assert r.min_ms <= r.score_ms <= max(r.samples_ms)
    assert r.cv >= 0 and r.seconds > 0
    warm = protocol.process_warmup_rounds
    assert m.loads == warm + 3 + r.remeasured * 1
    assert m.timed_runs == (warm + 3 + r.remeasured) * 10
    s = m.screen(FAST_MODEL)
    assert s.sessions == 1 and s.runs == protocol.screen_runs
    before = m.loads
    ranked = m.interleaved([SLOW_MODEL, FAST_MODEL, chain_model(width=64)])
    assert [x.sessions for x in ranked] == [3, 3, 3]
    assert ranked[2].score_ms < ranked[1].score_ms < ranked[0].score_ms
    assert m.loads - before >= 9
    assert m.counters()["loads"] == m.loads


def test_a_model_not_timed_yet_or_after_a_short_idle_gets_one_warm_up_session():
    protocol = TimingProtocol.robust().with_(process_warmup_rounds=2, sessions=3,
                                             model_warmup_after_s=0.2)
    m = Measurer(FakeBackend(), protocol)
    m.probe = NullProbe()
    m.measure(b"a" * 10)
    assert m.loads == 2 + 3  # the process's warm-up covers the first model
    m.measure(b"a" * 10)
    assert m.loads == 5 + 3  # timed just now: no warm-up
    m.measure(b"b" * 10)
    assert m.loads == 8 + 1 + 3  # a model not timed yet: one session thrown away
    c = m.compare(b"b" * 10, b"c" * 10, until="precision")
    n = m.loads
    assert n == 12 + 1 + 2 * c.rounds  # one session of "c" thrown away: "b" was just timed
    time.sleep(0.3)  # the worker idled: every model of the next measurement warms up once
    m.measure(b"a" * 10)
    assert m.loads == n + 1 + 3
    m.screen(b"d" * 10)  # a screen stays one session
    assert m.loads == n + 4 + 1
    off = Measurer(FakeBackend(), protocol.with_(model_warmup_after_s=None))
    off.probe = NullProbe()
    off.measure(b"a" * 10)
    off.measure(b"b" * 10)
    assert off.loads == 2 + 3 + 3


def test_the_baselines_model_a_b_timed_against_its_own_copy_reads_one():
    """The float start is the baseline's model (a copy, never timed before): an interleaved
    A/B of the two, right after the baseline was measured, contains 1."""
    m = Measurer(OnnxRuntimeBackend(), TimingProtocol.robust().with_(confidence=0.99))
    m.measure(FAST_MODEL)
    copy = onnx.load_from_string(FAST_MODEL)
    copy.doc_string = "the same model, other bytes"
    c = m.compare(copy.SerializeToString(), FAST_MODEL, until="precision")
    assert c.ci_low <= 1.0 <= c.ci_high, c.to_dict()


def test_warm_up_runs_once_then_again_after_idle():
    protocol = TimingProtocol.fast().with_(process_warmup_rounds=2, rewarm_after_s=0.05)
    m = Measurer(FakeBackend(), protocol)
    m.probe = NullProbe()
    assert m.warm_up() is False  # nothing to warm up with yet
    assert m.warm_up(b"w") is True and m.loads == 2
    assert m.warm_up(b"w") is False
    time.sleep(0.1)
    assert m.warm_up(b"w") is True and m.loads == 3  # one round after an idle spell


# -- quietness ------------------------------------------------------------------------------


def test_quiet_probe_arithmetic(monkeypatch):
    busy = iter([1000, 1000 + 60])
    own = {"self": iter([500, 500 + 10])}
    monkeypatch.setattr(measure, "_read_proc_stat_busy", lambda: next(busy))
    monkeypatch.setattr(measure, "_proc_cpu_jiffies", lambda pid, children: next(own[pid]))
    probe = QuietProbe(0.25)
    probe.available, probe.hz = True, 100
    token = probe.start()
    token = (token[0] - 1.0, token[1], token[2])  # pretend one second passed
    assert probe.stop(token) is False
    assert probe.last_other_cores == pytest.approx(0.48, abs=0.02)
    # the same load, but from our own worker process: quiet
    busy = iter([1000, 1060])
    own = {"self": iter([500, 510]), 4242: iter([0, 50])}
    probe = QuietProbe(0.25, pids=lambda: [4242])
    probe.available, probe.hz = True, 100
    token = probe.start()
    assert probe.stop((token[0] - 1.0, token[1], token[2])) is True


def test_quiet_probe_sees_a_busy_neighbour():
    probe = QuietProbe(0.25)
    if not probe.available:
        pytest.skip("no /proc/stat here")
    hog = subprocess.Popen(
        [sys.executable, "-c", "import time\nt=time.time()\nwhile time.time()-t<1.5: pass"]
    )
    try:
        time.sleep(0.2)
        token = probe.start()
        time.sleep(0.5)
        assert probe.stop(token) is False
        assert probe.last_other_cores > 0.5
    finally:
        hog.kill()
        hog.wait()


def test_quiet_probe_without_proc_is_a_no_op():
    probe = QuietProbe()
    probe.available = False
    assert probe.start() is None and probe.stop(None) is True


def test_models_timed_together_with_the_baseline_cancel_the_drift_between_them(tmp_path):
    """The starts are timed in the baseline's rounds: on a machine that slows down as it
    goes, the baseline's own model timed afterwards reads slower alone, and the same as the
    baseline timed together with it (each latency scaled by its ratio in those rounds)."""
    import optuna

    from qdq_optuna.record import Measurement as Record
    from qdq_optuna.record import PlanMemo
    from qdq_optuna.search._plans import PlanMeasurer

    class Drifting(FakeBackend):
        def load(self, model):  # every session 2 % slower than the one before
            self.loads += 1
            return _FakeRunner(self, len(model) * 1.02 ** self.loads)

    protocol = TimingProtocol.robust().with_(process_warmup_rounds=0, sessions=5)
    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 'run.db'}")
    m = Measurer(Drifting(sigma=0.005), protocol)
    m.probe = NullProbe()
    plans = PlanMeasurer(m, PlanMemo(study, "measured:", Record))
    base, same = b"b" * 100, b"c" * 100  # the same latency, other bytes
    base_ms = plans.measure(base, "baseline", "baseline")[0]
    alone = plans.measure(same, "alone", "starts")[0]
    assert alone / base_ms > 1.08  # five sessions later: the drift alone
    plans.measure_together(base, base_ms, [("float", same, 0), ("alone", same, 0)], "starts")
    together, record = plans.measure(same, "float", "starts")
    assert abs(together / base_ms - 1) < 0.03, record.stats
    assert "alone" not in plans.together  # measured before: not timed again
    assert plans.by_phase["starts"] == 2 and plans.cache_hits == 0


def test_models_timed_together_already_had_their_a_b(tmp_path, ort_measurer):
    """The starts are timed in the same rounds (fresh sessions of each in every round), so
    two of them already had an interleaved A/B: its paired ratios are their per-round
    timings' ratios, its interval at the level of one look of ``compare``; models of another
    call, or not timed together, have none. Real ONNX Runtime sessions."""
    import optuna

    from qdq_optuna.record import Measurement as Record
    from qdq_optuna.record import PlanMemo
    from qdq_optuna.search._plans import PlanMeasurer

    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 'run.db'}")
    plans = PlanMeasurer(ort_measurer, PlanMemo(study, "measured:", Record))
    fast, slow = FAST_MODEL, SLOW_MODEL  # serialized models
    plans.measure_together(fast, 1.0, [("fast", fast, 0), ("slow", slow, 0)], "starts")
    cmp = plans.together_comparison("fast", "slow")
    sessions = ort_measurer.protocol.sessions
    assert cmp is not None and cmp.rounds == sessions == len(cmp.ratios)
    fast_ms, slow_ms = (plans.rounds_of[k][1].samples_ms for k in ("fast", "slow"))
    assert cmp.ratios == pytest.approx([f / s for f, s in zip(fast_ms, slow_ms)])
    assert cmp.ratio < 1 / 1.5 and cmp.ci_high < 1.0 and cmp.decided  # 4x the MatMul work
    back = plans.together_comparison("slow", "fast")
    assert back.ratio == pytest.approx(1 / cmp.ratio) and back.ci_low > 1.0
    p = ort_measurer.protocol
    level = measure.per_look_confidence(p.confidence, p.max_rounds - p.min_rounds + 1)
    assert (cmp.ratio, cmp.ci_low, cmp.ci_high) == pytest.approx(
        measure.ratio_interval(cmp.ratios, level))
    plans.measure_together(fast, 1.0, [("later", slow, 0)], "starts")  # another call
    assert plans.together_comparison("later", "fast") is None
    assert plans.together_comparison("fast", "never timed") is None


# -- pacing --------------------------------------------------------------------------------


def test_sessions_are_paced_by_the_run_latency_within_their_bounds():
    p = TimingProtocol.robust()
    assert p.paced(20, None) == 20  # not known yet: the protocol's runs
    assert p.paced(20, 2.0) == 20  # a short model: never more than runs
    assert p.paced(20, 25.0) == 12  # 0.3 s / 25 ms
    assert p.paced(20, 500.0) == p.min_runs == 12  # a long model: never under min_runs
    assert p.with_(session_budget_s=None).paced(20, 500.0) == 20
    assert TimingProtocol.fast().paced(15, 100.0) == 12
    assert p.with_(min_runs=30).paced(20, 500.0) == 20  # never more than runs
    with pytest.raises(OptionError, match="session_budget_s"):
        TimingProtocol(session_budget_s=0)


class _CountingRunner(Runner):
    def __init__(self, counts: list[int]) -> None:
        self.counts = counts

    def time(self, warmup: int, iterations: int) -> list[float]:
        self.counts.append(iterations)
        return [25.0] * iterations

    def close(self) -> None:
        pass


class _CountingBackend(Backend):
    name = "counting"

    def __init__(self) -> None:
        self.counts: list[int] = []

    def load(self, model):
        return _CountingRunner(self.counts)


def test_once_paced_every_session_of_an_ab_times_the_same_paced_runs():
    backend = _CountingBackend()
    m = Measurer(backend, TimingProtocol.robust().with_(process_warmup_rounds=0))
    m.probe = NullProbe()
    m.measure(FAST_MODEL)
    assert set(backend.counts) == {20}  # the baseline: before the pace is known
    backend.counts.clear()
    m.pace(25.0)
    m.screen(FAST_MODEL)
    m.compare(SLOW_MODEL, FAST_MODEL)
    m.interleaved([FAST_MODEL, SLOW_MODEL], sessions=2)
    assert backend.counts and set(backend.counts) == {12}
    m.pace(None)
    backend.counts.clear()
    m.screen(FAST_MODEL)
    assert backend.counts == [20]
