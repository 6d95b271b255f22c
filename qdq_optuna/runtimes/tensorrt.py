"""TensorRT: its rules, FP16 float part by default, placeholder scales inside trials, its
classic INT8 PTQ recipe (NVIDIA Model Optimizer's default placement: read from its output
where it runs, else approximated by :class:`PtqRules`)."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx

from qdq_optuna.errors import ToolError
from qdq_optuna.model.graph import Graph, Use
from qdq_optuna.placement.export import Scales
from qdq_optuna.placement.rules import (
    RuntimeRules,
    conv_add_relu_fusion,
    epilogue_edge,
    promote_concat,
    shape_arithmetic,
)
from qdq_optuna.placement.starts import Start, read_placement, start_from_uses
from qdq_optuna.runtimes.base import Runtime

TENSORRT = RuntimeRules(
    name="tensorrt",
    default_quant_type="int8",
    quant_types=("int8", "fp8"),
    use_filters=(shape_arithmetic, conv_add_relu_fusion, epilogue_edge),
    promotions=(promote_concat,),
    fusion_group_ops=frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul"}),
)


# -- TensorRT's standard INT8 PTQ placement ---------------------------------------------------
@dataclass(frozen=True)
class PtqRules:
    """A PTQ tool's default INT8 placement as data: which nodes get Q/DQ on their inputs.

    :data:`TENSORRT_PTQ_RULES` approximate NVIDIA Model Optimizer's ``quantize`` (ONNX, int8,
    default settings): Q/DQ on the activation inputs of Conv/Gemm/MatMul (not on tensor-core
    unfriendly shapes), on the residual input of a Conv block's residual Add (never its
    backbone input), on pooling and Resize inputs next to quantized compute, never on op
    outputs; one Q/DQ pair per tensor, which every reader shares. Concat gets no Q/DQ of its
    own; the TensorRT rules' Concat promotion then covers the Concats of quantized tensors.
    """

    compute_ops: frozenset[str] = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul"})
    #: compute ops whose output chain can be fused into one kernel (the "backbone")
    backbone_ops: frozenset[str] = frozenset({"Conv", "ConvTranspose"})
    #: single-input ops that join the kernel of the compute op before them
    epilogue_ops: frozenset[str] = frozenset({"BatchNormalization", "Relu", "Sigmoid"})
    pooling_ops: frozenset[str] = frozenset({"MaxPool", "AveragePool", "GlobalAveragePool",
                                             "GlobalMaxPool"})
    #: ops whose input is quantized when it comes from a compute kernel
    follower_ops: frozenset[str] = frozenset({"Resize", "Upsample"})
    #: elementwise ops whose inputs are quantized when one comes from a compute kernel
    elementwise_ops: frozenset[str] = frozenset({"Add", "Mul"})

    #: ops a consumer search looks through
    copy_ops: frozenset[str] = frozenset({"Flatten", "Transpose", "Concat", "Split", "Squeeze",
                                          "Unsqueeze", "Expand", "Reshape", "Tile", "Gather",
                                          "Slice"})
    #: Conv channels below which a Conv stays float, unless a multiple of 8 (int8 kernels)
    min_channels: int = 16
    #: MatMul/Gemm N or K below which it stays float (GEMV-like shapes too)
    min_matmul_dim: int = 16


TENSORRT_PTQ_RULES = PtqRules()
_SCALE_BIAS = frozenset({"Add", "Sub", "Mul", "Div"})
_POINTWISE = frozenset({"Add", "Sub", "Mul", "Div", "Relu", "Clip", "LeakyRelu", "Sigmoid",
                        "HardSigmoid", "HardSwish", "Tanh", "Erf", "Gelu", "Elu", "Selu", "Exp",
                        "Log", "Sqrt", "Pow", "Neg", "Abs", "Softplus", "Mish", "PRelu",
                        "BatchNormalization"})
#: layers whose output Model Optimizer quantizes for an elementwise consumer
_OUTPUT_QUANTIZED = frozenset({"AveragePool", "BatchNormalization", "GlobalAveragePool",
                               "MaxPool", "Mul"})


def tensorrt_recipe_uses(pm, rules: PtqRules = TENSORRT_PTQ_RULES) -> set[Use]:
    """The uses :class:`PtqRules` quantize on ``pm``'s graph (before the runtime's rules)."""
    return _PtqPlacer(pm.graph, rules).uses()


def tensorrt_recipe_start(pm, qdq_model: str | os.PathLike | onnx.ModelProto | None = None,
                          rules: PtqRules = TENSORRT_PTQ_RULES) -> Start:
    """TensorRT's standard INT8 PTQ placement: read from ``qdq_model`` when Model Optimizer
    made one (:func:`run_modelopt`), else :data:`TENSORRT_PTQ_RULES` on ``pm``'s graph."""
    if qdq_model is not None:
        uses, notes, counts = read_placement(pm, qdq_model)
        return start_from_uses(pm, "recipe:tensorrt", uses,
                               ["read from NVIDIA Model Optimizer's output", *notes], counts)
    uses = tensorrt_recipe_uses(pm, rules)
    return start_from_uses(pm, "recipe:tensorrt", uses,
                           ["NVIDIA Model Optimizer's default INT8 placement, approximated "
                            "by rules (Model Optimizer not run)"])


