"""``qdq-optuna`` as a user runs it: a subprocess, its exit status, stdout and stderr."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import onnx
import optuna
import pytest
import yaml

from qdq_optuna.examples import zoo
from qdq_optuna.record import run_attrs
from qdq_optuna.runtimes.prepared import PreparedModel

REPO = Path(__file__).resolve().parent.parent
ERROR = "qdq-optuna: error:"


def cli(*args: str, cwd: Path = REPO, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))}
    return subprocess.run([sys.executable, "-m", "qdq_optuna", *map(str, args)], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=timeout)


def assert_usage_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(ERROR), proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("models")
    paths = {}
    for name in ("tiny_residual", "tiny_concat"):
        paths[name] = d / f"{name}.onnx"
        onnx.save(zoo.build(name), str(paths[name]))
    # a model that already carries Q/DQ nodes
    pm = PreparedModel.prepare(str(paths["tiny_residual"]))
    pp = pm.tunable[0]
    exporter = pm.exporter()
    paths["quantized"] = d / "quantized.onnx"
    onnx.save(exporter.to_model(exporter.plan(pp.uses(pp.ids))), str(paths["quantized"]))
    paths["garbage"] = d / "garbage.onnx"
    paths["garbage"].write_bytes(bytes(range(256)) * 3)
    return paths


@pytest.fixture(scope="module")
def quick_run(models, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess, str]:
    """One quick costmodel run of tiny_residual; the model's hash before it."""
    out = tmp_path_factory.mktemp("cli") / "quick"
    before = sha256(models["tiny_residual"])
    proc = cli("tune", "--model", models["tiny_residual"], "--output", out,
               "--backend", "costmodel", "--mode", "quick", "--schemes-per-region", "4")
    return out, proc, before


