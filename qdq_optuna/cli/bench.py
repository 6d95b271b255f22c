"""Sampler comparisons from YAML recipes: ``qdq-optuna bench RECIPE``.

A recipe names models x samplers x seeds x budgets on one backend (see ``studies/``; those ship
with the package and are found by name: ``qdq-optuna bench smoke``). Every
combination is one ordinary tuning run, ``tune(...)`` into ``DIR/runs/<name>/``; when it ends,
its record goes to ``DIR/runs/<name>/record.json``. A run with a record is skipped on the next
invocation; an interrupted run resumes through tune's own resume. After the runs,
``DIR/results.csv`` / ``DIR/results.json`` (one row per run), ``DIR/summary.md`` and
``DIR/bench.png`` are rewritten from all records of the recipe (the plot needs matplotlib;
without it the rest is written and one warning says so).

**Progress curve of a run.** Read back from the run's ``studies.db``. The x axis is the
cumulative number of *measurements*: times the backend was asked to time a model, counted as the
search counts them for ``report.json`` (the baseline, the whole-model starts, each visit's
reference when it was not measured before, each trial's own count, which is 0 for a model
already measured in the run, one per commit confirmation, the choice between lanes, and the final
A/B). At every point the y value is the speedup over the baseline of the fastest whole model the
run had measured so far (a feasible start, or a visit's trial: every trial is timed as a whole
model). For a deterministic backend (``costmodel``) the last point is the speedup of the saved
model; for a measured backend it is the search's own estimate, and ``speedup`` in the results
is the independent final A/B.

**measurements_to_99pct.** The best-known speedup of a model is the highest final curve value
over all runs of the recipe for that model. A run's ``measurements_to_99pct`` is the x of the
first curve point at or above 99 % of that speedup; empty when the run never gets there.

``wall_s`` is the time of the invocation that finished the run (a resumed run counts only its
last part); ``report_measurements`` is ``report.json``'s count, which also covers only the last
invocation, while ``measurements`` covers the whole run.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from qdq_optuna._files import atomic_write_bytes
from qdq_optuna.errors import UserError

log = logging.getLogger("qdq_optuna")
#: a run "reached" the best-known result once it is within this fraction of it
TARGET_FRACTION = 0.99
CSV_COLUMNS = (
    "model", "sampler", "seed", "budget", "backend", "baseline_ms", "final_ms", "speedup",
    "measurements", "measurements_to_99pct", "best_known_speedup", "curve_speedup", "wall_s",
    "complete", "run",
)
SIZES = ("small", "medium", "full")
MODES = ("quick", "default", "extensive")
TIMINGS = ("fast", "robust")
RECIPE_KEYS = {
    "name": "a short name (default: the file name)",
    "description": "free text",
    "backend": "costmodel, onnxruntime, ... (default costmodel)",
    "models": "zoo names (resnet, mobilenet, ...) or paths to .onnx files",
    "size": "zoo model size: small, medium or full (default medium)",
    "samplers": "sampler names (qdq, tpe, cmaes, random, ...)",
    "seeds": "a list of integer seeds, or a count n for seeds 0..n-1",
    "budgets": "a list of schemes_per_region values",
    "mode": "quick, default or extensive (default: default)",
    "timing": "fast or robust (default robust)",
    "threads": "ONNX Runtime intra-op threads (default 1)",
    "config": "further Config settings (mapping)",
    "output": "default output folder (relative to the working directory)",
}


@dataclass(frozen=True)
class RunSpec:
    model: str
    sampler: str
    seed: int
    budget: int

    @property
    def name(self) -> str:
        return f"{self.model}-{self.sampler}-s{self.seed}-b{self.budget}"


@dataclass
class Recipe:
    path: Path
    name: str
    models: list[str]
    samplers: list[str]
    seeds: list[int]
    budgets: list[int]
    backend: str = "costmodel"
    size: str = "medium"
    mode: str = "default"
    timing: str = "robust"
    threads: int = 1
    config: dict = field(default_factory=dict)
    output: str | None = None
    description: str = ""

    def runs(self) -> list[RunSpec]:
        return [RunSpec(_model_label(m), s, seed, b) for m in self.models for b in self.budgets
                for s in self.samplers for seed in self.seeds]

    def model_source(self, label: str) -> str:
        return next(m for m in self.models if _model_label(m) == label)

    def default_output(self) -> Path:
        return Path(self.output) if self.output else Path("runs") / self.name


def _model_label(model: str) -> str:
    return Path(model).stem if model.endswith(".onnx") else model


# -- recipes -------------------------------------------------------------------------------------
def recipe_dir() -> Path:
    """The shipped recipes: ``qdq_optuna/studies`` in an installed wheel, the repository's
    ``studies/`` folder in a source checkout."""
    installed = Path(__file__).resolve().parents[1] / "studies"
    if installed.is_dir():
        return installed
    return Path(__file__).resolve().parents[2] / "studies"


def recipe_names() -> list[str]:
    folder = recipe_dir()
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []


def find_recipe(recipe: str | Path) -> Path:
    """A recipe file: ``recipe`` itself when it names a file, else the shipped recipe of that
    name (``smoke`` or ``smoke.yaml``)."""
    path = Path(recipe)
    if path.is_file() or path.parent != Path("."):
        return path
    shipped = recipe_dir() / (path.name if path.suffix in (".yaml", ".yml") else f"{path.name}.yaml")
    if shipped.is_file():
        return shipped
    raise UserError(f"{recipe}: no such recipe file, and not a shipped recipe "
                    f"({', '.join(recipe_names()) or 'none found'})")


def load_recipe(path: str | Path) -> Recipe:
    """Read and check a recipe (a path or a shipped recipe's name); any problem is one
    :class:`UserError` line naming file and key."""
    path = find_recipe(path)
    return _RecipeDoc(path, _read_recipe(path)).recipe()


def _read_recipe(path: Path) -> dict:
    """The recipe's YAML mapping, its keys checked (known, and the required ones there)."""
    where = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{where}: cannot read the recipe ({exc})") from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        first = " ".join(str(exc).split())
        raise UserError(f"{where}: not a safe YAML recipe ({first})") from None
    if not isinstance(doc, dict):
        raise UserError(f"{where}: expected a mapping of recipe keys ({', '.join(RECIPE_KEYS)})")
    for key in doc:
        if key not in RECIPE_KEYS:
            raise UserError(f"{where}: unknown key {key!r} (valid keys: {', '.join(RECIPE_KEYS)})")
    for key in ("models", "samplers", "seeds", "budgets"):
        if key not in doc:
            raise UserError(f"{where}: missing key {key!r} ({RECIPE_KEYS[key]})")
    return doc


class _RecipeDoc:
    """A recipe's values, each checked as it is read (errors name the file and the key)."""

    def __init__(self, path: Path, doc: dict) -> None:
        self.path = path
        self.doc = doc

    def fail(self, key: str, msg: str) -> UserError:
        return UserError(f"{self.path}: {key}: {msg}")

    def str_list(self, key: str) -> list[str]:
        v = self.doc[key]
        if not isinstance(v, list) or not v or not all(isinstance(x, str) and x for x in v):
            raise self.fail(key, f"expected a non-empty list of names, got {v!r}")
        if len(set(v)) != len(v):
            raise self.fail(key, f"duplicate entries in {v!r}")
        return list(v)

    def int_list(self, key: str, minimum: int) -> list[int]:
        v = self.doc[key]
        if key == "seeds" and _is_int(v) and v >= 1:
            return list(range(v))
        if not isinstance(v, list) or not v or not all(_is_int(x) and x >= minimum for x in v):
            raise self.fail(key, f"expected a non-empty list of integers >= {minimum}, got {v!r}")
        if len(set(v)) != len(v):
            raise self.fail(key, f"duplicate entries in {v!r}")
        return list(v)

    def choice(self, key: str, choices: tuple[str, ...], default: str) -> str:
        v = self.doc.get(key, default)
        if v not in choices:
            raise self.fail(key, f"unknown {v!r} (choose from {', '.join(choices)})")
        return v

    def text(self, key: str, default: str, what: str, plain: bool = False) -> str:
        v = self.doc.get(key, default)
        bad = not isinstance(v, str) or (plain and (not v or "/" in v or v.startswith(".")))
        if bad:
            raise self.fail(key, f"expected {what}, got {v!r}" if plain else f"expected {what}")
        return v

    def models(self) -> list[str]:
        from qdq_optuna.examples import zoo

        models = self.str_list("models")
        for m in models:
            if m.endswith(".onnx"):
                if not (self.path.parent / m).is_file():
                    raise self.fail("models", f"{m}: no such file (paths are relative to the "
                                              "recipe)")
            elif m not in zoo.EXAMPLES:
                raise self.fail("models", f"unknown zoo model {m!r} (zoo: "
                                          f"{', '.join(zoo.EXAMPLES)}; or a path ending in .onnx)")
        labels = [_model_label(m) for m in models]
        if len(set(labels)) != len(labels):
            raise self.fail("models", f"two models share the name {labels!r}")
        return models

    def samplers(self) -> list[str]:
        from qdq_optuna.search.samplers import SAMPLERS

        samplers = self.str_list("samplers")
        for s in samplers:
            if s not in SAMPLERS:
                raise self.fail("samplers", f"unknown sampler {s!r} (choose from "
                                            f"{', '.join(SAMPLERS)})")
        return samplers

    def config(self, mode: str) -> dict:
        from qdq_optuna.config import Config

        config = self.doc.get("config") or {}
        if not isinstance(config, dict):
            raise self.fail("config", "expected a mapping of Config settings")
        known = {f.name for f in Config.__dataclass_fields__.values()}
        for k in config:
            if k not in known or k == "schemes_per_region":
                why = "use budgets" if k == "schemes_per_region" else "not a Config setting"
                raise self.fail(f"config.{k}", why)
        try:
            Config.preset(mode, **config)
        except (TypeError, UserError) as exc:
            raise self.fail("config", " ".join(str(exc).split())) from None
        return config

    def recipe(self) -> Recipe:
        doc = self.doc
        name = self.text("name", self.path.stem, "a plain name", plain=True)
        description = self.text("description", "", "text")
        backend = doc.get("backend", "costmodel")
        if not isinstance(backend, str) or not backend:
            raise self.fail("backend", f"expected a backend name, got {backend!r}")
        models, samplers = self.models(), self.samplers()
        seeds, budgets = self.int_list("seeds", 0), self.int_list("budgets", 1)
        threads = doc.get("threads", 1)
        if not _is_int(threads) or threads < 1:
            raise self.fail("threads", f"expected an integer >= 1, got {threads!r}")
        mode = self.choice("mode", MODES, "default")
        config = self.config(mode)
        output = doc.get("output")
        if output is not None and (not isinstance(output, str) or not output):
            raise self.fail("output", f"expected a folder name, got {output!r}")
        return Recipe(
            path=self.path, name=name, description=description, backend=backend, models=models,
            size=self.choice("size", SIZES, "medium"), samplers=samplers, seeds=seeds,
            budgets=budgets, mode=mode, timing=self.choice("timing", TIMINGS, "robust"),
            threads=threads, config=config, output=output,
        )


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# -- one run -------------------------------------------------------------------------------------
def model_path(recipe: Recipe, label: str, out: Path) -> Path:
    """The ONNX file of a recipe model; zoo models are written once to ``out/models/``."""
    source = recipe.model_source(label)
    if source.endswith(".onnx"):
        return (recipe.path.parent / source).resolve()
    target = out / "models" / f"{label}-{recipe.size}.onnx"
    if not target.is_file():
        from qdq_optuna.examples import zoo

        atomic_write_bytes(target, zoo.build(label, recipe.size).SerializeToString())
    return target.resolve()


def run_one(recipe: Recipe, spec: RunSpec, out: Path) -> dict:
    """Run (or resume) one tuning run and write its record; returns the record."""
    from qdq_optuna import tune
    from qdq_optuna.config import Config

    run_dir = out / "runs" / spec.name
    config = Config.preset(recipe.mode, **{**recipe.config, "schemes_per_region": spec.budget})
    started = time.monotonic()
    result = tune(
        model_path(recipe, spec.model, out), run_dir, benchmark=recipe.backend, config=config,
        sampler=spec.sampler, seed=spec.seed, timing=recipe.timing, threads=recipe.threads,
        run_id=spec.name, progress=False,
    )
    wall = time.monotonic() - started
    report = result.report
    history = run_history(run_dir, spec.name)
    record = {
        "model": spec.model, "sampler": spec.sampler, "seed": spec.seed, "budget": spec.budget,
        "backend": recipe.backend, "size": recipe.size, "mode": recipe.mode,
        "timing": recipe.timing,
        "baseline_ms": report["baseline_latency_ms"], "final_ms": report["final_latency_ms"],
        "speedup": report["speedup"], "measurements": history["measurements"],
        "report_measurements": report["measurements"],
        "curve_speedup": history["curve"][-1][1], "wall_s": round(wall, 3),
        "complete": bool(report.get("complete", True)), "run": spec.name,
        "curve": history["curve"],
    }
    atomic_write_bytes(run_dir / "record.json", json.dumps(record, indent=1).encode())
    return record


def run_history(run_dir: Path, run_id: str) -> dict:
    """The progress curve of a finished run (see the module docstring), from its studies.db."""
    from qdq_optuna.record import progress_curve
    from qdq_optuna.record.storage import default_storage_url, open_storage, quiet_optuna

    quiet_optuna(False)
    storage = open_storage(default_storage_url(run_dir), heartbeat=False)
    try:
        return progress_curve(storage, run_id)  # see record/run.py
    finally:
        storage.remove_session()
        storage.engine.dispose()


def first_reach(curve: list[list[float]], target: float) -> int | None:
    for x, y in curve:
        if y >= target * (1 - 1e-12):
            return int(x)
    return None


def aggregate(recipe: Recipe, out: Path) -> list[dict]:
    """Records of all finished runs of the recipe, with the cross-run fields filled in."""
    records = []
    for spec in recipe.runs():
        p = out / "runs" / spec.name / "record.json"
        if p.is_file():
            records.append(json.loads(p.read_text()))
    best: dict[str, float] = {}
    for r in records:
        best[r["model"]] = max(best.get(r["model"], 0.0), r["curve_speedup"])
    for r in records:
        r["best_known_speedup"] = best[r["model"]]
        r["measurements_to_99pct"] = first_reach(r["curve"], TARGET_FRACTION * best[r["model"]])
    return records


def write_outputs(recipe: Recipe, out: Path, records: list[dict]) -> dict[str, Path]:
    paths = {"csv": out / "results.csv", "json": out / "results.json",
             "summary": out / "summary.md", "plot": out / "bench.png"}
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_COLUMNS, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in records:
        w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in CSV_COLUMNS})
    atomic_write_bytes(paths["csv"], buf.getvalue().encode())
    slim = [{k: v for k, v in r.items() if k != "curve"} for r in records]
    atomic_write_bytes(paths["json"], json.dumps(slim, indent=1).encode())
    atomic_write_bytes(paths["summary"], summary_markdown(recipe, records).encode())
    if not records:
        return paths
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        log.warning("%s not written: matplotlib is not installed (pip install matplotlib; "
                    "everything else is)", paths.pop("plot"))
        return paths
    plot(recipe, records, paths["plot"])
    return paths


