"""The package's shape, measured: unit sizes, the import graph, and the per-trial call path.

Three figures the code review holds the package to (``tests/test_structure.py`` checks the
first two on every run):

* **units**: lines of every class (at most 400) and every function or method (at most 80),
  counted with ``ast`` from the ``def``/``class`` line to the unit's last line (decorators
  and docstrings included; a nested function counts inside its parent too);
* **import circles**: an edge A -> B for every import of B anywhere in A (module level and
  inside functions, since both run); importing a submodule also imports its packages, except
  A's own packages (Python has run them before A: a package ``__init__`` that re-exports its
  submodules is no circle, in Optuna's layout or ours); ``if TYPE_CHECKING:`` imports do not
  run and do not count. A circle is a strongly connected component of two or more;
* **per-trial path** (``--trace``): one real tuning run (cost model backend, accuracy mode, so
  the error step runs too) with a profiler that records, inside each trial's objective, every
  call that enters a ``qdq_optuna`` module from another ``qdq_optuna`` module. Printed: the
  entries of the first trial that measured a model, in call order, and per module how often it
  was entered; an *upward* entry is one into a module that (transitively) imports the caller;
* **run walk** (``--walk``): one whole ``tune`` run (the same model and settings) with a
  profiler that records each step ``tune()`` takes (the calls its ``run`` makes) and the
  package folders each step enters, and every call from one of the run's owners into another:
  ``tune()`` itself, preparing (``search/_prepare.py``), the search (the rest of ``search/``)
  and the outputs (``outputs/``); a *hop back* is a call into an owner earlier in that order
  (a return is none).

    python benchmarks/structure.py                 # this checkout
    python benchmarks/structure.py --root OTHER    # another checkout (e.g. to measure main)
    python benchmarks/structure.py --trace         # also the per-trial path (about 20 s)
    python benchmarks/structure.py --walk          # also the walk of one tune run
    python benchmarks/structure.py --json out.json

Exit code 1 when a unit is over its limit or a circle exists (``--no-fail`` to only report).
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
from pathlib import Path

CLASS_LIMIT = 400
FUNCTION_LIMIT = 80
PACKAGE = "qdq_optuna"


def modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package under ``root``."""
    out = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


# -- units ---------------------------------------------------------------------------------------
def units(root: Path) -> list[dict]:
    """Every class and function of the package with its length in lines."""
    rows = []
    for name, path in modules(root).items():
        tree = ast.parse(path.read_text(encoding="utf-8"))

        def walk(node: ast.AST, prefix: str, name: str = name) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    start = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                    kind = "class" if isinstance(child, ast.ClassDef) else "function"
                    qual = f"{prefix}{child.name}"
                    rows.append({"module": name, "unit": qual, "kind": kind,
                                 "lines": child.end_lineno - start + 1, "line": child.lineno})
                    walk(child, qual + ".")
                else:
                    walk(child, prefix)

        walk(tree, "")
    return rows


def too_long(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r["lines"] > (CLASS_LIMIT if r["kind"] == "class" else FUNCTION_LIMIT)]


def module_lines(root: Path) -> dict[str, int]:
    return {name: len(path.read_text(encoding="utf-8").splitlines())
            for name, path in modules(root).items()}


