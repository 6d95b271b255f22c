"""The move engine of a *visit*: one pattern's study tuned against a standing whole-model scheme.

A visit's study carries the user attr :data:`VISIT_ATTR` (written by whoever runs the descent,
e.g. qdq_optuna's search) that says where the visit starts and what the sampler may know:

* ``standing``: the pattern's standing scheme (point -> choice index, 0 = no Q/DQ);
* ``foreign``: the standing choice of other patterns' points that a chain reaches (opaque
  names, e.g. ``P005:n3.Mul.in0``); a move may set them too (a chain: a producer's output pair
  and its consumers' input pairs are one Q/DQ pair);
* ``edges``: per point (own or foreign), one ``[producer op, consumer op]`` per tensor use it
  quantizes (what a move's *signature* is made of);
* ``chains``: groups of points (own and foreign) switched on or off together;
* ``cache``: a scheme a pattern cache knows for the pattern, or None;
* ``taught``: ``{signature: [tried, paid]}``, what earlier visits' moves taught;
* ``give_up_after``: a signature tried that often without paying is not tried again (0: never);
* ``prior``: ``{signature: [tried, paid]}`` from earlier descents (lanes) from other starts:
  one that never paid there is given up sooner (:meth:`MoveStats.need`); optional;
* ``sites``: per point, the tensors where removing its Q/DQ may still win by the runtime's
  report, with their activation elements (-1: never too small); empty: the runtime fused it.
  A move that only switches off points with no site is not proposed (``fused``), nor, with
  ``min_share`` and ``total``, one whose sites hold less than ``min_share`` of the ``total``
  activation elements (``too small`` to measure). None: no report.
* ``settled``: points where a Q/DQ pair can change no layer's precision by the report (every
  neighbour already ran integer); a move that only switches such points on (and fused ones
  off) is not proposed (``integer``). None: the report cannot tell.
* ``added``: per point, the activation elements a pair added there can save work on (-1:
  unbounded, e.g. a convolution next to it may change precision); with ``min_share``, a move
  whose additions hold less is ``too small`` too. None: additions are never dropped for size.
* ``gains``: per point, the ms removing its Q/DQ saves by a measured kernel table (the
  integer kernel next to it measured slower than its float one); optional. A move that only
  switches such points off goes first, by its summed gain, and the first of all is ``kernel``:
  every such point of the visit off at once (the table's recommendation in one measurement).
* ``add_gains``: per point, the ms switching its Q/DQ on can save by the kernel table (a node
  next to it whose integer kernel measured faster than its float one: a Conv, and where the
  runtime has them a MaxPool, Concat, Add, ...); optional. A move that only switches points
  on is ordered by their summed gain, as the removals by theirs.

The fusion and Concat groups come from the study's ``qdq_fusion_groups`` /
``qdq_concat_groups``.

A *move* switches some points on and others off: ``kernel`` (see ``gains``), ``cache`` (the
cached scheme), ``fusion`` (a fusion group all on or all off), ``concat`` (a Concat group: its
inputs share one scale), ``chain``, ``single`` (one point flipped). Order: a move's signature
says what it changes (Q/DQ added or removed between a producer op and a consumer op,
``on:Conv>Concat``); moves are ordered by their measured kernel gain (``gains``), then by the rate at which their signature improved the standing model so far (a signature
not seen yet counts as even odds), then by kind in the order above, then by the op-mix prior
(:func:`op_prior`). The visit walks the list once (first improvement): each move is applied
to the visit's best scheme so far when it is proposed; moves that change nothing, build a
model already tried, or whose signature failed ``give_up_after`` times (counting this visit's
outcomes) are passed over. When the list is done the visit is over.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from optuna.trial import FrozenTrial, TrialState

VISIT_ATTR = "qdq_visit"
#: trial user attrs the engine reads (the objective writes them): the trial beat the visit's
#: best so far; how many Q/DQ pairs its model has (fewer wins a tie); a failure that may pass
IMPROVED_KEY = "improved"
QDQ_COUNT_KEY = "qdq_count"
TRANSIENT_KEY = "transient"
#: a trial that stepped back because another worker measures the same model (at the same
#: time both may: the move is then proposed again)
DUPLICATE_OF_KEY = "duplicate_of"
#: trial system attr: the visit's move a trial measures (kind, index, signature, foreign
#: points it sets); ``{"kind": None}``: the visit had no move left when the trial was asked
VISIT_MOVE_KEY = "qdq:visit_move"

KINDS = ("kernel", "cache", "fusion", "concat", "chain", "single")

#: ops that read INT8 on TensorRT-like runtimes and ONNX Runtime's QDQ kernels: Q/DQ in front
#: of them tends to pay
INT8_READERS = frozenset({"Conv", "ConvTranspose", "MatMul", "Gemm", "Concat", "MaxPool",
                          "AveragePool", "GlobalAveragePool", "Add", "Mul", "Resize", "Split"})
#: ops that run in float whatever their input: Q/DQ in front of them only costs
FLOAT_ONLY = frozenset({"Softmax", "LayerNormalization", "Erf", "Div", "Sqrt", "Pow",
                        "ReduceMean", "Exp", "Sigmoid"})
#: a signature that failed in earlier lanes (``prior``; qdq_optuna's search counts only clear
#: losses there) and never paid there is given up one failure sooner per this many failures
#: there: on the YOLO-like zoo model about 25 signatures failed 3 times from float and 3 more
#: from the recipe (77 of the recipe lane's 92 measurements); giving them up after 1 recipe
#: failure lost gains (``on:Add>Concat|on:Split>Concat`` paid at its second)
PRIOR_FAILURES_PER_TRY = 3
#: ... but never before it failed this often in the lane itself
MIN_OWN_FAILURES = 2


def op_prior(on_ops: Iterable[str], off_ops: Iterable[str]) -> float:
    """Expected gain of a move from the op mix alone: Q/DQ added before ops that read INT8,
    or removed before ops that run in float, first."""
    score = 0.0
    for op in on_ops:
        score += 1.0 if op in INT8_READERS else (-1.0 if op in FLOAT_ONLY else 0.0)
    for op in off_ops:
        score += 1.0 if op in FLOAT_ONLY else (-0.5 if op in INT8_READERS else 0.25)
    return score


@dataclass(frozen=True)
class Move:
    kind: str
    on: frozenset[str]
    off: frozenset[str]
    #: sorted ``on:Producer>Consumer`` / ``off:...`` strings
    signature: tuple[str, ...]
    prior: float = 0.0

    def apply(self, scheme: Mapping[str, int]) -> dict[str, int]:
        """The scheme after the move (a point switched on takes the first type)."""
        out = dict(scheme)
        for p in self.off:
            out[p] = 0
        for p in self.on:
            if not out.get(p):
                out[p] = 1
        return out


class MoveStats:
    """How often each move signature improved the standing model (one descent lane), and what
    earlier lanes learnt (``prior``: ``{signature: [tried, paid]}``, see :meth:`need`)."""

    def __init__(self, give_up_after: int,
                 prior: Mapping[str, Sequence[int]] | None = None) -> None:
        self.give_up_after = give_up_after
        self.tried: Counter[str] = Counter()
        self.paid: Counter[str] = Counter()
        self.prior = {k: (int(t), int(p)) for k, (t, p) in (prior or {}).items()}

    def tell(self, signature: Iterable[str], improved: bool) -> None:
        key = _key(signature)
        self.tried[key] += 1
        self.paid[key] += bool(improved)

    def rate(self, signature: Iterable[str]) -> float:
        key = _key(signature)
        return (self.paid[key] + 1) / (self.tried[key] + 2)

    def plus(self, outcomes: Iterable[tuple[Iterable[str], bool]]) -> MoveStats:
        """A copy with more outcomes counted."""
        out = MoveStats(self.give_up_after, self.prior)
        out.tried, out.paid = Counter(self.tried), Counter(self.paid)
        for signature, improved in outcomes:
            out.tell(signature, improved)
        return out

    def need(self, key: str) -> int:
        """Failures in this lane that give a signature up: ``give_up_after``, less one per
        ``PRIOR_FAILURES_PER_TRY`` failures in earlier lanes where it never paid (evidence
        from another start counts for less: a move's worth depends on its neighbours'
        Q/DQ), but at least ``MIN_OWN_FAILURES`` (the lane's own start gets its say)."""
        tried, paid = self.prior.get(key, (0, 0))
        if paid or not tried:
            return self.give_up_after
        return max(MIN_OWN_FAILURES, self.give_up_after - tried // PRIOR_FAILURES_PER_TRY)

    def hopeless(self, signature: Iterable[str]) -> bool:
        key = _key(signature)
        return bool(self.give_up_after) and not self.paid[key] and \
            self.tried[key] >= self.need(key)

    def to_attr(self) -> dict[str, list[int]]:
        """``{signature: [tried, paid]}`` (the ``taught`` of a visit attr)."""
        return {k: [n, self.paid[k]] for k, n in sorted(self.tried.items()) if n}

    def prior_attr(self) -> dict[str, list[int]]:
        """``prior`` as a visit attr (``{signature: [tried, paid]}``)."""
        return {k: list(v) for k, v in sorted(self.prior.items())}

    @classmethod
    def from_attr(cls, taught: Mapping[str, Sequence[int]], give_up_after: int,
                  prior: Mapping[str, Sequence[int]] | None = None) -> MoveStats:
        out = cls(give_up_after, prior)
        for key, (tried, paid) in taught.items():
            out.tried[key], out.paid[key] = int(tried), int(paid)
        return out


def _key(signature: Iterable[str]) -> str:
    return "|".join(signature)


@dataclass(frozen=True)
class Next:
    """The visit's next move (None: the list is done), and the moves passed over as hopeless."""

    index: int
    move: Move | None
    own: dict[str, int]
    foreign: dict[str, int]
    parent: int | None
    skipped: int


@dataclass(frozen=True)
class VisitSpec:
    """A visit as the descent describes it and the engine reads it: the fields of
    :data:`VISIT_ATTR` (see the module docstring), written with :meth:`to_attr` and read
    with :meth:`from_attr` on both sides of the study."""

    standing: dict[str, int]
    foreign: dict[str, int] = field(default_factory=dict)
    edges: dict[str, list[list[str]]] = field(default_factory=dict)
    chains: list[list[str]] = field(default_factory=list)
    cache: dict[str, int] | None = None
    taught: dict[str, list[int]] = field(default_factory=dict)
    give_up_after: int = 0
    sites: dict[str, dict[str, int]] | None = None
    settled: list[str] | None = None
    added: dict[str, int] | None = None
    #: with ``total``: the share of activation elements a move must touch (None: any)
    min_share: float | None = None
    total: int | None = None
    prior: dict[str, list[int]] | None = None
    #: the ms the kernel table says switching each point off saves (points with a gain only)
    gains: dict[str, float] | None = None
    #: the ms the kernel table says switching each point on can save (points with one only)
    add_gains: dict[str, float] | None = None

    def to_attr(self) -> dict[str, Any]:
        """The study attr (``min_share``/``total`` and ``prior`` only when set)."""
        attr: dict[str, Any] = {
            "standing": self.standing, "foreign": self.foreign, "edges": self.edges,
            "chains": self.chains, "cache": self.cache, "taught": self.taught,
            "give_up_after": self.give_up_after, "sites": self.sites,
            "settled": self.settled, "added": self.added}
        if self.min_share is not None or self.total is not None:
            attr.update(min_share=self.min_share, total=self.total)
        if self.prior:
            attr["prior"] = self.prior
        if self.gains:
            attr["gains"] = self.gains
        if self.add_gains:
            attr["add_gains"] = self.add_gains
        return attr

    @classmethod
    def from_attr(cls, attr: Mapping[str, Any]) -> VisitSpec:
        """A stored visit attr read back (absent keys take their defaults)."""
        sites, settled, added = attr.get("sites"), attr.get("settled"), attr.get("added")
        return cls(
            standing=dict(attr.get("standing") or {}),
            foreign={str(p): int(v) for p, v in (attr.get("foreign") or {}).items()},
            edges={str(p): [list(e) for e in es] for p, es in (attr.get("edges") or {}).items()},
            chains=[list(c) for c in attr.get("chains") or []],
            cache=attr.get("cache"), taught=dict(attr.get("taught") or {}),
            give_up_after=int(attr.get("give_up_after", 0)),
            sites=None if sites is None else {str(p): dict(t) for p, t in sites.items()},
            settled=None if settled is None else [str(p) for p in settled],
            added=None if added is None else {str(p): int(n) for p, n in added.items()},
            min_share=attr.get("min_share"), total=attr.get("total"),
            prior=attr.get("prior"),
            gains={str(p): float(g) for p, g in (attr.get("gains") or {}).items()} or None,
            add_gains={str(p): float(g) for p, g in (attr.get("add_gains") or {}).items()}
            or None)


class Visit:
    """A visit as its study describes it (see the module docstring)."""

    def __init__(self, spec: VisitSpec | Mapping[str, Any], points: Sequence[str],
                 fusion_groups: Sequence[Sequence[str]] = (),
                 concat_groups: Sequence[Sequence[str]] = ()) -> None:
        if not isinstance(spec, VisitSpec):  # a stored attr
            spec = VisitSpec.from_attr(spec)
        self.points = list(points)
        own = spec.standing
        self.own_standing = {p: int(own.get(p, 0)) for p in self.points}
        self.foreign_standing = dict(spec.foreign)
        self.standing = {**self.own_standing, **self.foreign_standing}
        self.edges = {p: [tuple(e) for e in es] for p, es in spec.edges.items()}
        self.chains = [frozenset(c) for c in spec.chains]
        self.cache = spec.cache
        self.stats = MoveStats.from_attr(spec.taught, spec.give_up_after, spec.prior)
        self.sites = None if spec.sites is None else {p: dict(t) for p, t in spec.sites.items()}
        self.settled = None if spec.settled is None else frozenset(spec.settled)
        self.added = None if spec.added is None else dict(spec.added)
        self.min_share = spec.min_share
        self.total = spec.total or 0
        self.gains = dict(spec.gains or {})
        self.add_gains = dict(spec.add_gains or {})
        self.fusion = [frozenset(g) for g in fusion_groups]
        self.concat = [frozenset(g) for g in concat_groups]
        self._moves: tuple[list[Move], dict[str, int]] | None = None

    @classmethod
    def of(cls, user_attrs: Mapping[str, Any]) -> Visit | None:
        """The visit a study's user attrs describe (None: not a visit)."""
        attr = user_attrs.get(VISIT_ATTR)
        points = user_attrs.get("qdq_points")
        if not isinstance(attr, dict) or not isinstance(points, list):
            return None
        return cls(attr, points, user_attrs.get("qdq_fusion_groups") or (),
                   user_attrs.get("qdq_concat_groups") or ())

    # -- the list ----------------------------------------------------------------------------
    def signature(self, on: Iterable[str], off: Iterable[str]) -> tuple[tuple[str, ...], float]:
        items, ops = set(), {"on": [], "off": []}
        for direction, points in (("on", on), ("off", off)):
            for pt in points:
                for producer, consumer in self.edges.get(pt, ()):
                    items.add(f"{direction}:{producer}>{consumer}")
                    ops[direction].append(consumer)
        return tuple(sorted(items)), op_prior(ops["on"], ops["off"])

    def _move(self, kind: str, on: Iterable[str], off: Iterable[str]) -> Move:
        on, off = frozenset(on), frozenset(off)
        signature, prior = self.signature(on, off)
        return Move(kind, on, off, signature, prior)

    def _groups(self, kind: str, groups: Iterable[frozenset[str]],
                state: frozenset[str]) -> list[Move]:
        moves = []
        for group in groups:
            if not group <= state:
                moves.append(self._move(kind, group - state, ()))
            if group & state:
                moves.append(self._move(kind, (), group & state))
        return moves

    def all_moves(self) -> list[Move]:
        """Every move from the standing scheme, best first; no duplicates, none that changes
        nothing, before the runtime's report prunes any."""
        state = frozenset(p for p, v in self.standing.items() if v)
        mine = frozenset(self.points)
        gained = frozenset(p for p in state if self.gains.get(p, 0) > 0)
        by_kind: dict[str, list[Move]] = {
            "kernel": [self._move("kernel", (), gained)] if gained else [],
            "cache": [],
            "fusion": self._groups("fusion", self.fusion, state),
            "concat": self._groups("concat", self.concat, state),
            "chain": self._groups("chain", [c for c in self.chains if c & mine], state),
            "single": [self._move("single", (), [pt]) if pt in state
                       else self._move("single", [pt], ()) for pt in sorted(mine)],
        }
        if self.cache:
            want = {q for q, v in self.cache.items() if v}
            by_kind["cache"] = [self._move("cache", want - state, (mine & state) - want)]
        moves, seen = [], set()
        for rank, kind in enumerate(KINDS):
            for m in sorted(by_kind[kind], key=lambda m: -m.prior):
                if (m.on or m.off) and (m.on, m.off) not in seen:
                    seen.add((m.on, m.off))
                    moves.append((rank, m))
        # stable: a removal or an addition the kernel table says gains first (by its gain),
        # then the learned rate, then kind, then the prior (the order above)
        moves.sort(key=lambda rm: (-self.gain(rm[1]), -self.stats.rate(rm[1].signature),
                                   rm[0]))
        return [m for _, m in moves]

    def gain(self, move: Move) -> float:
        """The measured kernel gain of a move that only switches points off, or only on (0
        otherwise)."""
        if move.on and not move.off:
            return sum(self.add_gains.get(p, 0.0) for p in move.on)
        if move.on or not self.gains:
            return 0.0
        return sum(self.gains.get(p, 0.0) for p in move.off)

    def why_not(self, move: Move) -> str | None:
        """Why the runtime's report says ``move`` cannot win (None: it may): both what it
        switches on and what it switches off must be unable to."""
        if self.sites is None:
            return None
        on = self._why_not_on(move.on) if move.on else None
        if move.on and on is None:
            return None
        off = self._why_not_off(move.off) if move.off else None
        if move.off and off is None:
            return None
        return on or off

    def _small(self, elements: Iterable[int]) -> bool:
        """Work under ``min_share`` of the ``total`` activation elements (-1: unbounded)."""
        elements = list(elements)
        return self.min_share is not None and bool(self.total) and \
            all(n >= 0 for n in elements) and sum(elements) / self.total < self.min_share

    def _why_not_on(self, on: frozenset[str]) -> str | None:
        settled = self.settled or frozenset()
        if on <= settled:
            return "integer"
        if self.added is not None and self._small(
                0 if p in settled else self.added.get(p, -1) for p in on):
            return "too small"
        return None

    def _why_not_off(self, off: frozenset[str]) -> str | None:
        found: dict[str, int] = {}
        for p in off:
            found.update(self.sites.get(p, {}))
        if not found:
            return "fused"
        return "too small" if self._small(found.values()) else None

    def moves(self) -> tuple[list[Move], dict[str, int]]:
        """The visit's moves in order, and how many the runtime's report dropped, by reason
        (``fused``, ``too small``, ``integer``)."""
        if self._moves is None:
            kept, dropped = [], Counter()
            for m in self.all_moves():
                why = self.why_not(m)
                if why is None:
                    kept.append(m)
                else:
                    dropped[why] += 1
            self._moves = (kept, dict(dropped))
        return self._moves

    # -- the walk ----------------------------------------------------------------------------
    def scheme_of(self, trial: FrozenTrial, known: Mapping[str, Any]) -> dict[str, int]:
        """A trial's whole scheme (own points from ``known``, foreign ones it set)."""
        out = dict(self.standing)
        out.update({p: int(known.get(p, 0)) for p in self.points})
        move = trial.system_attrs.get(VISIT_MOVE_KEY) or {}
        out.update({str(p): int(v) for p, v in (move.get("foreign") or {}).items()})
        return out

    def best(self, trials: Sequence[FrozenTrial]) -> FrozenTrial | None:
        """The visit's best finished trial: fastest, then fewer Q/DQ, then the earlier one
        (feasible trials only under constraints)."""
        done = [t for t in trials if t.state == TrialState.COMPLETE and t.values
                and all(v <= 0 for v in (t.constraints or {}).values())]
        return min(done, key=lambda t: (t.values[0], t.user_attrs.get(QDQ_COUNT_KEY, 0),
                                        t.number), default=None)

    def next(self, trials: Sequence[FrozenTrial],
             known: Callable[[FrozenTrial], Mapping[str, Any]],
             key: Callable[[FrozenTrial | None, dict[str, int], dict[str, int]], Hashable]
             ) -> Next:
        """The next move after the last one taken that changes the best scheme into a model
        not tried yet and whose signature is not hopeless. ``known(trial)``: the trial's own
        point values (empty: none yet); ``key(trial, own, foreign)``: the model's identity
        (``trial``: whose scheme it is, None for a candidate)."""
        moves, _ = self.moves()
        trials = [t for t in trials if t.user_attrs.get(DUPLICATE_OF_KEY) is None]
        records = [t.system_attrs.get(VISIT_MOVE_KEY) or {} for t in trials]
        taken = max((r["index"] for r in records if r.get("index") is not None), default=-1)
        keys = {key(None, dict(self.own_standing), {})}
        for t in trials:
            if t.state == TrialState.FAIL and t.user_attrs.get(TRANSIENT_KEY):
                continue
            values = known(t)
            if values:
                scheme = self.scheme_of(t, values)
                keys.add(key(t, *self._split(scheme)))
        best = self.best(trials)
        state = self.scheme_of(best, known(best)) if best is not None else dict(self.standing)
        stats = self.stats.plus(
            (r["signature"], bool(t.user_attrs.get(IMPROVED_KEY, False)))
            for t, r in zip(trials, records)
            if t.state == TrialState.COMPLETE and r.get("signature") is not None)
        skipped = 0
        parent = best.number if best is not None else None
        for i in range(taken + 1, len(moves)):
            move = moves[i]
            if stats.hopeless(move.signature):
                skipped += 1
                continue
            cand = move.apply(state)
            if cand == state:
                continue
            own, foreign = self._split(cand)
            if key(None, own, foreign) in keys:
                continue
            return Next(i, move, own, foreign, parent, skipped)
        return Next(len(moves), None, {}, {}, parent, skipped)

    def _split(self, scheme: Mapping[str, int]) -> tuple[dict[str, int], dict[str, int]]:
        """Own points, and the foreign points that differ from standing."""
        own = {p: scheme[p] for p in self.points}
        foreign = {p: v for p, v in scheme.items()
                   if p in self.foreign_standing and self.foreign_standing[p] != v}
        return own, foreign
