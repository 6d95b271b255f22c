"""Makes ``tests/data/run_c32ab0d/``: a run stored by the search as it was at commit c32ab0d
(before the search became a package), cut by a Ctrl-C in a trial of its refinement round.
``tests/test_old_layout.py`` resumes it with today's code.

Run it from a checkout of that commit, with this ``tests/`` folder importable:

    git worktree add OLD c32ab0d
    cd OLD && PYTHONPATH=OLD:THIS/tests python THIS/tests/data/make_old_run.py THIS/tests/data/run_c32ab0d

(``OLD`` first on the path, so the old ``qdq_optuna`` is the one imported.)
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import _latency_fns as fns
import onnx

import qdq_optuna
from qdq_optuna import Config
from qdq_optuna.backends.callable import CallableBackend
from qdq_optuna.examples import zoo

#: the settings ``tests/test_old_layout.py`` resumes with (they must match, or the run is refused)
BUDGET = 6
MODEL = ("tiny_concat", "medium")
#: the backend's call that raises (a trial of the refinement round, see the module docstring)
INTERRUPT_AT = int(os.environ.get("QDQ_TEST_INTERRUPT_AT", "24"))


def main(folder: Path) -> None:
    print(f"qdq_optuna from {Path(qdq_optuna.__file__).parent}")
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    onnx.save(zoo.build(*MODEL), str(folder / "model.onnx"))
    os.environ["QDQ_TEST_INTERRUPT_AT"] = str(INTERRUPT_AT)
    try:
        qdq_optuna.tune(folder / "model.onnx", folder / "run",
                        benchmark=CallableBackend(fns.costmodel_interruptible, deterministic=True),
                        config=Config(schemes_per_region=BUDGET), seed=0, progress=False)
    except KeyboardInterrupt:
        print("interrupted, as planned")
    else:
        raise SystemExit("the run was not interrupted: pick another INTERRUPT_AT")
    for name in os.listdir(folder / "run"):  # the storage is the truth of a run: keep it only
        if name != "studies.db":
            path = folder / "run" / name
            shutil.rmtree(path) if path.is_dir() else path.unlink()


if __name__ == "__main__":
    main(Path(sys.argv[1]).resolve())
