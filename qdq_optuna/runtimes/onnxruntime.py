"""ONNX Runtime (CPU): its rules, ONNX Runtime's ``quantize_static`` recipe (run, and read back
as a start), its ``quantize_dynamic`` transformer recipe and its weight-only recipe
(``MatMulNBitsQuantizer``) as files, the modes its installed version has kernels for, fused
scoring, and how its recipe's kernels compare with our export's."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import onnx

from qdq_optuna.backends.base import SessionSettings
from qdq_optuna.backends.onnxruntime_kernels import kernels_of
from qdq_optuna.errors import ToolError
from qdq_optuna.measure.kernels import qdq_unit
from qdq_optuna.measure.recipe_parity import RecipeParity
from qdq_optuna.model.calibration import CONCAT_SHARE_RATIO
from qdq_optuna.model.graph import Graph, InputShapes, ensure_opset, load_model
from qdq_optuna.model.precision import HighPrecisionModel
from qdq_optuna.placement import weight_only
from qdq_optuna.placement.dynamic import QuantMode
from qdq_optuna.placement.rules import Preprocess, RuntimeRules, SevenBitWeights, fused_activation
from qdq_optuna.placement.starts import (
    CONVOLUTIONS,
    KeepFile,
    Start,
    keep_recipe_file,
    quiet_tool,
    read_placement,
    read_scales,
    recipe_file_bytes,
    recipe_file_data,
    start_from_uses,
)
from qdq_optuna.runtimes.base import RecipeFileSpec, Runtime

#: the loggers ONNX Runtime's quantization tool writes to besides the root (quieted while it runs)
TOOL_LOGGERS = ("onnxruntime",)

#: ONNX Runtime's QDQ selectors (onnxruntime/core/optimizer/qdq_transformer): ops that run
#: quantized when DQ feeds their inputs and Q follows their output.
ORT_QUANTIZED_OPS = frozenset(
    {
        "Conv", "ConvTranspose", "MatMul", "Gemm", "Add", "Mul", "Concat", "MaxPool",
        "AveragePool", "GlobalAveragePool", "Relu", "Clip", "LeakyRelu", "Sigmoid", "HardSigmoid",
        "Resize", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Gather", "Split",
        "Softmax", "Where", "Pad", "DepthToSpace", "SpaceToDepth", "Slice", "Tanh", "Expand",
        "Tile", "ReduceMean", "ReduceMin", "ReduceMax", "InstanceNormalization",
        "LayerNormalization", "Abs", "Neg", "Erf",
    }
)

ONNXRUNTIME_CPU = RuntimeRules(
    name="onnxruntime",
    preprocess=Preprocess.ORT_BASIC,
    default_quant_type="uint8",
    quant_types=("uint8", "int8"),
    quantizable_ops=ORT_QUANTIZED_OPS,
    use_filters=(fused_activation,),
    fusion_group_ops=frozenset(
        {"Conv", "ConvTranspose", "MatMul", "Gemm", "Add", "Mul", "Concat", "MaxPool",
         "AveragePool", "GlobalAveragePool", "Resize", "Sigmoid", "LeakyRelu"}
    ),
    quantize_bias_ops=frozenset({"Gemm"}),
    output_quantized_ops=ORT_QUANTIZED_OPS,
    constant_operand_ops=frozenset({"Add", "Mul", "Concat"}),
    table_ops=frozenset({"Gather"}),
    concat_share_ratio=CONCAT_SHARE_RATIO,  # QLinearConcat copies the bytes
    seven_bit_weights=SevenBitWeights.ALL,
)


def ort_recipe_model(model: str | os.PathLike | onnx.ModelProto, work: Path, *,
                     data: Mapping[str, np.ndarray] | None = None,
                     input_shapes: InputShapes | str | None = None, samples: int = 4
                     ) -> Path:
    """What a user gets from ONNX Runtime's documented one-liner: ``quant_pre_process`` then
    ``quantize_static`` (QDQ, per-channel, uint8 activations, int8 weights), on a copy of
    ``model`` written to ``work``; calibrated on ``data`` (graph input -> samples on axis 0),
    or on ``samples`` random feeds. Returns the path of the quantized model."""
    from onnxruntime.quantization import (
        CalibrationDataReader,
        quantize_static,
    )
    from onnxruntime.quantization.shape_inference import quant_pre_process

    from qdq_optuna.model import calibration
    from qdq_optuna.runtimes._ort_indexed import indexed_lookups

    shapes = input_shapes if isinstance(input_shapes, InputShapes) else InputShapes.parse(input_shapes)
    # checked, static shapes, weights in memory; the inputs the data feeds stay inputs
    proto = load_model(model, shapes, fed=data or ()).full_model()
    # per-channel DequantizeLinear (its axis) needs opset 13: below it, the tool writes a model
    # ONNX Runtime refuses, and its user upgrades the opset first
    proto = ensure_opset(proto, 13, "ONNX Runtime's per-channel recipe")
    src, pre, out = work / "float.onnx", work / "preprocessed.onnx", work / "ort_recipe.onnx"
    big = proto.ByteSize() > (1 << 30)
    onnx.save(proto, str(src), save_as_external_data=big)
    if data is None:
        data = calibration.random_calibration_data(proto, shapes.shapes or None,
                                                   samples=samples, seed=0)
    feeds = [{k: v[i:i + 1] for k, v in data.items()} for i in range(len(next(iter(data.values()))))]

    class _Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.it = iter(feeds)

        def get_next(self):
            return next(self.it, None)

    with quiet_tool("ONNX Runtime's recipe (quant_pre_process + quantize_static)", TOOL_LOGGERS):
        quant_pre_process(str(src), str(pre), skip_symbolic_shape=True,
                          save_as_external_data=big)
        # the ranges outside ``work``: a file beside the model there reads as its weights
        with tempfile.TemporaryDirectory(prefix="qdq-optuna-ranges-") as ranges:
            cache = ort_minmax_cache(pre, feeds, Path(ranges) / "ort_ranges.json")
            with indexed_lookups(len(proto.graph.node)):
                quantize_static(str(pre), str(out), None if cache else _Reader(),
                                calibration_cache_path=cache, use_external_data_format=big,
                                **ort_recipe_options())
    return out


def ort_minmax_cache(model_path: Path, feeds: list[dict], path: Path) -> Path | None:
    """``quantize_static``'s MinMax ranges for ``model_path`` on ``feeds``, written as its
    own calibration cache (``calibration_cache_path``), so it skips its calibrator; None when
    this ONNX Runtime has no such cache (it calibrates itself).

    Why: its calibrator inserts a ReduceMin/ReduceMax pair per tensor, each time searching
    the node list and rebuilding the value-info map, which is quadratic in the graph's size:
    a 4,755-node decoder spent 424 of its first 475 s there (under a profiler). The tensors
    are ONNX Runtime's own choice (``select_tensors_to_calibrate``); each range is
    the minimum and maximum over the feeds of the tensor as its calibration session computes
    it (no graph optimization), so the ranges, and the recipe's file, are the same."""
    import inspect

    import onnxruntime as ort
    from onnxruntime.quantization import quantize_static
    from onnxruntime.quantization.calibrate import (
        CalibrationMethod,
        MinMaxCalibrater,
        TensorsData,
        save_tensors_data,
    )
    from onnxruntime.quantization.registry import QDQRegistry, QLinearOpsRegistry

    if "calibration_cache_path" not in inspect.signature(quantize_static).parameters:
        return None
    ops = list(set(QLinearOpsRegistry) | set(QDQRegistry))  # quantize_static's default
    calibrator = MinMaxCalibrater(str(model_path), ops,
                                  augmented_model_path=str(path.with_suffix(".onnx")))
    model = calibrator.model
    tensors, value_infos = calibrator.select_tensors_to_calibrate(model)
    inputs = {i.name for i in model.graph.input}
    outputs = {o.name for o in model.graph.output}
    names = sorted(tensors)
    for name in names:
        if name not in inputs and name not in outputs:
            model.graph.output.append(value_infos[name])
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    fetch = [n for n in names if n not in inputs]
    lows: dict[str, list] = {n: [] for n in names}
    highs: dict[str, list] = {n: [] for n in names}
    for feed in feeds:
        values = dict(zip(fetch, session.run(fetch, feed)))
        values.update({n: feed[n] for n in names if n in inputs})
        for name in names:
            v = np.asarray(values[name])
            lows[name].append(v.min() if v.size else np.array(np.inf, v.dtype))
            highs[name].append(v.max() if v.size else np.array(-np.inf, v.dtype))
    ranges = {n: (np.nanmin(lows[n], axis=0, keepdims=True).astype(np.asarray(lows[n][0]).dtype),
                  np.nanmax(highs[n], axis=0, keepdims=True).astype(np.asarray(highs[n][0]).dtype))
              for n in names}
    save_tensors_data(TensorsData(CalibrationMethod.MinMax, ranges), path)
    return path


