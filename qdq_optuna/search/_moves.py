"""What a visit of the descent tries: moves over the whole model, in expected-gain order.

A *move* switches some insertion points on and others off, points of any pattern. Its kinds
follow how runtimes fuse (``benchmarks/whole_model.py`` measured each of them):

* ``cache``: the pattern set to the best scheme the pattern cache knows for it;
* ``fusion``: a fusion group of the pattern all on, or all off;
* ``concat``: a Concat group (its inputs share one scale: all or nothing);
* ``chain``: every point, of this pattern and of its neighbours, that quantizes only one tensor
  the pattern reads or writes, on or off together: a producer's output pair and its consumers'
  input pairs are one Q/DQ pair, and the gain of INT8 on both sides needs both;
* ``single``: one point flipped.

Order: a move's *signature* says what it changes, Q/DQ added or removed between a producer op
and a consumer op (``on:Conv>Concat``). :class:`MoveStats` counts how often each signature
improved the standing model in this descent; moves are ordered by that rate (a signature not
seen yet counts as even odds), then by kind in the order above, then by the op-mix prior
(:func:`op_prior`). A signature that failed ``Config.skip_failed_moves`` times and never paid is
not tried again in this descent: on a YOLO-like model most offered points sit before ops that
never run INT8 (a SiLU's Mul, a Sigmoid), and trying each costs a measurement.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from qdq_optuna.placement.points import PatternPoints

#: (pattern id, point id)
Point = tuple[str, str]
#: pattern id -> scheme (point -> choice index, 0 = no Q/DQ)
Schemes = dict[str, dict[str, int]]
KINDS = ("cache", "fusion", "concat", "chain", "single")

#: ops that read INT8 on TensorRT-like runtimes and ONNX Runtime's QDQ kernels: Q/DQ in front
#: of them tends to pay
INT8_READERS = frozenset({"Conv", "ConvTranspose", "MatMul", "Gemm", "Concat", "MaxPool",
                          "AveragePool", "GlobalAveragePool", "Add", "Mul", "Resize", "Split"})
#: ops that run in float whatever their input: Q/DQ in front of them only costs
FLOAT_ONLY = frozenset({"Softmax", "LayerNormalization", "Erf", "Div", "Sqrt", "Pow",
                        "ReduceMean", "Exp", "Sigmoid"})


@dataclass(frozen=True)
class Move:
    kind: str
    on: frozenset[Point]
    off: frozenset[Point]
    #: sorted ``on:Producer>Consumer`` / ``off:...`` strings
    signature: tuple[str, ...]
    prior: float = 0.0

    def apply(self, schemes: Schemes) -> Schemes:
        """The whole-model schemes after the move (a point switched on takes the first type)."""
        out = {p: dict(s) for p, s in schemes.items()}
        for p, q in self.off:
            out[p][q] = 0
        for p, q in self.on:
            if not out[p].get(q):
                out[p][q] = 1
        return out


class MoveStats:
    """How often each move signature improved the standing model in one descent."""

    def __init__(self, give_up_after: int) -> None:
        self.give_up_after = give_up_after
        self.tried: Counter[str] = Counter()
        self.paid: Counter[str] = Counter()

    def tell(self, signature: Iterable[str], improved: bool) -> None:
        key = _key(signature)
        self.tried[key] += 1
        self.paid[key] += bool(improved)

    def rate(self, signature: Iterable[str]) -> float:
        key = _key(signature)
        return (self.paid[key] + 1) / (self.tried[key] + 2)

    def plus(self, outcomes: Iterable[tuple[Iterable[str], bool]]) -> MoveStats:
        """A copy with more outcomes counted."""
        out = MoveStats(self.give_up_after)
        out.tried, out.paid = Counter(self.tried), Counter(self.paid)
        for signature, improved in outcomes:
            out.tell(signature, improved)
        return out

    def hopeless(self, signature: Iterable[str]) -> bool:
        key = _key(signature)
        return bool(self.give_up_after) and not self.paid[key] and \
            self.tried[key] >= self.give_up_after


def _key(signature: Iterable[str]) -> str:
    return "|".join(signature)


def op_prior(on_ops: Iterable[str], off_ops: Iterable[str]) -> float:
    """Expected gain of a move from the op mix alone: Q/DQ added before ops that read INT8,
    or removed before ops that run in float, first."""
    score = 0.0
    for op in on_ops:
        score += 1.0 if op in INT8_READERS else (-1.0 if op in FLOAT_ONLY else 0.0)
    for op in off_ops:
        score += 1.0 if op in FLOAT_ONLY else (-0.5 if op in INT8_READERS else 0.25)
    return score


def chain_groups(uses_of: dict[Point, frozenset]) -> list[frozenset[Point]]:
    """The chains: per tensor, the points (of any pattern) that quantize only that tensor,
    when they belong to more than one pattern (a producer's output pair and its consumers'
    input pairs are one Q/DQ pair). ``uses_of``: point -> the uses it quantizes."""
    by_tensor: dict[str, set[Point]] = {}
    for pt, uses in uses_of.items():
        tensors = {u[0] for u in uses}
        if len(tensors) == 1:
            by_tensor.setdefault(next(iter(tensors)), set()).add(pt)
    return [frozenset(pts) for _, pts in sorted(by_tensor.items())
            if len({p for p, _ in pts}) > 1]


class MoveSpace:
    """Every point of every pattern, and the moves a visit of one pattern tries."""

    def __init__(self, prepared) -> None:
        self.graph = prepared.graph
        self.tunable: list[PatternPoints] = prepared.tunable
        self.uses_of: dict[Point, frozenset] = {
            (pp.pattern.id, pid): frozenset(pp.uses([pid]))
            for pp in self.tunable for pid in pp.ids}
        self.fusion = {pp.pattern.id: [frozenset((pp.pattern.id, q) for q in g)
                                       for g in pp.fusion_groups] for pp in self.tunable}
        self.concat = {pp.pattern.id: [frozenset((pp.pattern.id, q) for q in g)
                                       for g in pp.concat_groups] for pp in self.tunable}
        self.chains = chain_groups(self.uses_of)

    def signature(self, on: Iterable[Point], off: Iterable[Point]) -> tuple[tuple[str, ...],
                                                                           float]:
        g = self.graph
        items, ops = set(), {"on": [], "off": []}
        for direction, points in (("on", on), ("off", off)):
            for pt in points:
                for tensor, node, _ in self.uses_of[pt]:
                    consumer = g.nodes[node].op_type
                    items.add(f"{direction}:{g.producer_op(tensor) or 'input'}>{consumer}")
                    ops[direction].append(consumer)
        return tuple(sorted(items)), op_prior(ops["on"], ops["off"])

    def _move(self, kind: str, on: Iterable[Point], off: Iterable[Point]) -> Move:
        on, off = frozenset(on), frozenset(off)
        signature, prior = self.signature(on, off)
        return Move(kind, on, off, signature, prior)

    def _groups(self, kind: str, groups: Iterable[frozenset[Point]],
                state: frozenset[Point]) -> list[Move]:
        moves = []
        for group in groups:
            if not group <= state:
                moves.append(self._move(kind, group - state, ()))
            if group & state:
                moves.append(self._move(kind, (), group & state))
        return moves

    def moves(self, pid: str, schemes: Mapping[str, Mapping[str, int]], stats: MoveStats,
              cached: Mapping[str, int] | None = None) -> list[Move]:
        """A visit's moves for pattern ``pid`` from the standing ``schemes``, best first; no
        duplicates, none that changes nothing (see the module docstring for the order)."""
        state = frozenset((p, q) for p, s in schemes.items() for q, v in s.items() if v)
        mine = {pt for pt in self.uses_of if pt[0] == pid}
        by_kind: dict[str, list[Move]] = {
            "cache": [],
            "fusion": self._groups("fusion", self.fusion.get(pid, []), state),
            "concat": self._groups("concat", self.concat.get(pid, []), state),
            "chain": self._groups("chain", [c for c in self.chains if c & mine], state),
            "single": [self._move("single", (), [pt]) if pt in state
                       else self._move("single", [pt], ()) for pt in sorted(mine)],
        }
        if cached:
            want = {(pid, q) for q, v in cached.items() if v}
            by_kind["cache"] = [self._move("cache", want - state, (mine & state) - want)]
        moves, seen = [], set()
        for rank, kind in enumerate(KINDS):
            for m in sorted(by_kind[kind], key=lambda m: -m.prior):
                if (m.on or m.off) and (m.on, m.off) not in seen:
                    seen.add((m.on, m.off))
                    moves.append((rank, m))
        # stable: the learned rate first, then kind, then the prior (the order above)
        moves.sort(key=lambda rm: (-stats.rate(rm[1].signature), rm[0]))
        return [m for _, m in moves]


class MoveQueue:
    """A visit's moves, handed out one at a time as its trials finish: each move is applied
    to the visit's best state when it is taken (first improvement), once, in list order. What
    was taken is read back from the study's trials (``move_index``), so a resumed process or
    another worker continues the same list."""

    def __init__(self, pid: str, standing: Schemes, moves: list[Move], stats: MoveStats,
                 space) -> None:
        self.pid = pid
        self.standing = standing
        self.moves = moves
        self.stats = stats
        self.space = space
        #: moves passed over because their signature never paid (this process's count)
        self.skipped = 0

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

    def next(self, taken_index: int, best: Schemes, taken_keys: set[str], improved: list,
             plan_key) -> tuple[int, Move, dict, dict, str] | None:
        """The next move after ``taken_index`` that changes ``best`` into a model not taken
        yet and whose kind has not failed for good; ``improved``: (signature, improved) of the
        visit's finished moves (counted with the descent's earlier ones);
        ``plan_key(own, partner)`` names the model. None: the list is done."""
        stats = self.stats.plus(improved)
        for i in range(taken_index + 1, len(self.moves)):
            move = self.moves[i]
            if stats.hopeless(move.signature):
                self.skipped += 1
                continue
            cand = move.apply(best)
            if cand == best:
                continue
            own, partner = self.split(cand)
            key = plan_key(own, partner)
            if key in taken_keys:
                continue
            return i, move, own, partner, key
        return None
