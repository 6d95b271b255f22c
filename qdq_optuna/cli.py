"""``qdq-optuna``: a thin layer over the library (every command is one library call)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from . import __version__
from .backends import BACKEND_HELP
from .backends.base import BackendError, BackendUnavailable
from .calibration import DEFAULT_METHOD as DEFAULT_CALIBRATION_METHOD
from .errors import OptionError, UserError

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2
        raise OptionError(message)


def _number(cast, accept, expected: str):
    """An argparse type: ``cast`` the text, then ``accept`` it, else say what was expected."""
    def parse(text: str):
        try:
            v = cast(text)
        except ValueError:
            v = None
        if v is None or not accept(v):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return v
    return parse


_port = _number(int, lambda v: 0 <= v <= 65535, "a port 0-65535 (0: any free port)")
_positive_int = _number(int, lambda v: v >= 1, "a positive integer")
_count = _number(int, lambda v: v >= 0, "an integer >= 0")
_positive_float = _number(float, lambda v: 0 < v < float("inf"), "a positive number")


def _add_accuracy_args(t: argparse.ArgumentParser) -> None:
    t.add_argument("--validation-data", metavar="FILE.npz",
                   help="inputs the output errors are measured on (default: the calibration "
                        "data; random inputs with a warning otherwise)")
    t.add_argument("--metric", metavar="MODULE:FUNCTION",
                   help="user metric fn(reference_outputs, candidate_outputs) -> float, lower is "
                        "better (replaces --error-measure)")
    t.add_argument("--error-measure", choices=["relative_l2", "1-cosine", "max_abs"],
                   default="relative_l2", help="error of a trial's model vs FP32 (worst output)")
    t.add_argument("--max-output-error", type=_positive_float, metavar="X",
                   help="error budget: trials above it are infeasible; commits take the fastest "
                        "feasible scheme")
    t.add_argument("--objectives", default="latency", metavar="latency[,error]",
                   help="latency (default) or latency,error (two-objective studies, Pareto "
                        "front of the whole model in OUTPUT/pareto/)")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input-shapes", metavar="NAME:DxD,...",
                   help="fix symbolic input dims, e.g. input:1x3x224x224")
    p.add_argument("--quant-type", choices=["int8", "uint8", "fp8", "mixed"],
                   help="activation type (default: uint8 on ONNX Runtime CPU, int8 on TensorRT); "
                        "mixed: each point chooses none/int8/fp8 (TensorRT) or none/uint8/int8")
    p.add_argument("--preprocess", choices=["auto", "none", "ort-basic"], default="auto",
                   help="float-model preprocessing; auto = ONNX Runtime basic fusions for the "
                        "ONNX Runtime rules, none for TensorRT")
    p.add_argument("--maximum-sequence-region-size", type=_positive_int)
    p.add_argument("--minimum-topdown-search-size", type=_positive_int)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="qdq-optuna", description=__doc__)
    parser.add_argument("--version", action="version", version=f"qdq-optuna {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    t = sub.add_parser("tune", help="search the Q/DQ placement (resumes automatically)")
    t.add_argument("--model", required=True, help="float ONNX model (never modified)")
    t.add_argument("--output", required=True, help="output folder (also holds the studies)")
    _add_model_args(t)
    t.add_argument("--backend", default="onnxruntime", help=BACKEND_HELP)
    t.add_argument("--runtime", choices=["onnxruntime", "tensorrt"],
                   help="fusion rules to place Q/DQ for (default: follows --backend)")
    t.add_argument("--sampler", default="qdq",
                   choices=["qdq", "tpe", "cmaes", "random", "gp", "nsga2", "bruteforce"])
    t.add_argument("--schemes-per-region", type=_positive_int,
                   help="finished trials per pattern study (default 30; --mode sets it too)")
    t.add_argument("--converged-patience", type=_count,
                   help="our sampler: stop a pattern study early after N exploration trials "
                        "in a row that did not improve (default 1; 0: spend every budget)")
    t.add_argument("--refine-rounds", type=_count,
                   help="after the pattern-by-pattern pass, re-tune each pattern N more times "
                        "with every other pattern's scheme in place (default 1; 0: one pass)")
    t.add_argument("--mode", choices=["quick", "default", "extensive"], default="default")
    t.add_argument("--config", help="YAML file with Config settings")
    t.add_argument("--storage", help="Optuna RDB URL (default sqlite:///OUTPUT/studies.db)")
    t.add_argument("--run-id", help="name of the run in the storage (default: output folder name)")
    t.add_argument("--worker", action="store_true",
                   help="cooperate with other workers on the same --storage run")
    t.add_argument("--heartbeat-grace", type=_positive_float,
                   help="seconds without a heartbeat before a worker's trial is failed and "
                        "retried (default 180; workers only)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--timing", choices=["fast", "robust"], default="robust")
    t.add_argument("--threads", type=_positive_int, default=1, help="ONNX Runtime intra-op threads")
    t.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=True,
                   help="build and time in a worker subprocess, so a crash or hang fails only "
                        "that trial (default; --no-isolate runs the backend in this process)")
    t.add_argument("--scales", choices=["auto", "default", "calibrated"], default="auto",
                   help="scales used in trials (auto: calibrated for ONNX Runtime, default for TensorRT)")
    t.add_argument("--calibration-data", help=".npz of input name -> array (batch on axis 0)")
    t.add_argument("--calibration-method", default=DEFAULT_CALIBRATION_METHOD,
                   choices=["minmax", "percentile", "entropy", "mse"],
                   help=f"activation scales (default {DEFAULT_CALIBRATION_METHOD}: the lowest "
                        "output error in benchmarks/calibration_methods.py)")
    _add_accuracy_args(t)
    t.add_argument("--pattern-cache", help="YAML pattern cache of an earlier run (warm start)")
    t.add_argument("--qdq-baseline", help="Q/DQ model whose placement seeds the search")
    t.add_argument("--performance-threshold", type=_positive_float)
    t.add_argument("--timeout", type=_positive_float, help="seconds for the whole run")
    t.add_argument("--fresh", action="store_true", help="discard this run's studies and start over")
    t.add_argument("-q", "--quiet", action="store_true")
    t.add_argument("-v", "--verbose", action="store_true")

    i = sub.add_parser("inspect", help="print regions, patterns and insertion points")
    i.add_argument("model")
    _add_model_args(i)
    i.add_argument("--runtime", choices=["onnxruntime", "tensorrt"], default="onnxruntime")
    i.add_argument("--json", action="store_true", help="machine-readable output (stable schema)")

    d = sub.add_parser("dashboard", help="open a run's studies in optuna-dashboard")
    d.add_argument("output", help="the run's output folder")
    d.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    d.add_argument("--port", type=_port, default=8080,
                   help="TCP port (default 8080; 0 picks a free one, printed at start)")
    d.add_argument("--storage", help="storage URL when the run did not use OUTPUT/studies.db")

    e = sub.add_parser("example", help="write an example model (resnet, mobilenet, yolo, transformer, ...)")
    e.add_argument("name")
    e.add_argument("output")
    e.add_argument("--size", choices=["full", "medium", "small"], default="medium")

    b = sub.add_parser("bench", help="run a sampler-comparison recipe (studies/*.yaml); resumes")
    b.add_argument("recipe", help="YAML recipe: models x samplers x seeds x budgets x backend")
    b.add_argument("--output", help="results folder (default: the recipe's output, or runs/NAME)")
    b.add_argument("--only", metavar="SUBSTRING",
                   help="run only the runs whose name (MODEL-SAMPLER-sSEED-bBUDGET) contains it")
    b.add_argument("-q", "--quiet", action="store_true")
    return parser


def _config_from(args: argparse.Namespace):
    from .config import Config

    base = Config.from_yaml(args.config).to_dict() if getattr(args, "config", None) else {}
    overrides = {
        "schemes_per_region": getattr(args, "schemes_per_region", None),
        "converged_patience": getattr(args, "converged_patience", None),
        "refine_rounds": getattr(args, "refine_rounds", None),
        "performance_threshold": getattr(args, "performance_threshold", None),
        "maximum_sequence_region_size": args.maximum_sequence_region_size,
        "minimum_topdown_search_size": args.minimum_topdown_search_size,
        "verbose": getattr(args, "verbose", False) or None,
    }
    return Config.preset(getattr(args, "mode", "default"), **{**base, **overrides})


def cmd_tune(args: argparse.Namespace) -> int:
    from .search._options import TuneOptions
    from .search._run import Tuner

    if args.model and Path(args.output).resolve() == Path(args.model).resolve():
        raise OptionError("--output must be a folder, not the model file")
    if Path(args.output).exists() and not Path(args.output).is_dir():
        raise OptionError(f"--output {args.output}: exists and is not a folder")
    opts = TuneOptions(
        model=args.model, output_dir=args.output, backend=args.backend, runtime=args.runtime,
        quant_type=args.quant_type, input_shapes=args.input_shapes, config=_config_from(args),
        sampler=args.sampler, storage=args.storage, seed=args.seed, timing=args.timing,
        scales=args.scales, calibration_data=args.calibration_data,
        calibration_method=args.calibration_method, pattern_cache=args.pattern_cache,
        qdq_baseline=args.qdq_baseline, fresh=args.fresh, timeout=args.timeout,
        run_id=args.run_id, worker=args.worker, heartbeat_grace=args.heartbeat_grace,
        preprocess=args.preprocess,
        threads=args.threads, isolate=args.isolate, progress=not args.quiet,
        validation_data=args.validation_data, metric=args.metric,
        error_measure=args.error_measure, max_output_error=args.max_output_error,
        objectives=args.objectives,
    )
    result = Tuner(opts).run()
    r = result.report
    lo, hi = r["speedup_ci"]
    if not args.quiet:
        print(
            f"baseline {r['baseline_latency_ms']:.3f} ms -> tuned {r['final_latency_ms']:.3f} ms: "
            f"speedup {r['speedup']:.3f}x (95% CI {lo:.3f}-{hi:.3f}); "
            f"{len(r['quantized_tensors'])} tensors quantized; {r['measurements']} measurements"
        )
        if "final_output_error" in r:
            print(f"output error vs FP32 ({r['error_measure']}): {r['final_output_error']:.4g}"
                  + (f" (budget {r['max_output_error']:g})" if r.get("max_output_error") else ""))
        if r.get("pareto"):
            print(f"{sum(p['on_front'] for p in r['pareto'])} models on the latency/error front "
                  f"in {result.output_dir}/pareto/")
        print(f"wrote {result.output_dir}/optimized.onnx, report.md, report.json")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from .config import Config
    from .model import PreparedModel

    cfg = Config(
        maximum_sequence_region_size=args.maximum_sequence_region_size or 10,
        minimum_topdown_search_size=args.minimum_topdown_search_size or 10,
    )
    pm = PreparedModel.prepare(args.model, runtime=args.runtime, quant_type=args.quant_type,
                               input_shapes=args.input_shapes, config=cfg, preprocess=args.preprocess)
    doc = pm.to_json()
    if args.json:
        json.dump(doc, sys.stdout, indent=1)
        sys.stdout.write("\n")
        return 0
    leaves = sum(1 for r in doc["regions"] if r["type"] == "LEAF")
    described = doc["graph"]
    print(f"{doc['model']}: {doc['nodes']} nodes, opset {doc['opset']}, {len(doc['regions'])} regions "
          f"({leaves} leaves), {len(doc['patterns'])} patterns, rules: {doc['runtime']}")
    print(f"describes {described['description']} ({described['nodes']} nodes; the file has "
          f"{described['file_nodes']}); nodes are named as in the file"
          + (", fused nodes as listed under 'fused'" if doc["node_origins"] else ""))
    for p in doc["patterns"]:
        print(f"\n{p['id']} {p['signature'][:12]}  {len(p['regions'])} region(s) {p['regions']}  "
              f"ops: {' '.join(p['ops'])}" + ("" if p["tuned"] else "  (no insertion point: not tuned)"))
        for pt in p["insertion_points"]:
            first = next(iter(pt["resolved"].values()))
            more = f" (+{len(pt['resolved']) - 1} regions)" if len(pt["resolved"]) > 1 else ""
            weights = next(iter(pt["weights"].values()), [])
            with_w = f"  + weights {', '.join(weights)}" if weights else ""
            print(f"  {pt['id']:<28} {pt['kind']:<17} -> {', '.join(first) or '-'}{more}{with_w}")
        for g in p["concat_groups"]:
            print(f"  concat group: {' '.join(g)}")
    if doc["node_origins"]:
        print("\nfused (node here <- the file's nodes it stands for):")
        for name, labels in doc["node_origins"].items():
            print(f"  {name} <- {', '.join(labels) or '(new)'}")
    w = doc["weights"]
    print(f"\nweights: {len(w['quantized'])} can be quantized (with their activation's Q/DQ), "
          f"{len(w['float'])} stay float")
    for name, why in w["float"].items():
        print(f"  float: {name}: {why}")
    return 0


def cmd_example(args: argparse.Namespace) -> int:
    import onnx

    from . import zoo
    from .export import atomic_write_bytes

    try:
        model = zoo.build(args.name, args.size)
    except ValueError as exc:
        raise OptionError(str(exc)) from None
    onnx.checker.check_model(model)
    atomic_write_bytes(args.output, model.SerializeToString())
    print(f"wrote {args.output} ({len(model.graph.node)} nodes)")
    return 0


def cmd_dashboard(args: argparse.Namespace) -> int:
    from .dashboard import serve

    serve(args.output, host=args.host, port=args.port, storage=args.storage)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import bench

    echo = None if args.quiet else (lambda line: print(line, flush=True))
    records, paths = bench(args.recipe, output=args.output, only=args.only, echo=echo)
    if not args.quiet:
        print(paths["summary"].read_text(), end="")
        print(f"wrote {', '.join(str(p) for p in paths.values() if p.exists())}")
    return 0


COMMANDS = {"tune": cmd_tune, "inspect": cmd_inspect, "example": cmd_example,
            "dashboard": cmd_dashboard, "bench": cmd_bench}


def main(argv: list[str] | None = None) -> int:
    verbose = "-v" in (argv or sys.argv[1:]) or "--verbose" in (argv or sys.argv[1:])
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="qdq-optuna: %(levelname)s: %(message)s")
    try:
        import onnxruntime

        onnxruntime.set_default_logger_severity(3)
    except ImportError:
        pass
    try:
        args = build_parser().parse_args(argv)
        return COMMANDS[args.command](args)
    except UserError as exc:  # one line even if a file or tensor name holds a line break
        message = " ".join(part.strip() for part in str(exc).splitlines() if part.strip())
        print(f"qdq-optuna: error: {message or type(exc).__name__}", file=sys.stderr)
        return EXIT_USAGE
    except BackendUnavailable as exc:
        print(f"qdq-optuna: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BackendError as exc:  # outside a trial (a reference or the final measurement)
        message = " ".join(part.strip() for part in str(exc).splitlines() if part.strip())
        print(f"qdq-optuna: error: measuring failed: {message}; finished trials are saved, "
              "rerun the same command to resume", file=sys.stderr)
        return 1
    except BrokenPipeError:  # e.g. piped into head
        return 0
    except KeyboardInterrupt:
        print("qdq-optuna: interrupted; the running trial was marked failed and will be redone. "
              "Rerun the same command to resume.", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:  # an internal error: one line, traceback with -v
        if verbose:
            raise
        first = str(exc).strip().splitlines()
        print(f"qdq-optuna: internal error: {type(exc).__name__}: {first[0] if first else ''} "
              "(rerun with -v for the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
