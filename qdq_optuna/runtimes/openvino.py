"""OpenVINO (CPU plugin): its rules, NNCF's recipe, the float part's precision as the plugin's
inference precision hint (never a conversion), the guard's candidates run in OpenVINO itself."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import onnx

from qdq_optuna.backends.base import Backend
from qdq_optuna.model.precision import check_precision
from qdq_optuna.placement.rules import OPENVINO_CPU
from qdq_optuna.runtimes.base import Runtime

log = logging.getLogger("qdq_optuna")


class OpenVino(Runtime):
    name = "openvino"
    rules = OPENVINO_CPU

    def high_precision(self, requested: str | None, backend: str) -> str:
        """A compile hint here (the backend's, :meth:`backend_options`), never a conversion:
        the model stays FP32."""
        if requested is not None:
            check_precision(requested)
        return "fp32"

    def backend_options(self, model: Any, requested_precision: str | None,
                        threads: int | None, input_shapes: dict | None) -> dict:
        """The float part's inference precision hint: ``--high-precision``, else the faster
        hint the CPU supports on the user's float model (the baseline runs at it, and so does
        every candidate)."""
        from qdq_optuna.backends.openvino import choose_precision

        if isinstance(model, onnx.ModelProto):
            model = model.SerializeToString()
        hint, why = choose_precision(model, requested_precision, threads=threads,
                                     input_shapes=input_shapes)
        return {"precision": hint, "precision_why": why}

    has_recipe_file = True
    recipe_tool = "nncf.quantize"

    def recipe_start(self, pm, model: Any, *, input_shapes: Any = None, data: Any = None,
                     keep: Path | None = None):
        from qdq_optuna.placement import starts

        return starts.nncf_recipe_start(pm, model, input_shapes=input_shapes, data=data, keep=keep)

    def recipe_file(self, model: Any, *, input_shapes: Any = None,
                    data: Any = None) -> bytes | None:
        from qdq_optuna.placement import starts

        return starts.recipe_file_bytes(lambda work: starts.nncf_recipe_model(
            model, data=data, input_shapes=input_shapes))

    def error_runner(self, input_shapes: dict | None,
                     backend: Backend | None) -> Callable | None:
        """``OpenVinoBackend.outputs`` at the measuring backend's inference precision (f32 when
        another backend measures): its CPU kernels can differ from the ONNX semantics (16-bit
        sums that saturate on CPUs without VNNI). None where OpenVINO cannot run here: the
        guard then scores the Q/DQ as written in ONNX Runtime, with a warning."""
        from qdq_optuna.backends.base import BackendUnavailable

        hint = (backend.describe().get("inference_precision") if backend is not None
                else None) or "f32"
        try:
            from qdq_optuna.backends.openvino import OpenVinoBackend

            return OpenVinoBackend(precision=hint, input_shapes=input_shapes).outputs
        except (ImportError, BackendUnavailable) as exc:
            log.warning("the accuracy guard scores the Q/DQ as written in ONNX Runtime: "
                        "OpenVINO cannot run here (%s)", exc)
            return None


PROFILE = OpenVino()
