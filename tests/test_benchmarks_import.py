"""Every benchmark script imports: a script that no test touches rots when the package moves.

Why: the benchmarks are not part of the package and run rarely (they need a quiet machine);
importing each one checks its imports of the package and its helper module without running it.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = sorted(p.stem for p in (REPO / "benchmarks").glob("*.py"))

if os.environ.get("QDQ_OPTUNA_TEST_INSTALLED") == "1":  # the suite copied beside a wheel
    pytest.skip("imports the checkout's benchmarks/: run from the checkout", allow_module_level=True)


def test_there_are_benchmarks():
    assert len(SCRIPTS) >= 20


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_script_imports(name, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    monkeypatch.setattr(sys, "argv", [f"{name}.py", "--help"])  # a script must not run on import
    sys.modules.pop(name, None)
    module = importlib.import_module(name)
    assert module.__file__ == str(REPO / "benchmarks" / f"{name}.py")
    if name != "_common":
        assert callable(getattr(module, "main", None)), f"benchmarks/{name}.py has no main()"
