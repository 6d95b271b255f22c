"""OpenVINO backend: Intel's runtime on the CPU, reading the Q/DQ ONNX model directly.

OpenVINO turns each QuantizeLinear -> DequantizeLinear pair into a FakeQuantize and its
low-precision transformations decide which layers then run in u8/i8; where Q/DQ sit decides
that, so placements tuned for another runtime do not carry over. The float part's precision
is a compile-time hint here (``INFERENCE_PRECISION_HINT``), not a graph conversion: the run's
``--high-precision`` maps onto it. One inference thread and one stream by default: single-
thread latency ranks candidates reliably on small shared machines (as for ONNX Runtime).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from qdq_optuna.backends.base import Backend, BackendError, BackendUnavailable, ModelSource, Runner
from qdq_optuna.backends.what_ran import WhatRan
from qdq_optuna.errors import OptionError

#: ``--high-precision`` -> OpenVINO's ``INFERENCE_PRECISION_HINT`` and the CPU capability
#: (``OPTIMIZATION_CAPABILITIES``) it needs
PRECISION_HINTS: Mapping[str, tuple[str, str]] = {
    "fp32": ("f32", "FP32"), "bf16": ("bf16", "BF16"), "fp16": ("f16", "FP16"),
}
PERFORMANCE_HINTS = ("LATENCY", "THROUGHPUT")

_INSTALL = "pip install 'qdq-optuna[openvino]' (or: pip install openvino)"


def _openvino() -> Any:
    try:
        import openvino
    except ImportError as exc:
        raise BackendUnavailable(f"the openvino backend needs the openvino package: {_INSTALL}"
                                 ) from exc
    return openvino


def cpu_capabilities() -> list[str]:
    """What this CPU computes natively in OpenVINO (``FP32``, ``BF16``, ``FP16``, ``INT8``)."""
    return list(_openvino().Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES"))


class OpenVINOBackend(Backend):
    """Times ``InferRequest.infer`` of a freshly compiled model, inputs generated once."""

    def __init__(
        self,
        *,
        threads: int = 1,
        high_precision: str | None = None,
        performance_hint: str = "LATENCY",
        input_shapes: Mapping[str, Sequence[int]] | None = None,
        input_data: Mapping[str, np.ndarray] | None = None,
        seed: int = 0,
        device: str = "CPU",
    ) -> None:
        if int(threads) < 1:
            raise OptionError(f"--threads must be >= 1, got {threads}")
        precision = high_precision or "fp32"
        if precision not in PRECISION_HINTS:
            raise OptionError(f"--high-precision {precision}: OpenVINO takes "
                              f"{', '.join(PRECISION_HINTS)}")
        if performance_hint not in PERFORMANCE_HINTS:
            raise OptionError(f"OpenVINO performance hint must be one of "
                              f"{', '.join(PERFORMANCE_HINTS)}, got {performance_hint!r}")
        ov = _openvino()
        self._ov = ov
        self._core = ov.Core()
        hint, capability = PRECISION_HINTS[precision]
        offered = list(self._core.get_property(device, "OPTIMIZATION_CAPABILITIES"))
        if capability not in offered:
            raise OptionError(f"--high-precision {precision}: this {device} does not offer "
                              f"{capability} in OpenVINO (it offers {', '.join(offered)})")
        self.name = "openvino"
        self.device = device
        self.threads = int(threads)
        self.precision = precision
        self.hint = hint
        self.performance_hint = performance_hint
        self.input_shapes = {k: tuple(int(d) for d in v) for k, v in (input_shapes or {}).items()}
        self.input_data = {k: np.asarray(v) for k, v in (input_data or {}).items()}
        self.seed = int(seed)

    def config(self) -> dict[str, Any]:
        """The compile properties every model is compiled with."""
        return {"INFERENCE_NUM_THREADS": self.threads, "NUM_STREAMS": 1,
                "INFERENCE_PRECISION_HINT": self.hint, "PERFORMANCE_HINT": self.performance_hint}

    def describe(self) -> dict:
        return {"name": self.name, "openvino": self._ov.__version__, "device": self.device,
                "threads": self.threads, "inference_precision_hint": self.hint,
                "performance_hint": self.performance_hint,
                "input_shapes": {k: list(v) for k, v in sorted(self.input_shapes.items())},
                "input_data": sorted(self.input_data), "seed": self.seed,
                "how_to_run": f"openvino.Core().compile_model('optimized.onnx', "
                              f"'{self.device}', {self.config()!r})"}

    def compile(self, model: ModelSource) -> Any:
        """The compiled model (read straight from the ONNX bytes or file)."""
        try:
            source = model if isinstance(model, bytes) else str(model)
            read = self._core.read_model(source)
            return self._core.compile_model(read, self.device, self.config())
        except Exception as exc:  # OpenVINO raises RuntimeError and its own types
            text = str(exc).strip().splitlines()
            raise BackendError(f"OpenVINO could not compile the model: "
                               f"{text[0] if text else type(exc).__name__}") from exc

    def load(self, model: ModelSource) -> Runner:
        compiled = self.compile(model)
        return OpenVINORunner(compiled, self._make_inputs(compiled))

    def what_ran(self, model: ModelSource) -> WhatRan:
        """Read from the compiled model's runtime graph: which layers ran in u8/i8, which
        FakeQuantize stayed a layer of its own, where Reorders convert precision."""
        return runtime_graph_report(self.compile(model).get_runtime_model())

    def _make_inputs(self, compiled: Any) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(self.seed)
        feeds: dict[str, np.ndarray] = {}
        for port in compiled.inputs:
            name = port.get_any_name()
            if name in self.input_data:
                feeds[name] = self.input_data[name]
                continue
            shape = self.input_shapes.get(name)
            if shape is None:
                pshape = port.get_partial_shape()
                if pshape.is_dynamic:
                    raise BackendError(f"input {name!r} has dynamic shape {pshape}; give its "
                                       f"shape (e.g. --input-shapes {name}:1x3x224x224)")
                shape = tuple(int(d) for d in pshape.to_shape())
            dtype = np.dtype(port.get_element_type().to_dtype())
            feeds[name] = (rng.standard_normal(shape).astype(dtype)
                           if np.issubdtype(dtype, np.floating) else np.zeros(shape, dtype))
        return feeds


class OpenVINORunner(Runner):
    """One compiled model's infer request and its inputs."""

    def __init__(self, compiled: Any, feeds: dict[str, np.ndarray]) -> None:
        self.compiled = compiled
        self.request = compiled.create_infer_request()
        self.feeds = feeds

    def time(self, warmup: int, iterations: int) -> list[float]:
        if self.request is None:
            raise BackendError("runner used after close()")
        infer, feeds, clock = self.request.infer, self.feeds, time.perf_counter
        out: list[float] = []
        try:
            for _ in range(warmup):
                infer(feeds)
            for _ in range(iterations):
                t0 = clock()
                infer(feeds)
                out.append((clock() - t0) * 1e3)
        except Exception as exc:  # OpenVINO's own exception types
            raise BackendError(f"OpenVINO inference failed: {str(exc).strip()}") from exc
        return out

    def close(self) -> None:
        self.request = None
        self.compiled = None
        self.feeds = {}


