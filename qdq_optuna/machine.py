"""The CPU this process decides by: the x86 feature flags that change a run's answers.

Several rules depend on the processor: ONNX Runtime's u8 x s8 kernels saturate without VNNI
(so weights take 7 bits), OpenVINO offers a bf16 inference precision only with AVX512-BF16 or
AMX, and kernel timings differ between them. Every such rule asks :func:`current_cpu`, never
/proc/cpuinfo itself, so that a developer on one machine can run the others' code paths:
``QDQ_OPTUNA_CPU_FLAGS="avx2,avx512f,avx512_vnni"`` (or :func:`simulated_cpu` in a test, which
sets that variable so worker processes see the same CPU) replaces the flags read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import platform
from collections.abc import Iterable, Iterator
from pathlib import Path

#: the environment variable that simulates a CPU: comma-separated flags from :data:`FLAGS`
ENV = "QDQ_OPTUNA_CPU_FLAGS"
#: the flags that change an answer (names as /proc/cpuinfo spells them)
FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16", "amx_int8",
         "amx_tile")
#: the feature sets these machines come in, by name (for simulation and the tests)
FEATURE_SETS = {
    "avx2": ("avx2",),
    "vnni": ("avx2", "avx512f", "avx512_vnni"),
    "bf16": ("avx2", "avx512f", "avx512_vnni", "avx512_bf16"),
    "amx": ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8",
            "amx_tile"),
}
_X86 = ("x86_64", "amd64")


@dataclasses.dataclass(frozen=True)
class CpuFeatures:
    """One CPU's answer-changing flags. ``source``: where they came from ("/proc/cpuinfo",
    "simulated", or "unknown" where nothing could be read: then no flag is claimed and no
    x86-only rule applies)."""

    arch: str
    model_name: str = ""
    avx2: bool = False
    avx512f: bool = False
    avx512_vnni: bool = False
    avx_vnni: bool = False
    avx512_bf16: bool = False
    amx_bf16: bool = False
    amx_int8: bool = False
    amx_tile: bool = False
    source: str = "unknown"

    @classmethod
    def from_flags(cls, flags: Iterable[str], *, arch: str = "x86_64", model_name: str = "",
                   source: str = "simulated") -> CpuFeatures:
        """The features named in ``flags`` (others ignored: /proc/cpuinfo lists ~100)."""
        have = {f.strip().lower() for f in flags}
        return cls(arch=arch, model_name=model_name, source=source,
                   **{f: f in have for f in FLAGS})

    @classmethod
    def read(cls, path: str | os.PathLike = "/proc/cpuinfo") -> CpuFeatures:
        """This machine's CPU, from /proc/cpuinfo (its first processor); elsewhere (another
        system, an unreadable file) the architecture alone, source "unknown"."""
        arch = platform.machine().lower()
        try:
            text = Path(path).read_text()
        except OSError:
            return cls(arch=arch)
        fields: dict[str, str] = {}
        for line in text.splitlines():
            key, sep, value = line.partition(":")
            if not sep:
                if fields:  # the blank line after the first processor
                    break
                continue
            fields.setdefault(key.strip(), value.strip())
        if "flags" not in fields:
            return cls(arch=arch, model_name=fields.get("model name", ""))
        return cls.from_flags(fields["flags"].split(), arch=arch,
                              model_name=fields.get("model name", ""), source=str(path))

    @property
    def x86(self) -> bool:
        return self.arch in _X86

    @property
    def vnni(self) -> bool:
        """Integer dot products with 32-bit sums (AVX512-VNNI, AVX-VNNI or AMX-INT8)."""
        return self.avx512_vnni or self.avx_vnni or self.amx_int8

    @property
    def saturates_u8s8(self) -> bool:
        """Whether ONNX Runtime's x86 u8 x s8 kernels sum in 16 bits (VPMADDUBSW, no VNNI) and
        so saturate with 8-bit weights; False where the flags are unknown or not x86."""
        return self.x86 and self.source != "unknown" and not self.vnni

    @property
    def bf16(self) -> bool:
        """bf16 arithmetic the runtimes use (AVX512-BF16 or AMX-BF16)."""
        return self.avx512_bf16 or self.amx_bf16

    @property
    def amx(self) -> bool:
        return self.amx_tile and (self.amx_int8 or self.amx_bf16)

    @property
    def flags(self) -> tuple[str, ...]:
        """The answer-changing flags present, in :data:`FLAGS` order."""
        return tuple(f for f in FLAGS if getattr(self, f))

    def to_json(self) -> dict:
        """What a report names: the CPU, its flags and what the rules concluded from them."""
        return {"arch": self.arch, "model_name": self.model_name, "source": self.source,
                "flags": list(self.flags), "vnni": self.vnni, "bf16": self.bf16,
                "amx": self.amx, "saturates_u8s8": self.saturates_u8s8}

    def describe(self) -> str:
        """One line for report.md."""
        flags = ", ".join(self.flags) or "none of " + ", ".join(FLAGS[:3]) + ", ..."
        name = self.model_name or self.arch
        return f"{name} ({self.source}; flags: {flags})"


@functools.lru_cache(maxsize=1)
def _read() -> CpuFeatures:
    return CpuFeatures.read()


def current_cpu() -> CpuFeatures:
    """The CPU the rules decide by: ``QDQ_OPTUNA_CPU_FLAGS`` when set (a simulation; a feature
    set's name from :data:`FEATURE_SETS` or comma-separated flags), else this machine's."""
    text = os.environ.get(ENV, "").strip()
    if not text:
        return _read()
    flags = FEATURE_SETS.get(text.lower()) or [f for f in text.split(",") if f.strip()]
    return CpuFeatures.from_flags(flags, model_name=f"simulated {text}")


@contextlib.contextmanager
def simulated_cpu(flags: str | Iterable[str]) -> Iterator[CpuFeatures]:
    """Run a block (and the processes it starts) as if on a CPU with ``flags`` (a feature set's
    name from :data:`FEATURE_SETS`, or flags); the previous setting comes back after."""
    text = flags if isinstance(flags, str) else ",".join(flags)
    before = os.environ.get(ENV)
    os.environ[ENV] = text or ","  # "," : no flags at all (an x86 CPU without AVX2)
    try:
        yield current_cpu()
    finally:
        if before is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = before


def measuring_machine(runtime: dict, cpu: CpuFeatures | None = None) -> dict:
    """The machine a run's timings come from (a run's workers must share it): the CPU's
    answer-changing flags and ``runtime``, what the backend says its timings depend on
    (:func:`qdq_optuna.backends.base.measuring`: the runtime, its version, threads, precision
    hint). The CPU's model name is recorded, not compared (its flags are what change an
    answer)."""
    cpu = cpu or current_cpu()
    return {"arch": cpu.arch, "cpu_flags": list(cpu.flags), "cpu": cpu.model_name,
            "runtime": dict(runtime)}


def machine_differences(run: dict, here: dict) -> list[str]:
    """What differs between a run's measuring machine and this process's, in words (empty:
    their timings compare)."""
    out = []
    if run.get("arch") != here.get("arch"):
        out.append(f"architecture {here.get('arch')} here, {run.get('arch')} in the run")
    theirs, mine = set(run.get("cpu_flags") or ()), set(here.get("cpu_flags") or ())
    out += [f"{f}: {'here, not in the run' if f in mine else 'in the run, not here'}"
            for f in FLAGS if (f in mine) != (f in theirs)]
    rt_run, rt_here = run.get("runtime") or {}, here.get("runtime") or {}
    out += [f"{k} {rt_here.get(k)!r} here, {rt_run.get(k)!r} in the run"
            for k in sorted(set(rt_run) | set(rt_here)) if rt_run.get(k) != rt_here.get(k)]
    return out
