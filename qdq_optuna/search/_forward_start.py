"""The forward search as a start: where float was chosen (no quantized start within the
accuracy bound beat it) and a quantized start broke the bound, quantizer groups of the fastest
such start are added to float by measured gain per unit of error while the whole plan keeps the
bound (:mod:`~qdq_optuna.search._forward`); the result is the start ``forward``, chosen when it
beats float as a commit must, and the run then ends without a descent."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

from qdq_optuna.config import StartFrom
from qdq_optuna.measure.kernels import kernel_cache
from qdq_optuna.measure.repair import read_ran
from qdq_optuna.placement import starts as whole
from qdq_optuna.placement.export import plan_uses
from qdq_optuna.record import StartOutcome
from qdq_optuna.search._forward import (
    FORWARD_TIMED_ALONE,
    ForwardInputs,
    ForwardResult,
    forward_search,
)
from qdq_optuna.search._unfused import kernels_timed, time_kernels

log = logging.getLogger("qdq_optuna")

#: the forward search's start (:mod:`~qdq_optuna.search._forward`)
FORWARD = "forward"
#: the forward search's noise: groups whose gains together are below this share of float's
#: latency are not added (a ratio's typical p95 error on the timing protocol)
FORWARD_NOISE_SHARE = 0.03
#: the share of the search's time left that the forward search's kernel timing may take
#: (uncached signatures past it are not timed; their groups are timed whole or left out)
KERNEL_SHARE = 0.25
#: seconds the forward search's kernel timing may take however little time is left (its
#: error evaluations are bounded by their count, as the first repair's are: on a large model
#: the starts outlast a short --timeout, and a forward search cut there ships float)
KERNEL_FLOOR_S = 60.0


def forward_start(phase, rows: list[StartOutcome]) -> ForwardStart | None:
    """The forward search (:mod:`~qdq_optuna.search._forward`), once float was chosen
    (no quantized start within the accuracy bound beat it) where a quantized start broke
    the bound: its groups drawn from the fastest start past the bound, its result measured
    and checked as the start ``forward``; None where it does not run."""
    s = phase.s
    flt = float_row(rows)
    if s.guard is None or flt is None or flt.latency_ms is None \
            or phase.mode in (StartFrom.FLOAT, StartFrom.RECIPE):
        return None
    noise = 0.0 if s.plans.deterministic else FORWARD_NOISE_SHARE
    broke = [r for r in rows if r.qdq and not r.feasible and r.latency_ms is not None]
    if not broke:
        return None
    source = min(broke, key=lambda r: (r.latency_ms, r.name))
    plan = phase._row_plan(source)
    what = read_ran(s.plans.measurer.backend, s.exporter, plan)
    found = forward_search(_forward_inputs(s, plan, what, flt.latency_ms, noise))
    log.info("forward search from float (groups of %s): %d of %d group(s) added, %s",
             source.name, len(found.added), len(found.groups), found.end.value)
    if found.plan is None:
        return ForwardStart(source.name, found, None, flt)
    start = whole.start_from_uses(
        s.prepared, FORWARD, list(plan_uses(found.plan)),
        notes=[f"built up from float: {len(found.added)} of {len(found.groups)} quantizer "
               f"group(s) of {source.name}, by measured gain per unit of output error, "
               f"while the whole plan kept the accuracy bound ({found.evaluations} error "
               f"evaluations); then {found.end.value}"])
    phase._together([start])
    return ForwardStart(source.name, found, phase._measured(start), flt)


@dataclass(frozen=True)
class ForwardStart:
    """What the forward search did in the starts phase: the start its groups came from, its
    result, its measured start (None: it ended at float) and the float start."""

    source: str
    found: ForwardResult
    row: StartOutcome | None
    flt: StartOutcome

    def report(self, rows: list[StartOutcome], chosen: str) -> dict:
        """report.json's ``forward``: the search's result, what ships and the line that says
        why (the run then ends without a descent)."""
        row = next((r for r in rows if self.row is not None and r.name == self.row.name), None)
        speed = (self.flt.latency_ms / row.latency_ms if row is not None and row.latency_ms
                 else None)
        added, total = len(self.found.added), len(self.found.groups)
        if row is not None and chosen == row.name:
            why = (f"no quantized start within the accuracy bound is faster than float beyond "
                   f"noise; the most speed within it is {added} of {total} quantizer groups, "
                   f"{speed:.2f}x float: shipped")
        elif row is not None:
            why = (f"nothing within the accuracy bound is faster than float beyond noise (the "
                   f"forward search's {added} of {total} groups ran {speed:.2f}x float, not "
                   f"confirmed faster): {chosen} ships")
        else:
            why = (f"nothing within the accuracy bound is faster than float beyond noise "
                   f"({self.found.end.value}): {chosen} ships")
        return {**self.found.to_dict(), "from_start": self.source,
                "start": row.name if row is not None else None, "measured_speedup": speed,
                "shipped": chosen, "why": why + "; no descent"}


def _forward_inputs(s, plan, what, float_ms: float, noise: float) -> ForwardInputs:
    """The forward search's inputs in search ``s``: the guard's scorer and bound, the kernel
    table of ``plan`` (what the runtime ran ``what``), whole-model timing in the starts' phase,
    and ``noise`` as a share of the float start's ``float_ms``. It runs to its evaluation
    budget whatever the deadline, as the first repair does (:data:`KERNEL_FLOOR_S`)."""
    return ForwardInputs(
        s.exporter, plan, lambda p: s.guard.error(p)["error"], s.guard.bound.value, float_ms,
        noise * float_ms, _kernel_table(s, plan, what),
        lambda p: s.plans.measure(s.exporter.source(p), p.key, "starts", qdq=len(p))[0],
        len(plan) if s.plans.deterministic else FORWARD_TIMED_ALONE,
        what.float_nodes if what is not None else frozenset())


def _kernel_table(s, plan, what):
    """The kernel table of ``plan``'s integer kernels in search ``s`` (cached per machine),
    or None where the run times no kernels or the timing fails."""
    if s.plans.deterministic or not kernels_timed(s):
        return None
    left = s.remaining()
    deadline = s.plans.measurer.deadline
    if left is not None:  # the kernels take a share of what is left: errors follow
        deadline = time.monotonic() + max(KERNEL_SHARE * left, KERNEL_FLOOR_S)
    try:
        with s.wall.step("starts", "kernel timing"):
            return time_kernels(s, s.exporter.to_bytes(plan), kernel_cache(s.kernel_cache),
                                skip=what.float_nodes if what is not None else (),
                                deadline=deadline)
    except Exception as exc:  # evidence is an optimisation: never the run's failure
        log.info("kernels could not be timed (%s): groups are timed whole", exc)
        return None


def beats_float(phase, rows: list[StartOutcome], row: StartOutcome,
                flt: StartOutcome, *, ab) -> str:
    """``row``'s name when it beats float as a commit must (on a measured backend an
    interleaved A/B, kept on its row as ``ab_vs_float``), else float's."""
    rule, plans = phase.s.rule, phase.s.plans
    if not row.usable:
        return flt.name
    if plans.deterministic:
        return row.name if rule.promising(row.latency_ms, flt.latency_ms,
                                          rule.threshold) else flt.name
    cmp = plans.compare(phase._source(row), phase._source(flt), "starts")
    rows[rows.index(row)] = replace(row, ab_vs_float=ab(cmp))
    return row.name if rule.confirmed(cmp, rule.threshold, False) else flt.name


def float_row(rows: list[StartOutcome]) -> StartOutcome | None:
    """The float start's row (None: not among ``rows``)."""
    return next((r for r in rows if r.name == whole.FLOAT), None)


def forward_choice(phase, rows: list[StartOutcome], chosen: str, *, ab
                   ) -> tuple[str, ForwardStart | None]:
    """The start chosen once the forward search had its say: where float was chosen (no
    quantized start beat it), the forward search runs and its start (appended to ``rows``)
    is chosen when it beats float (``ab``: how an A/B is kept on a row)."""
    flt = float_row(rows)
    if flt is None or chosen != flt.name:
        return chosen, None
    with phase.s.wall.step("starts", "forward search"):
        forward = forward_start(phase, rows)
    if forward is not None and forward.row is not None:
        rows.append(forward.row)
        with phase.s.wall.step("starts", "choice A/Bs"):
            chosen = beats_float(phase, rows, forward.row, flt, ab=ab)
    return chosen, forward
