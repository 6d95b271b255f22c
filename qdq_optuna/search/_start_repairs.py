"""Starts past the accuracy bound, repaired: each quantized start that measured faster than
float but broke the bound comes back with just enough of its quantizer groups returned to float
(:func:`~qdq_optuna.measure.repair.repair`, the run's one repair), as one more start
(``NAME-in-bound``), measured and checked like any other.

:class:`StartRepairs` takes what it reads explicitly (the guard, the exporter, the prepared
model, the backend, the run's clock, the starts' own plan and measuring steps), not the search's
shared context.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import replace

from qdq_optuna.backends.base import Backend
from qdq_optuna.backends.what_ran import WhatRan
from qdq_optuna.measure.repair import RepairMethod, estimated_speed, read_ran, repair
from qdq_optuna.placement import starts as whole
from qdq_optuna.placement.export import QDQExporter, QuantPlan, plan_uses
from qdq_optuna.placement.starts import Start
from qdq_optuna.record import StartOutcome
from qdq_optuna.runtimes.prepared import PreparedModel
from qdq_optuna.search._guard import Guard, listed

log = logging.getLogger("qdq_optuna")

#: a repaired start's name is its start's with this suffix (``recipe:openvino-in-bound``): the
#: start without the Q/DQ that broke the accuracy bound (:meth:`StartRepairs.run`)
REPAIRED = "-in-bound"
#: a start's ``repair_outcome`` when its repair yielded no start to measure
NO_TIME = "not repaired: no time left under --timeout"
KEPT_NOTHING = ("not repaired: no quantized part of it kept the accuracy bound (ranked groups, "
                "then bisection over tensors)")
SAME_MODEL = "not measured: the repaired start is the same model as another start"
#: a start whose quantized uses overlap this much (Jaccard) with a start repaired already (or
#: found beyond repair) is not repaired again (PP-OCRv5's detector: every point and ONNX
#: Runtime's recipe differ in 1 of 264 points, and each repair costs 64 error evaluations)
TWIN = 0.9


class StartRepairs:
    """The starts phase's repairs. ``plan_of``: a start's whole-model plan; ``row_plan``: a
    measured row's; ``measure``: a repaired start timed with the baseline and measured as the
    other starts were (its row); ``stage``: the progress line's count (``stage(total, done)``);
    ``remaining``: seconds left of the run (None: no timeout)."""

    def __init__(self, *, guard: Guard, exporter: QDQExporter, prepared: PreparedModel,
                 backend: Backend, remaining: Callable[[], float | None],
                 plan_of: Callable[[Start], QuantPlan],
                 row_plan: Callable[[StartOutcome], QuantPlan],
                 measure: Callable[[Start], StartOutcome],
                 stage: Callable[[int, int], None]) -> None:
        self.guard = guard
        self.exporter = exporter
        self.prepared = prepared
        self.backend = backend
        self.remaining = remaining
        self.plan_of = plan_of
        self.row_plan = row_plan
        self.measure = measure
        self.stage = stage
        #: plan key -> what the runtime ran for it (the backend's report, None: not readable)
        self._ran: dict[str, WhatRan | None] = {}

    def run(self, cands: list[Start], rows: list[StartOutcome]) -> list[StartOutcome]:
        """Each quantized start that measured faster than float but broke the accuracy bound,
        with just enough of its quantizer groups returned to float: NNCF's placement of magika (a byte-level classifier)
        runs 2.1x faster than float on OpenVINO and puts out nothing like FP32 (cosine 1e-5);
        a few tensors cause that, and the rest of the placement is worth starting from. Whole
        groups (one node's quantized inputs) go back in order of error per latency cost
        (:func:`~qdq_optuna.measure.repair.rank_repair`), so the integer chains left still
        fuse; a repaired start is measured and checked like any other (its row, with the
        sensitivity table, is returned). Each start that needed a repair says on its row what
        it came to (``repair_outcome``), with the table when no repaired start was measured,
        so the report shows where the error was even when float ships."""
        flt = next((r for r in rows if r.name == "float"), None)
        if flt is None or flt.latency_ms is None:
            return []
        out, seen = [], {r.plan_key for r in rows}
        # a repair only takes Q/DQ out, so a start slower than a model already within the
        # bound is not worth its bisection (dnsmos-p835: 40 evaluations, 8 minutes)
        best = min((r.latency_ms for r in rows if r.usable), default=math.inf)
        tried: dict[str, set] = {}  # starts repaired (or found beyond repair): their uses
        todo = [(start, row) for start, row in zip(cands, rows)
                if not row.feasible and row.latency_ms is not None
                and row.latency_ms < min(flt.latency_ms, best)]
        # the start whose integer chains hold the most speed by the repair's cost model first
        # (what survives returning groups to float; measured speed breaks ties): the first
        # repair is the one that runs past the deadline
        held = {row.name: self._holds(row) for _, row in todo} if len(todo) > 1 else {}
        for start, row in sorted(todo, key=lambda sr: (-held.get(sr[1].name, 0.0),
                                                       sr[1].latency_ms)):
            if row.latency_ms >= min(flt.latency_ms, best):
                continue
            i = rows.index(row)
            # the first start repaired runs whole even past the search's deadline, as the
            # starts' A/Bs do: on a large model the starts' timing outlasts a short --timeout
            # (PP-OCRv4's detector: 330 s of 300), and a repair cut there ships float where the
            # repair's placement runs 1.3x (its cost is bounded by REPAIR_EVALUATIONS); later
            # ones only while time is left
            remaining = self.remaining()
            if tried and remaining is not None and remaining <= 0:
                rows[i] = replace(row, repair_outcome=NO_TIME)
                continue
            plan = self.row_plan(row)
            uses = set(plan_uses(plan))
            twin = next((name for name, other in tried.items() if _overlap(uses, other) >= TWIN),
                        None)
            if twin is not None:
                rows[i] = replace(row, repair_outcome=f"not repaired: nearly the placement of "
                                  f"{twin}, repaired already")
                continue
            repaired, table, outcome = self._repaired(start, plan, past_deadline=not tried)
            if outcome != NO_TIME:
                tried[start.name] = uses
            if repaired is None:
                log.info("start %s: %s", start.name, outcome)
                rows[i] = replace(row, repair_outcome=outcome, repair=table)
                continue
            key = self.plan_of(repaired).key
            if key in seen:  # float's key is among them: nothing left on
                rows[i] = replace(row, repair_outcome=SAME_MODEL, repair=table)
                continue
            rows[i] = replace(row, repair_outcome=f"repaired: {repaired.name}")
            seen.add(key)
            done = len(rows) + len(out)
            self.stage(done + 1, done)
            # timed with the baseline as the other starts were: timed alone after the repair,
            # PP-OCRv4's repaired start read 0.97x float, as placed it runs 1.24x float
            repaired_row = replace(self.measure(repaired), repair=table)
            out.append(repaired_row)
            if repaired_row.usable:
                best = min(best, repaired_row.latency_ms)
        return out

    def _repaired(self, start: Start, plan: QuantPlan, *, past_deadline: bool = False
                  ) -> tuple[Start | None, dict | None, str]:
        """``start`` within the bound by the run's one repair
        (:func:`~qdq_optuna.measure.repair.repair`), the ranked repair's sensitivity table, and
        what the repair came to: quantizer groups returned to float by error per latency cost;
        where that keeps nothing within the evaluations (an error spread over hundreds of
        groups ranks coarsely: a real PP-OCR detector and text-line classifier), bisection over
        tensors (a repaired start is measured even where the repair's own estimate says it
        runs no faster than float: the runtime decides, and the report says why).
        ``past_deadline``: the ranked repair runs to its evaluation budget whatever the
        deadline."""
        time_left = lambda: (r := self.remaining()) is None or r > 0  # noqa: E731
        fixed = repair(self.exporter, plan, lambda p: self.guard.error(p)["error"],
                       self.guard.bound.value, what=self._what_ran(plan), time_left=time_left,
                       rank_time_left=(lambda: True) if past_deadline else time_left)
        name, found = f"{start.name}{REPAIRED}", fixed.ranked
        table = found.to_dict()
        if fixed.method is RepairMethod.RANKED:
            nodes = [g.name for g in found.returned]
            switched = [g.name for g in found.switched]
            modes = (f"; {len(switched)} node(s) switched to dynamic instead (their "
                     f"activations quantized per call): {listed(switched)}" if switched else "")
            return whole.start_from_uses(
                self.prepared, name, list(plan_uses(fixed.plan)),
                notes=[f"{start.name} with {len(nodes)} of {len(found.groups)} quantizer "
                       f"group(s) returned to float, ranked by output error per latency "
                       f"cost ({found.evaluations} error evaluations) until within the "
                       f"accuracy bound: {listed(nodes)}{modes}"]), table, ""
        if fixed.method is RepairMethod.NO_TIME:
            return None, table, NO_TIME
        if fixed.method is RepairMethod.FLOAT:
            return None, table, KEPT_NOTHING
        cut = fixed.bisection
        gone = set(cut.responsible)
        return whole.start_from_uses(
            self.prepared, name, [u for u in plan_uses(plan) if u[0] not in gone],
            notes=[f"{start.name} without the Q/DQ on {len(gone)} tensor(s) that broke the "
                   f"accuracy bound (bisection in {cut.evaluations} error evaluations, after "
                   f"the ranked repair kept nothing in {found.evaluations}): "
                   f"{listed(cut.responsible)}"]), None, ""

    def _holds(self, row: StartOutcome) -> float:
        """The integer speed a start's placement holds by the repair's cost model."""
        plan = self.row_plan(row)
        return estimated_speed(self.exporter, plan, self._what_ran(plan))

    def _what_ran(self, plan: QuantPlan) -> WhatRan | None:
        """What the runtime ran integer for ``plan`` (the repair's latency costs), or None
        when the backend cannot tell."""
        if plan.key not in self._ran:  # the repair order and the repair read the same plan
            self._ran[plan.key] = read_ran(self.backend, self.exporter, plan)
        return self._ran[plan.key]


def _overlap(a: set, b: set) -> float:
    """Jaccard overlap of two sets of quantized uses."""
    return len(a & b) / max(len(a | b), 1)
