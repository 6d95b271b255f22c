"""The FP32 model's own noise floor (``ErrorScorer.noise_floor``: its error under half an 8-bit
step of input noise) and what the guard and the report make of it; and what a start that broke
the bound says on its row when its repair yielded nothing to measure. Real ONNX Runtime
sessions throughout."""

from __future__ import annotations

import logging

import corpus
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from qdq_optuna.measure.accuracy import FLOOR_LEVELS, ErrorScorer, input_noise

pytestmark = pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")


def _sigmoid_model(gain: float, offset: float = 2.0):
    """y = Sigmoid(gain * (Conv1x1(x) - offset)): a sparse map (a few % of cells near 1, as a
    text detector's probability map); the larger ``gain``, the more cells near the decision
    flip under a small input change (a text edge)."""
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((4, 4, 1, 1)) / 2).astype(np.float32)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 16, 16])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 16, 16])
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
             helper.make_node("Sub", ["c", "offset"], ["d"], name="offset"),
             helper.make_node("Mul", ["d", "gain"], ["s"], name="gain"),
             helper.make_node("Sigmoid", ["s"], ["y"], name="sigmoid")]
    graph = helper.make_graph(nodes, "sigmoid", [x], [y], [
        numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.array(gain, np.float32),
                                                                 "gain"),
        numpy_helper.from_array(np.array(offset, np.float32), "offset")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _data(samples: int = 8) -> dict:
    return {"x": np.random.default_rng(0).standard_normal((samples, 4, 16, 16))
            .astype(np.float32)}


def test_input_noise_moves_float_inputs_by_up_to_half_a_step_and_no_integers():
    x = np.linspace(-2.0, 3.0, 4000, dtype=np.float32).reshape(4, 1000)
    ids = np.arange(8, dtype=np.int64).reshape(4, 2)
    noisy, steps = input_noise({"x": x, "ids": ids}, seed=0)
    step = 5.0 / FLOOR_LEVELS
    assert steps == {"x": pytest.approx(step)}
    moved = np.abs(noisy["x"] - x)
    assert moved.max() <= step / 2 + 1e-6 and moved.max() > 0.4 * step
    assert noisy["x"].dtype == np.float32
    assert np.array_equal(noisy["ids"], ids)
    again, _ = input_noise({"x": x}, seed=0)
    assert np.array_equal(again["x"], noisy["x"])  # a fixed draw per seed


def test_the_floor_of_an_identity_model_is_the_input_noise_itself():
    """Through a model that passes its input on, the floor is the noise's own relative L2 (the
    mean over the draws), computed here from the same draws without the scorer."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 16, 16])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 16, 16])
    model = helper.make_model(helper.make_graph([helper.make_node("Identity", ["x"], ["y"])],
                                                "id", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    data = _data()
    scorer = ErrorScorer(model.SerializeToString(), data, metric=None,
                         error_measure="relative_l2", optimize=True)
    floor = scorer.noise_floor(draws=2)
    expected = np.mean([np.linalg.norm(input_noise(data, s)[0]["x"] - data["x"]) /
                        np.linalg.norm(data["x"]) for s in range(2)])
    assert floor["error"] == pytest.approx(expected, rel=1e-5)
    assert floor["draws"] == 2 and set(floor["steps"]) == {"x"}


def test_a_steep_model_has_a_far_higher_floor_than_a_gentle_one():
    floors = {}
    for gain in (1.0, 1000.0):
        model = _sigmoid_model(gain).SerializeToString()
        floors[gain] = ErrorScorer(model, _data(), metric=None, error_measure="relative_l2",
                                   optimize=True).noise_floor()["error"]
    assert floors[1000.0] > 5 * floors[1.0]


def test_no_floor_for_a_model_fed_integers():
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    model = helper.make_model(helper.make_graph(
        [helper.make_node("Cast", ["ids"], ["y"], to=TensorProto.FLOAT)], "cast", [ids], [y]),
        opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    data = {"ids": np.arange(16, dtype=np.int64).reshape(4, 4)}
    scorer = ErrorScorer(model.SerializeToString(), data, metric=None,
                         error_measure="relative_l2", optimize=True)
    assert scorer.noise_floor() is None


@pytest.mark.parametrize("gain, warned", [(1000.0, True), (1.0, False)])
def test_the_run_reports_the_floor_and_warns_when_it_fills_the_bound(tmp_path, caplog, gain,
                                                                     warned):
    """A steep model's floor is most of a bound of 0.1: one warning line naming the way out
    (a task-level metric), report.json's ``input_noise_floor`` with its share of the bound,
    report.md's line; a gentle model's floor is a small share and nothing warns."""
    from test_guard_run import _backend

    from qdq_optuna import Config, tune

    with caplog.at_level(logging.WARNING, logger="qdq_optuna"):
        result = tune(_sigmoid_model(gain), tmp_path / "run", backend=_backend(),
                      runtime="onnxruntime", calibration_data=_data(16),
                      max_output_error=0.1, config=Config(schemes_per_region=2),
                      progress=False)
    acc = result.report["accuracy"]
    floor = acc["input_noise_floor"]
    assert floor["share_of_bound"] == pytest.approx(floor["error"] / acc["bound"])
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("noise floor")]
    md = (result.output_dir / "report.md").read_text()
    assert "Noise floor:" in md
    if warned:
        assert floor["share_of_bound"] >= 0.5
        assert len(lines) == 1 and "--metric" in lines[0]
        assert "will hardly stay within" in md
    else:
        assert floor["share_of_bound"] < 0.1
        assert not lines and "will hardly stay within" not in md


def _tune_heavy(tmp_path):
    from test_guard_run import _backend, _calibration

    from qdq_optuna import Config, tune

    return tune(corpus.heavy_tail(3.3, 100.0), tmp_path / "run", backend=_backend(),
                runtime="onnxruntime", calibration_data=_calibration(),
                calibration_method="minmax", config=Config(schemes_per_region=3),
                progress=False)


def test_a_start_whose_repair_kept_nothing_says_so_with_its_sensitivity_table(tmp_path,
                                                                              monkeypatch):
    """With no evaluations for either repair, nothing quantized is kept within the bound: no
    repaired start, but the start that broke the bound says why on its row and in report.md,
    with the sensitivity table of what the ranked repair measured; a start nearly the same
    placement is not repaired again."""
    from qdq_optuna.measure import repair
    from qdq_optuna.search import _starts

    monkeypatch.setattr(repair, "REPAIR_EVALUATIONS", 1)
    monkeypatch.setattr(repair, "BISECT_EVALUATIONS", 0)
    result = _tune_heavy(tmp_path)
    starts = {s["name"]: s for s in result.report["starts"]}
    assert not any(n.endswith(_starts.REPAIRED) for n in starts)
    broke = [s for s in starts.values() if s["name"] != "float" and not s["feasible"]]
    assert broke and all(s.get("repair_outcome") for s in broke)
    first = next(s for s in broke if s["repair_outcome"] == _starts.KEPT_NOTHING)
    # out of evaluations, the ranked repair returned every group: nothing quantized kept
    assert first["repair"]["sensitivity"]
    assert first["repair"]["returned"] == first["repair"]["groups_total"]
    md = (result.output_dir / "report.md").read_text()
    assert f"## Repair of {first['name']}" in md and "| group |" in md
    for twin in broke:
        if twin is not first:
            assert twin["repair_outcome"] == (f"not repaired: nearly the placement of "
                                              f"{first['name']}, repaired already")


def test_a_repaired_start_slower_than_float_is_measured_and_the_report_says_why(tmp_path):
    """A repaired start runs no faster than float when the returns break the integer chains
    (here: any part of the placement is slower than float, only all of it fast): it is
    measured all the same (the runtime decides, not the repair's estimate), float stands,
    and report.md says why next to the sensitivity table."""
    import _latency_fns as fns
    from test_guard_run import _calibration

    from qdq_optuna import Config, tune
    from qdq_optuna.backends.callable import CallableBackend
    from qdq_optuna.search import _starts

    result = tune(corpus.heavy_tail(3.3, 100.0), tmp_path / "run",
                  backend=CallableBackend(fns.only_everything_quantized_is_fast,
                                          deterministic=True),
                  runtime="onnxruntime", calibration_data=_calibration(),
                  calibration_method="minmax", config=Config(schemes_per_region=3),
                  progress=False)
    starts = {s["name"]: s for s in result.report["starts"]}
    assert starts["all"]["latency_ms"] == 5.0 and not starts["all"]["feasible"]
    repaired = starts["all" + _starts.REPAIRED]
    assert starts["all"]["repair_outcome"] == "repaired: all" + _starts.REPAIRED
    assert repaired["feasible"] and repaired["latency_ms"] > starts["float"]["latency_ms"]
    assert not repaired["chosen"] and starts["float"]["chosen"]
    md = (result.output_dir / "report.md").read_text()
    assert "no faster than float: the float islands between its integer chains" in md


def test_the_first_start_past_the_bound_is_repaired_even_with_no_time_left(tmp_path,
                                                                              monkeypatch):
    """On a large model the starts' timing can outlast a short --timeout; the first start
    past the bound to be repaired is repaired all the same (bounded by its evaluations, as the starts' A/Bs
    run whole). Fails with the deadline checked before the first repair too."""
    from qdq_optuna.search import _run, _starts

    monkeypatch.setattr(_run.Tuner, "remaining", lambda self: 0.0)
    result = _tune_heavy(tmp_path)
    starts = {s["name"]: s for s in result.report["starts"]}
    repaired = starts["all" + _starts.REPAIRED]
    assert repaired["feasible"] and starts["all"]["repair_outcome"].startswith("repaired")


def test_a_repaired_recipe_has_no_standing_of_the_recipe():
    """The runtime's recipe stands unless float beats it in an A/B (it is what the runtime's
    users get without us); its repair is not that model, so it stands on its speed alone: a
    repaired PP-OCRv4 recipe that ran 0.75x float once stood and shipped."""
    from qdq_optuna.record import StartOutcome
    from qdq_optuna.search._starts import REPAIRED, _recipe

    rows = [StartOutcome("float", latency_ms=10.0, feasible=True),
            StartOutcome("recipe:onnxruntime", latency_ms=7.0, feasible=False),
            StartOutcome("recipe:onnxruntime" + REPAIRED, latency_ms=13.0, feasible=True)]
    assert _recipe(rows) is None
    rows[1] = StartOutcome("recipe:onnxruntime", latency_ms=7.0, feasible=True)
    assert _recipe(rows).name == "recipe:onnxruntime"


def test_a_repaired_start_is_timed_with_the_baseline_as_the_other_starts(tmp_path):
    """The starts are timed in the same rounds as the baseline, so drift between measurements
    minutes apart cancels; a repaired start is made after those rounds and is timed with the
    baseline too. Here each call of the backend reads 1 % slower than the one before: timed
    alone after the repair, the repaired start (0.6x float's latency) read 0.76x."""
    import _latency_fns as fns
    from test_guard_run import _calibration

    from qdq_optuna import Config, tune
    from qdq_optuna.backends.callable import CallableBackend
    from qdq_optuna.search import _starts

    calls = [0]

    def drifting(model) -> float:
        calls[0] += 1
        return (6.0 if fns.activation_qs(model) else 10.0) * (1 + 0.01 * calls[0])

    result = tune(corpus.heavy_tail(3.3, 100.0), tmp_path / "run",
                  backend=CallableBackend(drifting), runtime="onnxruntime",
                  calibration_data=_calibration(), calibration_method="minmax",
                  config=Config(schemes_per_region=3, refine_rounds=0), timeout=120,
                  progress=False)
    starts = {s["name"]: s for s in result.report["starts"]}
    repaired = starts["all" + _starts.REPAIRED]
    assert repaired["feasible"]
    assert repaired["latency_ms"] / starts["float"]["latency_ms"] == pytest.approx(0.6, rel=0.1)
