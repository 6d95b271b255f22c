"""The README's headline figures and the docs' generated tables come from benchmarks/results/.

Why: figures copied by hand drift from the files the benchmarks write; these tests fail when a
README row no longer matches its results file, or when the docs hook would render a wrong cell.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

if os.environ.get("QDQ_OPTUNA_TEST_INSTALLED") == "1":  # the suite copied beside a wheel
    pytest.skip("checks the source tree: run from the checkout", allow_module_level=True)


def _headline_row(r: dict) -> str:
    ci = r["tuned_vs_recipe"]["ci"]
    dyn = r.get("tuned_vs_dynamic")  # ONNX Runtime's transformer recipe, where it applies
    dynamic = (f"{r['recipe_dynamic']['speedup']:.3f}x / {dyn['speedup']:.3f}x "
               f"({dyn['ci'][0]:.3f}-{dyn['ci'][1]:.3f})" if dyn else "-")
    return (f"| {r['model']} | {r['seed']} | {r['tuned']['speedup']:.3f}x | "
            f"{r['recipe']['speedup']:.3f}x | {r['tuned_vs_recipe']['speedup']:.3f}x "
            f"({ci[0]:.3f}-{ci[1]:.3f}) | {dynamic} | {r['tuned_error']['cosine']:.4f} / "
            f"{r['recipe_error']['cosine']:.4f} | {r['tune_s']:.0f} s |")


def test_the_readme_headline_table_is_the_results_file():
    rows = json.loads((REPO / "benchmarks/results/vs_recipe_ort_cpu_headline.json").read_text())
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    table = [line for line in readme.splitlines() if line.startswith("| ") and " s |" in line]
    assert table == [_headline_row(r) for r in rows]


def test_the_readme_stays_short_and_starts_with_the_two_commands():
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) < 300
    assert lines[4].startswith("python3 -m venv .venv && .venv/bin/pip install -e . && ")
    assert lines[6].startswith('python3 -m venv .venv && .venv/bin/pip install -e ".[test]"')


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


def _pages() -> list[Path]:
    return [*sorted((REPO / "docs").rglob("*.md")), REPO / "README.md", REPO / "CHANGELOG.md"]


def test_every_package_path_the_docs_cite_exists():
    """A renamed module leaves the docs pointing at nothing; a reader then finds no such file."""
    cited = {}
    for page in _pages():
        for path in re.findall(r"(?<![\w./~-])qdq_optuna/[\w./-]*\w", page.read_text(encoding="utf-8")):
            cited.setdefault(path.rstrip("."), page.relative_to(REPO))
    assert len(cited) >= 10
    missing = {p: str(page) for p, page in cited.items() if not (REPO / p).exists()}
    assert missing == {}


def test_no_page_reads_as_a_work_log():
    """The docs describe the tool; issue numbers and progress notes belong in the history."""
    pattern = re.compile(r"\bissues?[ _-]?#?\d+|\bTODO\b|\b(?:this|last|next) session\b", re.I)
    found = {}
    for page in _pages():
        for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            if pattern.search(line):
                found.setdefault(str(page.relative_to(REPO)), []).append(n)
    assert found == {}


#: a diary's voice: when something was checked, what a figure or a line was before, what is
#: not done, whose runs loaded the machine. A page says what the product does and what a
#: figure was measured on (machine, versions), not when or by whom
_DIARY = re.compile("|".join([
    r"\b20\d\d-\d\d-\d\d\b",                          # a date: the figure's versions say when
    r"\bchecked\b[^.]*\b20\d\d\b",
    r"\b(?:it|this|that) was \d",                      # "It was 0.5"
    r"\bused to (?:read|be|run|say|show|take|give|write|print|ship|fail)\b",
    r"\bin this (?:change|commit|release|version|pass)\b",
    r"\bnot (?:done|run|measured|checked|tested) (?:yet|here yet)\b", r"\bnot yet\b",
    r"\b\d+ min instead of \d+\b", r"\btest suite\b[^.]*\binstead of\b",  # "15 min instead of 22"
    r"\bother engineers\b", r"\bengineers' runs\b",
    r"\b(?:is|are) now (?:skipped|made|robust|fixed)\b", r"\bnow (?:takes|reads|gives)\b",
]), re.I)


def diary_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if _DIARY.search(line)]


def test_the_diary_check_finds_each_kind_of_work_log_line():
    for line in ("Checked in a fresh venv on the CPU machine (2026-11-26): fine.",
                 "It was 0.5, a net for broken models only.",
                 "the float start used to read 0.77-0.87x of it",
                 "Written against the API; not run on a GPU in this change.",
                 "Writing only the changed tensors would meet both; not done yet.",
                 "the test suite takes 15 min instead of 22",
                 "load 4-6 from other engineers' runs", "it is now skipped"):
        assert diary_lines(line) == [line], line
    for line in ("measured on a 2-core AMD EPYC, ONNX Runtime 1.32",
                 "a change that only removes Q/DQ is kept when it is not slower",
                 "the tensors used to compute the scale", "Optuna 5.0"):
        assert diary_lines(line) == [], line


def test_no_page_reads_as_a_diary():
    """Every page and the README (the changelog is a history, and says when by version)."""
    pages = [p for p in _pages() if p.name != "CHANGELOG.md"]
    found = {str(p.relative_to(REPO)): diary_lines(p.read_text(encoding="utf-8"))
             for p in pages}
    assert {page: lines for page, lines in found.items() if lines} == {}


def test_sphinx_roles_in_docstrings_render_as_code(hooks):
    html = ("see :class:<code>~qdq_optuna.search.TuneOptions</code> and "
            ":meth:<code>Tuner.search &lt;qdq_optuna.search.Tuner.search&gt;</code>, "
            ":func:<code>qdq_optuna.tune</code>")
    assert hooks.sphinx_roles(html) == ("see <code>TuneOptions</code> and "
                                        "<code>Tuner.search</code>, <code>qdq_optuna.tune</code>")


def test_the_version_is_one_and_the_changelog_renders_in_the_site():
    import qdq_optuna

    pyproject = (REPO / "pyproject.toml").read_text()
    assert re.search(r'^version = "(.+)"$', pyproject, re.M).group(1) == qdq_optuna.__version__
    assert f"## {qdq_optuna.__version__}" in (REPO / "CHANGELOG.md").read_text()
    assert '--8<-- "CHANGELOG.md"' in (REPO / "docs" / "changelog.md").read_text()


def test_every_config_field_has_a_docstring_the_api_page_renders():
    """``#:`` comments do not render in the API reference; a string after the field does."""
    import ast
    import dataclasses

    from qdq_optuna.config import Config

    tree = ast.parse((REPO / "qdq_optuna" / "config.py").read_text(encoding="utf-8"))
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Config").body
    documented = {a.target.id for a, doc in zip(body, body[1:])
                  if isinstance(a, ast.AnnAssign) and isinstance(doc, ast.Expr)
                  and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)}
    assert documented == {f.name for f in dataclasses.fields(Config)}


