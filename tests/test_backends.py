"""ONNX Runtime, callable and isolated backends, and the ``--backend`` factory."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from qdq_optuna.backends import (
    BACKEND_NAMES,
    CallableBackend,
    IsolatedBackend,
    OnnxRuntimeBackend,
    TrtexecBackend,
    load_callable,
    make_backend,
)
from qdq_optuna.backends import onnxruntime as ort_backend
from qdq_optuna.backends.base import (
    BackendError,
    BackendUnavailable,
    Configured,
    SessionSettings,
    TransientBackendError,
)
from qdq_optuna.errors import OptionError, UserError
from qdq_optuna.examples.zoo import matmul_chain

sys.path.insert(0, str(Path(__file__).parent))  # for the isolated worker's test backend
import _crashy_backend  # noqa: E402


def chain_model(layers: int = 3, width: int = 64, rows: int = 8, symbolic: bool = False) -> bytes:
    return matmul_chain(layers, width, rows, symbolic=symbolic)

def gather_model() -> bytes:
    """An int64 index input next to a float one: integer inputs must come out as zeros."""
    table = numpy_helper.from_array(np.ones((10, 4), np.float32), "table")
    graph = helper.make_graph(
        [
            helper.make_node("Gather", ["table", "idx"], ["g"]),
            helper.make_node("Add", ["g", "y"], ["out"]),
        ],
        "gather",
        [
            helper.make_tensor_value_info("idx", TensorProto.INT64, [3]),
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 4]),
        ],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [3, 4])],
        [table],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


# -- ONNX Runtime ----------------------------------------------------------------------------


def test_ort_times_from_bytes_and_path(tmp_path):
    backend = OnnxRuntimeBackend()
    data = chain_model()
    path = tmp_path / "chain.onnx"
    path.write_bytes(data)
    for source in (data, str(path), path):
        with backend.load(source) as runner:
            times = runner.time(2, 5)
        assert len(times) == 5
        assert all(math.isfinite(t) and t > 0 for t in times)


def test_a_model_loaded_again_comes_from_onnx_runtimes_optimized_copy(monkeypatch):
    """From its second load on a model is read from the optimized graph ONNX Runtime wrote
    for it (every optimization off), with the same outputs; models under other session
    settings get copies of their own, a copy ONNX Runtime cannot read is dropped for the
    model itself, the least recently loaded copy goes past the limit, and ``close`` removes
    them all."""
    monkeypatch.setattr(ort_backend, "COPY_AFTER_S", 0.0)  # these tiny models load at once
    backend = OnnxRuntimeBackend()
    copies = backend.copies
    data = chain_model(layers=4)
    outputs = []
    for _ in range(4):
        with backend.load(data) as runner:
            outputs.append(runner.session.run(None, runner.feeds)[0])
            assert runner.time(1, 3)
    assert copies.loaded_from_copy == 2  # the 1st load measures, the 2nd writes the copy
    for out in outputs[1:]:
        np.testing.assert_array_equal(out, outputs[0])
    folder = Path(copies._folder)
    assert len(list(folder.iterdir())) == 1

    settings = SessionSettings("no_propagation", (
        ("optimization.disable_specified_optimizers", "QDQPropagationTransformer"),))
    for _ in range(3):
        backend.load(Configured(data, settings)).close()
    assert copies.loaded_from_copy == 3 and len(list(folder.iterdir())) == 2

    (copy,) = [p for p in folder.iterdir() if p.name == f"{copies.key(data, ())}.onnx"]
    copy.write_bytes(b"not a model")
    with backend.load(data) as runner:  # from the model again
        np.testing.assert_array_equal(runner.session.run(None, runner.feeds)[0], outputs[0])
    assert copies.loaded_from_copy == 3 and not copy.exists()

    copies.limit = 2
    for width in (16, 24, 32):
        for _ in range(2):
            backend.load(chain_model(layers=2, width=width)).close()
    assert len(list(folder.iterdir())) == 2
    backend.close()
    assert not folder.exists()


def test_a_killed_processs_optimized_copies_are_removed_by_the_next_backend(tmp_path, monkeypatch):
    """A worker killed with SIGKILL runs no clean-up: its folder of optimized copies stays in
    the temporary folder until the next backend that writes copies removes it; the folder of
    a process still running is left alone."""
    code = textwrap.dedent("""
        import os, signal, sys
        from qdq_optuna.backends import onnxruntime as ort_backend
        from qdq_optuna.examples.zoo import matmul_chain
        ort_backend.COPY_AFTER_S = 0.0
        backend = ort_backend.OnnxRuntimeBackend()
        data = matmul_chain(layers=2)
        for _ in range(3):
            backend.load(data).close()
        print(backend.copies._folder, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr
    orphan = Path(done.stdout.strip())
    assert orphan.parent == tmp_path and any(orphan.iterdir())  # the copy it wrote is left
    alive = tmp_path / f"{ort_backend.COPIES_PREFIX}{os.getpid()}-mine"
    alive.mkdir()

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(ort_backend, "COPY_AFTER_S", 0.0)
    backend = OnnxRuntimeBackend()
    for _ in range(2):
        backend.load(chain_model(layers=2)).close()
    assert not orphan.exists() and alive.exists()
    mine = Path(backend.copies._folder)
    assert mine.exists() and mine.name.startswith(f"{ort_backend.COPIES_PREFIX}{os.getpid()}-")
    backend.close()
    assert not mine.exists()


def test_ort_session_settings_and_describe():
    backend = OnnxRuntimeBackend()
    runner = backend.load(chain_model())
    opts = runner.session.get_session_options()
    assert opts.intra_op_num_threads == 1
    assert opts.inter_op_num_threads == 1
    try:  # never set: its int8 x int8 kernels run slower than FP32 on common CPUs
        value = opts.get_session_config_entry("session.qdqisint8allowed")
    except RuntimeError:  # "does not have configuration with key"
        value = ""
    assert value in ("", "0")
    desc = backend.describe()
    assert desc["threads"] == 1
    assert desc["providers"] == ["CPUExecutionProvider"]
    assert desc["onnxruntime"]
    assert desc["optimization"] == "all"


def test_ort_inputs_are_seeded_and_integers_zero():
    backend = OnnxRuntimeBackend(seed=3)
    a = backend.load(gather_model()).feeds
    b = backend.load(gather_model()).feeds
    assert a["idx"].dtype == np.int64 and not a["idx"].any()
    assert a["y"].dtype == np.float32 and a["y"].std() > 0
    np.testing.assert_array_equal(a["y"], b["y"])
    given = OnnxRuntimeBackend(input_data={"idx": np.array([1, 2, 3], np.int64)})
    assert given.load(gather_model()).feeds["idx"].tolist() == [1, 2, 3]


def test_ort_invalid_model_is_backend_error_with_ort_text():
    broken = helper.make_model(
        helper.make_graph(
            [helper.make_node("NoSuchOp", ["x"], ["y"])],
            "broken",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
        ),
        opset_imports=[helper.make_opsetid("", 17)],
    )
    with pytest.raises(BackendError) as info:
        OnnxRuntimeBackend().load(broken.SerializeToString())
    assert not isinstance(info.value, TransientBackendError)
    assert "NoSuchOp" in str(info.value)
    with pytest.raises(BackendError, match="ONNX Runtime"):
        OnnxRuntimeBackend().load(b"definitely not a model")


def test_ort_symbolic_dim_needs_shape():
    with pytest.raises(BackendError, match="'x'"):
        OnnxRuntimeBackend().load(chain_model(symbolic=True))
    runner = OnnxRuntimeBackend(input_shapes={"x": (4, 64)}).load(chain_model(symbolic=True))
    assert runner.feeds["x"].shape == (4, 64)
    assert len(runner.time(0, 2)) == 2


@pytest.mark.parametrize("name", ["ort-cuda", "ort-trt"])
def test_ort_gpu_providers_unavailable_here(name):
    import onnxruntime

    wanted = "CUDAExecutionProvider" if name == "ort-cuda" else "TensorrtExecutionProvider"
    if wanted in onnxruntime.get_available_providers():
        pytest.skip(f"{wanted} is installed")
    with pytest.raises(BackendUnavailable, match=wanted):
        backend = make_backend(name, isolate=False)
        backend.load(chain_model())
    with pytest.raises(BackendUnavailable, match="onnxruntime-gpu"):
        OnnxRuntimeBackend(providers=(wanted,))


@pytest.fixture
def ort_cuda():
    import onnxruntime

    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        pytest.skip("onnxruntime-gpu is not installed")
    backend = make_backend("ort-cuda", isolate=False)
    try:
        backend.load(chain_model()).close()
    except BackendUnavailable as exc:  # installed, but no device or CUDA libraries
        pytest.skip(str(exc))
    return backend


@pytest.mark.gpu
def test_ort_cuda_times_on_the_device_without_transfers(ort_cuda):
    from qdq_optuna.backends.onnxruntime import _DeviceRunner

    runner = ort_cuda.load(chain_model(layers=6, width=256, rows=64))
    try:
        assert isinstance(runner, _DeviceRunner)
        times = runner.time(5, 20)
        assert len(times) == 20 and all(0 < t < 1000 for t in times)
    finally:
        runner.close()
    with pytest.raises(BackendError, match="after close"):
        runner.time(0, 1)


@pytest.mark.gpu
def test_ort_cuda_tunes_end_to_end(residual, tmp_path):
    import onnxruntime

    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        pytest.skip("onnxruntime-gpu is not installed")
    from qdq_optuna import Config, tune

    result = tune(str(residual), str(tmp_path / "out"), benchmark="ort-cuda",
                  config=Config.preset("quick"), progress=False)
    report = json_load(tmp_path / "out" / "report.json")
    assert report["backend"]["providers"][0] == "CUDAExecutionProvider"
    assert report["final_latency_ms"] > 0 and report["speedup"] == pytest.approx(result.speedup)
    onnx.checker.check_model(onnx.load(str(tmp_path / "out" / "optimized.onnx")))


def json_load(path):
    import json

    return json.loads(Path(path).read_text())


def test_ort_bad_options():
    with pytest.raises(OptionError):
        OnnxRuntimeBackend(optimization="max")
    with pytest.raises(OptionError):
        OnnxRuntimeBackend(threads=0)


# -- callable --------------------------------------------------------------------------------


def test_callable_backend_calls_once_per_time_with_a_modelproto(tmp_path):
    seen = []

    def latency(model):
        seen.append(model)
        return 1.5 + len(model.graph.node)

    backend = CallableBackend(latency, deterministic=True)
    assert backend.deterministic and backend.name == "latency"
    runner = backend.load(chain_model(layers=2))
    assert runner.time(5, 50) == [5.5]
    assert runner.time(0, 1) == [5.5]
    assert len(seen) == 2 and all(isinstance(m, onnx.ModelProto) for m in seen)
    assert seen[0] is seen[1]  # parsed once per load
    path = tmp_path / "m.onnx"
    path.write_bytes(chain_model(layers=1))
    assert backend.load(path).time(0, 1) == [3.5]
    assert backend.describe()["callable"].endswith("latency")


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (float("nan"), "finite"),
        (float("inf"), "finite"),
        (-1.0, ">= 0"),
        ("3", "expected latency"),
        (None, "expected latency"),
        (True, "expected latency"),
    ],
)
def test_callable_backend_rejects_bad_values(value, message):
    runner = CallableBackend(lambda m: value, name="user").load(chain_model())
    with pytest.raises(BackendError, match=message):
        runner.time(0, 1)


