"""The forward search (``qdq_optuna.search._forward``): where every quantized placement breaks
the accuracy bound, quantizer groups are added to float by gain per unit of error while the
whole plan keeps the bound. A chain of Convs (``corpus.conv_chain``) whose every point on
breaks a bound of 0.02 while a few of its Convs fit, scored in real ONNX Runtime sessions
against the FP32 model (the guard's own parts, ``test_guard_run._guard``)."""

from __future__ import annotations

import math

import _latency_fns as fns
import corpus
import onnx
import pytest
from test_guard_run import _calibration, _guard, _independent_error

from qdq_optuna.backends.callable import CallableBackend
from qdq_optuna.search._forward import (
    ForwardEnd,
    ForwardInputs,
    GainSource,
    forward_groups,
    forward_search,
)

pytestmark = pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")

BOUND = 0.02


@pytest.fixture(scope="module")
def chain():
    guard, plan, _ = _guard(corpus.conv_chain(), BOUND)
    return guard, plan


def _inputs(chain, bound=BOUND, noise_ms=0.0, latency=fns.rewards_groups, **kw) -> ForwardInputs:
    guard, plan = chain
    ex = guard.exporter

    def timed(p):
        return latency(onnx.load_from_string(ex.to_bytes(p)))

    return ForwardInputs(ex, plan, lambda p: guard.error(p)["error"], bound, 10.0, noise_ms,
                         timed=timed, max_timed=len(plan), **kw)


def test_a_group_is_one_convs_inputs_and_the_q_on_its_output(chain):
    """ONNX Runtime runs a Conv integer only with a Q after it: each Conv's group holds its
    input's Q/DQ and its output's (past the Relu it folds in), so alone it is one full
    DQ -> Conv -> Q group."""
    guard, plan = chain
    ex = guard.exporter
    groups = forward_groups(ex.graph, plan, ex.rules.output_quantized_ops)
    assert [g.name for g in groups] == [f"conv{i}" for i in range(6)]
    for g in groups:
        model = onnx.load_from_string(ex.to_bytes(ex.plan(g.uses)))
        assert fns.full_groups(model)[0] == 1, g.name


def test_groups_are_added_while_the_whole_plan_keeps_the_bound(chain):
    """Every point on breaks the bound; each Conv alone keeps it; the search adds them by gain
    per error and stops where the next one breaks the *whole* plan's bound (measured, not
    summed): the plan it returns is within the bound, and it with the next group is not."""
    guard, plan = chain
    error = lambda p: guard.error(p)["error"]  # noqa: E731
    assert error(plan) > BOUND
    found = forward_search(_inputs(chain))
    assert found.end is ForwardEnd.BOUND and found.plan is not None
    added = found.added
    assert 0 < len(added) < len(found.groups)
    assert found.error == pytest.approx(error(found.plan)) and found.error <= BOUND
    # the sum of the errors alone would have stopped sooner (or later): the plan was scored
    assert sum(g.error for g in added) != pytest.approx(found.error)
    nxt = next(g for g in found.groups if g.name == found.next_group)
    with_next = guard.exporter.plan({**{u: q for g in added for u, q in g.uses.items()},
                                     **nxt.uses})
    assert error(with_next) > BOUND
    # equal gains (0.5 ms per full group on this backend): the least error alone goes first
    assert all(g.gain_from is GainSource.WHOLE_MODEL and g.gain_ms == pytest.approx(0.5)
               for g in found.groups)
    assert max(g.error for g in added) <= min(g.error for g in found.groups if not g.added)
    # the estimate is the groups' own gains; the backend agrees on this chain
    timed = fns.rewards_groups(onnx.load_from_string(guard.exporter.to_bytes(found.plan)))
    assert found.estimated_speedup == pytest.approx(10.0 / timed)
    out = found.to_dict()
    assert out["added"] == len(added) and out["end"] == ForwardEnd.BOUND.value
    assert [g["group"] for g in out["groups"][:len(added)]] == [g.name for g in added]


