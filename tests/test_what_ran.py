"""What the runtime ran: the readers (real ONNX Runtime, the cost model) and the descent's use
of them (a visit at a standalone Q/DQ is measured; the gain the descent finds stays)."""

from __future__ import annotations

from collections import Counter

import onnx
import pytest

from qdq_optuna import tune
from qdq_optuna.backends.costmodel import CostModelBackend, estimate
from qdq_optuna.backends.onnxruntime import OnnxRuntimeBackend
from qdq_optuna.backends.onnxruntime_kernels import optimized_graph
from qdq_optuna.backends.tensorrt import what_engine_ran
from qdq_optuna.backends.what_ran import WhatRan, quantized_tensors
from qdq_optuna.config import Config
from qdq_optuna.examples import zoo
from qdq_optuna.placement import starts
from qdq_optuna.runtimes.prepared import PreparedModel
from qdq_optuna.search._moves import Move, MoveSpace, MoveStats
from qdq_optuna.search._unfused import Unfused


def _all_on(name: str, runtime: str) -> tuple[PreparedModel, bytes]:
    pm = PreparedModel.prepare(zoo.build(name, "small"), runtime=runtime)
    exporter = pm.exporter()
    return pm, exporter.to_bytes(exporter.plan(starts.all_on_start(pm).scheme_uses))


def test_onnxruntime_report_matches_its_optimized_graph():
    pm, model = _all_on("transformer", "onnxruntime")
    what = OnnxRuntimeBackend().what_ran(model)
    quantized = set(quantized_tensors(onnx.load_from_string(model)).values())
    assert what.fused | what.standalone == quantized and not what.fused & what.standalone
    assert what.fused and what.standalone  # MatMuls fold, LayerNorm / Softmax inputs do not
    left = {n.input[0] for n in optimized_graph(model).graph.node
            if n.op_type == "QuantizeLinear"}
    assert left & quantized <= what.standalone


def test_costmodel_report_is_its_own_pricing():
    pm, model = _all_on("yolo", "tensorrt")
    what = CostModelBackend().what_ran(model)
    proto = onnx.load_from_string(model)
    priced = {n.name: e.kind for n, e in zip(proto.graph.node, estimate(proto).nodes,
                                             strict=True)}
    q_of = {n.input[0]: n.name for n in proto.graph.node if n.op_type == "QuantizeLinear"}
    for tensor in what.fused:
        assert priced[q_of[tensor]] == "qdq"
    assert any(priced[q_of[t]] == "reformat" for t in what.standalone if t in q_of)
    assert what.float_nodes  # the all-on YOLO has Q/DQ before float-only ops


def _points(pid: str, m: Move) -> Move:
    """An engine's move over (pattern, point) pairs (foreign points are ``P005:<point>``)."""
    def pt(name: str) -> tuple[str, str]:
        return tuple(name.split(":", 1)) if ":" in name else (pid, name)
    return Move(m.kind, frozenset(map(pt, m.on)), frozenset(map(pt, m.off)), m.signature)


def _single(on=(), off=()) -> Move:
    return Move("single", frozenset(on), frozenset(off), ())


def test_a_move_at_a_standalone_qdq_is_kept_and_a_fused_one_dropped():
    pm, model = _all_on("transformer", "tensorrt")
    what = CostModelBackend().what_ran(model)
    space = MoveSpace(pm)

    class _S:  # the parts of a Search that Unfused reads for sites()
        prepared = pm
        plans = None

    unfused = Unfused(_S(), space.uses_of)
    schemes = {pp.pattern.id: dict.fromkeys(pp.ids, 1) for pp in pm.tunable}
    kept_any = dropped_any = False
    sites = unfused.point_sites(what)
    for pp in pm.tunable:
        pid = pp.pattern.id
        every = space.visit(pid, schemes, MoveStats(0)).moves
        visit = space.visit(pid, schemes, MoveStats(0), sites=sites)
        assert len(every) == len(visit.moves) + sum(visit.dropped.values())
        for m in every:
            points = _points(pid, m)
            # the engine keeps a move that adds Q/DQ, or removes one where the report found a
            # standalone Q/DQ, a float island or a reformat (an exact backend: no size rule)
            found = unfused.site_tensors(points.off, what)
            assert (m in visit.moves) == bool(points.on or found)
            touches = {u[0] for pt in points.off for u in space.uses_of[pt]}
            if touches & what.standalone:
                assert m in visit.moves  # never skip a visit's move at a standalone Q/DQ
                kept_any = True
        dropped_any |= sum(visit.dropped.values()) > 0
    assert kept_any and dropped_any



