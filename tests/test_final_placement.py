"""``optimized.onnx`` carries exactly the placement the search committed.

The tuned set is recomputed independently of the exporter, from what the studies store: each
pattern study's ``committed`` user attr (point -> chosen value, 0 = off) and
``qdq_point_tensors`` (point -> the tensors it resolves to in all member regions). It must equal
the set of activation tensors that feed a QuantizeLinear in the saved model, for models with
residual Adds, Concat groups and attention, under both runtimes' rules.

The backend is a deterministic latency function that rewards quantized ops (an op whose every
activation input comes through Q -> DQ), so the search commits something in every model.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import optuna
import pytest
from _runs import standing_schemes

from qdq_optuna import Config, tune
from qdq_optuna.backends.callable import CallableBackend
from qdq_optuna.examples import zoo
from qdq_optuna.placement.export import graph_output_names
from qdq_optuna.record.storage import open_storage

pytestmark = pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")

Q, DQ = "QuantizeLinear", "DequantizeLinear"
COMPUTE = {"Conv", "ConvTranspose", "MatMul", "Gemm"}


def activation_q_inputs(model: onnx.ModelProto) -> set[str]:
    """Activations behind a Q (a quantized graph output by its name: the tensor its producer
    writes is renamed, the DQ writes the output)."""
    inits = {i.name for i in model.graph.initializer}
    renamed = graph_output_names(model)
    return {renamed.get(n.input[0], n.input[0]) for n in model.graph.node
            if n.op_type == Q and n.input[0] not in inits}


def rewards_quantized_ops(model: onnx.ModelProto) -> float:
    """``10 - 0.4 * quantized compute ops - 0.15 * other quantized ops + 0.02 * activation Qs``.

    An op is quantized when every input that is not a constant comes from a DQ fed by a Q.
    """
    producer = {o: n for n in model.graph.node for o in n.output}
    inits = {i.name for i in model.graph.initializer}

    def via_qdq(x: str) -> bool:
        p = producer.get(x)
        if p is None or p.op_type != DQ:
            return False
        q = producer.get(p.input[0])
        return q is not None and q.op_type == Q

    def constant(x: str) -> bool:
        p = producer.get(x)
        return x in inits or (p is not None and (
            p.op_type == "Constant" or (p.op_type == DQ and p.input[0] in inits)))

    score = 10.0
    for n in model.graph.node:
        if n.op_type in (Q, DQ):
            continue
        acts = [x for x in n.input if x and not constant(x)]
        if acts and all(via_qdq(x) for x in acts):
            score -= 0.4 if n.op_type in COMPUTE else 0.15
    return score + 0.02 * len(activation_q_inputs(model))


def committed_tensors(out, run_id: str) -> tuple[set[str], int]:
    """Union of the committed points' tensors over the run's pattern studies (and how many
    pattern studies were read), from the storage alone."""
    storage = open_storage(f"sqlite:///{out / 'studies.db'}", heartbeat=False)
    tensors: set[str] = set()
    attrs = [optuna.load_study(study_name=s.study_name, storage=storage).user_attrs
             for s in storage.get_all_studies()
             if s.study_name.startswith(f"{run_id}/") and s.study_name != f"{run_id}/_run"]
    lane = json.loads((out / "report.json").read_text())["lane"]  # the lane that shipped
    patterns = standing_schemes(attrs, lane)  # replayed: chain moves change neighbours too
    for first, committed in patterns:
        point_tensors = first["qdq_point_tensors"]
        for point, value in committed.items():
            if int(value):
                tensors.update(point_tensors[point])
    return tensors, len(patterns)


def run_ort(model: onnx.ModelProto) -> list[np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    feeds = {i.name: rng.standard_normal([d if isinstance(d, int) else 1 for d in i.shape])
             .astype(np.float32) for i in sess.get_inputs()}
    return sess.run(None, feeds)


def inputs_through_qdq(model: onnx.ModelProto, op: str) -> set[str]:
    """Tensors that reach an ``op`` node through a Q -> DQ pair."""
    producer = {o: n for n in model.graph.node for o in n.output}
    fed = set()
    for n in model.graph.node:
        if n.op_type != op:
            continue
        for x in n.input:
            dq = producer.get(x)
            q = producer.get(dq.input[0]) if dq is not None and dq.op_type == DQ else None
            if q is not None and q.op_type == Q:
                fed.add(q.input[0])
    return fed


CASES = [
    ("tiny_residual", "Add"),     # residual Adds (BasicBlocks, one with a 1x1 shortcut)
    ("tiny_concat", "Concat"),    # Concat groups (two branches, SPPF-like MaxPool chain)
    ("tiny_attention", "MatMul"),  # attention (Q/K/V fan-out, QK^T and AV MatMuls)
]


@pytest.mark.parametrize("runtime", ["onnxruntime", "tensorrt"])
@pytest.mark.parametrize("name,op", CASES, ids=[c[0] for c in CASES])
def test_optimized_model_quantizes_exactly_the_committed_tensors(name, op, runtime, tmp_path):
    model = zoo.build(name, "small")
    path = tmp_path / f"{name}.onnx"
    onnx.save(model, str(path))
    out = tmp_path / "run"
    result = tune(path, out, benchmark=CallableBackend(rewards_quantized_ops, deterministic=True),
                  runtime=runtime, config=Config(schemes_per_region=6), progress=False)

    tuned, studies = committed_tensors(out, result.report["run_id"])
    assert studies == len(result.report["patterns"])
    optimized = onnx.load(str(out / "optimized.onnx"))
    onnx.checker.check_model(optimized)
    in_model = activation_q_inputs(optimized)
    assert in_model == tuned, (
        f"{name} ({runtime}): only in the model {sorted(in_model - tuned)}, "
        f"only committed {sorted(tuned - in_model)}"
    )
    assert set(result.report["quantized_tensors"]) == tuned
    # the equality is checked where it matters: the structure under test got quantized
    assert inputs_through_qdq(optimized, op) & tuned, f"{name} ({runtime}): no {op} input tuned"
    # every Q feeds DQs of the same scale and zero point (a pair, never a dangling Q)
    consumers: dict[str, list] = {}
    for n in optimized.graph.node:
        for x in n.input:
            consumers.setdefault(x, []).append(n)
    for q in (n for n in optimized.graph.node if n.op_type == Q):
        dqs = consumers.get(q.output[0], [])
        assert dqs and all(d.op_type == DQ and list(d.input[1:]) == list(q.input[1:]) for d in dqs)
    if runtime == "onnxruntime":
        assert all(np.isfinite(o).all() for o in run_ort(optimized))
