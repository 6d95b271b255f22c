"""ONNX Runtime's transformer recipe: ``quantize_dynamic`` on the user's model (MatMuls with
constant weights, int8), as the tool's own file (a recipe file of the ONNX Runtime profile)
and as a whole-model start of the search (every dynamic point on).

Why: on a ViT-Ti/16 at one thread ONNX Runtime's ``quantize_dynamic`` measured 2.04x FP32 at
output cosine 0.9997, its ``quantize_static`` 1.53x at 0.979: on transformers the dynamic
recipe is the one to be at least as fast as.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnx

from qdq_optuna.model.graph import InputShapes, load_model
from qdq_optuna.placement.starts import (
    Start,
    keep_recipe_file,
    quiet_tool,
    start_from_schemes,
)

#: the op types ``quantize_dynamic`` writes with integer kernels in the recipe (its integer-op
#: registry has MatMul, not Gemm: a Gemm stays float in the tool's own file)
DYNAMIC_OP_TYPES = ("MatMul",)


def dynamic_candidates(model: onnx.ModelProto) -> list[str]:
    """The nodes ``quantize_dynamic`` quantizes with the recipe's settings: MatMuls whose
    weight (input B) is a constant, 2-D float initializer (``MatMulConstBOnly``)."""
    consts = {t.name: t for t in model.graph.initializer}
    return [n.name for n in model.graph.node
            if n.op_type in DYNAMIC_OP_TYPES and len(n.input) > 1 and n.input[1] in consts
            and len(consts[n.input[1]].dims) == 2
            and consts[n.input[1]].data_type == onnx.TensorProto.FLOAT]


def ort_dynamic_options() -> dict:
    """``quantize_dynamic``'s settings in ONNX Runtime's transformer recipe (its transformers
    tool's ``quantize_onnx_model``): MatMuls only, int8 weights per tensor, uint8 activations
    (the only dynamic activation type), constant weights only, float where a tensor's type is
    unknown; 7-bit weights where the CPU's u8 x s8 kernels saturate, as its documentation
    advises."""
    from onnxruntime.quantization import QuantType

    from qdq_optuna.model import calibration

    return {"op_types_to_quantize": list(DYNAMIC_OP_TYPES), "per_channel": False,
            "weight_type": QuantType.QInt8,
            "reduce_range": calibration.cpu_saturates_u8s8(),
            "extra_options": {"MatMulConstBOnly": True,
                              "DefaultTensorType": onnx.TensorProto.FLOAT}}


def ort_dynamic_recipe_model(model: str | os.PathLike | onnx.ModelProto, work: Path, *,
                             input_shapes: InputShapes | str | None = None) -> Path | None:
    """ONNX Runtime's ``quantize_dynamic`` (:func:`ort_dynamic_options`) on a copy of
    ``model`` written to ``work``: the path of the quantized model, or None when the model has
    no MatMul with a constant weight (the tool would change nothing). Needs no data: its
    activation ranges are taken per call."""
    from onnxruntime.quantization import quantize_dynamic

    shapes = input_shapes if isinstance(input_shapes, InputShapes) else InputShapes.parse(input_shapes)
    proto = load_model(model, shapes).full_model()
    if not dynamic_candidates(proto):
        return None
    src, out = work / "float.onnx", work / "ort_dynamic.onnx"
    big = proto.ByteSize() > (1 << 30)
    onnx.save(proto, str(src), save_as_external_data=big)
    with quiet_tool("ONNX Runtime's dynamic recipe (quantize_dynamic)"):
        quantize_dynamic(str(src), str(out), use_external_data_format=big,
                         **ort_dynamic_options())
    return out


def ort_dynamic_recipe_bytes(model: str | os.PathLike | onnx.ModelProto, *,
                             input_shapes: InputShapes | str | None = None,
                             data: Mapping[str, np.ndarray] | None = None) -> bytes | None:
    """The dynamic recipe's own file as bytes (the same model gives the same bytes: nothing
    is calibrated); None when the model has no MatMul to quantize or does not fit one file.
    ``data`` is accepted for the recipe-file interface and not used."""
    with tempfile.TemporaryDirectory(prefix="qdq-optuna-dynamic-") as tmp:
        written = ort_dynamic_recipe_model(model, Path(tmp), input_shapes=input_shapes)
        if written is None:
            return None
        path = Path(tmp) / "recipe.onnx"
        return path.read_bytes() if keep_recipe_file(written, path) else None


def dynamic_start(pm) -> Start | None:
    """ONNX Runtime's transformer recipe as a whole-model start: every dynamic point on and
    nothing else (what ``quantize_dynamic`` writes, with the search's graph and weights);
    None when the prepared model has no dynamic point."""
    schemes = {pp.pattern.id: {pid: 1 for pid in pp.ids if pid.endswith(".dynamic")}
               for pp in pm.tunable}
    if not any(schemes.values()):
        return None
    return start_from_schemes(pm, "dynamic", schemes)
