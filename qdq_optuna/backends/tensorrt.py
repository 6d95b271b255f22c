"""TensorRT backend through its Python API (TensorRT 10.x and 11.x).

Design notes:

* Explicit quantization only: the network is strongly typed and no precision flags are set, so
  the Q/DQ placement under test is exactly what TensorRT builds. On 10.x strong typing is opted
  into with ``NetworkDefinitionCreationFlag.STRONGLY_TYPED``; 11.x always types strongly and
  deprecates that flag, so it is not passed there. Every layer then runs in its ONNX tensors'
  type: the high precision (FP16/BF16) is the model's own, converted beforehand
  (``qdq_optuna.model.precision``), never a builder flag (those are refused on strongly typed
  networks). FP32 layers still use TF32 tensor cores, which TensorRT enables by default.
* Logger, builder and runtime are created once, on the first ``load``, and reused for every
  build; so is the timing cache, which makes repeated builds of similar candidates fast and their
  tactic choice stable. It is saved atomically (temp file + ``os.replace``, merged with what other
  processes saved meanwhile) every ``save_cache_every`` builds and on :meth:`close`.
* Device memory, streams and events come from cuda-python (``cuda.bindings.runtime``, or the
  older ``cuda.cudart``): a small dependency that TensorRT's own samples use, with no framework.
* Timing: CUDA events around each ``execute_async_v3`` on one stream, one synchronisation at the
  end, so the figures are GPU time and host jitter between iterations does not enter them.
* A build cannot be interrupted from Python. ``build_timeout_s`` is enforced by running this
  backend inside :class:`~qdq_optuna.backends.isolated.IsolatedBackend` (``make_backend
  ("tensorrt")`` does so), which kills a worker that hangs or crashes and starts a fresh one.
"""

from __future__ import annotations

import collections
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from qdq_optuna.backends.base import (
    Backend,
    BackendError,
    BackendUnavailable,
    ModelSource,
    Runner,
)
from qdq_optuna.errors import OptionError

#: bytes per element for types ``trt.nptype`` cannot map
_ODD_SIZES = {"FP8": 1.0, "BF16": 2.0, "INT4": 0.5, "FP4": 0.5, "E8M0": 1.0, "UINT8": 1.0}


def import_cudart() -> Any:
    """The CUDA runtime bindings of cuda-python, whichever layout is installed."""
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        try:
            from cuda import cudart  # cuda-python < 12.6
        except ImportError as exc:
            raise BackendUnavailable(
                "the TensorRT backend needs cuda-python for device memory and timing "
                "(pip install cuda-python)"
            ) from exc
    return cudart


def _cuda(cudart: Any, result: Any, what: str) -> Any:
    """Unpack a cuda-python ``(err, *values)`` tuple, raising on error."""
    if not isinstance(result, tuple):
        result = (result,)
    err, values = result[0], result[1:]
    if err != cudart.cudaError_t.cudaSuccess:
        name = getattr(err, "name", str(err))
        raise BackendError(f"CUDA error in {what}: {name}")
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def cuda_device_count() -> int:
    """Visible CUDA devices, 0 where there are none or cuda-python is missing."""
    try:
        cudart = import_cudart()
        err, count = cudart.cudaGetDeviceCount()
    except Exception:
        return 0
    return int(count) if err == cudart.cudaError_t.cudaSuccess else 0


def _trt_major(trt: Any) -> int:
    try:
        return int(str(trt.__version__).split(".")[0])
    except ValueError:
        return 0


