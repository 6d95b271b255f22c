"""Kernel evidence: each integer kernel cut from a Q/DQ model and timed against its float kernel
with real ONNX Runtime sessions; the cache; and the descent's pruning following the evidence in
both directions (the evidence pinned: never which kernel is faster on this machine)."""

from __future__ import annotations

import json
import math

import numpy as np
import onnx
import pytest

from qdq_optuna.backends.onnxruntime import OnnxRuntimeBackend
from qdq_optuna.backends.onnxruntime_kernels import kernels_of
from qdq_optuna.config import Config
from qdq_optuna.examples import zoo
from qdq_optuna.measure import kernels as K
from qdq_optuna.measure.timing import Measurer, TimingProtocol
from qdq_optuna.placement import starts
from qdq_optuna.runtimes.prepared import PreparedModel
from qdq_optuna.search._moves import MoveSpace, MoveStats
from qdq_optuna.search._unfused import Unfused, unavoidable

#: a short A/B: these tests check figures are produced and used, not how precise they are
QUICK = TimingProtocol.fast().with_(process_warmup_rounds=0, min_rounds=2, max_rounds=2)


@pytest.fixture(scope="module")
def resnet():
    """The small ResNet-like zoo model with every point on: (prepared, float, Q/DQ) protos."""
    pm = PreparedModel.prepare(zoo.build("resnet", "small"))
    ex = pm.exporter()
    qdq = onnx.load_from_string(ex.to_bytes(ex.plan(starts.all_on_start(pm).scheme_uses)))
    flt = onnx.load_from_string(ex.to_bytes(ex.plan(set())))
    return pm, flt, qdq


def test_a_unit_is_cut_with_its_qdq_and_runs_as_one_integer_kernel(resnet):
    _, flt, qdq = resnet
    qdq_s, flt_s = K.with_shapes(qdq), K.with_shapes(flt)
    units = K.units(qdq_s)
    convs = [n.name for n in qdq.graph.node if n.op_type == "Conv"]
    assert {u.node for u in units} >= set(convs) and convs
    for unit in units[:3]:
        int_bytes, float_bytes = K.unit_models(unit, qdq_s, flt_s)
        int_model, float_model = (onnx.load_from_string(b) for b in (int_bytes, float_bytes))
        onnx.checker.check_model(int_model, full_check=True)
        onnx.checker.check_model(float_model, full_check=True)
        ops = [n.op_type for n in int_model.graph.node]
        assert unit.node in {n.name for n in int_model.graph.node}
        assert "DequantizeLinear" in ops and "QuantizeLinear" in ops  # the node's own Q/DQ
        assert all(i.type.tensor_type.elem_type == onnx.TensorProto.UINT8
                   for i in int_model.graph.input)  # integer in: the kernel, no conversion
        run_int, run_float = kernels_of(int_bytes), kernels_of(float_bytes)
        assert run_int.integer == 1 and run_int.qdq == 0  # one fused integer kernel
        assert run_float.integer == 0 and run_float.qdq == 0 and run_float.float_kernels >= 1


def test_subgraph_cut_of_a_region_is_a_valid_model(resnet):
    _, flt, _ = resnet
    flt = K.with_shapes(flt)
    nodes = list(flt.graph.node[:3])  # conv1 -> relu -> maxpool
    model = onnx.load_from_string(K.subgraph(flt, [nodes[0].input[0]], [nodes[-1].output[0]]))
    assert [n.name for n in model.graph.node] == [n.name for n in nodes]


def test_timings_are_finite_and_the_cache_is_keyed_by_cpu_flags(resnet, tmp_path):
    _, flt, qdq = resnet
    units = K.units(K.with_shapes(qdq))
    skip = [u.node for u in units[2:]]  # two units keep the test short
    path = tmp_path / "kernels.json"
    backend = OnnxRuntimeBackend()
    run = lambda flags: K.kernel_table(backend, flt, qdq, skip=skip, output_q=True,  # noqa: E731
                                       cache=K.KernelCache(path), flags=flags, protocol=QUICK)
    first = run({"avx2", "fma"})
    assert set(first.timings) == {u.node for u in units[:2]}
    assert first.timed == len({u.signature for u in units[:2]}) and first.cached == 0
    for t in first.timings.values():
        assert all(math.isfinite(x) and x > 0 for x in (t.int_ms, t.float_ms, t.ratio))
        assert t.ci_low <= t.ratio <= t.ci_high and t.rounds >= 2
        assert t.decision in ("float", "integer", "tie")
    again = run({"fma", "avx2"})  # the same machine: every figure from the cache
    assert again.timed == 0 and again.cached == first.timed
    assert again.timings == first.timings
    other = run({"avx2", "fma", "avx512_vnni"})  # another CPU: measured again
    assert other.timed == first.timed and other.cached == 0
    data = json.loads(path.read_text())
    assert len(data["machines"]) == 2
    assert any(m["cpu_flags"] == ["avx2", "fma", "avx512_vnni"] for m in data["machines"].values())


def test_a_broken_cache_file_is_ignored(tmp_path):
    path = tmp_path / "kernels.json"
    path.write_text("{not json")
    cache = K.KernelCache(path)
    assert cache.get("k", "sig") is None
    t = K.KernelTiming("sig", "Conv", 2.0, 1.0, 0.5, 0.45, 0.55, 4)
    cache.put("k", {"cpu_flags": []}, t)
    cache.save()
    assert K.KernelCache(path).get("k", "sig") == t


@pytest.mark.parametrize("ratio, ci, decision", [
    (0.8, (0.75, 0.85), "float"), (1.2, (1.1, 1.3), "integer"), (0.99, (0.9, 1.05), "tie")])
def test_the_decision_is_the_interval_not_the_point(ratio, ci, decision):
    t = K.KernelTiming("s", "Conv", 1.0, ratio, ratio, *ci, 4)
    assert t.decision == decision


def _unfused(pm):
    space = MoveSpace(pm)

    class _Plans:  # a measured backend; the report is given, never read here
        measurer = type("M", (), {"backend": None})
        deterministic = False

    class _S:
        prepared = pm
        plans = _Plans()

    return space, Unfused(_S(), space.uses_of)


