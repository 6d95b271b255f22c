"""The calibration figures of ``docs/costmodel.md``: the cost model on the models that
``qdq_optuna.examples.costmodel_cases`` builds (FP16, as deployed; FP32 for comparison).

    python benchmarks/costmodel_figures.py

Deterministic: the cost model is an analytical model, not a measurement.
"""

from __future__ import annotations

from onnx import TensorProto

from qdq_optuna.backends.costmodel import estimate
from qdq_optuna.examples import costmodel_cases as tc


def row(label: str, model, base_ms: float | None = None) -> float:
    bd = estimate(model)
    vs = f"{base_ms / bd.total_ms:.2f}x" if base_ms else "1.00x"
    print(f"| {label} | {bd.total_ms * 1e3:.1f} us | {vs} | {bd.kernels} |")
    return bd.total_ms


def resnet(float_type: int, bn: bool) -> None:
    variants = tc.resnet_variants(bn=bn, float_type=float_type)
    name = "FP16" if float_type == TensorProto.FLOAT16 else "FP32"
    print(f"\nResNet-18-like, 224x224, {name}, BatchNorm {'as nodes' if bn else 'folded'}:\n")
    print("| placement | latency | vs float | kernels |\n|---|---:|---:|---:|")
    base = row(f"{name} baseline (no Q/DQ)", variants.pop("baseline"))
    for label, model in variants.items():
        row(label, model, base)


def small_models() -> None:
    block = tc.residual_block()
    print("\nResidual block (FP16):\n")
    print("| placement | latency | vs float | kernels |\n|---|---:|---:|---:|")
    base = row("FP16 baseline", block)
    row("shared Q/DQ on conv1/conv2 input tensors + weights",
        tc.with_qdq(block, tensors=("stem_relu", "relu1"), weights=tc.BLOCK_CONVS[1:]), base)
    row("per-edge Q/DQ on conv1/conv2 inputs + weights (residual FP16: Add not fused)",
        tc.with_qdq(block, edges=(("conv1", 0), ("conv2", 0)), weights=tc.BLOCK_CONVS[1:]), base)
    row("shared placement + Q/DQ on conv2's output (Add fusion lost)",
        tc.with_qdq(block, tensors=("stem_relu", "relu1", "conv2"),
                    weights=tc.BLOCK_CONVS[1:]), base)
    cat = tc.concat_model()
    print("\nConcat (FP16):\n")
    print("| placement | latency | vs float | kernels |\n|---|---:|---:|---:|")
    base = row("none", cat)
    out = {"tensors": ("cat",), "weights": ("fuse",)}
    row("partial", tc.with_qdq(cat, edges=(("cat", 0),), **out), base)
    row("all", tc.with_qdq(cat, edges=(("cat", 0), ("cat", 1)), **out), base)
    print("\nMatMul -> Softmax/LayerNorm -> MatMul, 512 x 1024 (FP16):\n")
    print("| placement | latency | vs float | kernels |\n|---|---:|---:|---:|")
    for norm in ("Softmax", "LayerNormalization"):
        chain = tc.matmul_chain(norm=norm)
        base = row(f"{norm}: baseline", chain)
        row(f"{norm}: Q/DQ around it", tc.with_qdq(chain, edges=(("norm", 0),),
                                                   tensors=("norm",)), base)
    print("\nOne 256-channel 3x3 Conv, 56x56:\n")
    print("| precision | latency | vs FP16 | kernels |\n|---|---:|---:|---:|")
    base = row("FP16", tc.big_conv(False))
    row("INT8 (input + weight Q/DQ)", tc.big_conv(True), base)
    row("FP32 (TF32 tensor cores)", tc.big_conv(False, float_type=TensorProto.FLOAT), base)


def main() -> None:
    for float_type in (TensorProto.FLOAT16, TensorProto.FLOAT):
        resnet(float_type, bn=False)
    resnet(TensorProto.FLOAT16, bn=True)
    small_models()


if __name__ == "__main__":
    main()
