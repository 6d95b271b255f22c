"""What a runtime actually ran for one model: which Q/DQ it fused into integer kernels, which
stayed standalone, where float ran between integer layers and where it reformatted. Read once
per standing model (never per trial) to tell the search where a move can still win."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WhatRan:
    #: how it was read, for the log and the report ("ONNX Runtime optimized graph", ...)
    how: str
    #: activation tensors (names in the exported Q/DQ model's float graph) whose Q/DQ the
    #: runtime folded into integer kernels
    fused: frozenset[str] = frozenset()
    #: tensors whose QuantizeLinear or DequantizeLinear ran as a standalone op
    standalone: frozenset[str] = frozenset()
    #: names of the model's compute nodes that ran in float next to integer neighbours
    float_nodes: frozenset[str] = frozenset()
    #: tensors at which the runtime inserted a precision or layout reformat (reorder)
    reformats: frozenset[str] = frozenset()
    #: names of the model's nodes the runtime ran inside an integer layer (None: the reader
    #: cannot tell): a Q/DQ pair added where every neighbour already ran integer changes no
    #: layer's precision
    integer_nodes: frozenset[str] | None = None

    def to_dict(self) -> dict:
        """JSON-ready, sorted (the report and the log)."""
        out = {"how": self.how, "fused": sorted(self.fused),
               "standalone": sorted(self.standalone), "float_nodes": sorted(self.float_nodes),
               "reformats": sorted(self.reformats)}
        if self.integer_nodes is not None:
            out["integer_nodes"] = sorted(self.integer_nodes)
        return out


def quantized_tensors(model) -> dict[str, str]:
    """Q/DQ model (``onnx.ModelProto``) -> {tensor a Q or DQ node reads or writes: the float
    activation tensor it quantizes}. Weights (a Q or DQ of an initializer) are left out: only
    activations are placement decisions."""
    graph = model.graph
    constants = {t.name for t in graph.initializer}
    constants |= {o for n in graph.node if n.op_type == "Constant" for o in n.output}
    out: dict[str, str] = {}
    for node in graph.node:
        if node.op_type == "QuantizeLinear" and node.input[0] not in constants:
            out[node.input[0]] = node.input[0]
            out[node.output[0]] = node.input[0]
    for node in graph.node:
        if node.op_type == "DequantizeLinear" and node.input[0] in out:
            out[node.output[0]] = out[node.input[0]]
    return out