def ort_recipe_options() -> dict:
    """``quantize_static``'s settings in ONNX Runtime's documented recipe (QDQ, per-channel,
    uint8 activations, int8 weights; 7-bit weights where the CPU's u8 x s8 kernels saturate,
    as its documentation advises): one place for the recipe start and the benchmarks."""
    from onnxruntime.quantization import QuantFormat, QuantType

    from qdq_optuna.model import calibration

    return {"quant_format": QuantFormat.QDQ, "per_channel": True,
            "activation_type": QuantType.QUInt8, "weight_type": QuantType.QInt8,
            "reduce_range": calibration.cpu_saturates_u8s8()}


def ort_recipe_start(pm, model: str | os.PathLike | onnx.ModelProto, *,
                     data: Mapping[str, np.ndarray] | None = None,
                     input_shapes: InputShapes | str | None = None,
                     keep: KeepFile | None = None) -> Start:
    """ONNX Runtime's recipe (:func:`ort_recipe_model`) on the user's ``model``, read back onto
    ``pm``'s graph; with ``keep``, the recipe's own file as the tool wrote it is also handed to
    it (:func:`~qdq_optuna.placement.starts.keep_recipe_file`)."""
    with tempfile.TemporaryDirectory(prefix="qdq-optuna-recipe-") as tmp:
        path = ort_recipe_model(model, Path(tmp), data=data, input_shapes=input_shapes)
        uses, notes, counts = read_placement(pm, path)
        if keep is not None:
            keep_recipe_file(path, keep)
    return start_from_uses(pm, "recipe:onnxruntime", uses, notes, counts)


