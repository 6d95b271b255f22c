"""ONNX Runtime's own recipe (``quantize_static``) next to our export of the same placement:
do both run the same kernels once ONNX Runtime has optimized them?"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import onnx

from qdq_optuna.backends.onnxruntime_kernels import Kernels, kernels_of


@dataclass(frozen=True)
class RecipeParity:
    """ONNX Runtime's recipe on a model, its placement mapped onto our insertion points
    (:func:`starts.ort_recipe_start`), and the kernels of both models after ONNX Runtime's
    optimizations: ``ours`` is our export of the projected placement with the recipe's scales."""

    start: object  # starts.Start
    ours: Kernels
    recipe: Kernels
    #: worst cosine / relative L2 / max abs of our export's outputs against the recipe's
    #: model's on the given inputs (None when no inputs were given)
    agreement: Mapping[str, float] | None = None

    @property
    def verdict(self) -> str:
        """``identical`` (every op count), ``fewer Q/DQ`` (the same kernels, no Q/DQ node
        the recipe lacks), ``more Q/DQ`` (the same kernels), else ``different kernels``."""
        if self.ours.same_as(self.recipe):
            return "identical"
        if self.ours.no_more_work_than(self.recipe):
            return "fewer Q/DQ"
        return "more Q/DQ" if self.ours.same_compute(self.recipe) else "different kernels"

    @property
    def as_fast(self) -> bool:
        """Our export runs every kernel the recipe's does, with no extra Q/DQ node."""
        return self.verdict in ("identical", "fewer Q/DQ")

    def diff(self) -> dict[str, tuple[int, int]]:
        """Op type -> (ours, the recipe's) where the counts differ."""
        return self.ours.diff(self.recipe)


def recipe_parity(pm, model, *, data=None, input_shapes=None, check_samples: int = 0
                  ) -> RecipeParity:
    """Run ONNX Runtime's recipe on ``model`` (the file ``pm`` was prepared from; calibrated
    on ``data``), project it onto ``pm``'s points and compare what ONNX Runtime runs for it and
    for our export (with the recipe's scales; checked with ``onnx.checker``). With
    ``check_samples``, both models also run on that many samples of ``data``."""
    from qdq_optuna.measure.accuracy import output_errors, run_model, summarize
    from qdq_optuna.placement import starts

    with tempfile.TemporaryDirectory(prefix="qdq-optuna-parity-") as tmp:
        path = starts.ort_recipe_model(model, Path(tmp), data=data, input_shapes=input_shapes)
        uses, notes, counts = starts.read_placement(pm, path)
        start = starts.start_from_uses(pm, "recipe:onnxruntime", uses, notes, counts)
        exporter = pm.exporter(scales=starts.read_scales(path))
        ours = exporter.to_bytes(exporter.plan(start.scheme_uses))
        onnx.checker.check_model(onnx.load_from_string(ours))
        agreement = None
        if check_samples and data is not None:
            feeds = {k: v[:check_samples] for k, v in data.items()}
            agreement = summarize(output_errors(run_model(str(path), feeds),
                                                run_model(ours, feeds)))
        return RecipeParity(start, kernels_of(ours), kernels_of(path), agreement)
