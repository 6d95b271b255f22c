"""Refinement rounds (``Config.refine_rounds``): each pattern tuned again with every other
pattern's scheme in place, on the analytical cost model (deterministic, so figures compare
exactly)."""

from __future__ import annotations

import json
import math

import onnx
import optuna
import pytest
from optuna.trial import TrialState

from qdq_optuna import Config, tune, zoo
from qdq_optuna.backends.costmodel import CostModelBackend
from qdq_optuna.errors import OptionError
from qdq_optuna.storage import open_storage


@pytest.fixture(scope="module")
def resnet(tmp_path_factory):
    path = tmp_path_factory.mktemp("refine") / "resnet.onnx"
    onnx.save(zoo.build("resnet", "full"), str(path))
    return path


@pytest.fixture(scope="module")
def runs(resnet, tmp_path_factory):
    """The same search with and without a refinement round."""
    out = {}
    for rounds in (0, 1):
        d = tmp_path_factory.mktemp(f"rounds{rounds}") / "run"
        out[rounds] = tune(resnet, d, benchmark="costmodel", seed=0,
                           config=Config(refine_rounds=rounds), progress=False)
    return out


def studies(result) -> dict[str, optuna.Study]:
    storage = open_storage(f"sqlite:///{result.output_dir / 'studies.db'}", heartbeat=False)
    run_id = result.report["run_id"]
    return {s.study_name[len(run_id) + 1:]: optuna.load_study(study_name=s.study_name,
                                                               storage=storage)
            for s in storage.get_all_studies()
            if s.study_name.startswith(f"{run_id}/") and s.study_name != f"{run_id}/_run"}


def test_refinement_finds_what_the_single_pass_cannot(runs):
    """ResNet-like, cost model: the first pass commits Q/DQ on the residual block's output for
    P001 before P002 quantizes the same tensors as its inputs; with P002's scheme in place,
    that output Q/DQ only costs. Only a refinement round can take it back."""
    single, refined = runs[0].report, runs[1].report
    assert "refinements" not in json.dumps(single["patterns"])
    assert refined["speedup"] > single["speedup"] * 1.01
    # deterministic backend: the whole-model speedup is the product of every round's gain
    assert refined["speedup"] == pytest.approx(math.prod(p["gain"] for p in refined["patterns"]))
    assert CostModelBackend().estimate(
        (runs[1].output_dir / "optimized.onnx").read_bytes()).total_ms == pytest.approx(
        refined["final_latency_ms"])
    changed = [(p, r) for p in refined["patterns"] for r in p.get("refinements", [])
               if r["gain"] > 1.0]
    assert changed, "no refinement round improved anything"
    for p, r in changed:
        assert r["commit_reason"] == "confirmed" and r["status"] == "committed"
        assert set(r["committed_scheme"]) == set(p["committed_scheme"])
        # under the 2 % commit threshold, taken because it only removes Q/DQ
        if r["gain"] < 1.02:
            assert set(r["committed_scheme"]) < set(r["from_scheme"])
    md = (runs[1].output_dir / "report.md").read_text()
    assert "refinement 1: confirmed" in md


def test_refinement_studies_start_from_the_standing_scheme(runs):
    result = runs[1]
    all_studies = studies(result)
    by_id = {p["id"]: p for p in result.report["patterns"]}
    refined = {name: s for name, s in all_studies.items() if "/refine" in name}
    assert refined
    for name, s in refined.items():
        pid = name.split("/")[0]
        first = all_studies[pid]
        attrs = s.user_attrs
        assert attrs["refine_round"] == 1 and attrs["pattern_id"] == pid
        assert attrs["order"] == len(by_id) + first.user_attrs["order"]
        # it starts where the first pass left the pattern: that model is the reference,
        # known already, so the first trial costs no measurement
        start = sorted(p for p, v in first.user_attrs["committed"].items() if v)
        assert sorted(attrs["refines"]) == start
        trials = sorted(s.get_trials(deepcopy=False), key=lambda t: t.number)
        assert trials[0].system_attrs["fixed_params"] == first.user_attrs["committed"]
        assert trials[0].system_attrs["qdq:origin"] == "seed"
        assert trials[0].user_attrs["measurements"] == 0
        assert trials[0].value == pytest.approx(attrs["reference_ms"])
        # our sampler climbs from it (no empty / full scheme first), within the round's cap
        for t in trials[1:]:
            assert t.system_attrs["qdq:origin"] == "mutation"
        done = [t for t in trials if t.state == TrialState.COMPLETE]
        assert len(done) <= 2 * len(attrs["qdq_points"])
        # the reference of a refinement is the whole model as it stood, so its latency
        # is below the first pass's reference
        assert attrs["reference_ms"] < first.user_attrs["reference_ms"]


def test_patterns_whose_surroundings_did_not_change_are_not_tuned_again(tmp_path):
    """ResNet-like at medium size: nothing is committed around the last patterns after they
    were tuned, so the refinement round leaves them alone; a rerun resumes to the same
    result without measuring anything."""
    path = tmp_path / "resnet.onnx"
    onnx.save(zoo.build("resnet", "medium"), str(path))
    out = tmp_path / "run"
    report = tune(path, out, benchmark="costmodel", seed=0, progress=False).report
    refined = {p["id"] for p in report["patterns"] if p.get("refinements")}
    assert refined and refined != {p["id"] for p in report["patterns"]}
    s = studies(tune(path, out, benchmark="costmodel", seed=0, progress=False))
    assert {n.split("/")[0] for n in s if "/refine" in n} == refined
    again = json.loads((out / "report.json").read_text())
    assert again["patterns"] == report["patterns"]
    state = (out / "state.yaml").read_text()
    assert "refinements: 1" in state


def test_refine_rounds_must_not_be_negative():
    with pytest.raises(OptionError, match="refine_rounds must be >= 0"):
        Config(refine_rounds=-1)
