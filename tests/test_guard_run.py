"""The accuracy guard in every run: the final model's errors are always measured and reported,
and a model past the bound is never written as ``optimized.onnx``.

A deterministic callable backend (``_latency_fns.every_qdq_faster``: every activation Q/DQ pair
saves time) makes every pair worth committing, accurate or not. On ``corpus.heavy_tail`` (dense
outliers) with min/max scales, every pair on breaks the bound: the search's guard keeps such a
placement from ever standing (starts, commits), so the run ships the fastest placement within
it. The final check under it (bisect, fall back) is tested on a plan directly, and end to end
where nothing with Q/DQ can keep the bound (a bound the FP16 model alone breaks).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import _latency_fns as fns
import corpus
import numpy as np
import onnx
import pytest
from test_resume import REPO, cli_env

from qdq_optuna import Config, tune
from qdq_optuna.backends.callable import CallableBackend
from qdq_optuna.examples import zoo
from qdq_optuna.measure.accuracy import output_errors, run_model, summarize
from qdq_optuna.measure.bound import DEFAULT_MAX_OUTPUT_ERROR, AccuracyBound, AskedBound
from qdq_optuna.placement.export import quantized_tensors
from qdq_optuna.search._guard import FALLBACK, WITHIN_BOUND

pytestmark = pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")

#: the tensors whose values carry the tail (``heavy`` and the Conv output it runs into)
TAILED = {"heavy", "c2"}


def _backend():
    return CallableBackend(fns.every_qdq_faster, deterministic=True)


def _calibration() -> dict:
    return {"x": np.random.default_rng(0).standard_normal((8, 4, 16, 16)).astype(np.float32)}


def _independent_error(model: onnx.ModelProto, optimized, data: dict) -> dict:
    """Worst-output errors of ``optimized`` vs the FP32 model, without the search's code."""
    ref = run_model(model.SerializeToString(), data)
    got = run_model(str(optimized), data)
    return summarize(output_errors(ref, got))


@pytest.fixture(scope="module")
def heavy_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("guard") / "heavy"
    model = corpus.heavy_tail(3.3, 100.0)
    logger = logging.getLogger("qdq_optuna")
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep(logging.WARNING)
    logger.addHandler(handler)
    try:
        result = tune(model, out, backend=_backend(), runtime="onnxruntime",
                      calibration_data=_calibration(), calibration_method="minmax",
                      config=Config(schemes_per_region=6), progress=False)
    finally:
        logger.removeHandler(handler)
    return model, result, [r.getMessage() for r in records]


def test_the_search_never_stands_on_a_model_past_the_bound(heavy_run):
    model, result, messages = heavy_run
    report = result.report
    # a repaired start within the bound runs faster than float: no forward search
    assert report["forward"] is None
    acc = report["accuracy"]
    assert acc["bound"] == DEFAULT_MAX_OUTPUT_ERROR and acc["bound_from"] == "default"
    assert acc["measure"] == "relative_l2"
    assert acc["data_kind"] == "calibration data" and acc["data"].startswith("--calibration-data")
    # every pair on is faster on this backend but breaks the bound: those starts were refused
    starts = {s["name"]: s for s in report["starts"]}
    assert not starts["all"]["feasible"] and starts["all"]["error"] > DEFAULT_MAX_OUTPUT_ERROR
    assert all(s["feasible"] == (s["error"] <= DEFAULT_MAX_OUTPUT_ERROR) for s in starts.values())
    # what the search ended with is within the bound: the final check had nothing to do
    assert acc["status"] == WITHIN_BOUND and acc["shipped"] == "tuned model"
    assert acc["error"] == acc["tuned_error"] <= DEFAULT_MAX_OUTPUT_ERROR
    assert acc["responsible_tensors"] == [] and acc["bisection_evaluations"] == 0
    assert report["final_output_error"] == acc["error"]
    assert set(report["final_output_errors"]) == {"y"}
    assert set(report["final_output_errors"]["y"]) == {"cosine", "relative_l2", "max_abs"}
    shipped = quantized_tensors(onnx.load(str(result.optimized_model)))
    assert shipped == set(report["quantized_tensors"]) == set(acc["tuned_tensors"])
    # the search still quantized what it could: more than nothing, less than everything
    assert shipped and not TAILED <= shipped
    # measured independently: optimized.onnx is within the bound
    independent = _independent_error(model, result.optimized_model, _calibration())
    assert independent["worst_relative_l2"] == pytest.approx(acc["error"], rel=1e-4, abs=1e-6)
    assert independent["worst_relative_l2"] <= DEFAULT_MAX_OUTPUT_ERROR
    assert not [m for m in messages if m.startswith("accuracy guard:")], messages
    # the final A/B measured what ships: every pair costs its 0.1 ms less on this backend
    assert report["final_latency_ms"] == pytest.approx(10.0 - 0.1 * len(shipped))


