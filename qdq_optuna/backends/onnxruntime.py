"""ONNX Runtime backend: CPU by default, CUDA / TensorRT execution providers on request.

Defaults follow the measured noise figures: one intra-op thread ranks candidates far more
reliably than two on small machines, and ``session.qdqisint8allowed`` is never set because its
int8 x int8 kernels run slower than FP32 on common x86 CPUs.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time
import weakref
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from qdq_optuna.backends.base import (
    Backend,
    BackendError,
    BackendUnavailable,
    Configured,
    ModelSource,
    Runner,
    time_calls,
)
from qdq_optuna.errors import OptionError

_OPT_LEVELS = {
    "disabled": "ORT_DISABLE_ALL",
    "basic": "ORT_ENABLE_BASIC",
    "extended": "ORT_ENABLE_EXTENDED",
    "all": "ORT_ENABLE_ALL",
}

_DTYPES = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(double)": np.float64,
    "tensor(int8)": np.int8,
    "tensor(uint8)": np.uint8,
    "tensor(int16)": np.int16,
    "tensor(uint16)": np.uint16,
    "tensor(int32)": np.int32,
    "tensor(uint32)": np.uint32,
    "tensor(int64)": np.int64,
    "tensor(uint64)": np.uint64,
    "tensor(bool)": np.bool_,
}

#: ``make_backend`` names for the execution-provider presets
PROVIDER_PRESETS: dict[str, tuple[str, ...]] = {
    "onnxruntime": ("CPUExecutionProvider",),
    "ort-cuda": ("CUDAExecutionProvider", "CPUExecutionProvider"),
    "ort-trt": ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"),
}

_GPU_HINT = "install onnxruntime-gpu (in place of onnxruntime) with matching CUDA libraries"

ProviderSpec = str | tuple[str, Mapping[str, Any]]

#: a model whose session took at least this long to create is, from its second load on,
#: loaded from ONNX Runtime's own optimized copy of it (:class:`OptimizedCopies`)
COPY_AFTER_S = 0.05
#: how many optimized copies a backend keeps (the least recently loaded goes first)
COPIES_KEPT = 8
#: the temporary folders of optimized copies: this prefix, then the owning process's id
COPIES_PREFIX = "qdq-optuna-sessions-"


class OptimizedCopies:
    """ONNX Runtime's optimized graph of a model, kept on disk, so a model loaded again (an
    A/B creates fresh sessions of the same two models every round) skips the graph
    optimizations that most of a session's creation is: its second load writes the copy
    (``SessionOptions.optimized_model_filepath``), its later loads read it with every
    optimization off, under the same session config entries. ONNX Runtime writes such a copy
    for the machine it runs on, which is the machine that times it. What it saves
    (``benchmarks/optimized_copy.py``, ``benchmarks/results/optimized_copy.md``): sessions of
    a 4,755-node decoder and of the tuned DenseNet-121 at a fraction of their creation time,
    at the same latency. CPU only, and only for models passed as bytes (a path's external
    data stays where it is)."""

    def __init__(self, limit: int = COPIES_KEPT) -> None:
        self.limit = limit
        self._folder: str | None = None
        #: key -> the copy's path (most recently loaded last)
        self._copies: OrderedDict[str, str] = OrderedDict()
        #: key -> seconds its last plain creation took
        self._created: dict[str, float] = {}
        self.loaded_from_copy = 0

    @staticmethod
    def key(model: bytes, entries: tuple[tuple[str, str], ...]) -> str:
        digest = hashlib.blake2b(model, digest_size=16)
        digest.update(repr(entries).encode())
        return digest.hexdigest()

    def copy(self, key: str) -> str | None:
        """The copy to load for ``key`` (None: none yet)."""
        path = self._copies.get(key)
        if path is not None:
            self._copies.move_to_end(key)
        return path

    def to_write(self, key: str) -> str | None:
        """Where this load writes its copy: only for a model loaded before whose creation
        took :data:`COPY_AFTER_S` or more (None: no copy)."""
        if key not in self._created or self._created[key] < COPY_AFTER_S:
            return None
        if self._folder is None:
            remove_orphaned_copies()
            self._folder = tempfile.mkdtemp(prefix=f"{COPIES_PREFIX}{os.getpid()}-")
            weakref.finalize(self, shutil.rmtree, self._folder, True)
        return os.path.join(self._folder, f"{key}.onnx")

    def created(self, key: str, seconds: float, written: str | None) -> None:
        self._created[key] = seconds
        if written is not None and os.path.isfile(written):
            self._copies[key] = written
            while len(self._copies) > self.limit:
                _, old = self._copies.popitem(last=False)
                _remove(old)

    def forget(self, key: str) -> None:
        """A copy ONNX Runtime could not load: loaded from the model again."""
        path = self._copies.pop(key, None)
        if path is not None:
            _remove(path)
        self._created.pop(key, None)

    def close(self) -> None:
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
        self._folder, self._copies = None, OrderedDict()


def remove_orphaned_copies(folder: str | None = None) -> list[str]:
    """Remove the folders of optimized copies whose process is gone (one killed with SIGKILL
    never ran its clean-up); a folder whose process still runs, or that another user owns, is
    left. Returns the folders removed."""
    folder = folder or tempfile.gettempdir()
    removed = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.startswith(COPIES_PREFIX):
            continue
        pid = entry.name[len(COPIES_PREFIX):].split("-", 1)[0]
        try:
            owned = entry.is_dir(follow_symlinks=False) and entry.stat().st_uid == os.getuid()
        except OSError:
            continue
        if owned and pid.isdigit() and not _process_alive(int(pid)):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
    return removed


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether it exists
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        pass
    return True


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def _provider_name(spec: ProviderSpec) -> str:
    return spec if isinstance(spec, str) else spec[0]


class OnnxRuntimeBackend(Backend):
    """Times ``InferenceSession.run`` with inputs generated once per session; a
    :class:`~qdq_optuna.backends.base.Configured` model runs with its session config entries."""

    session_settings = True

    def __init__(
        self,
        *,
        threads: int = 1,
        providers: Sequence[ProviderSpec] = ("CPUExecutionProvider",),
        optimization: str = "all",
        input_shapes: Mapping[str, Sequence[int]] | None = None,
        input_data: Mapping[str, np.ndarray] | None = None,
        seed: int = 0,
        name: str | None = None,
    ) -> None:
        if int(threads) < 1:
            raise OptionError(f"--threads must be >= 1, got {threads}")
        if optimization not in _OPT_LEVELS:
            raise OptionError(
                f"ONNX Runtime optimization must be one of {', '.join(_OPT_LEVELS)}, "
                f"got {optimization!r}"
            )
        import onnxruntime as ort  # lazy: keeps `import qdq_optuna` light

        self._ort = ort
        self.threads = int(threads)
        self.providers = tuple(p if isinstance(p, str) else (p[0], dict(p[1])) for p in providers)
        if not self.providers:
            raise OptionError("ONNX Runtime needs at least one execution provider")
        self.optimization = optimization
        self.input_shapes = {k: tuple(int(d) for d in v) for k, v in (input_shapes or {}).items()}
        self.input_data = {k: np.asarray(v) for k, v in (input_data or {}).items()}
        self.seed = int(seed)
        available = set(ort.get_available_providers())
        missing = [_provider_name(p) for p in self.providers if _provider_name(p) not in available]
        if missing:
            hint = f"; {_GPU_HINT}" if any(m != "CPUExecutionProvider" for m in missing) else ""
            raise BackendUnavailable(
                f"ONNX Runtime {ort.__version__} lacks execution provider(s) "
                f"{', '.join(missing)} (available: {', '.join(sorted(available))}){hint}"
            )
        names = tuple(_provider_name(p) for p in self.providers)
        self.on_gpu = names[0] != "CPUExecutionProvider"
        if self.on_gpu:
            _preload_cuda_libraries(ort)
        self.name = name or next(
            (k for k, v in PROVIDER_PRESETS.items() if v == names), "onnxruntime"
        )
        #: None on a GPU provider: its optimized graph may hold the provider's own nodes
        self.copies = None if self.on_gpu else OptimizedCopies()

    def describe(self) -> dict:
        return {
            "name": self.name,
            "onnxruntime": self._ort.__version__,
            "providers": [_provider_name(p) for p in self.providers],
            "provider_options": {
                p[0]: p[1] for p in self.providers if not isinstance(p, str) and p[1]
            },
            "threads": self.threads,
            "optimization": self.optimization,
            "input_shapes": {k: list(v) for k, v in sorted(self.input_shapes.items())},
            "input_data": sorted(self.input_data),
            "seed": self.seed,
        }

    def what_ran(self, model: bytes | Configured):
        """Read from ONNX Runtime's optimized graph (CPU at its full optimization only: what a
        GPU provider or a lower level runs is not what that graph shows); a
        :class:`~qdq_optuna.backends.base.Configured` model's under its session settings."""
        settings = model.settings if isinstance(model, Configured) else None
        if isinstance(model, Configured):
            model = model.model
        if self.on_gpu or self.optimization != "all" or not isinstance(model, bytes):
            return None
        import onnx

        from qdq_optuna.backends.onnxruntime_kernels import what_onnxruntime_ran
        from qdq_optuna.backends.what_ran import WhatRan, quantized_tensors

        proto = onnx.load_from_string(model)
        how = "ONNX Runtime optimized graph (CPU, ORT_ENABLE_ALL" + (
            f", session settings {settings.name})" if settings is not None else ")")
        return WhatRan(how, **what_onnxruntime_ran(
            proto, quantized_tensors(proto), settings.entries if settings is not None else ()))

    def _session_options(self, entries: tuple[tuple[str, str], ...] = ()) -> Any:
        ort = self._ort
        so = ort.SessionOptions()
        so.intra_op_num_threads = self.threads
        so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        so.graph_optimization_level = getattr(
            ort.GraphOptimizationLevel, _OPT_LEVELS[self.optimization]
        )
        so.log_severity_level = 3  # warnings would flood the progress output
        for key, value in entries:
            so.add_session_config_entry(key, value)
        return so

    def load(self, model: ModelSource | Configured) -> Runner:
        entries = model.settings.entries if isinstance(model, Configured) else ()
        if isinstance(model, Configured):
            model = model.model
        src: bytes | str = model if isinstance(model, bytes) else os.fspath(model)
        providers = [p if isinstance(p, str) else (p[0], dict(p[1])) for p in self.providers]
        session = (self._load_copied(src, entries, providers) if isinstance(src, bytes)
                   and self.copies is not None else None)
        if session is None:
            options = self._session_options(entries)
            # a big model's export references the input's weight files where they are: map
            # them (kept alive until the session has copied what it needs)
            mapped = _map_external_sources(options, src) if isinstance(src, str) else []
            session = self._create(src, options, providers)
            del mapped  # the session has copied what it needs
        wanted = _provider_name(self.providers[0])
        if wanted not in session.get_providers():
            raise BackendUnavailable(
                f"ONNX Runtime fell back from {wanted} to {', '.join(session.get_providers())}; "
                f"check the GPU driver and CUDA/TensorRT libraries ({_GPU_HINT})"
            )
        feeds = self._make_inputs(session)
        if self.on_gpu:
            return _DeviceRunner(session, feeds, self._ort, _device_id(self.providers[0]))
        return OnnxRuntimeRunner(session, feeds)

    def _create(self, src: bytes | str, options: Any, providers: list) -> Any:
        try:
            return self._ort.InferenceSession(src, sess_options=options, providers=providers)
        except Exception as exc:  # ORT raises its own exception types
            text = str(exc).strip() or type(exc).__name__
            raise BackendError(f"ONNX Runtime could not create a session: {text}") from exc

    def _load_copied(self, model: bytes, entries: tuple[tuple[str, str], ...],
                     providers: list) -> Any:
        """A session of ``model`` through :attr:`copies`: from its optimized copy when there
        is one, else created from the model (writing the copy when it is worth one)."""
        copies, key = self.copies, OptimizedCopies.key(model, entries)
        path = copies.copy(key)
        if path is not None:
            options = self._session_options(entries)
            options.graph_optimization_level = self._ort.GraphOptimizationLevel.ORT_DISABLE_ALL
            try:
                session = self._ort.InferenceSession(path, sess_options=options,
                                                     providers=providers)
                copies.loaded_from_copy += 1
                return session
            except Exception:  # noqa: BLE001 - a copy it cannot read: the model itself
                copies.forget(key)
        options = self._session_options(entries)
        write = copies.to_write(key)
        if write is not None:
            options.optimized_model_filepath = write
        start = time.perf_counter()
        session = self._create(model, options, providers)
        copies.created(key, time.perf_counter() - start, write)
        return session

    def close(self) -> None:
        if self.copies is not None:
            self.copies.close()

    def _make_inputs(self, session: Any) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(self.seed)
        feeds: dict[str, np.ndarray] = {}
        for inp in session.get_inputs():
            if inp.name in self.input_data:
                feeds[inp.name] = self.input_data[inp.name]
                continue
            dtype = _DTYPES.get(inp.type)
            if dtype is None:
                raise BackendError(
                    f"input {inp.name!r} has type {inp.type}, which the ONNX Runtime backend "
                    "cannot generate; pass its data explicitly"
                )
            shape = self.input_shapes.get(inp.name)
            if shape is None:
                dims = list(inp.shape or [])
                if any(not isinstance(d, int) or d < 0 for d in dims):
                    raise BackendError(
                        f"input {inp.name!r} has symbolic shape {dims}; give its shape "
                        f"(e.g. --input-shape {inp.name}:1x3x224x224)"
                    )
                shape = tuple(dims)
            if np.issubdtype(dtype, np.floating):
                feeds[inp.name] = rng.standard_normal(shape).astype(dtype)
            else:
                feeds[inp.name] = np.zeros(shape, dtype=dtype)
        return feeds


