"""The repair that returns quantizer groups to float by error per latency cost
(``qdq_optuna.measure.repair``), on a generated model with a heavy-tailed activation, scored in
real ONNX Runtime sessions against the FP32 model (the guard's own parts, see
``test_guard_run._guard``)."""

from __future__ import annotations

import math

import corpus
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from test_guard_run import _guard

from qdq_optuna.measure.bound import DEFAULT_MAX_OUTPUT_ERROR
from qdq_optuna.measure.repair import Repair, plan_groups, rank_repair
from qdq_optuna.placement.export import plan_uses

pytestmark = pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")


@pytest.fixture(scope="module")
def heavy():
    guard, plan, _ = _guard(corpus.heavy_tail(3.3, 100.0), DEFAULT_MAX_OUTPUT_ERROR)
    return guard, plan


def _repair(heavy, bound=DEFAULT_MAX_OUTPUT_ERROR, **kw) -> Repair:
    guard, plan = heavy
    return rank_repair(guard.exporter, plan, lambda p: guard.error(p)["error"], bound, **kw)


def _without(guard, plan, groups):
    gone = {u for g in groups for u in g.uses}
    return guard.exporter.plan({u: q for u, q in plan_uses(plan).items() if u not in gone})


def test_groups_partition_the_plan_by_reading_node(heavy):
    guard, plan = heavy
    groups = plan_groups(guard.exporter.graph, plan)
    uses = [u for g in groups for u in g.uses]
    assert len(uses) == len(set(uses)) and set(uses) == set(plan_uses(plan))
    by_name = {g.name: g for g in groups}
    assert by_name["conv2"].tensors == ["heavy"] and by_name["conv2"].nodes == ("conv2",)


def test_high_error_low_cost_goes_before_low_error_high_cost(heavy):
    """conv2 reads the heavy tail (error alone near the bound); conv1 reads the input (error
    alone near 0). Given conv2 cheap and conv1 dear, conv2 ranks first; given the opposite
    costs (conv2 a million times dearer than anything), a cheap group ranks before it."""
    cheap = _repair(heavy, node_costs={"conv2": 1.0, "heavy": 1.0, "conv1": 1e6})
    order = [g.name for g in cheap.groups]
    assert order.index("conv2") < order.index("conv1")
    errors = {g.name: g.error for g in cheap.groups}
    assert errors["conv2"] > 10 * errors["conv1"]
    dear = _repair(heavy, node_costs={"conv2": 1e12, "heavy": 1e12, "sigmoid": 1.0})
    order = [g.name for g in dear.groups]
    assert order.index("sigmoid") < order.index("conv2")
    assert all(g.cost >= 1e12 for g in dear.groups if "conv2" in g.lost)


def test_whole_groups_return_and_the_repair_stops_at_the_bound(heavy):
    guard, plan = heavy
    repair = _repair(heavy)
    assert repair.full_error > DEFAULT_MAX_OUTPUT_ERROR >= repair.error
    assert repair.within and repair.returned and repair.kept.activations
    kept = set(plan_uses(repair.kept))
    for g in repair.groups:  # a group is in the kept plan whole, or not at all
        inside = {u in kept for u in g.uses}
        assert inside == {not g.returned}, g.name
    # no more than needed: quantizing any returned group that costs speed again breaks it
    for g in repair.returned:
        if g.cost > 0:
            fewer = [x for x in repair.returned if x is not g]
            assert guard.error(_without(guard, plan, fewer))["error"] > repair.bound, g.name
    assert math.isclose(guard.error(repair.kept)["error"], repair.error)


def test_a_plan_within_the_bound_returns_nothing(heavy):
    repair = _repair(heavy, bound=10.0)
    assert repair.within and not repair.returned and repair.exclude_nodes() == ""
    assert repair.kept.key == heavy[1].key


def test_the_exclude_nodes_line_names_the_returned_nodes(heavy):
    repair = _repair(heavy)
    line = repair.exclude_nodes()
    assert line.startswith("--exclude-nodes ")
    assert line.split()[1:] == [n for g in repair.returned for n in g.nodes]
    table = repair.to_dict()["sensitivity"]
    assert {"group", "tensors", "error", "latency_cost", "returned_to_float"} <= set(table[0])