def test_callable_backend_wraps_exceptions():
    def boom(model):
        raise ValueError("device farm offline")

    runner = CallableBackend(boom).load(chain_model())
    with pytest.raises(BackendError, match="ValueError: device farm offline"):
        runner.time(0, 1)
    with pytest.raises(BackendError, match="cannot parse"):
        CallableBackend(boom).load(b"\x00garbage")


def test_load_callable_from_cwd(tmp_path, monkeypatch):
    (tmp_path / "my_latency_mod.py").write_text(
        textwrap.dedent(
            """
            def cost(model):
                return 2.0 * len(model.graph.node)

            class Holder:
                @staticmethod
                def cost(model):
                    return 7.0
            """
        )
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "my_latency_mod", raising=False)
    fn = load_callable("my_latency_mod:cost")
    assert sys.path[0] == str(tmp_path)
    assert fn(onnx.load_from_string(chain_model(layers=2))) == 8.0
    assert load_callable("my_latency_mod:Holder.cost")(None) == 7.0
    backend = make_backend("my_latency_mod:cost", deterministic=True)
    assert isinstance(backend, CallableBackend) and backend.deterministic
    assert backend.load(chain_model(layers=1)).time(0, 1) == [4.0]
    with pytest.raises(OptionError, match="no attribute"):
        load_callable("my_latency_mod:missing")
    with pytest.raises(OptionError, match="no_such_module_xyz"):
        make_backend("no_such_module_xyz:fn")
    with pytest.raises(OptionError, match="only deterministic"):
        make_backend("my_latency_mod:cost", threads=2)