def _timing(faster: str) -> K.KernelTiming:
    """Pinned evidence: float (or integer) measured faster by a clear margin."""
    if faster == "float":
        return K.KernelTiming("s", "Conv", 1.0, 0.7, 0.7, 0.65, 0.75, 6)
    return K.KernelTiming("s", "Conv", 0.7, 1.0, 1.0 / 0.7, 1.3, 1.5, 6)


def test_pruning_follows_the_kernel_evidence_in_both_directions(resnet):
    pm, _, qdq = resnet
    model = qdq.SerializeToString()
    what = OnnxRuntimeBackend().what_ran(model)
    space, unfused = _unfused(pm)
    g = pm.graph
    schemes = {pp.pattern.id: dict.fromkeys(pp.ids, 1) for pp in pm.tunable}
    convs = [n.name for n in g.nodes if n.op_type == "Conv"]
    # a Conv whose input Q/DQ the runtime fused: the removal a "fused, so futile" rule drops
    target = next(
        (pid, pt) for (pid, pt), uses in space.uses_of.items()
        if len(uses) == 1 and all(g.nodes[n].op_type == "Conv" and t in what.fused
                                  and t not in what.standalone for t, n, _ in uses))
    (tensor, node, _), = space.uses_of[target]
    conv = g.nodes[node].name

    def visit(kernels):
        unfused.kernels = kernels
        return space.visit(target[0], schemes, MoveStats(0), **{
            k: v for k, v in unfused.pruning_of(what).items()})

    def removal(v):
        return [m for m in v.moves if m.off == frozenset({target[1]}) and not m.on]

    # integer measured faster everywhere: the lone removal is pruned (as without evidence)
    integer = K.KernelTable({}, [], {c: _timing("integer") for c in convs})
    assert not removal(visit(integer)) and visit(integer).dropped.get("fused")
    assert not removal(visit(None))
    # adding a pair there can save what its integer-faster neighbours measured (0.3 ms each)
    unfused.kernels = integer
    near = [n for n in unfused._around(target)[1] if g.nodes[n].name in integer.timings]
    assert near and unfused.add_gains()(target) == pytest.approx(0.3 * len(near))
    # float measured faster at that Conv: the removal is kept, with the ones the table
    # recommends ahead of every other move
    table = K.KernelTable({}, [], {**integer.timings, conv: _timing("float")})
    v = visit(table)
    assert removal(v), "a removal at a float-faster kernel is measured"
    gained = [m for m in v.moves if not m.on and any(
        v.attr["gains"].get(p, 0) > 0 for p in m.off)]
    assert gained and v.moves[:len(gained)] == gained
    assert unfused.gains(what)(target) == pytest.approx(0.3)
    # no resolved difference: measured too (prune only on evidence that integer is faster)
    tie = K.KernelTable({}, [], {**integer.timings,
                                 conv: K.KernelTiming("s", "Conv", 1.0, 1.0, 1.0, 0.9, 1.1, 6)})
    assert removal(visit(tie)) and "gains" not in visit(tie).attr


def test_the_report_lists_the_table_with_the_decision_and_the_shipped_precision(resnet):
    from qdq_optuna.outputs.report import _kernel_lines
    from qdq_optuna.search._unfused import kernel_table_entry, placed_and_modes

    pm, flt, qdq = resnet
    convs = [n.name for n in pm.graph.nodes if n.op_type == "Conv"]
    table = K.KernelTable({"name": "onnxruntime", "threads": 1}, ["avx2"],
                          {convs[0]: _timing("float"), convs[1]: _timing("integer")})
    for model, shipped in ((qdq.SerializeToString(), "integer"),
                           (flt.SerializeToString(), "float")):
        entry = kernel_table_entry(table, *placed_and_modes(table, model))
        rows = {r["node"]: r for r in entry["kernels"]}
        assert rows[convs[0]]["decision"] == "float" and "tried first" in rows[convs[0]]["action"]
        assert rows[convs[1]]["decision"] == "integer" and "pruned" in rows[convs[1]]["action"]
        assert {r["shipped"] for r in rows.values()} == {shipped}
        assert entry["kernels"][0]["node"] == convs[0]  # the largest float gain first
        text = "\n".join(_kernel_lines(entry))
        assert "CPU flags: avx2" in text and f"| {convs[0]} | Conv |" in text


def _qs(model: onnx.ModelProto) -> int:
    """A latency that grows with the QuantizeLinear nodes a model runs (a pinned ranking)."""
    return 1.0 + 0.1 * sum(n.op_type == "QuantizeLinear" for n in model.graph.node)


def _pair(pm):
    """Every point on, and the same with one Conv's input pair off: (with, without) plans."""
    ex = pm.exporter()
    uses = set(starts.all_on_start(pm).scheme_uses)
    conv = next(i for i, n in enumerate(pm.graph.nodes)
                if n.op_type == "Conv" and any(u[1] == i for u in uses))
    return ex, ex.plan(uses), ex.plan({u for u in uses if u[1] != conv}), conv


def test_a_region_holds_the_op_whose_fusion_a_q_after_its_relu_decides(resnet):
    pm = resnet[0]
    g = pm.graph
    ex = pm.exporter()
    uses = set(starts.all_on_start(pm).scheme_uses)
    relu = next(i for i, n in enumerate(g.nodes) if n.op_type == "Relu"
                and g.nodes[g.producer[n.input[0]][0]].op_type == "Conv"
                and any(u[0] == n.output[0] for u in uses))
    conv = g.producer[g.nodes[relu].input[0]][0]
    out = g.nodes[relu].output[0]
    full, less = ex.plan(uses), ex.plan({u for u in uses if u[0] != out})
    nodes = K.changed_nodes(g, full, less)
    assert relu in nodes and conv in nodes  # the Conv runs integer only with the Q after it
    cuts = []
    for p in (full, less):
        cut = onnx.load_from_string(K.region_model(K.with_shapes(
            onnx.load_from_string(ex.to_bytes(p))), *K.region_cut(g, nodes)))
        onnx.checker.check_model(cut, full_check=True)
        cuts.append(cut)
    assert all(g.nodes[conv].name in {n.name for n in c.graph.node} for c in cuts)


