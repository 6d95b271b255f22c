"""Top-k mutation sampler for binary (or few-valued) Q/DQ placement schemes."""

from __future__ import annotations

import copy
import math
import zlib
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from optuna.distributions import BaseDistribution, IntDistribution
from optuna.samplers import BaseSampler, RandomSampler
from optuna.search_space import intersection_search_space
from optuna.study import Study, StudyDirection
from optuna.trial import FrozenTrial, TrialState

from ._visit import VISIT_MOVE_KEY, Next, Visit

POINTS_ATTR = "qdq_points"
NUM_CHOICES_ATTR = "qdq_num_choices"
CONCAT_GROUPS_ATTR = "qdq_concat_groups"
FUSION_GROUPS_ATTR = "qdq_fusion_groups"
POINT_USES_ATTR = "qdq_point_uses"
POINT_TENSORS_ATTR = "qdq_point_tensors"

ORIGIN_KEY = "qdq:origin"
PARENT_KEY = "qdq:parent"
MOVES_KEY = "qdq:moves"
DUPLICATE_KEY = "qdq:duplicate"
# "climb" (a one-move neighbour of a best scheme) or "explore" (the climb found no untried
# neighbour: random top-k mutations); absent on seeds and the first schemes.
PHASE_KEY = "qdq:phase"
# The proposed scheme is stored at sampling time so that other workers can de-duplicate against
# trials whose parameters have not been suggested yet.
SCHEME_KEY = "qdq:scheme"

_LIVE_STATES = (TrialState.COMPLETE, TrialState.RUNNING, TrialState.WAITING, TrialState.PRUNED)
_UINT64_MASK = (1 << 64) - 1

SchemeKey = Callable[[dict[str, int]], Hashable]


@dataclass(frozen=True)
class _Metadata:
    points: list[str] | None
    num_choices: int
    concat_groups: list[list[str]]
    fusion_groups: list[list[str]]
    point_uses: dict[str, list[int]] | None
    #: points that cover uses of one tensor (from ``qdq_point_tensors``; 2+ points each)
    tensor_groups: list[list[str]] = field(default_factory=list)


