"""OpenVINO backend: the CPU plugin, one inference thread and the latency hint by default.

OpenVINO reads ONNX Q/DQ models directly and its low-precision transformations turn the
QuantizeLinear/DequantizeLinear pairs into u8/i8 kernels, so placement matters there (unlike
ONNX Runtime CPU, where "every point on" is nearly always best). Every measurement round gets a
freshly compiled model, as with ONNX Runtime sessions. Compiling is not cheap (a real YOLOv8n
int8: 1.3-1.6 s, three quarters of a 12-round A/B), so each backend keeps OpenVINO's own model
cache (``CACHE_DIR``, a temporary folder of its own): a model compiled again is imported from
its blob (0.2-0.4 s), a new CompiledModel with its own memory, the same kernels.

The float part's precision is OpenVINO's ``INFERENCE_PRECISION_HINT``: on CPUs with
AVX512-BF16 OpenVINO's default is bf16, which was measured *slower* than f32 on some of these
machines (YOLOv8n 22.0 vs 13.3 ms) and about twice as fast on others (10.5 vs 5.6 ms), so a run
times the user's float model at each hint the CPU offers and keeps the faster
(:func:`choose_precision`); a backend built directly defaults to f32.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from qdq_optuna.backends.base import (
    Backend,
    BackendError,
    BackendUnavailable,
    ModelSource,
    Runner,
    time_calls,
)
from qdq_optuna.backends.what_ran import WhatRan
from qdq_optuna.errors import OptionError, install_hint
from qdq_optuna.machine import current_cpu

#: ``--high-precision`` names -> OpenVINO's INFERENCE_PRECISION_HINT
PRECISION_HINTS: Mapping[str, str] = {"fp32": "f32", "f32": "f32", "bf16": "bf16",
                                      "fp16": "f16", "f16": "f16"}
#: the capability OPTIMIZATION_CAPABILITIES must list for each hint
_CAPABILITY = {"f32": "FP32", "bf16": "BF16", "f16": "FP16"}
PERFORMANCE_HINTS = ("LATENCY", "THROUGHPUT")
#: compiled-model blobs kept in a backend's cache folder (a real YOLOv8n's is 3.8 MB); past
#: this the older half is deleted
MAX_CACHED_BLOBS = 48
#: layer types whose int8 execution is what quantization buys
_COMPUTE = frozenset({"Convolution", "FullyConnected", "MatMul", "Deconvolution",
                      "GroupConvolution", "Eltwise", "Pooling", "Concatenation", "Interpolate"})


def _openvino() -> Any:
    try:
        import openvino as ov  # lazy: keeps `import qdq_optuna` light
    except ImportError as exc:
        raise BackendUnavailable(
            f"the openvino backend needs the openvino package ({install_hint('openvino')})"
        ) from exc
    return ov


def _message(exc: BaseException, limit: int = 400) -> str:
    """OpenVINO's error on one line: its text starts with one "Exception from FILE:LINE:" line
    per layer it passed through; what went wrong is in the lines after them."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    said = [ln for ln in lines if not ln.startswith("Exception from ")]
    text = " ".join(said or lines) or type(exc).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."


def precision_hint(name: str) -> str:
    """OpenVINO's INFERENCE_PRECISION_HINT for ``--high-precision NAME`` (fp32/bf16/fp16)."""
    try:
        return PRECISION_HINTS[name.lower()]
    except KeyError:
        raise OptionError(f"--high-precision {name!r} has no OpenVINO inference precision "
                          f"(choose from fp32, bf16, fp16)") from None


def supported_hints(core: Any = None) -> tuple[str, ...]:
    """The inference precision hints the CPU offers (from OPTIMIZATION_CAPABILITIES); on a
    simulated CPU (:func:`qdq_optuna.machine.current_cpu`) f32, and bf16 where it has bf16
    (OpenVINO compiles a hint the real CPU lacks at f32, so both paths still run)."""
    cpu = current_cpu()
    if cpu.source == "simulated":
        return ("f32", "bf16") if cpu.bf16 else ("f32",)
    core = core if core is not None else _openvino().Core()
    caps = set(core.get_property("CPU", "OPTIMIZATION_CAPABILITIES"))
    return tuple(h for h, cap in _CAPABILITY.items() if cap in caps)


