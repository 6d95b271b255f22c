"""TensorRT through the ``trtexec`` command-line tool: no Python bindings needed.

``load`` builds the engine once (``--onnx ... --saveEngine ... --skipInference``); each
``Runner.time`` call then runs ``trtexec --loadEngine`` and returns **one** figure, the median
"GPU Compute Time" of that invocation, because trtexec does its own warm-up (``--warmUp`` is in
milliseconds) and repetitions (at least ``--iterations`` runs and ``--duration`` seconds). The
``warmup`` and ``iterations`` arguments of ``time`` are therefore only a floor on trtexec's own
iteration count. Every call has a subprocess timeout; a timeout is a
:class:`TransientBackendError`, a non-zero exit a :class:`BackendError` carrying trtexec's last
lines, and a missing binary :class:`BackendUnavailable` (never "infinite latency, exit 0").

Builds are strongly typed (``--stronglyTyped`` where ``trtexec --help`` lists it; TensorRT 11
always types strongly): every layer runs in its ONNX tensors' type, so the high precision is
the model's own (FP16/BF16, see ``qdq_optuna.model.precision``). A trtexec without strong typing
(8.x) gets the builder precision flags the model's types ask for instead (:func:`precision_flags`).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

from qdq_optuna.backends.base import (
    Backend,
    BackendError,
    BackendUnavailable,
    ModelSource,
    Runner,
    TransientBackendError,
)
from qdq_optuna.errors import OptionError

NOT_FOUND = "trtexec not found on PATH; install TensorRT or add its bin folder to PATH"

_SECTIONS = {
    "GPU Compute Time": "gpu_compute_ms",
    "Latency": "latency_ms",
    "Enqueue Time": "enqueue_ms",
    "H2D Latency": "h2d_ms",
    "D2H Latency": "d2h_ms",
}
_LINE_RE = re.compile(r"^(?:\s*\[[^\]]*\])*\s*(?P<label>[A-Za-z0-9 ]+?):\s*(?P<stats>min\s*=.*)$")
_STAT_RE = re.compile(
    r"(?P<key>min|max|mean|median|percentile\((?P<pct>[0-9.]+)%\))\s*=\s*"
    r"(?P<value>[-+0-9.eE]+|nan|inf)\s*ms"
)
_THROUGHPUT_RE = re.compile(r"Throughput:\s*([0-9.eE+-]+)\s*qps")
_VERSION_RE = re.compile(r"\[TensorRT v(\d+)\]")


def parse_tensorrt_version(text: str) -> str | None:
    """``"10.3.0"`` from trtexec's banner ``[TensorRT v100300]`` (8.x used ``v8601``)."""
    m = _VERSION_RE.search(text)
    if not m:
        return None
    n = int(m.group(1))
    if n >= 100000:
        return f"{n // 10000}.{n // 100 % 100}.{n % 100}"
    return f"{n // 1000}.{n // 100 % 10}.{n % 100}"


def parse_trtexec_output(text: str) -> dict[str, Any]:
    """Performance summary of a trtexec run as numbers (ms), keyed by section.

    ``{"gpu_compute_ms": {"min", "max", "mean", "median", "p90", "p95", "p99"}, "latency_ms":
    ..., "throughput_qps": float, "tensorrt_version": "10.3.0", "passed": bool}``; sections
    trtexec did not print are absent. "Total GPU Compute Time" lines are not confused with the
    per-inference statistics.
    """
    out: dict[str, Any] = {}
    for line in text.splitlines():
        m = _LINE_RE.match(line)
        if m:
            key = _SECTIONS.get(m.group("label").strip())
            if key is None:
                continue
            stats: dict[str, float] = {}
            for s in _STAT_RE.finditer(m.group("stats")):
                name = s.group("key")
                pct = s.group("pct")
                if pct is not None:
                    name = "p" + (pct.rstrip("0").rstrip(".") if "." in pct else pct)
                stats[name] = float(s.group("value"))
            out[key] = stats
            continue
        t = _THROUGHPUT_RE.search(line)
        if t:
            out["throughput_qps"] = float(t.group(1))
    version = parse_tensorrt_version(text)
    if version:
        out["tensorrt_version"] = version
    out["passed"] = "&&&& PASSED" in text
    return out


def median_gpu_compute_ms(text: str) -> float:
    """The figure the runner reports; :class:`BackendError` when trtexec printed none."""
    stats = parse_trtexec_output(text).get("gpu_compute_ms", {})
    if "median" not in stats:
        raise BackendError(f"no 'GPU Compute Time' median in trtexec output: {_tail(text)}")
    return stats["median"]