class _Space:
    """Integer parameters of the relative search space, as choice indices in canonical order."""

    def __init__(self, search_space: dict[str, BaseDistribution], points: list[str] | None):
        ints = {k: d for k, d in search_space.items() if isinstance(d, IntDistribution)}
        ordered = [p for p in points or [] if p in ints]
        seen = set(ordered)
        ordered += sorted(k for k in ints if k not in seen)
        self.names = ordered
        self.position = {name: i for i, name in enumerate(ordered)}
        self.dists = [ints[k] for k in ordered]
        self.n_choices = [(d.high - d.low) // d.step + 1 for d in self.dists]

    def __len__(self) -> int:
        return len(self.names)

    def values(self, scheme: Sequence[int]) -> dict[str, int]:
        return {name: int(d.low + i * d.step) for name, d, i in zip(self.names, self.dists, scheme)}

    def index(self, name: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
            return -1  # Foreign value (e.g. from a differently typed param): never "off".
        d = self.dists[self.position[name]]
        return int(round((value - d.low) / d.step))

    def known_values(self, trial: FrozenTrial) -> dict[str, Any]:
        """Scheme values of a trial, from its params, seed or recorded proposal."""
        merged: dict[str, Any] = {}
        for source in (
            trial.system_attrs.get(SCHEME_KEY),
            trial.system_attrs.get("fixed_params"),
            trial.params,
        ):
            if isinstance(source, dict):
                merged.update({k: v for k, v in source.items() if k in self.position})
        return merged

    def complete_values(self, known: dict[str, Any]) -> dict[str, Any]:
        # An unspecified point means "no Q/DQ", i.e. the lowest choice.
        return {name: known.get(name, d.low) for name, d in zip(self.names, self.dists)}

    def scheme_of(self, known: dict[str, Any]) -> tuple[int, ...]:
        scheme = []
        for name, n in zip(self.names, self.n_choices):
            i = self.index(name, known[name]) if name in known else 0
            scheme.append(min(max(i, 0), n - 1))
        return tuple(scheme)


def set_system_attrs(study: Study, trial: FrozenTrial, attrs: dict[str, Any]) -> None:
    """Write a running trial's system attrs from the sampler, as Optuna's own samplers do: the
    only place this package touches Optuna's storage internals (a sampler sees a
    FrozenTrial, which has no public setter)."""
    for key, value in attrs.items():
        study._storage.set_trial_system_attr(trial._trial_id, key, value)


class QDQMutationSampler(BaseSampler):
    """Top-k mutation sampler for Q/DQ placement with group moves and de-duplication.

    Latency over placements is needle-like: gains only appear when whole fusion or Concat
    groups are quantized. So the sampler seeds the empty and full schemes, climbs from the best
    scheme one move at a time (group moves first), and at a local optimum mutates the best
    schemes with single flips and atomic group moves, never re-proposing a scheme that
    yields an already known model. Study metadata comes from study user attrs so that all
    workers sharing a storage behave alike. See README.md for the attributes it reads.

    A study with the ``qdq_visit`` user attr is a visit of a descent: the sampler then
    proposes the visit's moves (its move engine, ``_visit.py``) in expected-gain order, each on
    the best scheme so far, and stops the study when none is left. ``scheme_key`` then also
    receives the other patterns' points a chain move sets (their ``qdq_visit`` names).

    Args:
        seed: Base seed; per-trial generators are derived from it and the trial number.
        top_percent_to_mutate: Fraction of completed trials eligible as parents.
        minimum_schemes_to_mutate: Lower bound on the number of eligible parents.
        maximum_mutations: Each child gets between 1 and this many moves.
        maximum_generation_attempts: Attempts to find a new scheme before random fallback.
        concat_group_min_samples: With ``schemes_per_region``, sets the Concat-group move
            probability ``min(1, max(concat_group_min_samples / schemes_per_region, 0.05))``.
        schemes_per_region: Expected trial budget per pattern study.
        fusion_group_probability: Probability of a fusion-group move when no Concat move
            was drawn.
        seed_empty_scheme: Propose the all-off scheme first. Off (as with
            ``seed_full_scheme``) for a study that starts from enqueued schemes only, e.g. a
            refinement around a scheme already chosen.
        seed_full_scheme: Propose the all-on scheme right after the empty one.
        scheme_key: Maps a scheme's params to the identity of the resulting model, for
            de-duplication when different params build the same model.
        hill_climb_parents: Best schemes whose one-move neighbourhoods are searched before
            mutating (0: no climbing).
    """

    def __init__(
        self,
        *,
        seed: int | None = None,
        top_percent_to_mutate: float = 0.1,
        minimum_schemes_to_mutate: int = 10,
        maximum_mutations: int = 3,
        maximum_generation_attempts: int = 100,
        concat_group_min_samples: int = 5,
        schemes_per_region: int = 30,
        fusion_group_probability: float = 0.35,
        seed_empty_scheme: bool = True,
        seed_full_scheme: bool = True,
        scheme_key: SchemeKey | None = None,
        hill_climb_parents: int = 1,
    ) -> None:
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"seed must be an int or None, got {seed!r}.")
        if not isinstance(top_percent_to_mutate, (int, float)) or not (
            0.0 < top_percent_to_mutate <= 1.0
        ):
            raise ValueError(
                f"top_percent_to_mutate must be in (0, 1], got {top_percent_to_mutate!r}."
            )
        _check_int("minimum_schemes_to_mutate", minimum_schemes_to_mutate, 1)
        _check_int("maximum_mutations", maximum_mutations, 1)
        _check_int("maximum_generation_attempts", maximum_generation_attempts, 1)
        _check_int("concat_group_min_samples", concat_group_min_samples, 0)
        _check_int("schemes_per_region", schemes_per_region, 1)
        _check_int("hill_climb_parents", hill_climb_parents, 0)
        if not isinstance(fusion_group_probability, (int, float)) or not (
            0.0 <= fusion_group_probability <= 1.0
        ):
            raise ValueError(
                f"fusion_group_probability must be in [0, 1], got {fusion_group_probability!r}."
            )
        for name, flag in (("seed_empty_scheme", seed_empty_scheme),
                           ("seed_full_scheme", seed_full_scheme)):
            if not isinstance(flag, bool):
                raise ValueError(f"{name} must be a bool, got {flag!r}.")
        if scheme_key is not None and not callable(scheme_key):
            raise ValueError("scheme_key must be a callable or None.")

        self._base_seed = _fresh_seed() if seed is None else seed & _UINT64_MASK
        self._top_percent = float(top_percent_to_mutate)
        self._min_parents = minimum_schemes_to_mutate
        self._max_mutations = maximum_mutations
        self._max_attempts = maximum_generation_attempts
        self._p_concat = min(1.0, max(concat_group_min_samples / schemes_per_region, 0.05))
        self._p_fusion = float(fusion_group_probability)
        self._seed_empty = seed_empty_scheme
        self._seed_full = seed_full_scheme
        self._scheme_key = scheme_key
        self._climb_parents = hill_climb_parents
        #: per study: its visit (None: not a visit), the model identity of trials' schemes
        self._visits: dict[int, Visit | None] = {}
        self._keys: dict[tuple[int, int], Hashable] = {}
        #: trial number -> the visit's move this sampler proposed for it (None: none left)
        self._proposed: dict[int, dict[str, Any]] = {}

    @property
    def concat_group_probability(self) -> float:
        """Probability that a move is an atomic Concat-group move."""
        return self._p_concat

    def converged(self, study: Study, patience: int = 1) -> bool:
        """Whether the search has settled: the last ``patience`` finished trials were all
        exploration (the best scheme had no untried one-move neighbour left) and none of them
        improved on the best. A caller may stop the study then instead of spending the rest of
        its budget on random mutations; seeds still queued are not affected (they are asked
        first anyway). Single objective only (False otherwise)."""
        _check_int("patience", patience, 1)
        if len(study.directions) != 1 or self._climb_parents == 0:
            return False
        trials = study.get_trials(deepcopy=False)
        if any(t.state == TrialState.WAITING for t in trials):
            return False
        finished = [t for t in trials if t.state.is_finished()]
        finished.sort(key=lambda t: t.number)
        last = finished[-patience:]
        if len(last) < patience or any(t.system_attrs.get(PHASE_KEY) != "explore" for t in last):
            return False
        complete = [t for t in finished if t.state == TrialState.COMPLETE and t.values]
        if not complete:
            return False
        sign = -1.0 if study.directions[0] == StudyDirection.MAXIMIZE else 1.0
        best = min(complete, key=lambda t: (_nan_last(sign * t.values[0]), t.number))
        return best.number < last[0].number

    def reseed_rng(self) -> None:
        self._base_seed = _fresh_seed()

    def before_trial(self, study: Study, trial: FrozenTrial) -> None:
        # Fully fixed seeds never reach sample_relative, so their origin is recorded here.
        fixed = trial.system_attrs.get("fixed_params")
        if not fixed:
            return
        meta = _read_metadata(study)
        if meta.points is None or not any(p in fixed for p in meta.points):
            return
        space = _Space({p: IntDistribution(0, meta.num_choices - 1) for p in meta.points}, None)
        scheme = space.complete_values(space.known_values(trial))
        self._record(study, trial, "seed", None, [], scheme, duplicate=False)

    def infer_relative_search_space(
        self, study: Study, trial: FrozenTrial
    ) -> dict[str, BaseDistribution]:
        meta = _read_metadata(study)
        if meta.points is not None:
            return {name: IntDistribution(0, meta.num_choices - 1) for name in meta.points}
        space = intersection_search_space(study.get_trials(deepcopy=False))
        return {
            name: dist
            for name, dist in space.items()
            if isinstance(dist, IntDistribution) and not dist.single()
        }

    def sample_relative(
        self, study: Study, trial: FrozenTrial, search_space: dict[str, BaseDistribution]
    ) -> dict[str, Any]:
        if not search_space:
            return {}
        meta = _read_metadata(study)
        space = _Space(search_space, meta.points)
        params: dict[str, Any] = {}

        if len(space) > 0:
            fixed = trial.system_attrs.get("fixed_params") or {}
            if any(name in fixed for name in space.names):
                params = self._seed_params(study, trial, space, meta, fixed)
            elif set(space.names) <= set(trial.params):
                params = {}  # a retried trial: its scheme is given
            elif self._visit(study) is not None and meta.points is not None:
                params = self._visit_params(study, trial, space, meta)
            else:
                params = self._propose(study, trial, space, meta)

        for name, dist in search_space.items():
            if name not in space.position:
                params[name] = self.sample_independent(study, trial, name, dist)
        return params

    # -- a visit of the descent (see _visit.py) ------------------------------------------------
    def _visit(self, study: Study) -> Visit | None:
        sid = study.study_name
        if sid not in self._visits:
            self._visits[sid] = Visit.of(study.user_attrs)
        return self._visits[sid]

    def next_move(self, study: Study, trials: list[FrozenTrial] | None = None) -> Next | None:
        """The move a visit's next trial would measure (``Next.move`` None: the visit's moves
        are done); None when the study is not a visit."""
        visit = self._visit(study)
        meta = _read_metadata(study)
        if visit is None or meta.points is None:
            return None
        space = _Space({p: IntDistribution(0, meta.num_choices - 1) for p in meta.points}, None)
        if trials is None:
            trials = study.get_trials(deepcopy=False)
        identity = self._identity_fn(space, meta)
        sid = study.study_name

        def key(t: FrozenTrial | None, own: dict[str, int], foreign: dict[str, int]) -> Hashable:
            if t is not None and (sid, t.number) in self._keys:
                return self._keys[sid, t.number]
            values = space.values(space.scheme_of(own))
            if self._scheme_key is not None:
                k = self._scheme_key({**values, **foreign})
            else:
                k = (identity(values), frozenset(foreign.items()))
            if t is not None:
                self._keys[sid, t.number] = k
            return k

        return visit.next(trials, space.known_values, key)

    def proposed_move(self, number: int) -> dict[str, Any] | None:
        """The visit's move this sampler proposed for trial ``number`` (``kind``, ``index``,
        ``signature``, ``foreign``; ``kind`` None: no move was left); None when the trial was
        not proposed as a move (a queued scheme)."""
        return self._proposed.get(number)

    def _visit_params(
        self, study: Study, trial: FrozenTrial, space: _Space, meta: _Metadata
    ) -> dict[str, Any]:
        visit = self._visit(study)
        found = self.next_move(study)
        if found is None or found.move is None:
            record: dict[str, Any] = {"kind": None, "index": None, "signature": None,
                                      "foreign": {}}
            own = dict(visit.own_standing)
        else:
            record = {"kind": found.move.kind, "index": found.index,
                      "signature": list(found.move.signature), "foreign": found.foreign}
            own = found.own
        set_system_attrs(study, trial, {VISIT_MOVE_KEY: record})
        self._proposed[trial.number] = record
        values = space.values(space.scheme_of(own))
        self._record(study, trial, "move", found.parent if found else None,
                     [record["kind"]] if record["kind"] else [], values,
                     duplicate=record["kind"] is None)
        return dict(values)

    def after_trial(
        self,
        study: Study,
        trial: FrozenTrial,
        state: TrialState,
        values: Sequence[float] | None,
    ) -> None:
        # A visit ends when its moves are done: the sampler stops the study (inside optimize;
        # with ask/tell the caller asks next_move). Other workers' running trials may still
        # improve the best, so it waits for them (a trial it proposes then finds no move).
        if self._visit(study) is None:
            return
        finished = copy.copy(trial)
        finished.state = state
        finished.values = values
        trials = [finished if t.number == trial.number else t
                  for t in study.get_trials(deepcopy=False)]
        if any(t.state in (TrialState.RUNNING, TrialState.WAITING) for t in trials):
            return
        found = self.next_move(study, trials)
        if found is not None and found.move is None:
            try:
                study.stop()
            except RuntimeError:  # not inside optimize (ask/tell): the caller decides
                pass

    def sample_independent(
        self,
        study: Study,
        trial: FrozenTrial,
        param_name: str,
        param_distribution: BaseDistribution,
    ) -> Any:
        seed = _derive_seed(self._base_seed, trial.number, zlib.crc32(param_name.encode()))
        return RandomSampler(seed=seed).sample_independent(
            study, trial, param_name, param_distribution
        )

    def _seed_params(
        self,
        study: Study,
        trial: FrozenTrial,
        space: _Space,
        meta: _Metadata,
        fixed: dict[str, Any],
    ) -> dict[str, Any]:
        # Seeds are used as given; in Q/DQ mode unspecified points are off, not random.
        filled = {}
        if meta.points is not None:
            filled = {n: d.low for n, d in zip(space.names, space.dists) if n not in fixed}
        scheme = space.complete_values(space.known_values(trial))
        scheme.update(filled)
        self._record(study, trial, "seed", None, [], scheme, duplicate=False)
        return filled

    def _propose(
        self, study: Study, trial: FrozenTrial, space: _Space, meta: _Metadata
    ) -> dict[str, Any]:
        rng = np.random.RandomState(_derive_seed(self._base_seed, trial.number))
        identity = self._identity_fn(space, meta)
        trials = study.get_trials(deepcopy=False, states=_LIVE_STATES)
        taken: set[Hashable] = set()
        for t in trials:
            if t.number == trial.number:
                continue
            known = space.known_values(t)
            if known:
                taken.add(identity(space.complete_values(known)))

        def fresh(scheme: Sequence[int]) -> bool:
            return identity(space.values(scheme)) not in taken

        empty = (0,) * len(space)
        if self._seed_empty and fresh(empty):
            return self._accept(study, trial, space, empty, "empty", None, [])
        full = tuple(min(1, n - 1) for n in space.n_choices)
        if self._seed_full and fresh(full):
            return self._accept(study, trial, space, full, "full", None, [])

        groups = {
            "concat": _resolve_groups(meta.concat_groups, space),
            "fusion": _resolve_groups(meta.fusion_groups, space),
            "tensor": _resolve_groups(meta.tensor_groups, space),
        }
        parents = self._ranked_parents(study, [t for t in trials if _is_parent(t, space)])
        if meta.points is not None:
            # Local search first: an untried one-move neighbour of the best scheme (of the next
            # best ones when its neighbourhood is used up).
            effects = _move_effects(study, trials, space) if parents else {}
            for parent in parents[: self._climb_parents]:
                base = list(space.scheme_of(space.known_values(parent)))
                nxt = next(((scheme, move)
                            for scheme, move in self._neighbours(base, space, groups, rng, effects)
                            if fresh(scheme)), None)
                if nxt is None:
                    continue
                scheme, moves = nxt
                return self._accept(study, trial, space, scheme, "mutation", parent.number, moves,
                                    phase="climb")
        if parents:
            k = min(
                len(parents),
                max(self._min_parents, math.ceil(self._top_percent * len(parents))),
            )
            for _ in range(self._max_attempts):
                parent = parents[rng.randint(k)]
                scheme = list(space.scheme_of(space.known_values(parent)))
                moves = self._mutate(scheme, space, groups, rng)
                if moves and fresh(scheme):
                    return self._accept(
                        study, trial, space, scheme, "mutation", parent.number, moves,
                        phase="explore",
                    )

        scheme = list(empty)
        for _ in range(self._max_attempts):
            scheme = [int(rng.randint(n)) for n in space.n_choices]
            if fresh(scheme):
                return self._accept(study, trial, space, scheme, "random", None, [],
                                    phase="explore")
        return self._accept(study, trial, space, scheme, "random", None, [], duplicate=True,
                            phase="explore")

    def _accept(
        self,
        study: Study,
        trial: FrozenTrial,
        space: _Space,
        scheme: Sequence[int],
        origin: str,
        parent: int | None,
        moves: list[str],
        duplicate: bool = False,
        phase: str | None = None,
    ) -> dict[str, Any]:
        values = space.values(scheme)
        self._record(study, trial, origin, parent, moves, values, duplicate)
        if phase is not None:
            set_system_attrs(study, trial, {PHASE_KEY: phase})
        return dict(values)

    @staticmethod
    def _record(
        study: Study,
        trial: FrozenTrial,
        origin: str,
        parent: int | None,
        moves: list[str],
        scheme: dict[str, Any],
        duplicate: bool,
    ) -> None:
        attrs = {SCHEME_KEY: scheme, ORIGIN_KEY: origin, PARENT_KEY: parent, MOVES_KEY: moves}
        if duplicate:
            attrs[DUPLICATE_KEY] = True
        set_system_attrs(study, trial, attrs)

    def _mutate(
        self,
        scheme: list[int],
        space: _Space,
        groups: dict[str, list[tuple[int, list[int]]]],
        rng: np.random.RandomState,
    ) -> list[str]:
        moves = []
        for _ in range(rng.randint(1, self._max_mutations + 1)):
            move = self._move(scheme, space, groups, rng)
            if move is not None:
                moves.append(move)
        return moves

    def _move(
        self,
        scheme: list[int],
        space: _Space,
        groups: dict[str, list[tuple[int, list[int]]]],
        rng: np.random.RandomState,
    ) -> str | None:
        if rng.random_sample() < self._p_concat:
            move = _group_move(scheme, space, groups["concat"], "concat", rng)
            if move is not None:
                return move
        if rng.random_sample() < self._p_fusion:
            move = _group_move(scheme, space, groups["fusion"], "fusion", rng)
            if move is not None:
                return move
        flippable = [i for i, n in enumerate(space.n_choices) if n >= 2]
        if not flippable:
            return None
        i = flippable[rng.randint(len(flippable))]
        n = space.n_choices[i]
        if n == 2:
            scheme[i] = 1 - scheme[i]
        else:
            new = int(rng.randint(n - 1))
            scheme[i] = new + 1 if new >= scheme[i] else new
        return f"flip:{space.names[i]}"

    def _neighbours(
        self,
        scheme: list[int],
        space: _Space,
        groups: dict[str, list[tuple[int, list[int]]]],
        rng: np.random.RandomState,
        effects: dict[str, float] | None = None,
    ) -> list[tuple[list[int], list[str]]]:
        """Every scheme one move away, in the order to try them: moves that improved other
        schemes before (best first), then untried moves (whole-group moves before single-point
        changes, each in random order), then moves that made things worse (least bad first).
        Two-move steps that switch a whole Concat group on together with one other point go
        right before the untried single-point changes: a Concat runs quantized only when its
        inputs *and* its output are, and neither move alone pays. Only move kinds that mutations
        can draw are used."""
        group_moves: list[tuple[list[int], str]] = []
        kinds = [("concat", self._p_concat > 0), ("fusion", self._p_fusion > 0),
                 ("tensor", self._p_fusion > 0)]
        for kind, allowed in kinds:
            for gid, members in groups[kind] if allowed else []:
                if any(scheme[i] > 0 for i in members):
                    child = list(scheme)
                    for i in members:
                        child[i] = 0
                    group_moves.append((child, f"{kind}-:g{gid}"))
                if not all(scheme[i] > 0 for i in members):
                    closed = set(members)
                    if kind == "concat":  # and every tensor group that shares a point with it
                        for _, shared in groups["tensor"]:
                            if closed & set(shared):
                                closed |= set(shared)
                    variants = [(members, "+")] + ([(sorted(closed), "++")]
                                                   if len(closed) > len(members) else [])
                    for value in range(1, min(space.n_choices[i] for i in members)):
                        for on, sign in variants:
                            child = list(scheme)
                            for i in on:
                                if child[i] == 0:
                                    child[i] = value
                            group_moves.append((child, f"{kind}{sign}:g{gid}"))
        flips: list[tuple[list[int], str]] = []
        if (1.0 - self._p_concat) * (1.0 - self._p_fusion) > 0:
            for i, n in enumerate(space.n_choices):
                for value in range(n):
                    if n >= 2 and value != scheme[i]:
                        child = list(scheme)
                        child[i] = value
                        flips.append((child, f"flip:{space.names[i]}"))
        single = [moves[j] for moves in (group_moves, flips) for j in rng.permutation(len(moves))]
        effects = effects or {}
        scored = [(effects.get(_effect_key(child, move, space)), i)
                  for i, (child, move) in enumerate(single)]
        good = sorted((e, i) for e, i in scored if e is not None and e < 0)
        bad = sorted((e, i) for e, i in scored if e is not None and e >= 0)
        fresh = [i for e, i in scored if e is None]
        order = [i for _, i in good] + fresh + [i for _, i in bad]
        out = [(single[i][0], [single[i][1]]) for i in order]
        pairs: list[tuple[list[int], list[str]]] = []
        labels = {move for _, move in group_moves}
        for child, move in group_moves:
            # the Concat group with the tensor groups it touches when there are any (a shared
            # input Q/DQ is what lets the Concat's producers write INT8), else the group alone
            if not move.startswith("concat+") or not flips or move.replace("+", "++") in labels:
                continue
            for i, n in enumerate(space.n_choices):
                if child[i] != scheme[i] or n < 2:
                    continue
                for value in range(n):
                    if value != child[i]:
                        pair = list(child)
                        pair[i] = value
                        pairs.append((pair, [move, f"flip:{space.names[i]}"]))
        # after the moves known to help and the untried group moves, before single flips
        cut = len(good) + sum(1 for i in fresh if i < len(group_moves))
        return out[:cut] + [pairs[j] for j in rng.permutation(len(pairs))] + out[cut:]

    def _identity_fn(self, space: _Space, meta: _Metadata) -> Callable[[dict[str, Any]], Hashable]:
        if self._scheme_key is not None:
            key = self._scheme_key
            return lambda values: key(dict(values))
        if meta.point_uses is None:
            names = space.names
            return lambda values: tuple(values[n] for n in names)

        uses = meta.point_uses
        with_value = max(space.n_choices, default=2) > 2

        def by_uses(values: dict[str, Any]) -> Hashable:
            covered: set[Hashable] = set()
            for name, value in values.items():
                i = space.index(name, value)
                if i == 0:
                    continue
                for use in uses.get(name, (name,)):
                    covered.add((use, i) if with_value else use)
            return frozenset(covered)

        return by_uses

    def _ranked_parents(self, study: Study, complete: list[FrozenTrial]) -> list[FrozenTrial]:
        # Constrained studies (Trial.set_constraint): feasible trials first, ranked as usual,
        # then infeasible ones by total violation.
        if any(t.constraints for t in complete):
            ok = [t for t in complete if all(v <= 0 for v in t.constraints.values())]
            bad = [t for t in complete if not all(v <= 0 for v in t.constraints.values())]
            bad.sort(key=lambda t: (sum(max(v, 0.0) for v in t.constraints.values()), t.number))
            return self._ranked_by_values(study, ok) + bad
        return self._ranked_by_values(study, complete)

    @staticmethod
    def _ranked_by_values(study: Study, complete: list[FrozenTrial]) -> list[FrozenTrial]:
        if not complete:
            return []
        directions = study.directions
        if len(directions) == 1:
            sign = -1.0 if directions[0] == StudyDirection.MAXIMIZE else 1.0
            return sorted(complete, key=lambda t: (_nan_last(sign * t.values[0]), t.number))
        return _rank_multi_objective(complete, directions)


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}.")


