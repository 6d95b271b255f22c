"""Accuracy in the search: recorded output errors, the error budget, two objectives.

A tiny ResNet-like model is tuned with a deterministic latency function that rewards
quantized ops (so schemes differ in latency in a known way) while the output errors are real:
every trial's model runs in ONNX Runtime on the validation data with calibrated scales. The
error budget is derived from an unconstrained run's own errors, never hard-coded.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import optuna
import pytest
from optuna.distributions import IntDistribution
from optuna.trial import TrialState, create_trial
from test_final_placement import rewards_quantized_ops

from qdq_optuna import Config, tune
from qdq_optuna.backends.callable import CallableBackend
from qdq_optuna.cli.commands import main
from qdq_optuna.examples import zoo
from qdq_optuna.measure.accuracy import AccuracyEvaluator
from qdq_optuna.model.calibration import random_calibration_data
from qdq_optuna.record.storage import open_storage
from qdq_optuna.search.objectives import choose_candidate, pareto_indices

pytestmark = pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")

BUDGET = 8


def backend() -> CallableBackend:
    return CallableBackend(rewards_quantized_ops, deterministic=True)


def pattern_studies(out, run_id: str) -> list[optuna.Study]:
    """The run's visit studies in the order they ran (these runs start from float: the
    first visit's reference is the FP32 model)."""
    storage = open_storage(f"sqlite:///{out / 'studies.db'}", heartbeat=False)
    names = sorted(s.study_name for s in storage.get_all_studies()
                   if s.study_name.startswith(f"{run_id}/") and "/round" in s.study_name)
    studies = [optuna.load_study(study_name=n, storage=storage) for n in names]
    return sorted(studies, key=lambda s: s.user_attrs["order"])


def complete(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    return study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))


def independent_error(model_path, candidate_path, data_path) -> dict:
    """The candidate's errors vs the original FP32 file, computed outside the search."""
    with np.load(data_path) as f:
        data = {k: f[k] for k in f.files}
    ev = AccuracyEvaluator(str(model_path), data)
    return ev.evaluate(str(candidate_path))[1]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("acc")
    model = root / "tiny_residual.onnx"
    onnx.save(zoo.build("tiny_residual"), str(model))
    rng = np.random.default_rng(0)
    cal = root / "cal.npz"
    np.savez(cal, input=rng.standard_normal((8, 3, 16, 16)).astype(np.float32))
    val = root / "val.npz"
    np.savez(val, input=rng.standard_normal((6, 3, 16, 16)).astype(np.float32))
    return model, cal, val


@pytest.fixture(scope="module")
def unconstrained(files, tmp_path_factory):
    model, cal, val = files
    out = tmp_path_factory.mktemp("free") / "run"
    result = tune(model, out, benchmark=backend(), runtime="onnxruntime", config=Config(schemes_per_region=BUDGET, start="float"),
                  calibration_data=str(cal), validation_data=str(val), progress=False)
    return result


def test_every_trial_records_its_output_errors(unconstrained, files):
    model, _, val = files
    report = unconstrained.report
    outputs = [o.name for o in onnx.load(str(model)).graph.output]
    studies = pattern_studies(unconstrained.output_dir, report["run_id"])
    assert studies[0].user_attrs["reference_error"] == 0.0  # FP32 against itself
    for study in studies:
        trials = complete(study)
        assert trials
        for t in trials:
            errs = t.user_attrs["output_errors"]
            assert sorted(errs) == sorted(outputs)
            for e in errs.values():
                assert set(e) == {"cosine", "relative_l2", "max_abs"}
                assert -1.0 <= e["cosine"] <= 1.0 and e["relative_l2"] >= 0 and e["max_abs"] >= 0
            # the scalar error is the default measure (relative L2) of the worst output
            assert t.user_attrs["error"] == max(e["relative_l2"] for e in errs.values())
            assert "feasible" not in t.user_attrs  # no budget, no feasibility
            if any(t.params.values()):
                assert t.user_attrs["error"] > 0  # calibrated int8 is never exact
    assert report["scales"] == "calibrated"
    # the reported final error is the error of the saved model, recomputed independently
    recomputed = independent_error(model, unconstrained.optimized_model, val)
    assert report["final_output_error"] == pytest.approx(recomputed["worst_relative_l2"],
                                                         rel=1e-3, abs=1e-6)
    last = [s for s in studies if "committed_error" in s.user_attrs][-1]
    assert report["final_output_error"] == pytest.approx(last.user_attrs["committed_error"])


