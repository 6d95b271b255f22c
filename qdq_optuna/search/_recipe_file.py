"""The runtime's recipe files as written: what a user of that runtime gets from its own tools
(NNCF's ``nncf.quantize`` for OpenVINO; ``quantize_static`` and, for models with MatMuls of
constant weights, ``quantize_dynamic`` for ONNX Runtime), with their Q/DQ, scales, zero
points and types exactly as the tools wrote them; the profile lists them
(``Runtime.recipe_files``), the classic recipe's first.

The starts phase reads the recipe's placement from that file and the descent moves from its
re-export with our scales (the ``recipe:RUNTIME`` start). The file itself is kept in the run
folder (``recipe_NAME.onnx``, written once when the recipe is made, so a resumed run
measures the same file; made again the same way when it is missing) and is a start of its
own when the run concludes, measured as written (each file in turn, against what would ship
so far):

* against the re-export of its placement: when the re-export is slower beyond noise (the
  A/B's interval above 1), the report lists what differs in their Q/DQ tensors
  (:func:`~qdq_optuna.measure.recipe_parity.qdq_differences`);
* against the tuned model (or an earlier file that ships): when the file keeps the accuracy
  bound and measures faster beyond noise, it ships as ``optimized.onnx``, so the result is
  never slower than any recipe file within the bound beyond noise. That A/B runs to its
  verdict whatever ``--timeout`` left (:meth:`PlanMeasurer.whole`): the run's last
  decision is the one the promise rests on.

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
from qdq_optuna.measure.accuracy import AccuracyError
from qdq_optuna.measure.recipe_parity import qdq_differences
from qdq_optuna.placement import starts
from qdq_optuna.record import Agreed
from qdq_optuna.run_folder import RunFolder
from qdq_optuna.search._outcome import ShippedAccuracy

log = logging.getLogger("qdq_optuna")

#: report.json's ``recipe_file["shipped"]`` and ``accuracy["shipped"]`` when the file ships
SHIPPED_RECIPE_FILE = "the recipe's own file"


class RecipeFile:
    """One recipe file of one run: ``path`` in the run ``folder`` (None: no file); ``make``
    makes it again (bytes, or None when the tool cannot) when the file is missing; ``name``
    and ``tool`` name it in the report; ``placement``: whether its static Q/DQ placement is
    read back and its re-export with our scales measured against it; ``agreed``: the stored
    run's key of its decision."""

    def __init__(self, search, folder: RunFolder, path: Path | None,
                 make: Callable[[], bytes | None], *, name: str = "", tool: str = "",
                 placement: bool = True, agreed: str = Agreed.RECIPE_FILE) -> None:
        self.s = search
        self.folder = folder
        self.path = path
        self.make = make
        self.name = name
        self.tool = tool
        self.placement = placement
        self.agreed = agreed

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

    def conclude(self, plan, final_bytes: bytes | None, exporter,
                 against: str = "the tuned model") -> tuple:
        """``(plan, final_bytes, report)``: what would ship (``against``: the tuned model, or
        an earlier recipe file that ships), or this file when it ships (``optimized.onnx``
        rewritten; ``plan``: the re-export of its placement, what the report lists, for a
        file with a placement); ``report``: this file's entry of report.json's
        ``recipe_files`` (None: no file)."""
        data = self.data() if isinstance(final_bytes, bytes) else None
        if data is None:
            return plan, final_bytes, None
        reexport = self._reexport(data, exporter) if self.placement else None
        # measured once per run and agreed in the stored run: a rerun, --remeasure or a
        # second worker reads the decision instead of measuring again
        report = self.s.record.agree(self.agreed, lambda: self._measure(
            data, plan, final_bytes, None if reexport is None else exporter.source(reexport),
            reexport is not None and reexport.key == plan.key, against))
        if not report.get("shipped"):
            return plan, final_bytes, report
        self.folder.write_optimized(data)
        return (plan if reexport is None else reexport), data, report

    def _reexport(self, data: bytes, exporter):
        """Our export of the file's placement, as the starts phase places it."""
        pm, space = self.s.prepared, self.s.settings.space
        uses, _, _ = starts.read_placement(pm, onnx.load_from_string(data))
        start = starts.start_from_uses(pm, "recipe", uses)
        return exporter.plan(self.s.record.uses({
            pp.pattern.id: space.indices(space.seed(start.schemes.get(pp.pattern.id, {})),
                                         pp.ids) for pp in pm.tunable}, start.pinned))

    def _measure(self, data: bytes, plan, final_bytes: bytes, reexport: bytes | None,
                 same: bool, against: str) -> dict:
        """The file's errors, its re-export's (with a placement) and its A/B against what
        would ship, and whether it ships: the file faster beyond noise by at least
        ``Config.performance_threshold`` (the commit rule's bar for a change that adds
        Q/DQ) and within the accuracy bound. Counted as the ``lanes`` phase (which model
        ships).

        The file is the A/B's candidate, so the A/B gives up when the *file* is not faster
        (timed the other way round it gave up when what would ship was not faster: the very
        case the file should win); and it runs to its verdict past ``--timeout``'s deadline.
        A file that breaks the bound cannot ship, so it is not timed (a 4,755-node decoder
        spent 170 of its 257 s here A/B-timing two such files: sessions of a large model
        take seconds each); the report gives its error and says why."""
        plans = self.s.plans
        report: dict = {"name": self.name, "tool": self.tool, "file": self.path.name,
                        "against": against, "shipped": False}
        node_filter = self.s.prepared.node_filter
        excluded = node_filter.quantized_against(onnx.load_from_string(data))
        if excluded:  # the tool ran on the whole model: not a file this user may ship
            shown = ", ".join(excluded[:5]) + (f" and {len(excluded) - 5} more"
                                               if len(excluded) > 5 else "")
            log.info("the recipe's own file %s quantizes nodes --exclude-nodes/--op-types "
                     "keep float (%s): not measured", self.path.name, shown)
            return {**report, "failure": f"not measured: it quantizes {len(excluded)} "
                    f"node(s) --exclude-nodes/--op-types keep float ({shown})",
                    "against_node_filter": excluded}
        guard = self.s.guard
        try:
            errors = plans.scorer.score_bytes(data)
            if guard is not None and not guard.bound.allows_recipe(errors["error"]):
                return {**report, "error": errors["error"],
                        "output_errors": errors["output_errors"], "within_bound": False,
                        "not_timed": "past the accuracy bound: it cannot ship"}
            vs_file = None
            if reexport is not None and not same:
                vs_file = plans.compare(reexport, data, "lanes")
            with plans.whole():
                file_vs = plans.compare(data, final_bytes, "lanes")
            vs_tuned = file_vs.turned()
            vs_file = vs_tuned if reexport is not None and same else vs_file
        except (BackendError, AccuracyError) as exc:  # a file the runtime cannot run never ships
            log.warning("the recipe's own file %s could not be measured (%s)",
                        self.path.name, exc)
            return {**report, "failure": str(exc)[:500]}
        report.update(error=errors["error"], output_errors=errors["output_errors"],
                      within_bound=True, tuned_vs_file=vs_tuned.to_dict())
        claim = guard.claim(errors) if guard is not None else None
        if claim is not None:  # the claim report.json makes when this file ships
            report["claim"] = claim
        if vs_file is not None:
            report.update(reexport_vs_file=vs_file.to_dict(),
                          differences=qdq_differences(reexport, data)
                          if vs_file.verdict == "slower" else [])
        rule = self.s.rule
        if rule.confirmed(file_vs, rule.threshold, plans.deterministic):
            log.warning("%s measured %.3fx the latency of the recipe's own file %s "
                        "(95%% interval %.3f-%.3f): optimized.onnx is that file", against,
                        vs_tuned.ratio, self.path.name, vs_tuned.ci_low, vs_tuned.ci_high)
            report["shipped"] = True
        return report