def recipe_parity(pm, model, *, data=None, input_shapes=None, check_samples: int = 0
                  ) -> RecipeParity:
    """Run ONNX Runtime's recipe on ``model`` (the file ``pm`` was prepared from; calibrated
    on ``data``), project it onto ``pm``'s points and compare what ONNX Runtime runs for it and
    for our export (with the recipe's scales; checked with ``onnx.checker``). With
    ``check_samples``, both models also run on that many samples of ``data``."""
    from qdq_optuna.measure.accuracy import output_errors, run_model, summarize

    with tempfile.TemporaryDirectory(prefix="qdq-optuna-parity-") as tmp:
        path = ort_recipe_model(model, Path(tmp), data=data, input_shapes=input_shapes)
        uses, notes, counts = read_placement(pm, path)
        start = start_from_uses(pm, "recipe:onnxruntime", uses, notes, counts)
        exporter = pm.exporter(scales=read_scales(path))
        ours = exporter.to_bytes(exporter.plan(start.scheme_uses))
        onnx.checker.check_model(onnx.load_from_string(ours))
        agreement = None
        if check_samples and data is not None:
            feeds = {k: v[:check_samples] for k, v in data.items()}
            agreement = summarize(output_errors(run_model(str(path), feeds),
                                                run_model(ours, feeds)))
        return RecipeParity(start, kernels_of(ours), kernels_of(path), agreement)


# -- ONNX Runtime's transformer recipe (quantize_dynamic) --------------------------------------
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


