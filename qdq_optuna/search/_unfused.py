"""Where the runtime left something a move can win: the standing model's "what ran"
(:class:`~qdq_optuna.backends.what_ran.WhatRan`), read once per standing model, never per trial.

A Q/DQ pair the runtime fused into an integer kernel, with no float compute next to it and no
reformat at it, has nothing to gain from removal: a move that only switches such pairs off is
not measured. A move is kept when one of its tensors has a standalone Q or DQ or a reformat,
when a node reading or writing one of its tensors ran in float next to integer neighbours, or
when it switches a point on (the report says nothing about a pair that is not there yet). A
visit with no move kept is skipped; a round whose every visit was skipped ends the descent.
A backend that cannot tell (``what_ran`` returns None) prunes nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from qdq_optuna.backends.what_ran import WhatRan
from qdq_optuna.search._moves import Point

log = logging.getLogger("qdq_optuna")

#: the line that ends a descent the runtime says is done
FINAL_LINE = "nothing the runtime left unfused: the standing model is final"


class Unfused:
    """The standing models' reports (by plan key) and the moves they leave worth measuring."""

    def __init__(self, search, uses_of: dict[Point, frozenset]) -> None:
        self.s = search
        self.uses_of = uses_of
        self.backend = search.plans.measurer.backend if search.plans is not None else None
        self.read: dict[str, WhatRan | None] = {}
        #: how often a report was read (once per standing model)
        self.reads = 0

    def of(self, schemes: dict[str, dict[str, int]]) -> WhatRan | None:
        """The report for the whole model at ``schemes`` (read at most once per model)."""
        if self.backend is None:
            return None
        exporter = self.s.exporter
        plan = exporter.plan(self.s.record.uses(schemes))
        if plan.key not in self.read:
            self.read[plan.key] = self._read(exporter, plan)
        return self.read[plan.key]

    def _read(self, exporter, plan) -> WhatRan | None:
        try:
            model = exporter.to_bytes(plan)
            what = self.backend.what_ran(model)
        except Exception as exc:  # a report is an optimisation: never the run's failure
            log.info("what the runtime ran could not be read (%s): nothing is pruned", exc)
            return None
        self.reads += 1
        if what is not None:
            log.info("what ran (%s): %d Q/DQ fused, %d standalone, %d float next to integer, "
                     "%d reformats", what.how, len(what.fused), len(what.standalone),
                     len(what.float_nodes), len(what.reformats))
        return what

    def sites(self, points: Iterable[Point], what: WhatRan) -> list[str]:
        """Why a move over ``points`` can still win (empty: it cannot, by the report)."""
        g = self.s.prepared.graph
        found = []
        for pt in points:
            for tensor, node, _ in self.uses_of[pt]:
                if tensor in what.standalone:
                    found.append(f"standalone Q/DQ at {tensor}")
                if tensor in what.reformats:
                    found.append(f"reformat at {tensor}")
                names = [g.nodes[node].name]
                if tensor in g.producer:
                    names.append(g.nodes[g.producer[tensor][0]].name)
                found.extend(f"float {n}" for n in names if n in what.float_nodes)
        return found

    def fused(self, what: WhatRan | None) -> Callable[[Point], bool] | None:
        """Whether removing a point's Q/DQ cannot win by the report (None: no report, nothing
        is pruned). The sampler does not propose a move that only switches such points off.
        (Putting the moves at a standalone Q/DQ or a float island first was measured: the
        visit's first improvement then lands elsewhere, 5 % slower on the zoo's ResNet.)"""
        if what is None:
            return None
        return lambda pt: not self.sites([pt], what)
