"""Weight-only int8 and int4 MatMuls: the weight stored in blocks of ``bits`` bits, the
activation left float, written as ONNX Runtime's ``com.microsoft`` ``MatMulNBits`` the way
its own ``onnxruntime.quantization.matmul_nbits_quantizer`` writes it (inputs A, the packed
weight ``[N, K/block, block*bits/8]``, the scales ``[N, K/block]`` and, asymmetric, the zero
points; attributes K, N, bits, block_size and accuracy_level). The packing is ONNX Runtime's
own (its ``quantize_matmul_4bits`` / ``quantize_matmul_8bits``, what that quantizer calls).

Why: weight-only MatMuls are what ONNX Runtime's CPU users of large transformers deploy; with
``accuracy_level`` 4 its kernel quantizes the activation block-wise to int8 inside the MatMul
and runs an integer dot product, so it needs no DynamicQuantizeLinear pass of its own and no
conversion around LayerNorm, GELU and Softmax. Which of the modes wins on a node is measured,
not assumed (``benchmarks/matmul_nbits.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qdq_optuna.model.graph import GRAPH_INITIALIZER, GRAPH_NODE, Graph, wire_field

#: the ops a weight-only point is offered on (with a constant 2-D FP32 weight:
#: :func:`~qdq_optuna.placement.dynamic.dynamic_node_ok`)
WEIGHT_ONLY_OPS = frozenset({"MatMul", "Gemm"})
#: the contrib domain MatMulNBits lives in
MS_DOMAIN = "com.microsoft"
#: ``block_size`` as ``MatMulNBitsQuantizer`` writes it by default
BLOCK_SIZE = 128
#: ``accuracy_level`` 4: the activation quantized to int8 per block inside the kernel (0
#: computes in float). Measured on a 2-core Xeon with AVX512-VNNI and AMX, onnxruntime 1.32
#: (``benchmarks/results/matmul_nbits.md``): level 4 is the faster one at a single token row
#: (1x1024x4096, int4 block 128: 7.7x float against 2.0x at level 0) and the slower one at
#: 128-196 rows, where every weight-only variant ran below float
ACCURACY_LEVEL = 4


def _packer(bits: int):
    from onnxruntime.capi import _pybind_state as ort_c

    return getattr(ort_c, f"quantize_matmul_{bits}bits", None)


@cache
def kernel_available(bits: int, accuracy_level: int = ACCURACY_LEVEL) -> bool:
    """Whether the installed ONNX Runtime packs and runs a ``bits``-bit MatMulNBits on its
    CPU provider: one small node, built and run once per process."""
    if _packer(bits) is None:
        return False
    try:
        import onnxruntime as ort

        k, n = 2 * 32, 16
        w = np.linspace(-1.0, 1.0, k * n, dtype=np.float32).reshape(k, n)
        inits, node = matmul_nbits(w, "A", "Y", "probe", bits=bits, block_size=32,
                                   accuracy_level=accuracy_level)
        graph = helper.make_graph(
            [node], "probe", [helper.make_tensor_value_info("A", TensorProto.FLOAT, [2, k])],
            [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [2, n])], inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                        helper.make_opsetid(MS_DOMAIN, 1)])
        so = ort.SessionOptions()
        so.intra_op_num_threads = 1
        session = ort.InferenceSession(model.SerializeToString(), so,
                                       providers=["CPUExecutionProvider"])
        a = np.ones((2, k), np.float32)
        out = session.run(None, {"A": a})[0]
        return bool(np.allclose(out, a @ w, atol=0.5))
    except Exception:  # no such kernel (an older build, another provider's wheel)
        return False


def pack(weight: np.ndarray, bits: int, block_size: int = BLOCK_SIZE,
         symmetric: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(packed, scales, zero_points)`` of a ``[K, N]`` FP32 weight, by ONNX Runtime's own
    block quantizer (the rows padded to whole blocks, as ``MatMulNBitsQuantizer`` does)."""
    packer = _packer(bits)
    if packer is None:
        raise ValueError(f"this onnxruntime has no {bits}-bit MatMul quantizer")
    rows, cols = weight.shape
    kpack = 8 // bits
    k_blocks = (rows + block_size - 1) // block_size
    blob = (block_size + kpack - 1) // kpack
    w = np.ascontiguousarray(weight, dtype=np.float32)
    if k_blocks * block_size > rows:
        w = np.pad(w, ((0, k_blocks * block_size - rows), (0, 0)))
    packed = np.zeros((cols, k_blocks, blob), np.uint8)
    zero_points = np.zeros((cols, (k_blocks + kpack - 1) // kpack), np.uint8)
    scales = np.zeros((cols, k_blocks), np.float32)
    packer(packed, w, scales, zero_points, block_size, cols, rows, symmetric)
    return packed, scales, zero_points


def matmul_nbits(weight: np.ndarray, a: str, out: str, base: str, *, bits: int,
                 block_size: int = BLOCK_SIZE, accuracy_level: int = ACCURACY_LEVEL,
                 unique: Callable[[str], str] = str, name: str | None = None
                 ) -> tuple[list[onnx.TensorProto], onnx.NodeProto]:
    """The initializers and the MatMulNBits node of ``a @ weight`` (``weight``: [K, N]), as
    ``MatMulNBitsQuantizer`` writes them (asymmetric: zero points; ``accuracy_level`` 0 is
    left out, as it leaves it out)."""
    packed, scales, zero_points = pack(weight, bits, block_size)
    rows, cols = weight.shape
    names = [unique(f"{base}_Q{bits}"), unique(f"{base}_scales"), unique(f"{base}_zero_points")]
    inits = [numpy_helper.from_array(x, n) for x, n in zip((packed, scales, zero_points), names)]
    attrs = {"K": rows, "N": cols, "bits": bits, "block_size": block_size}
    if accuracy_level:
        attrs["accuracy_level"] = accuracy_level
    node = helper.make_node("MatMulNBits", [a, *names], [out], name=name or unique(
        f"{base}_MatMulNBits"), domain=MS_DOMAIN, **attrs)
    return inits, node


def weight_only_node(graph: Graph, node: int, unique: Callable[[str], str], weight: np.ndarray,
                     bits: int, *, source: str | None = None, output: str | None = None,
                     block_size: int = BLOCK_SIZE, accuracy_level: int = ACCURACY_LEVEL
                     ) -> tuple[bytes, bytes]:
    """``(initializers, nodes)`` that replace ``node`` (a MatMul or Gemm of a constant 2-D
    weight, :func:`~qdq_optuna.placement.dynamic.dynamic_node_ok`) by a MatMulNBits of its
    weight (a Gemm's bias added after it, as for a dynamic node); the node keeps its name."""
    n = graph.nodes[node]
    a, base = source or n.input[0], n.name or n.output[0]
    out = output or n.output[0]
    gemm = n.op_type == "Gemm"
    attrs = {x.name: helper.get_attribute_value(x) for x in n.attribute} if gemm else {}
    if attrs.get("transB", 0):
        weight = weight.T
    bias = n.input[2] if gemm and len(n.input) > 2 and n.input[2] else None
    product = unique(f"{base}_nbits_out") if bias else out
    inits, main = matmul_nbits(weight, a, product, base, bits=bits, block_size=block_size,
                               accuracy_level=accuracy_level, unique=unique,
                               name=n.name or unique(f"{base}_MatMulNBits"))
    nodes = [main]
    if bias:
        nodes.append(helper.make_node("Add", [product, bias], [out],
                                      name=unique(f"{base}_bias_Add")))
    return (b"".join(wire_field(GRAPH_INITIALIZER, t.SerializeToString()) for t in inits),
            b"".join(wire_field(GRAPH_NODE, x.SerializeToString()) for x in nodes))
