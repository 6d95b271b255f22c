"""qdq-optuna: a thin layer over the library (every command is one library call)."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import warnings
from pathlib import Path

from qdq_optuna import __version__
from qdq_optuna._files import TRACEBACK_FILE, atomic_write_bytes
from qdq_optuna.accuracy_words import WITHIN_BOUND
from qdq_optuna.backends.base import BackendError, BackendUnavailable
from qdq_optuna.errors import (
    OptionError,
    UserError,
    interrupted_by,
    interrupting_signal,
    stop_signals_as_interrupt,
)
from qdq_optuna.runtimes import DEFAULT_RUNTIME

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
#: where ``tune`` writes when no --output is given (a folder in the working directory)
DEFAULT_OUTPUT = "qdq_optuna_output"

DESCRIPTION = """\
qdq-optuna decides where Quantize/Dequantize (Q/DQ) pairs go in an ONNX model so that the
quantized model runs fastest on its target runtime: one Optuna study per region pattern."""

TUNE_EXAMPLES = """\
examples:
  qdq-optuna tune -m model.onnx                       # ONNX Runtime CPU; results in ./qdq_optuna_output
  qdq-optuna tune -m model.onnx -o out --mode quick   # fewer schemes per pattern: a first look
  qdq-optuna tune -m model.onnx -o out -b costmodel --runtime tensorrt
  qdq-optuna tune -m model.onnx -o out --calibration-data calib.npz --max-output-error 0.05
  qdq-optuna tune -m model.onnx -o out --exclude-nodes '/head/.*' --op-types Conv,MatMul