def test_the_guard_lets_nothing_past_the_bound_without_falling_back(heavy_run, tmp_path):
    """A run whose bound is large enough for the tuned placement ships it as tuned."""
    model, broken, _ = heavy_run
    loose = broken.report["accuracy"]["tuned_error"] * 1.01
    result = tune(model, tmp_path / "loose", backend=_backend(), runtime="onnxruntime",
                  calibration_data=_calibration(), calibration_method="minmax",
                  max_output_error=loose, config=Config(schemes_per_region=6), progress=False)
    acc = result.report["accuracy"]
    assert acc["status"] == WITHIN_BOUND and acc["bound_from"] == "--max-output-error"
    assert acc["responsible_tensors"] == [] and acc["bisection_evaluations"] == 0
    assert acc["error"] == acc["tuned_error"] <= loose


def test_a_healthy_model_reports_its_errors_on_random_inputs(tmp_path, caplog):
    model = zoo.build("tiny_residual")
    with caplog.at_level(logging.WARNING, logger="qdq_optuna"):
        result = tune(model, tmp_path / "ok", backend=_backend(), runtime="onnxruntime",
                      config=Config(schemes_per_region=4), progress=False)
    report = result.report
    acc = report["accuracy"]
    assert acc["status"] == WITHIN_BOUND and acc["shipped"] == "tuned model"
    assert acc["responsible_tensors"] == []
    assert report["quantized_tensors"], "nothing quantized: the errors would prove nothing"
    assert 0 < acc["error"] <= DEFAULT_MAX_OUTPUT_ERROR
    assert acc["data_kind"] == "random inputs" and acc["data"].startswith("random:")
    outputs = {o.name for o in model.graph.output}
    assert set(report["final_output_errors"]) == outputs
    for errors in report["final_output_errors"].values():
        assert 0.9 < errors["cosine"] <= 1.0 and errors["max_abs"] > 0
    assert "accuracy guard:" not in caplog.text
    md = (result.output_dir / "report.md").read_text()
    assert "## Accuracy" in md and "**within bound**" in md
    assert "random inputs (8 samples, seed 1; a sanity check only)" in md
    # within the bound, the sensitivity table is there too: the shipped model's error, split
    sens = acc["sensitivity"]
    assert sens["error"] == pytest.approx(acc["error"]) and sens["groups"]
    assert {t for g in sens["groups"] for t in g["tensors"]} == set(report["quantized_tensors"])
    assert "## Sensitivity" in md and f"| {sens['groups'][0]['group']} |" in md
    for name in outputs:
        assert f"| `{name}` |" in md
    # accuracy modes add their keys; the guard's are there without them
    assert "objectives" not in report and "max_output_error" not in report


def test_a_bound_the_fp16_model_breaks_ships_it_says_so_and_exits_0(tmp_path):
    """No placement keeps a bound the FP16 conversion alone breaks: the model without Q/DQ
    ships, one warning line and report.md say so, the exit status is 0."""
    model = tmp_path / "heavy.onnx"
    onnx.save(corpus.heavy_tail(3.3, 100.0), str(model))
    cal = tmp_path / "cal.npz"
    np.savez(cal, **_calibration())
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "qdq_optuna", "tune", "-m", str(model), "-o", str(out),
         "-b", "costmodel", "--calibration-data", str(cal), "--max-output-error", "1e-7",
         "-n", "4", "-q"],
        cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "accuracy guard:" in line]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("qdq-optuna: WARNING: accuracy guard: even the fp16 model")
    report = json.loads((out / "report.json").read_text())
    acc = report["accuracy"]
    assert acc["status"] == "float model past bound" and acc["shipped"] == "model without Q/DQ"
    assert acc["error"] > 1e-7 and "cal.npz" in acc["data"]
    assert report["quantized_tensors"] == [] and report["high_precision"]["precision"] == "fp16"
    assert not any(s["feasible"] for s in report["starts"])
    assert not quantized_tensors(onnx.load(str(out / "optimized.onnx")))
    assert "Even the model without Q/DQ is past the bound" in (out / "report.md").read_text()


def _guard(model: onnx.ModelProto, bound: float):
    """A Guard of real parts: the minmax-calibrated exporter, ONNX Runtime scoring against the
    FP32 model on the calibration data, the error memo in an Optuna study."""
    import optuna

    from qdq_optuna.measure.accuracy import ErrorScorer
    from qdq_optuna.measure.timing import Measurer
    from qdq_optuna.model import calibration
    from qdq_optuna.record import PlanMemo, RunAttr
    from qdq_optuna.runtimes.prepared import PreparedModel
    from qdq_optuna.search._guard import Guard
    from qdq_optuna.search._plans import PlanMeasurer

    pm = PreparedModel.prepare(model, runtime="onnxruntime")
    stats = calibration.collect_statistics(pm.graph.full_model(), pm.candidate_tensors(),
                                           _calibration())
    exporter = pm.exporter(calibration.activation_scales(stats, method="minmax",
                                                         quant_type=pm.quant_type))
    scorer = ErrorScorer(model.SerializeToString(), _calibration(), metric=None,
                         error_measure="relative_l2", optimize=True)
    study = optuna.create_study()
    plans = PlanMeasurer(Measurer(_backend()), PlanMemo(study, RunAttr.MEASURED), scorer,
                         PlanMemo(study, RunAttr.ERROR))
    everything = set()
    for pp in pm.tunable:
        everything |= pp.uses(pp.ids)
    return Guard(plans, exporter, _bound(bound)), exporter.plan(everything), scorer