def _fresh_seed() -> int:
    return int(np.random.SeedSequence().generate_state(2, np.uint64)[0])


def _derive_seed(*parts: int) -> int:
    # Deterministic across processes (no str hashing), so resumed studies replay the same way.
    words = [int(p) & _UINT64_MASK for p in parts]
    return int(np.random.SeedSequence(words).generate_state(1)[0])


def _nan_last(value: float) -> float:
    return math.inf if math.isnan(value) else value


def _effect_key(child: Sequence[int], move: str, space: _Space) -> str:
    """Identity of a move across parents: a group move by its label, a flip with its value."""
    if move.startswith("flip:"):
        name = move[len("flip:"):]
        return f"{move}={child[space.position[name]]}" if name in space.position else move
    return move


def _move_effects(study: Study, trials: list[FrozenTrial], space: _Space) -> dict[str, float]:
    """Mean change of the objective (improvement < 0) that each one-move mutation caused,
    over all completed children whose parent completed too. Single objective only."""
    if len(study.directions) != 1:
        return {}
    sign = -1.0 if study.directions[0] == StudyDirection.MAXIMIZE else 1.0
    by_number = {t.number: t for t in trials}
    sums: dict[str, list[float]] = {}
    for t in trials:
        moves = t.system_attrs.get(MOVES_KEY)
        parent = by_number.get(t.system_attrs.get(PARENT_KEY, -1))
        if (
            parent is None
            or not isinstance(moves, list)
            or len(moves) != 1
            or not _is_parent(t, space)
            or not _is_parent(parent, space)
        ):
            continue
        delta = sign * (t.values[0] - parent.values[0])
        if math.isnan(delta):
            continue
        move = str(moves[0])
        child = space.scheme_of(space.known_values(t))
        # the move undone (back to the parent) is assumed to have the opposite effect
        back = _effect_key(space.scheme_of(space.known_values(parent)), _reverse(move), space)
        for key, d in ((_effect_key(child, move, space), delta), (back, -delta)):
            acc = sums.setdefault(key, [0.0, 0.0])
            acc[0] += d
            acc[1] += 1
    return {k: total / n for k, (total, n) in sums.items()}


