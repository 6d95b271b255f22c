"""Runtime: everything one target runtime decides, in one object chosen once per run.

A run asks its profile (never the runtime's name) for the rules that place Q/DQ, the defaults
(float-part precision, scales inside trials), the recipe start, how the accuracy guard runs a
candidate, what the runtime ran and, where measured, its integer-vs-float kernel timing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qdq_optuna.backends import BACKENDS
from qdq_optuna.backends.base import Backend
from qdq_optuna.backends.what_ran import WhatRan
from qdq_optuna.model.precision import HighPrecisionModel, resolve_high_precision
from qdq_optuna.placement.export import Scales
from qdq_optuna.placement.rules import RuntimeRules


class Runtime:
    """One runtime's profile; a subclass per runtime (``runtimes/<name>.py``, ``PROFILE``)."""

    #: the runtime's name (``--runtime``; a backend's ``BackendSpec.runtime``)
    name: str = ""
    #: where Q/DQ may go, fusion groups, quant types (``rules.default_quant_type``)
    rules: RuntimeRules
    #: the float part's precision when neither ``--high-precision`` nor the backend says
    default_precision: str = "fp32"
    #: ``--scales auto``: calibrated scales inside trials, or placeholders (``default``)
    default_scales: Scales = Scales.CALIBRATED

    def high_precision(self, requested: str | None, backend: str) -> str:
        """The float part's precision for ``--high-precision`` on ``backend`` (checked against
        what its table row refuses; its row's default, else this runtime's)."""
        spec = BACKENDS.get(backend)
        default = (spec.precision if spec is not None else None) or self.default_precision
        return resolve_high_precision(requested, backend, default,
                                      spec.refuses if spec is not None else None)

    def backend_options(self, model: Any, requested_precision: str | None,
                        threads: int | None, input_shapes: dict | None) -> dict:
        """Extra keyword arguments for this runtime's own backends (none by default)."""
        return {}

    def recipe_start(self, pm, model: Any, *, input_shapes: Any = None, data: Any = None,
                     keep: Path | None = None):
        """The runtime's classic quantization recipe as a whole-model start; ``keep``: where
        the recipe tool's own file is written as the tool wrote it (runtimes that have one)."""
        raise NotImplementedError

    #: whether the recipe is a tool run here whose own file is a start (:meth:`recipe_file`)
    has_recipe_file: bool = False

    def recipe_file(self, model: Any, *, input_shapes: Any = None,
                    data: Any = None) -> bytes | None:
        """The recipe tool's own file made again (same model, data, settings: same bytes);
        None where the runtime has no such tool here or the model does not fit one file."""
        return None

    def scores_fused(self, high_precision: HighPrecisionModel | None) -> bool:
        """Whether the accuracy guard scores candidates through ONNX Runtime's fused kernels
        (``ErrorScorer(optimize=...)``) rather than the Q/DQ as written."""
        return False

    def error_runner(self, input_shapes: dict | None,
                     backend: Backend | None) -> Callable | None:
        """What runs a candidate for the accuracy guard, when not ONNX Runtime (None)."""
        return None

    def scored_as(self, bf16: bool, fused: bool, runner: Callable | None) -> str:
        """How the accuracy guard ran the saved model, in the report's words (``runner``:
        this profile's :meth:`error_runner`, None when ONNX Runtime scored it)."""
        if bf16:
            return ("BF16 values in FP32 arithmetic (ONNX Runtime's CPU provider has no BF16 "
                    "kernels)")
        if fused:
            return ("the saved model in ONNX Runtime CPU with all graph optimizations (the fused "
                    "integer kernels an ONNX Runtime deployment runs)")
        return ("the saved model in ONNX Runtime CPU with graph optimizations off: each Q/DQ "
                "computed as written, which is what TensorRT's kernels compute up to their "
                "rounding (ONNX Runtime's own fusions refuse FP16 Q/DQ graphs)")

    def what_ran(self, backend: Backend, model: bytes) -> WhatRan | None:
        """What the runtime fused, ran standalone, kept float, reformatted for ``model``."""
        return backend.what_ran(model)

    def kernel_timing(self, backend: Backend) -> Callable:
        """``fn(float_model, qdq_model, **kw) -> KernelTable``: each integer kernel this
        runtime runs timed against its float kernel on ``backend`` (this machine), its units
        cut as the rules fuse them (:func:`qdq_optuna.measure.kernels.kernel_table`)."""
        from qdq_optuna.measure.kernels import kernel_table

        return functools.partial(kernel_table, backend,
                                 output_q=bool(self.rules.output_quantized_ops))

    def __repr__(self) -> str:
        return f"<runtime {self.name}>"
