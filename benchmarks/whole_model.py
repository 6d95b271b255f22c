"""The whole-model search against the best placements known, on the cost model (TensorRT
rules, FP16 high precision: what ``tune --backend costmodel`` runs by default).

For each zoo model and size it reports the latency of: the baseline (the FP16 model); every
offered point on; the TensorRT PTQ recipe (NVIDIA Model Optimizer's default INT8 placement: run
for real with ``--modelopt-python``, else its rules in ``qdq_optuna.placement.starts``); a long coordinate
descent over every point, fusion group, Concat group and chain of every pattern, from each of
those starts, until a whole pass improves nothing (the best-known reference, thousands of
evaluations); and ``qdq_optuna.tune(..., backend="costmodel")`` with default settings and 30
schemes per pattern: its speedup, its distance to the best known, its measurements per phase.
With ``--old-flow CHECKOUT`` the same ``tune`` of another checkout (e.g. the pattern-by-pattern
search before the whole-model search) runs in a subprocess, for its speedup and measurements.

The cost model is deterministic, so every model is evaluated once (cached by plan key). Under
ONNX Runtime rules the cost model is not used: it imitates TensorRT and does not price ONNX
Runtime's fused integer kernels (docs/costmodel.md).

    python benchmarks/whole_model.py --sizes medium full --work DIR [--old-flow CHECKOUT]
    python benchmarks/whole_model.py --models nudenet-320n --sizes real --work DIR
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import onnx

import qdq_optuna
from qdq_optuna.backends.costmodel import CostModelBackend
from qdq_optuna.config import Config
from qdq_optuna.examples import zoo
from qdq_optuna.placement import starts
from qdq_optuna.placement.points import chain_groups
from qdq_optuna.runtimes import tensorrt as trt_runtime
from qdq_optuna.runtimes.prepared import PreparedModel

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
        self.chains = chain_groups(self.uses_of)  # the search's own chains

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


# -- one model --------------------------------------------------------------------------------
TUNE = dict(backend="costmodel", config=Config(schemes_per_region=30), progress=False, seed=0)


def run_tune(path: Path, out: Path, input_shapes: str | None = None) -> dict:
    """The search with default settings, into a fresh folder (one invocation: report.json's
    measurements are the whole run's)."""
    t = time.time()
    r = qdq_optuna.tune(str(path), str(out), fresh=True, input_shapes=input_shapes,
                        runtime="tensorrt", **TUNE).report
    return {"speedup": r["speedup"], "measurements": r["measurements"],
            "by_phase": r.get("measurements_by_phase"), "final_ms": r["final_latency_ms"],
            "baseline_ms": r["baseline_latency_ms"], "wall_s": round(time.time() - t, 1),
            "lanes": r.get("descent", {}).get("lanes"),
            "starts": {s["name"]: s.get("speedup") for s in r.get("starts", [])}}


_OLD = """
import json, sys
import qdq_optuna
from qdq_optuna.config import Config
r = qdq_optuna.tune(sys.argv[1], sys.argv[2], benchmark="costmodel", fresh=True,
                    config=Config(schemes_per_region=30), progress=False, seed=0).report
print(json.dumps({"speedup": r["speedup"], "measurements": r["measurements"],
                  "final_ms": r["final_latency_ms"], "baseline_ms": r["baseline_latency_ms"]}))
"""


def run_old(checkout: Path, path: Path, out: Path) -> dict:
    """``tune`` of another checkout, with its own defaults (a subprocess importing it)."""
    t = time.time()
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    proc = subprocess.run([sys.executable, "-c", _OLD, str(path), str(out)], env=env,
                          capture_output=True, text=True, check=True)
    return {**json.loads(proc.stdout.strip().splitlines()[-1]),
            "wall_s": round(time.time() - t, 1)}


def model_file(name: str, size: str, work: Path) -> tuple[Path, str | None]:
    """The zoo model ``name`` at ``size`` (generated into ``work``), or with size ``real`` the
    real third-party model ``name`` of benchmarks/real_models.py, and its input shapes."""
    d = work / f"{name}-{size}"
    d.mkdir(parents=True, exist_ok=True)
    if size == "real":
        import real_models

        return real_models.fetch(name), real_models.MODELS[name].input_shapes
    path = d / "model.onnx"
    if not path.exists():
        onnx.save(zoo.build(name, size), str(path))
    return path, None


def bench(name: str, size: str, work: Path, modelopt_python: str | None,
          old_flow: Path | None, log: Callable[[str], None]) -> dict:
    d = work / f"{name}-{size}"
    path, shapes = model_file(name, size, work)
    pm = PreparedModel.prepare(str(path), runtime="tensorrt", high_precision="fp16",
                               input_shapes=shapes)
    space, ev = Space(pm), Evaluator(pm)
    row: dict = {"model": name, "size": size, "patterns": len(space.patterns),
                 "points": len(space.points), "chains": len(space.chains)}
    row["float_ms"] = ev.uses(set())
    cands = {"float": starts.float_start(pm), "all": starts.all_on_start(pm),
             "recipe": trt_runtime.tensorrt_recipe_start(pm)}
    if modelopt_python:
        mo = d / "modelopt.onnx"
        if not mo.exists():
            trt_runtime.run_modelopt(path, mo, python=modelopt_python)
        cands["modelopt"] = trt_runtime.tensorrt_recipe_start(pm, mo)
    row["starts"] = {key: {"exact_ms": ev.uses(c.uses), "scheme_ms": ev.uses(c.scheme_uses),
                           "uses": len(c.uses), "exact": c.exact} for key, c in cands.items()}
    # the reference: long descents from the starts, the best of them
    t = time.time()
    counter = Counter(ev, space)
    ref = {k: long_descent(space, counter, space.state_of(cands[k].schemes))[1]
           for k in ("all", "recipe", "float")}
    row["long_descent"] = {"from": ref, "best_ms": min(ref.values()),
                           "evaluations": counter.count, "wall_s": round(time.time() - t, 1)}
    row["best_known_ms"] = min(min(ref.values()), row["starts"]["all"]["exact_ms"],
                               row["starts"]["recipe"]["exact_ms"])
    row["tune"] = run_tune(path, d / "tune", shapes)
    row["tune"]["vs_best"] = row["tune"]["final_ms"] / row["best_known_ms"]
    log(f"  {name} {size}: tune {row['tune']['speedup']:.3f}x "
        f"({row['tune']['vs_best']:.3f} of the best known), {row['tune']['measurements']} "
        "measurements")
    if old_flow is not None:
        row["old"] = run_old(old_flow, path, d / "old")
        row["old"]["vs_best"] = row["old"]["final_ms"] / row["best_known_ms"]
    row["cost_model_s"] = round(ev.seconds, 1)
    return row


def table(rows: list[dict]) -> str:
    old = any("old" in r for r in rows)
    out = ["| model | all on | recipe | long descent: best (evaluations) | best known | "
           "tune: speedup, vs best, measurements (starts + descent) |"
           + (" old flow: speedup, vs best, measurements | tune / old measurements |" if old
              else ""),
           "|---|---:|---:|---:|---:|---:|" + ("---:|---:|" if old else "")]
    for r in rows:
        f, s, t = r["float_ms"], r["starts"], r["tune"]
        by = t.get("by_phase") or {}
        line = (f"| {r['model']} {r['size']} | {f / s['all']['exact_ms']:.3f}x | "
                f"{f / s['recipe']['exact_ms']:.3f}x | {f / r['long_descent']['best_ms']:.3f}x "
                f"({r['long_descent']['evaluations']}) | {f / r['best_known_ms']:.3f}x | "
                f"{t['speedup']:.3f}x, {t['vs_best']:.3f}, {t['measurements']} "
                f"({by.get('starts', 0)} + {by.get('descent', 0)}) |")
        if old:
            o = r.get("old")
            line += (f" {o['speedup']:.3f}x, {o['vs_best']:.3f}, {o['measurements']} | "
                     f"{t['measurements'] / o['measurements']:.2f} |" if o else " - | - |")
        out.append(line)
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--sizes", nargs="+", default=["medium", "full"],
                    help="zoo sizes; 'real' takes --models from benchmarks/real_models.py")
    ap.add_argument("--work", type=Path, required=True, help="models, tune runs, results")
    ap.add_argument("--modelopt-python", help="an interpreter with nvidia-modelopt[onnx]")
    ap.add_argument("--old-flow", type=Path,
                    help="a checkout whose tune to run too (its qdq_optuna package and samplers)")
    a = ap.parse_args(argv)
    rows = []
    for size, name in itertools.product(a.sizes, a.models):
        t = time.time()
        rows.append(bench(name, size, a.work, a.modelopt_python, a.old_flow,
                          lambda s: print(s, file=sys.stderr, flush=True)))
        print(f"{name} {size}: {time.time() - t:.0f} s", file=sys.stderr, flush=True)
        (a.work / "whole_model.json").write_text(json.dumps(rows, indent=1, default=str))
    text = table(rows)
    (a.work / "whole_model.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
