"""Whole-model starts: float, all points, the runtimes' recipes read back, the user's seeds."""

from __future__ import annotations

import collections
import itertools
from pathlib import Path

import onnx
import onnxruntime as ort
import pytest

import qdq_optuna
from qdq_optuna import starts, zoo
from qdq_optuna.backends.costmodel import CostModelBackend
from qdq_optuna.cache import PatternCache
from qdq_optuna.errors import UserError
from qdq_optuna.model import PreparedModel


def _optimized_ops(model: bytes | str, tmp_path: Path) -> collections.Counter:
    """Op types of ONNX Runtime's fully optimized graph (what its CPU kernels run)."""
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    out = tmp_path / "optimized.onnx"
    so.optimized_model_filepath = str(out)
    so.log_severity_level = 3
    ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
    return collections.Counter(n.op_type for n in onnx.load(str(out)).graph.node)


def _without_output_qdq(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with the Q/DQ pairs right before graph outputs removed (no tensor use can
    express them: see read_placement's notes)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    producer = {o: n for n in m.graph.node for o in n.output}
    for out in [o.name for o in m.graph.output]:
        dq = producer.get(out)
        q = producer.get(dq.input[0]) if dq is not None and dq.op_type == "DequantizeLinear" else None
        if q is None or q.op_type != "QuantizeLinear":
            continue
        x = q.input[0]
        m.graph.node.remove(q)
        m.graph.node.remove(dq)
        for n in m.graph.node:
            n.output[:] = [out if t == x else t for t in n.output]
            n.input[:] = [out if t == x else t for t in n.input]
    return m


@pytest.mark.parametrize("name", ["resnet", "yolo"])
def test_ort_recipe_read_back_gives_the_same_quantized_graph(name: str, tmp_path: Path) -> None:
    model = zoo.build(name, "small")
    pm = PreparedModel.prepare(model, runtime="onnxruntime")
    recipe = starts.ort_recipe_model(model, tmp_path)
    uses, notes, counts = starts.read_placement(pm, recipe)
    assert counts["unmapped"] == 0 and counts["mapped"] == counts["reads"] > 10
    start = starts.start_from_uses(pm, "recipe:onnxruntime", uses, notes, counts)
    assert start.exact  # the points express the recipe use for use
    # with the recipe's own scales, our exporter's model optimizes to the same kernels
    exporter = pm.exporter(scales=starts.read_scales(recipe))
    ours = _optimized_ops(exporter.to_bytes(exporter.plan(start.scheme_uses)), tmp_path)
    theirs = _optimized_ops(_without_output_qdq(onnx.load(str(recipe))).SerializeToString(),
                            tmp_path)
    assert ours == theirs
    assert ours["QLinearConv"] > 0


def test_ort_recipe_start_runs_the_tool(tmp_path: Path) -> None:
    model = zoo.build("resnet", "small")
    pm = PreparedModel.prepare(model, runtime="onnxruntime")
    start = starts.ort_recipe_start(pm, model)
    assert start.name == "recipe:onnxruntime" and start.counts["unmapped"] == 0
    assert any(note.startswith("1 graph output") for note in start.notes)  # the logits' Q/DQ
    on = start.on()
    assert sum(map(len, on.values())) > 0
    assert starts.scheme_uses(pm, start.schemes) == set(start.scheme_uses)


def test_float_and_all_on() -> None:
    pm = PreparedModel.prepare(zoo.build("resnet", "small"), runtime="tensorrt")
    f, a = starts.float_start(pm), starts.all_on_start(pm)
    assert not f.uses and f.exact and all(not any(s.values()) for s in f.schemes.values())
    assert a.exact and all(all(s.values()) for s in a.schemes.values())
    assert a.uses == set().union(*(pp.uses(pp.ids) for pp in pm.tunable))
    assert set(a.schemes) == {pp.pattern.id for pp in pm.tunable}


def test_qdq_baseline_round_trip(tmp_path: Path) -> None:
    """A Q/DQ model made from per-pattern schemes is read back to the same schemes."""
    pm = PreparedModel.prepare(zoo.build("yolo", "small"), runtime="tensorrt")
    schemes = {pp.pattern.id: {pid: int(i % 3 == 0) for i, pid in enumerate(pp.ids)}
               for pp in pm.tunable}
    uses = starts.scheme_uses(pm, schemes)
    exporter = pm.exporter()
    path = tmp_path / "baseline.onnx"
    path.write_bytes(exporter.to_bytes(exporter.plan(uses)))
    start = starts.baseline_start(pm, path)
    assert start.counts["unmapped"] == 0
    # the exporter's Concat promotion may add uses: the read-back covers the plan exactly
    assert exporter.plan(start.uses).key == exporter.plan(uses).key
    assert exporter.plan(start.scheme_uses).key == exporter.plan(uses).key


def test_read_placement_matches_renamed_nodes_by_structure(tmp_path: Path) -> None:
    pm = PreparedModel.prepare(zoo.build("resnet", "small"), runtime="tensorrt")
    uses = starts.all_on_start(pm).uses
    exporter = pm.exporter()
    model = onnx.load_from_string(exporter.to_bytes(exporter.plan(uses)))
    for i, node in enumerate(model.graph.node):
        node.name = f"renamed_{i}"
    found, notes, counts = starts.read_placement(pm, model)
    assert counts["unmapped"] == 0 and not notes
    assert exporter.plan(found).key == exporter.plan(uses).key


def test_bad_baseline_is_one_clear_error(tmp_path: Path) -> None:
    pm = PreparedModel.prepare(zoo.tiny_chain(), runtime="tensorrt")
    bad = tmp_path / "garbage.onnx"
    bad.write_bytes(b"not a model")
    with pytest.raises(UserError, match="garbage.onnx"):
        starts.baseline_start(pm, bad)


def test_pattern_cache_start() -> None:
    pm = PreparedModel.prepare(zoo.build("resnet", "small"), runtime="tensorrt")
    pp = pm.tunable[1]
    cache = PatternCache()
    cache.add(pp.pattern.signature, [(pp.ids[:1], 1.0), (pp.ids, 2.0)], minimum_distance=0,
              max_entries=4)
    start = starts.cache_start(pm, cache)
    assert start.on()[pp.pattern.id] == pp.ids[:1]  # the fastest cached scheme
    assert all(not any(s.values()) for p, s in start.schemes.items() if p != pp.pattern.id)
    assert starts.cache_start(pm, PatternCache()) is None


def test_tensorrt_recipe_rules_on_resnet() -> None:
    """Model Optimizer's default INT8 placement on a ResNet: every Conv's input, the shortcut
    input of each residual Add (never the Conv branch), the pooling input; not the GEMV-like
    classifier, never an op's output inside a Conv's kernel."""
    pm = PreparedModel.prepare(zoo.build("resnet", "medium"), runtime="tensorrt")
    g = pm.graph
    start = starts.tensorrt_recipe_start(pm)
    ops = collections.Counter(g.nodes[n].op_type for _, n, _ in start.uses)
    convs = [i for i, n in enumerate(g.nodes) if n.op_type == "Conv"]
    assert {(g.nodes[i].input[0], i, 0) for i in convs} <= start.uses
    assert ops["Gemm"] == 0 and ops["Relu"] == 0 and ops["BatchNormalization"] == 0
    for t, n, _ in start.uses:
        if g.nodes[n].op_type == "Add":  # the shortcut: not produced by this block's Conv/BN
            # (a downsampling block's shortcut is its downsample Conv/BN: quantized, as the
            # rules' downsampling-shortcut exception wants)
            assert g.producer_op(t) in ("Relu", "MaxPool") or "/downsample/" in t, t
    assert ops["GlobalAveragePool"] == 1 and start.exact


def _pattern_alone_best(pm, lat) -> dict[str, float]:
    best = {}
    for pp in pm.tunable:
        best[pp.pattern.id] = min(
            lat(pp.uses([p for p, v in zip(pp.ids, bits) if v]))
            for bits in itertools.product([0, 1], repeat=len(pp.ids)))
    return best


@pytest.fixture(scope="module")
def gated(tmp_path_factory) -> tuple[Path, float]:
    """zoo.gated_pairs on disk, and the speedup of every point on (cost model)."""
    model = zoo.gated_pairs()
    path = tmp_path_factory.mktemp("gated") / "gated.onnx"
    onnx.save(model, str(path))
    # FP16: the high precision tune runs the cost model with by default
    pm = PreparedModel.prepare(model, runtime="tensorrt", high_precision="fp16")
    exporter, backend = pm.exporter(), CostModelBackend()

    def lat(uses) -> float:
        return backend.estimate(exporter.to_bytes(exporter.plan(set(uses)))).total_ms

    float_ms = lat(())
    assert len(pm.tunable) >= 2
    # every scheme of any one pattern alone, the others float: no gain at all
    assert all(ms >= float_ms for ms in _pattern_alone_best(pm, lat).values())
    return path, float_ms / lat(starts.all_on_start(pm).uses)


def test_gated_pairs_gain_needs_both_patterns(gated) -> None:
    _, all_on = gated
    assert all_on > 1.05


def test_tune_finds_the_gain_of_two_adjacent_patterns(gated, tmp_path: Path) -> None:
    path, all_on = gated
    result = qdq_optuna.tune(path, tmp_path / "out", benchmark="costmodel", progress=False)
    assert result.speedup >= all_on / 1.02