# -- imports -------------------------------------------------------------------------------------
def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """Modules of the package that ``module`` imports (resolved, run-time imports only)."""
    found: set[str] = set()
    base = module.split(".") if is_package else module.split(".")[:-1]

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for sub in child.orelse:
                    visit(sub)
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names if a.name.startswith(PACKAGE))
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    parent = base[: len(base) - child.level + 1]
                    target = ".".join(parent + ([child.module] if child.module else []))
                else:
                    target = child.module or ""
                if target.startswith(PACKAGE):
                    found.add(target)
                    found.update(f"{target}.{a.name}" for a in child.names)  # submodules
            visit(child)

    visit(tree)
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    mods = modules(root)
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        targets = _imports(ast.parse(path.read_text(encoding="utf-8")), name,
                           path.name == "__init__.py")
        own = {name.rsplit(".", k)[0] for k in range(1, name.count(".") + 1)} | {PACKAGE}
        edges = set()
        for t in targets:
            while t and t not in own:  # a submodule import runs its packages' __init__ too
                if t in mods and t != name:
                    edges.add(t)
                t = t.rpartition(".")[0]
        graph[name] = edges
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with two or more modules (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def reaches(graph: dict[str, set[str]], a: str, b: str) -> bool:
    """Whether ``a`` imports ``b``, directly or through other modules."""
    seen, todo = set(), [a]
    while todo:
        v = todo.pop()
        for w in graph.get(v, ()):
            if w == b:
                return True
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return False


# -- the per-trial path --------------------------------------------------------------------------
#: the child scripts' one profiled ``tune`` run (a tiny residual model on the cost model)
_ONE_TUNE = r"""
with tempfile.TemporaryDirectory() as tmp:
    model = Path(tmp) / "m.onnx"
    model.write_bytes(zoo.build("tiny_residual").SerializeToString())
    sys.setprofile(profile)
    try:
        qdq_optuna.tune(str(model), str(Path(tmp) / "out"), benchmark="costmodel",
                        config=Config(schemes_per_region=6, refine_rounds=0),
                        max_output_error=1e9, progress=False)
    finally:
        sys.setprofile(None)
"""

_TRACE_CHILD = r"""
import json, sys, tempfile, os
from pathlib import Path
import qdq_optuna
from qdq_optuna import Config
from qdq_optuna.examples import zoo
root = Path(qdq_optuna.__file__).resolve().parent

def module_of(frame):
    f = frame.f_code.co_filename
    try:
        rel = Path(f).resolve().relative_to(root)
    except ValueError:
        return None
    parts = ["qdq_optuna", *rel.with_suffix("").parts]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)

trials, current, depth = [], None, [0]
def nearest(frame):
    while frame is not None:
        m = module_of(frame)
        if m is not None:
            return m
        frame = frame.f_back
    return None

def profile(frame, event, arg):
    global current
    if event == "call":
        if frame.f_code.co_name == "objective" and module_of(frame) and current is None:
            current = {"entries": []}
            depth[0] = id(frame)
            return
        if current is None:
            return
        callee = module_of(frame)
        if callee is None:
            return
        caller = nearest(frame.f_back)
        if caller is not None and caller != callee:
            current["entries"].append([caller, callee, frame.f_code.co_name])
    elif event == "return" and current is not None and id(frame) == depth[0] \
            and frame.f_code.co_name == "objective":
        trials.append(current)
        current = None

"""+_ONE_TUNE+r"""json.dump(trials, sys.stdout)
"""


def trace_trial(root: Path) -> dict:
    """The module entries of one measured trial's objective, from a real run under ``root``."""
    proc = subprocess.run([sys.executable, "-c", _TRACE_CHILD, str(root)], capture_output=True,
                          text=True, cwd=root, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"trace run failed:\n{proc.stderr[-3000:]}")
    trials = json.loads(proc.stdout)
    measured = [t for t in trials
                if any(c.startswith(f"{PACKAGE}.backends.") for _, c, _ in t["entries"])]
    pick = measured[0] if measured else max(trials, key=lambda t: len(t["entries"]))
    graph = import_graph(root)
    counts: dict[str, int] = {}
    upward = []
    for caller, callee, fn in pick["entries"]:
        counts[callee] = counts.get(callee, 0) + 1
        if reaches(graph, callee, caller):
            upward.append(f"{caller} -> {callee}.{fn}")
    path = []  # consecutive entries into the same module collapsed
    for caller, callee, fn in pick["entries"]:
        step = f"{caller.removeprefix(PACKAGE + '.')} -> {callee.removeprefix(PACKAGE + '.')}"
        if not path or path[-1][0] != step:
            path.append([step, 1, fn])
        else:
            path[-1][1] += 1
    return {"entries": len(pick["entries"]), "per_module": dict(sorted(counts.items())),
            "upward": sorted(set(upward)), "path": path, "trials_traced": len(trials)}


# -- the walk of one run --------------------------------------------------------------------------
_WALK_CHILD = r"""
import json, sys, tempfile
from pathlib import Path
import qdq_optuna
import qdq_optuna._tune  # the pipeline's modules imported before the profiler starts
from qdq_optuna import Config
from qdq_optuna.examples import zoo
root = Path(qdq_optuna.__file__).resolve().parent
known = {}

def module_of(code):
    f = code.co_filename
    if f not in known:
        try:
            parts = ["qdq_optuna", *Path(f).resolve().relative_to(root).with_suffix("").parts]
            known[f] = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        except ValueError:
            known[f] = None
    return known[f]

def owner(m):
    if m is None:
        return None
    if m == "qdq_optuna.search._prepare":
        return "prepare"
    if m == "qdq_optuna._tune":
        return "tune"
    for o in ("search", "outputs"):
        if m.startswith(f"qdq_optuna.{o}"):
            return o
    return None

def caller_owner(frame):
    while frame is not None:
        o = owner(module_of(frame.f_code))
        if o is not None:
            return o
        frame = frame.f_back
    return None

steps, calls, step_frame = [], [], [None]
def profile(frame, event, arg):
    if event == "return" and frame is step_frame[0]:
        step_frame[0] = None
    if event != "call" or frame.f_code.co_name == "<module>":
        return
    m = module_of(frame.f_code)
    if m is None:
        return
    back = frame.f_back
    if back is not None and back.f_code.co_name == "run" and module_of(back.f_code) == "qdq_optuna._tune":
        steps.append({"step": frame.f_code.co_qualname, "stages": []})
        step_frame[0] = frame
    parts = m.split(".")
    stage = "search/_prepare" if m == "qdq_optuna.search._prepare" else (
        parts[1] if len(parts) > 2 else "(top level)")
    if step_frame[0] is not None and stage not in steps[-1]["stages"]:
        steps[-1]["stages"].append(stage)
    o = owner(m)
    if o is None or back is None or owner(module_of(back.f_code)) == o:
        return
    c = caller_owner(back)
    if c is not None and c != o:
        calls.append([c, o, m.removeprefix("qdq_optuna.") + "." + frame.f_code.co_qualname])

"""+_ONE_TUNE+r"""json.dump({"steps": steps, "calls": calls}, sys.stdout)
"""

#: the run's owners in pipeline order (a call into an earlier one is a hop back)
OWNERS = ("tune", "prepare", "search", "outputs")


def walk_run(root: Path) -> dict:
    """The steps of one ``tune`` run under ``root`` with the folders each enters, the calls
    from one owner into another (``[caller, callee, function]``) and the hops back among
    them: calls into an owner earlier in :data:`OWNERS`."""
    proc = subprocess.run([sys.executable, "-c", _WALK_CHILD], capture_output=True, text=True,
                          cwd=root, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"walk run failed:\n{proc.stderr[-3000:]}")
    found = json.loads(proc.stdout)
    rank = {o: i for i, o in enumerate(OWNERS)}
    kinds: dict[str, int] = {}
    for caller, callee, fn in found["calls"]:
        key = f"{caller} -> {callee} ({fn})" + (" BACK" if rank[callee] < rank[caller] else "")
        kinds[key] = kinds.get(key, 0) + 1
    back = sum(rank[callee] < rank[caller] for caller, callee, _ in found["calls"])
    return {"steps": found["steps"], "calls": kinds, "owner_calls": len(found["calls"]),
            "hops_back": back}


# -- the command ---------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default=str(Path(__file__).resolve().parents[1]))
    ap.add_argument("--trace", action="store_true", help="also trace one trial's call path")
    ap.add_argument("--walk", action="store_true", help="also walk one whole tune run")
    ap.add_argument("--json", help="write the figures to this file")
    ap.add_argument("--no-fail", action="store_true")
    args = ap.parse_args(argv)
    root = Path(args.root).resolve()
    rows = units(root)
    over = too_long(rows)
    graph = import_graph(root)
    loops = circles(graph)
    lines = module_lines(root)
    report = {"root": str(root), "modules": len(lines), "lines": sum(lines.values()),
              "module_lines": lines, "classes": sum(r["kind"] == "class" for r in rows),
              "functions": sum(r["kind"] == "function" for r in rows), "over_limit": over,
              "largest": sorted(rows, key=lambda r: -r["lines"])[:12], "circles": loops}
    print(f"{root}: {report['modules']} modules, {report['lines']} lines, "
          f"{report['classes']} classes, {report['functions']} functions")
    print(f"\nover the limits (class > {CLASS_LIMIT}, function > {FUNCTION_LIMIT} lines): "
          f"{len(over)}")
    for r in sorted(over, key=lambda r: -r["lines"]):
        print(f"  {r['lines']:5d}  {r['kind']:<8} {r['module']}.{r['unit']} (line {r['line']})")
    print(f"\nimport circles: {len(loops)}")
    for c in loops:
        print("  " + " <-> ".join(m.removeprefix(PACKAGE + ".") for m in c))
    if args.trace:
        t = trace_trial(root)
        report["trial"] = t
        print(f"\nper-trial path ({t['entries']} module entries in one measured trial):")
        for step, n, fn in t["path"]:
            print(f"  {step}" + (f" x{n}" if n > 1 else "") + f"   ({fn}{', ...' if n > 1 else ''})")
        print("entries per module: " + ", ".join(
            f"{m.removeprefix(PACKAGE + '.')} {n}" for m, n in t["per_module"].items()))
        print(f"upward entries (into a module that imports the caller): {len(t['upward'])}")
        for u in t["upward"]:
            print(f"  {u}")
    if args.walk:
        w = walk_run(root)
        report["walk"] = w
        print("\nthe steps of one tune run, and the folders each enters:")
        for step in w["steps"]:
            print(f"  {step['step']}: {', '.join(step['stages']) or '-'}")
        print(f"calls from one owner into another ({w['owner_calls']}; hops back: "
              f"{w['hops_back']}):")
        for call, n in w["calls"].items():
            print(f"  {call}" + (f" x{n}" if n > 1 else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0 if args.no_fail or (not over and not loops) else 1


if __name__ == "__main__":
    sys.exit(main())
