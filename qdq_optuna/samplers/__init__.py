"""Samplers that ship with qdq_optuna.

``qdq_mutation`` is the repository's OptunaHub package ``samplers/qdq_mutation`` (kept there in
the hub's layout); the wheel installs it here. In a source checkout that is not installed it is
found in place, so ``qdq_optuna.samplers.qdq_mutation`` imports the same code either way.
"""

from pathlib import Path

_here = Path(__file__).resolve().parent
_checkout = _here.parents[1] / "samplers"
if not (_here / "qdq_mutation").is_dir() and (_checkout / "qdq_mutation" / "_sampler.py").is_file():
    __path__.append(str(_checkout))  # noqa: F821 (a package's own __path__)