def _atomic_write(path: str, data: bytes) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class TensorRTBackend(Backend):
    """Builds a TensorRT engine per candidate and times it with CUDA events."""

    name = "tensorrt"
    #: an engine build costs seconds: time one engine repeatedly instead of rebuilding
    fresh_sessions = False

    def __init__(
        self,
        *,
        timing_cache: str | os.PathLike | None = None,
        plugins: Sequence[str | os.PathLike] = (),
        input_shapes: Mapping[str, Sequence[int]] | None = None,
        warmup: int = 10,
        build_timeout_s: float = 600,
        builder_optimization_level: int | None = None,
        workspace_mb: int | None = None,
        save_cache_every: int = 10,
        seed: int = 0,
    ) -> None:
        self.timing_cache = os.fspath(timing_cache) if timing_cache else None
        self.plugins = [os.path.abspath(os.fspath(p)) for p in plugins]
        for p in self.plugins:
            if not os.path.isfile(p):
                raise OptionError(f"--plugin {p}: no such file")
        self.input_shapes = {k: tuple(int(d) for d in v) for k, v in (input_shapes or {}).items()}
        self.warmup = int(warmup)
        #: enforced only when running isolated (see the module docstring)
        self.build_timeout_s = float(build_timeout_s)
        if builder_optimization_level is not None and not 0 <= builder_optimization_level <= 5:
            raise OptionError("--builder-optimization-level must be within 0-5")
        self.builder_optimization_level = builder_optimization_level
        self.workspace_mb = workspace_mb
        self.save_cache_every = max(1, int(save_cache_every))
        self.seed = int(seed)
        self._trt: Any = None
        self._cudart: Any = None
        self._logger: Any = None
        self._builder: Any = None
        self._runtime: Any = None
        self._cache: Any = None
        self._builds_since_save = 0
        self._device = ""
        self.builds = 0

    # -- lazy initialisation ---------------------------------------------------------------
    def _init(self) -> None:
        if self._builder is not None:
            return
        try:
            import tensorrt as trt
        except ImportError as exc:
            raise BackendUnavailable(
                "TensorRT's Python package is not installed (pip install tensorrt); "
                "use --backend trtexec with a TensorRT install, or onnxruntime on CPU"
            ) from exc
        if _trt_major(trt) < 10:
            raise BackendUnavailable(f"TensorRT {trt.__version__} is too old; need 10.x or newer")
        cudart = import_cudart()
        if cuda_device_count() < 1:
            raise BackendUnavailable("no CUDA device is visible to the TensorRT backend")
        props = _cuda(cudart, cudart.cudaGetDeviceProperties(0), "cudaGetDeviceProperties")
        raw_name = getattr(props, "name", b"")
        self._device = (
            raw_name.decode(errors="replace").rstrip("\0")
            if isinstance(raw_name, bytes)
            else str(raw_name)
        )
        logger = _make_logger(trt)
        trt.init_libnvinfer_plugins(logger, "")
        registry = trt.get_plugin_registry()
        for path in self.plugins:
            if registry.load_library(path) is None:
                raise BackendError(f"TensorRT could not load plugin library {path}")
        self._trt, self._cudart, self._logger = trt, cudart, logger
        self._builder = trt.Builder(logger)
        self._runtime = trt.Runtime(logger)
        self._cache = self._new_cache(self._read_cache_file())

    def _read_cache_file(self) -> bytes:
        if self.timing_cache and os.path.isfile(self.timing_cache):
            with open(self.timing_cache, "rb") as f:
                return f.read()
        return b""

    def _new_cache(self, data: bytes) -> Any:
        config = self._builder.create_builder_config()
        cache = config.create_timing_cache(data)
        if cache is None and data:  # corrupt or foreign file: start afresh
            cache = config.create_timing_cache(b"")
        return cache

    # -- build -----------------------------------------------------------------------------
    def _network_flags(self) -> int:
        trt = self._trt
        flag = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
        if flag is None or _trt_major(trt) >= 11:  # 11.x: always strongly typed, flag deprecated
            return 0
        return 1 << int(flag)

    def _parse(self, network: Any, model: ModelSource) -> None:
        trt = self._trt
        parser = trt.OnnxParser(network, self._logger)
        if isinstance(model, bytes):
            ok = parser.parse(model)
        else:  # a path: external weights are found next to it
            ok = parser.parse_from_file(os.fspath(model))
        if ok:
            return
        errors = []
        for i in range(parser.num_errors):
            err = parser.get_error(i)
            try:
                where = err.node_name() or err.node_operator()
                errors.append(f"{where}: {err.desc()}" if where else err.desc())
            except Exception:
                errors.append(str(err))
        detail = "; ".join(errors) or self._logger.tail()
        raise BackendError(f"TensorRT's ONNX parser rejected the model: {detail}")

    def _profile(self, network: Any, config: Any) -> None:
        dynamic = {}
        for i in range(network.num_inputs):
            tensor = network.get_input(i)
            shape = tuple(tensor.shape)
            given = self.input_shapes.get(tensor.name)
            if any(d < 0 for d in shape):
                if given is None:
                    raise BackendError(
                        f"input {tensor.name!r} has dynamic shape {list(shape)}; give its shape "
                        f"(e.g. --input-shape {tensor.name}:1x3x224x224)"
                    )
                dynamic[tensor.name] = given
        if dynamic:
            profile = self._builder.create_optimization_profile()
            for name, shape in dynamic.items():
                profile.set_shape(name, shape, shape, shape)
            config.add_optimization_profile(profile)

    def build(self, model: ModelSource, *, detailed: bool = False) -> bytes:
        """Serialized engine for ``model``; raises :class:`BackendError` with TensorRT's text.
        ``detailed``: layer details kept for the engine inspector (:meth:`what_ran`)."""
        self._init()
        trt = self._trt
        self._logger.clear()
        network = self._builder.create_network(self._network_flags())
        self._parse(network, model)
        config = self._builder.create_builder_config()
        if detailed:
            config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED
        if self.workspace_mb:
            config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(self.workspace_mb) << 20)
        if self.builder_optimization_level is not None:
            config.builder_optimization_level = int(self.builder_optimization_level)
        if self.plugins and hasattr(config, "plugins_to_serialize"):
            config.plugins_to_serialize = list(self.plugins)
        if self._cache is not None and not config.set_timing_cache(self._cache, False):
            # written by another TensorRT version or GPU: keep going with a fresh cache
            self._cache = config.create_timing_cache(b"")
            config.set_timing_cache(self._cache, False)
        self._profile(network, config)
        serialized = self._builder.build_serialized_network(network, config)
        if serialized is None:
            raise BackendError(f"TensorRT engine build failed: {self._logger.tail()}")
        self.builds += 1
        self._builds_since_save += 1
        if self._builds_since_save >= self.save_cache_every:
            self.save_timing_cache()
        return bytes(memoryview(serialized))

    def save_timing_cache(self) -> None:
        """Merge with the file (other processes may have added to it), then replace it."""
        if not self.timing_cache or self._cache is None:
            return
        on_disk = self._read_cache_file()
        if on_disk:
            other = self._new_cache(on_disk)
            if other is not None:
                self._cache.combine(other, True)
        _atomic_write(self.timing_cache, bytes(memoryview(self._cache.serialize())))
        self._builds_since_save = 0

    # -- Backend interface -----------------------------------------------------------------
    def load(self, model: ModelSource) -> Runner:
        plan = self.build(model)
        engine = self._runtime.deserialize_cuda_engine(plan)
        if engine is None:
            raise BackendError(f"TensorRT could not deserialize the engine: {self._logger.tail()}")
        runner = TensorRTRunner(self._trt, self._cudart, engine, self.input_shapes, self.seed)
        try:
            if self.warmup:
                runner.time(self.warmup, 0)  # lazy kernel loading, clocks
        except BaseException:
            runner.close()
            raise
        return runner

    def what_ran(self, model: bytes):
        """Read with TensorRT's engine inspector (``IEngineInspector``, layer information as
        JSON) from an engine built with detailed profiling verbosity: one build per standing
        model, never per trial."""
        import json

        import onnx

        engine = self._runtime.deserialize_cuda_engine(self.build(model, detailed=True))
        if engine is None:
            raise BackendError(f"TensorRT could not deserialize the engine: {self._logger.tail()}")
        inspector = engine.create_engine_inspector()
        info = json.loads(inspector.get_engine_information(
            self._trt.LayerInformationFormat.JSON))
        return what_engine_ran(info, onnx.load_from_string(model))

    def describe(self) -> dict:
        try:
            import tensorrt as trt

            version = str(trt.__version__)
        except ImportError:
            version = None
        return {
            "name": self.name,
            "tensorrt": version,
            "device": self._device or None,
            "plugins": list(self.plugins),
            "input_shapes": {k: list(v) for k, v in sorted(self.input_shapes.items())},
            "strongly_typed": True,
            "builder_optimization_level": self.builder_optimization_level,
            "workspace_mb": self.workspace_mb,
        }

    def close(self) -> None:
        if self._builder is not None:
            self.save_timing_cache()
        self._cache = None
        self._builder = None
        self._runtime = None