class _PtqPlacer:
    def __init__(self, g: Graph, rules: PtqRules) -> None:
        self.g, self.r = g, rules

    def op(self, tensor: str) -> str | None:
        return self.g.producer_op(tensor)

    def node_of(self, tensor: str):
        p = self.g.producer.get(tensor)
        return None if p is None else self.g.nodes[p[0]]

    def data_inputs(self, idx: int) -> list[int]:
        node = self.g.nodes[idx]
        return [s for s, t in enumerate(node.input) if t and self.g.is_activation(t)]

    def _silu(self, node) -> str | None:
        """x for Mul(x, Sigmoid(x)), else None."""
        if node.op_type != "Mul" or len(node.input) != 2:
            return None
        for a, b in (node.input, node.input[::-1]):
            s = self.node_of(b)
            if s is not None and s.op_type == "Sigmoid" and s.input[0] == a:
                return a
        return None

    def kernel_source(self, tensor: str, partition: bool = False,
                      excluded: bool = False) -> int | None:
        """The compute node whose kernel writes ``tensor`` through its epilogue (BN,
        activations, constant scale/bias, SiLU, Relu -> MaxPool), if any; ``partition`` also
        follows any pointwise chain and a residual Add's backbone input (what Model
        Optimizer's fusible partitions hold); ``excluded`` also counts compute ops that stay
        float."""
        for _ in range(64):
            node = self.node_of(tensor)
            if node is None:
                return None
            idx = self.g.producer[tensor][0]
            op = node.op_type
            if op in self.r.compute_ops:
                return idx if excluded or not self.excluded(idx) else None
            acts = [t for t in node.input if t and self.g.is_activation(t)]
            if len(acts) == 1 and (op in self.r.epilogue_ops or op in _SCALE_BIAS
                                   or (partition and op in _POINTWISE)
                                   or (op == "MaxPool" and self.op(acts[0]) == "Relu")):
                tensor = acts[0]
            elif len(acts) == 2 and op in _POINTWISE and \
                    (src := self.kernel_source(acts[0], partition, excluded)) is not None and \
                    src == self.kernel_source(acts[1], partition, excluded):
                return src  # SiLU, GELU: both operands come from one kernel
            elif partition and op == "Add" and (res := self.residual(node)) is not None:
                tensor = node.input[1 - res]
            else:
                return None
        return None

    def residual(self, node) -> int | None:
        """For a residual Add of a Conv block: the slot of its residual (non-backbone) input."""
        ins = node.input
        if node.op_type != "Add" or len(ins) != 2 or not all(map(self.g.is_activation, ins)):
            return None
        bb = [self._backbone(t) for t in ins]
        if bb[0] != bb[1]:
            return 0 if bb[1] else 1
        if not bb[0]:
            return None
        d0, d1 = self._depths(ins[0]), self._depths(ins[1])
        common = set(d0) & set(d1)
        if not common:
            return None
        lca = min(common, key=lambda t: d0[t] + d1[t])
        return 0 if d0[lca] < d1[lca] else 1  # the shorter way back is the shortcut

    def _backbone(self, tensor: str) -> bool:
        src = self.kernel_source(tensor, excluded=True)
        return src is not None and self.g.nodes[src].op_type in self.r.backbone_ops

    def _depths(self, tensor: str, limit: int = 400) -> dict[str, int]:
        depth, frontier = {tensor: 0}, [tensor]
        while frontier and len(depth) < limit:
            nxt = []
            for t in frontier:
                node = self.node_of(t)
                for i in (node.input if node is not None else []):
                    if i and self.g.is_activation(i) and i not in depth:
                        depth[i] = depth[t] + 1
                        nxt.append(i)
            frontier = nxt
        return depth

    def excluded(self, idx: int) -> bool:
        """Compute ops Model Optimizer leaves float: narrow Convs, GEMV-like MatMul/Gemm."""
        g, r, node = self.g, self.r, self.g.nodes[idx]
        if node.op_type == "Conv":
            w = g.shapes.get(node.input[1]) if len(node.input) > 1 else None
            if not w or len(w) < 3 or not g.is_constant(node.input[1]):
                return True
            cout, cin = int(w[0]), int(w[1])
            if cout >= r.min_channels and cin >= r.min_channels:
                return False
            group = next((a.i for a in node.attribute if a.name == "group"), 1)
            ks = next((list(a.ints) for a in node.attribute if a.name == "kernel_shape"), w[2:])
            first = node.input[0] in g.graph_inputs
            if group == 1 and (cout % 8 == 0 or cin % 8 == 0) and len(set(ks)) == 1 and \
                    (first or cout >= r.min_channels or cin >= r.min_channels):
                return False
            return not (group > 1 and cout % 8 == 0 and all(k >= 3 for k in ks))
        if node.op_type in ("MatMul", "Gemm"):
            out = g.shapes.get(node.output[0]) or ()
            if any(not isinstance(d, int) for d in out) or len(out) < 2:
                return False
            if all(g.is_activation(t) for t in node.input[:2]):
                return out[-1] == 1 or out[-2] == 1
            if len(out) < 3 and 1 in out:
                return True
            w = g.shapes.get(node.input[1]) or ()
            trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0)
            k = (w[-1] if trans_b else w[-2]) if len(w) >= 2 else None
            return 0 < out[-1] < r.min_matmul_dim or (k is not None and 0 < k < r.min_matmul_dim)
        return False

    def _kernel_head(self, node) -> bool:
        """An elementwise op with computed operands that no kernel absorbs, reading a
        kernel's output or a layer Model Optimizer quantizes at its output."""
        srcs = [self.kernel_source(t, True) for t in node.input]
        if srcs[0] is not None and len(set(srcs)) == 1:
            return False  # the pointwise tail of one kernel (SiLU, GELU)
        return any(s is not None for s in srcs) or \
            any(self.op(t) in _OUTPUT_QUANTIZED for t in node.input)

    def _fused_pool(self, node) -> bool:
        """Conv -> [BN] -> Relu -> MaxPool with single consumers: one TensorRT kernel."""
        t = node.input[0]
        return node.op_type == "MaxPool" and self.op(t) == "Relu" and \
            len(self.g.consumers.get(t, [])) == 1 and self._backbone(t)

    def _feeds(self, tensor: str, quantized: set[int], seen: set[str] | None = None) -> bool:
        seen = set() if seen is None else seen
        for n, _ in self.g.consumers.get(tensor, []):
            node = self.g.nodes[n]
            if n in quantized:
                return True
            if node.op_type in self.r.copy_ops:
                for o in node.output:
                    if o and o not in seen:
                        seen.add(o)
                        if self._feeds(o, quantized, seen):
                            return True
        return False

    def uses(self) -> set[Use]:
        g, r = self.g, self.r
        slots: dict[int, set[int]] = {}   # quantized node -> its quantized input slots
        keep_float: set[tuple[int, int]] = set()
        for idx, node in enumerate(g.nodes):
            data = self.data_inputs(idx)
            if node.op_type in r.compute_ops:
                if self.excluded(idx):
                    keep_float.update((idx, s) for s in data)
                else:
                    slots[idx] = {s for s in data if s < 2}
            elif (res := self.residual(node)) is not None:
                slots[idx] = {res}
                keep_float.add((idx, 1 - res))
            elif node.op_type in r.elementwise_ops and len(data) == len(node.input) >= 2 \
                    and self._kernel_head(node):
                slots[idx] = set(data)
            elif node.op_type == "BatchNormalization" and data == [0] and \
                    self.kernel_source(node.input[0]) is None:
                slots[idx] = {0}  # not fused into a quantized Conv: a layer of its own
            elif node.op_type in r.follower_ops and data and \
                    self.kernel_source(node.input[0], True) is not None:
                slots[idx] = {0}
        first = set(slots)
        for idx, node in enumerate(g.nodes):
            if node.op_type in r.pooling_ops and not self._fused_pool(node) and \
                    self.data_inputs(idx) == [0] and \
                    (self._feeds(node.output[0], first)
                     or self.kernel_source(node.input[0], True) is not None):
                slots[idx] = {0}
        tensors = {g.nodes[n].input[s] for n, ss in slots.items() for s in ss}
        return {(t, n, s) for t in tensors for n, s in g.consumers.get(t, [])
                if (n, s) not in keep_float}


