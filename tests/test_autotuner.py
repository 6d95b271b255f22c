"""The ask/tell Autotuner with a user-side benchmark loop."""

from __future__ import annotations

import logging
import re
import textwrap
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from qdq_optuna import Autotuner
from qdq_optuna.examples import zoo
from qdq_optuna.measure.bound import DEFAULT_MAX_OUTPUT_ERROR
from qdq_optuna.model.calibration import random_calibration_data
from qdq_optuna.placement.export import quantized_tensors

REPO = Path(__file__).resolve().parent.parent


def _qdq_latency(model_bytes: bytes) -> float:
    """A deterministic stand-in for a benchmark: full Conv groups pay, stray Q/DQ cost."""
    m = onnx.load_from_string(model_bytes)
    produced_by = {o: n for n in m.graph.node for o in n.output}
    latency = 10.0
    for n in m.graph.node:
        if n.op_type == "Conv":
            src = produced_by.get(n.input[0])
            if src is not None and src.op_type == "DequantizeLinear":
                latency -= 1.0
        if n.op_type == "QuantizeLinear":
            latency += 0.1
    return latency


@pytest.mark.parametrize("sampler", ["qdq", "random"])
def test_ask_tell_loop_commits_and_exports(sampler: str) -> None:
    tuner = Autotuner(zoo.build("tiny_residual"), runtime="tensorrt", sampler=sampler)
    assert tuner.patterns
    for i in range(len(tuner.patterns)):
        tuner.set_pattern(i)
        for _ in range(8):
            trial = tuner.generate()
            tuner.submit(trial, _qdq_latency(tuner.export(trial)))
        tuner.commit()
    final = tuner.export_final()
    onnx.checker.check_model(final)
    ort.InferenceSession(final.SerializeToString(), providers=["CPUExecutionProvider"])
    # something paid off in at least one pattern, and the final model carries exactly it
    assert any(any(s.values()) for s in tuner.commits.values())
    assert quantized_tensors(final) == {u[0] for u in tuner.committed}


def test_failed_builds_are_recorded_not_committed() -> None:
    tuner = Autotuner(zoo.build("tiny_chain"), runtime="tensorrt")
    study = tuner.set_pattern(0)
    trial = tuner.generate()
    tuner.submit(trial, None)
    assert study.trials[0].state.name == "FAIL"
    assert not any(tuner.commit().values())


def _more_qdq_is_faster(model_bytes: bytes) -> float:
    """A deterministic stand-in for a benchmark under which every Q/DQ pair pays, so each
    pattern commits its every point (the final model quantizes all it can)."""
    m = onnx.load_from_string(model_bytes)
    return 10.0 - 0.01 * sum(n.op_type == "QuantizeLinear" for n in m.graph.node)


def _relative_error(model: onnx.ModelProto, reference: onnx.ModelProto, feed: dict) -> float:
    def run(m: onnx.ModelProto) -> np.ndarray:
        return ort.InferenceSession(m.SerializeToString(),
                                    providers=["CPUExecutionProvider"]).run(None, feed)[0]

    ref = run(reference)
    return float(np.linalg.norm(run(model) - ref) / np.linalg.norm(ref))


def _tuned(tuner: Autotuner, trials: int = 4) -> Autotuner:
    for i in range(len(tuner.patterns)):
        tuner.set_pattern(i)
        for _ in range(trials):
            trial = tuner.generate()
            tuner.submit(trial, _more_qdq_is_faster(tuner.export(trial)))
        tuner.commit()
    return tuner