def budget_from(unconstrained) -> tuple[float, str]:
    """A budget that makes the first pattern's fastest trial infeasible but not all trials."""
    study = pattern_studies(unconstrained.output_dir, unconstrained.report["run_id"])[0]
    trials = complete(study)
    fastest = min(trials, key=lambda t: (t.value, t.number))
    below = [t.user_attrs["error"] for t in trials if 0 < t.user_attrs["error"]
             < fastest.user_attrs["error"]]
    assert below, "the first pattern has no slower but more accurate trial to test with"
    return (max(below) + fastest.user_attrs["error"]) / 2, study.user_attrs["pattern_id"]


def test_error_budget_marks_infeasible_trials_and_commits_fastest_feasible(
        unconstrained, files, tmp_path):
    model, cal, val = files
    budget, first = budget_from(unconstrained)
    out = tmp_path / "run"
    result = tune(model, out, benchmark=backend(), runtime="onnxruntime", config=Config(schemes_per_region=BUDGET, start="float"),
                  calibration_data=str(cal), validation_data=str(val),
                  max_output_error=budget, progress=False)
    report = result.report
    studies = pattern_studies(out, report["run_id"])
    infeasible = 0
    for study in studies:
        trials = complete(study)
        for t in trials:
            over = t.user_attrs["error"] > budget
            infeasible += over
            assert t.user_attrs["feasible"] is (not over)
            assert t.constraints == {"max_output_error": pytest.approx(
                t.user_attrs["error"] - budget)}
        attrs = study.user_attrs
        feasible = [t for t in trials if t.user_attrs["feasible"]]
        if "candidate_trial" in attrs:  # the visit changed the standing model
            chosen = trials[[t.number for t in trials].index(attrs["candidate_trial"])]
            assert chosen.user_attrs["feasible"]
            assert chosen.value == min(t.value for t in feasible)
        assert attrs["committed_error"] <= budget
    assert infeasible > 0
    assert studies[0].user_attrs["pattern_id"] == first
    assert report["max_output_error"] == budget
    assert report["final_output_error"] <= budget
    recomputed = independent_error(model, result.optimized_model, val)
    assert recomputed["worst_relative_l2"] == pytest.approx(report["final_output_error"],
                                                            rel=1e-3, abs=1e-6)
    # the unconstrained run committed the (infeasible) fastest scheme of the first pattern
    free = pattern_studies(unconstrained.output_dir, unconstrained.report["run_id"])[0]
    assert free.user_attrs["committed_error"] > budget
    md = (out / "report.md").read_text()
    assert "error after commit" in md and f"budget {budget:g}" in md
    for row in report["patterns"]:
        assert row["committed_error"] <= budget


