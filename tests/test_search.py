"""The search end to end through :func:`qdq_optuna.tune` with deterministic latency functions.

One tiny ResNet-like model (``zoo.build("tiny_residual")``) is tuned with
``_latency_fns.rewards_groups``, a latency function with a real optimum (full DQ -> Conv -> Q
groups are faster, stray Q/DQ slower), so every run takes about a second and its outcome is
known in advance.
"""

from __future__ import annotations

import importlib.util
import json

import _latency_fns as fns
import numpy as np
import onnx
import onnxruntime as ort
import optuna
import pytest
import yaml
from _runs import distinct_models, expected_trials, is_refinement
from optuna.trial import TrialState

from qdq_optuna import Config, PreparedModel, tune
from qdq_optuna.backends.callable import CallableBackend
from qdq_optuna.errors import OptionError
from qdq_optuna.export import graph_output_names
from qdq_optuna.storage import open_storage

BUDGET = 6
REPORT_KEYS = {"baseline_latency_ms", "final_latency_ms", "speedup", "quantized_tensors",
               "measurements", "patterns"}
PATTERN_KEYS = {"id", "regions", "insertion_points", "trials", "committed_scheme", "gain"}
STUDY_ATTRS = {"signature", "regions", "ops", "qdq_points"}

pytestmark = pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")


def deterministic(fn) -> CallableBackend:
    return CallableBackend(fn, deterministic=True)


def studies(out, run_id: str | None = None) -> dict[str, optuna.Study]:
    """Every study of the run in ``out/studies.db``, by name."""
    storage = open_storage(f"sqlite:///{out / 'studies.db'}", heartbeat=False)
    names = [s.study_name for s in storage.get_all_studies()]
    return {n: optuna.load_study(study_name=n, storage=storage) for n in names
            if run_id is None or n.startswith(f"{run_id}/")}


def pattern_studies(out, run_id: str) -> dict[str, optuna.Study]:
    return {n.split("/", 1)[1]: s for n, s in studies(out, run_id).items()
            if n != f"{run_id}/_run"}


def complete(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    return study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))


def activation_q_inputs(model: onnx.ModelProto) -> set[str]:
    """Activations behind a Q (a quantized graph output by its name, see export)."""
    inits = {i.name for i in model.graph.initializer}
    renamed = graph_output_names(model)
    return {renamed.get(n.input[0], n.input[0]) for n in model.graph.node
            if n.op_type == "QuantizeLinear" and n.input[0] not in inits}


def qdq_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")]


def run_ort(model: onnx.ModelProto | str) -> list[np.ndarray]:
    data = model.SerializeToString() if isinstance(model, onnx.ModelProto) else model
    sess = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    feeds = {}
    rng = np.random.default_rng(0)
    for i in sess.get_inputs():
        shape = [d if isinstance(d, int) else 1 for d in i.shape]
        feeds[i.name] = rng.standard_normal(shape).astype(np.float32)
    return sess.run(None, feeds)



@pytest.fixture(scope="module")
def e2e(residual, tmp_path_factory):
    """A plain (not declared deterministic) callable, timed with the fast protocol."""
    out = tmp_path_factory.mktemp("e2e") / "run"
    result = tune(residual, out, benchmark=fns.rewards_groups, timing="fast",
                  config=Config(schemes_per_region=BUDGET), progress=False)
    return result


# -- 1. outputs --------------------------------------------------------------------------------
def test_outputs_exist_and_optimized_model_runs(e2e, residual):
    out = e2e.output_dir
    for name in ("optimized.onnx", "report.json", "report.md", "pattern_cache.yaml",
                 "state.yaml", "studies.db"):
        assert (out / name).is_file(), name
    assert e2e.optimized_model == out / "optimized.onnx"
    optimized = onnx.load(str(out / "optimized.onnx"))
    onnx.checker.check_model(optimized, full_check=True)
    got = run_ort(optimized)
    want = run_ort(str(residual))
    assert [a.shape for a in got] == [b.shape for b in want]
    assert all(np.isfinite(a).all() for a in got)

    cache = yaml.safe_load((out / "pattern_cache.yaml").read_text())
    assert isinstance(cache, dict) and isinstance(cache["patterns"], dict) and cache["patterns"]
    state = yaml.safe_load((out / "state.yaml").read_text())
    assert state["status"] == "done"
    assert state["run_id"] == "run"
    assert all(p["status"] == "committed" for p in state["patterns"])
    md = (out / "report.md").read_text()
    assert md.startswith("# qdq-optuna report") and "Speedup" in md


