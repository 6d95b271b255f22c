"""Ask/tell for users with their own benchmark loop: we propose and export, you measure.

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
"""

from __future__ import annotations

import os

import onnx
import optuna
from optuna.trial import TrialState

from .config import Config
from .graph import Use
from .insertion.points import PatternPoints
from .model import PreparedModel
from .sampling import make_sampler
from .storage import quiet_optuna


class Autotuner:
    def __init__(
        self,
        model: str | os.PathLike | onnx.ModelProto,
        *,
        runtime: str = "onnxruntime",
        quant_type: str | None = None,
        input_shapes: str | None = None,
        config: Config | None = None,
        sampler: str = "qdq",
        storage: str | optuna.storages.BaseStorage | None = None,
        seed: int | None = 0,
        run_id: str = "autotuner",
    ) -> None:
        self.config = config or Config()
        quiet_optuna(self.config.verbose)
        self.prepared = PreparedModel.prepare(
            model, runtime=runtime, quant_type=quant_type, input_shapes=input_shapes,
            config=self.config,
        )
        self.exporter = self.prepared.exporter(config=self.config)
        self.storage = storage if storage is not None else optuna.storages.InMemoryStorage()
        self.sampler_name = sampler
        self.seed = seed
        self.run_id = run_id
        self.committed: set[Use] = set()
        self.commits: dict[str, dict[str, int]] = {}
        self._pattern: PatternPoints | None = None
        self.study: optuna.Study | None = None

    @property
    def patterns(self) -> list[PatternPoints]:
        return self.prepared.tunable

    def set_pattern(self, index: int) -> optuna.Study:
        pp = self.patterns[index]
        self._pattern = pp
        base = set(self.committed)
        sampler = make_sampler(
            self.sampler_name, seed=None if self.seed is None else self.seed + index,
            config=self.config,
            scheme_key=lambda params: self.exporter.plan(
                base | pp.uses([p for p, v in params.items() if v])).key,
        )
        self.study = optuna.create_study(
            study_name=f"{self.run_id}/{pp.pattern.id}", storage=self.storage, sampler=sampler,
            direction="minimize", load_if_exists=True,
        )
        for key, value in {"qdq_points": pp.ids, "qdq_concat_groups": pp.concat_groups,
                           "qdq_fusion_groups": pp.fusion_groups,
                           "signature": pp.pattern.signature}.items():
            self.study.set_user_attr(key, value)
        # the empty scheme is the reference every commit is judged against
        self.study.enqueue_trial(dict.fromkeys(pp.ids, 0), skip_if_exists=True)
        return self.study

    def generate(self) -> optuna.Trial:
        """A new scheme for the current pattern (an Optuna trial with every point suggested)."""
        assert self.study is not None and self._pattern is not None, "call set_pattern first"
        trial = self.study.ask()
        for pid in self._pattern.ids:
            trial.suggest_int(pid, 0, 1)
        return trial

    def scheme(self, trial: optuna.Trial | optuna.trial.FrozenTrial) -> list[str]:
        return [p for p, v in trial.params.items() if v]

    def export(self, trial: optuna.Trial) -> bytes:
        """The model with committed schemes plus this trial's scheme on every member region."""
        plan = self.exporter.plan(self.committed | self._pattern.uses(self.scheme(trial)))
        trial.set_user_attr("plan_key", plan.key)
        return self.exporter.to_bytes(plan)

    def submit(self, trial: optuna.Trial, latency_ms: float | None) -> None:
        if latency_ms is None:
            self.study.tell(trial, state=TrialState.FAIL)
        else:
            self.study.tell(trial, float(latency_ms))

    def commit(self) -> dict[str, int]:
        """Commit the best scheme if it beats the empty scheme by ``performance_threshold``
        (as you measured them; re-measure first if your figures are noisy)."""
        pp = self._pattern
        done = self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        empty = [t.value for t in done if not any(t.params.values())]
        scheme = dict.fromkeys(pp.ids, 0)
        if done:
            best = min(done, key=lambda t: t.value)
            reference = min(empty) if empty else None
            if reference is not None and best.value * self.config.performance_threshold <= reference:
                scheme = {p: int(best.params.get(p, 0)) for p in pp.ids}
        self.committed |= pp.uses([p for p, v in scheme.items() if v])
        self.commits[pp.pattern.id] = scheme
        self.study.set_user_attr("committed", scheme)
        return scheme

    def export_final(self) -> onnx.ModelProto:
        return self.exporter.to_model(self.exporter.plan(self.committed))
