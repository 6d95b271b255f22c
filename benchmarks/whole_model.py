"""Whole-model placements on the cost model (TensorRT rules): starts, today's tune, a long
coordinate descent, and a prototype of the whole-model descent (issue 13).

For each zoo model and size it reports the latency of: float; every offered point on; the
TensorRT PTQ recipe (NVIDIA Model Optimizer's default INT8 placement: run for real with
``--modelopt-python``, else its rules in ``qdq_optuna.starts``; exact uses and their
projection onto the patterns' points); today's ``qdq_optuna.tune(..., benchmark="costmodel")``
at 30 schemes per pattern (report.json speedup and measurements); a long coordinate descent
over all points of all patterns (the best-known reference); and the prototype descent in
several variants, with its measurement count (distinct models built and timed).

The cost model is deterministic, so every model is evaluated once (cached by plan key). Under
ONNX Runtime rules the cost model is not used: it imitates TensorRT and does not price ONNX
Runtime's fused integer kernels (docs/costmodel.md).

    python benchmarks/whole_model.py --sizes medium full --work DIR [--modelopt-python PY]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import onnx

import qdq_optuna
from qdq_optuna import starts, zoo
from qdq_optuna.backends.costmodel import CostModelBackend
from qdq_optuna.bench import run_history
from qdq_optuna.config import Config
from qdq_optuna.model import PreparedModel

MODELS = ("resnet", "mobilenet", "yolo", "transformer")
Point = tuple[str, str]  # (pattern id, point id)
State = frozenset  # of Point
#: a move: points switched on, points switched off
Move = tuple[frozenset, frozenset]


# -- the search space over all patterns ------------------------------------------------------
class Space:
    """Every point of every pattern, with the moves that match how runtimes fuse."""

    def __init__(self, pm: PreparedModel) -> None:
        self.pm = pm
        self.patterns = [pp.pattern.id for pp in pm.tunable]
        self.pp = {pp.pattern.id: pp for pp in pm.tunable}
        self.points: list[Point] = [(pp.pattern.id, pid) for pp in pm.tunable for pid in pp.ids]
        self.uses_of = {(p, pid): frozenset(self.pp[p].uses([pid])) for p, pid in self.points}
        self.fusion = [frozenset((pp.pattern.id, q) for q in g)
                       for pp in pm.tunable for g in pp.fusion_groups]
        self.concat = [frozenset((pp.pattern.id, q) for q in g)
                       for pp in pm.tunable for g in pp.concat_groups]
        self.chains = self._chains()

    def _chains(self) -> list[frozenset]:
        """Per tensor: the points (of any pattern) that quantize only that tensor, when they
        span more than one pattern (a producer's output and its consumers' inputs)."""
        by_tensor: dict[str, set[Point]] = {}
        for pt, uses in self.uses_of.items():
            tensors = {u[0] for u in uses}
            if len(tensors) == 1:
                by_tensor.setdefault(next(iter(tensors)), set()).add(pt)
        return [frozenset(pts) for _, pts in sorted(by_tensor.items())
                if len({p for p, _ in pts}) > 1]

    def uses(self, state: Iterable[Point]) -> set:
        out: set = set()
        for pt in state:
            out |= self.uses_of[pt]
        return out

    def state_of(self, schemes: dict) -> State:
        return frozenset((p, q) for p, s in schemes.items() for q, v in s.items() if v)

    def group_moves(self, groups: Iterable[frozenset], state: State) -> list[Move]:
        moves = []
        for g in groups:
            if not g <= state:
                moves.append((g - state, frozenset()))
            if g & state:
                moves.append((frozenset(), g & state))
        return moves

    def single_moves(self, points: Iterable[Point], state: State) -> list[Move]:
        return [((frozenset(), frozenset([pt])) if pt in state else (frozenset([pt]), frozenset()))
                for pt in points]


def apply(state: State, move: Move) -> State:
    on, off = move
    return frozenset((state - off) | on)


class Evaluator:
    """Latency of a placement on the cost model, each distinct model (plan key) once."""

    def __init__(self, pm: PreparedModel) -> None:
        self.pm = pm
        self.exporter = pm.exporter()
        self.backend = CostModelBackend()
        self.cache: dict[str, float] = {}
        self.seconds = 0.0

    def uses(self, uses: Iterable) -> float:
        plan = self.exporter.plan(set(uses))
        hit = self.cache.get(plan.key)
        if hit is None:
            t = time.perf_counter()
            hit = self.cache[plan.key] = self.backend.estimate(self.exporter.to_bytes(plan)).total_ms
            self.seconds += time.perf_counter() - t
        return hit

    def key(self, uses: Iterable) -> str:
        return self.exporter.plan(set(uses)).key


class Counter:
    """Distinct models one search asked for (its measurement count), over a shared cache."""

    def __init__(self, ev: Evaluator, space: Space) -> None:
        self.ev, self.space, self.seen = ev, space, set()

    def __call__(self, state: Iterable[Point] = (), uses: Iterable | None = None) -> float:
        u = self.space.uses(state) if uses is None else set(uses)
        self.seen.add(self.ev.key(u))
        return self.ev.uses(u)

    @property
    def count(self) -> int:
        return len(self.seen)


# -- the long coordinate descent (reference) -------------------------------------------------
def long_descent(space: Space, measure: Counter, start: State) -> tuple[State, float]:
    """First-improvement descent over every point, fusion group, Concat group and chain of
    every pattern, passes until a whole pass improves nothing."""
    state, best = start, measure(start)
    improved = True
    while improved:
        improved = False
        moves = (space.group_moves(space.fusion + space.concat + space.chains, state)
                 + space.single_moves(space.points, state))
        for move in moves:
            cand = apply(state, move)
            if cand == state:
                continue
            ms = measure(cand)
            if ms < best * (1 - 1e-9):
                state, best, improved = cand, ms, True
    return state, best


# -- the prototype whole-model descent -------------------------------------------------------
@dataclass
class Variant:
    name: str
    #: move kinds tried per pattern, in this order of kinds
    kinds: tuple[str, ...] = ("fusion", "concat", "chain", "single")
    #: order moves inside a pattern by a static prior (see prior())
    prior: bool = True
    #: stop a pattern's round after this many failed moves in a row (0: try every move)
    patience: int = 0
    #: start from the best start (else float)
    best_start: bool = True
    #: also descend from these starts (by name) and keep the best result
    also_from: tuple[str, ...] = ()
    #: skip a pattern whose neighbourhood did not change since its last round
    skip_unchanged: bool = True
    max_rounds: int = 20


FP16_ONLY = frozenset({"Softmax", "LayerNormalization", "Erf", "Div", "Sqrt", "Pow", "ReduceMean",
                       "Exp", "Sigmoid"})
INT8_READERS = frozenset({"Conv", "ConvTranspose", "MatMul", "Gemm", "Concat", "MaxPool",
                          "AveragePool", "GlobalAveragePool", "Add", "Mul", "Resize", "Split"})


def prior(space: Space, move: Move) -> float:
    """Expected gain of a move from the op mix only (no measurement): adding Q/DQ in front of
    ops that read INT8 and removing it in front of FP16-only ops first; bigger groups first."""
    g = space.pm.graph
    score = 0.0
    for pt in move[0]:
        for _, n, _ in space.uses_of[pt]:
            op = g.nodes[n].op_type
            score += 1.0 if op in INT8_READERS else (-1.0 if op in FP16_ONLY else 0.0)
    for pt in move[1]:
        for _, n, _ in space.uses_of[pt]:
            op = g.nodes[n].op_type
            score += 1.0 if op in FP16_ONLY else (-0.5 if op in INT8_READERS else 0.25)
    return score


@dataclass
class DescentResult:
    state: State
    ms: float
    measurements: int
    phases: dict = field(default_factory=dict)
    rounds: int = 0
    start: str = ""


def _pattern_moves(space: Space, p: str, state: State, v: Variant) -> list[Move]:
    mine = {pt for pt in space.points if pt[0] == p}
    by_kind = {
        "fusion": space.group_moves([g for g in space.fusion if g <= mine], state),
        "concat": space.group_moves([g for g in space.concat if g <= mine], state),
        "chain": space.group_moves([c for c in space.chains if c & mine], state),
        "single": space.single_moves(sorted(mine), state),
    }
    moves: list[Move] = []
    seen: set = set()
    for kind in v.kinds:
        ms = by_kind[kind]
        if v.prior:
            ms = sorted(ms, key=lambda m: -prior(space, m))
        for m in ms:
            key = (m[0], m[1])
            if key not in seen:
                seen.add(key)
                moves.append(m)
    return moves


def _neighbourhood(space: Space, p: str) -> set[str]:
    """Tensors read or written by the pattern's regions (what another pattern's change can
    affect)."""
    g, tree = space.pm.graph, space.pm.tree
    nodes = {n for r in space.pp[p].pattern.regions for n in tree[r].all_nodes}
    return {t for n in nodes for t in (*g.nodes[n].input, *g.nodes[n].output) if t}


def whole_model_descent(space: Space, measure: Counter, start_states: dict[str, State],
                        v: Variant) -> DescentResult:
    """Starts -> standing model -> per-pattern rounds against the whole standing model (and
    from ``v.also_from`` too, keeping the best)."""
    res = _descent(space, measure, start_states, v)
    for name in v.also_from:
        if name in start_states and name != res.start:
            other = _descent(space, measure, {name: start_states[name]}, v)
            other.phases = {**res.phases, **{f"{name}:{k}": c for k, c in other.phases.items()}}
            if other.ms < res.ms:
                res = other
            res.measurements = measure.count
    return res


def _descent(space: Space, measure: Counter, start_states: dict[str, State],
             v: Variant) -> DescentResult:
    phases = {}
    if v.best_start:
        scored = {name: measure(s) for name, s in start_states.items()}
        name = min(scored, key=lambda k: (scored[k], k))
    else:
        name = "float"
        measure(start_states["float"])
    phases["starts"] = measure.count
    state = start_states[name]
    best = measure(state)
    near = {p: _neighbourhood(space, p) for p in space.patterns}
    last_seen: dict[str, frozenset] = {}
    rounds = 0
    for rnd in range(1, v.max_rounds + 1):
        rounds, changed = rnd, False
        for p in space.patterns:
            context = frozenset(u for u in space.uses(state) if u[0] in near[p])
            if v.skip_unchanged and last_seen.get(p) == context:
                continue
            failures = 0
            for move in _pattern_moves(space, p, state, v):
                cand = apply(state, move)
                if cand == state:
                    continue
                ms = measure(cand)
                if ms < best * (1 - 1e-9):
                    state, best, changed, failures = cand, ms, True, 0
                else:
                    failures += 1
                    if v.patience and failures >= v.patience:
                        break
            last_seen[p] = frozenset(u for u in space.uses(state) if u[0] in near[p])
        phases[f"round{rnd}"] = measure.count
        if not changed:
            break
    return DescentResult(state, best, measure.count, phases, rounds, name)


VARIANTS = [
    Variant("recommended: best start and the recipe, groups+chains+singles, prior, try all",
            also_from=("recipe",)),
    Variant("best start only"),
    Variant("float start", best_start=False),
    Variant("no chains", kinds=("fusion", "concat", "single")),
    Variant("singles only", kinds=("single",)),
    Variant("no prior (natural order)", prior=False),
    Variant("patience 3", patience=3),
    Variant("patience 8", patience=8),
    Variant("best start and the recipe, patience 8", also_from=("recipe",), patience=8),
    Variant("no skip of unchanged patterns", skip_unchanged=False),
]


# -- one model --------------------------------------------------------------------------------
def run_tune(path: Path, out: Path) -> dict:
    """Today's search; a finished run in ``out`` is resumed (nothing left to do), and the
    measurements are counted over the whole run from its storage, as ``qdq-optuna bench``
    does (report.json counts only the last invocation)."""
    cfg = Config(schemes_per_region=30)
    r = qdq_optuna.tune(str(path), str(out), benchmark="costmodel", config=cfg,
                        progress=False, seed=0)
    history = run_history(out, out.resolve().name, cfg.performance_threshold)
    return {"speedup": r.report["speedup"], "measurements": history["measurements"],
            "final_ms": r.report["final_latency_ms"], "baseline_ms": r.report["baseline_latency_ms"]}


def bench(name: str, size: str, work: Path, modelopt_python: str | None,
          variants: list[Variant], log: Callable[[str], None]) -> dict:
    d = work / f"{name}-{size}"
    d.mkdir(parents=True, exist_ok=True)
    path = d / "model.onnx"
    if not path.exists():
        onnx.save(zoo.build(name, size), str(path))
    pm = PreparedModel.prepare(str(path), runtime="tensorrt")
    space, ev = Space(pm), Evaluator(pm)
    row: dict = {"model": name, "size": size, "patterns": len(space.patterns),
                 "points": len(space.points), "chains": len(space.chains)}
    float_ms = ev.uses(set())
    row["float_ms"] = float_ms
    cands = {"float": starts.float_start(pm), "all": starts.all_on_start(pm),
             "recipe": starts.tensorrt_recipe_start(pm)}
    if modelopt_python:
        mo = d / "modelopt.onnx"
        if not mo.exists():
            data = None
            if name == "transformer":  # random ids would index outside the vocabulary
                import numpy as np
                data = d / "ids.npz"
                shape = [x.dim_value for x in onnx.load(str(path)).graph.input[0].type.tensor_type.shape.dim]
                np.savez(data, input_ids=np.zeros(shape, np.int64))
            starts.run_modelopt(path, mo, python=modelopt_python, calibration_data=data)
        cands["modelopt"] = starts.tensorrt_recipe_start(pm, mo)
        real = cands["modelopt"].uses
        rules = cands["recipe"].uses
        row["recipe_rules_vs_modelopt"] = {"modelopt_uses": len(real), "rules_uses": len(rules),
                                           "common": len(real & rules)}
    row["starts"] = {}
    for key, c in cands.items():
        row["starts"][key] = {"exact_ms": ev.uses(c.uses), "scheme_ms": ev.uses(c.scheme_uses),
                              "uses": len(c.uses), "exact": c.exact, "notes": list(c.notes)}
    t = time.time()
    row["tune"] = run_tune(path, d / "tune")
    row["tune"]["wall_s"] = round(time.time() - t, 1)
    start_states = {k: space.state_of(c.schemes) for k, c in cands.items()}
    # the reference: long descents from the starts, best of them
    t = time.time()
    ref_counter = Counter(ev, space)
    ref = {}
    for k in ("all", "recipe", "float"):
        s, ms = long_descent(space, ref_counter, start_states[k])
        ref[k] = ms
        if k == "float" and ms < min(ref.values()) * 0.999:
            log(f"  {name}-{size}: the descent from float beat the others")
    row["long_descent"] = {"from": {k: v for k, v in ref.items()}, "best_ms": min(ref.values()),
                           "evaluations": ref_counter.count, "wall_s": round(time.time() - t, 1)}
    best_known = min(min(ref.values()), row["starts"]["all"]["exact_ms"],
                     row["starts"]["recipe"]["exact_ms"])
    row["best_known_ms"] = best_known
    row["variants"] = {}
    for v in variants:
        res = whole_model_descent(space, Counter(ev, space), start_states, v)
        row["variants"][v.name] = {"ms": res.ms, "vs_best": res.ms / best_known,
                                   "speedup": float_ms / res.ms, "measurements": res.measurements,
                                   "rounds": res.rounds, "start": res.start, "phases": res.phases}
    row["tune"]["vs_best"] = row["tune"]["final_ms"] / best_known
    row["cost_model_s"] = round(ev.seconds, 1)
    return row


def table(rows: list[dict]) -> str:
    out = ["| model | float | all on | recipe (rules) | recipe (modelopt) | tune: speedup, meas. | "
           "long descent: best, evals | best known | prototype: speedup, vs best, meas. |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        f = r["float_ms"]
        s = r["starts"]
        mo = f"{f / s['modelopt']['exact_ms']:.3f}x" if "modelopt" in s else "-"
        rec = r["variants"][VARIANTS[0].name]
        out.append(
            f"| {r['model']} {r['size']} | 1.000x | {f / s['all']['exact_ms']:.3f}x | "
            f"{f / s['recipe']['exact_ms']:.3f}x | {mo} | {r['tune']['speedup']:.3f}x, "
            f"{r['tune']['measurements']} | {f / r['long_descent']['best_ms']:.3f}x, "
            f"{r['long_descent']['evaluations']} | {f / r['best_known_ms']:.3f}x | "
            f"{rec['speedup']:.3f}x, {rec['vs_best']:.3f}, {rec['measurements']} |")
    return "\n".join(out)


def variant_table(rows: list[dict]) -> str:
    names = list(rows[0]["variants"])
    out = ["| variant | " + " | ".join(f"{r['model']} {r['size']}" for r in rows) + " |",
           "|---|" + "---:|" * len(rows)]
    for n in names:
        cells = [f"{r['variants'][n]['vs_best']:.3f} / {r['variants'][n]['measurements']}"
                 for r in rows]
        out.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--sizes", nargs="+", default=["medium", "full"])
    ap.add_argument("--work", type=Path, required=True, help="models, tune runs, results")
    ap.add_argument("--modelopt-python", help="an interpreter with nvidia-modelopt[onnx]")
    ap.add_argument("--variants", default="all", help="'all' or 'recommended'")
    a = ap.parse_args(argv)
    variants = VARIANTS if a.variants == "all" else VARIANTS[:1]
    rows = []
    for size, name in itertools.product(a.sizes, a.models):
        t = time.time()
        rows.append(bench(name, size, a.work, a.modelopt_python, variants,
                          lambda s: print(s, file=sys.stderr)))
        print(f"{name} {size}: {time.time() - t:.0f} s", file=sys.stderr, flush=True)
        (a.work / "whole_model.json").write_text(json.dumps(rows, indent=1, default=str))
    text = table(rows) + "\n\nvariants (latency / best known, measurements):\n\n" + variant_table(rows)
    (a.work / "whole_model.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
