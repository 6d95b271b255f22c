"""Measurement you can trust: isolation inside real runs, trial statistics, clear backend errors.

* A candidate that segfaults or hangs the (isolated) backend fails only its trial: the study
  goes on, the trial is FAIL with ``failure`` and ``transient: true``, a rerun retries it once.
* Every measured trial carries its statistics (``ratio``, ``ci``, ``rounds``, ``decided``,
  ``screened_out``, ``sessions``); the report counts screened-out, A/B-compared and cached
  candidates; a stale reference screen cannot screen a candidate out.
* A backend that cannot run the float model ends the run with one line and exit 2; so does a
  missing ``trtexec``; a stand-in ``trtexec`` on PATH gets ``--warmUp`` in milliseconds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import _latency_fns as fns
import onnx
import optuna
import pytest
from _fake_trtexec import write_fake_trtexec
from _runs import check_visit
from optuna.trial import TrialState

from qdq_optuna import Config, PreparedModel, TuneOptions, tune
from qdq_optuna.backends import IsolatedBackend
from qdq_optuna.backends.base import Backend, Runner
from qdq_optuna.backends.callable import CallableBackend
from qdq_optuna.cli import commands as cli
from qdq_optuna.errors import UserError
from qdq_optuna.measure.timing import CUT_SHORT_ROUNDS, SCREEN_DISCARD_RATIO
from qdq_optuna.placement.scheme import ChoiceSpace
from qdq_optuna.record import RunRecord
from qdq_optuna.record.storage import open_storage
from qdq_optuna.search._settings import backend_for

TESTS = Path(__file__).resolve().parent
BUDGET = 6
STATS = {"kind", "latency_ms", "ratio", "ci", "rounds", "decided", "screened_out", "sessions"}

pytestmark = pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")


def pattern_studies(out: Path, run_id: str = "run") -> dict[str, optuna.Study]:
    storage = open_storage(f"sqlite:///{out / 'studies.db'}", heartbeat=False)
    return {s.study_name.split("/", 1)[1]: optuna.load_study(study_name=s.study_name,
                                                             storage=storage)
            for s in storage.get_all_studies()
            if s.study_name.startswith(f"{run_id}/") and "/round" in s.study_name}


def trials_with(study: optuna.Study, key: str) -> list[optuna.trial.FrozenTrial]:
    """The trials (pruned ones aside) that built the model of plan ``key``."""
    return [t for t in study.get_trials(deepcopy=False)
            if t.state != TrialState.PRUNED and t.user_attrs.get("plan_key") == key]


def complete(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    return study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))



@pytest.fixture(scope="module")
def target(residual, tmp_path_factory) -> tuple[list[str], str]:
    """The model of P001's first move in round 1 (a model no earlier step measures): its
    quantized tensors (what the trap recognises) and its plan key."""
    out = tmp_path_factory.mktemp("pre") / "run"
    tune(residual, out, benchmark=CallableBackend(fns.rewards_groups, deterministic=True),
         runtime="onnxruntime", config=Config(schemes_per_region=BUDGET), progress=False)
    study = pattern_studies(out)["P001/round1"]
    first = next(t for t in study.get_trials(deepcopy=False) if t.number == 1)
    assert first.user_attrs["move_index"] >= 0 and not first.user_attrs["measurement"].get(
        "cached"), "the target model was measured before P001's first move"
    # the whole model of that trial: the standing model then, with the trial's scheme
    pm = PreparedModel.prepare(str(residual))
    space = ChoiceSpace((pm.quant_type,))
    record = RunRecord(open_storage(f"sqlite:///{out / 'studies.db'}", heartbeat=False), "run",
                       pm.tunable, space)
    before = [a for a in record.visits("") if a.order < study.user_attrs["order"]]
    schemes = record.standing("", before)
    schemes["P001"] = space.indices(first.params, study.user_attrs["qdq_points"])
    for pid, points in (first.user_attrs.get("partner") or {}).items():
        schemes[pid].update(points)
    plan = pm.exporter().plan(record.uses(schemes))
    assert plan.key == first.user_attrs["plan_key"]
    return plan.tensors, plan.key


def trap(timeout: float = 120, **kwargs) -> IsolatedBackend:
    return IsolatedBackend(("_trap_backend", "PlanTrap", kwargs), start_timeout_s=120,
                           load_timeout_s=timeout)


# -- 1. isolation -----------------------------------------------------------------------------


def test_isolation_is_the_default_for_onnxruntime_and_can_be_turned_off(tmp_path):
    on = backend_for(TuneOptions(model="m.onnx", output_dir=str(tmp_path)))
    off = backend_for(TuneOptions(model="m.onnx", output_dir=str(tmp_path), isolate=False))
    try:
        assert isinstance(on, IsolatedBackend) and on.name == "onnxruntime"
        assert not isinstance(off, IsolatedBackend) and off.name == "onnxruntime"
    finally:
        on.close()
    args = cli.build_parser().parse_args(["tune", "--model", "m", "--output", "o"])
    assert args.isolate is True
    args = cli.build_parser().parse_args(["tune", "--model", "m", "--output", "o", "--no-isolate"])
    assert args.isolate is False


def test_isolated_worker_keeps_recent_models_and_measurer_rewarms_a_new_worker():
    import _crashy_backend

    from qdq_optuna.backends.isolated import KEEP_MODELS
    from qdq_optuna.measure.timing import Measurer, TimingProtocol

    backend = IsolatedBackend(("_crashy_backend", "CrashyBackend", {}), start_timeout_s=120)
    try:
        models = [bytes(range(n)) for n in range(3, 3 + KEEP_MODELS + 2)]
        order = models + models[::-1] + models[:2] * 3  # hits, evictions and re-sends
        for m in order:
            with backend.load(m) as runner:
                assert runner.time(0, 1) == [float(len(m))]
        assert len(backend._kept) == KEEP_MODELS and backend.restarts == 0
        protocol = TimingProtocol.robust().with_(process_warmup_rounds=2, remeasure_noisy=False)
        measurer = Measurer(backend, protocol)
        measurer.screen(models[0])
        assert measurer.loads == 3  # two warm-up sessions, then the screen
        measurer.screen(models[0])
        assert measurer.loads == 4
        with pytest.raises(Exception, match="crashed"):
            backend.load(_crashy_backend.CRASH)
        measurer.screen(models[0])  # a new worker process is cold: warmed up again
        assert measurer.loads == 7 and backend.restarts == 1
    finally:
        backend.close()


def test_crash_fails_only_its_trial_and_a_rerun_retries_it_once(residual, target, tmp_path):
    tensors, key = target
    out, state = tmp_path / "run", tmp_path / "state"
    state.mkdir()
    kwargs = {"crash": [tensors], "state_dir": str(state), "kill_parent_after": 2}
    # run 1 in a child process: the worker segfaults on the target, later kills the run itself
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(TESTS)!r})
        from qdq_optuna import Config
        from qdq_optuna.backends import IsolatedBackend
        from qdq_optuna import tune
        backend = IsolatedBackend(("_trap_backend", "PlanTrap", {kwargs!r}), start_timeout_s=120)
        tune({str(residual)!r}, {str(out)!r}, benchmark=backend, runtime="onnxruntime",
             config=Config(schemes_per_region={BUDGET}), progress=False)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert (state / "crashes").read_text().count("\n") == 1
    p1 = pattern_studies(out)["P001/round1"]
    assert "committed" not in p1.user_attrs
    crashed = trials_with(p1, key)
    assert len(crashed) == 1 and crashed[0].state == TrialState.FAIL
    attrs = crashed[0].user_attrs
    assert attrs["transient"] is True
    assert "crashed (signal 11" in attrs["failure"] and "building" in attrs["failure"]
    # the study went on after the crash ...
    assert any(t.number > crashed[0].number for t in complete(p1))
    # ... and did not crash the worker again on a re-proposal of the same model
    for t in p1.get_trials(deepcopy=False, states=(TrialState.PRUNED,)):
        assert t.user_attrs["plan_key"] == key
        assert "P001/round1 trial" in t.user_attrs["known_failure"]

    # run 2 resumes: the killed trial is redone, the crashed one retried once
    backend = trap(**kwargs)
    try:
        result = tune(residual, out, benchmark=backend, runtime="onnxruntime", config=Config(schemes_per_region=BUDGET),
                      progress=False)
    finally:
        backend.close()
    assert result.report["complete"]
    assert (state / "crashes").read_text().count("\n") == 2
    p1 = pattern_studies(out)["P001/round1"]
    crashed = trials_with(p1, key)
    assert [t.state for t in crashed] == [TrialState.FAIL, TrialState.FAIL]
    assert crashed[1].user_attrs["retry_of"] == crashed[0].number
    assert all(t.user_attrs["transient"] and "crashed" in t.user_attrs["failure"]
               for t in crashed)
    check_visit("P001/round1", p1, BUDGET)
    stats = result.report["search_statistics"]
    assert stats["failed_transient"] >= 2 and stats["failed"] >= 3  # + the killed trial
    assert "trials failed" in (out / "report.md").read_text()

    # run 3: nothing left to do, nothing retried again
    n_trials = len(p1.get_trials(deepcopy=False))
    backend = trap(**kwargs)
    try:
        tune(residual, out, benchmark=backend, runtime="onnxruntime", config=Config(schemes_per_region=BUDGET),
             progress=False)
    finally:
        backend.close()
    assert (state / "crashes").read_text().count("\n") == 2
    assert len(pattern_studies(out)["P001/round1"].get_trials(deepcopy=False)) == n_trials


def test_hanging_candidate_times_out_and_fails_only_its_trial(residual, target, tmp_path):
    tensors, key = target
    state = tmp_path / "state"
    state.mkdir()
    backend = trap(hang=[tensors], hang_s=120, state_dir=str(state), timeout=3)
    t0 = time.monotonic()
    try:
        result = tune(residual, tmp_path / "run", benchmark=backend, runtime="onnxruntime",
                      config=Config(schemes_per_region=BUDGET), progress=False)
    finally:
        backend.close()
    assert time.monotonic() - t0 < 90
    assert (state / "hangs").read_text().count("\n") == 1
    p1 = pattern_studies(tmp_path / "run")["P001/round1"]
    (hung,) = trials_with(p1, key)
    assert hung.state == TrialState.FAIL and hung.user_attrs["transient"] is True
    assert "timed out after 3 s (killed)" in hung.user_attrs["failure"]
    check_visit("P001/round1", p1, BUDGET)
    assert result.report["complete"] and result.report["search_statistics"]["failed"] == 1


def test_backend_crashing_on_the_float_model_is_one_clear_error(residual, tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    backend = trap(crash=[[]], state_dir=str(state))  # the float model: no Q at all
    try:
        with pytest.raises(UserError) as info:
            tune(residual, tmp_path / "run", benchmark=backend, runtime="onnxruntime", progress=False)
    finally:
        backend.close()
    text = str(info.value)
    assert text.startswith("backend trap cannot run the float model ")
    assert str(residual) in text and "crashed (signal 11" in text
    assert (state / "crashes").read_text().count("\n") == 2  # one more try, then the error


def test_cli_backend_error_on_the_float_model_is_exit_2(residual, tmp_path, monkeypatch,
                                                        capsys):
    (tmp_path / "refuses_float_xyz.py").write_text(
        "def fn(model):\n    raise RuntimeError('no device attached')\n")
    monkeypatch.chdir(tmp_path)
    code = cli.main(["tune", "--model", str(residual), "--output", str(tmp_path / "out"),
                     "--backend", "refuses_float_xyz:fn", "--runtime", "onnxruntime", "-q"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.count("\n") == 0
    assert err.startswith("qdq-optuna: error: backend refuses_float_xyz:fn cannot run the float "
                          f"model {residual}: ")
    assert "no device attached" in err and "internal error" not in err


# -- 2. trial statistics and the robust objective -----------------------------------------------


class _Fixed(Runner):
    def __init__(self, value: float) -> None:
        self.value = value

    def time(self, warmup: int, iterations: int) -> list[float]:
        return [self.value] * iterations


class SteppedMachine(Backend):
    """Not deterministic, so the robust protocol runs in full, but noise-free: a model's time
    is ``fn(model)``, times 1.5 from the first Q/DQ model on (the machine got slower right after
    the first pattern's reference was screened)."""

    name = "stepped"
    deterministic = False

    def __init__(self, fn) -> None:
        self.fn = fn
        self.slow = False

    def load(self, model):
        proto = onnx.load_from_string(model)
        self.slow = self.slow or bool(fns.activation_qs(proto))
        return _Fixed(self.fn(proto) * (1.5 if self.slow else 1.0))


def penalised(model) -> float:
    """``rewards_groups``, but quantizing the graph input costs 60 %: far off, screened out."""
    slow = any(q.input[0] == "input" for q in fns.activation_qs(model))
    return fns.rewards_groups(model) + (6.0 if slow else 0.0)


@pytest.fixture(scope="module")
def robust_run(residual, tmp_path_factory):
    out = tmp_path_factory.mktemp("robust") / "run"
    result = tune(residual, out, benchmark=SteppedMachine(penalised), runtime="onnxruntime", timing="robust",
                  config=Config(schemes_per_region=BUDGET), progress=False)
    return out, result.report


def test_every_measured_trial_carries_its_statistics(robust_run):
    out, report = robust_run
    kinds = set()
    for pid, study in pattern_studies(out).items():
        for t in complete(study):
            rec = t.user_attrs["measurement"]
            assert STATS <= set(rec), (pid, t.number, rec)
            assert rec["latency_ms"] == pytest.approx(t.value)
            kinds.add(rec["kind"])
            if rec.get("cached"):
                continue
            if rec["kind"] == "ab":
                lo, hi = rec["ci"]
                assert lo <= rec["ratio"] <= hi and rec["rounds"] >= 3 and rec["sessions"] >= 4
                assert rec["latency_ms"] == pytest.approx(rec["reference_ms"] * rec["ratio"])
                assert not rec["screened_out"]
    assert {"ab", "screened_out"} <= kinds


def test_screened_out_is_an_estimate_never_a_confirmed_figure(robust_run):
    out, report = robust_run
    p0 = pattern_studies(out)["P000/round1"]
    screened = [t for t in complete(p0) if t.user_attrs["measurement"]["screened_out"]]
    assert screened
    for t in screened:
        rec = t.user_attrs["measurement"]
        assert rec["kind"] == "screened_out" and rec["ci"] is None and rec["decided"] is False
        assert rec["ratio"] > SCREEN_DISCARD_RATIO and rec["screen_threshold"] == 1.3
        assert rec["ratio"] == pytest.approx(rec["screen_ms"] / rec["reference_screen_ms"])
        assert "n0.Conv.in0" in t.user_attrs["scheme"]  # only the truly slow ones
    # the fresh reference screen kept the 1.5x machine step from discarding the others
    others = [t for t in complete(p0) if not t.user_attrs["measurement"]["screened_out"]]
    assert any(t.user_attrs["measurement"]["kind"] == "ab" for t in others)
    for t in others:
        assert "n0.Conv.in0" not in t.user_attrs["scheme"]
    assert "n0.Conv.in0" not in p0.user_attrs["committed"] or not p0.user_attrs["committed"][
        "n0.Conv.in0"]


def test_report_counts_screened_compared_and_cached(robust_run):
    out, report = robust_run
    st = report["search_statistics"]
    assert st["screen_discard_ratio"] == SCREEN_DISCARD_RATIO
    assert st["screened_out"] >= 1 and st["ab_compared"] >= 1 and st["cache_hits"] >= 1
    assert st["measured"] == st["ab_compared"] + st["screened_out"] + st["screen_only"] + st[
        "deterministic"]
    assert st["measured"] + st["cache_hits"] == st["complete"]
    assert report["builds_saved_by_cache"] == st["cache_hits"]
    assert st["complete"] == sum(p["trials"] for p in report["patterns"])
    md = (out / "report.md").read_text()
    assert f"{st['screened_out']} screened out" in md and f"{st['cache_hits']} cache hits" in md
    assert f"{st['ab_compared']} A/B-compared" in md
    final = report["final_comparison"]
    assert final["rounds"] >= 8  # the reported figure is run for precision, not for a verdict


# -- 5. trtexec through the CLI ----------------------------------------------------------------



@pytest.mark.skipif(os.name != "posix", reason="the stand-in trtexec is a POSIX script")
def test_cli_trtexec_missing_then_a_stand_in_on_path(residual, tmp_path, monkeypatch, capsys):
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    code = cli.main(["tune", "--model", str(residual), "--output", str(tmp_path / "a"),
                     "--backend", "trtexec", "-q"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0
    assert err.startswith("qdq-optuna: error: trtexec not found on PATH")

    binary = write_fake_trtexec(tmp_path / "bin")
    log = tmp_path / "calls.log"
    monkeypatch.setenv("FAKE_TRTEXEC_LOG", str(log))
    monkeypatch.delenv("FAKE_TRTEXEC_MODE", raising=False)
    monkeypatch.delenv("FAKE_TRTEXEC_VERSION", raising=False)
    monkeypatch.setenv("PATH", str(binary.parent))
    code = cli.main(["tune", "--model", str(residual), "--output", str(tmp_path / "b"),
                     "--backend", "trtexec", "--timing", "fast", "--schemes-per-region", "2",
                     "-q"])
    assert code == 0, capsys.readouterr().err
    report = json.loads((tmp_path / "b" / "report.json").read_text())
    assert report["backend"]["name"] == "trtexec" and report["runtime"] == "tensorrt"
    assert report["backend"]["warmup_ms"] == 200 and "isolated" not in report["backend"]
    calls = [c.split() for c in log.read_text().splitlines()]
    builds = [c for c in calls if any(a.startswith("--saveEngine=") for a in c)]
    times = [c for c in calls if any(a.startswith("--loadEngine=") for a in c)]
    assert builds and times
    assert all("--skipInference" in c and "--stronglyTyped" in c for c in builds)
    assert not any(a in c for c in calls for a in ("--int8", "--fp16", "--best"))
    for c in times:  # milliseconds of warm-up, a floor of iterations, a duration: never counts
        assert "--warmUp=200" in c and "--duration=3" in c
        (iters,) = [int(a.split("=")[1]) for a in c if a.startswith("--iterations=")]
        assert iters >= 100


def test_a_timeout_bounds_the_run_its_conclusion_included(tmp_path):
    """``--timeout`` bounds the whole run: the search stops early enough for the conclusion,
    and past the deadline every A/B takes three rounds and says it was cut short (Inception v1
    with ``--timeout 300`` once concluded 560 s past it, in full-length A/Bs), but for a
    recipe file's A/B that decides whether the file ships."""
    from qdq_optuna.examples import zoo

    timeout = 1.0
    result = tune(zoo.build("resnet", "medium"), tmp_path / "out", timeout=timeout,
                  progress=False)
    r = result.report
    assert not r["complete"]
    assert r["elapsed_s"]["starts"] > timeout  # the whole conclusion ran past the deadline:
    final = r["final_comparison"]  # its A/Bs took their minimum, and say so
    assert final["cut_short"], final
    assert final["rounds"] == CUT_SHORT_ROUNDS or (
        final["same_model"] and final["candidate"]["sessions"] == 1)
    for rf in r.get("recipe_files") or []:
        cmp = rf.get("reexport_vs_file")  # a figure for the report: cut like the others,
        assert cmp is None or cmp["rounds"] <= CUT_SHORT_ROUNDS \
            or cmp == rf["tuned_vs_file"], cmp  # unless the re-export is what would ship
        # whether a file within the bound ships is decided whole, past the deadline
        cmp = rf.get("tuned_vs_file")
        assert cmp is None or not rf["within_bound"] or not cmp["cut_short"], cmp
    # the margin: the trial in flight and the conclusion's A/Bs at three rounds each, the
    # guard's scoring and the report; generous for a loaded 2-core machine
    assert r["elapsed_s"]["finish"] <= timeout + 45, r["elapsed_s"]
    assert "cut short" in (tmp_path / "out" / "report.md").read_text()