def test_a_bound_no_group_keeps_ends_at_float(chain):
    found = forward_search(_inputs(chain, bound=0.005))
    assert found.plan is None and found.end is ForwardEnd.NONE_FITS and not found.added
    assert all(g.error > 0.005 for g in found.groups)


def test_gains_within_noise_are_no_gain(chain):
    """One whole-model timing cannot resolve a gain below the noise: none is a gain, no error
    is scored, float stays."""
    found = forward_search(_inputs(chain, noise_ms=0.6))
    assert found.plan is None and found.end is ForwardEnd.NO_GAIN
    assert found.evaluations == 0 and all(g.gain_ms == 0 for g in found.groups)


def test_the_error_budget_bounds_the_evaluations(chain):
    found = forward_search(_inputs(chain, bound=1.0, max_evaluations=3))
    assert found.evaluations <= 3
    assert found.plan is None or found.error <= 1.0
    assert sum(not math.isnan(g.error) for g in found.groups) < len(found.groups)


def _tune(tmp_path, latency):
    from qdq_optuna import Config, tune

    return tune(corpus.conv_chain(), tmp_path / "run",
                backend=CallableBackend(latency, deterministic=True), runtime="onnxruntime",
                calibration_data=_calibration(), calibration_method="minmax",
                max_output_error=BOUND, config=Config(schemes_per_region=3), progress=False)


def test_a_run_whose_starts_all_break_the_bound_ships_the_forward_model(tmp_path):
    """Every quantized start breaks the bound (and runs slower than float, so none is
    repaired); the forward search's model is measured as the start ``forward``, ships, and the
    run ends without a descent; report.json and report.md say why; optimized.onnx, measured
    here without the search's code, is within the bound."""
    result = _tune(tmp_path, fns.few_groups_pay)
    report = result.report
    starts = {s["name"]: s for s in report["starts"]}
    assert all(not s["feasible"] for s in starts.values() if s["qdq"] and s["name"] != "forward")
    fw = report["forward"]
    assert starts["forward"]["chosen"] and starts["forward"]["feasible"]
    assert fw["shipped"] == "forward" and fw["end"] == ForwardEnd.BOUND.value
    assert 0 < fw["added"] <= fns.FEW and fw["measured_speedup"] > 1.0
    assert fw["why"].endswith(f"{fw['measured_speedup']:.2f}x float: shipped; no descent")
    assert report["descent"]["lanes"]["main"]["visits"] == 0
    assert report["speedup"] == pytest.approx(10.0 / (10.0 - 0.5 * fw["added"]))
    independent = _independent_error(corpus.conv_chain(), result.optimized_model,
                                     _calibration())
    assert independent["worst_relative_l2"] <= BOUND
    md = (result.output_dir / "report.md").read_text()
    assert "## Forward search" in md and fw["why"][1:] in md


def test_a_run_where_no_group_pays_ships_float_and_says_why(tmp_path):
    result = _tune(tmp_path, fns.only_everything_quantized_is_fast)
    fw = result.report["forward"]
    assert fw["shipped"] == "float" and fw["start"] is None and fw["added"] == 0
    assert fw["why"] == ("nothing within the accuracy bound is faster than float beyond noise "
                         f"({ForwardEnd.NO_GAIN.value}): float ships; no descent")
    assert result.report["descent"]["lanes"]["main"]["visits"] == 0
    assert result.report["quantized_tensors"] == []