# -- a bound on the user's own metric -------------------------------------------------------------
METRIC = '''import numpy as np

LABELS = None


def mismatch(ref, cand):
    """Share of output cells whose detection (> 0.5) disagrees with fixed labels."""
    global LABELS
    out = cand["y"]
    if LABELS is None:
        LABELS = np.random.default_rng(7).random(out.shape) < 0.02
    return float(np.mean((out > 0.5) != LABELS))
'''


@pytest.fixture
def metric_module(tmp_path, monkeypatch):
    (tmp_path / "task_metric.py").write_text(METRIC)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "task_metric:mismatch"


@pytest.mark.parametrize("drop, kind", [(0.002, "absolute"), (0.01, "relative")])
def test_a_metric_drop_bound_is_kept_by_what_ships(tmp_path, metric_module, drop, kind):
    """Every pair on lights the output up (the heavy tail): far past a small drop of the
    task metric; the run ships a model whose metric, recomputed here, stays within the FP32
    model's value plus the drop, and says where the bound came from."""
    from test_guard_run import _backend, _calibration

    from qdq_optuna import Config, tune
    from qdq_optuna.measure.accuracy import AccuracyEvaluator

    model = corpus.heavy_tail(3.3, 100.0)
    # the Sigmoid's input a graph output too, so its range stays whole (no reader's cut,
    # calibration.reader_bounds): every point on then breaks the bound, as this test needs
    model.graph.output.append(helper.make_tensor_value_info(
        "c2", TensorProto.FLOAT, [1, 8, 16, 16]))
    result = tune(model, tmp_path / "run", backend=_backend(), runtime="onnxruntime",
                  calibration_data=_calibration(), calibration_method="minmax",
                  metric=metric_module, max_metric_drop=drop, metric_drop_type=kind,
                  config=Config(schemes_per_region=3), progress=False)
    acc = result.report["accuracy"]
    evaluator = AccuracyEvaluator(model.SerializeToString(), _calibration(),
                                  metric=metric_module)
    fp32 = evaluator.evaluate(model.SerializeToString())[0]
    allowed = drop * (abs(fp32) if kind == "relative" else 1.0)
    assert acc["bound_from"] == "--max-metric-drop"
    assert acc["bound"] == pytest.approx(fp32 + allowed)
    assert acc["metric_drop"]["fp32_metric"] == pytest.approx(fp32)
    shipped = evaluator.evaluate(str(result.optimized_model))[0]
    assert shipped <= fp32 + allowed
    starts = {s["name"]: s for s in result.report["starts"]}
    assert starts["all"]["error"] > acc["bound"] and not starts["all"]["feasible"]
    assert "plus the allowed drop" in (result.output_dir / "report.md").read_text()


def test_metric_drop_options_fail_in_one_line(tmp_path, metric_module):
    from qdq_optuna import TuneOptions
    from qdq_optuna.errors import OptionError
    from qdq_optuna.measure.accuracy import AccuracyEvaluator, metric_drop_bound

    model = corpus.heavy_tail(3.3, 100.0)
    with pytest.raises(OptionError, match="needs --metric"):
        TuneOptions(model=model, output_dir=str(tmp_path), max_metric_drop=0.1)
    with pytest.raises(OptionError, match="two bounds"):
        TuneOptions(model=model, output_dir=str(tmp_path), metric=metric_module,
                    max_metric_drop=0.1, max_output_error=0.2)
    (tmp_path / "zero_metric.py").write_text("def dist(ref, cand):\n    return 0.0\n")
    evaluator = AccuracyEvaluator(model.SerializeToString(), _calibration_data(),
                                  metric="zero_metric:dist")
    with pytest.raises(OptionError, match="use --metric-drop-type absolute"):
        metric_drop_bound(evaluator, 0.01, "relative")
    assert metric_drop_bound(evaluator, 0.01, "absolute")["bound"] == pytest.approx(0.01)


def _calibration_data():
    from test_guard_run import _calibration

    return _calibration()


def test_latency_costs_count_only_what_the_runtime_ran_integer(heavy):
    """With ONNX Runtime's report of what it ran, a group's cost counts only nodes that ran
    integer (the Sub, which has no integer kernel, is free to return); without it every
    quantized node counts."""
    from qdq_optuna.backends import make_backend
    from qdq_optuna.measure.repair import latency_costs

    guard, plan = heavy
    graph = guard.exporter.graph
    what = make_backend("onnxruntime", threads=1, isolate=False).what_ran(
        guard.exporter.to_bytes(plan))
    assert what is not None and what.fused
    blind, seen = plan_groups(graph, plan), plan_groups(graph, plan)
    latency_costs(graph, plan, blind)
    latency_costs(graph, plan, seen, what)
    assert "over" in what.float_nodes
    for b, s in zip(blind, seen, strict=True):
        assert set(s.lost) <= set(b.lost) and s.cost <= b.cost
        assert not set(s.lost) & what.float_nodes
    assert sum(s.cost for s in seen) < sum(b.cost for b in blind)


