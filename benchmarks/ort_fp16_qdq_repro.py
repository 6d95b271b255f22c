"""Minimal reproduction: ONNX Runtime CPU's Q/DQ fusions on FP16 Q/DQ graphs.

A TensorRT-bound model with an FP16 float part carries FP16 Q/DQ scales (ONNX opset 19 and
later type the scale like the data). Each case below is one op between QuantizeLinear ->
DequantizeLinear pairs, valid ONNX (shape inference and the checker pass). It is run twice in
ONNX Runtime CPU: graph optimizations off (each Q/DQ as written) and all on (the fused integer
kernels a default session uses). A case prints the relative difference of the two, or the
error with which the optimized session refuses the model.

Seen with onnxruntime 1.32 (CPU): every case agrees except Concat, which a default session
refuses: its QDQ fusion makes a com.microsoft QLinearConcat whose schema takes float scales
only ("Type 'tensor(float16)' of input parameter ... of operator (QLinearConcat) ... is
invalid"). The model is valid and the session option ``session.disable_quant_qdq=1`` runs it.

    python benchmarks/ort_fp16_qdq_repro.py
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

OPS = ("Conv", "MatMul", "Add", "Mul", "Concat", "Sigmoid", "MaxPool", "AveragePool",
       "GlobalAveragePool", "Relu")


def _qdq(x: str, name: str, scale: float, inits: list, nodes: list) -> str:
    inits += [numpy_helper.from_array(np.array(scale, np.float16), f"{name}_s"),
              numpy_helper.from_array(np.array(0, np.int8), f"{name}_z")]
    nodes += [helper.make_node("QuantizeLinear", [x, f"{name}_s", f"{name}_z"], [f"{name}_q"]),
              helper.make_node("DequantizeLinear", [f"{name}_q", f"{name}_s", f"{name}_z"],
                               [f"{name}_dq"])]
    return f"{name}_dq"


def _weight(shape: tuple[int, ...], inits: list, nodes: list, rng) -> str:
    w = np.clip(np.round(rng.standard_normal(shape) * 50), -127, 127).astype(np.int8)
    inits += [numpy_helper.from_array(w, "wq"),
              numpy_helper.from_array(np.array(0.002, np.float16), "ws"),
              numpy_helper.from_array(np.array(0, np.int8), "wz")]
    nodes.append(helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["w"]))
    return "w"


def case(op: str, seed: int = 0) -> onnx.ModelProto:
    """``x -> Q/DQ -> op -> Q/DQ -> y``, FP16 throughout, opset 19."""
    rng = np.random.default_rng(seed)
    inits: list = []
    nodes: list = []
    a = _qdq("x", "a", 0.02, inits, nodes)
    if op == "Conv":
        nodes.append(helper.make_node("Conv", [a, _weight((8, 8, 3, 3), inits, nodes, rng)],
                                      ["y0"], pads=[1, 1, 1, 1]))
    elif op == "MatMul":
        nodes.append(helper.make_node("MatMul", [a, _weight((8, 8), inits, nodes, rng)], ["y0"]))
    elif op in ("Add", "Mul", "Concat"):
        b = _qdq("x", "b", 0.03, inits, nodes)
        nodes.append(helper.make_node(op, [a, b], ["y0"], **({"axis": 1} if op == "Concat"
                                                                else {})))
    else:
        pool = {"kernel_shape": [2, 2]} if op in ("MaxPool", "AveragePool") else {}
        nodes.append(helper.make_node(op, [a], ["y0"], **pool))
    nodes.append(helper.make_node("Identity", [_qdq("y0", "o", 0.05, inits, nodes)], ["y"]))
    graph = helper.make_graph(
        nodes, op, [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [1, 8, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, None)], inits)
    model = onnx.shape_inference.infer_shapes(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)]), strict_mode=True)
    onnx.checker.check_model(model, full_check=True)
    return model


def run(model: onnx.ModelProto, x: np.ndarray, optimize: bool) -> np.ndarray:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize else
                                   ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    session = ort.InferenceSession(model.SerializeToString(), so,
                                   providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0].astype(np.float64)


def check(op: str) -> str:
    """One line: the two sessions' relative difference, or the optimized one's refusal."""
    x = np.random.default_rng(1).standard_normal((1, 8, 8, 8)).astype(np.float16)
    model = case(op)
    as_written = run(model, x, optimize=False)
    try:
        fused = run(model, x, optimize=True)
    except Exception as exc:  # ONNX Runtime's own exception types
        return f"refused: {str(exc).splitlines()[0]}"
    diff = np.linalg.norm(fused - as_written) / max(np.linalg.norm(as_written), 1e-30)
    return f"relative difference {diff:.4f}"


def main() -> None:
    print(f"onnxruntime {ort.__version__}, onnx {onnx.__version__}")
    for op in OPS:
        print(f"{op:18s} {check(op)}")


if __name__ == "__main__":
    main()