# -- factory ---------------------------------------------------------------------------------


def test_make_backend_names():
    for name in ("onnxruntime", "ort"):
        backend = make_backend(name)
        assert isinstance(backend, OnnxRuntimeBackend)
        assert backend.name == "onnxruntime"
        assert backend.providers == ("CPUExecutionProvider",)
    assert make_backend("ort", threads=2).threads == 2
    trt = make_backend("tensorrt", timing_cache="cache.bin")
    assert isinstance(trt, IsolatedBackend) and trt.name == "tensorrt"
    assert trt.factory[0] == "qdq_optuna.backends.tensorrt"
    assert trt.load_timeout_s == 600
    assert make_backend("tensorrt", build_timeout_s=30).load_timeout_s == 30
    from qdq_optuna.backends.tensorrt import TensorRTBackend

    assert isinstance(make_backend("tensorrt", isolate=False), TensorRTBackend)
    assert "costmodel" in BACKEND_NAMES


def test_make_backend_unknown_name_and_options():
    with pytest.raises(OptionError) as info:
        make_backend("tensorrtt")
    text = str(info.value)
    assert "--backend" in text and "tensorrtt" in text
    for name in ("onnxruntime", "ort-cuda", "tensorrt", "trtexec", "costmodel"):
        assert name in text
    assert isinstance(info.value, UserError)
    with pytest.raises(OptionError, match="--backend ort"):
        make_backend("ort", thread=1)
    with pytest.raises(OptionError, match="--backend tensorrt"):
        make_backend("tensorrt", timing_cach="x")