def test_a_region_is_cut_from_both_models_around_the_changed_qdq(resnet):
    pm = resnet[0]
    ex, full, less, conv = _pair(pm)
    nodes = K.changed_nodes(pm.graph, full, less)
    assert conv in nodes
    inputs, outputs = K.region_cut(pm.graph, nodes)
    cuts = [onnx.load_from_string(K.region_model(K.with_shapes(
        onnx.load_from_string(ex.to_bytes(p))), inputs, outputs)) for p in (full, less)]
    for cut in cuts:
        onnx.checker.check_model(cut, full_check=True)
        assert pm.graph.nodes[conv].name in {n.name for n in cut.graph.node}
    assert _qs(cuts[0]) > _qs(cuts[1])  # the pair that differs is in the cut
    timing = K.time_region(Measurer(OnnxRuntimeBackend(), QUICK), pm.graph,
                           onnx.load_from_string(ex.to_bytes(full)),
                           onnx.load_from_string(ex.to_bytes(less)), full, less)
    assert timing is not None and math.isfinite(timing.ratio) and timing.nodes == len(nodes)


@pytest.mark.parametrize("candidate_has_more_qdq", [True, False])
def test_the_subgraph_screen_drops_a_slower_region_and_records_agreement(
        resnet, candidate_has_more_qdq):
    from qdq_optuna.backends.callable import CallableBackend
    from qdq_optuna.search._plans import PlanMeasurer, Reference

    pm = resnet[0]
    ex, full, less, _ = _pair(pm)
    cand, ref = (full, less) if candidate_has_more_qdq else (less, full)
    protocol = TimingProtocol.robust().with_(process_warmup_rounds=0, min_rounds=2,
                                             max_rounds=3, runs=1, warmup=0)
    whole = Measurer(CallableBackend(_qs), protocol)
    plans = PlanMeasurer(whole, memo=None, regions=pm.graph)
    plans.regions = (pm.graph, Measurer(whole.backend, protocol))  # a short region A/B too
    ref_bytes = ex.to_bytes(ref)
    ref_ms = _qs(onnx.load_from_string(ref_bytes))
    m = plans._time(ex.to_bytes(cand), Reference(ref, ref_bytes, ref_ms, ref_ms), cand)
    sub = m.extra["subgraph"]
    if candidate_has_more_qdq:  # its region is slower: no whole-model measurement at all
        assert m.kind == "screened_out" and m.screened_out and sub["verdict"] == "slower"
        assert whole.loads == 0
    else:  # faster region: the whole model is A/B-compared, and the two rankings agree
        assert m.kind == "ab" and sub["ratio"] < 1 and m.ratio < 1 and sub["agrees"]
        assert whole.loads > 0


def test_the_subgraph_screen_audit_times_a_slower_region_as_a_whole_model_too(resnet):
    import optuna

    from qdq_optuna.backends.callable import CallableBackend
    from qdq_optuna.outputs.report import trial_statistics
    from qdq_optuna.record import TrialAttr
    from qdq_optuna.search._plans import PlanMeasurer, Reference

    pm = resnet[0]
    ex, full, less, _ = _pair(pm)
    protocol = TimingProtocol.robust().with_(process_warmup_rounds=0, min_rounds=2,
                                             max_rounds=3, runs=1, warmup=0)
    whole = Measurer(CallableBackend(_qs), protocol)
    plans = PlanMeasurer(whole, memo=None, regions=pm.graph, audit=True)
    plans.regions = (pm.graph, Measurer(whole.backend, protocol))
    ref_bytes = ex.to_bytes(less)
    ref_ms = _qs(onnx.load_from_string(ref_bytes))
    m = plans._time(ex.to_bytes(full), Reference(less, ref_bytes, ref_ms, ref_ms), full)
    sub = m.extra["subgraph"]  # the region is slower, and so is the whole model: a right drop
    assert sub["verdict"] == "slower" and m.kind == "ab" and whole.loads > 0
    assert sub["whole_verdict"] == "slower" and sub["agrees"]
    st = trial_statistics([optuna.trial.create_trial(
        value=m.latency_ms, user_attrs={TrialAttr.MEASUREMENT: m.to_attrs()})],
        plans.screen_discard_ratio)
    assert (st["subgraph_slower_audited"], st["subgraph_slower_right"]) == (1, 1)
    assert st["subgraph_screened_out"] == 0


def test_openvino_units_read_integer_and_write_float_and_are_timed():
    pytest.importorskip("openvino")
    from qdq_optuna.backends.openvino import OpenVinoBackend

    pm = PreparedModel.prepare(zoo.build("resnet", "small"), runtime="openvino")
    ex = pm.exporter()
    qdq = onnx.load_from_string(ex.to_bytes(ex.plan(starts.all_on_start(pm).scheme_uses)))
    flt = onnx.load_from_string(ex.to_bytes(ex.plan(set())))
    shaped = K.with_shapes(qdq)
    assert not K.units(shaped)  # no Q after the Convs: not an ONNX Runtime integer kernel
    units = K.units(shaped, output_q=False)
    assert units
    int_model = onnx.load_from_string(K.unit_models(units[0], shaped, K.with_shapes(flt))[0])
    assert int_model.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    table = K.kernel_table(OpenVinoBackend(), flt, qdq, skip=[u.node for u in units[1:]],
                           output_q=False, protocol=QUICK)
    assert not table.output_q and set(table.timings) == {units[0].node}
    t = table.timings[units[0].node]
    assert math.isfinite(t.int_ms) and math.isfinite(t.float_ms) and t.int_ms > 0


def test_the_kernel_move_switches_every_gaining_point_off_first():
    from qdq_optuna.samplers.qdq_mutation import Visit

    attr = {"standing": {"a": 1, "b": 1, "c": 1}, "gains": {"a": 0.2, "b": 0.1}}
    moves = Visit(attr, ["a", "b", "c"]).all_moves()
    assert moves[0].kind == "kernel" and moves[0].off == {"a", "b"} and not moves[0].on
    assert [m.off for m in moves[1:3]] == [{"a"}, {"b"}]  # then each by its gain
    assert moves[0].kind not in {m.kind for m in Visit({"standing": attr["standing"]},
                                                       ["a", "b", "c"]).all_moves()}