def test_two_objectives_write_a_measured_model_level_front(files, tmp_path):
    model, cal, val = files
    out = tmp_path / "run"
    result = tune(model, out, benchmark=backend(), runtime="onnxruntime", config=Config(schemes_per_region=BUDGET, start="float"),
                  calibration_data=str(cal), validation_data=str(val),
                  objectives="latency,error", progress=False)
    report = result.report
    for study in pattern_studies(out, report["run_id"]):
        assert len(study.directions) == 2
        assert study.metric_names == ["latency_ms", "error"]
        trials = complete(study)
        assert all(len(t.values) == 2 and t.values[1] == t.user_attrs["error"] for t in trials)
        attrs = study.user_attrs
        if any(attrs["committed"].values()):  # the commit is a Pareto point of its study
            front = pareto_indices([tuple(t.values) for t in trials])
            assert attrs["candidate_trial"] in [trials[i].number for i in front]
    # one decision per pattern (the front is a chain of them): no refinement round
    assert not any(p.get("refinements") for p in report["patterns"])
    storage = open_storage(f"sqlite:///{out / 'studies.db'}", heartbeat=False)
    assert not [s for s in storage.get_all_studies() if "/refine" in s.study_name]
    pareto = report["pareto"]
    assert pareto[0]["patterns"] == [] and pareto[0]["error"] == 0.0
    assert len(pareto) == 1 + sum(1 for p in report["patterns"] if p["committed_scheme"])
    assert len(pareto) >= 2
    # the whole chain is optimized.onnx
    assert pareto[-1]["error"] == pytest.approx(report["final_output_error"])
    assert pareto[-1]["quantized_tensors"] == len(report["quantized_tensors"])
    on = [p for p in pareto if p["on_front"]]
    assert set(pareto_indices([(p["latency_ms"], p["error"]) for p in pareto])) == \
        {p["index"] for p in on}
    files_on_disk = sorted(f.name for f in (out / "pareto").glob("*.onnx"))
    assert files_on_disk == sorted(p["file"].split("/")[1] for p in on)
    for p in on:
        m = onnx.load(str(out / p["file"]))
        onnx.checker.check_model(m)
        recomputed = independent_error(model, out / p["file"], val)
        assert recomputed["worst_relative_l2"] == pytest.approx(p["error"], rel=1e-3, abs=1e-6)
    assert "Latency / error front" in (out / "report.md").read_text()
    json.loads((out / "report.json").read_text())  # finite, valid JSON


def test_user_metric_and_random_validation_data_warning(tmp_path, caplog, monkeypatch):
    model = tmp_path / "tiny_chain.onnx"
    onnx.save(zoo.build("tiny_chain"), str(model))
    (tmp_path / "my_metric.py").write_text(
        "import numpy as np\n"
        "def mean_abs(ref, cand):\n"
        "    return float(np.mean([np.abs(ref[k] - cand[k]).mean() for k in ref]))\n"
    )
    monkeypatch.chdir(tmp_path)
    caplog.set_level("WARNING", logger="qdq_optuna")
    result = tune(model, tmp_path / "run", benchmark=backend(), runtime="onnxruntime",
                  config=Config(schemes_per_region=4, start="float"), metric="my_metric:mean_abs",
                  progress=False)
    assert "output errors are measured on random inputs" in caplog.text
    for study in pattern_studies(result.output_dir, result.report["run_id"]):
        for t in complete(study):
            assert (t.user_attrs["error"] == 0) == (not any(t.params.values()))
    report = result.report
    assert report["error_measure"] == "metric my_metric:mean_abs"
    # the reported error is the user's metric on the saved model over the random inputs
    data = random_calibration_data(str(model), samples=8, seed=1)
    err, _ = AccuracyEvaluator(str(model), data, metric="my_metric:mean_abs").evaluate(
        str(result.optimized_model))
    assert err > 0 and report["final_output_error"] == pytest.approx(err, rel=1e-3)
    rel_l2 = max(e["relative_l2"] for e in report["final_output_errors"].values())
    assert report["final_output_error"] != pytest.approx(rel_l2)


def test_error_measure_max_abs(files, tmp_path):
    model, cal, _ = files
    result = tune(model, tmp_path / "run", benchmark=backend(), runtime="onnxruntime",
                  config=Config(schemes_per_region=3, start="float"), calibration_data=str(cal),
                  error_measure="max_abs", max_output_error=1e6, progress=False)
    for study in pattern_studies(result.output_dir, result.report["run_id"]):
        for t in complete(study):
            worst = max(e["max_abs"] for e in t.user_attrs["output_errors"].values())
            assert t.user_attrs["error"] == worst and t.user_attrs["feasible"]


# -- choices without a search ----------------------------------------------------------------------
def _trial(number, values, constraint=None):
    t = create_trial(values=list(values), params={"a": 0},
                     distributions={"a": IntDistribution(0, 1)},
                     system_attrs={} if constraint is None else
                     {"constraints:max_output_error": constraint})
    t.number = number
    return t


