"""High precision on the command line: ``--high-precision``, ``--keep-io-types``,
``--no-opset-upgrade`` on ``tune`` and ``inspect``; the report names the precision; bad
combinations are one line and exit 2."""

from __future__ import annotations

import json

import corpus
import onnx
import pytest

from qdq_optuna.cli.commands import main
from qdq_optuna.examples import zoo

pytestmark = pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    paths = {}
    for name, model in (("residual", zoo.build("tiny_residual")),
                        ("old", corpus.old_opset_unnamed())):
        paths[name] = d / f"{name}.onnx"
        onnx.save(model, str(paths[name]))
    return paths


def _error(capsys, *argv) -> str:
    rc = main(list(map(str, argv)))
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert err.startswith("qdq-optuna: error: ") and "\n" not in err, err
    return err


def _tune(capsys, model, out, *args) -> dict:
    rc = main(["tune", "-m", str(model), "-o", str(out), "-b", "costmodel", "-n", "3",
               "--refine-rounds", "0", *map(str, args)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    return json.loads((out / "report.json").read_text())


def test_the_report_names_the_precision(models, tmp_path, capsys):
    report = _tune(capsys, models["residual"], tmp_path / "default")
    hp = report["high_precision"]
    assert hp["precision"] == "fp16" and hp["keep_io_types"] is True  # the cost model's default
    assert isinstance(hp["kept_fp32"], dict)
    md = (tmp_path / "default" / "report.md").read_text()
    assert "- high precision: FP16 (converted before the search; graph inputs and outputs " \
           "kept FP32" in md
    model = onnx.load(str(tmp_path / "default" / "optimized.onnx"))
    assert model.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    assert any(init.data_type == onnx.TensorProto.FLOAT16 for init in model.graph.initializer)

    report = _tune(capsys, models["residual"], tmp_path / "io", "--no-keep-io-types")
    assert report["high_precision"]["keep_io_types"] is False
    model = onnx.load(str(tmp_path / "io" / "optimized.onnx"))
    assert model.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    assert "graph inputs and outputs FP16 too" in (tmp_path / "io" / "report.md").read_text()

    report = _tune(capsys, models["residual"], tmp_path / "fp32", "--high-precision", "fp32")
    assert report["high_precision"] == {"precision": "fp32", "keep_io_types": True,
                                        "kept_fp32": {}}
    assert "- high precision: FP32" in (tmp_path / "fp32" / "report.md").read_text()


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_ort_cpu_refuses_low_precision(models, tmp_path, capsys, precision):
    err = _error(capsys, "tune", "-m", models["residual"], "-o", tmp_path / "o",
                 "--high-precision", precision)
    assert err.startswith(f"qdq-optuna: error: --high-precision {precision} cannot run on "
                          "--backend onnxruntime: ONNX Runtime's CPU provider")
    assert not (tmp_path / "o" / "studies.db").exists()


def test_bf16_below_its_opset_without_the_upgrade(models, tmp_path, capsys):
    err = _error(capsys, "tune", "-m", models["residual"], "-o", tmp_path / "o", "-b",
                 "costmodel", "--high-precision", "bf16", "--no-opset-upgrade")
    assert "--high-precision bf16 needs opset >= 22" in err and "opset 17" in err
    assert "--no-opset-upgrade" in err
    err = _error(capsys, "inspect", models["residual"], "--high-precision", "bf16",
                 "--no-opset-upgrade")
    assert "--high-precision bf16 needs opset >= 22" in err


def test_no_upgrade_refuses_what_per_channel_weights_need(models, tmp_path, capsys):
    err = _error(capsys, "inspect", models["old"], "--runtime", "tensorrt",
                 "--no-opset-upgrade")
    assert "needs opset >= 13" in err and "opset 11" in err
    rc = main(["inspect", str(models["old"]), "--runtime", "tensorrt", "--json"])
    assert rc == 0 and json.loads(capsys.readouterr().out)["opset"] == 13  # upgraded


def test_inspect_takes_the_precision(models, capsys):
    assert main(["inspect", str(models["residual"]), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["high_precision"] == "fp32"  # as given
    assert main(["inspect", str(models["residual"]), "--runtime", "tensorrt",
                 "--high-precision", "fp16", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["high_precision"] == "fp16" and doc["patterns"]
    assert "its float part converted to FP16" in doc["graph"]["description"]


def test_bf16_runs_are_scored(models, tmp_path, capsys):
    """ONNX Runtime's CPU provider has no BF16 Conv: the guard scores a BF16 model's values in
    FP32 arithmetic, and says so."""
    out = tmp_path / "bf16"
    rc = main(["tune", "-m", str(models["residual"]), "-o", str(out), "-b",
               "tests._latency_fns:every_qdq_faster", "--runtime", "tensorrt",
               "--high-precision", "bf16", "-n", "4", "--refine-rounds", "0", "-q"])
    assert rc == 0, capsys.readouterr().err
    report = json.loads((out / "report.json").read_text())
    assert report["high_precision"]["precision"] == "bf16" and report["quantized_tensors"]
    acc = report["accuracy"]
    assert acc["status"] == "within bound" and 0 < acc["error"] < 0.2
    assert acc["scored_as"].startswith("BF16 values in FP32 arithmetic")
    assert "Scored as BF16 values in FP32 arithmetic" in (out / "report.md").read_text()
    model = onnx.load(str(out / "optimized.onnx"))
    assert any(i.data_type == onnx.TensorProto.BFLOAT16 for i in model.graph.initializer)
