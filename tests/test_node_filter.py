"""--exclude-nodes / --op-types: excluded nodes never get Q/DQ, whatever the points, seeds or
promotions would place (``qdq_optuna.placement.filters``)."""

from __future__ import annotations

import logging

import onnx
import pytest

from qdq_optuna import OptionError, PreparedModel
from qdq_optuna.examples import zoo
from qdq_optuna.placement.filters import NodeFilter
from qdq_optuna.placement.scheme import compute_inputs_scheme
from qdq_optuna.placement.seeds import baseline_seed


def _dq_consumers(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """Nodes that read a DequantizeLinear output (activation or weight)."""
    dq_out = {n.output[0] for n in model.graph.node if n.op_type == "DequantizeLinear"}
    return [n for n in model.graph.node if n.op_type not in ("QuantizeLinear", "DequantizeLinear")
            and any(t in dq_out for t in n.input)]


def _every_point_model(pm: PreparedModel) -> onnx.ModelProto:
    uses = set()
    for pp in pm.tunable:
        uses |= pp.uses(pp.ids)
    exporter = pm.exporter()
    return exporter.to_model(exporter.plan(uses))


def _seed_uses(pm: PreparedModel) -> set:
    """Uses of the starting schemes other than 'every point': compute inputs, a baseline
    import that quantizes every tensor."""
    every_tensor = {t for n in pm.graph.nodes for t in n.input}
    uses = set()
    for pp in pm.tunable:
        for scheme in (compute_inputs_scheme(pp), baseline_seed(pp, every_tensor)):
            if scheme:
                uses |= pp.uses([p for p, on in scheme.items() if on])
    return uses


@pytest.mark.parametrize("runtime", ["onnxruntime", "tensorrt"])
@pytest.mark.parametrize("model_name", ["tiny_residual", "tiny_concat", "resnet"])
def test_excluded_nodes_never_get_qdq(model_name, runtime):
    model = zoo.build(model_name, "small")
    free = PreparedModel.prepare(model, runtime=runtime)
    hit = {n.name for n in _dq_consumers(_every_point_model(free))}
    # one node by its name, a family by a regular expression (both get Q/DQ without a filter)
    by_name = sorted(hit)[0]
    convs = sorted(n for n in hit if n.endswith("conv") or n.endswith("conv2"))
    assert convs, hit
    pm = PreparedModel.prepare(model, runtime=runtime, exclude_nodes=[by_name, r".*conv2?"])
    excluded = {by_name} | {n.name for n in pm.graph.nodes
                            if n.name.endswith("conv") or n.name.endswith("conv2")}
    quantized = _every_point_model(pm)
    onnx.checker.check_model(quantized)
    assert not {n.name for n in _dq_consumers(quantized)} & excluded
    assert {n.name for n in _dq_consumers(quantized)}, "the filter must not switch off everything"
    seeds = _seed_uses(pm)
    assert not {pm.graph.nodes[n].name for _, n, _ in seeds} & excluded
    # every use a point may cover says why an excluded node's inputs are not among them
    assert pm.node_filter.exclude_nodes == (by_name, r".*conv2?")


@pytest.mark.parametrize("runtime", ["onnxruntime", "tensorrt"])
def test_op_types_limit_every_point(runtime):
    model = zoo.build("tiny_residual")
    pm = PreparedModel.prepare(model, runtime=runtime, op_types="Conv")
    consumers = _dq_consumers(_every_point_model(pm))
    assert consumers and {n.op_type for n in consumers} == {"Conv"}
    free = {n.op_type for n in _dq_consumers(_every_point_model(
        PreparedModel.prepare(model, runtime=runtime)))}
    assert free - {"Conv"}, "without the filter other op types get Q/DQ too"
    for pp in pm.tunable:
        assert {pm.graph.nodes[n].op_type for _, n, _ in pp.uses(pp.ids)} == {"Conv"}


def test_a_promotion_never_covers_an_excluded_concat():
    """TensorRT rules quantize a tensor for its Concat consumers too (promotion); an excluded
    Concat keeps float inputs."""
    model = zoo.build("tiny_concat")
    free = _dq_consumers(_every_point_model(PreparedModel.prepare(model, runtime="tensorrt")))
    assert "sppf/concat" in {n.name for n in free}
    pm = PreparedModel.prepare(model, runtime="tensorrt", exclude_nodes=["sppf/concat"])
    exporter = pm.exporter()
    for pp in pm.tunable:
        for pid in pp.ids:  # one point at a time: promotions act on partly covered tensors
            quantized = exporter.to_model(exporter.plan(pp.uses([pid])))
            assert "sppf/concat" not in {n.name for n in _dq_consumers(quantized)}, pid


def test_unnamed_nodes_are_matched_by_their_index():
    model = zoo.build("tiny_chain")
    for node in model.graph.node:
        node.name = ""
    pm = PreparedModel.prepare(model, runtime="tensorrt")
    first = next(n for _, n, _ in sorted(pm.tunable[0].uses(pm.tunable[0].ids)))
    label = pm.graph.name_of(first)
    assert label.startswith("#")
    filtered = PreparedModel.prepare(model, runtime="tensorrt", exclude_nodes=label)
    assert all(n != first for pp in filtered.tunable for _, n, _ in pp.uses(pp.ids))


def test_bad_filters_are_one_clear_error(caplog):
    with pytest.raises(OptionError, match=r"--op-types: 'conv' is not an ONNX op type \(did you "
                                          r"mean Conv"):
        NodeFilter.parse(op_types=["conv"])
    model = zoo.build("tiny_residual")
    with pytest.raises(OptionError, match=r"--exclude-nodes 'layer\[': no node has this name"):
        PreparedModel.prepare(model, exclude_nodes=["layer["])
    with caplog.at_level(logging.WARNING, logger="qdq_optuna"):
        PreparedModel.prepare(model, exclude_nodes=["no_such_node"])
    assert "--exclude-nodes 'no_such_node' matches no node" in caplog.text


def test_parse_accepts_what_users_type():
    f = NodeFilter.parse(exclude_nodes="a/b", op_types=["Conv, MatMul", "Add", "Conv"])
    assert f.exclude_nodes == ("a/b",) and f.op_types == ("Conv", "MatMul", "Add")
    assert not NodeFilter.parse() and f
    assert f.to_dict() == {"exclude_nodes": ["a/b"], "op_types": ["Conv", "MatMul", "Add"]}


def test_a_recipe_file_that_quantizes_excluded_nodes_is_caught():
    """A runtime's tool runs on the whole model, so its file may quantize what the user
    excluded: the filter names those nodes (static Q/DQ, ``quantize_dynamic``'s integer ops
    under their ``_quant`` names), and a file that does not is clean."""
    from qdq_optuna.runtimes import onnxruntime as ort_runtime

    model = zoo.build("transformer")
    dynamic = onnx.load_from_string(ort_runtime.ort_dynamic_recipe_bytes(model))
    matmuls = [n.name for n in model.graph.node if n.op_type == "MatMul"]
    query = next(n for n in matmuls if "query" in n)
    found = NodeFilter.parse(exclude_nodes=[r".*/query/.*"]).quantized_against(dynamic)
    assert query in found and all("query" in n for n in found)
    assert NodeFilter.parse(op_types="Conv").quantized_against(dynamic)  # MatMuls, not Conv
    assert NodeFilter.parse(exclude_nodes=["no_such_node"]).quantized_against(dynamic) == []
    assert NodeFilter().quantized_against(dynamic) == []