# --- install lines and runnable snippets --------------------------------------------------------

#: no package index has qdq-optuna: an install line names the checkout or a wheel built from it
_INSTALL_RE = re.compile(r"\bpip install ((?:\$\([^)]*\)|[^`\n&|;#)])+)")
_PIP_OPTIONS_WITH_VALUE = {"--extra-index-url", "--index-url", "-i", "-c", "-r", "--target"}


def _extras() -> set[str]:
    import tomllib

    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    return set(pyproject["project"]["optional-dependencies"])


def uninstallable(line: str, extras: set[str]) -> list[str]:
    """The package specs of ``line``'s ``pip install`` that a user of the checkout cannot
    install: ``qdq-optuna`` by name (from an index), or an extra the package does not have."""
    import shlex

    bad = []
    for match in _INSTALL_RE.finditer(line):
        spec = match.group(1).replace("$(echo ", "").replace(")[", "[")
        try:
            words = shlex.split(spec)
        except ValueError:  # a quote the line closes after the spec
            words = [w.strip("'\"") for w in spec.split()]
        skip = False
        for word in words:
            if skip or word.startswith("-"):
                skip = word in _PIP_OPTIONS_WITH_VALUE
                continue
            name, _, extra = word.partition("[")
            wanted = {e.strip() for e in extra.rstrip("]").split(",") if e.strip()}
            ours = name in (".", "-e") or re.fullmatch(r"dist/qdq_optuna-[^/]*\.whl", name)
            if re.fullmatch(r"qdq[-_]optuna", name, re.I):
                bad.append(f"{word} (no package index has qdq-optuna: install from the checkout)")
            elif ours and wanted - extras:
                bad.append(f"{word} (no extra {sorted(wanted - extras)[0]!r})")
    return bad


