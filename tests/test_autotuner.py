"""The ask/tell Autotuner with a user-side benchmark loop."""

from __future__ import annotations

import onnx
import onnxruntime as ort
import pytest

from qdq_optuna import Autotuner
from qdq_optuna.examples import zoo
from qdq_optuna.placement.export import quantized_tensors


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
