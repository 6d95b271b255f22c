"""What an installed qdq-optuna holds and how it behaves outside a checkout.

With ``QDQ_OPTUNA_TEST_INSTALLED=1`` (set by ``.ci/run``, which runs the suite against the
installed wheel) the package must come from site-packages and the wheel's files are checked.
"""

from __future__ import annotations

import importlib.metadata
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import qdq_optuna
from qdq_optuna._files import atomic_write_bytes
from qdq_optuna.cli import bench

INSTALLED = os.environ.get("QDQ_OPTUNA_TEST_INSTALLED") == "1"
CHECKOUT = Path(__file__).resolve().parent.parent


def test_our_sampler_does_not_depend_on_a_top_level_samplers_package(tmp_path):
    """A user project with its own ``samplers`` package on the path keeps our default sampler."""
    (tmp_path / "samplers").mkdir()
    (tmp_path / "samplers" / "__init__.py").write_text("USER = True\n")
    code = textwrap.dedent("""
        import samplers
        from qdq_optuna.config import Config
        from qdq_optuna.search.samplers import make_sampler
        from qdq_optuna.samplers.qdq_mutation import QDQMutationSampler
        assert samplers.USER
        s = make_sampler("qdq", seed=0, config=Config())
        assert isinstance(s, QDQMutationSampler), type(s)
        print(type(s).__module__)
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "qdq_optuna.samplers.qdq_mutation._sampler"


def test_the_optunahub_package_is_the_installed_sampler():
    """``samplers/qdq_mutation`` of the repository is the code the package runs (one copy)."""
    hub = CHECKOUT / "samplers" / "qdq_mutation" / "_sampler.py"
    if not hub.is_file():
        pytest.skip("no checkout beside the tests")
    from qdq_optuna.samplers.qdq_mutation import _sampler

    assert Path(_sampler.__file__).read_bytes() == hub.read_bytes()


def test_recipes_ship_by_name():
    names = bench.recipe_names()
    assert {"smoke", "sampler_comparison", "sampler_comparison_ort"} <= set(names)
    studies = CHECKOUT / "studies"
    if studies.is_dir():  # every recipe of the repository is shipped
        assert set(names) == {p.stem for p in studies.glob("*.yaml")}
    assert bench.find_recipe("smoke") == bench.find_recipe("smoke.yaml") == \
        bench.recipe_dir() / "smoke.yaml"
    with pytest.raises(bench.UserError, match="nosuch: no such recipe file, and not a shipped "
                                              "recipe .*smoke"):
        bench.find_recipe("nosuch")


def test_recipe_paths_keep_working(tmp_path):
    p = tmp_path / "smoke.yaml"  # a user's own recipe named like a shipped one wins by path
    p.write_text("name: mine\nmodels: [tiny_concat]\nsamplers: [qdq]\nseeds: 1\nbudgets: [2]\n")
    assert bench.load_recipe(p).name == "mine"
    assert bench.load_recipe(str(p)).name == "mine"
    with pytest.raises(bench.UserError, match="cannot read the recipe"):
        bench.load_recipe(tmp_path / "missing" / "r.yaml")


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_written_files_follow_the_umask(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        path = atomic_write_bytes(tmp_path / "sub" / "f.json", b"{}")
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == mode


def test_an_existing_file_keeps_its_mode(tmp_path):
    path = tmp_path / "report.md"
    path.write_text("old")
    path.chmod(0o640)
    atomic_write_bytes(path, b"new")
    assert path.read_bytes() == b"new" and stat.S_IMODE(path.stat().st_mode) == 0o640


@pytest.mark.skipif(not INSTALLED, reason="checks the installed wheel (QDQ_OPTUNA_TEST_INSTALLED=1)")
def test_the_installed_wheel():
    package = Path(qdq_optuna.__file__).resolve().parent
    assert "site-packages" in package.parts, package  # not the checkout's qdq_optuna/
    files = {str(f) for f in importlib.metadata.files("qdq-optuna")}
    assert not [f for f in files if f.startswith("samplers/")], "a top-level samplers package"
    assert not [f for f in files if "/tests/" in f], "tests in the wheel"
    for f in ("qdq_optuna/samplers/qdq_mutation/_sampler.py",
              "qdq_optuna/samplers/qdq_mutation/LICENSE", "qdq_optuna/studies/smoke.yaml"):
        assert f in files, f
    licenses = [f for f in files if "/licenses/" in f]
    assert any(f.endswith("licenses/LICENSE") for f in licenses), licenses
    meta = importlib.metadata.metadata("qdq-optuna")
    assert meta["License-Expression"] == "Apache-2.0 AND MIT"
    assert "onnx-graphsurgeon" not in " ".join(meta.get_all("Requires-Dist") or [])
    assert qdq_optuna.__version__ == importlib.metadata.version("qdq-optuna")


def test_the_gp_extra_runs_the_gp_sampler(tmp_path):
    """``pip install qdq-optuna[gp]`` brings torch; then --sampler gp tunes (skipped without
    torch, where tests/test_search.py checks the clear error instead)."""
    pytest.importorskip("torch")
    from qdq_optuna import Config, tune
    from qdq_optuna.examples import zoo

    model = tmp_path / "m.onnx"
    model.write_bytes(zoo.build("tiny_residual").SerializeToString())
    result = tune(model, tmp_path / "gp", benchmark="costmodel", sampler="gp",
                  config=Config(schemes_per_region=4, refine_rounds=0), progress=False)
    assert result.report["sampler"] == "gp" and result.report["complete"]
    assert all(p["trials"] >= 1 for p in result.report["patterns"])
