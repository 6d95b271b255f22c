"""The search side: one Optuna study per pattern, run by run (private; the public names are
re-exported from :mod:`qdq_optuna`).

Modules, top down (each imports only the ones below it):

* ``_run``: :class:`Tuner` and :func:`tune`: a run, phase by phase;
* ``_pattern``: :class:`PatternStudy`: one pattern's study in one round;
* ``_plans``: :class:`PlanMeasurer`: every measurement of a plan, counted;
* ``_workers``: budget slots, twins and redone trials when processes share a study;
* ``_progress``: the progress bars;
* ``_options``: :class:`TuneOptions`, :class:`TuneResult`, the resolved settings and the
  fingerprint;
* ``_record``: :class:`RunRecord`: the stored run's study names and user attributes.

This package's ``__init__`` imports nothing, so the modules outside the search that read a
stored run (report, dashboard, bench) can import ``_record`` without pulling the search in.
"""
