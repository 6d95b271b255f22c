"""A pattern's Q/DQ scheme and its forms.

A *scheme* gives every insertion point of a pattern a choice: 0 (no Q/DQ) or the index of a
quant type. The search meets it in four forms, all converted here:

* **params**: a trial's parameter values (indices for our sampler, type names for samplers
  with categorical parameters in mixed precision);
* **indices**: point -> choice index, as study attrs store it (``committed``);
* **points on**: the ids of the points with Q/DQ (reports, ``state.yaml``, the pattern cache);
* **typed uses**: tensor use -> quant type on every member region, what the exporter plans.

A pattern is always placed between the committed schemes of the other patterns (its
:data:`Around`); where two patterns cover one use, the earlier pattern's type stands, as in the
final model.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import optuna

from qdq_optuna.model.graph import Use
from qdq_optuna.placement.points import NODE_INPUT, PatternPoints
from qdq_optuna.placement.rules import WEIGHTED_OPS

#: the name of choice 0: no Q/DQ at the point
NONE = "none"

#: the committed uses (-> quant type) of the patterns before one pattern and after it
Around = tuple[dict[Use, str], dict[Use, str]]


def combine(base: Mapping[Use, str], typed: Mapping[Use, str]) -> dict[Use, str]:
    """A pattern's uses on top of the committed ones. A use an earlier pattern committed keeps
    its type (a region-output point and the next pattern's input point can cover the same
    use): commits are never changed by later patterns, as with on/off schemes."""
    return {**typed, **base}


@dataclass(frozen=True)
class Drawn:
    """One trial's scheme in every form the objective needs."""

    params: dict[str, object]
    #: the points with Q/DQ
    on: list[str]
    #: point -> quant type, for the points that are on (mixed precision only; else empty)
    types: dict[str, str]
    #: the typed uses of the whole model: this scheme placed between the others
    uses: dict[Use, str]
    #: tensors this scheme quantizes (over every member region)
    tensors: list[str]
    #: the space is mixed precision (``types`` is then worth storing)
    mixed: bool


@dataclass(frozen=True)
class ChoiceSpace:
    """The values one insertion point can take: ``none`` then quant types.

    ``categorical`` samplers get the names; ours gets indices. Either way
    :meth:`index` turns a trial's parameter value into the index (0 = no Q/DQ).
    """

    types: tuple[str, ...]
    categorical: bool = False

    @property
    def names(self) -> tuple[str, ...]:
        return (NONE, *self.types)

    @property
    def n(self) -> int:
        return len(self.names)

    @property
    def mixed(self) -> bool:
        return len(self.types) > 1

    def suggest(self, trial: optuna.Trial, pid: str) -> int:
        if self.categorical and self.mixed:
            return self.names.index(trial.suggest_categorical(pid, list(self.names)))
        return int(trial.suggest_int(pid, 0, self.n - 1))

    def index(self, value) -> int:
        if isinstance(value, str):
            if value not in self.names:
                raise ValueError(f"unknown precision choice {value!r} (choices {self.names})")
            return self.names.index(value)
        i = int(value)
        if not 0 <= i < self.n:
            raise ValueError(f"precision choice {i} outside 0..{self.n - 1}")
        return i

    def indices(self, params: Mapping[str, object], ids: Iterable[str]) -> dict[str, int]:
        """Index per point; a point missing from ``params`` is off."""
        return {pid: self.index(params[pid]) if pid in params else 0 for pid in ids}

    def value(self, index: int):
        """The parameter value a sampler of this space uses for ``index`` (seeds)."""
        return self.names[index] if self.categorical and self.mixed else int(index)

    def params(self, scheme: Mapping[str, object], ids: Iterable[str]) -> dict:
        """A stored scheme (indices) as the parameters a trial of this space takes."""
        return {pid: self.value(i) for pid, i in self.indices(scheme, ids).items()}

    def seed(self, params01: Mapping[str, int]) -> dict:
        """An on/off seed (pattern cache, Q/DQ baseline, empty scheme) in this space: on is the
        first (default) quant type."""
        return {pid: self.value(1 if v else 0) for pid, v in params01.items()}

    def typed_uses(self, pp: PatternPoints, params: Mapping[str, object]) -> dict[Use, str]:
        """Covered uses -> quant type. Points are applied in the pattern's point order; a use
        that two points cover with different types keeps the first point's type."""
        out: dict[Use, str] = {}
        for pid in pp.ids:
            i = self.index(params[pid]) if pid in params else 0
            if i == 0:
                continue
            for use in pp.uses([pid]):
                out.setdefault(use, self.types[i - 1])
        return out

    def placed(self, around: Around, pp: PatternPoints, params: Mapping[str, object]) -> dict:
        """The uses (-> quant type) of ``params`` for pattern ``pp`` between the committed uses
        of the patterns before it and after it."""
        before, after = around
        uses = combine(before, self.typed_uses(pp, params))
        return combine(uses, after) if after else uses

    def draw(self, trial: optuna.Trial, pp: PatternPoints, around: Around) -> Drawn:
        """Suggest every point of ``pp`` for ``trial`` and place the scheme in ``around``."""
        params = {pid: self.suggest(trial, pid) for pid in pp.ids}
        on = [p for p, v in params.items() if v]
        return Drawn(params=params, on=on, types=self.describe(params) if self.mixed else {},
                     uses=self.placed(around, pp, params),
                     tensors=sorted({u[0] for u in pp.uses(on)}), mixed=self.mixed)

    def on(self, params: Mapping[str, object]) -> list[str]:
        return [p for p, v in params.items() if self.index(v) != 0]

    def describe(self, params: Mapping[str, object]) -> dict[str, str]:
        """Point -> chosen quant type, for points that are on."""
        return {p: self.names[self.index(v)] for p, v in params.items() if self.index(v) != 0}


