"""``--quant-type mixed``: every insertion point chooses no Q/DQ or one of the runtime's types.

TensorRT rules: none/int8/fp8; ONNX Runtime rules: none/uint8/int8. Checked on exported models:
each quantized activation carries the type chosen for it (the zero point's element type), its
weights follow it (fp8 weights for fp8 activations, int8 otherwise), the opset covers FP8 (19),
onnx.checker accepts the model, and ONNX Runtime runs the ONNX Runtime types.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import optuna
import pytest
from _runs import standing_schemes
from onnx import TensorProto
from optuna.distributions import CategoricalDistribution, IntDistribution
from optuna.trial import TrialState
from test_final_placement import rewards_quantized_ops

from qdq_optuna import Config, tune
from qdq_optuna.backends.callable import CallableBackend
from qdq_optuna.errors import OptionError
from qdq_optuna.examples import zoo
from qdq_optuna.placement.export import graph_output_names
from qdq_optuna.record.storage import open_storage
from qdq_optuna.runtimes.prepared import PreparedModel

pytestmark = pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")

ELEM = {TensorProto.INT8: "int8", TensorProto.UINT8: "uint8", TensorProto.FLOAT8E4M3FN: "fp8"}
TYPES = {"tensorrt": ("int8", "fp8"), "onnxruntime": ("uint8", "int8")}


def use_types(model: onnx.ModelProto) -> dict[tuple[str, str, int], str]:
    """(tensor, consumer node name, input slot) -> the type of the Q/DQ pair in front of it."""
    inits = {i.name: i for i in model.graph.initializer}
    producer = {o: n for n in model.graph.node for o in n.output}
    renamed = graph_output_names(model)  # a quantized graph output: its DQ writes it
    readers = [(n.name, slot, x) for n in model.graph.node
               if n.op_type not in ("QuantizeLinear", "DequantizeLinear")
               for slot, x in enumerate(n.input)]
    readers += [("<graph output>", k, o.name) for k, o in enumerate(model.graph.output)]
    out = {}
    for name, slot, x in readers:
        dq = producer.get(x)
        q = producer.get(dq.input[0]) if dq is not None and dq.op_type == "DequantizeLinear" \
            else None
        if q is not None and q.op_type == "QuantizeLinear":
            tensor = renamed.get(q.input[0], q.input[0])
            out[(tensor, name, slot)] = ELEM[inits[q.input[2]].data_type]
    return out


def weight_types(model: onnx.ModelProto) -> dict[str, str]:
    """Consumer node name -> quant type of its dequantized weight (slot 1)."""
    inits = {i.name: i for i in model.graph.initializer}
    dq_out = {n.output[0]: ELEM.get(inits[n.input[0]].data_type)
              for n in model.graph.node
              if n.op_type == "DequantizeLinear" and n.input[0] in inits}
    return {n.name: dq_out[n.input[1]] for n in model.graph.node
            if n.op_type in ("Conv", "MatMul", "Gemm") and len(n.input) > 1
            and n.input[1] in dq_out}


def feeding_q(model: onnx.ModelProto, node: onnx.NodeProto) -> str | None:
    """The activation tensor quantized in front of ``node``'s input 0, if any."""
    producer = {o: n for n in model.graph.node for o in n.output}
    dq = producer.get(node.input[0])
    if dq is None or dq.op_type != "DequantizeLinear":
        return None
    q = producer.get(dq.input[0])
    return q.input[0] if q is not None and q.op_type == "QuantizeLinear" else None


@pytest.mark.parametrize("runtime", ["tensorrt", "onnxruntime"])
@pytest.mark.parametrize("name", ["tiny_residual", "tiny_attention"])
def test_exported_models_carry_the_chosen_type_per_tensor(runtime, name):
    pm = PreparedModel.prepare(zoo.build(name), runtime=runtime, quant_type="mixed")
    assert pm.mixed_types == TYPES[runtime]
    if runtime == "tensorrt":
        assert pm.graph.opset >= 19  # FP8 Q/DQ need opset 19
    exporter = pm.exporter()
    rng = np.random.default_rng(0)
    typed = {}
    for pp in pm.tunable:  # alternate the types point by point, some points off
        for pid in pp.ids:
            choice = int(rng.integers(0, 3))
            if choice:
                for use in pp.uses([pid]):
                    typed.setdefault(use, TYPES[runtime][choice - 1])
    plan = exporter.plan(typed)
    assert {q for _, _, q in plan.activations} == set(TYPES[runtime])  # both types in use
    model = exporter.to_model(plan)
    onnx.checker.check_model(model)
    # every chosen use sits behind a Q/DQ pair of exactly the chosen type
    got = use_types(model)
    g = pm.graph
    for (tensor, node, slot), q in typed.items():
        assert got[(tensor, g.name_of(node), slot)] == q
    # weights follow their activation
    by_name = {n.name: n for n in model.graph.node}
    for node_name, wq in weight_types(model).items():
        act_type = got[(feeding_q(model, by_name[node_name]), node_name, 0)]
        assert wq == ("fp8" if act_type == "fp8" else "int8")
    if runtime == "tensorrt":
        assert "fp8" in set(weight_types(model).values())
    if runtime == "onnxruntime":
        sess = ort.InferenceSession(model.SerializeToString(),
                                    providers=["CPUExecutionProvider"])
        feeds = {i.name: rng.standard_normal([d if isinstance(d, int) else 1 for d in i.shape])
                 .astype(np.float32) for i in sess.get_inputs()}
        assert all(np.isfinite(o).all() for o in sess.run(None, feeds))