def test_the_install_check_finds_a_line_a_user_cannot_run():
    extras = _extras()
    assert uninstallable("pip install qdq-optuna scikit-image", extras)
    assert uninstallable("`pip install 'qdq-optuna[openvino]'`", extras)
    assert uninstallable('pip install "qdq_optuna[dashboard]"', extras)
    assert uninstallable('pip install ".[nosuch]"', extras) == [".[nosuch] (no extra 'nosuch')"]
    assert uninstallable('pip install "$(echo dist/qdq_optuna-*.whl)[nosuch]"', extras)
    for fine in ('pip install .', 'pip install -e ".[test]"', 'pip install ".[openvino,gp]"',
                 "pip install dist/qdq_optuna-*.whl", 'pip install "$(echo dist/qdq_optuna-*.whl)'
                 '[openvino]"', "pip install --force-reinstall --no-deps onnxruntime-gpu",
                 "pip install . scikit-image"):
        assert uninstallable(fine, extras) == [], fine


def test_every_install_line_installs_from_the_checkout():
    """Pages and README: each ``pip install`` a reader copies must work from what they have, a
    checkout or a wheel built from it."""
    extras = _extras()
    found, bad = 0, {}
    for source in _pages():
        for n, line in enumerate(source.read_text(encoding="utf-8").splitlines(), 1):
            found += len(_INSTALL_RE.findall(line))
            for spec in uninstallable(line, extras):
                bad.setdefault(f"{source.relative_to(REPO)}:{n}", []).append(spec)
    assert found >= 15
    assert bad == {}


def test_the_error_messages_name_extras_that_exist():
    """The package's own "needs ..." errors say how to add an extra through ``install_hint``."""
    extras, named, bad = _extras(), set(), {}
    for source in sorted((REPO / "qdq_optuna").rglob("*.py")):
        text = source.read_text(encoding="utf-8")
        named |= set(re.findall(r"install_hint\(['\"](\w+)['\"]\)", text))
        if re.search(r"qdq[-_]optuna\[|pip install ['\"]?qdq[-_]optuna", text, re.I):
            bad[str(source.relative_to(REPO))] = "installs qdq-optuna from an index"
    assert named >= {"dashboard", "openvino", "postgres", "gp"} and named <= extras
    assert bad == {}


#: a ``bash`` or ``python`` block right after this marker runs in the test below, as written,
#: in an empty folder with the package's ``qdq-optuna`` on PATH and the page's files in it
RUNNABLE = "<!-- runnable -->"
_RUNNABLE_RE = re.compile(rf"^{re.escape(RUNNABLE)}\n```(bash|python)\n(.*?)^```$", re.S | re.M)
#: a block after ``<!-- file: NAME -->`` is a file the page's runnable blocks read
_FILE_RE = re.compile(r"^<!-- file: ([\w.-]+) -->\n```\w*\n(.*?)^```$", re.S | re.M)


def runnable_snippets() -> list[tuple[str, str, str]]:
    return [(str(page.relative_to(REPO)), m.group(1), m.group(2)) for page in _pages()
            for m in _RUNNABLE_RE.finditer(page.read_text(encoding="utf-8"))]


def page_files(page: str) -> dict[str, str]:
    return dict(_FILE_RE.findall((REPO / page).read_text(encoding="utf-8")))


@pytest.mark.parametrize("page,language,snippet", runnable_snippets(),
                         ids=lambda v: str(v).splitlines()[0][:40] if v else "")
def test_each_runnable_snippet_runs_as_written(page, language, snippet, tmp_path):
    import subprocess
    import sys

    bin_dir = Path(sys.executable).parent
    if not (bin_dir / "qdq-optuna").exists():
        pytest.skip("the qdq-optuna command is not installed beside this Python")
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
           "QDQ_OPTUNA_KERNEL_CACHE": str(tmp_path / "kernels.json")}
    folder = tmp_path / "run"
    folder.mkdir()
    for name, text in page_files(page).items():
        (folder / name).write_text(text, encoding="utf-8")
    command = (["bash", "-euo", "pipefail", "-c", snippet] if language == "bash"
               else [sys.executable, "-c", snippet])
    done = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, f"{page}:\n{snippet}\n{done.stderr[-2000:]}"


def test_the_recipes_config_file_loads_with_the_config_loader(tmp_path):
    import yaml

    from qdq_optuna.config import Config

    files = {k: v for k, v in page_files("docs/recipes.md").items() if k.endswith(".yaml")}
    assert files, "the recipes page shows a --config file"
    for name, text in files.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
        config, written = Config.from_yaml(tmp_path / name), yaml.safe_load(text)
        assert written and {k: getattr(config, k) for k in written} == written


def test_some_snippets_are_marked_runnable():
    assert {language for _, language, _ in runnable_snippets()} == {"bash", "python"}
    assert len(runnable_snippets()) >= 3


# --- option choices in prose ---------------------------------------------------------------------