def only_a_head(graph: Graph, candidates: list[str]) -> bool:
    """Whether the MatMuls a transformer recipe would change are only a CNN's head: all after
    the model's last convolution, each reading one row per batch item (pooled features):
    its file would be the float model but for its head, not worth a whole-model A/B. A model
    with MatMuls between convolutions (an OCR recognizer's attention blocks between its
    backbone and neck) keeps its files, and so does a transformer with a convolution stem
    (a ViT's patch embedding: its MatMuls read a row per token; they were taken for a head,
    and its ``quantize_dynamic`` file was never measured). A shape not known keeps them.
    ``graph``: the model as :func:`~qdq_optuna.model.graph.load_model` read it (its shapes
    inferred)."""
    nodes = graph.nodes
    convs = [i for i, n in enumerate(nodes) if n.op_type in CONVOLUTIONS]
    if not convs or not candidates:
        return False
    names = set(candidates)
    if min(i for i, n in enumerate(nodes) if n.name in names) < max(convs):
        return False
    for n in nodes:
        if n.name in names:
            dims = graph.shapes.get(n.input[0])
            if dims is None or any(not isinstance(d, int) or d < 1 for d in dims[1:-1]):
                return False
            if int(np.prod(dims[1:-1], dtype=np.int64)) > 1:  # rows per item: tokens
                return False
    return True


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
    with quiet_tool("ONNX Runtime's dynamic recipe (quantize_dynamic)", TOOL_LOGGERS):
        quantize_dynamic(str(src), str(out), use_external_data_format=big,
                         **ort_dynamic_options())
    return out


def ort_dynamic_recipe_bytes(model: str | os.PathLike | onnx.ModelProto, *,
                             input_shapes: InputShapes | str | None = None,
                             data: Mapping[str, np.ndarray] | None = None) -> bytes | None:
    """The dynamic recipe's own file as bytes (the same model gives the same bytes: nothing
    is calibrated); None when the model has no MatMul to quantize, its MatMuls
    are only its head (:func:`only_a_head`), or it does not fit one file.
    ``data`` is accepted for the recipe-file interface and not used."""
    shapes = input_shapes if isinstance(input_shapes, InputShapes) else InputShapes.parse(input_shapes)
    graph = load_model(model, shapes)
    proto = graph.full_model()
    if only_a_head(graph, dynamic_candidates(proto)):
        return None
    with tempfile.TemporaryDirectory(prefix="qdq-optuna-dynamic-") as tmp:
        written = ort_dynamic_recipe_model(proto, Path(tmp), input_shapes=shapes)
        if written is None:
            return None
        return recipe_file_data(written)


# -- ONNX Runtime's weight-only recipe (MatMulNBitsQuantizer) -------------------------------------
#: the weight-only recipe's bits: int4, what ONNX Runtime's LLM users deploy
WEIGHT_ONLY_RECIPE_BITS = 4


def weight_only_candidates(model: onnx.ModelProto, block_size: int = weight_only.BLOCK_SIZE
                           ) -> tuple[list[str], list[str]]:
    """``(large, small)``: the MatMuls of a constant 2-D float weight, named, whose K holds a
    whole block (``block_size`` rows: the weight-only recipe's), and the others."""
    consts = {t.name: t for t in model.graph.initializer}
    large, small = [], []
    for n in model.graph.node:
        if n.op_type in DYNAMIC_OP_TYPES and len(n.input) > 1 and n.input[1] in consts \
                and len(consts[n.input[1]].dims) == 2 \
                and consts[n.input[1]].data_type == onnx.TensorProto.FLOAT:
            (large if consts[n.input[1]].dims[0] >= block_size else small).append(n.name)
    return large, small


