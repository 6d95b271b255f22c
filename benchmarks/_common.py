"""What the benchmark scripts share: the machine's load and the one quiet-machine wait, ONNX
Runtime's recipe, calibration readers and Markdown tables.

Why one module: the scripts repeated these (and drifted: three load waits, two recipe calls).
A script imports it as ``import _common`` (``python benchmarks/NAME.py`` puts ``benchmarks/`` on
sys.path) and imports ``qdq_optuna`` like any client: the installed package (editable in a
checkout), never through a sys.path edit.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = REPO / "benchmarks"
RESULTS = BENCHMARKS / "results"


# -- machine load ------------------------------------------------------------------------------

def load_avg() -> list[float]:
    """The 1-, 5- and 15-minute load averages, rounded as the results files record them."""
    return [round(x, 2) for x in os.getloadavg()]


def load_now() -> float:
    """The 1-minute load average, rounded as the results files record it."""
    return load_avg()[0]


def wait_quiet(max_load: float, poll_s: float = 10.0, limit_s: float = 1200.0) -> dict:
    """Wait for the 1-minute load average to drop below ``max_load``; what was seen.

    Timings on a busy 2-core machine drift; a run after ``limit_s`` measures anyway and says so.
    """
    t0 = time.monotonic()
    load = os.getloadavg()[0]
    while load >= max_load and time.monotonic() - t0 < limit_s:
        time.sleep(poll_s)
        load = os.getloadavg()[0]
    waited = time.monotonic() - t0
    if load >= max_load:
        print(f"  ! load still {load:.2f} after {waited:.0f} s; measuring anyway (flagged)",
              flush=True)
    return {"load_before": round(load, 2), "waited_s": round(waited, 1),
            "quiet": load < max_load}


# -- ONNX Runtime's recipe ---------------------------------------------------------------------

def feeds(data: Mapping[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """Samples on axis 0 as one feed dict per sample (batch 1 each)."""
    count = len(next(iter(data.values())))
    return [{k: v[i:i + 1] for k, v in data.items()} for i in range(count)]


def calibration_reader(data: Mapping[str, np.ndarray] | Iterable[dict]):
    """An ONNX Runtime ``CalibrationDataReader`` over stacked arrays or feed dicts."""
    from onnxruntime.quantization import CalibrationDataReader

    items = feeds(data) if isinstance(data, Mapping) else list(data)

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.it = iter(items)

        def get_next(self):
            return next(self.it, None)

    return Reader()


def quantize_static_qdq(src: Path, dst: Path, data: Mapping[str, np.ndarray]) -> None:
    """``quantize_static`` as users run it: QDQ, per-channel, uint8 activations, int8 weights
    (7-bit on CPUs whose u8 x s8 kernels saturate, as ONNX Runtime's documentation advises).

    Its per-weight notes and hints are silenced (the package's ``quiet_tool``); a failure is
    one ``ToolError`` line.
    """
    from onnxruntime.quantization import quantize_static

    # the package's recipe start's settings, quieted the same way
    from qdq_optuna.placement.starts import quiet_tool
    from qdq_optuna.runtimes.onnxruntime import TOOL_LOGGERS, ort_recipe_options

    with quiet_tool("quantize_static", TOOL_LOGGERS):
        quantize_static(str(src), str(dst), calibration_reader(data), **ort_recipe_options())


def pre_process(src: Path, dst: Path, symbolic: bool = True) -> None:
    """``quant_pre_process``; without sympy (or ``symbolic=False``), or where ONNX Runtime's
    symbolic shape inference gives up on the model ("Incomplete symbolic shape inference", as
    on YOLOv8n exports with symbolic dims), without symbolic shape inference: what its error
    tells a user to do."""
    from onnxruntime.quantization.shape_inference import quant_pre_process

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if symbolic:
            try:  # ONNX Runtime's symbolic shape inference needs sympy; where it gives up it
                # saves what it has as sym_shape_infer_temp.onnx in the working folder
                with tempfile.TemporaryDirectory() as scratch, contextlib.chdir(scratch):
                    quant_pre_process(str(Path(src).resolve()), str(Path(dst).resolve()))
                return
            except ImportError:
                pass
            except Exception as exc:  # noqa: BLE001 - ORT's own advice: skip it when it fails
                if "symbolic shape inference" not in str(exc).lower():
                    raise
        quant_pre_process(str(src), str(dst), skip_symbolic_shape=True)


# -- tables ------------------------------------------------------------------------------------

def markdown_table(header: list[str], rows: Iterable[list]) -> str:
    """A Markdown table; cells are written as given (format them first)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def report_rows(table: str, rows: list, json_path: str | None, md_path: str | None) -> None:
    """A script's Markdown ``table`` printed, and written with its ``rows`` (JSON, with the
    machine and its load) where asked."""
    import json

    print(table)
    if json_path:
        Path(json_path).write_text(json.dumps({"machine": machine(), "load": load_now(),
                                               "rows": rows}, indent=1))
    if md_path:
        Path(md_path).write_text(table + "\n")


def machine() -> str:
    """The machine a result was measured on, in one line: the CPU's name and its cores."""
    from qdq_optuna.machine import current_cpu

    return f"{current_cpu().model_name or 'unknown CPU'}, {os.cpu_count()} cores"


def speedups(per_round: Mapping[str, list[float]], reference: str = "fp32",
             digits: int = 4) -> dict[str, dict]:
    """Each variant's speed against ``reference`` from latencies timed in the same
    interleaved rounds: the geometric mean of the per-round ratios with its ~95 % interval
    (two standard errors of the log ratios), and the median ms."""
    import math
    import statistics

    out = {}
    for name, ms in per_round.items():
        logs = [math.log(f / v) for f, v in zip(per_round[reference], ms)]
        mean = statistics.fmean(logs)
        half = 2.0 * statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else 0.0
        out[name] = {"speedup": round(math.exp(mean), digits),
                     "ci": [round(math.exp(mean - half), digits),
                            round(math.exp(mean + half), digits)],
                     "median_ms": round(statistics.median(ms), digits),
                     "best_ms": round(min(ms), digits)}
    return out
