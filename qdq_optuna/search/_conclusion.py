"""The conclusion's parts that read only what they are given: the baseline every speedup is
against, the user's model shipped when the tuned one measured slower, what the accuracy guard
measured of what ships, the report's header, and a finished run's stored report."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import onnx

from qdq_optuna.backends.base import Backend
from qdq_optuna.measure.repair import read_ran
from qdq_optuna.measure.timing import Comparison, Until
from qdq_optuna.model.graph import InputShapes
from qdq_optuna.placement.export import QDQExporter, QuantPlan, plan_uses
from qdq_optuna.placement.rules import Preprocess
from qdq_optuna.record import AgreedStarts, PatternStanding, RunRecord
from qdq_optuna.run_folder import RunFolder
from qdq_optuna.runtimes import Runtime
from qdq_optuna.runtimes.prepared import PreparedModel
from qdq_optuna.search._guard import Guard, Verdict, check_default_session
from qdq_optuna.search._options import TuneOptions
from qdq_optuna.search._outcome import AccuracyModes, RunHeader, ShippedAccuracy, StoppedOutcome
from qdq_optuna.search._plans import PlanMeasurer
from qdq_optuna.search._recipe_file import (
    RecipeFile,
    conclude_recipe_files,
    shipped_accuracy,
    shipped_recipe_file,
)
from qdq_optuna.search._runtime_settings import SettingsChoice, choose_settings
from qdq_optuna.search._settings import Settings
from qdq_optuna.search.samplers import sampler_name

log = logging.getLogger("qdq_optuna")


def baseline_of(prepared: PreparedModel, exporter: QDQExporter, model, input_shapes
                ) -> tuple[object, str, str]:
    """What every speedup is measured against: ``(source, memo key, description)``: the
    user's model as given, or converted to the run's high precision (no Q/DQ)."""
    hp = prepared.high_precision
    if hp is not None:
        data = hp.model.SerializeToString()
        return (data, "baseline:" + _sha(data),
                f"the user's model converted to {hp.precision} (no Q/DQ)")
    if prepared.preprocess is Preprocess.NONE:  # the graph searched on is the model
        plan = exporter.plan(set())
        return exporter.source(plan), plan.key, "the user's model as given"
    # ONNX Runtime's preprocessing changed the graph: the user's file
    data = user_model(model, input_shapes).SerializeToString()
    return data, "baseline:" + _sha(data), "the user's model as given"


def keep_users_model(cmp, baseline: tuple[object, str, str], folder: RunFolder,
                     plans: PlanMeasurer, guard: Guard, final_exporter: QDQExporter,
                     precision: str):
    """The search's model measured slower than the baseline (the user's model, or its
    high-precision conversion; a graph the preprocessing or the opset upgrade made slower
    can do that): the baseline ships instead, re-measured the same way, and the report
    says what the tuned model measured. Returns what the conclusion goes on with: the
    report's ``kept_your_model``, the plan, the bytes and the A/B that ship, the verdict."""
    source, _, what = baseline
    log.warning("the tuned model measured %.3fx the latency of %s (95%% interval %.3f-%.3f): "
                "optimized.onnx is that model instead", cmp.ratio, what, cmp.ci_low,
                cmp.ci_high)
    folder.write_optimized(source)
    kept = {"baseline_model": what, "tuned_comparison": cmp.to_dict()}
    plan = final_exporter.plan(set())
    cmp = plans.same_model(source, "final")
    verdict = guard.ship(guard.exporter.plan(set()), precision)
    return kept, plan, source, cmp, verdict


@dataclass
class Shipped:
    """What the conclusion ships: the lane's pattern rows, the plan and its exporter, the bytes
    written as ``optimized.onnx`` (None: a model written piece by piece), its final A/B against
    the baseline and what the guard measured of it."""

    rows: list[PatternStanding]
    plan: QuantPlan
    exporter: QDQExporter
    final_bytes: bytes | None
    comparison: Comparison
    accuracy: ShippedAccuracy
    #: the runtime session settings it ships with (and those tried)
    session: SettingsChoice