@pytest.mark.parametrize("deterministic", [False, True])
def test_a_removal_too_small_to_measure_is_dropped_on_a_measured_backend(deterministic):
    from qdq_optuna.search._unfused import (
        HEAVY_OPS,
        MIN_RESOLVABLE_SHARE,
        TOO_SMALL,
        skip_reason,
    )

    pm = PreparedModel.prepare(zoo.build("yolo", "small"), runtime="onnxruntime")
    space = MoveSpace(pm)

    class _Plans:  # a measured (or exact) backend, never asked to read a report here
        measurer = type("M", (), {"backend": None})

    class _S:
        prepared = pm
        plans = _Plans()

    _S.plans.deterministic = deterministic
    unfused = Unfused(_S(), space.uses_of)
    single = {}  # tensor -> a point that quantizes only it
    for pt, uses in space.uses_of.items():
        tensors = {u[0] for u in uses}
        if len(tensors) == 1:
            single.setdefault(next(iter(tensors)), pt)
    by_size = sorted(single, key=lambda t: unfused.numel[t])
    small, big = by_size[0], by_size[-1]
    total = unfused.total
    assert unfused.numel[small] / total < MIN_RESOLVABLE_SHARE <= unfused.numel[big] / total
    schemes = {pp.pattern.id: dict.fromkeys(pp.ids, 1) for pp in pm.tunable}

    def kept(tensor, what, on=False):
        """Whether the engine's visit keeps the move that removes (or, ``on``, adds) only
        ``tensor``'s Q/DQ, and the reasons it dropped moves for."""
        pid, q = single[tensor]
        visit = space.visit(pid, schemes, MoveStats(0), sites=unfused.point_sites(what),
                            resolvable=unfused.resolvable())
        if on:
            schemes_off = {**schemes, pid: {**schemes[pid], q: 0}}
            visit = space.visit(pid, schemes_off, MoveStats(0), sites=unfused.point_sites(what),
                                resolvable=unfused.resolvable(), added=unfused.added(what))
            every = space.visit(pid, schemes_off, MoveStats(0)).moves
            alone = [m for m in every if m.on == frozenset({q}) and not m.off]
        else:
            every = space.visit(pid, schemes, MoveStats(0)).moves
            alone = [m for m in every if m.off == frozenset({q}) and not m.on]
        assert alone
        return alone[0] in visit.moves, visit.dropped

    what = WhatRan("test", standalone=frozenset({small, big}))
    assert kept(big, what)[0]  # enough work to show up: measured
    small_kept, dropped = kept(small, what)
    if deterministic:  # an exact backend resolves any gain: nothing dropped for its size
        assert small_kept and TOO_SMALL not in dropped
    else:
        assert not small_kept and dropped.get(TOO_SMALL)
        assert "too small to measure" in skip_reason(Counter(dropped))
    # a reformat there is always measured
    reformat = WhatRan("test", standalone=frozenset({small}), reformats=frozenset({small}))
    assert kept(small, reformat)[0]
    # an addition: dropped on a measured backend only when it can save work on under the
    # share, with no multiply-add op next to it that may change precision
    added = unfused.added(what)
    assert (added is None) == deterministic
    g = pm.graph
    outcomes = set()
    for tensor in by_size:
        pt = single[tensor]
        near = {n for t, n, _ in space.uses_of[pt]} | {g.producer[t][0] for t, _, _ in
                                                       space.uses_of[pt] if t in g.producer}
        heavy = any(g.nodes[n].op_type in HEAVY_OPS for n in near)
        small_add = not deterministic and not heavy and 0 <= added(pt) < \
            MIN_RESOLVABLE_SHARE * total
        assert kept(tensor, what, on=True)[0] == (not small_add), tensor
        if heavy and not deterministic:  # no report names the Conv integer: unbounded
            assert added(pt) == -1
        outcomes.add((heavy, small_add))
    # both kinds occur (measured backend): a small element-wise addition, one next to a Conv
    assert deterministic or {(False, True), (True, False)} <= outcomes


@pytest.mark.parametrize("skipped", [True, False])
def test_a_round_that_changes_nothing_ends_with_one_final_line(caplog, skipped):
    import logging

    from qdq_optuna._progress import Progress
    from qdq_optuna.search._descent import Descent
    from qdq_optuna.search._unfused import FINAL_LINE

    descent = object.__new__(Descent)  # the lane loop alone: visits are stubbed
    descent.s = type("S", (), {"progress": Progress(False)})()
    descent.rounds, descent.tunable, descent.skipped, descent.on_change = 3, ["a", "b"], [], None
    descent.unfused = None  # no kernel table: the round visits every pattern in order
    visits = []

    def visit(lane, order, rnd, pp, stats):
        visits.append((rnd, pp))
        if skipped and pp == "b":
            descent.skipped.append((lane, rnd, pp, "nothing left"))
        return False

    descent.visit, descent._stats = visit, lambda lane: None
    with caplog.at_level(logging.INFO, logger="qdq_optuna"):
        descent.lane("", 0)
    assert visits == [(1, "a"), (1, "b")]  # no second round
    lines = [r.getMessage() for r in caplog.records if r.getMessage() == FINAL_LINE]
    assert lines == ([FINAL_LINE] if skipped else [])