def test_report_schema(e2e):
    report = json.loads((e2e.output_dir / "report.json").read_text())
    assert REPORT_KEYS <= set(report)
    assert report["complete"] is True
    assert report["patterns"], "tiny_residual has tunable patterns"
    for p in report["patterns"]:
        assert PATTERN_KEYS <= set(p), p.keys()
        assert set(p["committed_scheme"]) <= set(p["insertion_points"])
        assert p["gain"] >= 1.0
    assert report["measurements"] > 0
    assert report == json.loads(json.dumps(e2e.report, default=str))


def test_quantized_tensors_are_the_q_inputs_of_the_optimized_model(e2e):
    optimized = onnx.load(str(e2e.optimized_model))
    assert set(e2e.report["quantized_tensors"]) == activation_q_inputs(optimized)
    assert e2e.report["quantized_tensors"], "the latency function rewards quantizing"


def test_studies_named_per_pattern_with_attrs(e2e):
    report = e2e.report
    all_studies = studies(e2e.output_dir)
    # the run's overview ("run"), its bookkeeping, one study per pattern and round
    assert set(all_studies) == {"run", "run/_run"} | {
        f"run/{p['id']}" for p in report["patterns"]} | {
        f"run/{p['id']}/refine{r['round']}" for p in report["patterns"]
        for r in p.get("refinements", [])}
    for p in report["patterns"]:
        s = all_studies[f"run/{p['id']}"]
        attrs = s.user_attrs
        assert STUDY_ATTRS <= set(attrs)
        assert attrs["signature"] == p["signature"]
        assert attrs["regions"] == p["regions"]
        assert attrs["qdq_points"] == p["insertion_points"]
        assert attrs["ops"] == p["ops"]
        assert s.metric_names == ["latency_ms"]


def test_each_study_has_exactly_its_budget_of_complete_trials(e2e, residual):
    report = e2e.report
    expected = distinct_models(residual, report["patterns"])
    assert min(expected.values()) < BUDGET, "some pattern has fewer schemes than the budget"
    by_id = pattern_studies(e2e.output_dir, "run")
    for p in report["patterns"]:
        want = min(BUDGET, expected[p["id"]])
        done = complete(by_id[p["id"]])
        assert len(done) == want, p["id"]
        assert p["trials"] == want
        # the qdq sampler never measures one model twice in a study
        keys = [t.user_attrs["plan_key"] for t in done]
        assert len(keys) == len(set(keys)), p["id"]
        assert not any(t.system_attrs.get("qdq:duplicate") for t in done)


def test_trial_user_attrs(e2e):
    for pid, s in pattern_studies(e2e.output_dir, "run").items():
        points = s.user_attrs["qdq_point_tensors"]
        for t in complete(s):
            attrs = t.user_attrs
            assert {"tensors", "qdq_count", "measurement"} <= set(attrs), (pid, t.number)
            on = [p for p, v in t.params.items() if v]
            assert attrs["tensors"] == sorted({x for p in on for x in points[p]})
            assert isinstance(attrs["qdq_count"], int) and attrs["qdq_count"] >= 0
            assert attrs["measurement"]["latency_ms"] == pytest.approx(t.value)


# -- 2. commit rule ----------------------------------------------------------------------------
def test_rewarded_groups_are_committed_and_speed_up(e2e):
    report = e2e.report
    committed = [p for p in report["patterns"] if p["committed_scheme"]]
    assert committed
    assert all(p["gain"] >= 1.02 for p in committed)
    assert report["speedup"] > 1.0
    assert report["baseline_latency_ms"] == pytest.approx(10.0)
    optimized = onnx.load(str(e2e.optimized_model))
    assert report["final_latency_ms"] == pytest.approx(fns.rewards_groups(optimized))
    assert report["final_latency_ms"] < 10.0


def test_nothing_committed_when_every_qdq_is_slower(residual, tmp_path):
    result = tune(residual, tmp_path / "slow", benchmark=fns.every_qdq_slower, timing="fast",
                  config=Config(schemes_per_region=4), progress=False)
    report = result.report
    assert all(p["committed_scheme"] == [] for p in report["patterns"])
    assert all(p["trials"] >= 2 for p in report["patterns"]), "Q/DQ schemes were tried"
    optimized = onnx.load(str(result.optimized_model))
    assert qdq_nodes(optimized) == []
    assert report["quantized_tensors"] == []
    assert report["speedup"] == pytest.approx(1.0, abs=1e-6)