def test_make_backend_trtexec_missing():
    with pytest.raises(BackendUnavailable, match="trtexec not found on PATH"):
        make_backend("trtexec", trtexec="no-such-trtexec-binary")
    with pytest.raises(BackendUnavailable, match="add its bin folder to PATH"):
        TrtexecBackend(trtexec="no-such-trtexec-binary")


def test_make_backend_costmodel_is_lazy():
    try:
        backend = make_backend("costmodel")
    except BackendUnavailable as exc:
        assert "costmodel" in str(exc)
    except OptionError:
        pass  # the cost model exists but needs options
    else:
        assert backend.load is not None


# -- isolation -------------------------------------------------------------------------------


CRASHY = ("_crashy_backend", "CrashyBackend", {"hang_s": 30.0})


def test_isolated_runs_and_forwards():
    backend = IsolatedBackend(CRASHY)
    try:
        assert backend.name == "crashy"
        desc = backend.describe()
        assert desc["isolated"] and desc["hang_s"] == 30.0
        worker = backend.worker_pids()
        assert worker and worker[0] != __import__("os").getpid()
        with backend.load(b"abc") as runner:
            assert runner.time(1, 3) == [3.0, 3.0, 3.0]
        with pytest.raises(BackendError, match="refused the marker") as info:
            backend.load(_crashy_backend.FAIL)
        assert not isinstance(info.value, TransientBackendError)
        assert backend.load(b"abcd").time(0, 1) == [4.0]  # same worker still serves
        assert backend.restarts == 0
    finally:
        backend.close()
    assert backend.worker_pids() == []