def test_the_report_counts_how_often_the_region_ranked_as_the_whole_model():
    import optuna

    from qdq_optuna.outputs.report import _statistics_lines, trial_statistics
    from qdq_optuna.record import Measurement, TrialAttr

    def trial(m: Measurement):
        return optuna.trial.create_trial(value=m.latency_ms,
                                         user_attrs={TrialAttr.MEASUREMENT: m.to_attrs()})

    sub = {"nodes": 3, "ratio": 0.9, "ci_low": 0.85, "ci_high": 0.95, "rounds": 4,
           "verdict": "faster"}
    trials = [
        trial(Measurement(9.0, kind="ab", ratio=0.9, ci=[0.8, 0.95], reference_ms=10.0,
                          extra={"subgraph": {**sub, "agrees": True}})),
        trial(Measurement(11.0, kind="ab", ratio=1.1, ci=[1.05, 1.2], reference_ms=10.0,
                          extra={"subgraph": {**sub, "agrees": False}})),
        trial(Measurement(13.0, kind="screened_out", screened_out=True, ratio=1.3,
                          reference_ms=10.0, extra={"subgraph": {**sub, "verdict": "slower"}})),
        trial(Measurement(10.0, kind="ab", ratio=1.0, ci=[0.9, 1.1], reference_ms=10.0)),
    ]
    st = trial_statistics(trials, 1.3)
    assert (st["subgraph_screened_out"], st["subgraph_compared"], st["subgraph_agreed"]) == \
        (1, 2, 1)
    assert "the region ranked 1 as the whole model did" in "\n".join(_statistics_lines(st))


def _timed_into_cache(pm, setting):
    """One standing model's integer kernels timed (real ONNX Runtime sessions, a short A/B,
    one unit) by the descent's reader of what ran, with ``--kernel-cache`` set to
    ``setting``; the table it timed."""
    backend = OnnxRuntimeBackend()
    ex = pm.exporter()
    model = ex.to_bytes(ex.plan(starts.all_on_start(pm).scheme_uses))
    what = backend.what_ran(model)
    keep = K.units(onnx.load_from_string(model))[0].node

    def timing(flt, qdq, skip=(), **kw):
        skip = set(skip) | {u.node for u in K.units(qdq) if u.node != keep}
        return K.kernel_table(backend, flt, qdq, skip=skip, protocol=QUICK, output_q=True, **kw)

    class _S:
        prepared, exporter, kernel_timing, kernel_cache = pm, ex, staticmethod(timing), setting
        config = Config()
        plans = type("P", (), {"measurer": type("M", (), {"deadline": None, "backend": backend}),
                               "deterministic": False})

    unfused = Unfused(_S(), {})
    unfused._time_kernels(ex, model, what)
    return unfused.kernels


def test_the_kernel_cache_moves_or_turns_off(resnet, tmp_path, monkeypatch):
    """``--kernel-cache PATH`` writes the timings there (and a second reader finds them),
    ``$QDQ_OPTUNA_KERNEL_CACHE`` is its default, ``off`` reads and writes no file; the
    user's cache folder is never touched."""
    pm = resnet[0]
    home = tmp_path / "xdg"
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))
    monkeypatch.delenv(K.KERNEL_CACHE_ENV, raising=False)
    moved = tmp_path / "moved" / "kernels.json"
    table = _timed_into_cache(pm, str(moved))
    assert table.timed == 1 and table.cached == 0
    assert len(json.loads(moved.read_text())["machines"]) == 1
    again = _timed_into_cache(pm, str(moved))  # read back: nothing timed again
    assert (again.timed, again.cached) == (0, 1)
    off = _timed_into_cache(pm, "off")
    assert (off.timed, off.cached) == (1, 0)  # not read from the moved file either
    monkeypatch.setenv(K.KERNEL_CACHE_ENV, str(tmp_path / "env.json"))
    assert _timed_into_cache(pm, None).timed == 1 and (tmp_path / "env.json").is_file()
    monkeypatch.setenv(K.KERNEL_CACHE_ENV, "off")
    assert _timed_into_cache(pm, None).timed == 1
    assert not home.exists()
    assert K.kernel_cache(None) is None and K.kernel_cache("OFF") is None
    monkeypatch.delenv(K.KERNEL_CACHE_ENV)
    assert K.kernel_cache(None).path == home / "qdq_optuna" / "kernels.json"


def test_the_limit_puts_each_timed_node_at_its_faster_kernel_and_the_rest_at_float(resnet):
    """The limit: the float model's latency less the timed nodes' float times plus their
    faster kernels; a placed model's gap counts only nodes whose kernels were told apart, on
    the pattern that holds them; report.md words it in the final A/B's terms."""
    from qdq_optuna.outputs.limit import limit_lines
    from qdq_optuna.search._limit import estimate, node_patterns
    from qdq_optuna.search._unfused import placed_and_modes

    pm, flt, qdq = resnet
    convs = [n.name for n in pm.graph.nodes if n.op_type == "Conv"]
    tie = K.KernelTiming("s", "Conv", 0.9, 0.92, 0.92 / 0.9, 0.97, 1.08, 6)
    timings = {convs[0]: _timing("float"), convs[1]: _timing("integer"), convs[2]: tie}
    table = K.KernelTable({"name": "onnxruntime", "threads": 1}, ["avx2"], timings)
    patterns = node_patterns(pm)
    assert set(convs) <= set(patterns)
    float_ms = 10.0
    timed_float = sum(t.float_ms for t in timings.values())
    best = sum(min(t.int_ms, t.float_ms) for t in timings.values())
    placed, _ = placed_and_modes(table, qdq.SerializeToString())
    assert set(convs[:3]) <= placed  # every point on: each timed Conv is set up integer
    lim = estimate(table, float_ms, placed, patterns)
    assert lim.limit_ms == pytest.approx(float_ms - timed_float + best)
    assert lim.placed_ms == pytest.approx(float_ms - timed_float
                                          + sum(t.int_ms for t in timings.values()))
    # integer-placed: the Conv whose float kernel is faster is the only gap (the tie is none)
    gap = timings[convs[0]].int_ms - timings[convs[0]].float_ms
    assert lim.by_op() == {"Conv": pytest.approx(gap)}
    assert lim.by_pattern() == {patterns[convs[0]]: pytest.approx(gap)}
    # all float: the Conv whose integer kernel is faster is the gap
    as_float = estimate(table, float_ms, set(), patterns)
    assert as_float.by_op() == {"Conv": pytest.approx(
        timings[convs[1]].float_ms - timings[convs[1]].int_ms)}
    r = {"limit": lim.to_dict(), "baseline_latency_ms": 20.0, "final_latency_ms": 12.0}
    text = "\n".join(limit_lines(r))
    limit_final = 20.0 - (float_ms - lim.limit_ms)  # the final A/B's baseline less the saving
    assert f"**{limit_final:.4g} ms**" in text and f"{12.0 / limit_final - 1:+.1%}" in text
    assert f"| pattern {patterns[convs[0]]} |" in text


