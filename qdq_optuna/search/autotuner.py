"""Ask/tell for users with their own benchmark loop: we propose and export, you measure.

The example is on :class:`Autotuner`.

It is a thin face over the same pattern studies ``tune`` runs
(:class:`~qdq_optuna.search._pattern.PatternStudy`: the same study set-up, sampler, plans and
commit rule), in the order you choose; only the measuring is yours. A pattern's reference is
its empty scheme on top of your earlier commits (the first trial of each study), and a scheme
is committed when your figures say it beats the reference by ``performance_threshold`` (re-
measure before you submit if your figures are noisy: nothing confirms them). The final model
gets what ``tune()``'s gets: calibrated scales (``_prepare.calibrated_scales``) and the
accuracy guard (:class:`~qdq_optuna.search._guard.Guard`) on held-out or validation data.
"""

from __future__ import annotations

import os
from typing import Any

import onnx
import optuna
from optuna.trial import TrialState

from qdq_optuna.config import Config
from qdq_optuna.measure.accuracy import hold_out
from qdq_optuna.model.calibration import DEFAULT_METHOD
from qdq_optuna.model.graph import Use
from qdq_optuna.placement.export import QDQExporter, Scales
from qdq_optuna.placement.points import PatternPoints
from qdq_optuna.placement.scheme import ChoiceSpace, combine
from qdq_optuna.record import PatternAttr, RunRecord, TrialAttr
from qdq_optuna.record.storage import quiet_optuna
from qdq_optuna.runtimes import DEFAULT_RUNTIME, profile_for
from qdq_optuna.runtimes.prepared import PreparedModel
from qdq_optuna.search._commit import CommitRule
from qdq_optuna.search._guard import Guard, Verdict
from qdq_optuna.search._options import TuneOptions
from qdq_optuna.search._pattern import PatternStudy, Search, Seed
from qdq_optuna.search._plans import PlanMeasurer
from qdq_optuna.search._prepare import (
    accuracy_bound,
    asked_bound,
    calibrated_scales,
    error_scorer,
    read_data,
)
from qdq_optuna.search._settings import Settings
from qdq_optuna.search.samplers import SamplerArg


