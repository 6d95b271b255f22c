"""Runtime session settings are part of the result: ONNX Runtime's QDQPropagationTransformer
moves a Q in front of a MaxPool that follows a float op, and the uint8 MaxPool then runs in a
slow NCHW kernel; the shipped model is A/B-timed with and without the setting that keeps the
placement, and ships with the faster one (real ONNX Runtime sessions, small generated models)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from qdq_optuna import tune
from qdq_optuna.backends import BackendError, Configured, SessionSettings, make_backend
from qdq_optuna.backends.onnxruntime import OnnxRuntimeBackend
from qdq_optuna.measure.accuracy import ErrorMeasure, ErrorScorer
from qdq_optuna.measure.bound import AccuracyBound, AskedBound
from qdq_optuna.measure.timing import Measurer, TimingProtocol
from qdq_optuna.runtimes.onnxruntime import PROFILE, SESSION_SETTINGS
from qdq_optuna.search._plans import PlanMeasurer
from qdq_optuna.search._runtime_settings import SettingsDecision, choose_settings

NO_PROPAGATION = SESSION_SETTINGS[0]
CHANNELS, SIDE = 32, 96


def _bound(value: float) -> AccuracyBound:
    return AccuracyBound.resolve(AskedBound(value, ErrorMeasure("relative_l2")), "test data")


def _pooled(qdq: bool, pool_quantized: bool = False, *, channels: int = CHANNELS,
            side: int = SIDE, kernel: int = 1, convs: int = 1,
            head: str = "Sigmoid") -> onnx.ModelProto:
    """``head`` (a float op: Sigmoid; LRN has no integer kernel and no quantizer quantizes
    it) -> MaxPool -> ``convs`` Convs (``kernel`` x ``kernel``) -> Relu. With
    ``qdq``: a Q/DQ pair on the MaxPool's output (the first Conv's input), int8 weights and a
    Q/DQ pair on each Conv's output; ``pool_quantized``: a Q/DQ pair on the MaxPool's input
    too (the placement itself runs it on uint8: nothing is left for the propagation to
    move)."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(np.array(1 / 255, np.float32), "s"),
             numpy_helper.from_array(np.array(0, np.uint8), "z"),
             numpy_helper.from_array(np.array(0.02, np.float32), "s2"),
             numpy_helper.from_array(np.array(128, np.uint8), "z2")]
    nodes = [helper.make_node(head, ["x"], ["sg"], name="head",
                              **({"size": 5} if head == "LRN" else {}))]
    pool_in = "sg"
    if qdq and pool_quantized:
        nodes += [helper.make_node("QuantizeLinear", ["sg", "s", "z"], ["sgq"]),
                  helper.make_node("DequantizeLinear", ["sgq", "s", "z"], ["sgd"])]
        pool_in = "sgd"
    nodes.append(helper.make_node("MaxPool", [pool_in], ["mp"], name="pool", kernel_shape=[3, 3],
                                  strides=[2, 2], pads=[1, 1, 1, 1]))
    x, (scale, zero) = "mp", ("s", "z")
    for i in range(convs):
        w = (rng.standard_normal((channels, channels, kernel, kernel)) * 0.1).astype(np.float32)
        conv_in, conv_w = x, f"w{i}"
        if qdq:
            wq = np.clip(np.round(w / 0.01), -127, 127).astype(np.int8)
            inits += [numpy_helper.from_array(wq, f"w{i}q"),
                      numpy_helper.from_array(np.array(0.01, np.float32), f"w{i}s"),
                      numpy_helper.from_array(np.array(0, np.int8), f"w{i}z")]
            nodes += [helper.make_node("QuantizeLinear", [x, scale, zero], [f"{x}q"]),
                      helper.make_node("DequantizeLinear", [f"{x}q", scale, zero], [f"{x}d"]),
                      helper.make_node("DequantizeLinear", [f"w{i}q", f"w{i}s", f"w{i}z"],
                                       [f"w{i}d"])]
            conv_in, conv_w = f"{x}d", f"w{i}d"
        else:
            inits.append(numpy_helper.from_array(w, f"w{i}"))
        nodes.append(helper.make_node("Conv", [conv_in, conv_w], [f"c{i}"], name=f"conv{i}",
                                      pads=[kernel // 2] * 4))
        x, (scale, zero) = f"c{i}", ("s2", "z2")
    if qdq:
        nodes += [helper.make_node("QuantizeLinear", [x, "s2", "z2"], ["yq"]),
                  helper.make_node("DequantizeLinear", ["yq", "s2", "z2"], ["yd"])]
        x = "yd"
    nodes.append(helper.make_node("Relu", [x], ["y"], name="relu"))
    graph = helper.make_graph(
        nodes, "pooled", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                        [1, channels, side, side])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT,
                                       [1, channels, side // 2, side // 2])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    return model


def test_the_setting_is_timed_only_where_it_changes_the_kernels():
    """Q after a MaxPool that follows a float op: the propagation makes the MaxPool uint8,
    the setting keeps it float (other kernels); a placement that quantizes the MaxPool's
    input itself runs the same kernels either way, and a float model has no Q to move."""
    assert PROFILE.settings_matter(_pooled(True).SerializeToString(), NO_PROPAGATION)
    assert not PROFILE.settings_matter(_pooled(True, pool_quantized=True).SerializeToString(),
                                       NO_PROPAGATION)
    assert not PROFILE.settings_matter(_pooled(False).SerializeToString(), NO_PROPAGATION)


@pytest.mark.parametrize("isolate", [False, True])
def test_a_configured_model_runs_under_its_settings(isolate):
    """The backend (in this process or in its worker) creates the session with the config
    entries: one that reads an ONNX file as ORT format fails the load, the same model under
    the propagation setting runs."""
    backend = make_backend("onnxruntime", isolate=isolate)
    try:
        model = _pooled(True).SerializeToString()
        with backend.load(Configured(model, NO_PROPAGATION)) as runner:
            assert len(runner.time(1, 2)) == 2
        assert backend.session_settings
        ort_format = SessionSettings("ort_format", (("session.load_model_format", "ORT"),))
        with pytest.raises(BackendError, match="ORT model verification"):
            backend.load(Configured(model, ort_format))
    finally:
        backend.close()


def _plans(model: bytes) -> PlanMeasurer:
    data = {"x": np.random.default_rng(1).standard_normal((2, CHANNELS, SIDE, SIDE))
            .astype(np.float32)}
    scorer = ErrorScorer(_pooled(False).SerializeToString(), data, metric=None,
                         error_measure="relative_l2", optimize=True)
    protocol = TimingProtocol.robust().with_(warmup=2, runs=10, process_warmup_rounds=1)
    return PlanMeasurer(Measurer(OnnxRuntimeBackend(), protocol), None, scorer)


def test_the_faster_setting_ships_with_its_error_and_ab():
    """The uint8 NCHW MaxPool the propagation makes is slower than the float one: the A/B
    says so beyond noise, the guard's error under the setting is that of the same outputs,
    and the setting ships; a bound below that error keeps the defaults."""
    model = _pooled(True).SerializeToString()
    plans = _plans(model)
    choice = choose_settings(PROFILE, plans.measurer.backend, plans, _bound(0.2), model)
    (trial,) = choice.trials
    assert trial.decision is SettingsDecision.SHIPS, trial
    assert choice.shipped == NO_PROPAGATION
    assert trial.ratio < 1 and trial.ci[1] < 1
    default_error = plans.scorer.score_bytes(model)["error"]
    assert trial.error == pytest.approx(default_error, rel=1e-4, abs=1e-6)
    entry = choice.to_dict()
    assert entry["shipped"]["entries"] == {
        "optimization.disable_specified_optimizers": "QDQPropagationTransformer"}
    assert entry["candidates"][0]["decision"] == "ships"
    choice.baseline_ships()  # the tuned model lost to the user's: no settings ship with it
    assert choice.report()["shipped"] is None
    assert choice.report()["candidates"][0]["decision"] == SettingsDecision.BASELINE_SHIPS.value
    past = choose_settings(PROFILE, plans.measurer.backend, plans, _bound(trial.error / 2),
                           model)
    assert past.shipped is None
    assert past.trials[0].decision is SettingsDecision.PAST_BOUND


def test_a_placement_the_setting_cannot_change_is_not_timed():
    model = _pooled(True, pool_quantized=True).SerializeToString()
    plans = _plans(model)
    loads = plans.measurer.loads
    choice = choose_settings(PROFILE, plans.measurer.backend, plans, _bound(0.2), model)
    assert choice.shipped is None
    assert [t.decision for t in choice.trials] == [SettingsDecision.SAME_KERNELS]
    assert plans.measurer.loads == loads  # no session was timed


def test_a_tuned_model_ships_with_the_settings_it_was_measured_with(tmp_path):
    """A whole run where the MaxPool must stay float (``--exclude-nodes``) behind an LRN (as
    in Inception v1): report.json's ``session_settings`` holds the setting's A/B on the
    shipped model (the propagation changes its kernels), the final A/B measured the model
    with what ships, what ran is read under it, and report.md gives the line a deployment
    adds. Whether a Q/DQ model ships at all depends on the CPU (its integer Convs against
    float: about 0.97 ms against 1.20 ms, 0.80 ms with the setting, on a 2-core Xeon with
    AVX512-VNNI; a CPU without VNNI may run them slower than float): where the float model
    ships, no setting may ship with it, and the test says which case it checked."""
    src = tmp_path / "pooled.onnx"
    onnx.save(_pooled(False, channels=128, side=16, kernel=3, convs=6, head="LRN"), str(src))
    out = tmp_path / "run"
    report = tune(str(src), out, exclude_nodes=["pool"], mode="quick", progress=False).report
    saved = onnx.load(str(out / "optimized.onnx"))
    ss = report["session_settings"]
    text = (out / "report.md").read_text()
    assert json.loads((out / "report.json").read_text())["session_settings"] == ss
    if "QuantizeLinear" not in {n.op_type for n in saved.graph.node}:  # float is fastest here
        assert ss["shipped"] is None and NO_PROPAGATION.code[0] not in text
        pytest.skip("this CPU ran the integer Convs no faster than float: the float model "
                    "shipped, without settings (checked); the shipping path needs one that "
                    "runs them faster")
    (candidate,) = ss["candidates"]
    assert candidate["name"] == NO_PROPAGATION.name
    assert candidate["decision"] != SettingsDecision.SAME_KERNELS.value
    assert candidate["ratio"] is not None
    assert ss["shipped"] is not None, candidate
    assert candidate["decision"] == "ships" and candidate["ci"][1] < 1
    assert NO_PROPAGATION.code[0] in text
    # what the runtime ran is read under the settings it ships with
    assert report["what_ran"]["how"].endswith(f"session settings {NO_PROPAGATION.name})")
    assert "session settings A/B" in text  # its phase in "Where the time went"


def test_past_the_deadline_no_setting_is_timed():
    """``--timeout``: past the run's deadline the final A/B gets what is left; the setting
    is not timed and says why."""
    import time

    model = _pooled(True).SerializeToString()
    plans = _plans(model)
    plans.set_deadline(time.monotonic() - 1.0)
    choice = choose_settings(PROFILE, plans.measurer.backend, plans, _bound(0.2), model)
    assert choice.shipped is None and plans.measurer.loads == 0
    assert [t.decision for t in choice.trials] == [SettingsDecision.OUT_OF_TIME]
