"""The README's headline figures and the docs' generated tables come from benchmarks/results/.

Why: figures copied by hand drift from the files the benchmarks write; these tests fail when a
README row no longer matches its results file, or when the docs hook would render a wrong cell.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

if os.environ.get("QDQ_OPTUNA_TEST_INSTALLED") == "1":  # the suite copied beside a wheel
    pytest.skip("checks the source tree: run from the checkout", allow_module_level=True)


def _headline_row(r: dict) -> str:
    ci = r["tuned_vs_recipe"]["ci"]
    return (f"| {r['model']} | {r['seed']} | {r['tuned']['speedup']:.3f}x | "
            f"{r['recipe']['speedup']:.3f}x | {r['tuned_vs_recipe']['speedup']:.3f}x "
            f"({ci[0]:.3f}-{ci[1]:.3f}) | {r['tuned_error']['cosine']:.4f} / "
            f"{r['recipe_error']['cosine']:.4f} | {r['tune_s']:.0f} s |")


def test_the_readme_headline_table_is_the_results_file():
    rows = json.loads((REPO / "benchmarks/results/vs_recipe_ort_cpu_concat.json").read_text())
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    table = [line for line in readme.splitlines() if line.startswith("| ") and " s |" in line]
    assert table == [_headline_row(r) for r in rows]


def test_the_readme_stays_short_and_starts_with_the_two_commands():
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) < 300
    assert lines[4].startswith("python3 -m venv .venv && .venv/bin/pip install -e . && ")
    assert lines[6].startswith('python3 -m venv .venv && .venv/bin/pip install -e ".[test]"')


@pytest.fixture(scope="module")
def hooks():
    pytest.importorskip("mkdocs")
    spec = importlib.util.spec_from_file_location("docs_hooks", REPO / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cells_and_tables(hooks):
    assert hooks.cell(1.23456) == "1.235" and hooks.cell([1.0, 2.5]) == "1-2.5"
    assert hooks.cell(None) == "-" and hooks.cell(True) == "yes" and hooks.cell("a|b") == "a\\|b"
    rows = [{"m": "x", "t": {"s": 2.0}}, {"m": "y"}]
    assert hooks.table(rows, {"m": "model", "t.s": "speed"}, "f", {"t.s": "n/a"}).splitlines() \
        == ["| model | speed |", "|---|---|", "| x | 2 |", "| y | n/a |"]
    with pytest.raises(Exception, match="row 1 has no 't.s'"):
        hooks.table(rows, {"t.s": "speed"}, "f")


def test_every_results_directive_names_a_file_and_its_columns(hooks):
    """What `mkdocs build --strict` would fail on, found without building the site."""
    class Page:
        class file:
            src_path = "page"

    pages = list((REPO / "docs").rglob("*.md"))
    found = 0
    for page in pages:
        text = page.read_text(encoding="utf-8")
        for match in hooks._RESULTS_RE.finditer(text):
            found += 1
            spec = hooks.yaml.safe_load(match.group(1))
            assert "Rendered at build time" in hooks._results(spec, Page)
    assert found >= 10


def test_the_cli_reference_lists_every_tune_option(hooks):
    from qdq_optuna.cli.commands import build_parser

    text = hooks.cli_reference()
    tune = next(a for a in build_parser()._actions if a.dest == "command").choices["tune"]
    for action in tune._actions:
        for flag in action.option_strings:
            assert f"`{flag}`" in text
