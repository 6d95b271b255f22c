"""Ask/tell for users with their own benchmark loop: we propose and export, you measure.

The example is on :class:`Autotuner`.

It is a thin face over the same pattern studies ``tune`` runs
(:class:`~qdq_optuna.search._pattern.PatternStudy`: the same study set-up, sampler, plans and
commit rule), in the order you choose; only the measuring is yours. A pattern's reference is
its empty scheme on top of your earlier commits (the first trial of each study), and a scheme
is committed when your figures say it beats the reference by ``performance_threshold`` (re-
measure before you submit if your figures are noisy: nothing confirms them).
"""

from __future__ import annotations

import os

import onnx
import optuna
from optuna.trial import TrialState

from qdq_optuna.config import Config
from qdq_optuna.model.graph import Use
from qdq_optuna.placement.export import Scales
from qdq_optuna.placement.points import PatternPoints
from qdq_optuna.placement.scheme import ChoiceSpace, combine
from qdq_optuna.record import PatternAttr, RunRecord, TrialAttr
from qdq_optuna.record.storage import quiet_optuna
from qdq_optuna.runtimes import DEFAULT_RUNTIME, profile_for
from qdq_optuna.runtimes.prepared import PreparedModel
from qdq_optuna.search._commit import CommitRule
from qdq_optuna.search._options import Settings
from qdq_optuna.search._pattern import PatternStudy, Search, Seed
from qdq_optuna.search.samplers import SamplerArg


class Autotuner:
    """Ask/tell: the search proposes a scheme and exports its model, you measure it.

    ```python
    tuner = Autotuner("model.onnx", runtime="tensorrt")
    for pattern in range(len(tuner.patterns)):
        tuner.set_pattern(pattern)
        for _ in range(30):
            trial = tuner.generate()
            tuner.submit(trial, my_benchmark(tuner.export(trial)))   # None: the build failed
        tuner.commit()
    onnx.save(tuner.export_final(), "optimized.onnx")
    ```

    ``generate()`` returns the next trial of the current pattern's study, ``export(trial)``
    its whole model (ONNX bytes), ``submit(trial, ms)`` your figure (``None``: the build
    failed), ``commit()`` keeps the pattern's best scheme when it beats the reference, and
    ``export_final()`` is the model with every commit.
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
    ) -> None:
        self.config = config or Config()
        quiet_optuna(self.config.verbose)
        self.prepared = PreparedModel.prepare(
            model, runtime=profile_for(runtime).rules, quant_type=quant_type,
            input_shapes=input_shapes, config=self.config,
        )
        self.exporter = self.prepared.exporter(config=self.config)
        self.storage = storage if storage is not None else optuna.storages.InMemoryStorage()
        space = ChoiceSpace((self.prepared.quant_type,))
        settings = Settings(backend="ask/tell", runtime=runtime, scales=Scales.DEFAULT,
                            objectives=("latency",), constrained=False, accuracy=False,
                            space=space, rounds=1)
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

    @property
    def patterns(self) -> list[PatternPoints]:
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
        return self.search.settings.space.on(trial.params)

    def export(self, trial: optuna.Trial) -> bytes:
        """The model with committed schemes plus this trial's scheme on every member region."""
        plan = self._pattern.plan(trial.params)
        trial.set_user_attr(TrialAttr.PLAN_KEY, plan.key)
        return self.exporter.to_bytes(plan)

    def submit(self, trial: optuna.Trial, latency_ms: float | None) -> None:
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
        return self.exporter.to_model(self.exporter.plan(self.committed))