def test_isolated_crash_is_transient_and_recovers():
    backend = IsolatedBackend(CRASHY)
    try:
        survivor = backend.load(b"ab")
        with pytest.raises(TransientBackendError, match=r"crashed \(signal 11") as info:
            backend.load(_crashy_backend.CRASH)
        assert "building" in str(info.value)
        with pytest.raises(TransientBackendError, match="restarted"):
            survivor.time(0, 1)  # its engine died with the worker
        assert backend.load(b"abcde").time(0, 2) == [5.0, 5.0]
        runner = backend.load(b"crash-on-time")
        with pytest.raises(TransientBackendError, match="while timing"):
            runner.time(0, 1)
        assert backend.load(b"xy").time(0, 1) == [2.0]
        assert backend.restarts == 2
    finally:
        backend.close()


class _Interrupt(BaseException):
    """Stands for Ctrl-C or SIGTERM (a real KeyboardInterrupt would end pytest's session)."""


def test_isolated_interrupted_call_retires_its_worker():
    """An exception raised while the worker works (Ctrl-C, SIGTERM) leaves its reply to come:
    the worker is killed, so the next call neither reads that stale reply nor waits behind the
    hanging one, and closing returns at once."""
    backend = IsolatedBackend(CRASHY, load_timeout_s=60.0)

    def interrupt(signum, frame):
        raise _Interrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        backend.load(b"warm")
        old = backend.worker_pids()
        signal.setitimer(signal.ITIMER_REAL, 1.0)
        with pytest.raises(_Interrupt):
            backend.load(_crashy_backend.HANG)  # the worker sleeps 30 s in it
        assert backend.worker_pids() == []
        t0 = time.monotonic()
        assert backend.load(b"abc").time(0, 1) == [3.0]
        assert backend.worker_pids() != old
        backend.close()
        assert time.monotonic() - t0 < 20
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        backend.close()


def test_isolated_timeout_kills_and_recovers():
    # worker starts (importing the package: about 1 s on a busy 2-core machine) get time;
    # only the hanging build runs under the 1 s limit
    backend = IsolatedBackend(CRASHY, load_timeout_s=60.0)
    try:
        backend.load(b"warm")  # start the worker outside the timed call
        old = backend.worker_pids()
        backend.load_timeout_s = 1.0
        t0 = time.monotonic()
        with pytest.raises(TransientBackendError, match="timed out after 1 s"):
            backend.load(_crashy_backend.HANG)
        assert time.monotonic() - t0 < 10
        backend.load_timeout_s = 60.0
        assert backend.load(b"abc").time(0, 1) == [3.0]
        assert backend.worker_pids() != old
    finally:
        backend.close()


def test_isolated_unavailable_backend_reports_cleanly():
    backend = IsolatedBackend(("_crashy_backend", "BrokenBackend", {}))
    with pytest.raises(BackendUnavailable, match="no such runtime"):
        backend.load(b"x")
    with pytest.raises(BackendUnavailable):  # and again, not a hang or a crash report
        backend.describe()
    backend.close()


def test_isolated_onnxruntime_end_to_end(tmp_path):
    backend = make_backend("ort", isolate=True)
    try:
        assert isinstance(backend, IsolatedBackend)
        path = tmp_path / "m.onnx"
        path.write_bytes(chain_model())
        for source in (chain_model(), path):
            with backend.load(source) as runner:
                times = runner.time(1, 3)
            assert len(times) == 3 and all(t > 0 for t in times)
        with pytest.raises(BackendError, match="ONNX Runtime"):
            backend.load(b"not a model")
        assert backend.describe()["providers"] == ["CPUExecutionProvider"]
    finally:
        backend.close()