def fastest_precision(model: ModelSource, *, input_shapes: Mapping[str, Sequence[int]] | None
                      = None, threads: int = 1, rounds: int = 5, runs: int = 10
                      ) -> tuple[str, dict[str, float]]:
    """The inference precision hint the user's float ``model`` runs fastest at on this CPU,
    and each supported hint's milliseconds (median over ``rounds`` of the minimum of ``runs``
    inferences, hints interleaved, a fresh compiled model each round). With one supported hint
    (a CPU without AVX512-BF16/AMX-FP16: f32 only) nothing is timed and its time is absent."""
    core = _openvino().Core()
    hints = supported_hints(core)
    if len(hints) == 1:
        return hints[0], {}
    backends = {h: OpenVinoBackend(threads=threads, precision=h, input_shapes=input_shapes)
                for h in hints}
    best: dict[str, list[float]] = {h: [] for h in hints}
    for r in range(int(rounds)):
        for i in range(len(hints)):
            h = hints[(r + i) % len(hints)]
            with backends[h].load(model) as runner:
                best[h].append(min(runner.time(2, runs)))
    ms = {h: round(float(np.median(v)), 4) for h, v in best.items()}
    return min(ms, key=ms.__getitem__), ms


def choose_precision(model: ModelSource, requested: str | None, **kwargs: Any
                     ) -> tuple[str, str]:
    """``(hint, why)`` for the float part: the requested one (``--high-precision``), else the
    faster of the hints this CPU supports on the user's float ``model``
    (:func:`fastest_precision`)."""
    if requested is not None:
        return precision_hint(requested), f"--high-precision {requested}"
    try:
        hint, ms = fastest_precision(model, **kwargs)
    except BackendError as exc:  # e.g. a dynamic input without --input-shapes: f32 as before
        return "f32", f"f32: the float model could not be timed at each hint ({exc})"
    if not ms:
        return hint, f"{hint}: the only inference precision this CPU offers OpenVINO"
    times = ", ".join(f"{h} {v:.3f} ms" for h, v in sorted(ms.items(), key=lambda kv: kv[1]))
    return hint, f"{hint}: the faster on the float model ({times})"


