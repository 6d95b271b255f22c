"""Models whose weights live in external data files, up to beyond protobuf's 2 GB limit.

Above ``graph.INLINE_EXTERNAL_LIMIT`` bytes of external data (1 GiB; the tests lower it with
``QDQ_OPTUNA_INLINE_EXTERNAL_LIMIT``) a model is tuned in *external mode*: its big weights are
never read into one protobuf; an export is a small model file in a work folder of the output
folder that references the input's weight files where they are plus one file of quantized
weights (each weight quantized once, in slices of a memory map); backends get its path (ONNX
Runtime maps the input's files into memory; the cost model reads shapes only); the final
``optimized.onnx`` gets one self-contained data file beside it. The input folder is never
written to, and nothing is linked to its files (``onnx.load`` refuses hard-linked data).

The > 2 GB model is generated in the test as a sparse file of zeros (no disk, little time);
its test is marked slow (several GB of memory: ONNX Runtime calibrates it), run with
``QDQ_OPTUNA_SLOW=1``.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from test_resume import REPO, cli_env

from qdq_optuna._files import external_sources
from qdq_optuna.model.graph import INLINE_EXTERNAL_ENV, PROTOBUF_LIMIT
from qdq_optuna.runtimes.prepared import PreparedModel

SLOW = os.environ.get("QDQ_OPTUNA_SLOW") == "1"


# -- models ----------------------------------------------------------------------------------
def _mlp(weights: dict[str, np.ndarray | tuple]) -> onnx.ModelProto:
    """x[4,K] -> Gemm(transB) -> Relu -> MatMul -> Relu -> Gemm(+bias) -> y. ``weights`` maps
    fc1.w [N1,K], fc2.w [N1,N2], fc3.w [N2,N3] (and fc1.b, fc3.b) to arrays, or to shapes for
    tensors whose data the caller places itself."""
    def init(name, value):
        if isinstance(value, np.ndarray):
            return numpy_helper.from_array(value, name)
        t = TensorProto(name=name, data_type=TensorProto.FLOAT)
        t.dims.extend(value)
        return t

    k = (weights["fc1.w"].shape if isinstance(weights["fc1.w"], np.ndarray) else weights["fc1.w"])[1]
    n3 = (weights["fc3.w"].shape if isinstance(weights["fc3.w"], np.ndarray) else weights["fc3.w"])[1]
    nodes = [
        helper.make_node("Gemm", ["x", "fc1.w", "fc1.b"], ["h1"], name="fc1", transB=1),
        helper.make_node("Relu", ["h1"], ["r1"], name="relu1"),
        helper.make_node("MatMul", ["r1", "fc2.w"], ["h2"], name="fc2"),
        helper.make_node("Relu", ["h2"], ["r2"], name="relu2"),
        helper.make_node("Gemm", ["r2", "fc3.w", "fc3.b"], ["y"], name="fc3"),
    ]
    graph = helper.make_graph(
        nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, n3])],
        [init(n, v) for n, v in weights.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def small_mlp(seed: int = 0) -> onnx.ModelProto:
    """~1.3 MB of random weights, inline."""
    rng = np.random.default_rng(seed)
    return _mlp({
        "fc1.w": (rng.standard_normal((256, 512)) * 0.05).astype(np.float32),
        "fc1.b": (rng.standard_normal(256) * 0.1).astype(np.float32),
        "fc2.w": (rng.standard_normal((256, 512)) * 0.05).astype(np.float32),
        "fc3.w": (rng.standard_normal((512, 128)) * 0.05).astype(np.float32),
        "fc3.b": (rng.standard_normal(128) * 0.1).astype(np.float32),
    })


def small_external_model(folder: Path) -> Path:
    """:func:`small_mlp` with its weights in ``weights.bin`` (tensors over 1 KB external)."""
    model = small_mlp()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "mlp.onnx"
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="weights.bin", size_threshold=1024)
    return path


def huge_external_model(folder: Path, k: int = 16384, n: int = 12288) -> tuple[Path, int]:
    """Three weights of ~0.8 GB each (2.4 GB > 2 GiB) of zeros in a sparse ``weights.bin``:
    written without writing the data (the file is a hole), so it costs no disk and no time."""
    shapes = {"fc1.w": (n, k), "fc2.w": (n, k), "fc3.w": (k, n)}
    model = _mlp({**shapes, "fc1.b": np.zeros(n, np.float32), "fc3.b": np.zeros(n, np.float32)})
    offset = 0
    for t in model.graph.initializer:
        if t.name not in shapes:
            continue
        length = int(np.prod(shapes[t.name])) * 4
        t.ClearField("raw_data")
        t.data_location = TensorProto.EXTERNAL
        for key, value in (("location", "weights.bin"), ("offset", str(offset)),
                           ("length", str(length))):
            entry = t.external_data.add()
            entry.key, entry.value = key, value
        offset += length
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "weights.bin", "wb") as fh:
        fh.truncate(offset)  # sparse: all zeros, no blocks
    path = folder / "huge.onnx"
    path.write_bytes(model.SerializeToString())
    return path, offset


def folder_state(folder: Path) -> dict[str, tuple]:
    """name -> (size, mtime, link count, sha256 of the first MB) of every file in ``folder``."""
    out = {}
    for p in sorted(folder.rglob("*")):
        st = p.stat()
        with open(p, "rb") as fh:
            head = hashlib.sha256(fh.read(1 << 20)).hexdigest()
        out[str(p.relative_to(folder))] = (st.st_size, st.st_mtime_ns, st.st_nlink, head)
    return out


def leftovers(out: Path) -> list[str]:
    return sorted(str(p.relative_to(out)) for p in out.rglob("*")
                  if p.name.endswith(".tmp") or p.name.startswith(".qdq_work"))


def run_model(path: Path, x: np.ndarray) -> np.ndarray:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"]).run(
        None, {"x": x})[0]


# -- fast: the external-mode machinery on a small model ------------------------------------------
def test_external_mode_exports_the_same_model(tmp_path, monkeypatch):
    """Exported in external mode (weights on disk, quantized in slices, files by path), a plan
    gives the same model as exported from memory: same quantized weights, same outputs."""
    path = small_external_model(tmp_path / "in")
    before = folder_state(tmp_path / "in")
    inline = PreparedModel.prepare(path, runtime="tensorrt")
    monkeypatch.setenv(INLINE_EXTERNAL_ENV, "0")
    ext = PreparedModel.prepare(path, runtime="tensorrt")
    ext.data_dir = tmp_path / "work"
    assert inline.graph.external_dir is None and ext.graph.external_dir == (tmp_path / "in")
    assert inline.source_sha256 != ext.source_sha256  # the weights count in external mode
    on_disk = [t.name for t in ext.graph.model.graph.initializer
               if t.data_location == TensorProto.EXTERNAL]
    assert sorted(on_disk) == ["fc1.w", "fc2.w", "fc3.w"]  # biases (small) were read in
    assert [pp.ids for pp in ext.tunable] == [pp.ids for pp in inline.tunable]

    x = np.random.default_rng(1).standard_normal((4, 512)).astype(np.float32)
    e_in, e_ext = inline.exporter(), ext.exporter()
    for pp_in, pp_ext in zip(inline.tunable, ext.tunable):
        for on in ([], pp_in.ids, pp_in.ids[:1]):
            plan_in, plan_ext = e_in.plan(pp_in.uses(on)), e_ext.plan(pp_ext.uses(on))
            assert plan_in.key == plan_ext.key
            src = e_ext.source(plan_ext)
            file = Path(os.fspath(src))
            assert file.parent == e_ext.work_folder and file.parent.parent == tmp_path / "work"
            assert file.stat().st_size < 50_000  # structure only: no weights inside
            assert set(external_sources(file)) >= {"weights.bin"}
            # the quantized weights are the in-memory export's, byte for byte
            model_ext = onnx.load(str(file), load_external_data=False)
            model_in = onnx.load_from_string(e_in.to_bytes(plan_in))
            inits = {t.name: t for t in model_in.graph.initializer}
            for t in model_ext.graph.initializer:
                if t.name.endswith("_quantized") and t.data_location == TensorProto.EXTERNAL:
                    info = {e.key: e.value for e in t.external_data}
                    raw = (file.parent / info["location"]).read_bytes()
                    start = int(info["offset"])
                    assert raw[start:start + int(info["length"])] == inits[t.name].raw_data
            # and ONNX Runtime runs it by path with the input's weights mapped from memory
            from qdq_optuna.backends.onnxruntime import OnnxRuntimeBackend

            backend = OnnxRuntimeBackend()
            with backend.load(src) as runner:
                assert runner.time(0, 1)
            so = ort.SessionOptions()
            so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
            ref = ort.InferenceSession(e_in.to_bytes(plan_in), so,
                                       providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
            got = run_external(file, x)
            np.testing.assert_array_equal(got, ref)

    # the final model: one self-contained data file beside it
    plan = e_ext.plan(ext.tunable[0].uses(ext.tunable[0].ids))
    saved = e_ext.save(plan, tmp_path / "out" / "optimized.onnx")
    data_files = list((tmp_path / "out").glob("optimized.onnx.*.data"))
    assert len(data_files) == 1
    loaded = onnx.load(str(saved))  # with its data: no links, nothing outside the folder
    onnx.checker.check_model(loaded)
    ref_bytes = e_in.to_bytes(e_in.plan(inline.tunable[0].uses(inline.tunable[0].ids)))
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    ref = ort.InferenceSession(ref_bytes, so, providers=["CPUExecutionProvider"]).run(
        None, {"x": x})[0]
    np.testing.assert_array_equal(run_model(saved, x), ref)
    # saving again replaces the pair; the old data file goes
    e_ext.save(plan, saved)
    assert len(list((tmp_path / "out").glob("optimized.onnx.*.data"))) == 1
    assert folder_state(tmp_path / "in") == before  # never written to, never linked


def run_external(file: Path, x: np.ndarray) -> np.ndarray:
    """Run a work-folder model the way the ONNX Runtime backend loads it."""
    from qdq_optuna.backends.onnxruntime import _map_external_sources

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    maps = _map_external_sources(so, str(file))
    session = ort.InferenceSession(str(file), so, providers=["CPUExecutionProvider"])
    del maps
    return session.run(None, {"x": x})[0]


def test_big_inline_models_are_read_once_and_exported_to_files(tmp_path, monkeypatch):
    """A model with its weights inline is read without a second copy of them (the big
    initializers go straight into the graph's serialized store), and above
    ``$QDQ_OPTUNA_FILE_EXPORT_BYTES`` its exports are files written piece by piece, never one
    bytes object: the same models as byte exports, and a tune run gives a valid model."""
    from qdq_optuna.model.graph import load_model
    from qdq_optuna.placement.export import FILE_EXPORT_ENV, ExportedModel

    folder = tmp_path / "in"
    folder.mkdir()
    path = folder / "mlp.onnx"
    rng = np.random.default_rng(1)
    model = small_mlp(seed=1)
    onnx.save(model, str(path))
    before = folder_state(folder)
    graph = load_model(path)
    assert graph.compacted == {"fc1.w", "fc2.w", "fc3.w", "fc1.b"}  # fc3.b: 512 B, inline
    assert not any(t.raw_data for t in graph.model.graph.initializer if t.name in graph.compacted)
    # the weights are those of the file (shape inference added value_info, nothing else)
    assert list(graph.full_model().graph.initializer) == list(model.graph.initializer)
    np.testing.assert_array_equal(graph.array("fc2.w"), numpy_helper.to_array(
        next(t for t in model.graph.initializer if t.name == "fc2.w")))

    pm_bytes = PreparedModel.prepare(str(path), runtime="tensorrt")
    ex_bytes = pm_bytes.exporter()
    monkeypatch.setenv(FILE_EXPORT_ENV, "1024")
    pm = PreparedModel.prepare(str(path), runtime="tensorrt")
    pm.data_dir = tmp_path / "work"
    ex = pm.exporter()
    assert ex.to_files and not ex_bytes.to_files
    pp = pm.tunable[0]
    plan = ex.plan(pp.uses(pp.ids))
    src = ex.source(plan)
    assert isinstance(src, ExportedModel)
    assert Path(os.fspath(src)).read_bytes() == ex_bytes.to_bytes(ex_bytes.plan(pp.uses(pp.ids)))
    x = rng.standard_normal((4, 512)).astype(np.float32)
    assert run_model(Path(os.fspath(src)), x).shape == (4, 128)

    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "qdq_optuna", "tune", "--model", str(path), "--output", str(out),
         "--backend", "onnxruntime", "--mode", "quick", "--timing", "fast", "-q"],
        env=cli_env(**{FILE_EXPORT_ENV: "1024"}), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    onnx.checker.check_model(str(out / "optimized.onnx"))
    assert run_model(out / "optimized.onnx", x).shape == (4, 128)
    assert leftovers(out) == []
    assert folder_state(folder) == before


def test_tune_in_external_mode_survives_a_kill(tmp_path):
    """``tune`` with ONNX Runtime on a model in external mode: killed once part way, rerun to
    the end; the input folder is untouched, no work folder is left, the output runs."""
    model = small_external_model(tmp_path / "in")
    before = folder_state(tmp_path / "in")
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "qdq_optuna", "tune", "--model", str(model), "--output",
            str(out), "--backend", "onnxruntime", "--timing", "fast",
            "--schemes-per-region", "4", "-q"]
    env = cli_env(**{INLINE_EXTERNAL_ENV: "0"})
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None and not list(
            out.glob(".qdq_work.*")):
        time.sleep(0.05)
    time.sleep(0.5)
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.communicate()
    rerun = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert rerun.returncode == 0, rerun.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["complete"]
    assert leftovers(out) == []
    assert len(list(out.glob("optimized.onnx.*.data"))) == 1
    x = np.random.default_rng(2).standard_normal((4, 512)).astype(np.float32)
    onnx.checker.check_model(onnx.load(str(out / "optimized.onnx")))
    assert np.isfinite(run_model(out / "optimized.onnx", x)).all()
    assert folder_state(tmp_path / "in") == before


# -- slow: a model over 2 GB -------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.skipif(not SLOW, reason="slow: set QDQ_OPTUNA_SLOW=1 to run it")
def test_tune_a_model_over_2gb(tmp_path):
    """``tune --backend costmodel`` on 2.4 GB of weights; the tuned model loads in ONNX Runtime."""
    model, data_bytes = huge_external_model(tmp_path / "in")
    assert data_bytes > PROTOBUF_LIMIT
    before = folder_state(tmp_path / "in")
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "qdq_optuna", "tune", "--model", str(model), "--output",
            str(out), "--backend", "costmodel", "--schemes-per-region", "3", "-q"]
    started = time.monotonic()
    proc = subprocess.run(argv, cwd=REPO, env=cli_env(), capture_output=True, text=True,
                          timeout=900)
    elapsed = time.monotonic() - started
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    assert proc.returncode == 0, proc.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["complete"]
    assert leftovers(out) == []
    assert folder_state(tmp_path / "in") == before
    saved = out / "optimized.onnx"
    assert saved.stat().st_size < 1 << 20
    onnx.checker.check_model(str(saved))  # the path form: checks the external data file
    print(f"\n>2GB model ({data_bytes / 2**30:.2f} GiB): tune {elapsed:.1f} s, "
          f"peak RSS {peak_kib / 2**20:.2f} GiB, quantized weights "
          f"{report['quantized_weights']}")
    # ONNX Runtime loads the tuned model with its data file and runs it
    x = np.ones((4, 16384), np.float32)
    assert np.isfinite(run_model(saved, x)).all()
