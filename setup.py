"""The package list (pyproject.toml holds everything else).

Two folders keep their place in the repository and are installed inside the package, so the
wheel puts nothing at the top level but ``qdq_optuna``:

* ``samplers/qdq_mutation`` (an OptunaHub package, loadable with
  ``optunahub.load_local_module``) becomes ``qdq_optuna.samplers.qdq_mutation``; its tests
  stay out of the wheel;
* ``studies/*.yaml`` (the ``qdq-optuna bench`` recipes) becomes ``qdq_optuna/studies/``.
"""

from setuptools import find_packages, setup

MAPPED = {
    "qdq_optuna.samplers.qdq_mutation": "samplers/qdq_mutation",
    "qdq_optuna.studies": "studies",
}

setup(packages=find_packages(include=["qdq_optuna", "qdq_optuna.*"]) + list(MAPPED),
      package_dir=MAPPED)