def test_choose_candidate_rules():
    trials = [_trial(0, [10.0, 0.0], -1.0), _trial(1, [7.0, 0.3], 0.2),
              _trial(2, [8.0, 0.05], -0.05), _trial(3, [8.1, 0.01], -0.09)]
    best, _ = choose_candidate(trials, multi_objective=False, constrained=False, threshold=1.02)
    assert best.number == 1
    best, _ = choose_candidate(trials, multi_objective=False, constrained=True, threshold=1.02)
    assert best.number == 2  # fastest feasible
    best, _ = choose_candidate(trials, multi_objective=True, constrained=True, threshold=1.02)
    assert best.number == 3  # 8.1 is within 2 % of 8.0 and more accurate
    best, _ = choose_candidate(trials, multi_objective=True, constrained=False, threshold=1.0)
    assert best.number == 1
    none, why = choose_candidate([_trial(0, [5.0, 1.0], 0.5)], multi_objective=False,
                                 constrained=True, threshold=1.02)
    assert none is None and "budget" in why


def test_our_sampler_ranks_feasible_trials_first():
    from qdq_optuna.samplers.qdq_mutation import QDQMutationSampler

    study = optuna.create_study()
    trials = [_trial(0, [5.0], 0.3), _trial(1, [9.0], -0.1), _trial(2, [7.0], 0.0),
              _trial(3, [4.0], 0.1)]
    for t in trials:
        t.values = [t.values[0]]
    ranked = QDQMutationSampler(seed=0)._ranked_parents(study, trials)
    assert [t.number for t in ranked] == [2, 1, 3, 0]


# -- option errors ---------------------------------------------------------------------------------
@pytest.mark.parametrize("args,needle", [
    (["--objectives", "error"], "--objectives"),
    (["--objectives", "latency,error", "--sampler", "cmaes"], "--sampler cmaes"),
    (["--max-output-error", "-1"], "--max-output-error"),
    (["--max-output-error", "0.1", "--scales", "default"], "--scales default"),
    (["--error-measure", "psnr"], "--error-measure"),
    (["--metric", "no_such_module_xyz:f"], "--metric"),
])
def test_bad_accuracy_options_are_one_line_exit_2(files, tmp_path, capsys, args, needle):
    model, _, _ = files
    rc = main(["tune", "--model", str(model), "--output", str(tmp_path / "o"), "-q",
               "--backend", "costmodel", *args])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("qdq-optuna: error: ") and "\n" not in err
    assert needle in err


def test_bad_validation_data_names_the_option_and_file(files, tmp_path, capsys):
    model, _, _ = files
    bad = tmp_path / "bad.npz"
    np.savez(bad, wrong_name=np.zeros((2, 3, 16, 16), np.float32))
    rc = main(["tune", "--model", str(model), "--output", str(tmp_path / "o"), "-q",
               "--validation-data", str(bad), "--backend", "costmodel"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "--validation-data" in err and str(bad) in err and "\n" not in err


def test_starts_past_the_error_bound_are_recorded_and_never_chosen(files, tmp_path):
    """The whole-model starts go through the accuracy guard: a start whose output error breaks
    the bound is recorded as infeasible (its latency kept) and never becomes the standing
    model."""
    model, cal, val = files
    result = tune(model, tmp_path / "run", benchmark=backend(), runtime="onnxruntime",
                  config=Config(schemes_per_region=3), calibration_data=str(cal),
                  validation_data=str(val), max_output_error=1e-9, progress=False)
    starts = {s["name"]: s for s in result.report["starts"]}
    assert starts["float"]["feasible"] and starts["float"]["chosen"]
    others = [s for name, s in starts.items() if name != "float"]
    assert others and not any(s["feasible"] or s["chosen"] for s in others)
    assert all(s["error"] > 1e-9 and s["latency_ms"] > 0 for s in others)
    storage = open_storage(f"sqlite:///{result.output_dir / 'studies.db'}", heartbeat=False)
    study = optuna.load_study(study_name="run/_starts", storage=storage)
    assert {t.user_attrs["start"]: t.user_attrs["feasible"] for t in study.trials} == {
        name: s["feasible"] for name, s in starts.items()}
    assert result.report["quantized_tensors"] == []  # no Q/DQ keeps an error of 1e-9