# -- what ran ---------------------------------------------------------------------------------
_INTEGER = {"u8", "i8", "u4", "i4"}
#: runtime layers that compute (their precision says whether the work ran in integers)
_COMPUTE = {"Convolution", "FullyConnected", "MatMul", "Deconvolution", "Eltwise", "Pooling",
            "Interpolate", "Concatenation", "Reduce", "Subgraph", "MVN"}


_Q_SUFFIX = "_QuantizeLinear"


def _rt(op: Any, key: str) -> str:
    info = op.get_rt_info()
    return info[key].astype(str) if key in info else ""


def runtime_graph_report(runtime_model: Any) -> WhatRan:
    """:class:`WhatRan` of an OpenVINO runtime model. The runtime model names each layer by
    the ONNX nodes it came from (``originalLayersNames``): a FakeQuantize folded into an
    integer layer leaves no layer of its own; one that stays is a standalone quantize; a
    compute layer in f32/bf16 between integer neighbours is a float island; a Reorder that
    changes precision is a reformat."""
    fused, standalone, floats, reformats = set(), set(), set(), set()
    ops = list(runtime_model.get_ordered_ops())
    precision = {op.get_friendly_name(): _rt(op, "runtimePrecision") for op in ops}
    for op in ops:
        kind, prec = _rt(op, "layerType"), _rt(op, "runtimePrecision")
        names = [n for n in _rt(op, "originalLayersNames").split(",") if n]
        # the exporter names a tensor's QuantizeLinear TENSOR_QuantizeLinear
        quantized = [n[:-len(_Q_SUFFIX)] for n in names if n.endswith(_Q_SUFFIX)]
        if kind == "FakeQuantize":
            standalone.update(quantized)
        elif kind == "Reorder":
            ins = [precision.get(i.get_source_output().get_node().get_friendly_name(), "")
                   for i in op.inputs()]
            if any(p and p != prec for p in ins):
                reformats.add(op.get_friendly_name())
        elif kind in _COMPUTE:
            if prec in _INTEGER:
                fused.update(quantized)
            else:
                neighbours = [precision.get(i.get_source_output().get_node().get_friendly_name(),
                                            "") for i in op.inputs()]
                if any(p in _INTEGER for p in neighbours):
                    floats.update(names)
    return WhatRan("OpenVINO runtime model (layerType, runtimePrecision)", frozenset(fused),
                   frozenset(standalone), frozenset(floats), frozenset(reformats))
