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
