"""TensorRT backends.

The trtexec output parser and command lines are tested everywhere, against sample output and a
stand-in ``trtexec`` script. Real engine builds are marked ``gpu`` and skip cleanly where
TensorRT, cuda-python or a GPU is missing.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from _fake_trtexec import write_fake_trtexec
from onnx import TensorProto, helper, numpy_helper

from qdq_optuna.backends import make_backend
from qdq_optuna.backends.base import BackendError, BackendUnavailable, TransientBackendError
from qdq_optuna.backends.trtexec import (
    NOT_FOUND,
    TrtexecBackend,
    format_shapes,
    median_gpu_compute_ms,
    parse_tensorrt_version,
    parse_trtexec_output,
)
from qdq_optuna.errors import OptionError

SAMPLE = (
    "&&&& RUNNING TensorRT.trtexec [TensorRT v100300] [b10] # trtexec --loadEngine=m.plan\n"
    "[11/25/2026-10:00:00] [I] === Model Options ===\n"
    "[11/25/2026-10:00:00] [I] Format: *\n"
    "[11/25/2026-10:00:03] [I] === Performance summary ===\n"
    "[11/25/2026-10:00:03] [I] Throughput: 4321.98 qps\n"
    "[11/25/2026-10:00:03] [I] Latency: min = 0.242676 ms, max = 0.398193 ms, "
    "mean = 0.251112 ms, median = 0.249756 ms, percentile(90%) = 0.256104 ms, "
    "percentile(95%) = 0.259277 ms, percentile(99%) = 0.290039 ms\n"
    "[11/25/2026-10:00:03] [I] Enqueue Time: min = 0.0136719 ms, max = 0.0551758 ms, "
    "mean = 0.0159 ms, median = 0.0153809 ms, percentile(90%) = 0.0172119 ms, "
    "percentile(95%) = 0.0180664 ms, percentile(99%) = 0.0290527 ms\n"
    "[11/25/2026-10:00:03] [I] H2D Latency: min = 0.00854492 ms, max = 0.0322266 ms, "
    "mean = 0.0101 ms, median = 0.00976562 ms, percentile(90%) = 0.0112305 ms, "
    "percentile(95%) = 0.0117188 ms, percentile(99%) = 0.0148926 ms\n"
    "[11/25/2026-10:00:03] [I] GPU Compute Time: min = 0.226318 ms, "
    "max = 0.37915 ms, mean = 0.23288 ms, median = 0.231445 ms, "
    "percentile(90%) = 0.236542 ms, percentile(95%) = 0.239624 ms, "
    "percentile(99.9%) = 0.26886 ms\n"
    "[11/25/2026-10:00:03] [I] D2H Latency: min = 0.00390625 ms, max = 0.0163574 ms, "
    "mean = 0.0048 ms, median = 0.00463867 ms, percentile(90%) = 0.00537109 ms, "
    "percentile(95%) = 0.00561523 ms, percentile(99%) = 0.00708008 ms\n"
    "[11/25/2026-10:00:03] [I] Total Host Walltime: 3.00062 s\n"
    "[11/25/2026-10:00:03] [I] Total GPU Compute Time: 3.01852 s\n"
    "[11/25/2026-10:00:03] [W] * GPU compute time is unstable, "
    "with coefficient of variance = 4.32%.\n"
    "[11/25/2026-10:00:03] [I] Explanations of the performance metrics are printed in "
    "the verbose logs.\n"
    "&&&& PASSED TensorRT.trtexec [TensorRT v100300] [b10] # trtexec --loadEngine=m.plan\n"
)


# -- pure parsing ----------------------------------------------------------------------------


def test_parse_sample_output():
    out = parse_trtexec_output(SAMPLE)
    gpu = out["gpu_compute_ms"]
    assert gpu["median"] == pytest.approx(0.231445)
    assert gpu["min"] == pytest.approx(0.226318) and gpu["max"] == pytest.approx(0.37915)
    assert gpu["mean"] == pytest.approx(0.23288)
    assert gpu["p90"] == pytest.approx(0.236542) and gpu["p95"] == pytest.approx(0.239624)
    assert gpu["p99.9"] == pytest.approx(0.26886)
    assert out["latency_ms"]["median"] == pytest.approx(0.249756)
    assert out["latency_ms"]["p99"] == pytest.approx(0.290039)
    assert out["h2d_ms"]["median"] == pytest.approx(0.00976562)
    assert out["enqueue_ms"]["max"] == pytest.approx(0.0551758)
    assert out["throughput_qps"] == pytest.approx(4321.98)
    assert out["tensorrt_version"] == "10.3.0"
    assert out["passed"] is True
    assert median_gpu_compute_ms(SAMPLE) == pytest.approx(0.231445)
    assert json.dumps(out)


def test_parse_without_prefixes_and_without_transfers():
    text = (
        "GPU Compute Time: min = 1.5 ms, max = 2 ms, mean = 1.6 ms, median = 1.55 ms\n"
        "Total GPU Compute Time: 3.2 s\n"
    )
    out = parse_trtexec_output(text)
    assert out["gpu_compute_ms"] == {"min": 1.5, "max": 2.0, "mean": 1.6, "median": 1.55}
    assert "h2d_ms" not in out and out["passed"] is False


def test_missing_summary_is_backend_error_with_tail():
    text = "&&&& RUNNING TensorRT.trtexec\n[E] Error[4]: could not find engine\n&&&& FAILED\n"
    with pytest.raises(BackendError, match="could not find engine"):
        median_gpu_compute_ms(text)


def test_versions_and_shapes():
    assert parse_tensorrt_version("[TensorRT v110000]") == "11.0.0"
    assert parse_tensorrt_version("[TensorRT v101300]") == "10.13.0"
    assert parse_tensorrt_version("[TensorRT v8601]") == "8.6.1"
    assert parse_tensorrt_version("no banner") is None
    assert format_shapes({"x": (1, 3, 224, 224), "ids:0": (1, 128)}) == (
        "x:1x3x224x224,'ids:0':1x128"
    )


def test_trtexec_missing_binary():
    with pytest.raises(BackendUnavailable) as info:
        TrtexecBackend(trtexec="bogus-trtexec-does-not-exist")
    assert NOT_FOUND in str(info.value)
    assert "trtexec not found on PATH; install TensorRT or add its bin folder to PATH" in str(info.value)


# -- a stand-in trtexec ----------------------------------------------------------------------


@pytest.fixture
def fake_trtexec(tmp_path, monkeypatch):
    if os.name != "posix":
        pytest.skip("the stand-in trtexec is a POSIX script")
    script = write_fake_trtexec(tmp_path)
    log = tmp_path / "calls.log"
    monkeypatch.setenv("FAKE_TRTEXEC_LOG", str(log))
    monkeypatch.delenv("FAKE_TRTEXEC_MODE", raising=False)
    monkeypatch.delenv("FAKE_TRTEXEC_VERSION", raising=False)
    return script, log


def _tiny_model_bytes() -> bytes:
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "relu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def test_trtexec_build_then_time(fake_trtexec, tmp_path):
    script, log = fake_trtexec
    plugin = tmp_path / "libplugin.so"
    plugin.write_bytes(b"")
    backend = TrtexecBackend(
        trtexec=str(script),
        warmup_ms=50,
        iterations=30,
        duration_s=1,
        use_cuda_graph=True,
        timing_cache=tmp_path / "tc.bin",
        plugins=[plugin],
        input_shapes={"x": (2, 4)},
        timeout_s=30,
    )
    model = _tiny_model_bytes()
    runner = backend.load(model)
    assert os.path.isfile(runner.engine_path)
    assert runner.time(5, 10) == [pytest.approx(len(model) / 1000.0)]
    assert runner.last["gpu_compute_ms"]["p90"] == pytest.approx(len(model) / 1000.0 * 1.2)
    assert runner.time(5, 500) == [pytest.approx(len(model) / 1000.0)]
    workdir = runner.workdir
    runner.close()
    assert not os.path.exists(workdir)

    calls = log.read_text().splitlines()
    assert calls[0] == "--help"
    build, time1, time2 = calls[1].split(), calls[2].split(), calls[3].split()
    assert build[0].startswith("--onnx=") and any(a.startswith("--saveEngine=") for a in build)
    assert "--stronglyTyped" in build and "--skipInference" in build
    assert f"--timingCacheFile={tmp_path / 'tc.bin'}" in build
    assert f"--staticPlugins={plugin}" in build and "--shapes=x:2x4" in build
    assert not any(a in build for a in ("--int8", "--fp16", "--best"))
    assert time1[0].startswith("--loadEngine=")
    assert {"--warmUp=50", "--iterations=30", "--duration=1", "--useCudaGraph"} <= set(time1)
    assert "--noDataTransfers" in time1 and "--shapes=x:2x4" in time1
    assert "--iterations=500" in time2  # the caller's count is a floor
    desc = backend.describe()
    assert desc["tensorrt"] == "10.3.0" and desc["strongly_typed_flag"] is True


def test_trtexec_11_needs_no_strongly_typed_flag(fake_trtexec, monkeypatch):
    script, log = fake_trtexec
    monkeypatch.setenv("FAKE_TRTEXEC_VERSION", "110000")
    backend = TrtexecBackend(trtexec=str(script))
    backend.load(_tiny_model_bytes()).close()
    build = log.read_text().splitlines()[1].split()
    assert "--stronglyTyped" not in build
    assert backend.describe()["tensorrt"] == "11.0.0"


def test_trtexec_failure_and_timeout(fake_trtexec, tmp_path, monkeypatch):
    script, _ = fake_trtexec
    path = tmp_path / "m.onnx"
    path.write_bytes(_tiny_model_bytes())
    backend = TrtexecBackend(trtexec=str(script), timeout_s=2)
    backend._probe()
    monkeypatch.setenv("FAKE_TRTEXEC_MODE", "fail")
    with pytest.raises(BackendError) as info:
        backend.load(path)
    assert not isinstance(info.value, TransientBackendError)
    assert "exit 1" in str(info.value) and "bad Q/DQ" in str(info.value)
    assert "m.onnx" in str(info.value)
    monkeypatch.setenv("FAKE_TRTEXEC_MODE", "sleep")
    with pytest.raises(TransientBackendError, match="timed out after 2 s"):
        backend.load(path)


def test_trtexec_bad_options(fake_trtexec, tmp_path):
    script, _ = fake_trtexec
    with pytest.raises(OptionError, match="--plugin"):
        TrtexecBackend(trtexec=str(script), plugins=[tmp_path / "missing.so"])
    with pytest.raises(OptionError):
        TrtexecBackend(trtexec=str(script), iterations=0)


# -- real TensorRT (GPU machines) --------------------------------------------------------------


def _qdq_conv_model(channels: int = 16, size: int = 32, dynamic: bool = False) -> bytes:
    """x -> Q/DQ (int8) -> Conv(weights DQ int8 per channel) -> Relu: TensorRT's INT8 pattern."""
    rng = np.random.default_rng(0)
    w = rng.integers(-127, 127, (channels, channels, 3, 3), dtype=np.int8)
    inits = [
        numpy_helper.from_array(np.array(0.05, np.float32), "x_scale"),
        numpy_helper.from_array(np.array(0, np.int8), "x_zp"),
        numpy_helper.from_array(w, "w_q"),
        numpy_helper.from_array(np.full(channels, 0.01, np.float32), "w_scale"),
        numpy_helper.from_array(np.zeros(channels, np.int8), "w_zp"),
        numpy_helper.from_array(np.zeros(channels, np.float32), "bias"),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "x_scale", "x_zp"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "x_scale", "x_zp"], ["xdq"]),
        helper.make_node("DequantizeLinear", ["w_q", "w_scale", "w_zp"], ["w"], axis=0),
        helper.make_node("Conv", ["xdq", "w", "bias"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["y"]),
    ]
    batch: int | str = "batch" if dynamic else 1
    graph = helper.make_graph(
        nodes,
        "qdq_conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, channels, size, size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, channels, size, size])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


@pytest.fixture
def trt_env():
    pytest.importorskip("tensorrt")
    from qdq_optuna.backends.tensorrt import cuda_device_count

    if cuda_device_count() < 1:
        pytest.skip("no CUDA device (or cuda-python missing)")


@pytest.mark.gpu
def test_tensorrt_builds_times_and_saves_timing_cache(trt_env, tmp_path):
    from qdq_optuna.backends.tensorrt import TensorRTBackend

    cache = tmp_path / "timing.cache"
    backend = TensorRTBackend(timing_cache=str(cache), warmup=5)
    try:
        runner = backend.load(_qdq_conv_model())
        times = runner.time(5, 20)
        assert len(times) == 20 and all(0 < t < 1000 for t in times)
        runner.close()
        import tensorrt as trt

        flags = backend._network_flags()
        assert flags == 0 if int(trt.__version__.split(".")[0]) >= 11 else flags != 0
        desc = backend.describe()
        assert desc["tensorrt"] == trt.__version__ and desc["device"]
    finally:
        backend.close()
    assert cache.is_file() and cache.stat().st_size > 0
    # a second backend starts from the saved cache
    again = TensorRTBackend(timing_cache=str(cache), warmup=0)
    try:
        assert len(again.load(_qdq_conv_model()).time(0, 3)) == 3
    finally:
        again.close()


@pytest.mark.gpu
def test_tensorrt_errors_name_the_problem(trt_env, tmp_path):
    from qdq_optuna.backends.tensorrt import TensorRTBackend

    backend = TensorRTBackend(warmup=0)
    try:
        with pytest.raises(BackendError, match="parser"):
            backend.load(b"not an onnx model")
        with pytest.raises(BackendError, match="'x'"):
            backend.load(_qdq_conv_model(dynamic=True))
        path = tmp_path / "dyn.onnx"
        path.write_bytes(_qdq_conv_model(dynamic=True))
        shaped = TensorRTBackend(warmup=0, input_shapes={"x": (2, 16, 32, 32)})
        try:
            assert len(shaped.load(path).time(1, 2)) == 2
        finally:
            shaped.close()
    finally:
        backend.close()


@pytest.mark.gpu
def test_tensorrt_isolated_via_make_backend(trt_env, tmp_path):
    from qdq_optuna.measure.timing import Measurer, TimingProtocol

    cache = tmp_path / "iso.cache"
    backend = make_backend("tensorrt", timing_cache=str(cache), warmup=2)
    try:
        assert backend.name == "tensorrt" and not backend.fresh_sessions
        protocol = TimingProtocol.fast().with_(runs=10, max_rounds=3)
        m = Measurer(backend, protocol)
        c = m.compare(_qdq_conv_model(channels=32), _qdq_conv_model(channels=16))
        assert c.rounds >= 2 and c.ratio > 0
        assert m.loads == 2  # one engine per model, timed repeatedly
    finally:
        backend.close()
    assert cache.is_file()


@pytest.mark.gpu
def test_real_trtexec(tmp_path):
    binary = shutil.which("trtexec")
    if binary is None:
        pytest.skip("trtexec not on PATH")
    backend = TrtexecBackend(
        trtexec=binary,
        duration_s=0.5,
        iterations=20,
        timeout_s=300,
        timing_cache=tmp_path / "tc.bin",
    )
    runner = backend.load(_qdq_conv_model())
    try:
        (median,) = runner.time(0, 20)
        assert 0 < median < 1000
        assert runner.last["gpu_compute_ms"]["min"] <= median
    finally:
        runner.close()
    assert (tmp_path / "tc.bin").is_file()


def _fp16_qdq_model(tmp_path) -> str:
    """resnet (small) converted to FP16 with every TensorRT point quantized, as a file."""
    from qdq_optuna import PreparedModel
    from qdq_optuna.examples import zoo

    pm = PreparedModel.prepare(zoo.build("resnet", "small"), runtime="tensorrt",
                               high_precision="fp16")
    exporter = pm.exporter()
    uses: set = set()
    for pp in pm.tunable:
        uses |= pp.uses(pp.ids)
    path = tmp_path / "fp16_qdq.onnx"
    exporter.save(exporter.plan(uses), path)
    return str(path)


def test_trtexec_10_builds_fp16_models_strongly_typed(fake_trtexec, tmp_path):
    script, log = fake_trtexec
    TrtexecBackend(trtexec=str(script)).load(_fp16_qdq_model(tmp_path)).close()
    build = log.read_text().splitlines()[1].split()
    assert "--stronglyTyped" in build
    assert not {"--fp16", "--int8", "--bf16", "--best"} & set(build)


def test_trtexec_without_strong_typing_gets_the_models_precisions(fake_trtexec, tmp_path,
                                                                  monkeypatch):
    """TensorRT 8.6 has no --stronglyTyped: the weakly typed build gets the precision flags
    the model's types ask for (its help lists them), or the FP16 layers would run FP32."""
    script, log = fake_trtexec
    monkeypatch.setenv("FAKE_TRTEXEC_VERSION", "8601")
    backend = TrtexecBackend(trtexec=str(script))
    backend.load(_fp16_qdq_model(tmp_path)).close()
    backend.load(_tiny_model_bytes()).close()
    calls = log.read_text().splitlines()
    fp16_build, fp32_build = calls[1].split(), calls[2].split()
    assert "--stronglyTyped" not in fp16_build
    assert {"--fp16", "--int8"} <= set(fp16_build) and "--bf16" not in fp16_build
    assert not {"--fp16", "--int8", "--stronglyTyped"} & set(fp32_build)
    desc = backend.describe()
    assert desc["strongly_typed"] is False and desc["tensorrt"] == "8.6.1"


def test_fake_trtexec_refuses_flags_it_does_not_know(fake_trtexec, monkeypatch):
    script, _ = fake_trtexec
    monkeypatch.setenv("FAKE_TRTEXEC_VERSION", "110000")
    backend = TrtexecBackend(trtexec=str(script), strongly_typed=True)
    with pytest.raises(BackendError, match="Unknown option: --stronglyTyped"):
        backend.load(_tiny_model_bytes())


class _FakeFlag:
    """Stands in for tensorrt.NetworkDefinitionCreationFlag (TensorRT is not installed here)."""

    def __init__(self, **members):
        self.__dict__.update(members)


@pytest.mark.parametrize(("version", "members", "flags"), [
    ("10.3.0", {"STRONGLY_TYPED": 1}, 1 << 1),   # opted into on 10.x
    ("11.0.0", {"STRONGLY_TYPED": 1}, 0),        # always strongly typed, flag deprecated
    ("10.0.0", {}, 0),                           # a build without the flag
])
def test_tensorrt_network_is_strongly_typed(version, members, flags):
    from types import SimpleNamespace

    from qdq_optuna.backends.tensorrt import TensorRTBackend

    backend = TensorRTBackend()
    backend._trt = SimpleNamespace(__version__=version,
                                   NetworkDefinitionCreationFlag=_FakeFlag(**members))
    assert backend._network_flags() == flags
