"""``qdq-optuna bench``: recipes, resumable runs, results, plot (studies/smoke.yaml end to end)."""

from __future__ import annotations

import csv
import json
import logging
import shutil
import sys
from pathlib import Path

import pytest

from qdq_optuna.cli import bench
from qdq_optuna.cli.commands import main

SMOKE = bench.find_recipe("smoke")  # the shipped recipe (a checkout's studies/ or the wheel's)


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["bench", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "smoke"
    rc = main(["bench", str(SMOKE), "--output", str(out)])
    assert rc == 0
    return out


def _rows(out: Path) -> list[dict]:
    with open(out / "results.csv", newline="") as fh:
        return list(csv.DictReader(fh))


def test_outputs(smoke_run: Path) -> None:
    recipe = bench.load_recipe(SMOKE)
    with open(smoke_run / "results.csv", newline="") as fh:
        header = next(csv.reader(fh))
    assert tuple(header) == bench.CSV_COLUMNS
    rows = _rows(smoke_run)
    assert sorted(r["run"] for r in rows) == sorted(s.name for s in recipe.runs())
    assert {r["sampler"] for r in rows} == set(recipe.samplers)
    records = json.loads((smoke_run / "results.json").read_text())
    assert len(records) == len(rows)
    png = (smoke_run / "bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    summary = (smoke_run / "summary.md").read_text()
    for s in recipe.samplers:
        assert f"| {s} |" in summary
    for s in recipe.runs():
        assert (smoke_run / "runs" / s.name / "optimized.onnx").is_file()


def test_figures_are_consistent(smoke_run: Path) -> None:
    records = json.loads((smoke_run / "results.json").read_text())
    best = max(r["curve_speedup"] for r in records)
    assert best > 1.0  # tiny_concat has something to find on the cost model
    for r in records:
        run = json.loads((smoke_run / "runs" / r["run"] / "record.json").read_text())
        report = json.loads((smoke_run / "runs" / r["run"] / "report.json").read_text())
        # the measurement count rebuilt from studies.db is the search's own count
        assert r["measurements"] == report["measurements"] == r["report_measurements"]
        assert run["curve"][-1][0] == r["measurements"]
        # deterministic backend: the curve ends at the saved model's speedup
        assert r["curve_speedup"] == pytest.approx(report["speedup"], rel=1e-9)
        assert r["speedup"] == pytest.approx(report["baseline_latency_ms"]
                                             / report["final_latency_ms"])
        assert r["best_known_speedup"] == pytest.approx(best)
        xs = [p[0] for p in run["curve"]]
        assert xs == sorted(xs) and len(set(xs)) == len(xs)
        reach = r["measurements_to_99pct"]
        if r["curve_speedup"] >= 0.99 * best:
            assert reach is not None and 1 <= reach <= r["measurements"]
            assert bench.first_reach(run["curve"], 0.99 * best) == reach
        else:
            assert reach is None


def test_rerun_skips_finished_runs(smoke_run: Path, capsys) -> None:
    before = {p: p.stat().st_mtime_ns for p in smoke_run.glob("runs/*/record.json")}
    rc, out, _ = _cli(capsys, str(SMOKE), "--output", str(smoke_run))
    assert rc == 0
    assert out.count("done before, skipped") == len(before) == 2
    assert {p: p.stat().st_mtime_ns for p in smoke_run.glob("runs/*/record.json")} == before


def test_run_without_record_resumes(smoke_run: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "copy"
    shutil.copytree(smoke_run, out)
    name = bench.load_recipe(SMOKE).runs()[0].name
    old = json.loads((out / "runs" / name / "record.json").read_text())
    (out / "runs" / name / "record.json").unlink()
    rc, stdout, _ = _cli(capsys, str(SMOKE), "--output", str(out), "--only", name)
    assert rc == 0 and "skipped" not in stdout
    new = json.loads((out / "runs" / name / "record.json").read_text())
    # tune found the run finished: nothing ran again (its report stands), and the
    # history-based figures are those of the whole run
    assert new["report_measurements"] == old["report_measurements"]
    assert new["speedup"] == old["speedup"]
    assert new["measurements"] == old["measurements"]
    assert new["curve"] == old["curve"]


def test_only_filters_runs(tmp_path: Path, capsys) -> None:
    out = tmp_path / "only"
    rc, stdout, _ = _cli(capsys, str(SMOKE), "--output", str(out), "--only=-random-")
    assert rc == 0
    assert [p.name for p in (out / "runs").iterdir()] == ["tiny_concat-random-s0-b12"]
    assert [r["sampler"] for r in _rows(out)] == ["random"]
    rc, _, err = _cli(capsys, str(SMOKE), "--output", str(out), "--only", "nothing-like-this")
    assert rc == 2 and "--only" in err


BAD = {
    "unknown_key": ("modles: [resnet]\n", "'modles'"),
    "python_tag": ("models: !!python/object/apply:os.getcwd []\n", "safe YAML"),
    "unknown_sampler": ("samplers: [qdq, annealing]\n", "samplers: unknown sampler 'annealing'"),
    "unknown_model": ("models: [lenet]\n", "models: unknown zoo model 'lenet'"),
    "bad_seeds": ("seeds: [0, -1]\n", "seeds:"),
    "bad_budget": ("budgets: [0]\n", "budgets:"),
    "bad_timing": ("timing: slow\n", "timing: unknown 'slow'"),
    "bad_config": ("config: {maximum_mutations: 0}\n", "config:"),
    "config_budget": ("config: {schemes_per_region: 5}\n", "config.schemes_per_region"),
    "not_a_mapping": ("- resnet\n", "expected a mapping"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_recipe_is_one_line_exit_2(case: str, tmp_path: Path, capsys) -> None:
    text, expect = BAD[case]
    good = {"models": "models: [tiny_concat]\n", "samplers": "samplers: [qdq]\n",
            "seeds": "seeds: [0]\n", "budgets": "budgets: [2]\n"}
    key = text.split(":")[0]
    doc = text if case == "not_a_mapping" else "".join(
        v for k, v in good.items() if k != key) + text
    path = tmp_path / f"{case}.yaml"
    path.write_text(doc)
    rc, out, err = _cli(capsys, str(path), "--output", str(tmp_path / "out"))
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("qdq-optuna: error: ") and str(path) in lines[0]
    assert expect in lines[0]
    assert not (tmp_path / "out").exists()


def test_missing_key_and_seed_count(tmp_path: Path) -> None:
    p = tmp_path / "r.yaml"
    p.write_text("models: [tiny_concat]\nsamplers: [qdq]\nseeds: 3\n")
    with pytest.raises(bench.UserError, match="missing key 'budgets'"):
        bench.load_recipe(p)
    p.write_text("models: [tiny_concat]\nsamplers: [qdq, random]\nseeds: 3\nbudgets: [2, 5]\n")
    r = bench.load_recipe(p)
    assert r.seeds == [0, 1, 2] and len(r.runs()) == 12 and r.name == "r"


@pytest.mark.parametrize("name", ["sampler_comparison", "sampler_comparison_ort", "smoke"])
def test_committed_recipes_load(name: str) -> None:
    r = bench.load_recipe(name)  # by name, as `qdq-optuna bench NAME` finds it
    assert r.runs() and r.path == bench.recipe_dir() / f"{name}.yaml"


def test_first_reach_and_step() -> None:
    curve = [[1, 1.0], [5, 1.1], [9, 1.3], [12, 1.3]]
    assert bench.first_reach(curve, 1.0) == 1
    assert bench.first_reach(curve, 1.2) == 9
    assert bench.first_reach(curve, 1.31) is None
    assert bench._step(curve, [1, 4, 5, 8, 9, 20]) == [1.0, 1.0, 1.1, 1.1, 1.3, 1.3]


def test_without_matplotlib_everything_but_the_plot_is_written(smoke_run, tmp_path, monkeypatch,
                                                                capsys):
    """A default install has no matplotlib: bench writes its tables and says in one warning
    line that the plot was skipped."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    # twice in CI (the installed wheel's suite, two workers) no record reached caplog: what an
    # earlier test of the same worker process left in logging's global state (a fileConfig
    # that disables existing loggers, a library's logging.disable, root handlers replaced)
    # is not this test's subject, so it reads our logger's records with a handler of its own
    # on that logger, with logging's global switches as a fresh process has them
    ours = logging.getLogger("qdq_optuna")
    kept: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = kept.append  # type: ignore[method-assign]
    monkeypatch.setattr(ours, "disabled", False)
    disabled_at = logging.root.manager.disable
    level = ours.level
    logging.disable(logging.NOTSET)
    ours.setLevel(logging.NOTSET)
    ours.addHandler(handler)
    out = tmp_path / "smoke"
    shutil.copytree(smoke_run / "runs", out / "runs")  # finished runs: skipped, then aggregated
    try:
        rc, stdout, err = _cli(capsys, "smoke", "-o", str(out))  # a shipped recipe by name
    finally:
        ours.removeHandler(handler)
        ours.setLevel(level)
        logging.disable(disabled_at)
    assert rc == 0, err
    for name in ("results.csv", "results.json", "summary.md"):
        assert (out / name).is_file(), name
    assert not (out / "bench.png").exists()
    assert json.loads((out / "results.json").read_text()), "no records: nothing to plot"
    warnings = [r.getMessage() for r in kept if "bench.png" in r.getMessage()]
    assert warnings == [f"{out / 'bench.png'} not written: matplotlib is not installed (pip "
                        "install matplotlib; everything else is)"]
    assert [r.levelname for r in kept if "bench.png" in r.getMessage()] == ["WARNING"]
    assert "bench.png" not in stdout.splitlines()[-1]  # not listed as written