def test_errors_that_interact_rank_by_what_returning_a_group_drops(heavy):
    """Errors of quantizers do not add up. Here (by construction, on the real plan's groups)
    the dear ``conv2`` costs 0.15 alone, and 1.0 more while the cheap ``over`` is quantized
    too; ``over`` alone costs nothing. Ranked by the error with a group alone quantized,
    ``conv2`` goes first and fixes it at its high cost; ranked by what returning a group from
    the full plan drops, the cheap ``over`` goes back and the dear ``conv2`` stays integer."""
    guard, plan = heavy
    groups = {g.name: g for g in plan_groups(guard.exporter.graph, plan)}

    def quantized(p, name):
        return set(groups[name].uses) <= set(plan_uses(p))

    def error(p):
        dear, cheap = quantized(p, "conv2"), quantized(p, "over")
        return 0.15 * dear + 1.0 * (dear and cheap)

    repair = rank_repair(guard.exporter, plan, error, 0.2)
    by_name = {g.name: g for g in repair.groups}
    assert by_name["over"].cost < by_name["conv2"].cost
    assert [g.name for g in repair.returned] == ["over"]
    assert repair.error == pytest.approx(0.15) and repair.within
    assert "conv2" not in repair.exclude_nodes()


# -- latency costs that see the Q/DQ boundaries a return creates ---------------------------------
def _conv_chain(length: int = 5):
    """x -> conv1 -> ... -> convN -> y, every Conv 8 -> 8 channels 3x3 on 16x16: one integer
    chain under ONNX Runtime's rules when every point is on."""
    from onnx import TensorProto, helper

    rng = np.random.default_rng(0)
    nodes, inits, prev = [], [], "x"
    for i in range(1, length + 1):
        w = corpus._w(rng, 8, 8, 3, 3)
        inits.append(numpy_helper.from_array(w, f"w{i}"))
        out = "y" if i == length else f"t{i}"
        nodes.append(helper.make_node("Conv", [prev, f"w{i}"], [out], name=f"conv{i}",
                                      pads=[1, 1, 1, 1]))
        prev = out
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 8, 16, 16]) for n in "xy"]
    return corpus._model(nodes, [io[0]], [io[1]], inits)


@pytest.fixture(scope="module")
def chain():
    from qdq_optuna.backends import make_backend
    from qdq_optuna.runtimes.prepared import PreparedModel

    pm = PreparedModel.prepare(_conv_chain(), runtime="onnxruntime")
    exporter = pm.exporter({})
    uses = set()
    for pp in pm.tunable:
        uses |= pp.uses(pp.ids)
    plan = exporter.plan(uses)
    what = make_backend("onnxruntime", threads=1, isolate=False).what_ran(
        exporter.to_bytes(plan))
    return exporter, plan, what


def _chain_fusion(chain):
    from qdq_optuna.measure.repair import Fusion, node_weights

    exporter, plan, what = chain
    graph = exporter.graph
    return Fusion(graph, plan, node_weights(graph), exporter.rules, what), node_weights(graph)


def test_returning_a_tensor_mid_chain_costs_more_than_the_chain_end(chain):
    """Every Conv of the chain runs integer (ONNX Runtime's own report). Returning the
    middle Conv's input splits the chain: two Convs lose their integer kernel (a QLinearConv
    needs its Q out) and the float island gets a stand-alone DQ before it and a stand-alone
    Q after it, so it costs more than the kernels it takes off integer; returning the chain's
    end (the graph output's Q/DQ) costs the last Conv alone and removes the output's DQ."""
    exporter, plan, what = chain
    assert not what.float_nodes & {f"conv{i}" for i in range(1, 6)}
    fusion, weights = _chain_fusion(chain)
    groups = {g.name: g for g in plan_groups(exporter.graph, plan)}
    mid_cost, mid_lost = fusion.change(groups["conv3"].uses)
    end_cost, end_lost = fusion.change(groups["graph output y"].uses)
    assert set(mid_lost) == {"conv2", "conv3"} and set(end_lost) == {"conv5"}
    assert mid_cost > sum(weights[n] for n in mid_lost)  # the island's borders count
    assert mid_cost > end_cost > 0
    # multiply-adds alone (the old cost) could not tell these apart: equal Convs
    assert len({weights[f"conv{i}"] for i in range(1, 6)}) == 1


