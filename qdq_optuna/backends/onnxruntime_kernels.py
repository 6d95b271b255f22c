"""What ONNX Runtime's CPU build runs for a model: its fully optimized graph, as counts.

Two Q/DQ models that place Q/DQ differently can still run the same kernels (ONNX Runtime folds
each DQ -> op -> Q group into one integer kernel), and two that look alike can run differently
(one missing Q turns a QLinearMatMul back into a float MatMul). So placements are compared by
the graph ONNX Runtime writes after all its optimizations (``optimized_model_filepath``,
``ORT_ENABLE_ALL``): op types, and which nodes still compute in float. No timing is involved.
"""

from __future__ import annotations

import collections
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import onnx
from onnx import TensorProto

_QDQ = frozenset({"QuantizeLinear", "DequantizeLinear"})
_FLOATS = frozenset({TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16,
                     TensorProto.DOUBLE})
#: integer kernels that are not named QLinear*
_INTEGER_KERNELS = frozenset({"QGemm", "MatMulIntegerToFloat", "DynamicQuantizeLinear",
                              "QAttention", "DynamicQuantizeMatMul", "ConvInteger",
                              "MatMulInteger", "QEmbedLayerNormalization"})
#: ops that only move or reshape data: in float they are no float kernel worth counting
_DATA_MOVEMENT = frozenset({"Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Shape",
                            "Gather", "Transpose", "Concat", "Split", "Slice", "Expand", "Cast",
                            "Constant", "ConstantOfShape", "Tile", "Pad", "Range", "Size"})


@dataclass(frozen=True)
class Kernels:
    """The nodes of a model's fully optimized graph: every op type, and the op types of the
    nodes that compute in float (a float input or output, Q/DQ and data movement left out)."""

    ops: Mapping[str, int]
    float_ops: Mapping[str, int]
    #: DequantizeLinear nodes of constants left at run time (weights no kernel took in)
    constant_dq: int = 0

    @property
    def integer(self) -> int:
        """Integer kernels (QLinear*, QGemm, MatMulIntegerToFloat, ...)."""
        return sum(n for op, n in self.ops.items() if is_integer_kernel(op))

    @property
    def qdq(self) -> int:
        """QuantizeLinear / DequantizeLinear nodes left after fusion."""
        return sum(self.ops.get(op, 0) for op in _QDQ)

    @property
    def float_kernels(self) -> int:
        return sum(self.float_ops.values())

    def diff(self, other: Kernels) -> dict[str, tuple[int, int]]:
        """Op type -> (count here, count in ``other``), for the op types whose counts differ;
        float kernels as ``float:<op>``."""
        out = {}
        for prefix, mine, theirs in (("", self.ops, other.ops),
                                     ("float:", self.float_ops, other.float_ops)):
            for op in sorted(set(mine) | set(theirs)):
                if mine.get(op, 0) != theirs.get(op, 0):
                    out[prefix + op] = (mine.get(op, 0), theirs.get(op, 0))
        return out

    def same_as(self, other: Kernels) -> bool:
        return not self.diff(other)

    def same_compute(self, other: Kernels) -> bool:
        """The same integer and float kernels (Q/DQ nodes may differ)."""
        return not any(op not in _QDQ for op in self.diff(other))

    def no_more_work_than(self, other: Kernels) -> bool:
        """The same kernels, and no more Q nor DQ nodes left than ``other``."""
        return self.same_compute(other) and all(
            self.ops.get(op, 0) <= other.ops.get(op, 0) for op in _QDQ)

    def to_dict(self) -> dict:
        return {"ops": dict(sorted(self.ops.items())), "float_ops": dict(sorted(self.float_ops.items())),
                "integer": self.integer, "qdq": self.qdq, "constant_dq": self.constant_dq,
                "float_kernels": self.float_kernels}


def is_integer_kernel(op: str) -> bool:
    return op.startswith("QLinear") or op in _INTEGER_KERNELS


def optimized_graph(model: bytes | str | os.PathLike | onnx.ModelProto,
                    folder: str | os.PathLike | None = None,
                    config: Sequence[tuple[str, str]] = ()) -> onnx.ModelProto:
    """The graph ONNX Runtime's CPU provider runs, after every graph optimization (with the
    session ``config`` entries)."""
    import onnxruntime as ort

    if isinstance(model, onnx.ModelProto):
        model = model.SerializeToString()
    elif not isinstance(model, bytes):
        model = str(model)
    with tempfile.TemporaryDirectory(prefix="qdq-optuna-kernels-", dir=folder) as tmp:
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.optimized_model_filepath = str(Path(tmp) / "optimized.onnx")
        so.log_severity_level = 3
        so.intra_op_num_threads = 1
        for key, value in config:
            so.add_session_config_entry(key, value)
        ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
        return onnx.load(so.optimized_model_filepath)


