"""A text detector's own error for ``--metric``: the share of probability-map pixels whose text
decision (> 0.3, PaddleOCR's DB threshold) differs from the FP32 model's. Relative L2 and cosine
of the map mislead on a photo with no text: its map is ~1e-7 everywhere, a quantized logit near
-15 changes that by its own size (cosine 0) while no pixel's decision changes.

    python benchmarks/repair_vs_bisect.py --models ppocr-det --metric det_metric:flips --bound 0.002
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

#: PaddleOCR's ``det_db_thresh``: a pixel is text above it
THRESHOLD = 0.3


def flips(reference: dict, candidate: dict) -> float:
    """Share of pixels of the (single) output whose text decision differs."""
    (ref,), (cand,) = reference.values(), candidate.values()
    return float(np.mean((np.asarray(ref) > THRESHOLD) != (np.asarray(cand) > THRESHOLD)))


def main(argv: list[str] | None = None) -> int:
    """``det_metric.py FP32.onnx CANDIDATE.onnx DATA.npz``: the candidate's flips on the data's
    samples (one run each, ONNX Runtime CPU), per sample and over all."""
    import onnxruntime as ort

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reference", help="the FP32 detector (.onnx)")
    ap.add_argument("candidate", help="the quantized detector (.onnx)")
    ap.add_argument("data", help=".npz: input name -> samples on axis 0")
    args = ap.parse_args(argv)
    data = dict(np.load(args.data))
    outs = []
    for path in (args.reference, args.candidate):
        session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        n = len(next(iter(data.values())))
        outs.append(np.concatenate([session.run(None, {k: v[i:i + 1] for k, v in data.items()})[0]
                                    for i in range(n)]))
    ref, cand = outs
    for i in range(len(ref)):
        print(f"sample {i}: flips {flips({'o': ref[i]}, {'o': cand[i]}):.5f}")
    print(f"all: flips {flips({'o': ref}, {'o': cand}):.5f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