def test_a_float_islands_neighbour_costs_less_once_the_island_is_there(chain):
    """After the middle goes back to float, returning its neighbour grows the island instead
    of cutting a new one: it costs less than it did from the full plan (the greedy and the
    prefix order read costs against the plan as it is), and nothing changes until told."""
    exporter, plan, _ = chain
    fusion, _ = _chain_fusion(chain)
    groups = {g.name: g for g in plan_groups(exporter.graph, plan)}
    alone = fusion.change(groups["conv4"].uses)[0]
    assert fusion.change(groups["conv4"].uses)[0] == alone  # change() leaves the state
    before = fusion.total()
    fusion.returned(groups["conv3"].uses)
    assert fusion.total() > before  # slower than with the whole chain integer
    assert fusion.change(groups["conv4"].uses)[0] < alone
    fusion.restored(groups["conv3"].uses)
    assert fusion.total() == before


def test_the_repair_returns_a_chain_end_before_its_middle(chain):
    """Two groups whose return fixes the error equally well (by construction on the real
    plan's groups): the chain's end and its middle. The repair returns the end, whose cost
    counts no new boundary, and the middle stays integer."""
    exporter, plan, what = chain
    groups = {g.name: g for g in plan_groups(exporter.graph, plan)}

    def error(p):
        kept = set(plan_uses(p))
        mid, end = (set(groups[n].uses) <= kept for n in ("conv3", "graph output y"))
        return 0.5 if mid and end else 0.1

    repair = rank_repair(exporter, plan, error, 0.2, what=what)
    assert [g.name for g in repair.returned] == ["graph output y"]
    assert repair.speed["kept"] > 0  # still faster than float by the repair's own estimate


def test_where_the_ranked_repair_keeps_nothing_bisection_repairs_the_start(tmp_path,
                                                                           monkeypatch):
    """The fallback: a ranked repair given one error evaluation cannot rank anything and
    returns every group (nothing kept); the start is then repaired by bisection over tensors
    (its own budget), measured as ``all-in-bound`` within the bound, its note says so, and it
    has no sensitivity table (bisection names tensors, not groups)."""
    from test_guard_run import TAILED, _backend, _calibration

    from qdq_optuna import Config, tune
    from qdq_optuna.measure import repair

    monkeypatch.setattr(repair, "REPAIR_EVALUATIONS", 1)
    result = tune(corpus.heavy_tail(3.3, 100.0), tmp_path / "run", backend=_backend(),
                  runtime="onnxruntime", calibration_data=_calibration(),
                  calibration_method="minmax", config=Config(schemes_per_region=3),
                  progress=False)
    starts = {s["name"]: s for s in result.report["starts"]}
    repaired = starts["all-in-bound"]
    assert repaired["feasible"] and repaired["error"] <= DEFAULT_MAX_OUTPUT_ERROR
    assert 0 < repaired["qdq"] < starts["all"]["qdq"]
    note = " ".join(repaired["notes"])
    assert "bisection in" in note and "ranked repair kept nothing in" in note
    assert any(t in note for t in TAILED)
    assert not repaired.get("repair")