def test_the_limit_counts_a_matmuls_mode_kernels_and_the_mode_it_runs_in():
    """A MatMul timed as float 1.0 ms, static integer 0.7 ms and dynamic 0.4 ms: its limit is
    the dynamic kernel; placed dynamic it has no gap, placed static its gap is 0.3 ms; a
    dynamic kernel whose interval overlaps the static one's is no gap (not told apart)."""
    from qdq_optuna.search._limit import estimate

    dyn = K.KernelTiming("s", "MatMul", 0.7, 1.0, 1.0 / 0.7, 1.3, 1.5, 6, dynamic_ms=0.4,
                         dynamic_ratio=2.5, dynamic_ci=(2.3, 2.7))
    table = K.KernelTable({"name": "onnxruntime", "threads": 1}, ["avx2"], {"mm": dyn})
    patterns = {"mm": "P000"}
    as_dynamic = estimate(table, 10.0, set(), patterns, {"mm": "dynamic"})
    assert as_dynamic.limit_ms == pytest.approx(10.0 - 1.0 + 0.4)
    assert as_dynamic.placed_ms == pytest.approx(as_dynamic.limit_ms) and not as_dynamic.by_op()
    as_static = estimate(table, 10.0, {"mm"}, patterns)
    assert as_static.by_op() == {"MatMul": pytest.approx(0.3)}
    assert as_static.nodes[0].placed == "integer"
    close = K.KernelTiming("s", "MatMul", 0.7, 1.0, 1.0 / 0.7, 1.3, 1.5, 6, dynamic_ms=0.68,
                           dynamic_ratio=1.47, dynamic_ci=(1.35, 1.6))
    tied = estimate(K.KernelTable({"name": "onnxruntime", "threads": 1}, ["avx2"],
                                  {"mm": close}), 10.0, {"mm"}, patterns)
    assert tied.limit_ms == pytest.approx(10.0 - 1.0 + 0.68) and not tied.by_op()


def test_the_gap_plans_the_visits_largest_first_and_skips_what_is_within_noise(resnet):
    """A pattern whose Conv runs its slower kernel by more than the noise is visited first;
    one whose timed Convs all run their faster kernel, with nothing unfused, is skipped with
    the reason; one with an untimed Conv, or something unfused, is still visited; and when
    the whole standing model is within noise of the limit, with nothing unfused, the lane
    ends."""
    from qdq_optuna.search._limit import estimate, heavy_nodes, node_patterns, plan_visits

    pm, _, _ = resnet
    patterns, heavy = node_patterns(pm), heavy_nodes(pm)
    ids = [pp.pattern.id for pp in pm.tunable]
    with_convs = [p for p in ids if heavy[p]]
    assert len(with_convs) >= 2
    slow, fast = with_convs[0], with_convs[1]
    timings = {n: _timing("float") for n in heavy[slow]}  # float faster, placed integer
    timings |= {n: _timing("integer") for n in heavy[fast]}  # integer faster, placed integer
    table = K.KernelTable({"name": "onnxruntime", "threads": 1}, ["avx2"], timings)
    placed = set(timings)
    lim = estimate(table, 20.0, placed, patterns)
    nothing_unfused = dict.fromkeys(ids, False)
    plan = plan_visits(ids, lim, nothing_unfused, heavy)
    assert plan.order[0] == slow and plan.gaps[slow] > plan.noise_ms
    assert fast in plan.skipped and "within noise" in plan.skipped[fast]
    untimed = [p for p in with_convs if p not in (slow, fast)]
    assert all(p in plan.order for p in untimed)  # the estimate cannot speak for them
    assert all(p in plan.order for p in ids if not heavy[p])
    assert plan.end is None
    # the noise floor follows the standing model's measured latency when given
    assert plan_visits(ids, lim, nothing_unfused, heavy, 4.0).noise_ms == pytest.approx(0.06)
    # the same pattern with a standalone Q/DQ the runtime left: visited
    assert fast in plan_visits(ids, lim, {**nothing_unfused, fast: True}, heavy).order
    # every timed kernel at its faster one and nothing unfused: the lane ends
    at_best = estimate(table, 20.0, set(heavy[fast]), patterns)
    done = plan_visits(ids, at_best, nothing_unfused, heavy)
    assert done.end and "within noise" in done.end and not done.order