def _reverse(move: str) -> str:
    """The move that undoes ``move`` (a flip is its own inverse; its key carries the value)."""
    if move.startswith("flip:"):
        return move
    kind, _, gid = move.partition(":")
    return f"{kind.rstrip('+-')}{'-' if kind.endswith('+') else '+'}:{gid}"


def _is_parent(trial: FrozenTrial, space: _Space) -> bool:
    return (
        trial.state == TrialState.COMPLETE
        and trial.values is not None
        and any(name in trial.params for name in space.names)
    )


def _resolve_groups(groups: list[list[str]], space: _Space) -> list[tuple[int, list[int]]]:
    resolved = []
    for gid, group in enumerate(groups):
        members = sorted(
            {space.position[n] for n in group if n in space.position}
            - {i for i, n in enumerate(space.n_choices) if n < 2}
        )
        if members:
            resolved.append((gid, members))
    return resolved


def _group_move(
    scheme: list[int],
    space: _Space,
    groups: list[tuple[int, list[int]]],
    kind: str,
    rng: np.random.RandomState,
) -> str | None:
    actions = []
    for gid, members in groups:
        on = [scheme[i] > 0 for i in members]
        if not all(on):
            actions.append((gid, members, "+"))
        if any(on):
            actions.append((gid, members, "-"))
    if not actions:
        return None
    gid, members, sign = actions[rng.randint(len(actions))]
    if sign == "+":
        # One quant type for the whole group so mixed-precision groups stay consistent.
        value = int(rng.randint(1, min(space.n_choices[i] for i in members)))
        for i in members:
            if scheme[i] == 0:
                scheme[i] = value
    else:
        for i in members:
            scheme[i] = 0
    return f"{kind}{sign}:g{gid}"