def test_a_round_with_a_change_is_followed_by_another_and_each_change_is_announced():
    """A visit that changed the standing model starts another round and calls ``on_change``
    with the lane at once (the anytime result), whatever the visits after it did."""
    from qdq_optuna._progress import Progress
    from qdq_optuna.search._descent import Descent

    descent = object.__new__(Descent)  # the lane loop alone: visits are stubbed
    descent.s = type("S", (), {"progress": Progress(False)})()
    descent.rounds, descent.tunable, descent.skipped = 3, ["a", "b"], []
    descent.unfused = None
    visits, changes = [], []
    descent.on_change = changes.append

    def visit(lane, order, rnd, pp, stats):
        visits.append((rnd, pp))
        return rnd == 1 and pp == "a"  # the first visit changes it, the last one does not

    descent.visit, descent._stats = visit, lambda lane: None
    descent.lane("main", 0)
    assert visits == [(1, "a"), (1, "b"), (2, "a"), (2, "b")]
    assert changes == ["main"]


def test_engine_inspector_json():
    pm, model = _all_on("resnet", "tensorrt")
    proto = onnx.load_from_string(model)
    qdq = [n for n in proto.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")
           and n.input[0] in quantized_tensors(proto)]
    conv = next(n for n in proto.graph.node if n.op_type == "Conv")
    lone_q, lone_dq = (n for n in qdq if n.input[0] == qdq[0].input[0] or
                       n.input[0] == qdq[0].output[0])
    info = {"Layers": [
        {"Name": f"{lone_q.name} + {lone_dq.name}", "LayerType": "Scale",
         "Inputs": [{"Name": lone_q.input[0], "Format/Datatype": "Row major linear FP32"}],
         "Outputs": [{"Name": lone_dq.output[0], "Format/Datatype": "Row major linear FP32"}]},
        {"Name": "Reformatting CopyNode for Input Tensor 0 to x", "LayerType": "Reformat",
         "Inputs": [{"Name": conv.input[0], "Format/Datatype": "Row major linear FP32"}],
         "Outputs": [{"Name": "x", "Format/Datatype": "Channel major FP16 format"}]}]}
    what = what_engine_ran(info, proto)
    assert isinstance(what, WhatRan)
    assert what.standalone == {lone_q.input[0]} and lone_q.input[0] not in what.fused
    assert what.reformats == {quantized_tensors(proto).get(conv.input[0], conv.input[0])}


@pytest.mark.parametrize("name", ["resnet", "transformer"])
def test_pruned_descent_keeps_the_gain(tmp_path, name):
    model = zoo.build(name, "small")
    runs = {prune: tune(model, tmp_path / str(prune), backend="costmodel", seed=0,
                        progress=False, config=Config(prune_by_runtime=prune))
            for prune in (False, True)}
    before, after = runs[False].report, runs[True].report
    assert after["final_latency_ms"] <= before["final_latency_ms"] * 1.01
    assert after["measurements"] <= before["measurements"]
    assert after["what_ran"]["patterns"]  # the report's what-ran section
    assert (tmp_path / "True" / "optimized.onnx").is_file()


def test_an_isolated_backend_reads_it_in_its_worker():
    from qdq_optuna.backends.isolated import IsolatedBackend

    _, model = _all_on("resnet", "tensorrt")
    isolated = IsolatedBackend(("qdq_optuna.backends.costmodel", "CostModelBackend", {}))
    try:
        assert isolated.what_ran(model) == CostModelBackend().what_ran(model)
    finally:
        isolated.close()


def test_report_md_lists_each_skipped_visit_with_its_own_reason():
    """A skip's reason carries its pattern's own figures (the realization score's expected
    gain), so report.md gives one row per skipped visit, the first 40, and says how many
    more report.json holds."""
    from qdq_optuna.outputs.report import _what_ran_lines

    skipped = [{"lane": "", "round": 1 + i // 20, "pattern": f"P{i % 20:03d}",
                "reason": f"expected gain within noise: this pattern's {i / 100:.3g} ms"}
               for i in range(45)]
    lines = _what_ran_lines({"descent_skipped": skipped})
    rows = [line for line in lines if line.startswith("| P")]
    assert len(rows) == 40
    assert rows[7] == "| P007 | 1 | expected gain within noise: this pattern's 0.07 ms |"
    assert any("5 more in report.json `descent_skipped`" in line for line in lines)


def test_the_time_table_counts_each_kind_of_skipped_visit_apart():
    """report.md's time table says how many visits the runtime's report, the gap and the
    lane's realization score each skipped (the score's reasons are told by their prefix)."""
    from qdq_optuna.outputs.time_spent import _descent
    from qdq_optuna.search._descent import NOT_EXPECTED
    from qdq_optuna.search._limit import WITHIN_NOISE

    scored = NOT_EXPECTED.format(realized=0.0, estimated=0.4, gap=0.2, expected=0.03,
                                 noise=0.05)
    r = {"descent": {"lanes": {"": {"visits": 3, "changed": 1, "gain": 1.1}}},
         "descent_skipped": [{"reason": scored}, {"reason": scored},
                             {"reason": WITHIN_NOISE.format(noise=0.05)},
                             {"reason": "all 3 move(s): 3 only remove Q/DQ the runtime fused"}]}
    assert _descent(r) == ("3 visits, 1 commit, gain 1.100x; 1 skipped by the runtime's "
                           "report; 1 skipped: gap within noise; 2 skipped: gap expected "
                           "within noise by what the lane's visits realized")
