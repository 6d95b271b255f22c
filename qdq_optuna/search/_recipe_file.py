"""The runtime's recipe file as written: what a user of that runtime gets from its own tool
(NNCF's ``nncf.quantize`` for OpenVINO, ``quantize_static`` for ONNX Runtime), with its Q/DQ,
scales, zero points and types exactly as the tool wrote them.

The starts phase reads the recipe's placement from that file and the descent moves from its
re-export with our scales (the ``recipe:RUNTIME`` start). The file itself is kept in the run
folder (``recipe_RUNTIME.onnx``, written once when the recipe is made, so a resumed run
measures the same file; made again the same way when it is missing) and is a start of its
own when the run concludes, measured as written:

* against the re-export of its placement: when the re-export is slower beyond noise (the
  A/B's interval above 1), the report lists what differs in their Q/DQ tensors
  (:func:`~qdq_optuna.measure.recipe_parity.qdq_differences`);
* against the tuned model: when the tuned model is slower beyond noise and the file keeps the
  accuracy bound, the file ships as ``optimized.onnx``, so the result is never slower than
  the recipe beyond noise.

Why: on SqueezeNet (OpenVINO, BF16 CPU) NNCF's file measured 1.614x FP32 and the re-export
of its placement 1.296x; the search had never started from what NNCF gives.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import onnx

from qdq_optuna.backends.base import BackendError
from qdq_optuna.errors import ToolError
from qdq_optuna.measure.recipe_parity import qdq_differences
from qdq_optuna.placement import starts
from qdq_optuna.record import Agreed
from qdq_optuna.run_folder import RunFolder

log = logging.getLogger("qdq_optuna")

#: report.json's ``recipe_file["shipped"]`` and ``accuracy["shipped"]`` when the file ships
SHIPPED_RECIPE_FILE = "the recipe's own file"


class RecipeFile:
    """The recipe file of one run: ``path`` in the run ``folder`` (None: no file); ``make``
    makes it again (bytes, or None when the tool cannot) when the file is missing."""

    def __init__(self, search, folder: RunFolder, path: Path | None,
                 make: Callable[[], bytes | None]) -> None:
        self.s = search
        self.folder = folder
        self.path = path
        self.make = make

    def data(self) -> bytes | None:
        """The file's bytes: as kept, else made again and kept."""
        if self.path is None:
            return None
        if self.path.is_file():
            return self.path.read_bytes()
        try:
            data = self.make()
        except ToolError as exc:
            log.warning("%s; the recipe's own file is not measured", exc)
            return None
        if data is not None:
            self.folder.keep(self.path, data)
        return data

    def conclude(self, plan, final_bytes: bytes | None, exporter) -> tuple:
        """``(plan, final_bytes, report)``: the tuned model's, or the recipe file's when it
        ships (``optimized.onnx`` rewritten; ``plan``: the re-export of its placement, what
        the report lists); ``report``: report.json's ``recipe_file`` (None: no file)."""
        data = self.data() if isinstance(final_bytes, bytes) else None
        if data is None:
            return plan, final_bytes, None
        pm, space = self.s.prepared, self.s.settings.space
        uses, _, _ = starts.read_placement(pm, onnx.load_from_string(data))
        start = starts.start_from_uses(pm, "recipe", uses)  # as the starts phase places it
        reexport = exporter.plan(self.s.record.uses({
            pp.pattern.id: space.indices(space.seed(start.schemes.get(pp.pattern.id, {})),
                                         pp.ids) for pp in pm.tunable}, start.pinned))
        # measured once per run and agreed in the stored run: a rerun, --remeasure or a
        # second worker reads the decision instead of measuring again
        report = self.s.record.agree(Agreed.RECIPE_FILE, lambda: self._measure(
            data, plan, final_bytes, exporter.source(reexport), reexport.key == plan.key))
        if not report.get("shipped"):
            return plan, final_bytes, report
        self.folder.write_optimized(data)
        return reexport, data, report

    def _measure(self, data: bytes, plan, final_bytes: bytes, reexport: bytes,
                 same: bool) -> dict:
        """The file's errors, its re-export's and the tuned model's A/Bs against it, and
        whether it ships: the tuned model slower beyond noise by at least
        ``Config.performance_threshold`` (the commit rule's bar for adding Q/DQ) and the file
        within the accuracy bound. Counted as the ``lanes`` phase (which model ships)."""
        plans = self.s.plans
        report: dict = {"file": self.path.name, "shipped": False}
        try:
            errors = plans.scorer.score_bytes(data)
            vs_file = plans.compare(reexport, data, "lanes")
            vs_tuned = vs_file if same else plans.compare(final_bytes, data, "lanes")
        except BackendError as exc:
            log.warning("the recipe's own file could not be measured (%s)", exc)
            return {**report, "failure": str(exc)[:500]}
        guard = self.s.guard
        within = guard is None or errors["error"] <= guard.bound
        report.update(error=errors["error"], output_errors=errors["output_errors"],
                      within_bound=within, reexport_vs_file=vs_file.to_dict(),
                      tuned_vs_file=vs_tuned.to_dict(),
                      differences=qdq_differences(reexport, data)
                      if vs_file.verdict == "slower" else [])
        threshold = self.s.config.performance_threshold
        if within and vs_tuned.verdict == "slower" and vs_tuned.ratio >= threshold:
            log.warning("the tuned model measured %.3fx the latency of the recipe's own file "
                        "(95%% interval %.3f-%.3f): optimized.onnx is that file",
                        vs_tuned.ratio, vs_tuned.ci_low, vs_tuned.ci_high)
            report["shipped"] = True
        return report


def shipped_accuracy(accuracy: dict, recipe_file: dict | None) -> dict:
    """report.json's accuracy keys, with the recipe file's errors when it ships."""
    if recipe_file is None:
        return accuracy
    accuracy["recipe_file"] = recipe_file
    if recipe_file.get("shipped"):
        accuracy["accuracy"].update(shipped=SHIPPED_RECIPE_FILE, error=recipe_file["error"],
                                    output_errors=recipe_file["output_errors"])
        accuracy["final_output_error"] = recipe_file["error"]
        accuracy["final_output_errors"] = recipe_file["output_errors"]
    return accuracy