_CHOICES_RE = re.compile(r"(--[a-z][a-z-]*)[ =]([\w.:-]+(?:\\?\|[\w.:-]+)+)")


def parser_choices() -> dict[str, set[str]]:
    """Each option's choices as ``qdq-optuna COMMAND -h`` lists them (``--backend``: its named
    backends, which its help lists)."""
    import argparse

    from qdq_optuna.backends import BACKENDS
    from qdq_optuna.cli.commands import build_parser

    choices: dict[str, set[str]] = {"--backend": {n for n, s in BACKENDS.items() if s.label}}
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for command in sub.choices.values():
        for action in command._actions:
            if action.choices and not isinstance(action.choices, dict):
                for flag in action.option_strings:
                    choices.setdefault(flag, set(action.choices))
    return choices


def drifted_choices(text: str, choices: dict[str, set[str]]) -> list[str]:
    """``--option a|b|c`` spans whose values are not exactly the parser's choices (a
    ``package.module:function`` placeholder aside)."""
    bad = []
    for flag, values in _CHOICES_RE.findall(text):
        if flag not in choices:
            continue
        listed = {v for v in values.replace("\\|", "|").split("|") if ":" not in v}
        if listed != choices[flag]:
            bad.append(f"{flag} {values}: the parser has {'|'.join(sorted(choices[flag]))}")
    return bad


def test_the_choices_check_finds_a_missing_choice():
    choices = parser_choices()
    assert "openvino" in choices["--backend"] and "openvino" in choices["--runtime"]
    assert drifted_choices("`--runtime onnxruntime|tensorrt`", choices)
    assert drifted_choices("`--backend onnxruntime\\|ort-cuda\\|costmodel\\|pkg.module:fn`",
                           choices)
    assert not drifted_choices("`--runtime onnxruntime\\|tensorrt\\|openvino`", choices)


def test_every_listed_option_choice_is_the_parsers():
    choices, bad, found = parser_choices(), {}, 0
    for page in _pages():
        for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            found += len(_CHOICES_RE.findall(line))
            for drift in drifted_choices(line, choices):
                bad.setdefault(f"{page.relative_to(REPO)}:{n}", []).append(drift)
    assert found >= 10
    assert bad == {}


# --- report.json's keys --------------------------------------------------------------------------

def documented_report_keys(text: str) -> set[str]:
    """The top-level ``report.json`` keys outputs.md names: the first cell of each table row of
    its ``report.json`` section, and the keys its prose after the tables adds."""
    section = text[text.index("## `report.json`"):text.index("## `inspect --json`")]
    keys = set()
    for row in re.findall(r"^\| (`[^|]*`) \|", section, re.M):
        keys |= {re.split(r"[.\[]", k)[0] for k in re.findall(r"`([\w.\[\]]+)`", row)}
    prose = re.search(r"^Accuracy modes also add (.*?)\.", section, re.M | re.S).group(1)
    return keys | {k for k in re.findall(r"`(\w+)`", prose) if not k.startswith("latency")}


def test_the_report_key_check_finds_an_undocumented_key():
    page = ("## `report.json`\n\n| key | what |\n|---|---|\n| `model`, `run_id` | x |\n"
            "| `accuracy.bound` | y |\n\nAccuracy modes also add `objectives`; `--objectives "
            "latency,error` adds `pareto` (per point).\n\n## `inspect --json`\n")
    documented = documented_report_keys(page)
    assert documented == {"model", "run_id", "accuracy", "objectives", "pareto"}
    assert {"model", "speedup"} - documented == {"speedup"}


def test_outputs_page_lists_every_top_level_report_key(tmp_path):
    """A real report.json (a tiny model, the cost model under ONNX Runtime's rules, with
    validation data so the accuracy keys are there) against the page's key tables."""
    import numpy as np
    import onnx

    import qdq_optuna
    from qdq_optuna.examples import zoo

    onnx.save(zoo.tiny_residual(), tmp_path / "m.onnx")
    data = {"input": np.random.default_rng(0).random((4, 3, 16, 16), dtype=np.float32)}
    qdq_optuna.tune(tmp_path / "m.onnx", tmp_path / "out", backend="costmodel",
                    runtime="onnxruntime", progress=False, validation_data=data,
                    config=qdq_optuna.Config(schemes_per_region=3, refine_rounds=0))
    report = json.loads((tmp_path / "out" / "report.json").read_text(encoding="utf-8"))
    documented = documented_report_keys((REPO / "docs" / "outputs.md").read_text("utf-8"))
    assert len(report) >= 40
    assert sorted(set(report) - documented) == []