def test_the_final_export_is_calibrated_and_within_the_bound() -> None:
    """``export_final()`` ships calibrated scales checked by tune()'s accuracy guard: on a
    small detector its output error vs float (a real ONNX Runtime session) is within the bound
    and far below that of the same placement with the placeholder scale on every activation."""
    model = zoo.build("yolo", "small")
    data = random_calibration_data(model, None, samples=16, seed=3)
    tuner = _tuned(Autotuner(model, calibration_data=data))
    final = tuner.export_final()
    assert quantized_tensors(final) == {u[0] for u in tuner.committed}  # nothing left out
    placeholder = tuner.prepared.exporter(config=tuner.config)
    feed = {name: a[:1] for name, a in data.items()}
    calibrated_error = _relative_error(final, model, feed)
    placeholder_error = _relative_error(
        placeholder.to_model(placeholder.plan(tuner.committed)), model, feed)
    assert tuner.verdict.status == "within bound"
    assert tuner.verdict.errors["error"] <= DEFAULT_MAX_OUTPUT_ERROR
    assert calibrated_error <= DEFAULT_MAX_OUTPUT_ERROR < placeholder_error
    assert calibrated_error * 5 < placeholder_error


def test_the_final_export_steps_back_when_the_bound_is_broken(caplog) -> None:
    """A bound no 8-bit placement keeps: the guard ships a model within it, and says so."""
    model = zoo.build("tiny_residual")
    tuner = _tuned(Autotuner(model, max_output_error=1e-9), trials=2)
    assert tuner.committed
    with caplog.at_level(logging.WARNING, logger="qdq_optuna"):
        final = tuner.export_final()
    assert tuner.verdict.status != "within bound"
    assert quantized_tensors(final) < {u[0] for u in tuner.committed}
    assert "accuracy guard" in caplog.text
    assert "random inputs" in caplog.text  # no calibration data: the scales are placeholders


def test_trials_use_the_scales_tunes_trials_use() -> None:
    """On ONNX Runtime the trials' models carry calibrated scales (as tune()'s trials), on
    TensorRT the placeholder scale (``Config.default_q_scale``)."""
    def scales(runtime: str) -> set[float]:
        tuner = Autotuner(zoo.build("tiny_chain"), runtime=runtime)
        pp = tuner.patterns[0]  # every point of a pattern on, exported as export(trial) does
        m = onnx.load_from_string(tuner.exporter.to_bytes(tuner.exporter.plan(pp.uses(pp.ids))))
        inits = {i.name: onnx.numpy_helper.to_array(i) for i in m.graph.initializer}
        return {round(float(inits[n.input[1]]), 6) for n in m.graph.node
                if n.op_type == "QuantizeLinear" and n.input[1] in inits}

    assert scales("tensorrt") == {0.1}
    assert scales("onnxruntime") and 0.1 not in scales("onnxruntime")


def _python_block(text: str, containing: str) -> str:
    """The first fenced Python block of ``text`` (Markdown or a docstring) holding
    ``containing``, dedented."""
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    return next(textwrap.dedent(b) for b in blocks if containing in b)


def test_the_ask_tell_example_runs_as_written(tmp_path, monkeypatch) -> None:
    """The Autotuner docstring's ask/tell script, run as written (its 30 trials per pattern
    cut to 2) on an example model and calibration data under the names it reads; docs/api.md
    shows the same script."""
    script = _python_block(Autotuner.__doc__, "Autotuner(")
    page = REPO / "docs" / "api.md"
    if page.is_file():  # the checkout (a suite copied beside a wheel has the docstring alone)
        assert _python_block(page.read_text(encoding="utf-8"), "Autotuner(") == script
    assert script.count("range(30)") == 1
    model = zoo.build("tiny_residual")
    onnx.save(model, tmp_path / "model.onnx")
    np.savez(tmp_path / "cal.npz", **random_calibration_data(model, None, samples=8, seed=1))
    monkeypatch.chdir(tmp_path)
    exec(compile(script.replace("range(30)", "range(2)"), "docs/api.md", "exec"), {})
    final = onnx.load(tmp_path / "optimized.onnx")
    onnx.checker.check_model(final)
    assert (tmp_path / "model.onnx").read_bytes() == model.SerializeToString()  # not modified