def test_one_data_set_is_split_and_the_claimed_error_is_on_the_held_out_part(tmp_path):
    """Calibration data of HOLD_OUT_MIN samples and no validation data: a quarter is held out
    of calibration and the guard's figures are measured on it alone, which the report says;
    the error it claims for what ships is the one recomputed here on exactly those samples
    (and, the held-out samples made ten times larger, not the one on the other samples)."""
    from test_guard_run import _backend, _independent_error

    from qdq_optuna import Config, tune
    from qdq_optuna.measure.accuracy import HOLD_OUT_MIN, hold_out

    model = corpus.heavy_tail(3.3, 100.0)
    x = np.random.default_rng(0).standard_normal((HOLD_OUT_MIN, 4, 16, 16)).astype(np.float32)
    (cal, cal_id), (held, held_id) = hold_out(({"x": x}, "probe"))
    assert len(held["x"]) == HOLD_OUT_MIN // 4 and len(cal["x"]) + len(held["x"]) == len(x)
    mask = np.isin(x, held["x"]).all(axis=(1, 2, 3))
    x[mask] *= 10.0  # the held-out samples far outside the calibrated range
    result = tune(model, tmp_path / "run", backend=_backend(), runtime="onnxruntime",
                  calibration_data={"x": x}, calibration_method="minmax",
                  config=Config(schemes_per_region=3), progress=False)
    acc = result.report["accuracy"]
    assert acc["data_kind"] == "held-out part of the calibration data"
    assert f"{HOLD_OUT_MIN // 4} of its {HOLD_OUT_MIN} samples" in acc["data"]
    on_held = _independent_error(model, result.optimized_model, {"x": x[mask]})
    on_rest = _independent_error(model, result.optimized_model, {"x": x[~mask]})
    assert acc["error"] == pytest.approx(on_held["worst_relative_l2"], rel=1e-4)
    assert on_held["worst_relative_l2"] != pytest.approx(on_rest["worst_relative_l2"], rel=1e-2)
    md = (result.output_dir / "report.md").read_text()
    assert "held-out part of the calibration data" in md


def test_small_calibration_data_is_not_split():
    from qdq_optuna.measure.accuracy import HOLD_OUT_MIN, hold_out

    data = ({"x": np.zeros((HOLD_OUT_MIN - 1, 2), np.float32)}, "small")
    assert hold_out(data) == (data, None) and hold_out(None) == (None, None)


def _branch():
    """x -> conv1 -> t1, read by conv2 -> y1 and by conv3 -> y2."""
    from onnx import TensorProto, helper

    rng = np.random.default_rng(1)
    inits = [numpy_helper.from_array(corpus._w(rng, 8, 8, 3, 3), f"w{i}") for i in (1, 2, 3)]
    nodes = [helper.make_node("Conv", [x, f"w{i}"], [y], name=f"conv{i}", pads=[1, 1, 1, 1])
             for i, x, y in ((1, "x", "t1"), (2, "t1", "y1"), (3, "t1", "y2"))]
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 8, 16, 16])
          for n in ("x", "y1", "y2")]
    return corpus._model(nodes, [io[0]], io[1:], inits)


def test_a_node_whose_output_one_reader_reads_float_runs_float():
    """ONNX Runtime fuses a Conv into its QLinearConv only when every consumer of its output
    is a QuantizeLinear. Returning conv3's group leaves conv1's output read float by conv3:
    ONNX Runtime's own report has conv1 float then, and so does the repair's cost model (it
    once counted any quantized reader as enough, and ranked such returns as nearly free)."""
    from qdq_optuna.backends import make_backend
    from qdq_optuna.measure.repair import Fusion, node_weights
    from qdq_optuna.runtimes.prepared import PreparedModel

    pm = PreparedModel.prepare(_branch(), runtime="onnxruntime")
    exporter = pm.exporter({})
    plan = exporter.plan(set().union(*(pp.uses(pp.ids) for pp in pm.tunable)))
    backend = make_backend("onnxruntime", threads=1, isolate=False)
    what = backend.what_ran(exporter.to_bytes(plan))
    assert "conv1" not in what.float_nodes
    groups = {g.name: g for g in plan_groups(exporter.graph, plan)}
    fusion = Fusion(exporter.graph, plan, node_weights(exporter.graph), exporter.rules, what)
    conv1 = next(i for i, n in enumerate(exporter.graph.nodes) if n.name == "conv1")
    assert fusion.integer(conv1)
    _, lost = fusion.change(groups["conv3"].uses)
    assert "conv1" in lost and "conv3" in lost
    gone = set(groups["conv3"].uses)
    partial = exporter.plan({u: q for u, q in plan_uses(plan).items() if u not in gone})
    assert "conv1" in backend.what_ran(exporter.to_bytes(partial)).float_nodes


