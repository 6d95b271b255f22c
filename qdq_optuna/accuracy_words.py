"""The accuracy guard's figures in words: which data they come from, and what ONNX Runtime CPU
with default options does with a model the guard scored another way.

Shared by the guard's log lines (:mod:`qdq_optuna.search`), report.md and the dashboard
(:mod:`qdq_optuna.outputs`): the outputs word what the search measured without importing the
modules that measure.
"""

from __future__ import annotations

#: how far the error a user sees on ONNX Runtime CPU with default options may exceed the
#: guard's before the run warns (ONNX Runtime's integer kernels round differently)
DEFAULT_SESSION_FACTOR = 2.0
#: the guard's verdict (``Verdict.status``, report.json ``accuracy.status``) when the tuned
#: model ships
WITHIN_BOUND = "within bound"


#: :func:`data_kind` of calibration data scored as it is (the samples the scales came from)
CALIBRATION_DATA = "calibration data"


def data_kind(data: str) -> str:
    """Which data the guard's figures come from: ``validation data``, ``calibration data`` or
    ``random inputs``."""
    if data.startswith("--validation-data"):
        return "validation data"
    if data.startswith("--calibration-data held out"):
        return "held-out part of the calibration data"
    if data.startswith("--calibration-data"):
        return CALIBRATION_DATA
    return "random inputs"


def data_phrase(data: str) -> str:
    """:attr:`Guard.data` for people: ``the calibration data (cal.npz:1a2b...)``, or random
    inputs named as such."""
    kind = data_kind(data)
    if kind == "random inputs":
        _, samples, seed = (data.split(":") + ["?", "?"])[:3]
        return f"random inputs ({samples} samples, seed {seed}; a sanity check only)"
    return f"the {kind} ({data.split(' ', 1)[-1]})"


def default_session_lines(check: dict | None, guard_error: float) -> list[str]:
    """Report lines (and the log's warning) on what ONNX Runtime CPU with default options does
    with a model the guard scored another way: empty when it agrees within the factor."""
    if check is None:
        return []
    how = ("to check the model on ONNX Runtime CPU as TensorRT computes it, set the session "
           "option `session.disable_quant_qdq` to `1` (Q/DQ run as written)")
    if not check["loads"]:
        return [f"ONNX Runtime CPU with default options refuses `optimized.onnx` "
                f"({check['refused']}); its Q/DQ fusions do not take every valid Q/DQ graph "
                f"(FP16 scales in QLinearConcat: `benchmarks/ort_fp16_qdq_repro.py`). This does "
                f"not concern TensorRT; {how}."]
    if check["error"] > DEFAULT_SESSION_FACTOR * max(guard_error, 1e-6):
        return [f"ONNX Runtime CPU with default options computes `optimized.onnx` with error "
                f"{check['error']:.4g}, over {DEFAULT_SESSION_FACTOR:g}x the {guard_error:.4g} "
                f"above (its fused integer kernels, not the Q/DQ as written); {how}."]
    return []


def share_words(share: float) -> str:
    """A share of the bound in words: ``0.74`` -> ``74% of``, ``14.2`` -> ``14.2 times``."""
    return f"{share:.3g} times" if share >= 2 else f"{100 * share:.0f}% of"
