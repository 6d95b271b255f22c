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

import dataclasses
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

import onnx

from qdq_optuna.backends import DEFAULT_BACKEND
from qdq_optuna.backends.base import Backend
from qdq_optuna.config import Config
from qdq_optuna.errors import (
    OptionError,
    interrupted_by,
    interrupting_signal,
    stop_signals_as_interrupt,
)
from qdq_optuna.model.data import model_argument
from qdq_optuna.outputs.dashboard import PatternPictures, save_run_overview
from qdq_optuna.outputs.write import write_outputs, write_stopped_outputs
from qdq_optuna.run_folder import OPTIMIZED
from qdq_optuna.search import PreparedRun, TuneOptions, Tuner, TuneResult, open_run

log = logging.getLogger("qdq_optuna")


def tune(model: str | os.PathLike | onnx.ModelProto, output_dir: str | os.PathLike, *,
         backend: Callable | Backend | str | None = None,
         config: Config | str | os.PathLike | None = None,
         benchmark: Callable | Backend | str | None = None, mode: str | None = None,
         **options: Any) -> TuneResult:
    """Tune ``model``; results go to ``output_dir`` (see the docs: outputs).

    Every option of ``qdq-optuna tune`` is a keyword, named as its flag without the dashes
    (``--input-shapes`` is ``input_shapes=``, ``--refine-rounds`` is ``refine_rounds=``); an
    unknown keyword raises :class:`~qdq_optuna.errors.OptionError` naming it.

    Args:
        model: the float model, a path or an ``onnx.ModelProto`` (never modified).
        output_dir: the output folder (``--output``); also holds the studies.
        backend: what measures latency: a backend name (``"onnxruntime"``, ``"openvino"``,
            ``"tensorrt"``, ``"costmodel"``, ...), a ``Backend`` (``qdq_optuna.backends.base``)
            or any callable ``fn(model: onnx.ModelProto) -> ms``; ``benchmark`` is the same.
        config: search settings: a [`Config`][qdq_optuna.config.Config], or the path of a YAML
            file of its fields (``--config``).
        benchmark: the same as ``backend`` (give one of them).
        mode: ``--mode``: ``"quick"``, ``"default"`` or ``"extensive"`` sets the budget fields
            of ``Config``; the fields ``config`` changes from their defaults win over the
            preset's, as ``--config`` does over ``--mode``.
        **options: the other options: the fields of
            [`TuneOptions`][qdq_optuna.search.TuneOptions] (``input_shapes=``,
            ``calibration_data=``, ``sampler=``, ``seed=``, ``timeout=``, ...), the fields of
            ``Config`` (``refine_rounds=``, ``schemes_per_region=``, ...: they win over
            ``config``'s, as a flag over the file), ``verbose=`` (``-v``) and ``quiet=``
            (``-q``: no progress bars).

    Returns:
        Where the outputs are, and ``report.json`` as a dict.
    """
    return run(options_from(model, output_dir, backend=backend, config=config,
                            benchmark=benchmark, mode=mode, **options))


#: the Config fields ``tune()`` takes as keywords, and the TuneOptions fields other than
#: its named arguments
_CONFIG_KEYWORDS = frozenset(f.name for f in dataclasses.fields(Config))
_OPTION_KEYWORDS = frozenset(f.name for f in dataclasses.fields(TuneOptions)) - {
    "model", "output_dir", "backend", "config"}