def test_a_placement_whose_chains_are_cut_holds_less_estimated_speed():
    """``estimated_speed`` (the order in which starts past the bound are repaired): the
    branch model with every point on holds more integer speed than the same placement with
    conv3's inputs float, which takes conv1 off integer too (its output read float) and leaves
    stand-alone Q/DQ on a model this small that cost more than what stays integer."""
    from qdq_optuna.measure.repair import estimated_speed
    from qdq_optuna.runtimes.prepared import PreparedModel

    pm = PreparedModel.prepare(_branch(), runtime="onnxruntime")
    exporter = pm.exporter({})
    plan = exporter.plan(set().union(*(pp.uses(pp.ids) for pp in pm.tunable)))
    gone = set(next(g for g in plan_groups(exporter.graph, plan) if g.name == "conv3").uses)
    cut = exporter.plan({u: q for u, q in plan_uses(plan).items() if u not in gone})
    assert estimated_speed(exporter, plan) > 0 > estimated_speed(exporter, cut)
    assert estimated_speed(exporter, exporter.plan(set())) == 0


def test_one_repair_ranks_then_bisects_then_gives_float():
    """:func:`~qdq_optuna.measure.repair.repair`, the starts' and the shipped model's: the
    ranked repair first; bisection over tensors where ranking kept nothing (one evaluation
    ranks nothing); the model without Q/DQ where nothing quantized keeps the bound; bisection
    skipped once the run's time is up. What it returns never breaks the bound unless it is
    the model without Q/DQ."""
    from qdq_optuna.measure.repair import RepairMethod, repair

    guard, plan, _ = _guard(corpus.heavy_tail(3.3, 100.0), DEFAULT_MAX_OUTPUT_ERROR)
    err = lambda p: guard.error(p)["error"]  # noqa: E731
    bound = DEFAULT_MAX_OUTPUT_ERROR
    assert err(plan) > bound
    ranked = repair(guard.exporter, plan, err, bound)
    assert ranked.method is RepairMethod.RANKED and ranked.bisection is None
    assert ranked.plan.activations and err(ranked.plan) <= bound
    assert ranked.responsible == sorted({t for g in ranked.ranked.returned for t in g.tensors})
    cut = repair(guard.exporter, plan, err, bound, max_evaluations=1)
    assert cut.method is RepairMethod.BISECTION and cut.plan.activations
    assert err(cut.plan) <= bound and set(cut.responsible) <= {"heavy", "c2"}
    assert cut.evaluations == cut.ranked.evaluations + cut.bisection.evaluations
    late = repair(guard.exporter, plan, err, bound, max_evaluations=1, time_left=lambda: False,
                  rank_time_left=lambda: True)
    assert late.method is RepairMethod.NO_TIME and not late.plan.activations
    nothing = repair(guard.exporter, plan, err, -1.0)
    assert nothing.method is RepairMethod.FLOAT and not nothing.plan.activations


def _range_shift_model():
    """x -> MatMul -> Div by d -> MatMul: two MatMuls of constant weights; d (a second input)
    changes the second one's input range a thousandfold from one input to the next."""
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(rng.standard_normal((64, 64)).astype(np.float32) / 8, "w1")
    w2 = numpy_helper.from_array(rng.standard_normal((64, 32)).astype(np.float32) / 8, "w2")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
         helper.make_node("Div", ["h", "d"], ["hd"], name="div"),
         helper.make_node("MatMul", ["hd", "w2"], ["y"], name="mm2")],
        "range_shift",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 64]),
         helper.make_tensor_value_info("d", TensorProto.FLOAT, [1, 1, 1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 32])],
        [w1, w2])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _range_shift_data() -> dict:
    rng = np.random.default_rng(1)
    return {"x": rng.standard_normal((8, 8, 64)).astype(np.float32),
            "d": np.array([1.0, 0.001] * 4, np.float32).reshape(8, 1, 1)}


def _range_shift_repair(dynamic: bool):
    exporter, plan, error = _range_shift_parts(dynamic)
    return rank_repair(exporter, plan, error, 0.01), plan


def _range_shift_parts(dynamic: bool):
    """(exporter, the every-point static plan, its 1 - cosine in real ONNX Runtime)."""
    from qdq_optuna.measure.accuracy import ErrorScorer
    from qdq_optuna.model import calibration
    from qdq_optuna.placement.dynamic import QuantMode
    from qdq_optuna.runtimes import profile_for
    from qdq_optuna.runtimes.prepared import PreparedModel

    model = _range_shift_model()
    data = _range_shift_data()
    modes = (QuantMode.STATIC, QuantMode.DYNAMIC) if dynamic else (QuantMode.STATIC,)
    pm = PreparedModel.prepare(model, runtime=profile_for("onnxruntime").rules_for_modes(modes))
    stats = calibration.collect_statistics(pm.graph.full_model(), pm.candidate_tensors(), data)
    exporter = pm.exporter(calibration.activation_scales(stats, method="minmax",
                                                         quant_type=pm.quant_type))
    # 1 - cosine: a mean over samples, so the small-range inputs count as much as the large
    scorer = ErrorScorer(model.SerializeToString(), data, metric=None,
                         error_measure="1-cosine", optimize=True)
    static = {u for pp in pm.tunable for u in pp.uses(pp.ids) if u[2] >= 0}
    plan = exporter.plan({u for u in static if u[1] >= 0})
    assert not plan.dynamic
    error = lambda p: scorer.evaluator.evaluate(exporter.to_bytes(p))[0]  # noqa: E731
    return exporter, plan, error