# -- inspect ---------------------------------------------------------------------------------
def test_inspect_json_schema(models):
    proc = cli("inspect", models["tiny_residual"], "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert {"model", "runtime", "regions", "patterns"} <= set(doc)
    assert doc["regions"] and doc["patterns"]
    region_ids = {r["id"] for r in doc["regions"]}
    for r in doc["regions"]:
        assert {"id", "type", "level", "parent", "nodes"} <= set(r)
        assert isinstance(r["id"], int) and isinstance(r["level"], int)
        assert isinstance(r["type"], str) and isinstance(r["nodes"], list)
        assert r["parent"] is None or r["parent"] in region_ids
    for p in doc["patterns"]:
        assert {"id", "signature", "regions", "insertion_points"} <= set(p)
        assert set(p["regions"]) <= region_ids
        for pt in p["insertion_points"]:
            assert {"id", "kind", "resolved"} <= set(pt)
            assert {int(r) for r in pt["resolved"]} <= set(p["regions"])
            assert all(isinstance(t, list) for t in pt["resolved"].values())
    assert any(p["insertion_points"] for p in doc["patterns"])


def test_inspect_text_lists_patterns(models):
    proc = cli("inspect", models["tiny_residual"])
    assert proc.returncode == 0, proc.stderr
    assert "P000" in proc.stdout and "patterns" in proc.stdout


# -- bad inputs: one line, exit 2 -------------------------------------------------------------
BAD = {
    "missing file": (["inspect", "{tmp}/missing.onnx"], "missing.onnx"),
    "garbage bytes": (["inspect", "{garbage}"], "garbage.onnx"),
    "bad input shapes": (["inspect", "{model}", "--input-shapes", "input:1xx3"], "--input-shapes"),
    "shapes without name": (["inspect", "{model}", "--input-shapes", "1x3x32x32"],
                            "--input-shapes"),
    "already quantized": (["inspect", "{quantized}"], "quantized.onnx"),
    "unknown flag": (["tune", "--model", "{model}", "--output", "{tmp}/o", "--bogus"],
                     "--bogus"),
    "unknown sampler": (["tune", "--model", "{model}", "--output", "{tmp}/o", "--sampler",
                         "annealing"], "annealing"),
    "tune missing model": (["tune", "--model", "{tmp}/missing.onnx", "--output", "{tmp}/o",
                            "--backend", "costmodel"], "missing.onnx"),
    "unknown backend": (["tune", "--model", "{model}", "--output", "{tmp}/o", "--backend",
                         "warp-drive"], "warp-drive"),
    "negative refine rounds": (["tune", "--model", "{model}", "--output", "{tmp}/o",
                                "--refine-rounds", "-1"], "--refine-rounds"),
    "a mode the runtime lacks": (["tune", "--model", "{model}", "--output", "{tmp}/o",
                                  "--backend", "costmodel", "--modes", "dynamic"],
                                 "tensorrt offers no dynamic mode"),
    "unknown mode": (["tune", "--model", "{model}", "--output", "{tmp}/o", "--modes",
                      "static,int4"], "--modes: unknown mode 'int4'"),
    "a weight-only mode the runtime lacks": (
        ["tune", "--model", "{model}", "--output", "{tmp}/o", "--backend", "costmodel",
         "--modes", "static,weight_int4"], "tensorrt offers no weight_int4 mode"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_one_line_exit_2(case, models, tmp_path):
    argv, needle = BAD[case]
    fill = {"tmp": tmp_path, "model": models["tiny_residual"], "garbage": models["garbage"],
            "quantized": models["quantized"]}
    proc = cli(*[a.format(**fill) for a in argv])
    assert_usage_error(proc, needle)
    assert not (tmp_path / "o" / "optimized.onnx").exists()


# -- tune ------------------------------------------------------------------------------------
def test_tune_leaves_the_model_unchanged(quick_run, models):
    out, proc, before = quick_run
    assert proc.returncode == 0, proc.stderr
    assert sha256(models["tiny_residual"]) == before
    assert "speedup" in proc.stdout and "optimized.onnx" in proc.stdout
    report = json.loads((out / "report.json").read_text())
    assert report["complete"] and report["backend"]["name"] == "costmodel"
    onnx.checker.check_model(onnx.load(str(out / "optimized.onnx")))


def test_search_options_reach_the_run(models, tmp_path):
    out = tmp_path / "o"
    proc = cli("tune", "--model", models["tiny_residual"], "--output", out, "--backend",
               "costmodel", "--schemes-per-region", "3", "--refine-rounds", "2",
               "--converged-patience", "0", "-q")
    assert proc.returncode == 0, proc.stderr
    storage = f"sqlite:///{out / 'studies.db'}"
    settings = run_attrs(optuna.load_study(study_name="o/_run", storage=storage))["settings"]
    assert settings["config"]["refine_rounds"] == 2
    assert settings["config"]["converged_patience"] == 0
    assert settings["config"]["schemes_per_region"] == 3


def test_output_must_not_be_the_model(models):
    proc = cli("tune", "--model", models["tiny_residual"], "--output", models["tiny_residual"],
               "--backend", "costmodel")
    assert_usage_error(proc, "--output")


# -- warm-start inputs that must be refused ----------------------------------------------------
def test_pattern_cache_with_python_tag_is_refused(models, tmp_path):
    marker = tmp_path / "pwned"
    cache = tmp_path / "evil.yaml"
    cache.write_text(f'version: 1\npatterns: !!python/object/apply:os.system ["touch {marker}"]\n')
    proc = cli("tune", "--model", models["tiny_residual"], "--output", tmp_path / "o",
               "--backend", "costmodel", "--schemes-per-region", "4", "--pattern-cache", cache,
               "-q")
    assert_usage_error(proc, "--pattern-cache")
    assert not marker.exists(), "the YAML tag was executed"


def test_pattern_cache_of_another_model_is_refused(quick_run, models, tmp_path):
    out, proc, _ = quick_run
    assert proc.returncode == 0, proc.stderr
    cache = out / "pattern_cache.yaml"
    assert yaml.safe_load(cache.read_text())["patterns"]
    proc = cli("tune", "--model", models["tiny_concat"], "--output", tmp_path / "other",
               "--backend", "costmodel", "--schemes-per-region", "4", "--pattern-cache", cache,
               "-q")
    assert_usage_error(proc, "--pattern-cache", "another model")
    assert not (tmp_path / "other" / "optimized.onnx").exists()


def test_malformed_pattern_cache_is_refused(models, tmp_path):
    cache = tmp_path / "bad.yaml"
    cache.write_text("version: 1\npatterns:\n  abc: [1, 2]\n")
    proc = cli("tune", "--model", models["tiny_residual"], "--output", tmp_path / "o",
               "--backend", "costmodel", "--pattern-cache", cache, "-q")
    assert_usage_error(proc, "--pattern-cache")


def test_callable_backend_by_module_path(models, tmp_path):
    out = tmp_path / "fn"
    proc = cli("tune", "--model", models["tiny_residual"], "--output", out,
               "--backend", "tests._latency_fns:rewards_groups", "--runtime", "onnxruntime", "--timing", "fast",
               "--schemes-per-region", "4", "-q")
    assert proc.returncode == 0, proc.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["backend"]["callable"] == "tests._latency_fns:rewards_groups"
    assert report["speedup"] > 1.0


# -- the log ------------------------------------------------------------------------------------
def test_a_log_has_whole_lines_and_each_warning_once(quick_run):
    """Piped to a file there is no width: no line is cut, and no warning repeats."""
    _, proc, _ = quick_run
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert "…" not in proc.stderr
    for line in lines:
        assert line.count("(") == line.count(")"), line
    warnings = [line for line in lines if ": WARNING: " in line]
    assert warnings and len(warnings) == len(set(warnings)), warnings


def test_a_repeated_warning_is_said_once(capsys):
    import logging

    from qdq_optuna.cli.commands import _setup_logging

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        for h in handlers:
            root.removeHandler(h)
        _setup_logging(0)
        log = logging.getLogger("qdq_optuna")
        for _ in range(3):
            log.warning("no --calibration-data: calibrating on random inputs")
        log.warning("another warning")
        log.error("an error")
        log.error("an error")
    finally:
        for h in list(root.handlers):
            root.removeHandler(h)
        for h in handlers:
            root.addHandler(h)
        root.setLevel(level)
    err = capsys.readouterr().err.splitlines()
    assert err.count("qdq-optuna: WARNING: no --calibration-data: calibrating on random "
                     "inputs") == 1
    assert "qdq-optuna: WARNING: another warning" in err
    assert err.count("qdq-optuna: ERROR: an error") == 2


def test_a_run_cut_by_its_timeout_says_so_on_the_console(tmp_path):
    """A ``--timeout`` run that ends before its descent did says so in one line (and how to
    resume); the same run without a timeout, resumed from the stored studies, does not."""
    model = tmp_path / "m.onnx"
    onnx.save(zoo.build("tiny_residual"), model)
    args = ("tune", "-m", model, "-o", tmp_path / "out", "-b", "costmodel", "-n", "2",
            "--refine-rounds", "0")
    proc = cli(*args, "--timeout", "0.001", "-q")
    assert proc.returncode == 0, proc.stderr
    cut = [line for line in proc.stderr.splitlines() if "cut the run short" in line]
    assert len(cut) == 1, proc.stderr
    assert "--timeout 0.001s" in cut[0] and "rerun the same command to resume" in cut[0]
    assert json.loads((tmp_path / "out" / "report.json").read_text())["complete"] is False
    resumed = cli(*args)
    assert resumed.returncode == 0, resumed.stderr
    assert "cut the run short" not in resumed.stderr + resumed.stdout
    assert json.loads((tmp_path / "out" / "report.json").read_text())["complete"] is True