class OpenVinoBackend(Backend):
    """Times ``InferRequest.infer`` on a model compiled for the CPU plugin."""

    def __init__(
        self,
        *,
        threads: int = 1,
        performance_hint: str = "LATENCY",
        precision: str = "f32",
        input_shapes: Mapping[str, Sequence[int]] | None = None,
        input_data: Mapping[str, np.ndarray] | None = None,
        seed: int = 0,
        device: str = "CPU",
        name: str | None = None,
        precision_why: str | None = None,
    ) -> None:
        if int(threads) < 1:
            raise OptionError(f"--threads must be >= 1, got {threads}")
        hint = str(performance_hint).upper()
        if hint not in PERFORMANCE_HINTS:
            raise OptionError(f"OpenVINO performance_hint must be one of "
                              f"{', '.join(PERFORMANCE_HINTS)}, got {performance_hint!r}")
        self._ov = _openvino()
        self.core = self._ov.Core()
        self.cache_dir = Path(tempfile.mkdtemp(prefix="qdq-openvino-cache-"))
        self.core.set_property({"CACHE_DIR": str(self.cache_dir)})
        weakref.finalize(self, shutil.rmtree, self.cache_dir, True)
        if device not in self.core.available_devices:
            raise BackendUnavailable(f"OpenVINO {self._ov.__version__} has no {device} device "
                                     f"(available: {', '.join(self.core.available_devices)})")
        self.precision = precision_hint(precision)
        if device == "CPU" and self.precision not in supported_hints(self.core):
            raise BackendUnavailable(
                f"this CPU offers no {self.precision} inference precision to OpenVINO "
                f"(it offers {', '.join(supported_hints(self.core))})")
        self.threads = int(threads)
        self.performance_hint = hint
        self.device = device
        self.input_shapes = {k: tuple(int(d) for d in v) for k, v in (input_shapes or {}).items()}
        self.input_data = {k: np.asarray(v) for k, v in (input_data or {}).items()}
        self.seed = int(seed)
        self.name = name or "openvino"
        #: why the float part runs at this hint (``choose_precision``'s sentence)
        self.precision_why = precision_why or "given"

    def describe(self) -> dict:
        return {"name": self.name, "openvino": self._ov.__version__, "device": self.device,
                "threads": self.threads, "performance_hint": self.performance_hint,
                "inference_precision": self.precision,
                "inference_precision_why": self.precision_why,
                "input_shapes": {k: list(v) for k, v in sorted(self.input_shapes.items())},
                "input_data": sorted(self.input_data), "seed": self.seed,
                # what every measurement and the guard compiled with: a check of the shipped
                # file compiles with the same (OpenVINO's bf16 kernels differ by thread count)
                "properties": self.config(),
                "how_to_run": "openvino.Core().compile_model('optimized.onnx', 'CPU', "
                              f"{self.config()!r})"}

    def config(self) -> dict[str, str]:
        """The compile_model properties every measurement uses (also the shipped how-to-run)."""
        return {"INFERENCE_NUM_THREADS": str(self.threads),
                "PERFORMANCE_HINT": self.performance_hint,
                "INFERENCE_PRECISION_HINT": self.precision}

    def compile(self, model: ModelSource, extra: Mapping[str, str] | None = None) -> Any:
        """The model compiled with :meth:`config` and ``extra`` properties (a BackendError when
        OpenVINO refuses it)."""
        self._trim_cache()
        try:
            if isinstance(model, bytes):
                read = self.core.read_model(model, b"")  # ONNX bytes: no separate weights
            else:
                read = self.core.read_model(os.fspath(model))
            # only the inputs this model has: a unit cut out of the run's model (the kernel
            # table's) reads other tensors, and OpenVINO refuses a reshape of an input it
            # lacks ("Input for tensor name ... is not found")
            names = {n for port in read.inputs for n in port.get_names()}
            shapes = {k: list(v) for k, v in self.input_shapes.items() if k in names}
            if shapes:
                read.reshape(shapes)
            return self.core.compile_model(read, self.device, {**self.config(), **(extra or {})})
        except Exception as exc:  # OpenVINO raises RuntimeError subclasses of its own
            raise BackendError(f"OpenVINO could not compile the model: {_message(exc)}") from exc

    def outputs(self, model: ModelSource, data: Mapping[str, np.ndarray]
                ) -> dict[str, np.ndarray]:
        """Every output of ``model`` compiled as the timings compile it, one sample of ``data``
        at a time (samples on axis 0), concatenated: the values an OpenVINO deployment computes
        (the accuracy guard's candidates on OpenVINO runs)."""
        compiled = self.compile(model)
        count = len(next(iter(data.values()))) if data else 0
        parts: dict[str, list[np.ndarray]] = {}
        for i in range(count):
            result = compiled({name: np.asarray(v[i:i + 1]) for name, v in data.items()})
            for port in compiled.outputs:
                parts.setdefault(port.get_any_name(), []).append(np.asarray(result[port]))
        return {name: np.concatenate(chunks, axis=0) if chunks[0].ndim else np.stack(chunks)
                for name, chunks in parts.items()}

    def _trim_cache(self) -> None:
        blobs = sorted(self.cache_dir.glob("*.blob"), key=lambda f: f.stat().st_mtime)
        if len(blobs) > MAX_CACHED_BLOBS:
            for old in blobs[:len(blobs) // 2]:
                old.unlink(missing_ok=True)

    def load(self, model: ModelSource) -> Runner:
        compiled = self.compile(model)
        return OpenVinoRunner(compiled, self._make_inputs(compiled))

    def _make_inputs(self, compiled: Any) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(self.seed)
        feeds: dict[str, np.ndarray] = {}
        for port in compiled.inputs:
            name = port.get_any_name()
            if name in self.input_data:
                feeds[name] = self.input_data[name]
                continue
            if port.get_partial_shape().is_dynamic:
                raise BackendError(f"input {name!r} has dynamic shape {port.get_partial_shape()}; "
                                   f"give its shape (e.g. --input-shape {name}:1x3x224x224)")
            shape = tuple(int(d) for d in port.get_shape())
            dtype = port.get_element_type().to_dtype()
            if np.issubdtype(dtype, np.floating):
                feeds[name] = rng.standard_normal(shape).astype(dtype)
            else:
                feeds[name] = np.zeros(shape, dtype=dtype)
        return feeds

    def profile(self, model: ModelSource, runs: int = 50, warmup: int = 5
                ) -> list[dict[str, Any]]:
        """Per runtime layer, OpenVINO's own timing (``PERF_COUNT``): name, ``layer_type``,
        ``exec_type`` (the kernel, e.g. ``jit_avx2_I8``, ``brgconv_avx2_1x1_f32``) and
        ``min_us``, the minimum over ``runs`` inferences (robust to a shared machine's
        interruptions), in execution order. Executed layers only."""
        compiled = self.compile(model, {"PERF_COUNT": "YES"})
        request = compiled.create_infer_request()
        for name, value in self._make_inputs(compiled).items():
            request.set_tensor(name, _tensor(value))
        best: dict[str, dict[str, Any]] = {}
        for i in range(warmup + runs):
            request.infer()
            if i < warmup:
                continue
            for info in request.get_profiling_info():
                if str(info.status).endswith("NOT_RUN"):
                    continue
                us = info.real_time.total_seconds() * 1e6
                row = best.setdefault(info.node_name, {
                    "name": info.node_name, "layer_type": info.node_type,
                    "exec_type": info.exec_type, "min_us": us})
                row["min_us"] = min(row["min_us"], us)
        return list(best.values())

    def what_ran(self, model: bytes) -> WhatRan | None:
        """Which layers OpenVINO's CPU plugin ran in u8/i8, read from the compiled model's
        runtime graph (see :func:`read_what_ran`)."""
        return read_what_ran(self.compile(model).get_runtime_model(), model)


class OpenVinoRunner(Runner):
    """One compiled model, its infer request and inputs; ``time`` wraps each ``infer``."""

    def __init__(self, compiled: Any, feeds: dict[str, np.ndarray]) -> None:
        self.compiled = compiled
        self.request = compiled.create_infer_request()
        self.feeds = feeds
        for name, value in feeds.items():  # set once: timing covers inference, not copies
            self.request.set_tensor(name, _tensor(value))

    def time(self, warmup: int, iterations: int) -> list[float]:
        if self.request is None:
            raise BackendError("runner used after close()")
        return time_calls(self.request.infer, warmup, iterations, "OpenVINO")

    def close(self) -> None:
        self.request = None
        self.compiled = None
        self.feeds = {}


def _tensor(value: np.ndarray) -> Any:
    import openvino as ov

    return ov.Tensor(np.ascontiguousarray(value))


# -- what ran -------------------------------------------------------------------------------
def _info(op: Any) -> dict[str, str]:
    rt = op.get_rt_info()
    return {k: str(rt[k].astype(str)) if hasattr(rt[k], "astype") else str(rt[k])
            for k in ("layerType", "runtimePrecision", "originalLayersNames", "outputPrecisions")
            if k in rt}


def _originals(info: Mapping[str, str]) -> list[str]:
    return [n for n in info.get("originalLayersNames", "").split(",") if n]


def runtime_layers(runtime_model: Any) -> list[dict[str, str]]:
    """Each layer of OpenVINO's runtime graph: name, layerType, runtimePrecision,
    originalLayersNames (the ONNX node names it executes)."""
    return [{"name": op.get_friendly_name(), **_info(op)} for op in runtime_model.get_ordered_ops()]


def _integer(info: Mapping[str, str]) -> bool:
    return info.get("runtimePrecision", "").lower() in ("u8", "i8")


class _OnnxNames:
    """The exported ONNX model's node names -> the float tensors they stand for."""

    def __init__(self, model: bytes) -> None:
        import onnx

        proto = onnx.load_from_string(model)
        producer = {o: n for n in proto.graph.node for o in n.output}
        self.tensor: dict[str, str] = {}
        self.compute: set[str] = set()
        for node in proto.graph.node:
            if node.op_type == "QuantizeLinear":
                self.tensor[node.name] = node.input[0]
            elif node.op_type == "DequantizeLinear":
                q = producer.get(node.input[0])
                if q is not None and q.op_type == "QuantizeLinear":
                    self.tensor[node.name] = q.input[0]
            elif node.output:
                self.tensor[node.name] = node.output[0]
                self.compute.add(node.name)

    def quantized(self, names: list[str]) -> set[str]:
        return {self.tensor[n] for n in names if n in self.tensor and n not in self.compute}


def read_what_ran(runtime_model: Any, model: bytes) -> WhatRan:
    """The :class:`WhatRan` of a compiled model's runtime graph, named in the exported ONNX
    model ``model``. A layer lists the ONNX nodes it executes in originalLayersNames: a
    QuantizeLinear folded into a layer that runs u8/i8 (a Convolution writing u8) is fused;
    one that runs in a float layer of its own (a ``Subgraph`` or FakeQuantize computing the
    rounding in f32) is standalone; Reorder/Convert layers are reformats of the tensor their
    source layer writes; compute nodes in f32 layers, when integer layers ran too, are float;
    the model's nodes an u8/i8 layer executes ran integer."""
    names = _OnnxNames(model)
    layers = list(runtime_model.get_ordered_ops())
    fused, standalone, floats, reformats = set(), set(), set(), set()
    integer, not_integer = set(), set()  # the model's nodes, by the layers that ran them
    integer_seen = False
    for op in layers:
        info = _info(op)
        layer, originals = info.get("layerType", ""), _originals(info)
        if layer in ("Reorder", "Convert"):
            for port in op.inputs():
                source = _originals(_info(port.get_source_output().get_node()))
                reformats.update(names.quantized(source) or
                                 {names.tensor[n] for n in source if n in names.tensor})
        elif layer in ("Const", "Input", "Parameter", "Output", "Result"):
            continue
        elif _integer(info):
            integer_seen = True
            fused.update(names.quantized(originals))
            integer.update(n for n in originals if n in names.compute)
        else:
            standalone.update(names.quantized(originals))
            not_integer.update(n for n in originals if n in names.compute)
            if layer in _COMPUTE:
                floats.update(n for n in originals if n in names.compute)
    return WhatRan(how="OpenVINO CPU runtime graph (get_runtime_model: layerType, "
                       "runtimePrecision, originalLayersNames)",
                   fused=frozenset(fused - standalone), standalone=frozenset(standalone),
                   float_nodes=frozenset(floats) if integer_seen else frozenset(),
                   integer_nodes=frozenset(integer - not_integer),
                   reformats=frozenset(reformats))