# -- Model Optimizer, where it is installed --------------------------------------------------
def run_modelopt(model: str | os.PathLike, output: str | os.PathLike, *,
                 python: str | os.PathLike | None = None,
                 calibration_data: str | os.PathLike | None = None,
                 timeout: float = 1800) -> Path:
    """NVIDIA Model Optimizer's default INT8 quantization (``python -m
    modelopt.onnx.quantization --quantize_mode int8``, calibrated on the CPU) of ``model`` into
    ``output``, with ``python`` (an interpreter where ``nvidia-modelopt[onnx]`` is installed;
    default: this one). Its dependencies pin onnx and ONNX Runtime versions of their own, so it
    usually lives in an environment of its own."""
    cmd = [str(python or sys.executable), "-m", "modelopt.onnx.quantization",
           "--onnx_path", str(model), "--quantize_mode", "int8", "--calibration_method", "max",
           "--calibration_eps", "cpu", "--output_path", str(output)]
    if calibration_data is not None:
        cmd += ["--calibration_data_path", str(calibration_data)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ToolError(f"NVIDIA Model Optimizer ({cmd[0]}): {exc}") from None
    if done.returncode != 0 or not Path(output).is_file():
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise ToolError(f"NVIDIA Model Optimizer failed on {model}: {last}")
    return Path(output)


class TensorRT(Runtime):
    name = "tensorrt"
    rules = TENSORRT
    #: TensorRT users deploy FP16 (the cost model and callables under its rules too)
    default_precision = "fp16"
    #: placeholder scales inside trials (``--scales auto`` under TensorRT's rules)
    default_scales = Scales.DEFAULT

    def recipe_start(self, pm, model: Any, *, input_shapes: Any = None, data: Any = None,
                     keep=None):
        return tensorrt_recipe_start(pm)


PROFILE = TensorRT()