def test_threshold_above_any_gain_commits_nothing(residual, tmp_path):
    result = tune(residual, tmp_path / "t", benchmark=deterministic(fns.rewards_groups),
                  config=Config(schemes_per_region=4, performance_threshold=2.0),
                  progress=False)
    assert all(p["committed_scheme"] == [] for p in result.report["patterns"])
    assert qdq_nodes(onnx.load(str(result.optimized_model))) == []


# -- 3. samplers -------------------------------------------------------------------------------
@pytest.mark.parametrize("sampler", ["qdq", "tpe", "random", "cmaes"])
def test_samplers_by_name(sampler, residual, tmp_path):
    budget = 4
    result = tune(residual, tmp_path / sampler, benchmark=deterministic(fns.rewards_groups),
                  sampler=sampler, config=Config(schemes_per_region=budget, converged_patience=0),
                  progress=False)
    report = result.report
    assert report["sampler"] == sampler and report["complete"]
    expected = distinct_models(residual, report["patterns"])
    for p in report["patterns"]:
        assert p["trials"] == min(budget, expected[p["id"]]), (sampler, p["id"])
    want = expected_trials(residual, report, budget)
    for p, s in pattern_studies(result.output_dir, result.report["run_id"]).items():
        if is_refinement(p):  # a cap: its distinct models depend on the other patterns
            assert 1 <= len(complete(s)) <= want[p], (sampler, p)
        else:
            assert len(complete(s)) == want[p], (sampler, p)


def test_qdq_stops_a_converged_study_early_without_losing_the_best(residual, tmp_path):
    """With a large budget our sampler's climb runs out of untried neighbours of the best
    scheme; the study then stops after ``converged_patience`` exploration trials that did not
    improve, and commits the same scheme as a run that spends its whole budget."""
    budget = 40
    runs = {}
    for patience in (0, 1):
        runs[patience] = tune(residual, tmp_path / f"p{patience}",
                              benchmark=deterministic(fns.rewards_groups), sampler="qdq",
                              config=Config(schemes_per_region=budget,
                                            converged_patience=patience), progress=False).report
    full, early = runs[0], runs[1]
    expected = distinct_models(residual, full["patterns"])
    stopped = [p for p in early["patterns"] if "converged_after" in p]
    assert stopped, "no study converged before its budget"
    for p_full, p_early in zip(full["patterns"], early["patterns"]):
        assert p_full["trials"] == min(budget, expected[p_full["id"]])
        assert "converged_after" not in p_full
        assert p_early["committed_scheme"] == p_full["committed_scheme"]
        if "converged_after" in p_early:
            assert p_early["trials"] < p_full["trials"]
    assert early["measurements"] < full["measurements"]
    assert early["final_latency_ms"] == pytest.approx(full["final_latency_ms"])


def test_qdq_studies_also_start_from_the_compute_inputs(residual, tmp_path):
    """Our sampler's studies get the classic recipe (Q/DQ on Conv/Gemm/MatMul inputs only) as
    a seed after the user's, unless it is no scheme of its own; other samplers do not."""
    from qdq_optuna.scheme import compute_inputs_scheme

    pm = PreparedModel.prepare(str(residual))
    want = {pp.pattern.id: compute_inputs_scheme(pp) for pp in pm.tunable}
    assert any(want.values())
    for sampler, on in (("qdq", True), ("qdq", False), ("random", True)):
        out = tmp_path / f"{sampler}-{on}"
        tune(residual, out, benchmark=deterministic(fns.rewards_groups), sampler=sampler,
             config=Config(schemes_per_region=6, seed_compute_inputs=on), progress=False)
        for pid, s in pattern_studies(out, out.name).items():
            if is_refinement(pid):  # starts from the standing scheme only (tested below)
                continue
            fixed = [t.system_attrs["fixed_params"] for t in s.get_trials(deepcopy=False)
                     if t.system_attrs.get("fixed_params")]
            seeded = want[pid] is not None and want[pid] in fixed
            assert seeded == (sampler == "qdq" and on and want[pid] is not None), (sampler, pid)
            if seeded:
                t = next(t for t in s.get_trials(deepcopy=False)
                         if t.system_attrs.get("fixed_params") == want[pid])
                assert t.state == TrialState.COMPLETE
                assert t.system_attrs["qdq:origin"] == "seed"


