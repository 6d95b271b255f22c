"""A visit as our sampler's move engine reads it (``samplers/qdq_mutation/_visit.py``).

The engine (move kinds, expected-gain order, first-improvement walk, give-up rule) lives in the
sampler; the search only describes a visit as the sampler's ``VisitSpec``, stored as the study
attr the sampler reads back (:data:`~qdq_optuna.samplers.qdq_mutation.VISIT_ATTR`): the
pattern's standing scheme, the points of other patterns a chain reaches and their standing
choice, each point's producer/consumer ops (a move's signature), the chains, the pattern
cache's scheme, what the lane's earlier visits taught (:class:`MoveStats`; earlier lanes'
clear losses as ``prior``) and, from the runtime's report, where removing a point's Q/DQ may
still win (moves that only remove Q/DQ the runtime fused, or too little to measure, are not
proposed: ``_unfused.py``). A foreign point is named ``P005:<point>``; a trial that sets
foreign points carries them as its ``partner``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import optuna

from qdq_optuna.placement.points import PatternPoints, chain_groups
from qdq_optuna.record import TrialAttr
from qdq_optuna.samplers.qdq_mutation import Move, MoveStats, Visit, VisitSpec

#: (pattern id, point id)
Point = tuple[str, str]
#: pattern id -> scheme (point -> choice index, 0 = no Q/DQ)
Schemes = dict[str, dict[str, int]]

__all__ = ["Move", "MoveSpace", "MoveStats", "Point", "Schemes", "VisitMoves"]


class MoveSpace:
    """Every point of every pattern: what it quantizes, the chains, and visits described."""

    def __init__(self, prepared) -> None:
        self.graph = prepared.graph
        self.tunable: list[PatternPoints] = prepared.tunable
        self.uses_of: dict[Point, frozenset] = {
            (pp.pattern.id, pid): frozenset(pp.uses([pid]))
            for pp in self.tunable for pid in pp.ids}
        self.chains = chain_groups(self.uses_of)
        self.by_id = {pp.pattern.id: pp for pp in self.tunable}

    def edges(self, pt: Point) -> list[list[str]]:
        """One ``[producer op, consumer op]`` per use ``pt`` quantizes."""
        g = self.graph
        return [[g.producer_op(tensor) or "input", g.nodes[node].op_type]
                for tensor, node, _ in self.uses_of[pt]]

    def visit(self, pid: str, schemes: Schemes, stats: MoveStats,
              cached: Mapping[str, int] | None = None,
              sites: Callable[[Point], dict[str, int]] | None = None,
              resolvable: Mapping | None = None,
              settled: Callable[[Point], bool] | None = None,
              added: Callable[[Point], int] | None = None,
              gains: Callable[[Point], float] | None = None,
              add_gains: Callable[[Point], float] | None = None) -> VisitMoves:
        """The visit of pattern ``pid`` from the standing ``schemes``. ``sites(point)``: by
        the runtime's report, the tensors where removing the point's Q/DQ may still win, with
        their activation elements (None: no report); ``resolvable``: ``min_share`` of
        ``total`` elements a removal must touch to be measured (None: any); ``settled(point)``:
        a Q/DQ pair there can change no layer's precision (None: the report cannot tell);
        ``added(point)``: the activation elements a pair added there can save work on (-1:
        unbounded; None: additions are never too small); ``gains(point)``: the ms removing
        its Q/DQ saves by the measured kernel table (such removals go first);
        ``add_gains(point)``: the ms adding it can save by that table (such additions go
        first too)."""
        pp = self.by_id[pid]
        mine = {(pid, q) for q in pp.ids}
        chains = [c for c in self.chains if c & mine]
        foreign = sorted({pt for c in chains for pt in c} - mine)
        name = _namer(pid)
        spec = VisitSpec(
            standing={q: int(schemes[pid].get(q, 0)) for q in pp.ids},
            foreign={name(pt): int(schemes[pt[0]].get(pt[1], 0)) for pt in foreign},
            edges={name(pt): self.edges(pt) for pt in sorted(mine) + foreign},
            chains=[sorted(name(pt) for pt in c) for c in chains],
            cache=dict(cached) if cached else None,
            taught=stats.to_attr(),
            give_up_after=stats.give_up_after,
            sites=None if sites is None else {
                name(pt): sites(pt) for pt in sorted(mine) + foreign},
            settled=None if settled is None or sites is None else sorted(
                name(pt) for pt in sorted(mine) + foreign if settled(pt)),
            added=None if added is None or sites is None else {
                name(pt): added(pt) for pt in sorted(mine) + foreign},
            min_share=(resolvable or {}).get("min_share"), total=(resolvable or {}).get("total"),
            # a later lane: what earlier lanes taught
            prior=stats.prior_attr() if stats.prior else None,
            # only points the kernel table says gain
            gains=None if gains is None else {
                name(pt): round(g, 6) for pt in sorted(mine) + foreign if (g := gains(pt)) > 0}
            or None,
            add_gains=None if add_gains is None else {
                name(pt): round(g, 6) for pt in sorted(mine) + foreign
                if (g := add_gains(pt)) > 0} or None)
        return VisitMoves(pid, schemes, spec.to_attr(), Visit(spec, pp.ids, pp.fusion_groups,
                                                              pp.concat_groups))


def _namer(pid: str) -> Callable[[Point], str]:
    return lambda pt: pt[1] if pt[0] == pid else f"{pt[0]}:{pt[1]}"


class VisitMoves:
    """One visit: its attr for the sampler, its moves (the engine's list), and the whole-model
    schemes of a trial with this pattern's scheme and its partner's points."""

    def __init__(self, pid: str, standing: Schemes, attr: dict, engine: Visit) -> None:
        self.pid = pid
        self.standing = standing
        self.attr = attr
        self.engine = engine
        self.moves, self.dropped = engine.moves()

    def partner(self, foreign: Mapping[str, int]) -> dict[str, dict[str, int]]:
        """Foreign points (``P005:<point>`` -> choice) as a partner (pattern -> points)."""
        out: dict[str, dict[str, int]] = {}
        for name, v in foreign.items():
            p, _, q = name.partition(":")
            out.setdefault(p, {})[q] = int(v)
        return out

    def own_and_partner(self, values: Mapping) -> tuple[dict, dict | None]:
        """A sampler's scheme (own points and ``P005:<point>`` ones) split."""
        own = {k: v for k, v in values.items() if ":" not in k}
        foreign = {k: v for k, v in values.items() if ":" in k}
        return own, (self.partner(foreign) or None)

    def schemes(self, own: Mapping[str, int], partner: Mapping | None) -> Schemes:
        """The whole model's schemes with this pattern at ``own`` and ``partner``'s points."""
        out = {p: dict(s) for p, s in self.standing.items()}
        out[self.pid] = dict(own)
        for p, points in (partner or {}).items():
            out[p].update({q: int(v) for q, v in points.items()})
        return out

    def split(self, schemes: Schemes) -> tuple[dict[str, int], dict[str, dict[str, int]]]:
        """This pattern's scheme, and the other patterns' points that differ from standing."""
        partner = {}
        for p, scheme in schemes.items():
            if p == self.pid:
                continue
            changed = {q: v for q, v in scheme.items() if self.standing[p].get(q, 0) != v}
            if changed:
                partner[p] = changed
        return dict(schemes[self.pid]), partner


def trial_move(trial: optuna.Trial, sampler, visit: VisitMoves,
               others_running: Callable[[], bool]) -> dict | None:
    """The trial's partner points: of the move our ``sampler`` proposes for it now (its kind,
    place and signature become the trial's user attrs), else of its queued attrs. No move
    left: ``others_running()`` waits for the other workers' trials (another's may still change
    the best); when none runs the study stops; the trial is given up either way."""
    _ = trial.relative_params  # our sampler proposes the trial's scheme now
    move = sampler.proposed_move(trial.number)
    if move is None:  # a queued scheme: the start, or a redo
        return trial.user_attrs.get(TrialAttr.PARTNER)
    if move["kind"] is None:
        trial.set_user_attr(TrialAttr.SKIPPED, "the visit's moves are done")
        if not others_running():
            trial.study.stop()
        raise optuna.TrialPruned("the visit's moves are done")
    partner = visit.partner(move["foreign"]) or None
    trial.set_user_attr(TrialAttr.MOVE, move["kind"])
    trial.set_user_attr(TrialAttr.MOVE_INDEX, move["index"])
    trial.set_user_attr(TrialAttr.MOVE_SIGNATURE, move["signature"])
    if partner:
        trial.set_user_attr(TrialAttr.PARTNER, partner)
    return partner
