"""The descent's rounds (``Config.refine_rounds``): every visit tunes a pattern against the
whole standing model, from its standing scheme, and a pattern whose surroundings did not change
is not visited again; on the analytical cost model (deterministic, so figures compare
exactly)."""

from __future__ import annotations

import json
import math

import onnx
import optuna
import pytest
from _runs import check_visit, is_visit

from qdq_optuna import Config, tune
from qdq_optuna.backends.costmodel import CostModelBackend
from qdq_optuna.errors import OptionError
from qdq_optuna.examples import zoo
from qdq_optuna.record.storage import open_storage

BUDGET = 30


@pytest.fixture(scope="module")
def resnet(tmp_path_factory):
    path = tmp_path_factory.mktemp("refine") / "resnet.onnx"
    onnx.save(zoo.build("resnet", "medium"), str(path))
    return path


@pytest.fixture(scope="module")
def runs(resnet, tmp_path_factory):
    """The default search, and the single pattern-by-pattern pass from float it replaced
    (``--start float --refine-rounds 0``)."""
    out = {}
    for name, cfg in (("single", Config(start="float", refine_rounds=0)), ("default", Config())):
        d = tmp_path_factory.mktemp(name) / "run"
        out[name] = tune(resnet, d, backend="costmodel", seed=0, config=cfg, progress=False)
    return out


def studies(result) -> dict[str, optuna.Study]:
    storage = open_storage(f"sqlite:///{result.output_dir / 'studies.db'}", heartbeat=False)
    run_id = result.report["run_id"]
    return {s.study_name[len(run_id) + 1:]: optuna.load_study(study_name=s.study_name,
                                                               storage=storage)
            for s in storage.get_all_studies()
            if s.study_name.startswith(f"{run_id}/") and s.study_name != f"{run_id}/_run"}


def test_the_descent_beats_the_single_pass_from_float(runs):
    single, default = runs["single"].report, runs["default"].report
    assert [s["name"] for s in single["starts"] if s["chosen"]] == ["float"]
    assert all(v["round"] == 1 for p in single["patterns"] for v in p["visits"])
    assert default["speedup"] > single["speedup"] * 1.01
    # deterministic backend: the saved model is what the search measured
    assert CostModelBackend().estimate(
        (runs["default"].output_dir / "optimized.onnx").read_bytes()).total_ms == pytest.approx(
        default["final_latency_ms"])
    # never slower than its start: the standing model only ever got faster
    chosen = next(s for s in default["starts"] if s["chosen"])
    assert default["final_latency_ms"] <= chosen["latency_ms"] + 1e-12
    assert default["speedup"] == pytest.approx(
        chosen["speedup"] * math.prod(p["gain"] for p in default["patterns"]))
    md = (runs["default"].output_dir / "report.md").read_text()
    assert "## Starts" in md and "standing model" in md


def test_visits_start_from_the_standing_model(runs):
    result = runs["default"]
    all_studies = studies(result)
    visits = sorted(((n, s) for n, s in all_studies.items() if is_visit(n)),
                    key=lambda ns: ns[1].user_attrs["order"])
    assert visits
    previous_ref = math.inf
    for name, s in visits:
        attrs = s.user_attrs
        check_visit(name, s, BUDGET)
        trials = sorted(s.get_trials(deepcopy=False), key=lambda t: t.number)
        # its first trial is the pattern's standing scheme: the reference, measured before
        assert sorted(p for p, v in trials[0].params.items() if v) == sorted(attrs["from_scheme"])
        assert trials[0].user_attrs["measurements"] == 0
        assert trials[0].value == pytest.approx(attrs["reference_ms"])
        # the standing model never gets slower from one visit to the next (one lane here)
        if not attrs["lane"]:
            assert attrs["reference_ms"] <= previous_ref + 1e-12
            previous_ref = attrs["reference_ms"]
        # moves carry their kind and what they change; with our sampler they are all it tries
        for t in trials[1:]:
            assert t.user_attrs["move"] in ("kernel", "cache", "fusion", "concat", "chain", "single")
            assert t.user_attrs["move_signature"]


def test_patterns_whose_surroundings_did_not_change_are_not_visited_again(runs, resnet):
    """Round 2 visits only the patterns next to what round 1 changed; a rerun resumes to the
    same result without measuring anything."""
    result = runs["default"]
    report = result.report
    rounds = {p["id"]: [v["round"] for v in p["visits"] if v["pattern"] == p["id"]]
              for p in report["patterns"]}
    # a pattern whose every move only removes Q/DQ the runtime fused is skipped, not visited
    assert all(r[0] == 1 for r in rounds.values() if r) and any(rounds.values())
    assert any(len(r) == 1 for r in rounds.values()), "every pattern was visited again"
    before = {n: len(s.trials) for n, s in studies(result).items()}
    rerun = tune(resnet, result.output_dir, backend="costmodel", seed=0, progress=False)
    assert rerun.finished_before  # the stored result: nothing measured again
    assert rerun.report == report
    assert {n: len(s.trials) for n, s in studies(result).items()} == before
    state = (result.output_dir / "state.yaml").read_text()
    assert "status: done" in state


def test_chain_moves_change_the_partner_pattern_too(tmp_path):
    """A chain move sets the points of every pattern that quantizes one tensor, together; a
    committed one records its partners' new schemes, and the standing model (report, resume)
    takes them."""
    path = tmp_path / "concat.onnx"
    onnx.save(zoo.build("tiny_concat"), str(path))
    # from the recipe (Q/DQ on Conv inputs): every point on is already the optimum here
    result = tune(path, tmp_path / "run", backend="costmodel", seed=0, progress=False,
                  config=Config(refine_rounds=1, start="recipe"))
    chains = [(n, s) for n, s in studies(result).items()
              if is_visit(n) and s.user_attrs.get("partner")]
    assert chains, "no chain move was committed"
    name, s = chains[0]
    trials = s.get_trials(deepcopy=False)
    # a chain move improved the visit; later moves build on it, partner points included
    assert any(t.user_attrs.get("move") == "chain" and t.user_attrs.get("improved")
               and t.user_attrs.get("partner") for t in trials)
    won = next(t for t in trials if t.number == s.user_attrs["candidate_trial"])
    assert won.user_attrs["partner"]
    for partner, points in won.user_attrs["partner"].items():
        scheme = s.user_attrs["partner"][partner]
        assert all(scheme[q] == v for q, v in points.items())
    report = json.loads((result.output_dir / "report.json").read_text())
    partners = {v["pattern"] for p in report["patterns"] for v in p["visits"]
                if v["pattern"] != p["id"]}
    assert partners, "the report does not show the partner's change"


def test_refine_rounds_must_not_be_negative():
    with pytest.raises(OptionError, match="refine_rounds must be >= 0"):
        Config(refine_rounds=-1)
    with pytest.raises(OptionError, match="start must be one of best, float, recipe, all"):
        Config(start="somewhere")