rerun the same command to resume an interrupted run; --fresh starts over.
terms in the progress lines and the report:
  start           a whole model measured before the descent: float, all (every insertion
                  point on), the runtime's recipe (quantize_static, NNCF), your seeds
  standing model  the best whole model so far; every candidate is measured against it
  visit           one pattern's Optuna study in one descent round
  lane            one descent from one start (--start all, or best with the recipe close)"""


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)

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
_threshold = _number(float, lambda v: 1.0 <= v < float("inf"), "a number >= 1.0 (1.02: 2 % faster)")


def _add_verbosity(p: argparse.ArgumentParser, top: bool = False) -> None:
    """-v / -q, accepted before the command and after it (the command's value wins)."""
    g = p.add_argument_group("output detail") if not top else p
    x = g.add_mutually_exclusive_group()
    x.add_argument("-v", "--verbose", action="count", default=0 if top else argparse.SUPPRESS,
                   help="more detail: INFO log lines, and the traceback of an internal error "
                        "(-vv: DEBUG)")
    x.add_argument("-q", "--quiet", action="store_true", default=False if top else argparse.SUPPRESS,
                   help="no progress output, only warnings and errors")


#: the CLI's checked number types, by the name a tune option's metadata gives
ARG_TYPES = {"int": int, "positive_int": _positive_int, "positive_float": _positive_float,
             "count": _count, "threshold": _threshold}


def add_options(groups: dict, names=None, **overrides) -> None:
    """The flags of :class:`~qdq_optuna.TuneOptions`'s fields (``names``: only these), each
    defined once, on the field (:func:`~qdq_optuna.search.option`); ``groups``: group
    name -> argparse group; ``overrides``: field name -> changed argparse keywords."""
    import dataclasses

    from qdq_optuna.config import field_flags
    from qdq_optuna.search import TuneOptions

    for f in dataclasses.fields(TuneOptions):
        m = f.metadata
        if not m.get("group") or (names is not None and f.name not in names):
            continue
        kw = {"dest": f.name, "help": m["help"]}
        default = f.default if f.default is not dataclasses.MISSING else None
        if default is True:
            kw.update(action=argparse.BooleanOptionalAction, default=True)
        elif default is False:
            kw.update(action="store_true", default=False)
        else:
            kw.update(default=default, choices=m["choices"], metavar=m["metavar"],
                      type=ARG_TYPES.get(m["type"]) if m["type"] else None)
            if m["nargs"]:
                kw.update(nargs=m["nargs"], action="extend")
        kw = {k: v for k, v in {**kw, **overrides.get(f.name, {})}.items() if v is not None
              or k == "default"}
        groups[m["group"]].add_argument(*field_flags(f), **kw)


#: the model-side flags that ``inspect`` shares with ``tune``
MODEL_OPTIONS = ("input_shapes", "quant_type", "preprocess", "high_precision", "keep_io_types",
                 "exclude_nodes", "op_types", "opset_upgrade")


def add_config_options(g, names: tuple[str, ...]) -> None:
    """The flags of :class:`~qdq_optuna.config.Config`'s fields ``names``, each defined once,
    on the field (:func:`~qdq_optuna.config.flag`); a flag not given is None (the preset's or
    the YAML file's value stands)."""
    import dataclasses

    from qdq_optuna.config import Config, field_flags

    by_name = {f.name: f for f in dataclasses.fields(Config)}
    for name in names:
        m = by_name[name].metadata
        kw = {"type": ARG_TYPES.get(m["type"]) if m["type"] else None,
              "metavar": m["metavar"], "choices": m["choices"]}
        g.add_argument(*field_flags(by_name[name]), help=m["flag_help"],
                       **{k: v for k, v in kw.items() if v})


def _add_region_args(g) -> None:
    add_config_options(g, ("maximum_sequence_region_size", "minimum_topdown_search_size"))


def _add_search_args(g) -> None:
    add_config_options(g, ("schemes_per_region",))
    g.add_argument("--mode", choices=["quick", "default", "extensive"], default="default",
                   help="budget preset: quick (10 schemes per pattern), default (30), "
                        "extensive (80, larger mutations)")
    add_config_options(g, ("converged_patience", "start", "refine_rounds",
                           "performance_threshold"))
    g.add_argument("--config", metavar="FILE.yaml", help="YAML file with Config settings")


def _add_tune(sub) -> None:
    from qdq_optuna.search import OPTION_GROUPS

    t = sub.add_parser(
        "tune", help="search the Q/DQ placement (resumes automatically)",
        usage="qdq-optuna tune -m MODEL [-o DIR] [options]",
        description="Search where Q/DQ pairs go in MODEL: whole-model starts, then rounds "
                    "over the patterns,\neach tuned against the whole model, measuring every "
                    "candidate on the backend;\nwrites DIR/optimized.onnx, report.md, "
                    "report.json and the studies.",
        epilog=TUNE_EXAMPLES)
    groups = {name: t.add_argument_group(name, about) for name, about in OPTION_GROUPS.items()}
    add_options(groups, model={"required": True, "default": None},
                output_dir={"default": DEFAULT_OUTPUT})
    _add_region_args(groups["model"])
    _add_search_args(groups["search"])
    _add_verbosity(t)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="qdq-optuna", description=DESCRIPTION,
                     epilog="run 'qdq-optuna COMMAND -h' for the options of a command")
    parser.add_argument("--version", action="version", version=f"qdq-optuna {__version__}")
    _add_verbosity(parser, top=True)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    _add_tune(sub)

    i = sub.add_parser("inspect", help="print regions, patterns and insertion points",
                       description="Print the regions, patterns and insertion points of MODEL "
                                   "and the tensors they resolve to.")
    i.add_argument("model", help="ONNX model")
    add_options({"model": i}, names=("runtime", *MODEL_OPTIONS),
                runtime={"default": DEFAULT_RUNTIME,
                         "help": "whose fusion rules place the Q/DQ (default %(default)s)"})
    _add_region_args(i)
    i.add_argument("--json", action="store_true", help="machine-readable output (stable schema)")
    _add_verbosity(i)

    d = sub.add_parser("dashboard", help="open a run's studies in optuna-dashboard",
                       description="Serve a run's studies and artifacts with optuna-dashboard.")
    d.add_argument("output", help="the run's output folder")
    d.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    d.add_argument("-p", "--port", type=_port, default=8080,
                   help="TCP port (default 8080; 0 picks a free one, printed at start)")
    d.add_argument("--storage", metavar="URL",
                   help="storage URL when the run did not use OUTPUT/studies.db")
    _add_verbosity(d)

    e = sub.add_parser("example", help="write an example model (resnet, mobilenet, yolo, "
                                       "transformer, ...)",
                       description="Write one of the built-in example models to an ONNX file.")
    e.add_argument("name", help="resnet, mobilenet, yolo, transformer, or a tiny_* model")
    e.add_argument("output", help="the .onnx file to write")
    e.add_argument("--size", choices=["full", "medium", "small"], default="medium",
                   help="model size (default %(default)s)")
    _add_verbosity(e)

    from qdq_optuna.cli.bench import recipe_names

    b = sub.add_parser("bench", help="run a sampler-comparison recipe; resumes",
                       description="Run every model x sampler x seed x budget of a recipe as "
                                   "one tune run, then\nwrite results.csv, results.json, "
                                   "summary.md and bench.png (with matplotlib).")
    b.add_argument("recipe", help="a shipped recipe by name "
                                  f"({', '.join(recipe_names()) or 'none found'}) or a YAML file")
    b.add_argument("-o", "--output",
                   help="results folder (default: the recipe's output, or runs/NAME)")
    b.add_argument("--only", metavar="SUBSTRING",
                   help="run only the runs whose name (MODEL-SAMPLER-sSEED-bBUDGET) contains it")
    _add_verbosity(b)
    return parser