def precision_flags(onnx_path: str | os.PathLike) -> list[str]:
    """Builder precision flags for a weakly typed build (TensorRT before strong typing): the
    model's float types (``--fp16``, ``--bf16``) and its Q/DQ types (``--int8``, ``--fp8``),
    so the engine runs the precisions the model was converted and quantized to."""
    import onnx
    from onnx import TensorProto

    try:
        model = onnx.load(os.fspath(onnx_path), load_external_data=False)
    except Exception as exc:  # DecodeError, OSError
        raise BackendError(f"trtexec: cannot read {onnx_path}: {exc}") from exc
    g = model.graph
    types = {t.data_type for t in g.initializer}
    types |= {vi.type.tensor_type.elem_type for vi in (*g.input, *g.output, *g.value_info)}
    types |= {a.i for n in g.node if n.op_type == "Cast" for a in n.attribute if a.name == "to"}
    flags = []
    if TensorProto.FLOAT16 in types:
        flags.append("--fp16")
    if TensorProto.BFLOAT16 in types:
        flags.append("--bf16")
    inits = {t.name: t.data_type for t in g.initializer}
    quantized = set()  # the zero points' types: what each Q/DQ quantizes to
    for n in g.node:
        if n.op_type in ("QuantizeLinear", "DequantizeLinear"):
            zp = n.input[2] if len(n.input) > 2 else ""
            quantized.add(inits.get(zp, TensorProto.UINT8))
    if quantized & {TensorProto.FLOAT8E4M3FN, TensorProto.FLOAT8E5M2}:
        flags.append("--fp8")
    if quantized & {TensorProto.INT8, TensorProto.UINT8}:
        flags.append("--int8")
    return flags