def _make_logger(trt: Any) -> Any:
    class _Logger(trt.ILogger):
        """Keeps the last messages so build failures can say why."""

        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self.messages: collections.deque[str] = collections.deque(maxlen=20)

        def log(self, severity: Any, msg: str) -> None:
            if int(severity) <= int(trt.ILogger.Severity.WARNING):
                self.messages.append(f"[{severity.name}] {msg}")

        def clear(self) -> None:
            self.messages.clear()

        def tail(self) -> str:
            errors = [m for m in self.messages if not m.startswith("[WARNING]")]
            return " | ".join((errors or list(self.messages))[-5:]) or "no message from TensorRT"

    return _Logger()


def _element_size(trt: Any, dtype: Any) -> tuple[float, Any]:
    try:
        np_type = np.dtype(trt.nptype(dtype))
        return float(np_type.itemsize), np_type
    except (TypeError, KeyError, ValueError):
        size = _ODD_SIZES.get(getattr(dtype, "name", str(dtype)).upper())
        if size is None:
            raise BackendError(f"tensor type {dtype} is not supported by the runner") from None
        return size, None


class TensorRTRunner(Runner):
    """One engine, its execution context, device buffers, a stream and timing events."""

    def __init__(
        self,
        trt: Any,
        cudart: Any,
        engine: Any,
        input_shapes: Mapping[str, Sequence[int]],
        seed: int = 0,
    ) -> None:
        self.trt, self.cudart, self.engine = trt, cudart, engine
        self.buffers: list[int] = []
        self.events: list[tuple[Any, Any]] = []
        self.stream: Any = None
        self.context = engine.create_execution_context()
        if self.context is None:
            raise BackendError("TensorRT could not create an execution context")
        try:
            self.stream = _cuda(cudart, cudart.cudaStreamCreate(), "cudaStreamCreate")
            self._allocate(input_shapes, np.random.default_rng(seed))
        except BaseException:
            self.close()
            raise

    def _allocate(self, input_shapes: Mapping[str, Sequence[int]], rng: Any) -> None:
        trt, cudart, engine, ctx = self.trt, self.cudart, self.engine, self.context
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        inputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        for name in inputs:
            shape = tuple(engine.get_tensor_shape(name))
            if any(d < 0 for d in shape):
                if name not in input_shapes:
                    raise BackendError(f"input {name!r} has dynamic shape {list(shape)}")
                ctx.set_input_shape(name, tuple(input_shapes[name]))
        for name in names:
            shape = tuple(ctx.get_tensor_shape(name))
            if any(d < 0 for d in shape):
                raise BackendError(f"tensor {name!r} has a data-dependent shape {list(shape)}")
            size, np_type = _element_size(trt, engine.get_tensor_dtype(name))
            count = math.prod(shape)
            nbytes = max(1, math.ceil(count * size))
            ptr = _cuda(cudart, cudart.cudaMalloc(nbytes), "cudaMalloc")
            self.buffers.append(int(ptr))
            if not ctx.set_tensor_address(name, int(ptr)):
                raise BackendError(f"TensorRT refused the address of tensor {name!r}")
            if name in inputs:
                if np_type is not None and np.issubdtype(np_type, np.floating):
                    host = rng.standard_normal(count).astype(np_type)
                else:  # integer, bool and packed types: zeros are always valid
                    host = np.zeros(nbytes, dtype=np.uint8)
                host = np.ascontiguousarray(host)
                kind = cudart.cudaMemcpyKind.cudaMemcpyHostToDevice
                _cuda(cudart, cudart.cudaMemcpy(int(ptr), host.ctypes.data, nbytes, kind), "copy")

    def _event_pairs(self, n: int) -> list[tuple[Any, Any]]:
        cudart = self.cudart
        while len(self.events) < n:
            start = _cuda(cudart, cudart.cudaEventCreate(), "cudaEventCreate")
            end = _cuda(cudart, cudart.cudaEventCreate(), "cudaEventCreate")
            self.events.append((start, end))
        return self.events[:n]

    def time(self, warmup: int, iterations: int) -> list[float]:
        if self.context is None:
            raise BackendError("runner used after close()")
        cudart, ctx, stream = self.cudart, self.context, self.stream
        handle = int(stream)
        for _ in range(warmup):
            if not ctx.execute_async_v3(handle):
                raise BackendError("TensorRT execute_async_v3 failed")
        pairs = self._event_pairs(iterations)
        for start, end in pairs:
            _cuda(cudart, cudart.cudaEventRecord(start, stream), "cudaEventRecord")
            if not ctx.execute_async_v3(handle):
                raise BackendError("TensorRT execute_async_v3 failed")
            _cuda(cudart, cudart.cudaEventRecord(end, stream), "cudaEventRecord")
        _cuda(cudart, cudart.cudaStreamSynchronize(stream), "cudaStreamSynchronize")
        elapsed = getattr(cudart, "cudaEventElapsedTime", None) or cudart.cudaEventElapsedTime_v2
        return [float(_cuda(cudart, elapsed(s, e), "cudaEventElapsedTime")) for s, e in pairs]

    def close(self) -> None:
        cudart = self.cudart
        if self.stream is not None:
            cudart.cudaStreamSynchronize(self.stream)
        for start, end in self.events:
            cudart.cudaEventDestroy(start)
            cudart.cudaEventDestroy(end)
        self.events = []
        for ptr in self.buffers:
            cudart.cudaFree(ptr)
        self.buffers = []
        if self.stream is not None:
            cudart.cudaStreamDestroy(self.stream)
            self.stream = None
        self.context = None
        self.engine = None