def _config_from(args: argparse.Namespace):
    """The run's Config from ``--mode``, ``--config`` and the search flags, as ``tune()``
    makes it from the same keywords."""
    import dataclasses

    from qdq_optuna._tune import _config
    from qdq_optuna.config import Config

    given = {f.name: getattr(args, f.name, None) for f in dataclasses.fields(Config)
             if "flag_help" in f.metadata}  # the flags given (None: not given)
    return _config(getattr(args, "config", None), getattr(args, "mode", "default"),
                   verbose=bool(getattr(args, "verbose", 0)) or None, **given)


def _node_filter(args: argparse.Namespace) -> dict:
    """--exclude-nodes / --op-types as keyword arguments (only those given)."""
    given = {"exclude_nodes": args.exclude_nodes, "op_types": args.op_types}
    return {k: v for k, v in given.items() if v}


def cmd_tune(args: argparse.Namespace) -> int:
    from qdq_optuna import tune

    if args.model and Path(args.output_dir).resolve() == Path(args.model).resolve():
        raise OptionError("--output must be a folder, not the model file")
    if Path(args.output_dir).exists() and not Path(args.output_dir).is_dir():
        raise OptionError(f"--output {args.output_dir}: exists and is not a folder")
    keywords = {k: v for k, v in vars(args).items() if k != "command"}  # each flag's dest
    result = tune(keywords.pop("model"), keywords.pop("output_dir"), **keywords)
    if not args.quiet:
        _print_result(result)
    return 0


def _print_result(result) -> None:
    """tune's summary lines on stdout (the report's figures)."""
    r = result.report
    lo, hi = r["speedup_ci"]
    if result.finished_before:
        print(f"run {r['run_id']!r} finished on {r.get('finished')}; its report is unchanged "
              "(--remeasure measures the final model again, --fresh starts over)")
    print(f"baseline {r['baseline_latency_ms']:.3f} ms -> tuned {r['final_latency_ms']:.3f} ms: "
          f"speedup {r['speedup']:.3f}x (95% CI {lo:.3f}-{hi:.3f}); "
          f"{len(r['quantized_tensors'])} tensors quantized; {r['measurements']} "
          f"measurement{'s' if r['measurements'] != 1 else ''}")
    acc = r.get("accuracy")
    if acc:
        left_out = (f"; Q/DQ on {', '.join(acc['responsible_tensors'])} left out"
                    if acc["status"] != WITHIN_BOUND and acc["responsible_tensors"] else "")
        print(f"output error vs FP32 ({acc['measure']}, worst output, on {acc['data_kind']}): "
              f"{acc['error']:.4g}, bound {acc['bound']:g}: {acc['status']}{left_out}")
    if r.get("pareto"):
        print(f"{sum(p['on_front'] for p in r['pareto'])} models on the latency/error front "
              f"in {result.output_dir}/pareto/")
    done = "kept (not rewritten)" if result.finished_before else "wrote"
    print(f"{done} {result.output_dir}/optimized.onnx, report.md, report.json")


def cmd_inspect(args: argparse.Namespace) -> int:
    from qdq_optuna.config import Config
    from qdq_optuna.runtimes import profile_for
    from qdq_optuna.runtimes.prepared import PreparedModel

    cfg = Config(
        maximum_sequence_region_size=args.maximum_sequence_region_size or 10,
        minimum_topdown_search_size=args.minimum_topdown_search_size or 10,
    )
    pm = PreparedModel.prepare(args.model, runtime=profile_for(args.runtime).rules, quant_type=args.quant_type,
                               input_shapes=args.input_shapes, config=cfg, preprocess=args.preprocess,
                               high_precision=args.high_precision or "fp32",
                               keep_io_types=args.keep_io_types, upgrade_opset=args.opset_upgrade,
                               **_node_filter(args))
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

    from qdq_optuna.examples import zoo

    try:
        model = zoo.build(args.name, args.size)
    except ValueError as exc:
        raise OptionError(str(exc)) from None
    onnx.checker.check_model(model)
    atomic_write_bytes(args.output, model.SerializeToString())
    print(f"wrote {args.output} ({len(model.graph.node)} nodes)")
    return 0


