"""OpenVINO: the backend, its rules, NNCF's placement as a start, a whole run (real openvino)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

pytest.importorskip("openvino")

from qdq_optuna import Config, PreparedModel, tune, zoo  # noqa: E402
from qdq_optuna.backends import make_backend, runtime_for_backend  # noqa: E402
from qdq_optuna.backends.openvino import OpenVINOBackend, cpu_capabilities  # noqa: E402
from qdq_optuna.errors import OptionError  # noqa: E402


def _every_point(pm: PreparedModel) -> bytes:
    exporter = pm.exporter()
    uses = set()
    for pp in pm.tunable:
        uses |= set(pp.uses(pp.ids))
    return exporter.to_bytes(exporter.plan(uses))


def test_backend_times_a_model_and_says_how_it_compiled():
    backend = OpenVINOBackend()
    model = zoo.build("resnet", "small").SerializeToString()
    with backend.load(model) as runner:
        times = runner.time(2, 5)
    assert len(times) == 5 and all(t > 0 for t in times)
    doc = backend.describe()
    assert doc["inference_precision_hint"] == "f32" and doc["threads"] == 1
    assert "compile_model('optimized.onnx'" in doc["how_to_run"]
    assert runtime_for_backend("openvino") == "openvino"


def test_a_precision_the_cpu_lacks_is_one_clear_error():
    missing = [p for p, cap in (("bf16", "BF16"), ("fp16", "FP16")) if cap not in
               cpu_capabilities()]
    if not missing:
        pytest.skip("this CPU offers every precision")
    with pytest.raises(OptionError, match=f"--high-precision {missing[0]}"):
        make_backend("openvino", high_precision=missing[0], isolate=False)


def test_what_ran_reads_integer_layers_from_the_runtime_model():
    """Every point on: OpenVINO folds the Q/DQ of the Convs into u8 convolutions, which the
    runtime model names by the exporter's QuantizeLinear nodes; the float model has none."""
    pm = PreparedModel.prepare(zoo.build("resnet", "small"), runtime="openvino")
    backend = OpenVINOBackend()
    quantized = backend.what_ran(_every_point(pm))
    assert quantized.fused, quantized
    assert quantized.fused <= set(pm.candidate_tensors())
    plain = backend.what_ran(pm.exporter().to_bytes(pm.exporter().plan(set())))
    assert not plain.fused and not plain.standalone


@pytest.mark.parametrize("name", ["resnet", "yolo"])
def test_nncf_placement_is_a_start_our_rules_express_exactly(name):
    pytest.importorskip("nncf")
    from qdq_optuna.starts import nncf_recipe_start

    model = zoo.build(name, "small")
    pm = PreparedModel.prepare(model, runtime="openvino")
    start = nncf_recipe_start(pm, model)
    assert start.name == "recipe:openvino" and start.uses
    assert start.exact, start.notes
    assert start.counts["unmapped"] == 0 and start.counts["not_offered"] == 0


def test_tune_on_openvino_ships_a_model_openvino_runs(tmp_path):
    model = zoo.build("tiny_residual")
    result = tune(model, tmp_path / "out", backend="openvino", timing="fast",
                  config=Config(schemes_per_region=3, refine_rounds=1), progress=False)
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["runtime"] == "openvino"
    assert report["backend"]["inference_precision_hint"] == "f32"
    assert report["high_precision"]["precision"] == "fp32"  # the graph is not converted
    names = [s["name"] for s in report["starts"]]
    if _has_nncf():
        assert "recipe:openvino" in names
    import openvino as ov

    compiled = ov.Core().compile_model(str(result.optimized_model), "CPU")
    x = np.random.default_rng(0).standard_normal(
        [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]).astype(np.float32)
    out = compiled.create_infer_request().infer({model.graph.input[0].name: x})
    assert all(np.isfinite(np.asarray(v)).all() for v in out.values())
    assert report["accuracy"]["status"] == "within bound"


def _has_nncf() -> bool:
    try:
        import nncf  # noqa: F401
    except ImportError:
        return False
    return True


def test_inspect_takes_the_openvino_runtime(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "m.onnx"
    onnx.save(zoo.build("tiny_concat"), str(path))
    proc = subprocess.run([sys.executable, "-m", "qdq_optuna", "inspect", str(path),
                           "--runtime", "openvino", "--json"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["patterns"]