def test_kernel_table_gains_count_resolved_kernels_less_their_conversions(chain):
    """Where the kernel table has a node, its gain alone is its float kernel less its integer
    kernel (only where the interval told them apart) less the stand-alone Q and DQ it needs
    alone; a node the table lacks is timed in the whole model (a Conv: the table times it)."""
    from qdq_optuna.measure.kernels import KernelTable, KernelTiming
    from qdq_optuna.measure.repair import BOUNDARY_MACS

    def timing(int_ms, float_ms, lo, hi):
        return KernelTiming("sig", "Conv", int_ms, float_ms, float_ms / int_ms, lo, hi, 4)

    table = KernelTable({"name": "test"}, [], {
        "conv0": timing(0.1, 0.3, 2.5, 3.5), "conv1": timing(0.1, 0.3, 2.5, 3.5),
        "conv2": timing(0.2, 0.21, 0.9, 1.2)})  # conv2: a tie
    found = forward_search(_inputs(chain, bound=1.0, kernels=table))
    by = {g.name: g for g in found.groups}
    assert by["conv2"].gain_ms == 0 and by["conv2"].gain_from is GainSource.KERNEL_TABLE
    # conv0 and conv1: 0.2 ms saved over 8x(4 or 8)x9x256 multiply-adds; the median saving
    # per multiply-add prices an element of a stand-alone Q/DQ
    macs = {"conv0": 8 * 4 * 9 * 256, "conv1": 8 * 8 * 9 * 256}
    per_element = BOUNDARY_MACS * sorted(0.2 / m for m in macs.values())[1]
    assert by["conv0"].gain_ms == pytest.approx(0.2 - per_element * (4 * 256 + 8 * 256))
    assert by["conv1"].gain_ms == pytest.approx(0.2 - per_element * (8 * 256 + 8 * 256))
    assert {g.name for g in found.groups if g.gain_from is GainSource.WHOLE_MODEL} == {
        "conv3", "conv4", "conv5"}


def test_a_node_whose_static_scale_breaks_the_bound_is_added_dynamically():
    """Where the run offers a MatMul the dynamic mode, its dynamic use is a group beside its
    static one, its gain read from the kernel table's dynamic kernel. The second MatMul of
    ``test_repair``'s range-shift model (its input range changes a thousandfold from input to
    input; 1 - cosine in real ONNX Runtime) breaks the bound with a static scale alone and
    keeps it dynamically: the forward search adds it dynamically (and the first one once, in
    one mode); without the dynamic mode offered it stays float."""
    from test_repair import _range_shift_parts

    from qdq_optuna.measure.kernels import KernelTable, KernelTiming

    def timing(op):
        return KernelTiming("sig", op, 0.1, 0.4, 4.0, 3.5, 4.5, 4, dynamic_ms=0.2,
                            dynamic_ratio=2.0, dynamic_ci=(1.8, 2.2))

    table = KernelTable({"name": "test"}, [], {"mm1": timing("MatMul"), "mm2": timing("MatMul")})
    bound = 0.01
    exporter, plan, error = _range_shift_parts(dynamic=True)
    found = forward_search(ForwardInputs(exporter, plan, error, bound, 1.0, 0.0, table))
    by = {g.name: g for g in found.groups}
    assert {"mm2", "mm2 (dynamic)", "mm1", "mm1 (dynamic)"} <= by.keys()
    assert by["mm2 (dynamic)"].gain_ms == pytest.approx(0.2)
    assert by["mm2 (dynamic)"].gain_from is GainSource.KERNEL_TABLE
    assert by["mm2"].error > bound >= by["mm2 (dynamic)"].error
    assert by["mm2 (dynamic)"].added and not by["mm2"].added
    assert 2 in [n for _, n, _ in found.plan.dynamic]  # mm2 runs dynamically
    assert sum(g.added for g in found.groups if g.label == "mm1") == 1  # one mode per node
    assert found.error <= bound and error(found.plan) == pytest.approx(found.error)
    assert found.to_dict()["groups"][0]["mode"] in ("static", "dynamic")

    exporter, plan, error = _range_shift_parts(dynamic=False)
    static_only = forward_search(ForwardInputs(exporter, plan, error, bound, 1.0, 0.0, table))
    assert all(g.mode.value == "static" for g in static_only.groups)
    assert not (static_only.plan and static_only.plan.dynamic)
    assert not any(g.added for g in static_only.groups if g.label == "mm2")