def cmd_dashboard(args: argparse.Namespace) -> int:
    from qdq_optuna.outputs.dashboard import serve

    serve(args.output, host=args.host, port=args.port, storage=args.storage)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from qdq_optuna.cli.bench import bench

    echo = None if args.quiet else (lambda line: print(line, flush=True))
    records, paths = bench(args.recipe, output=args.output, only=args.only, echo=echo)
    if not args.quiet:
        print(paths["summary"].read_text(), end="")
        print(f"wrote {', '.join(str(p) for p in paths.values() if p.exists())}")
    return 0


COMMANDS = {"tune": cmd_tune, "inspect": cmd_inspect, "example": cmd_example,
            "dashboard": cmd_dashboard, "bench": cmd_bench}


class _OnceEach(logging.Filter):
    """Each warning once per command: a second step that finds the same missing input (the
    calibration data, say) says nothing new."""

    def __init__(self) -> None:
        super().__init__()
        self._seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.WARNING:
            return True
        text = record.getMessage()
        if text in self._seen:
            return False
        self._seen.add(text)
        return True


def _setup_logging(verbosity: int) -> None:
    """Log records and Python warnings as ``qdq-optuna: LEVEL: message`` lines on stderr, unless
    the process configured logging itself (as ``logging.basicConfig`` decides)."""
    root = logging.getLogger()
    ours = [h for h in root.handlers if getattr(h, "_qdq_optuna", False)]
    for h in ours:
        root.removeHandler(h)  # main() called again in the same process: today's stderr
    if ours or not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("qdq-optuna: %(levelname)s: %(message)s"))
        handler._qdq_optuna = True  # type: ignore[attr-defined]
        handler.addFilter(_OnceEach())
        root.addHandler(handler)
    root.setLevel(logging.DEBUG if verbosity >= 2 else logging.INFO if verbosity else logging.WARNING)


def _warning_line(message, category, filename, lineno, file=None, line=None) -> None:
    logging.getLogger("py.warnings").warning("%s: %s (%s:%s)", category.__name__, message,
                                             Path(filename).name, lineno)


def _interrupted(exc: BaseException) -> int:
    """Ctrl-C: exit 130; SIGTERM / SIGHUP: 143 / 129 (128 + the signal, as a shell reports
    a process the signal ended), after the same clean-up."""
    signum = interrupting_signal(exc) or signal.SIGINT
    what = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
    print(f"qdq-optuna: {what}; the running trial was marked failed and will be redone. "
          "Rerun the same command to resume.", file=sys.stderr)
    return EXIT_INTERRUPTED if signum == signal.SIGINT else 128 + int(signum)


def _keep_traceback(exc: BaseException, output) -> Path | None:
    """Write ``exc``'s traceback (its causes included: a storage error's SQL one) into the
    output folder, so an error that a rerun may not repeat can still be read (None: no
    output folder to write to)."""
    import traceback

    if output is None or not Path(output).is_dir():
        return None
    text = "".join(traceback.format_exception(exc))
    try:
        return atomic_write_bytes(Path(output) / TRACEBACK_FILE, text.encode())
    except OSError:
        return None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    verbose, args = 0, None
    showwarning = warnings.showwarning
    try:
        with stop_signals_as_interrupt():  # SIGTERM / SIGHUP from here on end as Ctrl-C does
            try:
                import onnxruntime

                onnxruntime.set_default_logger_severity(3)
            except ImportError:
                pass
            args = parser.parse_args(argv)
            verbose = args.verbose
            _setup_logging(verbose)
            warnings.showwarning = _warning_line
            if args.command is None:  # bare qdq-optuna: what there is to run
                parser.print_help(sys.stderr)
                return EXIT_USAGE
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
    except KeyboardInterrupt as exc:
        return _interrupted(exc)
    except Exception as exc:  # an internal error: one line, traceback with -v
        if interrupted_by(exc):  # Ctrl-C landed in a library's clean-up
            return _interrupted(exc)
        if verbose:
            raise
        first = str(exc).strip().splitlines()
        kept = _keep_traceback(exc, getattr(args, "output_dir", None) or getattr(args, "output", None))
        where = (f"its traceback is in {kept}" if kept is not None
                 else "rerun with -v for the traceback")
        print(f"qdq-optuna: internal error: {type(exc).__name__}: {first[0] if first else ''} "
              f"({where})", file=sys.stderr)
        return 1
    finally:
        warnings.showwarning = showwarning


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