def ort_weight_only_recipe_bytes(model: str | os.PathLike | onnx.ModelProto, *,
                                 input_shapes: InputShapes | str | None = None,
                                 data: Mapping[str, np.ndarray] | None = None) -> bytes | None:
    """ONNX Runtime's weight-only recipe as its own tool writes it: ``MatMulNBitsQuantizer``
    (int4, its default block size 128, asymmetric, ``accuracy_level`` 4) on the MatMuls of
    constant weights whose K holds a whole block (the large ones; the others stay float);
    None when the model has none, or the file would not fit one protobuf. ``data`` is accepted
    for the recipe-file interface and not used (nothing is calibrated)."""
    shapes = input_shapes if isinstance(input_shapes, InputShapes) else InputShapes.parse(input_shapes)
    graph = load_model(model, shapes)
    proto = graph.full_model()
    large, small = weight_only_candidates(proto)
    if (not large or only_a_head(graph, large)
            or not weight_only.kernel_available(WEIGHT_ONLY_RECIPE_BITS)):
        return None
    try:
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
    except ImportError as exc:  # its onnx_ir dependency missing
        raise ToolError(f"ONNX Runtime's weight-only recipe (matmul_nbits_quantizer) cannot "
                        f"be imported ({exc}; pip install onnx-ir)") from exc
    if proto.ByteSize() > (1 << 31) - 1:
        return None
    with quiet_tool("ONNX Runtime's weight-only recipe (MatMulNBitsQuantizer)", TOOL_LOGGERS):
        quantizer = MatMulNBitsQuantizer(
            proto, bits=WEIGHT_ONLY_RECIPE_BITS, block_size=weight_only.BLOCK_SIZE,
            is_symmetric=False, accuracy_level=weight_only.ACCURACY_LEVEL,
            nodes_to_exclude=small, op_types_to_quantize=DYNAMIC_OP_TYPES)
        quantizer.process()
    return quantizer.model.model.SerializeToString()


def weight_only_modes_lacking() -> dict[QuantMode, str]:
    """The weight-only modes the installed onnxruntime has no MatMulNBits kernel for, with
    the line ``--modes`` refuses them with."""
    import onnxruntime

    return {m: f"{m.value} needs ONNX Runtime's MatMulNBits kernel ({m.bits}-bit), which "
               f"onnxruntime {onnxruntime.__version__} here lacks"
            for m in (QuantMode.WEIGHT_INT8, QuantMode.WEIGHT_INT4)
            if not weight_only.kernel_available(m.bits)}


#: ONNX Runtime's session settings that change what it runs for a placement, each A/B-timed
#: on the shipped model where it changes the kernels ONNX Runtime runs
SESSION_SETTINGS = (
    SessionSettings(
        "no_qdq_propagation",
        (("optimization.disable_specified_optimizers", "QDQPropagationTransformer"),),
        why="ONNX Runtime's QDQPropagationTransformer moves a QuantizeLinear in front of an "
            "op that only selects or moves values (MaxPool, Reshape, Transpose, ...), so that "
            "op runs on uint8 where the placement left it float; a uint8 MaxPool after a "
            "float op runs in a slower NCHW kernel than the float one",
        code=('so.add_session_config_entry("optimization.disable_specified_optimizers", '
              '"QDQPropagationTransformer")',)),
)


#: the attributes NhwcMaxPool takes of a MaxPool's
_NHWC_POOL_ATTRS = frozenset({"auto_pad", "ceil_mode", "dilations", "kernel_shape", "pads",
                              "strides"})


def nhwc_max_pool_unit(node: onnx.NodeProto, inputs: list, output: tuple,
                       params: list) -> onnx.ModelProto:
    """A uint8 MaxPool as ONNX Runtime runs it between its integer kernels, which run in
    NHWC: its NhwcMaxPool on uint8 (the MaxPool alone behind DQ -> Q runs a NCHW uint8
    kernel about 10x slower than the float one, which is not what a chain of integer kernels
    runs)."""
    from onnx import TensorProto, helper

    def nhwc(shape: list) -> list:
        return [shape[0], *shape[2:], shape[1]]

    (name, shape), = inputs
    pool = helper.make_node("NhwcMaxPool", [name], [output[0]], domain="com.microsoft")
    pool.attribute.extend(a for a in node.attribute if a.name in _NHWC_POOL_ATTRS)
    graph = helper.make_graph(
        [pool], "unit", [helper.make_tensor_value_info(name, TensorProto.UINT8, nhwc(shape))],
        [helper.make_tensor_value_info(output[0], TensorProto.UINT8, nhwc(output[1]))])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                   helper.make_opsetid("com.microsoft", 1)])