def test_plan_keys_distinguish_types():
    pm = PreparedModel.prepare(zoo.build("tiny_chain"), runtime="tensorrt", quant_type="mixed")
    exporter = pm.exporter()
    uses = pm.tunable[0].uses(pm.tunable[0].ids)
    keys = {exporter.plan(dict.fromkeys(uses, q)).key for q in ("int8", "fp8")}
    assert len(keys) == 2
    assert exporter.plan(set(uses)).key == exporter.plan(dict.fromkeys(uses, "int8")).key


def test_typed_calibrated_scales_are_used_per_type():
    """(tensor, type) scale keys: an int8 and a uint8 Q of the same tensor get each their own
    calibration, and a tensor-only key applies to the exporter's own type only."""
    pm = PreparedModel.prepare(zoo.build("tiny_chain"), runtime="onnxruntime",
                               quant_type="mixed")
    t = pm.candidate_tensors()[0]
    exporter = pm.exporter({t: (0.5, 7), (t, "int8"): (0.25, 0)})
    assert exporter.activation_params(t, "uint8") == (0.5, 7)
    assert exporter.activation_params(t, "int8") == (0.25, 0)
    plain = pm.exporter({t: (0.5, 7)})
    assert plain.activation_params(t, "int8") != (0.5, 7)  # uint8 params never leak to int8


def committed_use_types(out, run_id: str, pm: PreparedModel) -> dict[tuple, str]:
    """(tensor, consumer name, slot) -> type, from the studies' ``committed`` indices and
    ``qdq_choice_names`` with the points resolved by a separately prepared model. Patterns in
    study order, points in ``qdq_points`` order; a use keeps the first type it was given
    (commits are never changed by later patterns)."""
    storage = open_storage(f"sqlite:///{out / 'studies.db'}", heartbeat=False)
    attrs = [optuna.load_study(study_name=s.study_name, storage=storage).user_attrs
             for s in storage.get_all_studies()
             if s.study_name.startswith(f"{run_id}/") and not s.study_name.endswith("/_run")]
    by_id = {pp.pattern.id: pp for pp in pm.tunable}
    types: dict[tuple, str] = {}
    lane = json.loads((out / "report.json").read_text())["lane"]  # the lane that shipped
    for a, committed in standing_schemes(attrs, lane):  # every decided visit replayed
        pp = by_id[a["pattern_id"]]
        for pid in a["qdq_points"]:
            idx = committed[pid]
            for tensor, node, slot in (pp.uses([pid]) if idx else ()):
                types.setdefault((tensor, pm.graph.name_of(node), slot),
                                 a["qdq_choice_names"][idx])
    return types


@pytest.mark.parametrize("sampler,runtime", [("qdq", "onnxruntime"), ("tpe", "tensorrt"),
                                             ("nsga2", "onnxruntime")])
def test_mixed_search_end_to_end(sampler, runtime, tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(zoo.build("tiny_residual"), str(path))
    out = tmp_path / "run"
    result = tune(path, out, benchmark=CallableBackend(rewards_quantized_ops, deterministic=True),
                  runtime=runtime, quant_type="mixed", sampler=sampler,
                  config=Config(schemes_per_region=6), progress=False)
    run_id = result.report["run_id"]
    storage = open_storage(f"sqlite:///{out / 'studies.db'}", heartbeat=False)
    seen_types = set()
    for s in storage.get_all_studies():
        if s.study_name.endswith(("/_run", "/_starts")) or not s.study_name.startswith(
                f"{run_id}/"):
            continue  # the run's bookkeeping, its starts and its overview
        study = optuna.load_study(study_name=s.study_name, storage=storage)
        assert study.user_attrs["qdq_num_choices"] == 3
        assert study.user_attrs["qdq_choice_names"] == ["none", *TYPES[runtime]]
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            for dist in t.distributions.values():
                if sampler == "qdq":
                    assert dist == IntDistribution(0, 2)
                else:
                    assert isinstance(dist, CategoricalDistribution)
                    assert list(dist.choices) == ["none", *TYPES[runtime]]
            seen_types.update(t.user_attrs.get("scheme_types", {}).values())
    assert seen_types, "no trial quantized anything"
    # the run's float part: FP16 under TensorRT rules (the default there), FP32 otherwise
    pm = PreparedModel.prepare(str(path), runtime=runtime, quant_type="mixed",
                               high_precision="fp16" if runtime == "tensorrt" else "fp32")
    expected = committed_use_types(out, run_id, pm)
    assert expected, "nothing committed; the type check would prove nothing"
    model = onnx.load(str(result.optimized_model))
    onnx.checker.check_model(model)
    assert use_types(model) == expected
    for row in result.report["patterns"]:
        assert set(row.get("committed_types", {})) == set(row["committed_scheme"])


@pytest.mark.parametrize("sampler", ["cmaes", "gp"])
def test_mixed_needs_categorical_parameters(sampler, tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(zoo.build("tiny_chain"), str(path))
    with pytest.raises(OptionError, match="--quant-type mixed needs categorical parameters"):
        tune(path, tmp_path / "run", benchmark=CallableBackend(rewards_quantized_ops), runtime="onnxruntime",
             quant_type="mixed", sampler=sampler, progress=False)