def conclude(lane: str, *, record: RunRecord, plans: PlanMeasurer, guard: Guard,
             final_exporter: QDQExporter, precision: str, recipe_files: list[RecipeFile],
             baseline: tuple[object, str, str], folder: RunFolder, profile: Runtime,
             settings: Settings, in_time: Callable[[], bool],
             mark: Callable[[str], None]) -> Shipped:
    """``lane``'s standing model guarded (:meth:`Guard.ship`) and saved as ``optimized.onnx``
    (``precision``: the run's high precision), the runtime's recipe files measured against
    it, and its independent A/B against ``baseline`` (the user's model ships instead when the
    tuned one measured slower); ``mark`` ends each of these steps."""
    uses, rows = record.committed(lane)
    verdict = guard.ship(guard.exporter.plan(plan_uses(final_exporter.plan(uses))), precision,
                         what_ran=partial(read_ran, plans.measurer.backend, guard.exporter))
    plan = final_exporter.plan(plan_uses(verdict.plan))  # what ships
    final_bytes = folder.save_optimized(guard.shipped_exporter(final_exporter), plan)
    corrected = guard.correction_keys(plan)
    mark("guard")
    plan, final_bytes, measured_files = conclude_recipe_files(recipe_files, plan, final_bytes,
                                                              final_exporter)
    mark("recipe_file")
    base_bytes, base_key, _ = baseline
    session = (SettingsChoice(listed=bool(profile.session_settings))
               if plan.key == base_key or not plan.quantized or settings.multi_objective
               else choose_settings(profile, plans.measurer.backend, plans, guard.bound,
                                    final_bytes))  # no Q/DQ, or a front: no settings to ship
    mark("session_settings")
    cmp = (plans.same_model(final_bytes, "final") if plan.key == base_key  # no Q/DQ added
           else plans.compare(session.source(final_bytes), base_bytes, "final",
                              until=Until.PRECISION))
    mark("final")
    kept = None
    if cmp.verdict == "slower" and isinstance(base_bytes, bytes) and not settings.multi_objective:
        kept, plan, final_bytes, cmp, verdict = keep_users_model(
            cmp, baseline, folder, plans, guard, final_exporter, precision)
        session.baseline_ships()
    accuracy = concluded_accuracy(
        guard, verdict, profile=profile, plans=plans, settings=settings,
        recipe_files=measured_files, kept=kept, corrected=corrected, final_bytes=final_bytes,
        in_time=in_time)
    mark("finish")
    return Shipped(rows, plan, final_exporter, final_bytes, cmp, accuracy, session)


def concluded_accuracy(guard: Guard, verdict: Verdict, *, profile: Runtime,
                       plans: PlanMeasurer, settings: Settings, recipe_files: list[dict],
                       kept: dict | None, corrected: dict, final_bytes, in_time
                       ) -> ShippedAccuracy:
    """What the guard measured of what ships: its figures, the recipe files measured, the
    user's model when it ships, the sensitivity of the guard's plan, the bias correction
    applied, the default ONNX Runtime session's check and the accuracy modes' settings."""
    evaluator = plans.scorer.evaluator
    accuracy = shipped_accuracy(guard.shipped_accuracy(
        verdict, scored_as=profile.scored_as(plans.scorer.bf16, evaluator.optimize,
                                             evaluator.runner)), recipe_files)
    if kept is not None:
        accuracy.kept_your_model = kept
    elif shipped_recipe_file(recipe_files) is None:  # the guard's plan ships
        accuracy.guard["sensitivity"] = guard.sensitivity(verdict.plan, in_time)
    if guard.corrected is not None:  # what ships: the recipe file, or no Q/DQ, has none
        accuracy.guard["bias_correction"] = (
            corrected if kept is None and shipped_recipe_file(recipe_files) is None
            else {"applied": False})
    check_default_session(accuracy.guard, plans.scorer, final_bytes)
    if settings.accuracy:  # the accuracy modes' keys
        accuracy.modes = AccuracyModes(list(settings.objectives), guard.bound.label,
                                       guard.bound.trial_budget)
    return accuracy


