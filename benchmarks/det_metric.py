"""A text detector's own error for ``--metric``: the share of probability-map pixels whose text
decision (> 0.3, PaddleOCR's DB threshold) differs from the FP32 model's. Relative L2 and cosine
of the map mislead on a photo with no text: its map is ~1e-7 everywhere, a quantized logit near
-15 changes that by its own size (cosine 0) while no pixel's decision changes.

    python benchmarks/repair_vs_bisect.py --models ppocr-det --metric det_metric:flips --bound 0.002
"""

from __future__ import annotations

import numpy as np

#: PaddleOCR's ``det_db_thresh``: a pixel is text above it
THRESHOLD = 0.3


def flips(reference: dict, candidate: dict) -> float:
    """Share of pixels of the (single) output whose text decision differs."""
    (ref,), (cand,) = reference.values(), candidate.values()
    return float(np.mean((np.asarray(ref) > THRESHOLD) != (np.asarray(cand) > THRESHOLD)))