def test_a_node_whose_input_range_shifts_is_switched_to_dynamic_not_float():
    """Static scales calibrated over inputs a thousandfold apart round the small ones away;
    a MatMul of a constant weight that ONNX Runtime can run dynamically (its activation range
    read per call) gets that mode from the repair instead of float, and the repaired plan is
    within the bound with both MatMuls still integer. Without the dynamic mode in the run the
    same repair can only return groups to float."""
    fixed, plan = _range_shift_repair(dynamic=True)
    assert fixed.full_error > 0.01 and fixed.within, (fixed.full_error, fixed.error)
    by_name = {g.name: g for g in fixed.groups}
    # mm2 reads the Div's output, whose range shifts with d: its static scale is where the
    # error is
    assert by_name["mm2"].switched is not None and not by_name["mm2"].returned, fixed.to_dict()
    assert [g.name for g in fixed.switched] == ["mm2"]
    assert len(fixed.kept.dynamic) == 1 and fixed.kept.dynamic[0][1] == 2
    rows = {r["group"]: r for r in fixed.to_dict()["sensitivity"]}
    assert rows["mm2"]["fixed_by"] == "dynamic"
    assert fixed.to_dict()["switched"] == 1

    static_only, _ = _range_shift_repair(dynamic=False)
    assert static_only.within and not static_only.switched and not static_only.kept.dynamic
    assert {g.name: g for g in static_only.groups}["mm2"].returned


def test_the_sensitivity_table_names_the_mode_that_fixes_a_node():
    """The report's sensitivity table (every run): for the most sensitive nodes that can run
    dynamically, the drop with the node switched to dynamic beside the drop as float, and the
    fix; mm2 (whose input range shifts) is fixed by dynamic."""
    from qdq_optuna.measure.repair import sensitivity
    from qdq_optuna.outputs.report import sensitivity_lines

    exporter, plan, error = _range_shift_parts(dynamic=True)
    table = sensitivity(exporter, plan, error)
    rows = {r["group"]: r for r in table["groups"]}
    assert rows["mm2"]["fix"] == "dynamic"
    assert rows["mm2"]["dynamic_error_drop"] >= 0.9 * rows["mm2"]["error_drop"] > 0.01
    text = "\n".join(sensitivity_lines(table, "1-cosine"))
    assert "drop as dynamic | fix |" in text and "| dynamic |" in text

    exporter, plan, error = _range_shift_parts(dynamic=False)
    assert all("fix" not in r for r in sensitivity(exporter, plan, error)["groups"])


def test_a_plan_of_dynamic_nodes_repaired_within_the_bound_is_kept():
    """A plan whose nodes all run dynamically has no Q/DQ at all; once its repair returns the
    node past the bound to float, what is left is still a quantized plan (it was taken for
    "nothing kept" and the run shipped float: a 4,755-node decoder's dynamic start, within the
    bound after one group of 864 went back to float)."""
    from qdq_optuna.measure.repair import RepairMethod, repair
    from qdq_optuna.placement.dynamic import QuantMode, mode_use

    exporter, _, _ = _range_shift_parts(dynamic=True)
    graph = exporter.graph
    both = exporter.plan({mode_use(graph, 0, QuantMode.DYNAMIC): "int8",
                          mode_use(graph, 2, QuantMode.DYNAMIC): "int8"})
    assert len(both.dynamic) == 2 and not both.activations and both.quantized

    def error(plan):  # mm2 (node 2) dynamic is what breaks the bound
        return 0.3 if any(n == 2 for _, n, _ in plan.dynamic) else 0.01

    fixed = repair(exporter, both, error, 0.1)
    assert fixed.method is RepairMethod.RANKED and fixed.kept_quantized
    assert [n for _, n, _ in fixed.plan.dynamic] == [0]