# -- schemes of their own ------------------------------------------------------------------------
def compute_inputs_scheme(pp: PatternPoints) -> dict[str, int] | None:
    """The classic post-training recipe as one scheme: Q/DQ on the activation inputs of the
    pattern's Conv / Gemm / MatMul nodes only; None when that is no scheme of its own (no such
    input, or every point is one)."""
    on = {p.id for p in pp.points if p.kind == NODE_INPUT and p.label in WEIGHTED_OPS}
    if not on or len(on) == len(pp.ids):
        return None
    return {pid: int(pid in on) for pid in pp.ids}


def quantized_uses(plan) -> set[tuple]:
    """(tensor, consumer, slot, type) of every activation use that reads through Q/DQ in an
    exported plan (:class:`~qdq_optuna.placement.export.QuantPlan`)."""
    return {(t, n, s, q) for t, consumers, q in plan.activations for n, s in consumers}


def distinct_schemes(space: ChoiceSpace, pp: PatternPoints, around: Around,
                     plan_key: Callable[[dict], str]) -> int | None:
    """How many different models the schemes of ``pp`` build in ``around`` (None: too many
    schemes to count). ``plan_key`` maps typed uses to the exported model's key."""
    if space.n ** len(pp.ids) > 1024:
        return None
    keys = set()
    for bits in itertools.product(range(space.n), repeat=len(pp.ids)):
        keys.add(plan_key(space.placed(around, pp, dict(zip(pp.ids, bits)))))
    return len(keys)


class Neighbourhood:
    """The tensors near each pattern's regions: those its nodes, or the nodes next to them,
    read or write. A pattern whose neighbourhood carries the same Q/DQ as when it was last
    tuned has nothing new to find in a refinement round."""

    def __init__(self, prepared) -> None:
        self.prepared = prepared
        self._near: dict[str, set[str]] = {}

    def tensors(self, pp: PatternPoints) -> set[str]:
        if pp.pattern.id not in self._near:
            g = self.prepared.graph
            nodes = {n for r in pp.pattern.regions for n in self.prepared.tree[r].all_nodes}

            def tensors_of(idxs) -> set[str]:
                return {t for i in idxs for t in (*g.nodes[i].input, *g.nodes[i].output) if t}

            first = tensors_of(nodes)
            hop = {g.producer[t][0] for t in first if t in g.producer}
            hop |= {c for t in first for c, _ in g.consumers.get(t, [])}
            self._near[pp.pattern.id] = tensors_of(nodes | hop)
        return self._near[pp.pattern.id]

    def key(self, pp: PatternPoints, around: Around) -> str:
        """A digest of the other patterns' Q/DQ on the tensors near ``pp``."""
        tensors = self.tensors(pp)
        others = combine(*around)
        items = sorted((list(u), q) for u, q in others.items() if u[0] in tensors)
        return hashlib.sha256(json.dumps(items).encode()).hexdigest()[:24]
