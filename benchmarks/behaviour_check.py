"""Behaviour check for refactors: the same ``tune`` (cost model, seed 0, default settings) on the
zoo models, and per model its final latency, measurement count per phase and the standing
placement's digest. Run it before and after a change and compare the two JSON files:

    python benchmarks/behaviour_check.py --out before.json
    python benchmarks/behaviour_check.py --out after.json --compare before.json

``--real NAME ...`` adds real third-party models of ``real_models.py`` (fetched into its cache
on first use), tuned with their ``--input-shapes`` and no data of their own, as the zoo is.
``--reports DIR`` keeps each run's report.json and report.md there (as ``MODEL-SAMPLER.*``);
``--compare-reports EARLIER_DIR`` then says, per model, whether the two reports are the same
once what differs from run to run is left out (wall-clock times, report.md's "Where the time
went", the temporary folder, the finish time).

Deterministic (the cost model does not time anything), so any difference is a behaviour change.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import qdq_optuna
from qdq_optuna.examples import zoo

MODELS = ("resnet", "mobilenet", "yolo", "transformer")


def run(name: str, size: str, sampler: str, folder: Path, reports: Path | None = None) -> dict:
    """One ``tune`` of a zoo model (``size``) or, with ``size`` ``"real"``, of a real model."""
    t0 = time.monotonic()
    if size == "real":
        import real_models

        model, shapes = str(real_models.fetch(name)), real_models.MODELS[name].input_shapes
    else:
        model, shapes = zoo.build(name, size), None
    res = qdq_optuna.tune(model, folder, backend="costmodel", seed=0, input_shapes=shapes,
                          sampler=sampler, progress=False, fresh=True)
    r = res.report
    shipped = (folder / "optimized.onnx").read_bytes()
    if reports is not None:
        reports.mkdir(parents=True, exist_ok=True)
        for suffix in ("json", "md"):
            (reports / f"{name}-{size}-{sampler}.{suffix}").write_bytes(
                (folder / f"report.{suffix}").read_bytes())
    return {"model": f"{name}-{size}", "sampler": sampler, "final_ms": r["final_latency_ms"],
            "measurements": r["measurements"], "by_phase": r["measurements_by_phase"],
            "optimized_sha": hashlib.sha256(shipped).hexdigest()[:16],
            "wall_s": round(time.monotonic() - t0, 1)}


#: report.json keys that differ from run to run (wall-clock times, paths)
VOLATILE = {"finished", "elapsed_s", "output", "storage", "seconds", "wall_time", "load_s",
            "timing_s"}
_TEMP = re.compile(r"[^\s`'\"]*qdq-behaviour-[^/\s`'\"]+/")
_PHASES = re.compile(r"Phases ended at [^.]*\.")
#: report.md's wall-time section (seconds only; its counts are report.json's too)
_TIME_SECTION = re.compile(r"## Where the time went\n.*?(?=\n## |\Z)", re.S)


def _stable(x):
    """A report without what differs from run to run."""
    if isinstance(x, dict):
        return {k: _stable(v) for k, v in x.items() if k not in VOLATILE}
    if isinstance(x, list):
        return [_stable(v) for v in x]
    return _TEMP.sub("TMP/", x) if isinstance(x, str) else x


def same_reports(before: Path, after: Path) -> list[str]:
    """Per report in ``after``: whether it matches ``before``'s (times and paths aside)."""
    lines = []
    for path in sorted(after.glob("*.json")):
        old = before / path.name
        if not old.exists():
            continue
        js = list(_stable(json.loads(old.read_text())).items()) == list(
            _stable(json.loads(path.read_text())).items())
        md = [_TIME_SECTION.sub("", _PHASES.sub("", _TEMP.sub("TMP/", p.with_suffix(".md")
                                                               .read_text())))
              for p in (old, path)]
        lines.append(f"{path.stem}: report.json {'same' if js else 'DIFFERS'}, report.md "
                     f"{'same' if md[0] == md[1] else 'DIFFERS'}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--sizes", nargs="+", default=["small", "medium"])
    ap.add_argument("--samplers", nargs="+", default=["qdq"])
    ap.add_argument("--real", nargs="*", default=[], metavar="NAME",
                    help="real models of real_models.py to tune too (e.g. mtcnn-rnet ppocr-cls)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--compare", type=Path, help="an earlier --out file: print what differs")
    ap.add_argument("--reports", type=Path, help="keep each run's report.json / report.md here")
    ap.add_argument("--compare-reports", type=Path,
                    help="an earlier --reports folder: say whether each report is the same")
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="qdq-behaviour-") as tmp:
        cases = [(n, s) for n in args.models for s in args.sizes] + [(n, "real") for n in args.real]
        for name, size in cases:
            for sampler in args.samplers:
                row = run(name, size, sampler, Path(tmp) / f"{name}-{size}-{sampler}",
                          args.reports)
                print(json.dumps(row), flush=True)
                rows.append(row)
    args.out.write_text(json.dumps(rows, indent=1) + "\n")
    same = True
    if args.compare_reports and args.reports:
        for line in same_reports(args.compare_reports, args.reports):
            print(line)
            same &= "DIFFERS" not in line
    if args.compare:
        before = {(r["model"], r["sampler"]): r for r in json.loads(args.compare.read_text())}
        print("| model | sampler | final ms before | after | measurements before | after | same model |")
        print("|---|---|---:|---:|---:|---:|---|")
        for r in rows:
            b = before.get((r["model"], r["sampler"]))
            if b is None:
                continue
            eq = (b["final_ms"] == r["final_ms"] and b["measurements"] == r["measurements"]
                  and b["optimized_sha"] == r["optimized_sha"])
            same &= eq
            print(f"| {r['model']} | {r['sampler']} | {b['final_ms']:.6f} | {r['final_ms']:.6f} | "
                  f"{b['measurements']} | {r['measurements']} | "
                  f"{'yes' if b['optimized_sha'] == r['optimized_sha'] else 'no'} |")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