#: the ops besides Conv/Gemm/MatMul ONNX Runtime's CPU provider has integer kernels for, and
#: how each one's integer kernel is built alone to be timed (QLinearConcat, QLinearAdd,
#: QLinearMul, QLinearAveragePool, QLinearGlobalAveragePool, a uint8 Resize, NhwcMaxPool)
OP_UNITS = MappingProxyType({
    "MaxPool": nhwc_max_pool_unit, "AveragePool": qdq_unit, "GlobalAveragePool": qdq_unit,
    "Concat": qdq_unit, "Add": qdq_unit, "Mul": qdq_unit, "Resize": qdq_unit})


class OnnxRuntime(Runtime):
    name = "onnxruntime"
    rules = ONNXRUNTIME_CPU
    session_settings = SESSION_SETTINGS
    op_units = OP_UNITS

    def settings_matter(self, model: bytes, settings: SessionSettings) -> bool:
        """Whether ONNX Runtime's optimized graph of ``model`` has other kernels (op types,
        float ops, Q/DQ left) under ``settings`` than under its defaults."""
        return not kernels_of(model).same_as(kernels_of(model, settings.entries))

    has_recipe_file = True
    recipe_tool = "quantize_static"
    #: without ``--modes``: static and dynamic int8 MatMuls (DynamicQuantizeMatMul /
    #: MatMulIntegerToFloat on its CPU; a Gemm too, its basic fusions make Gemm of MatMul +
    #: Add). The weight-only modes are offered on request: at a transformer's 128-196 token
    #: rows MatMulNBits ran 0.34-1.03x float where dynamic int8 ran 2.4-4.6x
    #: (benchmarks/results/matmul_nbits.md); it wins at a few rows (7.7x at one)
    default_modes = (QuantMode.STATIC, QuantMode.DYNAMIC)
    dynamic_ops = frozenset({"MatMul", "Gemm"})

    @property
    def modes(self) -> tuple[QuantMode, ...]:
        """Static, dynamic, and each weight-only mode whose MatMulNBits kernel the installed
        onnxruntime runs (checked with one node, once per process)."""
        lacking = self.lacking_modes()
        return (*self.default_modes,
                *(m for m in (QuantMode.WEIGHT_INT8, QuantMode.WEIGHT_INT4) if m not in lacking))

    def lacking_modes(self) -> dict[QuantMode, str]:
        return weight_only_modes_lacking()

    def recipe_start(self, pm, model: Any, *, input_shapes: Any = None, data: Any = None,
                     keep: KeepFile | None = None):
        return ort_recipe_start(pm, model, input_shapes=input_shapes, data=data, keep=keep)

    def recipe_file(self, model: Any, *, input_shapes: Any = None,
                    data: Any = None) -> bytes | None:
        return recipe_file_bytes(lambda work: ort_recipe_model(
            model, work, data=data, input_shapes=input_shapes))

    def recipe_files(self) -> tuple[RecipeFileSpec, ...]:
        """``quantize_static``'s file, then ``quantize_dynamic``'s (MatMuls with constant
        weights, int8: ONNX Runtime's recipe for transformers on CPU), then its weight-only
        file (``MatMulNBitsQuantizer``, int4 on the large MatMuls); no dynamic or weight-only
        file for a model without such a MatMul."""
        return (*super().recipe_files(),
                RecipeFileSpec(f"{self.name}_dynamic", "quantize_dynamic",
                               ort_dynamic_recipe_bytes, placement=False),
                RecipeFileSpec(f"{self.name}_weight_only", "MatMulNBitsQuantizer",
                               ort_weight_only_recipe_bytes, placement=False))

    def scores_fused(self, high_precision: HighPrecisionModel | None) -> bool:
        """ONNX Runtime's fused integer kernels are what its rules stand for, but only with an
        FP32 float part: its CPU fusions refuse valid FP16 Q/DQ graphs (QLinearConcat takes
        FP32 scales only), so an FP16 model under its rules is scored as written."""
        return high_precision is None or high_precision.precision == "fp32"


PROFILE = OnnxRuntime()