def conclude_recipe_files(files: list[RecipeFile], plan, final_bytes: bytes | None,
                          exporter) -> tuple:
    """``(plan, final_bytes, reports)``: each recipe file in turn measured against what
    would ship so far (the tuned model, then the last file that shipped), so what ships is
    never slower beyond noise than any of them that keeps the bound; ``reports``: the
    measured files' entries (report.json's ``recipe_files``)."""
    reports, against = [], "the tuned model"
    for rf in files:
        plan, final_bytes, report = rf.conclude(plan, final_bytes, exporter, against)
        if report is None:
            continue
        reports.append(report)
        if report.get("shipped"):
            against = f"the recipe's own file {report['file']}"
    return plan, final_bytes, reports


def shipped_recipe_file(reports: list[dict]) -> dict | None:
    """The entry of the recipe file that ships (the last one shipped), or None."""
    return next((r for r in reversed(reports) if r.get("shipped")), None)


def shipped_accuracy(accuracy: ShippedAccuracy, reports: list[dict]) -> ShippedAccuracy:
    """The guard's accuracy of what ships, with the recipe files measured (the classic
    recipe's first) and the shipped recipe file's errors when one ships."""
    if not reports:
        return accuracy
    accuracy.recipe_files = reports
    recipe_file = shipped_recipe_file(reports)
    if recipe_file is not None:
        # the claim (per-sample spread, upper bound) is the file's, not the tuned model's
        accuracy.guard.update(shipped=SHIPPED_RECIPE_FILE, error=recipe_file["error"],
                              output_errors=recipe_file["output_errors"],
                              claim=recipe_file.get("claim"))
        accuracy.final_output_error = recipe_file["error"]
        accuracy.final_output_errors = recipe_file["output_errors"]
    return accuracy