def what_engine_ran(info: Mapping, model: Any):
    """:class:`~qdq_optuna.backends.what_ran.WhatRan` from an engine inspector's JSON
    (``{"Layers": [{"Name", "LayerType", "Inputs": [{"Name", "Format/Datatype"}], "Outputs":
    [...]}]}``, detailed verbosity) for the Q/DQ ``model`` it was built from. A layer's name
    joins the ONNX nodes fused into it with " + ": a layer made of Q/DQ nodes only ran them
    standalone; a Reformat layer reformats its input; a layer with a float output that reads
    or writes a quantized tensor, and names compute nodes of the model, is a float island."""
    from qdq_optuna.backends.what_ran import WhatRan, quantized_tensors

    quantized = quantized_tensors(model)
    qdq_nodes = {n.name: quantized.get(n.input[0]) for n in model.graph.node
                 if n.op_type in ("QuantizeLinear", "DequantizeLinear")}
    compute = {n.name for n in model.graph.node if n.name and n.name not in qdq_nodes}
    standalone, float_nodes, reformats = set(), set(), set()
    for layer in info.get("Layers", []):
        if isinstance(layer, str):  # names only: the engine was not built DETAILED
            continue
        parts = [p.strip() for p in str(layer.get("Name", "")).split(" + ")]
        tensors = [t.get("Name", "") for t in (*layer.get("Inputs", []),
                                                 *layer.get("Outputs", []))]
        if parts and all(p in qdq_nodes for p in parts):
            standalone |= {qdq_nodes[p] for p in parts if qdq_nodes[p]}
        elif layer.get("LayerType") == "Reformat":
            reformats |= {quantized.get(t.get("Name", ""), t.get("Name", ""))
                          for t in layer.get("Inputs", [])}
        else:
            out_formats = " ".join(str(t.get("Format/Datatype", ""))
                                   for t in layer.get("Outputs", []))
            if "Int8" not in out_formats and "INT8" not in out_formats and \
                    any(t in quantized for t in tensors):
                float_nodes |= {p for p in parts if p in compute}
    fused = set(quantized.values()) - {None} - standalone
    return WhatRan("TensorRT engine inspector (detailed)", fused=frozenset(fused),
                   standalone=frozenset(standalone), float_nodes=frozenset(float_nodes),
                   reformats=frozenset(reformats))
