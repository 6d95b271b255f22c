"""TensorRT: its rules, FP16 float part by default, placeholder scales inside trials, its
classic INT8 PTQ recipe."""

from __future__ import annotations

from typing import Any

from qdq_optuna.placement.rules import TENSORRT
from qdq_optuna.runtimes.base import Runtime


class TensorRT(Runtime):
    name = "tensorrt"
    rules = TENSORRT
    #: TensorRT users deploy FP16 (the cost model and callables under its rules too)
    default_precision = "fp16"
    #: placeholder scales inside trials (``--scales auto`` under TensorRT's rules)
    default_scales = "default"

    def recipe_start(self, pm, model: Any, *, input_shapes: Any = None, data: Any = None,
                     keep=None):
        from qdq_optuna.placement import starts

        return starts.tensorrt_recipe_start(pm)


PROFILE = TensorRT()
