"""ONNX Runtime (CPU): its rules, ONNX Runtime's ``quantize_static`` recipe and its
``quantize_dynamic`` transformer recipe as files, fused scoring."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qdq_optuna.model.precision import HighPrecisionModel
from qdq_optuna.placement.dynamic import QuantMode
from qdq_optuna.placement.rules import ONNXRUNTIME_CPU
from qdq_optuna.runtimes.base import RecipeFileSpec, Runtime


class OnnxRuntime(Runtime):
    name = "onnxruntime"
    rules = ONNXRUNTIME_CPU

    has_recipe_file = True
    recipe_tool = "quantize_static"
    #: dynamic int8 MatMuls (DynamicQuantizeMatMul / MatMulIntegerToFloat on its CPU), a
    #: Gemm too (its basic fusions make Gemm of MatMul + Add)
    modes = (QuantMode.STATIC, QuantMode.DYNAMIC)
    dynamic_ops = frozenset({"MatMul", "Gemm"})

    def recipe_start(self, pm, model: Any, *, input_shapes: Any = None, data: Any = None,
                     keep: Path | None = None):
        from qdq_optuna.placement import starts

        return starts.ort_recipe_start(pm, model, input_shapes=input_shapes, data=data, keep=keep)

    def recipe_file(self, model: Any, *, input_shapes: Any = None,
                    data: Any = None) -> bytes | None:
        from qdq_optuna.placement import starts

        return starts.recipe_file_bytes(lambda work: starts.ort_recipe_model(
            model, work, data=data, input_shapes=input_shapes))

    def recipe_files(self) -> tuple[RecipeFileSpec, ...]:
        """``quantize_static``'s file, then ``quantize_dynamic``'s (MatMuls with constant
        weights, int8: ONNX Runtime's recipe for transformers on CPU; no file for a model
        without such a MatMul)."""
        from qdq_optuna.placement.dynamic_recipe import ort_dynamic_recipe_bytes

        return (*super().recipe_files(),
                RecipeFileSpec(f"{self.name}_dynamic", "quantize_dynamic",
                               ort_dynamic_recipe_bytes, placement=False))

    def scores_fused(self, high_precision: HighPrecisionModel | None) -> bool:
        """ONNX Runtime's fused integer kernels are what its rules stand for, but only with an
        FP32 float part: its CPU fusions refuse valid FP16 Q/DQ graphs (QLinearConcat takes
        FP32 scales only), so an FP16 model under its rules is scored as written."""
        return high_precision is None or high_precision.precision == "fp32"


PROFILE = OnnxRuntime()
