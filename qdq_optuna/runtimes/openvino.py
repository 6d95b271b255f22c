"""OpenVINO (CPU plugin): its rules, NNCF's recipes (run, and read back as starts: the default
preset for every model, the transformer preset for models with attention), the float part's
precision as the plugin's inference precision hint (never a conversion), the guard's
candidates run in OpenVINO itself."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import onnx

from qdq_optuna.backends.base import Backend
from qdq_optuna.errors import ToolError
from qdq_optuna.model.graph import InputShapes, ensure_opset, load_model
from qdq_optuna.model.precision import check_precision
from qdq_optuna.placement.rules import RuntimeRules, SevenBitWeights, swish_operand
from qdq_optuna.placement.starts import (
    KeepFile,
    Start,
    keep_recipe_file,
    quiet_tool,
    read_placement,
    recipe_file_bytes,
    start_from_uses,
)
from qdq_optuna.runtimes.base import RecipeFileSpec, Runtime

log = logging.getLogger("qdq_optuna")

#: the loggers NNCF and OpenVINO write to besides the root (NNCF's keeps its own handler and
#: level; quieted while the recipe runs)
TOOL_LOGGERS = ("nncf", "openvino")

#: OpenVINO's low-precision transformations (LPT): the ONNX ops whose OpenVINO operation has an
#: LPT transformation that keeps it in u8/i8 when a FakeQuantize (a Q/DQ pair read from ONNX)
#: feeds it (docs: "OpenVINO Low Precision Transformations", its list of quantized operations:
#: Add, AvgPool, Clamp, Concat, Convolution, ConvolutionBackpropData, DepthToSpace, Gather,
#: GroupConvolution, Interpolate, MatMul, MaxPool, Multiply, MVN, NormalizeL2, Pad, PRelu,
#: ReduceMax/Mean/Min/Sum, Relu, Reshape, ShuffleChannels, Split, Squeeze, StridedSlice,
#: Subtract, Transpose, Unsqueeze, VariadicSplit). NNCF's placements for ONNX put Q/DQ on the
#: inputs of Conv, MatMul, Gemm, Add, Concat, Split, Resize, MaxPool (read from its output on
#: the zoo's YOLO, ResNet and on nudenet-320n), all inside this set.
OPENVINO_QUANTIZED_OPS = frozenset(
    {
        "Conv", "ConvTranspose", "MatMul", "Gemm", "Add", "Sub", "Mul", "Concat", "MaxPool",
        "AveragePool", "GlobalAveragePool", "Resize", "Reshape", "Transpose", "Squeeze",
        "Unsqueeze", "Flatten", "Gather", "Split", "Slice", "Pad", "DepthToSpace",
        "SpaceToDepth", "Relu", "Clip", "PRelu", "ReduceMean", "ReduceMax", "ReduceMin",
        "ReduceSum", "MeanVarianceNormalization", "LpNormalization",
    }
)

#: OpenVINO CPU: a Q/DQ pair is read as one FakeQuantize on the tensor; the plugin folds it
#: into the *producer's* output (a Convolution writing u8: ``originalLayersNames`` of the
#: runtime layer lists the QuantizeLinear) and the consumer reads u8. Unlike ONNX Runtime no Q
#: is needed after an op to run it quantized, so only inputs are sites (no output rules), and
#: a Relu after a Conv is folded by OpenVINO itself (no filter). Activations u8 (as NNCF emits
#: for non-negative and asymmetric ranges), weights i8 per channel.
OPENVINO_CPU = RuntimeRules(
    name="openvino",
    default_quant_type="uint8",
    quant_types=("uint8", "int8"),
    quantizable_ops=OPENVINO_QUANTIZED_OPS,
    fusion_group_ops=frozenset(
        {"Conv", "ConvTranspose", "MatMul", "Gemm", "Add", "Mul", "Concat", "MaxPool",
         "AveragePool", "GlobalAveragePool", "Resize"}
    ),
    # LPT's precision-preserving operations (MaxPool, Reshape, Transpose, Squeeze, Unsqueeze,
    # Split, StridedSlice, Concat, DepthToSpace, Pad, Interpolate nearest): measured, NNCF's
    # ResNet quantizes the Relu before a MaxPool and the next Conv's weights; that Conv runs
    # u8 (runtimePrecision) only when its weights carry their DequantizeLinear too
    precision_preserving_ops=frozenset(
        {"MaxPool", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Split", "Slice",
         "Concat", "DepthToSpace", "SpaceToDepth", "Pad", "Resize"}
    ),
    # always shared (as NNCF does): LPT turns a Concat of u8 inputs with different scales into
    # a per-channel dequantization after it, which the next Convolution cannot fold, so that
    # Convolution runs f32 with its weights dequantized at run time. Measured on nudenet-320n
    # (NNCF's placement, our percentile scales): with the ONNX Runtime ratio 0.5 one Concat
    # (model.4, Split outputs next to residual Adds) kept two scales: Convolution u8 63 + f32
    # 1, Reorder f32 6; shared: u8 64, Reorder f32 3, as NNCF's file
    concat_share_ratio=0.0,
    # the image (or other raw input) a first layer reads spans the whole u8 range: there the
    # 16-bit pair sums overflow. mtcnn-rnet on an AVX2 CPU, same model in OpenVINO: worst
    # output cosine vs FP32 0.65 with 8-bit first-layer weights, 0.997 with 7 bits (ONNX
    # Runtime without fusions, which does not saturate, read 0.997 for both)
    seven_bit_weights=SevenBitWeights.FIRST,
    use_filters=(swish_operand,),
)


#: ops between an attention's Softmax and the MatMul that weighs the values with it, which
#: change the layout but not what is read (exports put Cast, Reshape or Dropout there)
_LAYOUT_OPS = frozenset({"Cast", "Identity", "Reshape", "Transpose", "Dropout", "Squeeze",
                         "Unsqueeze"})


def attention_blocks(model: onnx.ModelProto) -> int:
    """How many attention blocks ``model`` has: Softmax outputs that a MatMul of two
    activations reads (attention's probabilities times its values; a classifier's final
    Softmax feeds no MatMul, a linear layer's MatMul has a constant weight). NNCF's
    ``ModelType.TRANSFORMER`` preset is written for these graphs: it leaves the attention's
    Softmax, LayerNorm and GELU parts float and smooths the MatMul inputs' outliers."""
    g = model.graph
    constants = {t.name for t in g.initializer} | {
        o for n in g.node if n.op_type == "Constant" for o in n.output}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in g.node:
        for t in n.input:
            readers.setdefault(t, []).append(n)

    def weighs_values(tensor: str, depth: int = 0) -> bool:
        for n in readers.get(tensor, []):
            if n.op_type == "MatMul" and not any(t in constants for t in n.input):
                return True
            if n.op_type in _LAYOUT_OPS and depth < 4 and weighs_values(n.output[0], depth + 1):
                return True
        return False

    return sum(1 for n in g.node if n.op_type == "Softmax" and weighs_values(n.output[0]))


def nncf_recipe_model(model: str | os.PathLike | onnx.ModelProto, *,
                      data: Mapping[str, np.ndarray] | None = None,
                      input_shapes: InputShapes | str | None = None, samples: int = 4,
                      transformer: bool = False) -> onnx.ModelProto:
    """What an OpenVINO user gets from NNCF's documented one-liner, ``nncf.quantize`` with its
    defaults (``nncf.Dataset`` of feed dicts), on ``model``; calibrated on ``data`` (graph
    input -> samples on axis 0) or on ``samples`` random feeds; ``transformer``: with
    ``model_type=nncf.ModelType.TRANSFORMER``, NNCF's preset for transformers. Raises
    :class:`ToolError` when nncf is missing or refuses the model."""
    try:
        import nncf
    except ImportError:
        raise ToolError("NNCF (OpenVINO's recipe) is not installed (pip install nncf)") from None
    from qdq_optuna.model import calibration

    shapes = input_shapes if isinstance(input_shapes, InputShapes) else InputShapes.parse(input_shapes)
    proto = load_model(model, shapes, fed=data or ()).full_model()
    proto = ensure_opset(proto, 13, "NNCF's per-channel recipe")
    if data is None:
        data = calibration.random_calibration_data(proto, shapes.shapes or None,
                                                   samples=samples, seed=0)
    count = len(next(iter(data.values())))
    feeds = [{k: v[i:i + 1] for k, v in data.items()} for i in range(count)]
    preset = {"model_type": nncf.ModelType.TRANSFORMER} if transformer else {}
    what = "NNCF's transformer recipe (nncf.quantize, ModelType.TRANSFORMER)" if transformer \
        else "NNCF's recipe (nncf.quantize)"
    with quiet_tool(what, TOOL_LOGGERS):
        nncf.set_log_level(logging.ERROR)
        return nncf.quantize(proto, nncf.Dataset(feeds), subset_size=count, **preset)


def nncf_activation_type(qdq_model: onnx.ModelProto) -> str:
    """The activation type most of a Q/DQ model's QuantizeLinear write ("uint8" or "int8"):
    NNCF's default preset writes int8 (symmetric) wherever a tensor can be negative."""
    zps = {t.name: t.data_type for t in qdq_model.graph.initializer}
    types = [zps.get(n.input[2]) for n in qdq_model.graph.node
             if n.op_type == "QuantizeLinear" and len(n.input) > 2]
    signed, unsigned = types.count(onnx.TensorProto.INT8), types.count(onnx.TensorProto.UINT8)
    return "int8" if signed > unsigned else "uint8"


def nncf_recipe_start(pm, model: str | os.PathLike | onnx.ModelProto, *,
                      data: Mapping[str, np.ndarray] | None = None,
                      input_shapes: InputShapes | str | None = None,
                      keep: KeepFile | None = None) -> Start:
    """NNCF's placement (:func:`nncf_recipe_model`) read back onto ``pm``'s graph; with
    ``keep``, NNCF's own file is also handed to it
    (:func:`~qdq_optuna.placement.starts.keep_recipe_file`)."""
    written = nncf_recipe_model(model, data=data, input_shapes=input_shapes)
    uses, notes, counts = read_placement(pm, written)
    if keep is not None:
        keep_recipe_file(written, keep)
    return start_from_uses(pm, "recipe:openvino", uses, notes, counts)


#: the start of NNCF's transformer preset (not ``recipe:...``: the default preset is the
#: recipe every OpenVINO model is held to; this one is a start like any other)
TRANSFORMER_START = "nncf-transformer"


def nncf_transformer_start(pm, model: str | os.PathLike | onnx.ModelProto, *,
                           data: Mapping[str, np.ndarray] | None = None,
                           input_shapes: InputShapes | str | None = None,
                           keep: KeepFile | None = None) -> Start | None:
    """NNCF's transformer preset's placement read back onto ``pm``'s graph (its file kept at
    ``keep``), or None for a model without attention (:func:`attention_blocks`), for which
    the preset is not meant."""
    if not attention_blocks(pm.graph.full_model()):
        return None
    written = nncf_recipe_model(model, data=data, input_shapes=input_shapes, transformer=True)
    uses, notes, counts = read_placement(pm, written)
    if keep is not None:
        keep_recipe_file(written, keep)
    return start_from_uses(pm, TRANSFORMER_START, uses, notes, counts)


def nncf_transformer_bytes(model: str | os.PathLike | onnx.ModelProto, *,
                           input_shapes: InputShapes | str | None = None,
                           data: Mapping[str, np.ndarray] | None = None) -> bytes | None:
    """NNCF's transformer preset's own file made again (same model and data: same bytes), or
    None for a model without attention or too big for one file."""
    shapes = input_shapes if isinstance(input_shapes, InputShapes) else InputShapes.parse(input_shapes)
    if not attention_blocks(load_model(model, shapes, fed=data or ()).full_model()):
        return None
    return recipe_file_bytes(lambda work: nncf_recipe_model(
        model, data=data, input_shapes=input_shapes, transformer=True))


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
                     keep: KeepFile | None = None):
        return nncf_recipe_start(pm, model, input_shapes=input_shapes, data=data, keep=keep)

    def recipe_file(self, model: Any, *, input_shapes: Any = None,
                    data: Any = None) -> bytes | None:
        return recipe_file_bytes(lambda work: nncf_recipe_model(
            model, data=data, input_shapes=input_shapes))

    def recipe_files(self) -> tuple[RecipeFileSpec, ...]:
        """NNCF's default preset's file, then its transformer preset's
        (``ModelType.TRANSFORMER``, for models with attention: :func:`attention_blocks`),
        whose placement is also a start."""
        return (*super().recipe_files(),
                RecipeFileSpec(f"{self.name}_transformer",
                               "nncf.quantize(model_type=ModelType.TRANSFORMER)",
                               nncf_transformer_bytes, start=nncf_transformer_start))

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

    def scored_as(self, bf16: bool, fused: bool, runner: Callable | None) -> str:
        if runner is not None:
            return ("the saved model in OpenVINO's CPU plugin, compiled as the timings compile "
                    "it (what an OpenVINO deployment computes)")
        return super().scored_as(bf16, fused, runner)


PROFILE = OpenVino()
