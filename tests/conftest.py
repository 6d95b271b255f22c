"""Shared test setup.

* ONNX Runtime's warnings (unused initializers, fallbacks) are silenced for the whole run.
* ``zoo_model(name)`` builds a zoo model once per session (``"small"`` size for the four
  example models, tiny models as is) and hands each test its own copy.
* ``analyzed(name, rules)`` runs load -> regions -> patterns -> points on a zoo model once per
  session (see ``strategies.analyze``).

Hypothesis strategies for random ONNX DAGs live in ``tests/strategies.py``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import onnx
import onnxruntime as ort
import pytest

ort.set_default_logger_severity(3)


@pytest.fixture(scope="session")
def zoo_model():
    from qdq_optuna.examples import zoo

    cache: dict[str, onnx.ModelProto] = {}

    def get(name: str) -> onnx.ModelProto:
        if name not in cache:
            cache[name] = zoo.build(name, "small")
        copy = onnx.ModelProto()
        copy.CopyFrom(cache[name])
        return copy

    return get


@pytest.fixture(scope="session")
def analyzed(zoo_model):
    from strategies import analyze

    cache: dict = {}

    def get(name: str, rules):
        key = (name, rules.name)
        if key not in cache:
            cache[key] = analyze(zoo_model(name), rules)
        return cache[key]

    return get


@pytest.fixture(scope="module")
def residual(tmp_path_factory):
    """tiny_residual saved as a file, one per test module (tests check it stays unchanged)."""
    from qdq_optuna.examples import zoo

    path = tmp_path_factory.mktemp("model") / "tiny_residual.onnx"
    onnx.save(zoo.build("tiny_residual"), str(path))
    return path


@pytest.fixture(scope="module")
def hooks():
    """The docs site's build hooks (docs/hooks.py), for the tests of what they render."""
    pytest.importorskip("mkdocs")
    path = Path(__file__).resolve().parent.parent / "docs" / "hooks.py"
    spec = importlib.util.spec_from_file_location("docs_hooks", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