def test_visits_that_realize_none_of_the_estimate_leave_the_rest_expected_within_noise():
    """The estimate is trusted before a lane's first visit (a gap above the noise is
    visited); each decided visit that measured none of its pattern's gap lowers the trust,
    until the other patterns' gaps, scaled by the share realized, fall within the noise; a
    visit that realized its gap keeps the next ones planned; a visit made for what the
    runtime left unfused counts one noise floor of estimate, in a score of its own."""
    from qdq_optuna.record import Visit
    from qdq_optuna.record.records import Decision
    from qdq_optuna.search._descent import MIN_PRICED_VISITS, Realization
    from qdq_optuna.search._limit import GapPlan

    noise = 0.05
    plan = GapPlan(("a", "b", "c", "d", "e", "f"), {}, {"a": 0.2, "b": 0.2, "c": 0.15, "e": 0.01},
                   noise)

    def visit(pid: str, gain: float) -> Visit:
        committed = {"p0": 1} if gain > 1 else {}
        return Visit(pid, 1, decision=Decision(committed, gain=gain), reference_ms=4.0,
                     gain=gain)

    lane = Realization()
    assert lane.skip_reason(plan, "a") is None  # no evidence yet: the estimate stands
    assert lane.skip_reason(plan, "d") is None  # unfused only: one noise floor, visited
    lane.add(plan, "a", visit("a", 1.0))  # measured nothing of its 0.2 ms
    assert lane.skip_reason(plan, "b") is None  # 0.2 * 0.1 / 0.3 = 0.067 > 0.05
    lane.add(plan, "b", visit("b", 1.0))
    why = lane.skip_reason(plan, "c")  # 0.15 * 0.1 / 0.5 = 0.03 < 0.05
    assert why is not None and "expected gain within noise" in why and "0.4 ms" in why
    # a visit for unfused sites keeps its own score, whose prior is the priced share (0.2):
    # after two priced failures, 0.05 * 0.2 < 0.05
    why = lane.skip_reason(plan, "d")
    assert why is not None and "realized their estimate (0.2)" in why and "0 visit(s)" in why
    # with no priced visit, the unfused kind is trusted: its first visit is made, and its
    # failure ends it (0.05 * 0.1 / 0.15 < 0.05)
    unpriced = Realization()
    assert unpriced.skip_reason(plan, "d") is None
    unpriced.add(plan, "d", visit("d", 1.0))
    why = unpriced.skip_reason(plan, "e")  # a gap within the noise is an unfused-only visit
    assert why is not None and "(1), and its 1 visit(s) made for it realized 0 ms" in why
    assert unpriced.to_dict() == {"estimated_ms": 0.05, "realized_ms": 0.0, "unfused_visits": 1,
                                  "unfused_realized_ms": 0.0}
    # priced visits that paid do not keep failed unfused-only ones going (the ViT: 3.7 of
    # 2.6 ms priced, then seven unfused-only visits for nothing)
    paid_priced = Realization()
    paid_priced.add(plan, "a", visit("a", 4.0 / 3.6))  # 0.4 ms realized of its 0.2
    assert paid_priced.skip_reason(plan, "d") is None  # trusted fully (1.67, at most 1)
    paid_priced.add(plan, "d", visit("d", 1.0))
    assert paid_priced.skip_reason(plan, "e") is not None  # 0.05 * 0.1 / 0.15 < 0.05
    assert paid_priced.skip_reason(plan, "c") is None  # the priced score stands apart
    # an unfused-only visit that paid keeps the next one
    mixed = Realization()
    mixed.add(plan, "d", visit("d", 4.0 / 3.9))  # 0.1 ms realized of its 0.05 ms floor
    assert mixed.skip_reason(plan, "e") is None and mixed.skip_reason(plan, "f") is None
    # the same lane where the first visit realized its gap: the next ones are visited
    paid = Realization()
    paid.add(plan, "a", visit("a", 4.0 / 3.8))  # 0.2 ms of 4.0 realized: all of its gap
    assert paid.realized == pytest.approx(0.2)
    assert paid.skip_reason(plan, "c") is None and paid.skip_reason(plan, "d") is None
    paid.add(plan, "b", visit("b", 1.0))  # then one that realized nothing: 0.6 of it kept
    assert paid.skip_reason(plan, "c") is None  # 0.15 * 0.6 = 0.09 > 0.05
    # one failed visit of a large gap is one A/B: the next priced pattern is still visited
    # (0.2 * 0.1 / 0.6 = 0.033 < 0.05 would skip it; ShuffleNet shipped float so), the
    # second failure ends the lane
    big = GapPlan(("a", "b", "c"), {}, {"a": 0.5, "b": 0.2, "c": 0.2}, noise)
    first = Realization()
    first.add(big, "a", visit("a", 1.0))
    assert MIN_PRICED_VISITS == 2 and first.skip_reason(big, "b") is None
    first.add(big, "b", visit("b", 1.0))
    assert first.skip_reason(big, "c") is not None


def test_a_mode_kernel_is_recorded_at_its_own_time_not_the_float_kernels():
    """A MatMul/Gemm's dynamic kernel is recorded at the time of the model written in that
    mode (the reference of its A/B against float), beside the ratio float/mode. It was the
    float model's time: the ViT's dynamic Gemms read 0.347 ms against 0.352 ms float (ratio
    4x), so the limit put its dynamic model at the float model's latency and the forward
    search saw no gain in a dynamic node. The cost model is deterministic, so the two
    models' own times are known."""
    from onnx import TensorProto, helper, numpy_helper

    from qdq_optuna.backends.costmodel import CostModelBackend
    from qdq_optuna.placement.dynamic import QuantMode

    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array(rng.standard_normal((768, 192)).astype(np.float32), "W")
    bias = numpy_helper.from_array(rng.standard_normal(768).astype(np.float32), "B")
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "W", "B"], ["y"], name="g", transB=1)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [197, 192])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [197, 768])], [weight, bias])
    flt = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    unit = K.Unit("g", "Gemm", "sig", (), (), (), 0)
    dynamic = K.mode_unit_model(unit, flt.SerializeToString(), QuantMode.DYNAMIC)
    backend = CostModelBackend()
    float_ms = backend.estimate(flt).total_ms
    dynamic_ms = backend.estimate(onnx.load_from_string(dynamic)).total_ms
    assert not math.isclose(float_ms, dynamic_ms)  # the two models differ in cost
    timing = K.KernelTiming("sig", "Gemm", float_ms, float_ms, 1.0, 1.0, 1.0, 1)
    timed = K.time_mode(Measurer(backend), timing, unit, flt.SerializeToString(),
                        QuantMode.DYNAMIC)
    assert timed.dynamic_ms == pytest.approx(dynamic_ms, rel=1e-4)
    assert timed.dynamic_ratio == pytest.approx(float_ms / dynamic_ms, rel=1e-4)


def test_a_float_standing_model_has_the_every_point_on_kernels_timed_once(resnet):
    """From a float standing model (no integer kernel to time) the reader of what ran times
    the kernels of the model with every offered point on, once per run, so the gap plan can
    speak for the patterns' convolutions (real ONNX Runtime sessions, one unit timed)."""
    pm = resnet[0]
    backend = OnnxRuntimeBackend()
    ex = pm.exporter()
    every = starts.all_on_start(pm).scheme_uses
    keep = K.units(onnx.load_from_string(ex.to_bytes(ex.plan(every))))[0].node
    calls = []

    def timing(flt, qdq, skip=(), **kw):
        calls.append(len(K.units(qdq)))
        skip = set(skip) | {u.node for u in K.units(qdq) if u.node != keep}
        return K.kernel_table(backend, flt, qdq, skip=skip, protocol=QUICK, output_q=True, **kw)

    class _S:
        prepared, exporter, kernel_timing, kernel_cache = pm, ex, staticmethod(timing), "off"
        config = Config()
        plans = type("P", (), {"measurer": type("M", (), {"deadline": None, "backend": backend}),
                               "deterministic": False})
        record = type("R", (), {"uses": staticmethod(lambda schemes, pinned=(): every)})

    unfused = Unfused(_S(), {})
    assert unfused.evidence
    unfused._read(ex, ex.plan(set()))  # the float model
    assert calls[0] == 0 and len(calls) == 2  # its own (no unit), then every point on
    assert keep in unfused.kernels.timings and pm.graph.nodes[
        next(i for i, n in enumerate(pm.graph.nodes) if n.name == keep)].op_type == "Conv"
    unfused._read(ex, ex.plan(set()))  # another standing model read later
    assert len(calls) == 3  # the float model's own timing again, every point on not again