def options_from(model: str | os.PathLike | onnx.ModelProto, output_dir: str | os.PathLike, *,
                 backend: Callable | Backend | str | None = None,
                 config: Config | str | os.PathLike | None = None,
                 benchmark: Callable | Backend | str | None = None, mode: str | None = None,
                 verbose: int | bool | None = None, quiet: bool = False,
                 **keywords: Any) -> TuneOptions:
    """The :class:`TuneOptions` ``tune()``'s keywords describe, each routed where the CLI
    routes its flag (a TuneOptions field, a Config field over ``config`` and ``mode``, ``-q``
    to ``progress``); ``qdq-optuna tune`` passes its parsed flags here through ``tune()``."""
    if backend is not None and benchmark is not None:
        raise OptionError("tune: pass backend= or benchmark= (the same thing), not both")
    unknown = sorted(set(keywords) - _CONFIG_KEYWORDS - _OPTION_KEYWORDS)
    if unknown:
        raise OptionError(f"tune: unknown keyword {unknown[0]!r} (the keywords are the "
                          "options of qdq-optuna tune without their dashes, e.g. "
                          "input_shapes=, refine_rounds=)")
    settings = {k: v for k, v in keywords.items() if k in _CONFIG_KEYWORDS}
    settings["verbose"] = bool(verbose) or None
    given = {k: v for k, v in keywords.items() if k in _OPTION_KEYWORDS}
    if quiet:
        given["progress"] = False
    chosen = backend if backend is not None else benchmark
    return TuneOptions(model=model_argument(model), output_dir=str(output_dir),
                       backend=chosen if chosen is not None else DEFAULT_BACKEND,
                       config=_config(config, mode, **settings), **given)


def _config(config: Config | str | os.PathLike | None, mode: str | None,
            **settings: Any) -> Config:
    """``config`` (a Config or a YAML file's) with ``mode``'s preset under it and ``settings``
    (those not None) over it: the CLI's ``--mode``, ``--config`` and the search flags."""
    if isinstance(config, (str, os.PathLike)):
        config = Config.from_yaml(config)
    settings = {k: v for k, v in settings.items() if v is not None}
    if mode is None and not settings:
        return config or Config()
    defaults = Config().to_dict()
    changed = {k: v for k, v in (config or Config()).to_dict().items() if v != defaults[k]}
    return Config.preset(mode or "default", **{**changed, **settings})


def run(options: TuneOptions) -> TuneResult:
    """Run (or resume) the tuning run ``options`` describe. SIGTERM and SIGHUP end it as
    Ctrl-C does (:func:`~qdq_optuna.errors.stop_signals_as_interrupt`: unless the caller set
    its own handler for them): the report of what is known, ``state.yaml`` saying how to
    resume, the SQLite file whole."""
    with stop_signals_as_interrupt():
        return _run(options)


def _run(options: TuneOptions) -> TuneResult:
    tuner = Tuner(PreparedRun.from_options(options))  # prepare
    pictures = PatternPictures(tuner.out, tuner.prepared)
    tuner.on_commit.append(pictures)
    with tuner.session():
        done = tuner.open(open_run(tuner.run))  # prepare: the storage, the run record
        if done is not None:  # a finished run: its result, nothing measured again
            return TuneResult(tuner.out, done, finished_before=True)
        report = None
        try:
            try:
                outcome = tuner.search()  # search
            finally:  # what the last commits decided (not on Ctrl-C: a prompt exit)
                if not interrupted_by(sys.exc_info()[1]):
                    pictures.flush()
            report = write_outputs(outcome)  # write outputs
            tuner.close(outcome, report)
        except BaseException as exc:
            signum = interrupting_signal(exc)
            if signum is not None and report is None:
                _report_what_is_known(tuner, signum)
            raise
        save_run_overview(outcome.record, outcome.out, report, dict(outcome.plans.by_phase))
        if outcome.partial:
            cut = (f"--timeout {options.timeout:g}s" if options.timeout is not None
                   else "the run's deadline")
            log.warning("%s cut the run short: %s is the best model found by then "
                        "(report.md: incomplete); rerun the same command to resume from the "
                        "stored studies (a larger --timeout, or none, lets it finish)",
                        cut, tuner.out / OPTIMIZED)
        return TuneResult(tuner.out, report)


def _report_what_is_known(tuner: Tuner, signum: int) -> None:
    """A run stopped part way: its report of what the storage holds (nothing is measured)."""
    try:
        known = tuner.stopped(signum)
        if known is not None:
            write_stopped_outputs(known)
    except Exception:  # the storage may be gone: state.yaml and the message still say how to resume
        logging.getLogger("qdq_optuna").debug("the stopped run's report not written", exc_info=True)