def _rank_multi_objective(
    complete: list[FrozenTrial], directions: Sequence[StudyDirection]
) -> list[FrozenTrial]:
    from optuna.study._multi_objective import _fast_non_domination_rank

    if not complete:
        return []
    signs = np.array([-1.0 if d == StudyDirection.MAXIMIZE else 1.0 for d in directions])
    losses = np.array([t.values for t in complete], dtype=float) * signs
    losses = np.where(np.isnan(losses), np.inf, losses)
    ranks = _fast_non_domination_rank(losses)
    crowding: dict[int, float] = {}
    try:
        from optuna.samplers.nsgaii._elite_population_selection_strategy import (
            _calc_crowding_distance,
        )

        for rank in set(ranks.tolist()):
            front = [t for t, r in zip(complete, ranks) if r == rank]
            crowding.update(_calc_crowding_distance(front))
    except ImportError:  # pragma: no cover - private helper moved; fall back to trial order
        pass
    order = sorted(
        range(len(complete)),
        key=lambda i: (ranks[i], -crowding.get(complete[i].number, 0.0), complete[i].number),
    )
    return [complete[i] for i in order]


def _read_metadata(study: Study) -> _Metadata:
    attrs = study.user_attrs
    points = attrs.get(POINTS_ATTR)
    if points is not None:
        if not isinstance(points, list) or not all(isinstance(p, str) for p in points):
            raise ValueError(f"Study user attr {POINTS_ATTR!r} must be a list of str.")
        points = list(dict.fromkeys(points))
    num_choices = attrs.get(NUM_CHOICES_ATTR, 2)
    if isinstance(num_choices, bool) or not isinstance(num_choices, int) or num_choices < 1:
        raise ValueError(f"Study user attr {NUM_CHOICES_ATTR!r} must be an int >= 1.")
    uses = attrs.get(POINT_USES_ATTR)
    if uses is not None and not isinstance(uses, dict):
        raise ValueError(f"Study user attr {POINT_USES_ATTR!r} must be a dict.")
    return _Metadata(
        points=points,
        num_choices=num_choices,
        concat_groups=_read_groups(attrs, CONCAT_GROUPS_ATTR),
        fusion_groups=_read_groups(attrs, FUSION_GROUPS_ATTR),
        point_uses=uses,
        tensor_groups=_tensor_groups(attrs.get(POINT_TENSORS_ATTR)),
    )


def _tensor_groups(point_tensors: Any) -> list[list[str]]:
    """Points that share a tensor, one group per tensor covered by two or more points: a Q/DQ
    pair is shared by all consumers of a tensor only when all of them are covered."""
    if point_tensors is None:
        return []
    if not isinstance(point_tensors, dict) or not all(
        isinstance(v, list) for v in point_tensors.values()
    ):
        raise ValueError(f"Study user attr {POINT_TENSORS_ATTR!r} must be a dict of lists.")
    by_tensor: dict[str, list[str]] = {}
    for point, tensors in point_tensors.items():
        for tensor in tensors:
            by_tensor.setdefault(str(tensor), []).append(point)
    groups = {tuple(sorted(ps)) for ps in by_tensor.values() if len(ps) > 1}
    return [list(g) for g in sorted(groups)]


def _read_groups(attrs: dict[str, Any], key: str) -> list[list[str]]:
    groups = attrs.get(key) or []
    if not isinstance(groups, list) or not all(isinstance(g, list) for g in groups):
        raise ValueError(f"Study user attr {key!r} must be a list of lists of str.")
    return groups


__all__ = ["QDQMutationSampler"]