def test_the_every_point_model_turns_on_static_points_only():
    """With the dynamic mode offered, every point on would run each MatMul dynamically (a
    node's mode point wins over its static ones) and leave no static unit to time; the model
    timed for evidence has every static point on and no node in a per-node mode."""
    from qdq_optuna.placement.dynamic import QuantMode
    from qdq_optuna.runtimes import profile_for
    from qdq_optuna.search._unfused import every_point_model, placed_and_modes

    pm = PreparedModel.prepare(zoo.small("transformer"), runtime=profile_for("onnxruntime")
                               .rules_for_modes((QuantMode.STATIC, QuantMode.DYNAMIC)))
    ex = pm.exporter()

    def uses(schemes, pinned=()):
        return {u for pp in pm.tunable
                for u in pp.uses([pid for pid, on in schemes[pp.pattern.id].items() if on])}

    class _S:
        prepared = pm
        record = type("R", (), {"uses": staticmethod(uses)})

    model, what = every_point_model(_S(), ex, OnnxRuntimeBackend(), set())
    assert placed_and_modes(K.KernelTable({}, [], {}), model)[1] == {}
    matmuls = [u for u in K.units(onnx.load_from_string(model)) if u.op == "MatMul"]
    assert len(matmuls) >= 6  # the constant-weight MatMuls are static units to time
    every_on = ex.plan(uses({pp.pattern.id: dict.fromkeys(pp.ids, 1) for pp in pm.tunable}))
    assert every_on.dynamic  # what the old "every point on" ran: those MatMuls dynamic


