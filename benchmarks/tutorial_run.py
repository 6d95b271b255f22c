"""Run docs/tutorial.md as a reader would, on the real model its settings block names, and
record what it printed: the figures the tutorial's "What to expect" table shows.

Why: the test suite runs the page on a generated model with the cost model (short on CI); the
figures a reader sees come from this run, on the real YOLOv8n detector and the photographs
scikit-image ships, measured on ONNX Runtime CPU. Every ``python`` block runs as written, in a
temporary folder; ``--timeout`` overrides the settings block's budget (the page's own by
default). Writes ``benchmarks/results/tutorial_yolov8n.json`` (the page's YOLOv8n);
``benchmarks/results/tutorial_ppocr_det.json`` is the same script on PP-OCRv4's text detector,
the run docs/bound_bites.md reads.

    python benchmarks/real_models.py --only nudenet-320n
    python benchmarks/tutorial_run.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import tempfile
import time
from pathlib import Path

import _common
import numpy as np
import onnxruntime as ort

import qdq_optuna

PAGE = _common.REPO / "docs" / "tutorial.md"
OUT = _common.RESULTS / "tutorial_yolov8n.json"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", text, re.S | re.M)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """Over all held-out photos at once (a text-free photo alone has no direction to keep)."""
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-30))


def run_row(label: str, out: Path, scope: dict, wall_s: float) -> dict:
    """One tune of the page: its report's claims and the held-out check the page makes."""
    report = json.loads((out / "report.json").read_text(encoding="utf-8"))
    fp32 = scope["fp32"]
    tuned = scope["outputs"](out / "optimized.onnx", scope["held_out"])
    agree = [scope["agreement"](r, t) for r, t in zip(fp32, tuned)]
    acc = report["accuracy"]
    chosen = next((s["name"] for s in report.get("starts", []) if s.get("chosen")), None)
    scope["cpu"] = report.get("cpu", {})
    return {
        "run": label,
        "speedup": report["speedup"],
        "speedup_ci": report.get("speedup_ci"),
        "start": chosen,
        "shipped": acc.get("shipped"),
        "measure": acc.get("measure"),
        "error": acc.get("error"),
        "bound": acc.get("bound"),
        "repaired_starts": [s["name"] for s in report.get("starts", []) if s.get("repair")],
        "held_out_cosine": cosine(fp32, tuned),
        "held_out_agreement_min": min(agree),
        "held_out_agreement_mean": float(np.mean(agree)),
        "quantized_tensors": len(report.get("quantized_tensors") or []),
        "wall_s": round(wall_s, 1),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--timeout", type=float, help="each tune's --timeout (the page's if unset)")
    ap.add_argument("--output", type=Path, default=OUT)
    args = ap.parse_args(argv)
    blocks = python_blocks(PAGE.read_text(encoding="utf-8"))
    settings = blocks[0]
    if args.timeout is not None:
        settings += f"\nTUNE['timeout'] = {args.timeout}\n"
    scope: dict = {"__name__": "tutorial"}
    rows = []
    cwd = os.getcwd()
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)
        try:
            exec(compile(settings + "\n" + blocks[1], str(PAGE), "exec"), scope)  # settings, data
            # step 3, timed as a whole (the page's block, as written)
            t0 = time.monotonic()
            exec(compile(blocks[2], str(PAGE), "exec"), scope)
            tune_s = time.monotonic() - t0
            exec(compile(blocks[3], str(PAGE), "exec"), scope)  # step 4: held-out photos
            rows.append(run_row("default bound", Path("out"), scope, tune_s))
            t0 = time.monotonic()
            exec(compile("\n".join(blocks[4:]), str(PAGE), "exec"), scope)  # step 5: --metric
            rows.append(run_row("detection loss <= 0.1 (--metric)", Path("out_metric"), scope,
                                time.monotonic() - t0))
        finally:
            os.chdir(cwd)
    cpu = scope.get("cpu", {})
    result = {
        "model": Path(scope["MODEL"]).name,
        "settings": {k: v for k, v in scope["TUNE"].items() if isinstance(v, (str, int, float))},
        "held_out": scope["HELD_OUT"],
        "machine": {"cpu": cpu.get("model_name"), "flags": cpu.get("flags"),
                    "cores": os.cpu_count(),
                    "load_avg": _common.load_avg(), "python": platform.python_version()},
        "versions": {"qdq_optuna": qdq_optuna.__version__, "onnxruntime": ort.__version__},
        "rows": rows,
    }
    args.output.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    for row in rows:
        print(json.dumps(row))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
