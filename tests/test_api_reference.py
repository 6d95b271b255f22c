"""The Python API page: generated from the code, rendered without raw source or internals.

Why: mkdocstrings shows a dataclass field's default as the source that builds it
(``option(group='model', ...)``, f-strings); the fields' table is generated from the metadata
the command line is built from, and the page is checked as built.
"""

from __future__ import annotations

import dataclasses
import html
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

if os.environ.get("QDQ_OPTUNA_TEST_INSTALLED") == "1":  # the suite copied beside a wheel
    pytest.skip("checks the source tree: run from the checkout", allow_module_level=True)


@pytest.mark.parametrize("dotted", ["qdq_optuna.search.TuneOptions", "qdq_optuna.config.Config"])
def test_the_fields_table_has_every_field_with_its_default_and_flag(hooks, dotted):
    import importlib

    from qdq_optuna.config import field_flags

    module, _, name = dotted.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    rows = {r.split("|")[1].strip(" `"): r for r in hooks.fields_reference(dotted).splitlines()[2:]}
    fields = dataclasses.fields(cls)
    assert set(rows) == {f.name for f in fields}
    for f in fields:
        row = rows[f.name]
        for flag in field_flags(f):
            assert f"`{flag}`" in row, f.name
        if f.default is not dataclasses.MISSING:
            assert f"<code>{html.escape(repr(f.default), quote=False)}</code>" in row, f.name
        assert row.count("|") - row.count("\\|") == 6, f.name  # five cells, none split
    assert "<code>30</code>" in rows.get("schemes_per_region", "<code>30</code>")


def _text(page: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", page))


def test_the_built_api_page_shows_no_source_and_no_internals(tmp_path):
    """``mkdocs build --strict``, then the API page's text: no field rendered as the source
    that builds it, ``tune()`` and ``Autotuner`` with their parameters, no internal method."""
    pytest.importorskip("mkdocstrings")
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                           str(site)], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    page = (site / "api" / "index.html").read_text(encoding="utf-8")
    text = _text(page)
    for raw in ("option(", "flag(", 'f"', "f'", "field(", "default_factory"):
        assert raw not in text, raw
    ids = set(re.findall(r'id="(qdq_optuna\.[\w.]+)"', page))
    for internal in ("agree", "claim", "settle_fingerprint", "check_layout", "to_attrs",
                     "from_attrs", "materialize", "run_scales"):
        assert not [i for i in ids if i.endswith("." + internal)], internal
    assert {"qdq_optuna._tune.tune", "qdq_optuna.search.autotuner.Autotuner.export_final",
            "qdq_optuna.record.RunRecord.visits"} <= ids
    tune = text[text.index("tune(\n"):text.index("TuneOptions", text.index("tune(\n") + 500)]
    assert "Parameters:" in tune and "refine_rounds=" in tune
    autotuner = text[text.index("Autotuner(\n"):]
    assert "calibration_data" in autotuner.split("Parameters:")[1][:4000]
    assert "--refine-rounds" in text and "--pattern-cache" in text  # the fields' tables