def _lrn_model() -> onnx.ModelProto:
    """x -> Conv -> Relu -> LRN -> Conv -> Relu -> y (LRN: no integer kernel in ONNX Runtime)."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = [numpy_helper.from_array((rng.standard_normal((8, c, 3, 3)) * 0.1).astype(np.float32),
                                 f"w{i}") for i, c in enumerate((3, 8))]
    nodes = [helper.make_node("Conv", ["x", "w0"], ["c0"], pads=[1] * 4),
             helper.make_node("Relu", ["c0"], ["r0"]),
             helper.make_node("LRN", ["r0"], ["l"], size=5),
             helper.make_node("Conv", ["l", "w1"], ["c1"], pads=[1] * 4),
             helper.make_node("Relu", ["c1"], ["y"])]
    graph = helper.make_graph(
        nodes, "lrn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 16, 16])], w)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def test_conversions_no_placement_can_avoid_send_no_visit():
    """The conversions at an op with no integer kernel (LRN) and at the model's input, next
    to Convs measured faster as integer, and the LRN running float, leave nothing a visit can
    close; where the Conv after the LRN was not measured faster, its conversion counts again
    (removing it may pay)."""
    from qdq_optuna.backends.what_ran import WhatRan

    pm = PreparedModel.prepare(_lrn_model())
    g = pm.graph
    by_op = {}
    for n in g.nodes:
        by_op.setdefault(n.op_type, []).append(n)
    conv0, conv1 = by_op["Conv"]
    lrn = by_op["LRN"][0]
    lrn_in, lrn_out, model_in = lrn.input[0], lrn.output[0], g.graph_inputs[0]
    what = WhatRan("test", standalone=frozenset({model_in, lrn_in, lrn_out}),
                   float_nodes=frozenset({lrn.name}))
    _, unfused = _unfused(pm)
    unfused.kernels = K.KernelTable({}, [], {conv0.name: _timing("integer"),
                                             conv1.name: _timing("integer")})
    tensors, nodes = unavoidable(pm, unfused.kernels, what)
    assert tensors == {model_in, lrn_in, lrn_out} and nodes == {lrn.name}
    assert not any(unfused.pattern_sites(what).values())
    tie = K.KernelTiming("s", "Conv", 1.0, 1.0, 1.0, 0.9, 1.1, 6)
    unfused.kernels = K.KernelTable({}, [], {conv0.name: _timing("integer"), conv1.name: tie})
    tensors, _ = unavoidable(pm, unfused.kernels, what)
    assert tensors == {model_in, lrn_in}
    holding = [pp.pattern.id for pp in pm.tunable if lrn_out in {u[0] for u in pp.uses(pp.ids)}]
    assert holding and all(unfused.pattern_sites(what)[p] for p in holding)


def _priced(q_per_k: float, dq_per_k: float) -> dict[str, K.KernelTiming]:
    """Conversion timings: a Q (DQ) costs ``q_per_k`` (``dq_per_k``) ms per 1,024 elements
    over a fixed 0.01 ms (the one-element model's)."""
    out = {}
    for op, per_k in (("QuantizeLinear", q_per_k), ("DequantizeLinear", dq_per_k)):
        for n in K.CONVERSION_SIZES:
            ms = 0.01 + per_k * n / 1024
            out[K.conversion_key(op, n)] = K.KernelTiming(
                json.dumps(["conversion", K.conversion_key(op, n)]), op, ms, 0.01,
                0.01 / ms, 0.01 / ms, 0.01 / ms, 4)
    return out


def test_the_limit_prices_the_conversions_its_kernels_need_next_to_float_ops():
    """x -> Conv -> Relu -> LRN -> Conv -> Relu -> y: with both Convs integer, a Q on x and
    on the LRN's output, a DQ on its input and on y; each priced by its elements on the
    line through the standalone Q and DQ timings. Where conversions cost more than an
    integer kernel gains, the limit keeps that Conv float (and says so); the limit is never
    above the placed model's estimate; the conversions the placed model has beyond the
    limit's are a gap of their own."""
    from qdq_optuna.outputs.limit import limit_lines
    from qdq_optuna.search._limit import CONVERSIONS, boundaries, estimate

    pm = PreparedModel.prepare(_lrn_model())
    conv0, conv1 = [n.name for n in pm.graph.nodes if n.op_type == "Conv"]
    bounds = boundaries(pm)
    assert {b.tensor for b in bounds} == {pm.graph.graph_inputs[0], "r0", "l", "y"}
    timings = {conv0: _timing("integer"), conv1: _timing("integer")}  # 1.0 -> 0.7 ms each
    cheap = K.KernelTable({}, [], timings, conversions=_priced(0.01, 0.02))
    assert cheap.conversion_ms("QuantizeLinear", 2048) == pytest.approx(0.02)
    assert cheap.conversion_ms("DequantizeLinear", 2048) == pytest.approx(0.04)
    lim = estimate(cheap, 10.0, {conv0, conv1}, {}, bounds=bounds)
    convs = 0.01 * 768 / 1024 + 0.04 + 0.02 + 0.04  # Q x, DQ r0, Q l, DQ y
    assert lim.conversions == 4 and lim.conversions_ms == pytest.approx(convs)
    assert lim.limit_ms == pytest.approx(10.0 - 2.0 + 1.4 + convs)
    assert lim.placed_ms == pytest.approx(lim.limit_ms) and not lim.by_op()
    # the same without conversion timings: as before, nothing priced
    bare = estimate(K.KernelTable({}, [], timings), 10.0, {conv0, conv1}, {}, bounds=bounds)
    assert bare.limit_ms == pytest.approx(9.4) and bare.conversions == 0

    # 0.2 ms per conversion of 2,048 elements: the second Conv's 0.3 ms gain buys two of them
    # (0.4 ms): the limit keeps it float, and the placed model with it integer has a gap
    dear = K.KernelTable({}, [], timings, conversions=_priced(0.1, 0.1))
    lim = estimate(dear, 10.0, {conv0, conv1}, {}, bounds=bounds)
    assert lim.kept_for_conversions == (conv1,)
    assert lim.limit_ms <= lim.placed_ms
    assert CONVERSIONS in lim.by_op() and lim.by_op()[CONVERSIONS] == pytest.approx(
        lim.placed_conversions_ms - lim.conversions_ms)
    as_limit = estimate(dear, 10.0, {conv0}, {}, bounds=bounds)  # the kept Conv float
    assert not as_limit.by_op() and as_limit.placed_ms == pytest.approx(as_limit.limit_ms)
    as_float = estimate(dear, 10.0, set(), {}, bounds=bounds)
    assert as_float.placed_conversions == 0 and as_float.limit_ms <= as_float.placed_ms
    r = {"limit": lim.to_dict(), "baseline_latency_ms": 10.0, "final_latency_ms": 9.9}
    text = "\n".join(limit_lines(r))
    assert f"{lim.conversions} standalone Q/DQ" in text and "kept off their faster" in text
    assert f"| op {CONVERSIONS} |" in text


def test_a_standalone_q_and_dq_are_timed_on_this_machine(tmp_path):
    """The conversions' timings are real ONNX Runtime sessions: a Q or DQ of a million
    elements costs more than one of four thousand, both above nothing; cached per machine
    and read back."""
    flt = zoo.build("resnet", "small")
    cache = K.KernelCache(tmp_path / "k.json")
    backend = OnnxRuntimeBackend()
    table = K.kernel_table(backend, flt, flt, cache=cache, protocol=QUICK, output_q=True)
    assert set(table.conversions) == {K.conversion_key(op, n) for op in K.CONVERSION_OPS
                                      for n in K.CONVERSION_SIZES}
    for op in K.CONVERSION_OPS:
        small, large = (table.conversion_ms(op, n) for n in K.CONVERSION_SIZES)
        assert large > small >= 0 and large > 0
    assert table.to_dict()["conversions"]
    again = K.kernel_table(backend, flt, flt, cache=K.KernelCache(tmp_path / "k.json"),
                           protocol=QUICK, output_q=True)
    assert again.conversions == table.conversions  # from the cache, not timed again


def test_openvino_times_the_kernels_of_a_run_given_input_shapes():
    """A run given ``--input-shapes`` measures with a backend that reshapes the model's
    inputs; a model cut out of it (a kernel unit) reads other tensors, and OpenVINO refused
    to reshape an input it lacks ("Input for tensor name ... is not found"). Real
    OpenVINO."""
    pytest.importorskip("openvino")
    from qdq_optuna.backends.openvino import OpenVinoBackend
    from qdq_optuna.runtimes import profile_for

    profile = profile_for("openvino")
    model = zoo.build("resnet", "small")
    given = model.graph.input[0]
    dims = [d.dim_value for d in given.type.tensor_type.shape.dim]
    pm = PreparedModel.prepare(model, runtime=profile)
    ex = pm.exporter()
    qdq = onnx.load_from_string(ex.to_bytes(ex.plan(starts.all_on_start(pm).scheme_uses)))
    flt = onnx.load_from_string(ex.to_bytes(ex.plan(set())))
    backend = OpenVinoBackend(input_shapes={given.name: dims})
    table = profile.kernel_timing(backend)(flt, qdq, protocol=QUICK)
    assert len(table.timings) >= 3 and len(table.conversions) == 4


def test_a_run_given_its_bound_reads_the_runtime_and_reports_the_limit(tmp_path):
    """A bound, data or metric given explicitly puts the run in the accuracy modes; with one
    objective its commits still need a latency gain, so it reads what the runtime ran, times
    the kernels and reports the limit like a run with the default bound (it read nothing and
    reported no limit: the real YOLOv8n with ``--max-output-error 0.2`` spent 140 s on two
    visits). Real ONNX Runtime sessions."""
    from qdq_optuna import tune

    model = tmp_path / "resnet.onnx"
    onnx.save(zoo.build("resnet", "small"), model)
    report = tune(model, tmp_path / "out", backend="onnxruntime", timing="fast",
                  kernel_cache="off", max_output_error=0.5, progress=False,
                  config=Config(schemes_per_region=2, refine_rounds=0)).report
    assert report["accuracy"]["bound"] == 0.5
    assert report["what_ran_reads"] >= 1 and report["kernel_table"]["kernels"]
    assert report["limit"]["limit_ms"] > 0
    assert len(report["kernel_table"]["conversions"]) == 4  # a Q and a DQ at two sizes
    assert report["limit"]["conversions"] >= 1  # at least the model's input and output
    assert report["limit"]["limit_ms"] <= report["limit"]["placed_ms"]
