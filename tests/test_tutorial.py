"""The tutorial page runs: its ``python`` blocks, in order, on the photographs scikit-image ships.

Why: a tutorial whose code drifts from the API fails the first reader who copies it. The page's
first block (the settings: model file, size, budget) is replaced by a generated YOLO-style model
so nothing is downloaded; every other ``python`` block runs as written (``py`` blocks are
deployment snippets for other runtimes and are not run here). Also ``tune(mode=...)``, the
Python spelling of ``--mode`` the tutorial uses.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import onnx
import pytest

import qdq_optuna
from qdq_optuna._tune import _config
from qdq_optuna.config import Config
from qdq_optuna.errors import OptionError
from qdq_optuna.examples import zoo

REPO = Path(__file__).resolve().parent.parent
PAGE = REPO / "docs" / "tutorial.md"

def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", text, re.S | re.M)


def test_the_tutorial_runs_on_the_bundled_photos(tmp_path, monkeypatch):
    if os.environ.get("QDQ_OPTUNA_TEST_INSTALLED") == "1":
        pytest.skip("runs the docs of the source tree: CI runs it from the checkout")
    pytest.importorskip("skimage")
    blocks = python_blocks(PAGE.read_text(encoding="utf-8"))
    assert "MODEL =" in blocks[0] and "TUNE =" in blocks[0], "the first block is the settings"
    model = tmp_path / "yolo.onnx"
    onnx.save(zoo.yolo_like(image=64, width=8, num_classes=4), model)
    # the cost model under ONNX Runtime's rules, one pass of 3 trials a visit: deterministic
    # and short on 2 cores (the measured backends and the full search have their own tests);
    # the errors and the held-out outputs are still computed in ONNX Runtime
    settings = (f"MODEL = {str(model)!r}\nSIZE = 64\nTUNE = {{'backend': 'costmodel', "
                "'runtime': 'onnxruntime', 'progress': False, "
                "'config': qdq_optuna.Config(schemes_per_region=3, refine_rounds=0)}\n")
    monkeypatch.chdir(tmp_path)
    scope: dict = {"__name__": "tutorial", "qdq_optuna": qdq_optuna}
    exec(compile(settings + "\n".join(blocks[1:]), str(PAGE), "exec"), scope)

    result, bounded = scope["result"], scope["bounded"]
    assert Path(result.optimized_model).is_file() and result.speedup > 0
    onnx.checker.check_model(str(result.optimized_model))
    assert set(scope["held_out_agreement"]) == set(scope["HELD_OUT"])
    assert all(0.0 <= v <= 1.0 for v in scope["held_out_agreement"].values())
    # the metric run bounded the user's metric, and says so in its report
    report = json.loads((tmp_path / "out_metric" / "report.json").read_text())
    assert report["accuracy"]["measure"] == "metric tutorial:detection_loss"  # no address in it
    assert report["accuracy"]["error"] <= 0.1
    assert Path(bounded.optimized_model).is_file()


def test_tune_mode_is_the_cli_mode():
    assert _config(None, "quick") == Config.preset("quick")
    assert _config(None, None) == Config()
    mine = Config(refine_rounds=1)
    assert _config(mine, None) is mine
    both = _config(mine, "extensive")  # a changed field wins over the preset, as --config does
    assert both.refine_rounds == 1
    assert both.schemes_per_region == Config.preset("extensive").schemes_per_region
    with pytest.raises(OptionError, match="--mode: unknown 'fast'"):
        qdq_optuna.tune(zoo.build("resnet", "small"), "unused", mode="fast")