def _median(values: list[float]) -> float:
    """Median where ``inf`` stands for "never reached"."""
    return statistics.median(sorted(values)) if values else math.nan


def _fmt(v: float, spec: str) -> str:
    return "not reached" if math.isinf(v) else "-" if math.isnan(v) else format(v, spec)


def summary_rows(records: list[dict]) -> list[dict]:
    """One row per (model, budget, sampler): medians over seeds."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["model"], r["budget"], r["sampler"]), []).append(r)
    rows = []
    for (model, budget, sampler), rs in groups.items():
        reach = [math.inf if r["measurements_to_99pct"] is None else r["measurements_to_99pct"]
                 for r in rs]
        rows.append({
            "model": model, "budget": budget, "sampler": sampler, "runs": len(rs),
            "reached": sum(1 for v in reach if not math.isinf(v)),
            "median_to_99pct": _median(reach),
            "median_speedup": _median([r["speedup"] for r in rs]),
            "min_speedup": min(r["speedup"] for r in rs),
            "max_speedup": max(r["speedup"] for r in rs),
            "median_measurements": _median([r["measurements"] for r in rs]),
            "best_known_speedup": rs[0]["best_known_speedup"],
        })
    return rows


def summary_markdown(recipe: Recipe, records: list[dict]) -> str:
    lines = [f"# {recipe.name}", ""]
    if recipe.description:
        lines += [" ".join(recipe.description.split()), ""]
    lines += [f"backend `{recipe.backend}`, size `{recipe.size}`, mode `{recipe.mode}`, timing "
              f"`{recipe.timing}`; {len(records)} of {len(recipe.runs())} runs finished. "
              f"Medians over seeds; \"to 99 %\" = measurements until the run's progress curve "
              f"first reaches {TARGET_FRACTION:.0%} of the best speedup any run found for the model.",
              ""]
    rows = summary_rows(records)
    for model in dict.fromkeys(r["model"] for r in rows):
        for budget in dict.fromkeys(r["budget"] for r in rows if r["model"] == model):
            sel = [r for r in rows if r["model"] == model and r["budget"] == budget]
            lines += [f"## {model} (budget {budget}; best known {sel[0]['best_known_speedup']:.3f}x)",
                      "",
                      "| sampler | runs | measurements to 99 % (reached) | final speedup "
                      "(min-max) | measurements |",
                      "|---|---:|---:|---:|---:|"]
            order = {s: i for i, s in enumerate(recipe.samplers)}
            for r in sorted(sel, key=lambda r: order.get(r["sampler"], 99)):
                lines.append(
                    f"| {r['sampler']} | {r['runs']} | {_fmt(r['median_to_99pct'], '.0f')} "
                    f"({r['reached']}/{r['runs']}) | {r['median_speedup']:.3f}x "
                    f"({r['min_speedup']:.3f}-{r['max_speedup']:.3f}) | "
                    f"{_fmt(r['median_measurements'], '.0f')} |")
            lines.append("")
    return "\n".join(lines)


def _step(curve: list[list[float]], xs) -> list[float]:
    """The curve as a step function sampled at ``xs`` (its first value before it starts, its
    last after it ends: a finished run keeps its result)."""
    import bisect

    cx = [c[0] for c in curve]
    return [curve[max(0, bisect.bisect_right(cx, x) - 1)][1] for x in xs]


def plot(recipe: Recipe, records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    models = list(dict.fromkeys(r["model"] for r in records))
    cols = min(2, len(models))
    rows = math.ceil(len(models) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.0 * cols, 4.0 * rows), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    multi_budget = len({r["budget"] for r in records}) > 1
    for ax, model in zip(axes.flat, models):
        rs = [r for r in records if r["model"] == model]
        xmax = max(r["curve"][-1][0] for r in rs)
        xs = np.arange(1, xmax + 1)
        keys = list(dict.fromkeys((r["sampler"], r["budget"]) for r in rs))
        order = {s: i for i, s in enumerate(recipe.samplers)}
        keys.sort(key=lambda k: (order.get(k[0], 99), k[1]))
        for i, (sampler, budget) in enumerate(keys):
            group = [r for r in rs if (r["sampler"], r["budget"]) == (sampler, budget)]
            end = max(r["curve"][-1][0] for r in group)
            gx = xs[xs <= end]
            ys = np.array([_step(r["curve"], gx) for r in group])
            color = colors[i % len(colors)]
            label = f"{sampler} (b{budget})" if multi_budget else sampler
            label += f", {len(group)} seed{'s' if len(group) > 1 else ''}"
            ax.plot(gx, np.median(ys, axis=0), color=color, label=label, lw=1.6,
                    drawstyle="steps-post")
            ax.fill_between(gx, ys.min(axis=0), ys.max(axis=0), color=color, alpha=0.15, lw=0,
                            step="post")
        best = rs[0]["best_known_speedup"]
        ax.axhline(TARGET_FRACTION * best, color="grey", ls=":", lw=1)
        ax.set_title(f"{model} ({recipe.size}); best known {best:.3f}x", fontsize=10)
        ax.set_xlabel("measurements")
        ax.set_ylabel("speedup if stopped here")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    for ax in list(axes.flat)[len(models):]:
        ax.set_visible(False)
    fig.suptitle(f"{recipe.name} (backend {recipe.backend})\nline: median over seeds; band: "
                 f"min-max over seeds; dotted: {TARGET_FRACTION:.0%} of the best known", fontsize=9)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())


# -- the command ---------------------------------------------------------------------------------
def bench(recipe_path: str | Path, output: str | Path | None = None, only: str | None = None,
          echo: Callable[[str], None] | None = print) -> tuple[list[dict], dict[str, Path]]:
    """Run every (model, sampler, seed, budget) of a recipe that has no record yet (filtered by
    ``only``, a substring of the run name), then rewrite the results. Returns (records, paths)."""
    recipe = load_recipe(recipe_path)
    recipe_path = recipe.path
    out = Path(output) if output is not None else recipe.default_output()
    if out.exists() and not out.is_dir():
        raise UserError(f"--output {out}: exists and is not a folder")
    specs = [s for s in recipe.runs() if only is None or only in s.name]
    if not specs:
        raise UserError(f"--only {only!r}: matches none of the {len(recipe.runs())} runs of "
                        f"{recipe_path}")
    say = echo or (lambda _: None)
    for i, spec in enumerate(specs, 1):
        tag = f"[{i}/{len(specs)}] {spec.name}"
        if (out / "runs" / spec.name / "record.json").is_file():
            say(f"{tag}: done before, skipped")
            continue
        r = run_one(recipe, spec, out)
        say(f"{tag}: {r['speedup']:.3f}x in {r['measurements']} measurements ({r['wall_s']:.0f} s)")
    records = aggregate(recipe, out)
    paths = write_outputs(recipe, out, records)
    return records, paths