def _device_id(spec: ProviderSpec) -> int:
    options = {} if isinstance(spec, str) else spec[1]
    return int(options.get("device_id", 0))


_preloaded = False


def _preload_cuda_libraries(ort: Any) -> None:
    """Let onnxruntime-gpu find CUDA/cuDNN from the ``nvidia-*`` wheels (e.g. PyTorch's), as
    its documentation recommends; harmless where the system libraries are found anyway."""
    global _preloaded
    if _preloaded or not hasattr(ort, "preload_dlls"):
        return
    _preloaded = True
    try:
        ort.preload_dlls()
    except Exception:  # a missing wheel only means the system's libraries are used
        pass


def _map_external_sources(options: Any, path: str) -> list:
    """:func:`qdq_optuna._files.map_external_sources`, failing as a backend error."""
    from qdq_optuna._files import map_external_sources

    try:
        return map_external_sources(options, path)
    except OSError as exc:
        raise BackendError(f"cannot map the model's external data: {exc}") from exc


class OnnxRuntimeRunner(Runner):
    """One session and its inputs; ``time`` wraps each ``run`` in ``perf_counter``."""

    def __init__(self, session: Any, feeds: dict[str, np.ndarray]) -> None:
        self.session = session
        self.feeds = feeds

    def _inference(self) -> Any:
        """One inference as a call without arguments."""
        run, feeds = self.session.run, self.feeds
        return lambda: run(None, feeds)

    def time(self, warmup: int, iterations: int) -> list[float]:
        if self.session is None:
            raise BackendError("runner used after close()")
        return time_calls(self._inference(), warmup, iterations, "ONNX Runtime")

    def close(self) -> None:
        self.session = None
        self.feeds = {}


class _DeviceRunner(OnnxRuntimeRunner):
    """GPU execution providers: inputs live on the device and outputs stay there (IO
    binding), so host<->device copies are not timed (as trtexec's ``--noDataTransfers``).
    ``run_with_iobinding`` returns after the provider's stream is synchronized, so a host clock
    around it measures the whole inference."""

    def __init__(self, session: Any, feeds: dict[str, np.ndarray], ort: Any, device: int):
        super().__init__(session, feeds)
        self._inputs = {
            name: ort.OrtValue.ortvalue_from_numpy(arr, "cuda", device)
            for name, arr in feeds.items()
        }
        self._binding = session.io_binding()
        for name, value in self._inputs.items():
            self._binding.bind_ortvalue_input(name, value)
        for out in session.get_outputs():
            self._binding.bind_output(out.name, "cuda", device)

    def _inference(self) -> Any:
        run, binding = self.session.run_with_iobinding, self._binding
        return lambda: run(binding)

    def close(self) -> None:
        self._binding = None
        self._inputs = {}
        super().close()