def finished_report(record: RunRecord, folder: RunFolder, fingerprint_digest: str | None,
                    run_id: str) -> dict | None:
    """The report of this run when it finished with these settings and this output
    folder holds that report and its model (a worker's own folder may not: it finishes)."""
    done = record.finished()
    if done is None or done.fingerprint != fingerprint_digest:
        return None
    text = folder.finished_report(done.report_sha256)
    if text is None:
        return None
    log.info("run %r finished on %s (speedup %.3fx): its report stands; --remeasure "
             "measures the final model again, --fresh starts over", run_id,
             done.at, done.speedup or float("nan"))
    return json.loads(text)


def read_what_ran(profile: Runtime, backend: Backend, model,
                  session: SettingsChoice | None = None) -> dict:
    """What the runtime ran for the shipped model (under the ``session`` settings it ships
    with), read by its profile (``what_ran``), or why it could not be (``what_ran_error``:
    the report still ships without it)."""
    try:
        source = model if session is None else session.source(model)
        return {"what_ran": profile.what_ran(backend, source) if isinstance(model, bytes)
                else None}
    except Exception as exc:  # the report still ships without it
        return {"what_ran_error": str(exc)}


def run_header(prepared: PreparedModel, backend: Backend, settings: Settings,
               options: TuneOptions, *, out: Path, run_id: str, storage: str,
               reader_clipped: int) -> RunHeader:
    """The report's first fields: what was tuned, where, how."""
    return RunHeader(prepared.source, str(out), run_id, storage, backend.describe(),
                     settings.runtime, prepared.quant_type, sampler_name(options.sampler),
                     options.timing.value, settings.scales.value, reader_clipped,
                     high_precision_summary(prepared))


def stopped_outcome(out: Path, header: RunHeader, record: RunRecord, plans: PlanMeasurer,
                    starts: AgreedStarts | None, *, signum: int, baseline_ms: float | None,
                    elapsed: dict[str, float]) -> StoppedOutcome:
    """What a run stopped by ``signum`` knows (read from the storage, nothing measured): the
    first lane's standing model, this process's measurements."""
    lane = starts.order[0] if starts is not None else ""
    rows = record.committed(lane)[1] if starts is not None else []
    return StoppedOutcome(out=out, header=header, record=record, signum=signum, lane=lane,
                          rows=rows, baseline_ms=baseline_ms, measurements=plans.measurements,
                          by_phase=dict(plans.by_phase), elapsed=dict(elapsed))


def state_counters(storage: str, fingerprint_digest: str | None, baseline_ms: float | None,
                   plans: PlanMeasurer | None) -> dict:
    """state.yaml's run fields: storage, fingerprint, baseline and this process's counters."""
    return {"storage": storage, "fingerprint": fingerprint_digest,
            "baseline_latency_ms": baseline_ms,
            "measurements": plans.measurements if plans is not None else 0,
            "cache_hits": plans.cache_hits if plans is not None else 0}


def high_precision_summary(prepared: PreparedModel) -> dict:
    """report.json's ``high_precision``: the float part's precision, whether the graph's
    inputs and outputs kept their types, the opsets and the nodes kept FP32 (with why)."""
    hp = prepared.high_precision
    if hp is None:
        return {"precision": "fp32", "keep_io_types": True, "kept_fp32": {}}
    return hp.describe()


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:24]


def user_model(model: str | os.PathLike | onnx.ModelProto, input_shapes: str | None
               ) -> onnx.ModelProto:
    """The user's model as given (its weights in memory), with ``--input-shapes`` applied:
    the baseline when ONNX Runtime's preprocessing changed the graph the search works on."""
    from qdq_optuna.model.graph import add_shapes_by_running, apply_input_shapes

    if isinstance(model, onnx.ModelProto):
        proto = onnx.ModelProto()
        proto.CopyFrom(model)
    else:
        proto = onnx.load(str(model))
    for vi in proto.graph.input:  # a stored dim <= 0 is symbolic (paddle2onnx writes -1)
        for d in vi.type.tensor_type.shape.dim:
            if d.HasField("dim_value") and d.dim_value <= 0:
                d.ClearField("dim_value")
    apply_input_shapes(proto, InputShapes.parse(input_shapes), "<model>")
    del proto.graph.value_info[:]  # inferred again by the runtime, from the fixed inputs
    # ... except where static inference cannot (a Reshape to a computed shape, as paddle2onnx
    # writes): the cost model reads shapes from the file alone
    add_shapes_by_running(proto)
    return proto
