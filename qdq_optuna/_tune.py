"""``tune()``: the pipeline in one place: prepare -> search -> write outputs.

* **prepare** (:class:`~qdq_optuna.search.PreparedRun`, ``search/_prepare.py``): the options,
  the backend and the runtime's profile, the model (regions, patterns, points, precision), the
  user's data; the storage and the run record when the run opens;
* **search** (:meth:`Tuner.search <qdq_optuna.search.Tuner.search>`): baseline, starts,
  descent, and what ships, measured (a :class:`~qdq_optuna.search.SearchOutcome`);
* **write outputs** (:func:`~qdq_optuna.outputs.write.write_outputs`): report.json / .md
  (pareto/ for two objectives), then the run's pattern cache, state and finished mark, and
  the dashboard's overview.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import onnx

from qdq_optuna.backends import DEFAULT_BACKEND
from qdq_optuna.backends.base import Backend
from qdq_optuna.config import Config
from qdq_optuna.errors import OptionError, interrupted_by
from qdq_optuna.model.data import model_argument
from qdq_optuna.outputs.dashboard import PatternPictures, save_run_overview
from qdq_optuna.outputs.write import write_outputs
from qdq_optuna.search import PreparedRun, TuneOptions, Tuner, TuneResult, open_run


def tune(model: str | os.PathLike | onnx.ModelProto, output_dir: str | os.PathLike, *,
         backend: Callable | Backend | str | None = None, config: Config | None = None,
         benchmark: Callable | Backend | str | None = None, mode: str | None = None,
         **options) -> TuneResult:
    """Tune ``model``; results go to ``output_dir`` (see the docs: outputs).

    ``backend`` (or its older name ``benchmark``) is a backend name (``"onnxruntime"``,
    ``"openvino"``, ``"tensorrt"``, ``"costmodel"``, ...), a
    ``Backend`` (``qdq_optuna.backends.base``), or any callable
    ``fn(model: onnx.ModelProto) -> ms``.

    ``mode`` is ``--mode``: ``"quick"``, ``"default"`` or ``"extensive"`` sets the budget
    fields of [`Config`][qdq_optuna.config.Config]; with ``config`` too, the fields ``config``
    changes from their defaults win over the preset's, as ``--config`` does over ``--mode``.
    Other keyword arguments are the fields of [`TuneOptions`][qdq_optuna.search.TuneOptions]
    (``--input-shapes`` is ``input_shapes=``, and so on).
    """
    if backend is not None and benchmark is not None:
        raise OptionError("tune: pass backend= or benchmark= (the same thing), not both")
    chosen = backend if backend is not None else benchmark
    return run(TuneOptions(model=model_argument(model), output_dir=str(output_dir),
                           backend=chosen if chosen is not None else DEFAULT_BACKEND,
                           config=_config(config, mode), **options))


def _config(config: Config | None, mode: str | None) -> Config:
    """``config`` with ``mode``'s preset under it (the CLI's ``--mode`` with ``--config``)."""
    if mode is None:
        return config or Config()
    defaults = Config().to_dict()
    changed = {k: v for k, v in (config or Config()).to_dict().items() if v != defaults[k]}
    return Config.preset(mode, **changed)


def run(options: TuneOptions) -> TuneResult:
    """Run (or resume) the tuning run ``options`` describe."""
    tuner = Tuner(PreparedRun.from_options(options))  # prepare
    pictures = PatternPictures(tuner.out, tuner.prepared)
    tuner.on_commit.append(pictures)
    with tuner.session():
        done = tuner.open(open_run(tuner.run))  # prepare: the storage, the run record
        if done is not None:  # a finished run: its result, nothing measured again
            return TuneResult(tuner.out, done, finished_before=True)
        try:
            outcome = tuner.search()  # search
        finally:  # what the last commits decided (not on Ctrl-C: a prompt exit)
            if not interrupted_by(sys.exc_info()[1]):
                pictures.flush()
        report = write_outputs(outcome)  # write outputs
        tuner.close(outcome, report)
        save_run_overview(outcome.record, outcome.out, report, dict(outcome.plans.by_phase))
        return TuneResult(tuner.out, report)