def kernels_of(model: bytes | str | os.PathLike | onnx.ModelProto,
               config: Sequence[tuple[str, str]] = ()) -> Kernels:
    """:class:`Kernels` of ``model``'s ONNX Runtime-optimized graph (CPU; with the session
    ``config`` entries)."""
    graph = optimized_graph(model, config=config).graph
    constants = {t.name for t in graph.initializer}
    floats = _float_tensors(graph)
    ops = collections.Counter(n.op_type for n in graph.node)
    float_ops: collections.Counter = collections.Counter()
    for node in graph.node:
        if node.op_type in _QDQ or node.op_type in _DATA_MOVEMENT or is_integer_kernel(node.op_type):
            continue
        if any(t in floats for t in (*node.input, *node.output) if t and t not in constants):
            float_ops[node.op_type] += 1
    constant_dq = sum(1 for n in graph.node if n.op_type == "DequantizeLinear" and n.input[0] in constants)
    return Kernels(dict(ops), dict(float_ops), constant_dq)


#: integer kernels whose output is float
_FLOAT_OUT = frozenset({"DequantizeLinear", "MatMulIntegerToFloat", "DynamicQuantizeMatMul"})


def _float_tensors(graph: onnx.GraphProto) -> set[str]:
    """Tensors of a float type: as typed in the graph, else as their producer makes them (ONNX
    Runtime leaves the tensors its fusions create untyped): a DQ writes float, a Q or an
    integer kernel an integer type, any other op its first typed data input's type."""
    types = {vi.name: vi.type.tensor_type.elem_type
             for vi in (*graph.value_info, *graph.input, *graph.output)
             if vi.type.tensor_type.elem_type}
    types.update({t.name: t.data_type for t in graph.initializer})
    for node in graph.node:  # ONNX Runtime writes its graph in topological order
        if node.op_type in _FLOAT_OUT:
            made = TensorProto.FLOAT
        elif node.op_type == "QuantizeLinear" or is_integer_kernel(node.op_type):
            made = TensorProto.UINT8
        else:
            made = next((types[t] for t in node.input if t in types), None)
        for out in node.output:
            if out and out not in types and made is not None:
                types[out] = made
    return {t for t, elem in types.items() if elem in _FLOATS}


#: ONNX Runtime's layout reformats (NCHWc blocked layout for float convolutions)
_REORDERS = frozenset({"ReorderInput", "ReorderOutput"})


def what_onnxruntime_ran(model: bytes | onnx.ModelProto, quantized: Mapping[str, str],
                         config: Sequence[tuple[str, str]] = ()) -> dict[str, frozenset[str]]:
    """The fields of a :class:`~qdq_optuna.backends.what_ran.WhatRan` of a Q/DQ model on ONNX
    Runtime's CPU provider (``quantized``: its Q/DQ tensors -> the float tensor each
    quantizes), read from its fully optimized graph: a Q or DQ node still there ran standalone
    (its tensor's others were folded into QLinear kernels or not), every other activation Q/DQ
    was folded; a float compute node of the model next to a Q/DQ or an integer kernel is a
    float island; a Reorder node is a layout reformat."""
    proto = model if isinstance(model, onnx.ModelProto) else onnx.load_from_string(model)
    names = {n.name for n in proto.graph.node if n.name}
    tensors = {t for n in proto.graph.node for t in (*n.input, *n.output) if t}
    graph = optimized_graph(proto, config=config).graph
    producer = {o: n for n in graph.node for o in n.output}
    consumers: dict[str, list] = collections.defaultdict(list)
    for n in graph.node:
        for t in n.input:
            consumers[t].append(n)
    standalone = {quantized[n.input[0]] for n in graph.node
                  if n.op_type in _QDQ and n.input[0] in quantized}
    constants = {t.name for t in graph.initializer}
    floats = _float_tensors(graph)

    def integer_side(node) -> bool:
        near = [producer.get(t) for t in node.input] + [c for t in node.output
                                                        for c in consumers[t]]
        return any(m is not None and (m.op_type in _QDQ or is_integer_kernel(m.op_type))
                   for m in near)

    float_nodes = {n.name for n in graph.node
                   if n.name in names and n.op_type not in _QDQ | _DATA_MOVEMENT
                   and not is_integer_kernel(n.op_type)
                   and any(t in floats for t in (*n.input, *n.output) if t and t not in constants)
                   and integer_side(n)}
    reformats = {quantized.get(n.input[0], n.input[0]) for n in graph.node
                 if n.op_type in _REORDERS and n.input[0] in tensors}
    return {"fused": frozenset(set(quantized.values()) - standalone),
            "standalone": frozenset(standalone), "float_nodes": frozenset(float_nodes),
            "reformats": frozenset(reformats)}