def _tail(text: str, lines: int = 12) -> str:
    rows = [ln.rstrip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in rows if "[E]" in ln or "Error" in ln]
    picked = (errors[-lines // 2 :] + rows[-lines // 2 :]) if errors else rows[-lines:]
    return " | ".join(dict.fromkeys(picked)) or "(no output)"


def format_shapes(shapes: Mapping[str, Sequence[int]]) -> str:
    """``--shapes`` value; names with ``:`` or ``,`` are quoted the way trtexec expects."""
    parts = []
    for name, dims in shapes.items():
        quoted = f"'{name}'" if any(c in name for c in ":,'") else name
        parts.append(f"{quoted}:{'x'.join(str(int(d)) for d in dims)}")
    return ",".join(parts)


class TrtexecBackend(Backend):
    """Builds with one trtexec call per candidate, times with one call per ``time``."""

    name = "trtexec"
    #: a build is a trtexec run of seconds: reuse the engine across measurement rounds
    fresh_sessions = False

    def __init__(
        self,
        *,
        trtexec: str = "trtexec",
        warmup_ms: int = 200,
        iterations: int = 100,
        duration_s: float = 3,
        use_cuda_graph: bool = False,
        no_data_transfers: bool = True,
        plugins: Sequence[str | os.PathLike] = (),
        timing_cache: str | os.PathLike | None = None,
        input_shapes: Mapping[str, Sequence[int]] | None = None,
        timeout_s: float = 600,
        strongly_typed: bool | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        binary = shutil.which(os.fspath(trtexec))
        if binary is None:
            raise BackendUnavailable(f"{NOT_FOUND} (looked for {os.fspath(trtexec)!r})")
        self.binary = binary
        if int(warmup_ms) < 0 or int(iterations) < 1 or float(duration_s) < 0:
            raise OptionError("trtexec: warmup_ms >= 0, iterations >= 1, duration_s >= 0")
        self.warmup_ms = int(warmup_ms)
        self.iterations = int(iterations)
        self.duration_s = float(duration_s)
        self.use_cuda_graph = bool(use_cuda_graph)
        self.no_data_transfers = bool(no_data_transfers)
        self.plugins = [os.path.abspath(os.fspath(p)) for p in plugins]
        for p in self.plugins:
            if not os.path.isfile(p):
                raise OptionError(f"--plugin {p}: no such file")
        self.timing_cache = os.path.abspath(os.fspath(timing_cache)) if timing_cache else None
        self.input_shapes = {k: tuple(int(d) for d in v) for k, v in (input_shapes or {}).items()}
        self.timeout_s = float(timeout_s)
        #: None: pass --stronglyTyped where this trtexec needs it (10.x; always on in 11.x)
        self.strongly_typed = strongly_typed
        self.extra_args = [str(a) for a in extra_args]
        self._help: str | None = None

    # -- probing -----------------------------------------------------------------------------
    def _probe(self) -> str:
        """``trtexec --help`` once: the version banner and which flags this build knows."""
        if self._help is None:
            try:
                proc = subprocess.run(
                    [self.binary, "--help"], capture_output=True, text=True, timeout=60
                )
                self._help = (proc.stdout or "") + (proc.stderr or "")
            except (OSError, subprocess.TimeoutExpired):
                self._help = ""
        return self._help

    @property
    def tensorrt_version(self) -> str | None:
        return parse_tensorrt_version(self._probe())

    def _knows(self, flag: str) -> bool:
        text = self._probe()
        return not text or flag in text  # unknown help text: assume a current trtexec

    def _strong_flag(self) -> list[str] | None:
        """``["--stronglyTyped"]`` (10.x), ``[]`` (11.x: always strongly typed, the flag is
        redundant), or None: this trtexec builds weakly typed networks (8.x, or
        ``strongly_typed=False``)."""
        if self.strongly_typed is not None:
            return ["--stronglyTyped"] if self.strongly_typed else None
        version = self.tensorrt_version
        if version and int(version.split(".")[0]) >= 11:
            return []
        return ["--stronglyTyped"] if self._knows("--stronglyTyped") else None

    def _typing_flags(self, onnx_path: str | None = None) -> list[str]:
        strong = self._strong_flag()
        if strong is not None:
            return strong
        # weakly typed: the builder needs the precisions the model's own types ask for
        flags = precision_flags(onnx_path) if onnx_path else []
        return [f for f in flags if self._knows(f)]

    def _common_flags(self) -> list[str]:
        flags = [f"--staticPlugins={p}" for p in self.plugins]
        if self.input_shapes:
            flags.append(f"--shapes={format_shapes(self.input_shapes)}")
        return flags

    def build_command(self, onnx_path: str, engine_path: str) -> list[str]:
        cmd = [self.binary, f"--onnx={onnx_path}", f"--saveEngine={engine_path}"]
        cmd += self._typing_flags(onnx_path)
        if self.timing_cache:
            cmd.append(f"--timingCacheFile={self.timing_cache}")
        cmd += self._common_flags()
        if self._knows("--skipInference"):
            cmd.append("--skipInference")
        elif self._knows("--buildOnly"):
            cmd.append("--buildOnly")
        return cmd + self.extra_args

    def time_command(self, engine_path: str, iterations: int = 0) -> list[str]:
        cmd = [
            self.binary,
            f"--loadEngine={engine_path}",
            f"--warmUp={self.warmup_ms}",
            f"--iterations={max(self.iterations, int(iterations))}",
            f"--duration={self.duration_s:g}",
        ]
        if self.use_cuda_graph:
            cmd.append("--useCudaGraph")
        if self.no_data_transfers:
            cmd.append("--noDataTransfers")
        return cmd + self._common_flags() + self.extra_args

    def run(self, cmd: list[str], what: str) -> str:
        """Run trtexec; its combined output, or the right error."""
        try:
            proc = subprocess.run(
                cmd,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                errors="replace",
                timeout=self.timeout_s,
            )
        except subprocess.TimeoutExpired as exc:
            raise TransientBackendError(
                f"trtexec timed out after {self.timeout_s:g} s while {what}"
            ) from exc
        except OSError as exc:
            raise BackendUnavailable(f"{NOT_FOUND} ({exc})") from exc
        if proc.returncode != 0:
            raise BackendError(
                f"trtexec failed (exit {proc.returncode}) while {what}: {_tail(proc.stdout)}"
            )
        return proc.stdout

    # -- Backend interface -------------------------------------------------------------------
    def load(self, model: ModelSource) -> Runner:
        workdir = tempfile.mkdtemp(prefix="qdq-trtexec-")
        try:
            if isinstance(model, bytes):
                onnx_path = os.path.join(workdir, "model.onnx")
                with open(onnx_path, "wb") as f:
                    f.write(model)
                label = f"a model of {len(model)} bytes"
            else:
                onnx_path = os.path.abspath(os.fspath(model))
                label = os.path.basename(onnx_path)
            engine_path = os.path.join(workdir, "model.plan")
            self.run(self.build_command(onnx_path, engine_path), f"building {label}")
            if not os.path.isfile(engine_path):
                raise BackendError(f"trtexec wrote no engine for {label}")
        except BaseException:
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        return TrtexecRunner(self, engine_path, workdir, label)

    def describe(self) -> dict:
        return {
            "name": self.name,
            "trtexec": self.binary,
            "tensorrt": self.tensorrt_version,
            "warmup_ms": self.warmup_ms,
            "iterations": self.iterations,
            "duration_s": self.duration_s,
            "use_cuda_graph": self.use_cuda_graph,
            "no_data_transfers": self.no_data_transfers,
            "strongly_typed_flag": bool(self._strong_flag()),
            "strongly_typed": self._strong_flag() is not None,
            "plugins": list(self.plugins),
            "input_shapes": {k: list(v) for k, v in sorted(self.input_shapes.items())},
            "extra_args": list(self.extra_args),
        }


class TrtexecRunner(Runner):
    """A built engine file; each ``time`` is one ``trtexec --loadEngine`` run."""

    def __init__(self, backend: TrtexecBackend, engine_path: str, workdir: str, label: str):
        self.backend = backend
        self.engine_path = engine_path
        self.workdir: str | None = workdir
        self.label = label
        #: the full parsed summary of the last run (percentiles, throughput, ...)
        self.last: dict[str, Any] = {}

    def time(self, warmup: int, iterations: int) -> list[float]:
        if self.workdir is None:
            raise BackendError("runner used after close()")
        cmd = self.backend.time_command(self.engine_path, iterations)
        text = self.backend.run(cmd, f"timing {self.label}")
        median = median_gpu_compute_ms(text)
        self.last = parse_trtexec_output(text)
        return [median]

    def close(self) -> None:
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None
