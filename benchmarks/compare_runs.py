"""Do two runs of the same command store and report the same thing? (A refactoring check.)

Compares two output folders of ``qdq-optuna tune`` made on a deterministic backend (the cost
model, or a callable), e.g. one made with an older checkout and one with this one:

* ``report.json``: every key, except where the run was (``output``, ``storage``, ``model``),
  when it ended (``finished``), how long the timing code took (``seconds``) and how busy the
  machine was (``quiet``; rounds ``remeasured``, and the ``loads`` / ``timed_runs`` they
  added: the measurer re-times a round another process disturbed, even on a callable);
* ``state.yaml``: every key except ``storage``;
* ``studies.db``: the same study names; per study the same user attrs and per trial the same
  state, parameters, values, user attrs and system attrs (artifact ids, creation times and
  ``seconds`` excepted).

    python benchmarks/compare_runs.py OLD_OUTPUT NEW_OUTPUT

Prints the differences (at most 20) and exits 1 when there are any.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

#: keys whose values name the place or the moment of a run, not its result
VOLATILE = {"output", "storage", "model", "finished", "seconds", "created", "artifacts",
            "datetime_start", "datetime_complete", "url", "artifact_id",
            "quiet", "remeasured", "loads", "timed_runs"}


def clean(value):
    if isinstance(value, dict):
        return {k: clean(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [clean(v) for v in value]
    return value


def diff(a, b, where: str, out: list[str]) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            if k not in a or k not in b:
                out.append(f"{where}.{k}: only in {'new' if k in b else 'old'}")
            else:
                diff(a[k], b[k], f"{where}.{k}", out)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            diff(x, y, f"{where}[{i}]", out)
    elif a != b:
        out.append(f"{where}: {str(a)[:120]} != {str(b)[:120]}")


def studies(folder: Path) -> dict:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = optuna.storages.RDBStorage(f"sqlite:///{(folder / 'studies.db').resolve()}")
    run = {}
    for s in storage.get_all_studies():
        if "/" not in s.study_name:  # the run's overview: no trials, a note
            continue
        study = optuna.load_study(study_name=s.study_name, storage=storage)
        trials = [{"number": t.number, "state": t.state.name, "params": t.params,
                   "values": t.values, "user_attrs": t.user_attrs,
                   "system_attrs": t.system_attrs}
                  for t in study.get_trials(deepcopy=False)]
        run[s.study_name.split("/", 1)[1]] = clean({"user_attrs": s.user_attrs,
                                                    "trials": trials})
    return run


def compare(old: Path, new: Path) -> list[str]:
    out: list[str] = []
    diff(clean(json.loads((old / "report.json").read_text())),
         clean(json.loads((new / "report.json").read_text())), "report.json", out)
    diff(clean(yaml.safe_load((old / "state.yaml").read_text())),
         clean(yaml.safe_load((new / "state.yaml").read_text())), "state.yaml", out)
    diff(studies(old), studies(new), "studies.db", out)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    args = ap.parse_args(argv)
    out = compare(args.old, args.new)
    report = json.loads((args.new / "report.json").read_text())
    print(f"{args.new}: speedup {report['speedup']:.6f}, {report['measurements']} measurements, "
          f"{sum(bool(p['committed_scheme']) for p in report['patterns'])} of "
          f"{len(report['patterns'])} patterns commit Q/DQ")
    for line in out[:20]:
        print("  " + line)
    print("same" if not out else f"{len(out)} differences")
    return 1 if out else 0


if __name__ == "__main__":
    sys.exit(main())
