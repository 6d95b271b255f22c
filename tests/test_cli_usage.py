"""The command line's surface: usage, help, -v/-q everywhere, short flags, defaults."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import onnx
import pytest

from qdq_optuna import __version__
from qdq_optuna.cli.commands import DEFAULT_OUTPUT, build_parser, main
from qdq_optuna.examples import zoo

REPO = Path(__file__).resolve().parent.parent
COMMANDS = ("tune", "inspect", "dashboard", "example", "bench")
MINIMAL = {"tune": ["-m", "m.onnx"], "inspect": ["m.onnx"], "dashboard": ["out"],
           "example": ["resnet", "m.onnx"], "bench": ["smoke"]}


def run(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))}
    return subprocess.run([sys.executable, "-m", "qdq_optuna", *map(str, args)], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=120)


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("m") / "tiny_residual.onnx"
    onnx.save(zoo.build("tiny_residual"), str(path))
    return path


def test_bare_command_prints_usage_and_exits_2():
    proc = run()
    assert proc.returncode == 2
    assert proc.stderr.startswith("usage: qdq-optuna")
    for command in COMMANDS:
        assert command in proc.stderr


def test_version():
    proc = run("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"qdq-optuna {__version__}"


@pytest.mark.parametrize("command", COMMANDS)
def test_verbosity_on_every_command_before_and_after_it(command):
    parser = build_parser()
    rest = MINIMAL[command]
    assert parser.parse_args([command, *rest]).verbose == 0
    assert parser.parse_args(["-v", command, *rest]).verbose == 1
    assert parser.parse_args([command, *rest, "-v"]).verbose == 1
    assert parser.parse_args([command, "-vv", *rest]).verbose == 2
    assert parser.parse_args(["-q", command, *rest]).quiet
    assert parser.parse_args([command, *rest, "--quiet"]).quiet
    assert not parser.parse_args([command, *rest]).quiet


def test_rerun_with_v_shows_the_traceback(model, monkeypatch, capsys):
    """The internal-error hint is not a dead end: -v (anywhere) gives the traceback."""
    from qdq_optuna.runtimes import prepared as model_module

    def broken(*args, **kwargs):
        raise RuntimeError("something internal")

    monkeypatch.setattr(model_module.PreparedModel, "prepare", broken)
    assert main(["inspect", str(model)]) == 1
    err = capsys.readouterr().err
    assert err.strip() == ("qdq-optuna: internal error: RuntimeError: something internal "
                           "(rerun with -v for the traceback)")
    for argv in (["-v", "inspect", str(model)], ["inspect", str(model), "-v"]):
        with pytest.raises(RuntimeError, match="something internal"):
            main(argv)


def test_an_internal_error_keeps_its_traceback_in_the_output_folder(model, monkeypatch,
                                                                   capsys, tmp_path):
    """An error a rerun may not repeat (a storage commit after a kill) can still be read:
    its traceback, the cause behind it included, is written into the run's output folder
    and the one line says where."""
    from qdq_optuna._files import TRACEBACK_FILE
    from qdq_optuna.runtimes import prepared as model_module

    def broken(*args, **kwargs):
        try:
            raise ValueError("the cause underneath")
        except ValueError as cause:
            raise RuntimeError("something internal") from cause

    monkeypatch.setattr(model_module.PreparedModel, "prepare", broken)
    out = tmp_path / "run"
    out.mkdir()
    assert main(["tune", "-m", str(model), "-o", str(out), "-q"]) == 1
    err = capsys.readouterr().err.strip()
    kept = out / TRACEBACK_FILE
    assert err == ("qdq-optuna: internal error: RuntimeError: something internal "
                   f"(its traceback is in {kept})")
    text = kept.read_text()
    assert "Traceback" in text and "ValueError: the cause underneath" in text
    assert "RuntimeError: something internal" in text


def test_tune_help_is_grouped_with_help_for_every_option():
    parser = build_parser()
    tune = _subparsers(parser)["tune"]
    titles = {g.title for g in tune._action_groups}
    assert {"model", "search", "measurement", "accuracy", "storage and workers",
            "output"} <= titles
    for action in tune._actions:
        assert action.help, action.option_strings
    text = tune.format_help()
    assert "examples:" in text and "qdq-optuna tune -m model.onnx" in text
    assert len(text.splitlines()[0]) < 80  # a short usage line, not every option


def test_no_rst_markup_in_help():
    parser = build_parser()
    for p in [parser, *_subparsers(parser).values()]:
        text = p.format_help()
        assert "``" not in text and ":func:" not in text, p.prog


def test_short_flags_and_output_default():
    parser = build_parser()
    args = parser.parse_args(["tune", "-m", "m.onnx", "-b", "costmodel", "-s", "tpe", "-n", "4"])
    assert (args.model, args.backend, args.sampler, args.schemes_per_region) == \
        ("m.onnx", "costmodel", "tpe", 4)
    assert args.output_dir == DEFAULT_OUTPUT == "qdq_optuna_output"
    assert parser.parse_args(["tune", "-m", "m", "-o", "out"]).output_dir == "out"
    assert parser.parse_args(["bench", "smoke", "-o", "x"]).output == "x"
    assert parser.parse_args(["dashboard", "out", "-p", "0"]).port == 0


def test_node_filter_options_parse_like_quantize_static_lists():
    parser = build_parser()
    args = parser.parse_args(["tune", "-m", "m", "--exclude-nodes", "a/b", ".*head.*",
                              "--op-types", "Conv,MatMul", "--exclude-nodes", "c"])
    assert args.exclude_nodes == ["a/b", ".*head.*", "c"]
    assert args.op_types == ["Conv,MatMul"]  # split (and checked) by NodeFilter.parse


def test_inspect_honours_the_node_filter(model):
    excluded = "layer1.0/conv1"
    proc = run("inspect", model, "--json", "--exclude-nodes", excluded, "-q")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    consumers = {u[1] for p in doc["patterns"] for pt in p["insertion_points"]
                 for uses in pt["uses"].values() for u in uses}
    assert consumers and excluded not in consumers
    free = json.loads(run("inspect", model, "--json").stdout)
    assert excluded in {u[1] for p in free["patterns"] for pt in p["insertion_points"]
                        for uses in pt["uses"].values() for u in uses}
    bad = run("inspect", model, "--op-types", "Konv")
    assert bad.returncode == 2
    assert bad.stderr.strip() == ("qdq-optuna: error: --op-types: 'Konv' is not an ONNX op "
                                  "type (did you mean Conv?)")


def test_python_warnings_are_one_log_line(model, tmp_path):
    """A warning raised while a command runs is one ``qdq-optuna: WARNING:`` line."""
    (tmp_path / "warny_backend_xyz.py").write_text(
        "import warnings\n"
        "def fn(model):\n"
        "    warnings.warn('the device runs slow today')\n"
        "    return 1.0\n")
    env_path = os.pathsep.join([str(tmp_path), str(REPO)])
    proc = subprocess.run(
        [sys.executable, "-m", "qdq_optuna", "tune", "-m", str(model), "-o", str(tmp_path / "o"),
         "-b", "warny_backend_xyz:fn", "--runtime", "onnxruntime", "-n", "2", "--refine-rounds", "0", "-q"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": env_path}, capture_output=True, text=True,
        timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "slow today" in line]
    assert lines and set(lines) == {"qdq-optuna: WARNING: UserWarning: the device runs slow "
                                    "today (warny_backend_xyz.py:3)"}, proc.stderr
    assert "warnings.warn(" not in proc.stderr  # no source line echoed below it


def test_each_tune_option_is_defined_once_on_its_field():
    """Every TuneOptions field with a group is one tune flag (its dest the field's name, its
    default the field's), and the parsed flags reach TuneOptions through the routing the command
    uses (``options_from``)."""
    import dataclasses

    from qdq_optuna._tune import options_from
    from qdq_optuna.search import TuneOptions

    tune = _subparsers(build_parser())["tune"]
    dests = {a.dest: a for a in tune._actions}
    fields = {f.name: f for f in dataclasses.fields(TuneOptions)}
    flagged = {n for n, f in fields.items() if f.metadata.get("group")}
    assert flagged <= set(dests) and {"model", "sampler", "isolate", "op_types"} <= flagged
    for name in flagged - {"model", "output_dir"}:
        assert dests[name].default == fields[name].default, name
        assert dests[name].help == fields[name].metadata["help"], name
    args = build_parser().parse_args(["tune", "-m", "m.onnx", "--no-isolate", "--seed", "3",
                                      "--op-types", "Conv", "MatMul", "--worker"])
    keywords = {k: v for k, v in vars(args).items() if k != "command"}  # as cmd_tune passes
    opts = options_from(keywords.pop("model"), keywords.pop("output_dir"), **keywords)
    assert (opts.isolate, opts.seed, opts.op_types, opts.worker) == (False, 3, ["Conv", "MatMul"],
                                                                     True)


def test_every_config_flag_comes_from_its_field_and_reaches_the_config():
    """Each Config field defined with ``flag()`` is a ``tune`` flag whose value, given, is
    the run's setting (the flags are not written by hand a second time)."""
    import dataclasses

    from qdq_optuna.cli.commands import _config_from
    from qdq_optuna.config import Config

    flagged = [f for f in dataclasses.fields(Config) if "flag_help" in f.metadata]
    assert {f.name for f in flagged} >= {"schemes_per_region", "start", "refine_rounds"}
    parser = build_parser()
    for f in flagged:
        value = f.metadata["choices"][-1] if f.metadata["choices"] else "7"
        args = parser.parse_args(["tune", "-m", "m.onnx", "--" + f.name.replace("_", "-"), value])
        got = getattr(_config_from(args), f.name)
        assert str(got) in (value, "7.0"), f.name
        assert got != f.default


def test_mode_with_a_config_file_keeps_the_presets_budget(tmp_path):
    """``--config`` sets what the file changes and ``--mode`` the rest of the budget, as
    ``tune(mode=..., config=...)`` does (a file's unchanged fields used to undo the preset)."""
    from qdq_optuna import Config
    from qdq_optuna._tune import _config
    from qdq_optuna.cli.commands import _config_from

    path = tmp_path / "c.yaml"
    path.write_text("refine_rounds: 1\n")
    args = build_parser().parse_args(["tune", "-m", "m.onnx", "--mode", "quick",
                                      "--config", str(path)])
    got = _config_from(args)
    assert got.schemes_per_region == Config.preset("quick").schemes_per_region != 30
    assert got.refine_rounds == 1
    assert got == _config(Config(refine_rounds=1), "quick")


def _changed_value(action: argparse.Action) -> list[str]:
    """Command-line words that give ``action`` a value other than its default."""
    flag = action.option_strings[-1]
    if isinstance(action, argparse.BooleanOptionalAction):
        return [next(s for s in action.option_strings if s.startswith("--no-"))]
    if action.nargs == 0:  # store_true, count
        return [flag]
    if action.choices:
        return [flag, next(str(c) for c in reversed(list(action.choices)) if c != action.default)]
    examples = {"objectives": "latency,error", "input_shapes": "x:1x3x8x8",
                "metric": "my_metrics:score", "backend": "costmodel",
                "accuracy_confidence": "0.9"}
    value = examples.get(action.dest, "7" if action.type is not None else "other")
    return [flag, value]


#: options valid only beside another (``--max-metric-drop`` needs ``--metric``)
_COMPANIONS = {"max_metric_drop": {"metric": "my_metrics:score"},
               "metric_drop_type": {"metric": "my_metrics:score", "max_metric_drop": 0.1}}


def test_tune_takes_every_option_of_the_tune_command_as_a_keyword(tmp_path):
    """Generated from the parser: for each option of ``qdq-optuna tune``, its parsed value
    given to ``tune()`` as the keyword of its dest changes the run's options (routed where
    the CLI routes it: a TuneOptions field, a Config field, progress); nothing is run."""
    from qdq_optuna._tune import options_from

    (tmp_path / "c.yaml").write_text("refine_rounds: 1\n")
    parser = build_parser()
    tune = _subparsers(parser)["tune"]
    checked = set()
    for action in tune._actions:
        if isinstance(action, argparse._HelpAction) or action.dest in ("model", "output_dir"):
            continue
        words = (["--config", str(tmp_path / "c.yaml")] if action.dest == "config"
                 else _changed_value(action))
        args = vars(parser.parse_args(["tune", "-m", "m.onnx", *words]))
        value = args[action.dest]
        companions = _COMPANIONS.get(action.dest, {})
        changed = options_from("m.onnx", "out", **companions, **{action.dest: value})
        assert changed != options_from("m.onnx", "out", **companions), action.dest
        checked.add(action.dest)
    assert {"refine_rounds", "sampler", "seed", "timeout", "pattern_cache", "qdq_baseline",
            "mode", "config", "quiet", "verbose", "input_shapes"} <= checked


def test_tune_names_an_unknown_keyword_in_one_line(tmp_path):
    """``tune()`` with a misspelt keyword: an OptionError naming it, before anything runs
    (``refine_rounds`` beside it is taken)."""
    from qdq_optuna import OptionError, tune

    with pytest.raises(OptionError, match="unknown keyword 'refine_round'") as caught:
        tune(zoo.build("tiny_chain"), tmp_path / "out", refine_rounds=0, refine_round=1)
    assert "\n" not in str(caught.value)
    assert not (tmp_path / "out").exists()