def test_gp_sampler_without_torch_is_a_clear_error(residual, tmp_path):
    if importlib.util.find_spec("torch") is not None:
        pytest.skip("torch is installed: the gp sampler is available")
    with pytest.raises(OptionError, match="--sampler gp needs torch"):
        tune(residual, tmp_path / "gp", benchmark=deterministic(fns.rewards_groups),
             sampler="gp", config=Config(schemes_per_region=4), progress=False)


# -- 4. reproducibility ------------------------------------------------------------------------
def _trace(result) -> list:
    rows = []
    for pid, s in sorted(pattern_studies(result.output_dir, result.report["run_id"]).items()):
        trials = sorted(s.get_trials(deepcopy=False), key=lambda t: t.number)
        rows.append((pid, [(t.state.name, t.params, t.value) for t in trials],
                     s.user_attrs["committed"]))
    return rows


def test_same_seed_same_search(residual, tmp_path):
    runs = [tune(residual, tmp_path / f"r{i}" / "same", benchmark=deterministic(fns.rewards_groups),
                 seed=7, config=Config(schemes_per_region=5), progress=False)
            for i in range(2)]
    a, b = (_trace(r) for r in runs)
    assert a == b
    assert [p["committed_scheme"] for p in runs[0].report["patterns"]] == \
        [p["committed_scheme"] for p in runs[1].report["patterns"]]
    assert any(len({tuple(sorted(p.items())) for _, p, _ in row[1]}) > 1 for row in a)


# -- 6. warm starts ----------------------------------------------------------------------------
def test_pattern_cache_seeds_the_next_run(e2e, residual, tmp_path):
    cache_path = e2e.output_dir / "pattern_cache.yaml"
    cache = yaml.safe_load(cache_path.read_text())["patterns"]
    result = tune(residual, tmp_path / "warm", benchmark=deterministic(fns.rewards_groups),
                  pattern_cache=str(cache_path), config=Config(schemes_per_region=BUDGET),
                  progress=False)
    by_id = pattern_studies(result.output_dir, "warm")
    seeded = 0
    for p in result.report["patterns"]:
        entry = cache.get(p["signature"])
        if not entry or not entry["schemes"]:
            continue
        best = sorted(entry["schemes"][0]["points"])
        first = sorted(by_id[p["id"]].get_trials(deepcopy=False),
                       key=lambda t: t.number)[:len(entry["schemes"])]
        seeds = [sorted(k for k, v in t.system_attrs.get("fixed_params", {}).items() if v)
                 for t in first if t.system_attrs.get("qdq:origin") == "seed"]
        assert best in seeds, (p["id"], best, seeds)
        seeded += 1
    assert seeded == len(result.report["patterns"])


def _quantize_static(float_path, out_path) -> None:
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

    model = onnx.load(str(float_path))

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            rng = np.random.default_rng(0)
            feeds = []
            for _ in range(2):
                feed = {}
                for i in model.graph.input:
                    shape = [d.dim_value or 1 for d in i.type.tensor_type.shape.dim]
                    feed[i.name] = rng.standard_normal(shape).astype(np.float32)
                feeds.append(feed)
            self.it = iter(feeds)

        def get_next(self):
            return next(self.it, None)

    quantize_static(str(float_path), str(out_path), Reader(), quant_format=QuantFormat.QDQ)


def test_qdq_baseline_seeds_its_placement(residual, tmp_path):
    baseline = tmp_path / "baseline_qdq.onnx"
    _quantize_static(residual, baseline)
    quantized = activation_q_inputs(onnx.load(str(baseline)))
    assert quantized
    result = tune(residual, tmp_path / "seeded", benchmark=deterministic(fns.rewards_groups),
                  qdq_baseline=str(baseline),
                  config=Config(schemes_per_region=4, seed_compute_inputs=False),
                  progress=False)
    assert result.report["complete"]
    seeds = 0
    for _pid, s in pattern_studies(result.output_dir, "seeded").items():
        tensors = s.user_attrs["qdq_point_tensors"]
        expected = {p: int(bool(ts) and set(ts) <= quantized) for p, ts in tensors.items()}
        for t in s.get_trials(deepcopy=False):
            fixed = t.system_attrs.get("fixed_params")
            if fixed and any(fixed.values()):
                assert fixed == expected
                assert t.state == TrialState.COMPLETE
                assert set(t.user_attrs["tensors"]) <= quantized
                seeds += 1
    assert seeds >= 1
