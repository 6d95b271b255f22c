"""The output folder of a run: every file name in it, and its writes (atomic, ``_files.py``).

The search decides and records, the record and the outputs word what was found; what any of
them leaves in the run's folder is written here, by the :class:`RunFolder` that
:mod:`qdq_optuna._tune` hands the search, so the names of a run's files are spelled, and its
files written, in this one module.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import shutil
from pathlib import Path

import onnx

from qdq_optuna._files import atomic_write_bytes

log = logging.getLogger("qdq_optuna")

#: the shipped model (the standing model while the run goes on)
OPTIMIZED = "optimized.onnx"
REPORT_JSON = "report.json"
REPORT_MD = "report.md"
#: a readable snapshot of the stored run
STATE = "state.yaml"
#: every measured scheme per pattern, for ``--pattern-cache`` of a later run
PATTERN_CACHE = "pattern_cache.yaml"
#: activation statistics, reused while the model, data and preprocessing are the same
CALIBRATION_STATS = "calibration_stats.json"
#: the default storage
STUDIES_DB = "studies.db"
#: the two-objective run's front, one model per point
PARETO = "pareto"
#: the runtime's recipe file as its tool wrote it (``recipe_onnxruntime.onnx``)
RECIPE_FILE = "recipe_{runtime}.onnx"
#: every name above
OUTPUT_NAMES = (OPTIMIZED, REPORT_JSON, REPORT_MD, STATE, PATTERN_CACHE, CALIBRATION_STATS,
                STUDIES_DB, PARETO, RECIPE_FILE)


class RunFolder:
    """One run's output folder: where each file goes, and the writes of the model files."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def listing(self) -> frozenset[Path] | None:
        """What the folder holds now (None: it does not exist), for :meth:`remove_new`."""
        if not self.path.is_dir():
            return None
        return frozenset(self.path.rglob("*"))

    def remove_new(self, before: frozenset[Path] | None) -> None:
        """Remove what was created since ``listing()`` returned ``before`` (the folder too,
        when it did not exist): a run that failed before it measured anything leaves no
        files, while a resumed run's earlier files stay."""
        if before is None:
            shutil.rmtree(self.path, ignore_errors=True)
            return
        for path in sorted(set(self.path.rglob("*")) - before, key=lambda q: -len(q.parts)):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)

    def __truediv__(self, name: str) -> Path:
        return self.path / name

    @property
    def optimized(self) -> Path:
        return self.path / OPTIMIZED

    @property
    def report_json(self) -> Path:
        return self.path / REPORT_JSON

    @property
    def state(self) -> Path:
        return self.path / STATE

    @property
    def pattern_cache(self) -> Path:
        return self.path / PATTERN_CACHE

    def recipe_file(self, runtime: str) -> Path:
        """Where the run keeps its runtime's recipe file as the tool wrote it."""
        return self.path / RECIPE_FILE.format(runtime=runtime)

    def keep(self, path: Path, data: bytes) -> None:
        """A file of the run folder (the recipe file made again), written atomically."""
        atomic_write_bytes(path, data)

    @property
    def calibration_stats(self) -> Path:
        return self.path / CALIBRATION_STATS

    def write_calibration_stats(self, data: bytes) -> None:
        """The activation statistics' cache (an interrupted run never leaves half of it)."""
        self.path.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(self.calibration_stats, data)

    def write_pattern_cache(self, text: str) -> None:
        atomic_write_bytes(self.pattern_cache, text.encode())

    def clear_pareto(self) -> None:
        """An empty ``pareto/`` (a rerun replaces the previous front)."""
        folder = self.path / PARETO
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.glob("*.onnx"):
            with contextlib.suppress(OSError):
                old.unlink()

    def save_pareto_model(self, exporter, plan, name: str) -> str:
        """One model of the front, ``pareto/NAME`` (as :meth:`save_optimized` writes: atomic,
        piece by piece for a model whose weights stay on disk); returns that relative path."""
        exporter.save(plan, self.path / PARETO / name)
        return f"{PARETO}/{name}"

    def finished_report(self, sha256: str | None) -> bytes | None:
        """``report.json``'s bytes when the folder holds it with this digest and its model
        (a worker's own folder may not: it finishes), else None."""
        path = self.report_json
        if not path.is_file() or not self.optimized.is_file():
            return None
        text = path.read_bytes()
        return text if hashlib.sha256(text).hexdigest() == sha256 else None

    def write_reports(self, report_json: bytes, report_md: str) -> None:
        atomic_write_bytes(self.report_json, report_json)
        atomic_write_bytes(self.path / REPORT_MD, report_md.encode())

    def write_state(self, text: str) -> None:
        atomic_write_bytes(self.state, text.encode())

    def write_optimized(self, data: bytes) -> bytes:
        """``optimized.onnx`` as ``data`` (the user's model kept); returns ``data``."""
        atomic_write_bytes(self.optimized, data)
        return data

    def save_optimized(self, exporter, plan) -> bytes:
        """``optimized.onnx`` of ``plan`` (checked), written atomically; returns what the
        final comparison times."""
        if exporter.external or exporter.to_files:  # written piece by piece
            return exporter.save(plan, self.optimized)
        optimized = exporter.to_model(plan)
        onnx.checker.check_model(optimized)
        return self.write_optimized(optimized.SerializeToString())

    def save_standing(self, exporter, uses) -> None:
        """The anytime result: ``optimized.onnx`` of a standing model (every decision in it
        passed the guard), written after the starts and on each change, so a run stopped at
        any point leaves the best model so far (``state.yaml`` says the run is not done; the
        report of a run cut short says ``partial``)."""
        plan = exporter.plan(uses)
        self.save_optimized(exporter, plan)
        log.debug("%s: the standing model so far (%d Q/DQ)", OPTIMIZED, len(plan))