def _bound(value: float) -> AccuracyBound:
    return AccuracyBound.resolve(AskedBound(value, "relative_l2"), "--calibration-data test")


def test_the_final_check_alone_repairs_and_keeps_the_rest():
    """:meth:`Guard.final` on a plan, whatever placed it (a search whose commits check the
    bound too never gets here with a broken plan; this is the net under it): the starts' one
    repair, whose ranked groups take out what reads the tailed tensors and keep the rest."""
    from qdq_optuna.measure.repair import RepairMethod

    guard, plan, scorer = _guard(corpus.heavy_tail(3.3, 100.0), DEFAULT_MAX_OUTPUT_ERROR)
    verdict = guard.final(plan)
    assert verdict.status == FALLBACK and verdict.repair is RepairMethod.RANKED
    assert verdict.tuned_errors["error"] > DEFAULT_MAX_OUTPUT_ERROR >= verdict.errors["error"]
    assert verdict.responsible and set(verdict.responsible) & TAILED
    assert verdict.plan.tensors and set(verdict.plan.tensors) < set(plan.tensors)
    # what the runtime ran (the repair's costs) is read only when the guard steps in
    read = []
    guard.final(verdict.plan, what_ran=lambda p: read.append(p.key))
    assert read == []
    guard.final(plan, what_ran=lambda p: read.append(p.key))
    assert read == [plan.key]
    # errors are scored once per plan: asking again costs nothing
    before = scorer.evaluations
    assert guard.final(plan).plan.key == verdict.plan.key and scorer.evaluations == before
    # a bound not even the model without Q/DQ keeps: it ships, and says so
    guard.bound = _bound(-1.0)
    worst = guard.final(plan)
    assert worst.status == "float model past bound" and worst.plan.tensors == []
    assert worst.shipped == "model without Q/DQ"


def test_a_fast_start_past_the_bound_comes_back_without_what_broke_it(heavy_run):
    """Every pair on breaks the bound; the quantizer groups that cost the most error per unit
    of speed go back to float, whole, and the same start without them is measured as a start
    of its own, within the bound and faster than float (every pair saves time here), so the
    search stands on it. The report shows the sensitivity table and the --exclude-nodes line
    for the groups returned."""
    model, result, _ = heavy_run
    starts = {s["name"]: s for s in result.report["starts"]}
    repaired = starts["all-in-bound"]
    assert repaired["feasible"] and repaired["error"] <= DEFAULT_MAX_OUTPUT_ERROR
    assert 0 < repaired["qdq"] < starts["all"]["qdq"]
    assert repaired["latency_ms"] < starts["float"]["latency_ms"]
    table = repaired["repair"]["sensitivity"]
    returned = [g for g in table if g["returned_to_float"]]
    assert returned and all(set(g["tensors"]) & TAILED for g in returned), table
    line = repaired["repair"]["exclude_nodes"]
    assert line.split()[1:] == [n for g in returned for n in g["nodes"]]
    names = {n.name for n in model.graph.node}
    assert set(line.split()[1:]) <= names
    md = (result.output_dir / "report.md").read_text()
    assert "## Repair: all-in-bound" in md and line in md
    # the table gives each group's share of the error; the start ran faster than float
    assert "| share of the error |" in md and "x float's speed (measured)." in md
    chosen = next(s for s in starts.values() if s["chosen"])
    assert chosen["feasible"] and chosen["latency_ms"] <= repaired["latency_ms"]


def test_the_sensitivity_table_names_the_tensors_that_cost_the_error():
    """The shipped plan's sensitivity (report.md's table on every run): on the heavy-tailed
    model, the groups reading the tailed tensors come first, and a group's drop is the error
    the plan loses without it, as an ONNX Runtime session scores the plan without it."""
    from qdq_optuna.measure.repair import SENSITIVITY_EVALUATIONS
    from qdq_optuna.placement.export import plan_uses

    guard, plan, scorer = _guard(corpus.heavy_tail(3.3, 100.0), DEFAULT_MAX_OUTPUT_ERROR)
    sens = guard.sensitivity(plan, lambda: True)
    groups = sens["groups"]
    assert sens["error"] == guard.error(plan)["error"] > 0
    assert sens["evaluations"] <= SENSITIVITY_EVALUATIONS and len(groups) == sens["groups_total"]
    drops = [g["error_drop"] for g in groups]
    assert drops == sorted(drops, reverse=True)
    assert set(groups[0]["tensors"]) & TAILED
    top = groups[0]
    assert top["shared_by"] == 1 and top["nodes"] and top["nodes"][0] in sens["exclude_nodes"]
    node = next(i for i, n in enumerate(guard.exporter.graph.nodes)
                if n.name == top["nodes"][0])
    without = guard.exporter.plan({u: q for u, q in plan_uses(plan).items() if u[1] != node})
    alone = scorer.score_bytes(guard.exporter.to_bytes(without))["error"]
    assert top["error_drop"] == pytest.approx(sens["error"] - alone, rel=1e-6)