class Autotuner:
    """Ask/tell: the search proposes a scheme and exports its model, you measure it.

    ```python
    import time

    import numpy as np
    import onnx
    import onnxruntime as ort

    from qdq_optuna import Autotuner


    def benchmark(model_bytes: bytes) -> float | None:
        # median ms of 20 runs on ONNX Runtime's CPU provider (None: the model does not load)
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        try:
            session = ort.InferenceSession(model_bytes, options,
                                           providers=["CPUExecutionProvider"])
        except Exception:
            return None
        feed = {i.name: np.random.rand(*i.shape).astype(np.float32)
                for i in session.get_inputs()}
        session.run(None, feed)  # warm-up
        times = []
        for _ in range(20):
            start = time.perf_counter()
            session.run(None, feed)
            times.append((time.perf_counter() - start) * 1e3)
        return float(np.median(times))


    tuner = Autotuner("model.onnx", calibration_data="cal.npz")
    for pattern in range(len(tuner.patterns)):
        tuner.set_pattern(pattern)
        for _ in range(30):
            trial = tuner.generate()
            tuner.submit(trial, benchmark(tuner.export(trial)))
        tuner.commit()
    onnx.save(tuner.export_final(), "optimized.onnx")  # calibrated, within the error bound
    print(tuner.verdict.status, tuner.verdict.errors["error"])
    ```

    ``generate()`` returns the next trial of the current pattern's study, ``export(trial)``
    its whole model (ONNX bytes), ``submit(trial, ms)`` your figure (``None``: the build
    failed), ``commit()`` keeps the pattern's best scheme when it beats the reference, and
    ``export_final()`` is the model with every commit, with calibrated scales and checked
    against the error bound as ``tune()`` checks what it ships.

    Args:
        model: the float model, a path or an ``onnx.ModelProto`` (never modified).
        runtime: whose fusion rules place the Q/DQ (``onnxruntime``, ``openvino``,
            ``tensorrt``), as ``--runtime``.
        quant_type: the activation type (default: the runtime's), as ``--quant-type``.
        input_shapes: fixed symbolic input dims, ``"input:1x3x224x224"``.
        config: search settings (budget, sampler settings, commit threshold).
        sampler: the Optuna sampler, as ``--sampler``.
        storage: an Optuna storage or RDB URL for the studies (default: in memory).
        seed: the sampler's seed.
        run_id: the run's name in the storage.
        calibration_data: data the activation scales come from: an ``.npz`` path, a dict of
            arrays (samples on axis 0), an iterable of feed dicts or a
            ``CalibrationDataReader``; random inputs with a warning when None (the scales are
            then placeholders).
        validation_data: data the final model's output errors are measured on (default: a
            held-out quarter of the calibration data, as ``tune()``).
        max_output_error: the bound on the final model's output error (relative L2, worst
            output; default 0.2), as ``--max-output-error``.
        calibration_method: how activation statistics become scales, as
            ``--calibration-method`` (default: its default, ``percentile``).

    ``export(trial)`` uses the scales ``tune()``'s trials use on that runtime: calibrated ones
    on ONNX Runtime and OpenVINO, a placeholder scale (``Config.default_q_scale``) on
    TensorRT, where the scale does not change which kernels run. Only ``export_final()``
    is checked against the bound.
    """

    def __init__(
        self,
        model: str | os.PathLike | onnx.ModelProto,
        *,
        runtime: str = DEFAULT_RUNTIME,
        quant_type: str | None = None,
        input_shapes: str | None = None,
        config: Config | None = None,
        sampler: SamplerArg = "qdq",
        storage: str | optuna.storages.BaseStorage | None = None,
        seed: int | None = 0,
        run_id: str = "autotuner",
        calibration_data: Any = None,
        validation_data: Any = None,
        max_output_error: float | None = None,
        calibration_method: str | None = None,
    ) -> None:
        self.config = config or Config()
        quiet_optuna(self.config.verbose)
        self.options = TuneOptions(
            model=model, output_dir="", runtime=runtime, quant_type=quant_type,
            input_shapes=input_shapes, config=self.config, sampler=sampler, seed=seed,
            calibration_data=calibration_data, validation_data=validation_data,
            max_output_error=max_output_error,
            calibration_method=calibration_method or DEFAULT_METHOD)
        self.profile = profile_for(runtime)
        self.prepared = PreparedModel.prepare(
            model, runtime=self.profile.rules, quant_type=quant_type,
            input_shapes=input_shapes, config=self.config,
        )
        calibration = read_data(calibration_data, self.prepared, "calibration data")
        validation = read_data(validation_data, self.prepared, "validation data")
        if validation is None:  # errors on samples calibration never saw, as tune()
            calibration, validation = hold_out(calibration)
        self._data = (calibration, validation)
        self._calibrated: QDQExporter | None = None
        self.verdict: Verdict | None = None
        """The accuracy guard's decision on the last ``export_final()`` (None: not called):
        ``status``, ``shipped``, ``errors`` of what it returned, ``responsible`` tensors."""
        scales = (Scales.DEFAULT if self.profile.default_scales == Scales.DEFAULT
                  else Scales.CALIBRATED)
        self.exporter = (self.calibrated_exporter() if scales == Scales.CALIBRATED
                         else self.prepared.exporter(config=self.config))
        self.storage = storage if storage is not None else optuna.storages.InMemoryStorage()
        space = ChoiceSpace((self.prepared.quant_type,))
        settings = Settings(backend="ask/tell", runtime=runtime, scales=scales,
                            objectives=("latency",), accuracy=False, space=space, rounds=1)
        self.record = RunRecord(self.storage, run_id, self.prepared.tunable, space)
        self.search = Search(prepared=self.prepared, exporter=self.exporter, settings=settings,
                             config=self.config, record=self.record,
                             rule=CommitRule(self.config.performance_threshold),
                             sampler=sampler, seed=seed)
        self.run_id = run_id
        #: the uses your commits quantize, and each pattern's committed scheme
        self.committed: set[Use] = set()
        self.commits: dict[str, dict[str, int]] = {}
        self._uses: dict[Use, str] = {}
        self._pattern: PatternStudy | None = None
        self.study: optuna.Study | None = None

    def calibrated_exporter(self) -> QDQExporter:
        """The exporter with scales from one calibration pass (made on first use)."""
        if self._calibrated is None:
            scales, _ = calibrated_scales(self.prepared, self.options, None, self._data[0])
            self._calibrated = self.prepared.exporter(scales, self.config)
        return self._calibrated

    @property
    def patterns(self) -> list[PatternPoints]:
        """The patterns with insertion points, in study order (``set_pattern``'s index)."""
        return self.prepared.tunable

    def set_pattern(self, index: int) -> optuna.Study:
        """Open pattern ``index``'s study, on top of everything committed so far."""
        pp = self.patterns[index]
        empty = Seed(self.search.settings.space.seed(dict.fromkeys(pp.ids, 0)))
        self._pattern = PatternStudy(self.search, pp, order=index, around=(dict(self._uses), {}),
                                     seeds=[empty])
        self._pattern.open()
        self.study = self._pattern.study
        return self.study

    def generate(self) -> optuna.Trial:
        """A new scheme for the current pattern (an Optuna trial with every point suggested)."""
        assert self.study is not None and self._pattern is not None, "call set_pattern first"
        trial = self.study.ask()
        for pid in self._pattern.pp.ids:
            self.search.settings.space.suggest(trial, pid)
        return trial

    def scheme(self, trial: optuna.Trial | optuna.trial.FrozenTrial) -> list[str]:
        """The insertion points ``trial`` switches on."""
        return self.search.settings.space.on(trial.params)

    def export(self, trial: optuna.Trial) -> bytes:
        """The model with committed schemes plus this trial's scheme on every member region,
        with the scales ``tune()``'s trials use on this runtime: calibrated on ONNX Runtime
        and OpenVINO, the placeholder ``Config.default_q_scale`` on TensorRT (its kernels do
        not depend on the scale); not checked against the error bound."""
        plan = self._pattern.plan(trial.params)
        trial.set_user_attr(TrialAttr.PLAN_KEY, plan.key)
        return self.exporter.to_bytes(plan)

    def submit(self, trial: optuna.Trial, latency_ms: float | None) -> None:
        """Your latency of ``trial``'s model in ms (None: it failed to build or run)."""
        if latency_ms is None:
            self.study.tell(trial, state=TrialState.FAIL)
        else:
            self.study.tell(trial, float(latency_ms))

    def commit(self) -> dict[str, int]:
        """Commit the best scheme if your figures say it beats the reference (the empty scheme
        on top of the earlier commits) by ``performance_threshold``."""
        ps = self._pattern
        space = self.search.settings.space
        done = self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        empty = [t.value for t in done if not space.on(t.params)]
        if empty:  # the reference, as you measured it
            self.record.reference(ps.study, lambda: [min(empty), None])
        scheme = dict(ps.commit()[PatternAttr.COMMITTED])
        self._uses = combine(self._uses, space.typed_uses(ps.pp, scheme))
        self.committed = set(self._uses)
        self.commits[ps.pp.pattern.id] = scheme
        return scheme

    def export_final(self) -> onnx.ModelProto:
        """The model with every commit, calibrated scales on its activations, checked as
        ``tune()`` checks what it ships: within the bound it is the committed plan; past it,
        the plan without the Q/DQ bisection names responsible (one warning line), or the
        model without Q/DQ. The decision is :attr:`verdict`."""
        exporter = self.calibrated_exporter()
        hp = self.prepared.high_precision
        self.verdict = self._guard(exporter).ship(exporter.plan(self.committed),
                                                  hp.precision if hp is not None else "fp32")
        return exporter.to_model(self.verdict.plan)

    def _guard(self, exporter: QDQExporter) -> Guard:
        """The accuracy guard of ``tune()``, on this tuner's validation data."""
        calibration, validation = self._data
        scorer, data_name = error_scorer(self.prepared, self.options, self.profile, exporter,
                                         validation, calibration)
        plans = PlanMeasurer(None, self.record.measured, scorer, self.record.errors)
        return Guard(plans, exporter,
                     accuracy_bound(asked_bound(self.options), scorer, data_name))
