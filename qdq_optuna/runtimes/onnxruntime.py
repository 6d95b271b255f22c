"""ONNX Runtime (CPU): its rules, ONNX Runtime's ``quantize_static`` recipe, fused scoring."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qdq_optuna.model.precision import HighPrecisionModel
from qdq_optuna.placement.rules import ONNXRUNTIME_CPU
from qdq_optuna.runtimes.base import Runtime


class OnnxRuntime(Runtime):
    name = "onnxruntime"
    rules = ONNXRUNTIME_CPU

    has_recipe_file = True

    def recipe_start(self, pm, model: Any, *, input_shapes: Any = None, data: Any = None,
                     keep: Path | None = None):
        from qdq_optuna.placement import starts

        return starts.ort_recipe_start(pm, model, input_shapes=input_shapes, data=data, keep=keep)

    def recipe_file(self, model: Any, *, input_shapes: Any = None,
                    data: Any = None) -> bytes | None:
        from qdq_optuna.placement import starts

        return starts.recipe_file_bytes(lambda work: starts.ort_recipe_model(
            model, work, data=data, input_shapes=input_shapes))

    def scores_fused(self, high_precision: HighPrecisionModel | None) -> bool:
        """ONNX Runtime's fused integer kernels are what its rules stand for, but only with an
        FP32 float part: its CPU fusions refuse valid FP16 Q/DQ graphs (QLinearConcat takes
        FP32 scales only), so an FP16 model under its rules is scored as written."""
        return high_precision is None or high_precision.precision == "fp32"


PROFILE = OnnxRuntime()
