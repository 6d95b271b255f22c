"""Fuzz the model side: mutated zoo models through load_model -> regions -> patterns -> points.

Hypothesis draws mutations of valid zoo models: byte-level (bit flips, truncation, deleted,
inserted or duplicated ranges) and field-level (node rewiring, renamed / duplicated / dropped /
reordered nodes and tensors, op types, domains, attributes, opset and IR versions, input dims
and types, initializer dims / types / data / external-data locations, value_info, input
shapes). Each mutant is written to a file and run through

    load_model -> discover_regions -> PatternIndex -> enumerate_points (both rule sets)

Refusing a mutant with :class:`qdq_optuna.errors.UserError` is the contract; any other
exception, an example slower than ``--slow`` seconds, or a load that changes the file on disk is
a *finding*: printed once per (exception type, place) with its traceback, and saved with its
mutation log as a reproducer. This is a benchmark script, not a CI test:

    python benchmarks/fuzz_loading.py --seconds 300
    python benchmarks/fuzz_loading.py --seconds 60 --models tiny_chain,tiny_concat --seed 3
    python benchmarks/fuzz_loading.py --replay /tmp/qdq-optuna-fuzz/finding-01-KeyError.onnx

The example being run is always at ``FINDINGS/current.onnx``: if the process dies (a crash in
native code), that file is the reproducer. Exit status: 0 without findings, 1 with.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import re
import resource
import signal
import sys
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import onnx  # noqa: E402
from hypothesis import HealthCheck, Phase, Verbosity, given, settings  # noqa: E402
from hypothesis import seed as hypothesis_seed  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from onnx import AttributeProto, TensorProto  # noqa: E402

from qdq_optuna.errors import UserError  # noqa: E402
from qdq_optuna.examples import zoo  # noqa: E402
from qdq_optuna.model.graph import InputShapes, load_model  # noqa: E402
from qdq_optuna.placement.patterns import PatternIndex  # noqa: E402
from qdq_optuna.placement.points import enumerate_points  # noqa: E402
from qdq_optuna.placement.regions import RegionConfig, discover_regions  # noqa: E402
from qdq_optuna.runtimes import profile_for  # noqa: E402

DEFAULT_MODELS = (
    "tiny_chain,tiny_residual,tiny_concat,tiny_attention,resnet,mobilenet,yolo,transformer"
)
RUNTIMES = ("onnxruntime", "tensorrt")
BATCH = 25
OP_TYPES = [
    "Conv", "Relu", "Add", "Mul", "MatMul", "Gemm", "Concat", "MaxPool", "GlobalAveragePool",
    "Flatten", "Reshape", "Transpose", "Softmax", "Identity", "Constant", "ConstantOfShape",
    "QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "If", "Loop", "Split",
    "Resize", "Gather", "LayerNormalization", "Frobnicate", "",
]
DOMAINS = ["", "ai.onnx", "ai.onnx.ml", "com.microsoft", "custom.domain"]
WEIRD_NAMES = ["", "ghost", "a\nb", "\u2028", "../x", "#0", "x" * 300, "名前"]
INTERESTING_INTS = [0, 1, -1, 2, 3, 7, 255, 2**31 - 1, -(2**31), 2**62, 10**9]
INTERESTING_DIMS = [0, 1, 3, 16, -1, -7, 10**6, 10**9, 10**12, 2**62]
LOCATIONS = ["w.bin", "../w.bin", "/dev/zero", "/etc/hostname", "", ".", "sub/../w.bin",
             "missing.bin", "w.bin\x00x", "x" * 5000, "model.onnx"]


class _Hang(Exception):
    pass


@dataclass
class Stats:
    examples: int = 0
    accepted: int = 0
    refused: Counter = field(default_factory=Counter)
    reasons: Counter = field(default_factory=Counter)
    findings: dict[tuple[str, str], Path] = field(default_factory=dict)
    slowest: float = 0.0


# -- mutations -------------------------------------------------------------------------------


def _tensor_names(model: onnx.ModelProto) -> list[str]:
    g = model.graph
    names = [i.name for i in g.input] + [t.name for t in g.initializer]
    names += [o for n in g.node for o in n.output]
    return names or ["x"]


def _pick(draw, seq):
    return seq[draw(st.integers(0, len(seq) - 1))]


def mutate_proto(draw, model: onnx.ModelProto, log: list[str]) -> None:
    """One field-level edit of ``model`` (in place), described in ``log``."""
    g = model.graph
    kinds = [
        "rewire", "rename_output", "op_type", "domain", "drop_node", "dup_node", "swap_nodes",
        "node_name", "attr_delete", "attr_int", "attr_ints", "attr_type", "opset", "ir_version",
        "input_dim", "input_dtype", "input_noshape", "drop_input", "output_rename",
        "drop_outputs", "init_dims", "init_dtype", "init_data", "drop_init", "init_rename",
        "init_external", "value_info", "add_input_slot", "drop_input_slot", "extra_opset",
    ]
    # edits that usually keep the model valid are drawn more often, so that regions, patterns
    # and insertion points see many odd but loadable graphs
    kind = _pick(draw, kinds + ["rewire_earlier"] * 8 + ["dup_node"] * 3 + ["rename_tensor"] * 2)
    nodes = g.node
    n = len(nodes)
    names = _tensor_names(model)
    if kind in ("rewire", "rename_output", "op_type", "domain", "drop_node", "dup_node",
                "node_name", "attr_delete", "attr_int", "attr_ints", "attr_type",
                "add_input_slot", "drop_input_slot") and n == 0:
        kind = "opset"
    if kind == "rewire_earlier" and n:
        # point one input at an activation that exists before the node (a new edge, still a DAG)
        i = draw(st.integers(0, n - 1))
        node = nodes[i]
        earlier = [x.name for x in g.input] + [o for m in nodes[:i] for o in m.output if o]
        if node.input and earlier:
            j = draw(st.integers(0, len(node.input) - 1))
            new = _pick(draw, earlier)
            log.append(f"node {i} ({node.name}) input {j}: {node.input[j]!r} -> {new!r}")
            node.input[j] = new
    elif kind == "rename_tensor" and n:
        # rename a node output and every use of it (the same graph, other names)
        i = draw(st.integers(0, n - 1))
        if nodes[i].output:
            old = nodes[i].output[0]
            new = _pick(draw, [old + "_renamed", "0", "x/y:z", "名前", "output"])
            log.append(f"tensor {old!r} renamed {new!r} everywhere")
            for m in nodes:
                for k, t in enumerate(m.input):
                    if t == old:
                        m.input[k] = new
                for k, t in enumerate(m.output):
                    if t == old:
                        m.output[k] = new
            for vi in list(g.output) + list(g.value_info):
                if vi.name == old:
                    vi.name = new
    elif kind == "rewire":
        i = draw(st.integers(0, n - 1))
        node = nodes[i]
        if node.input:
            j = draw(st.integers(0, len(node.input) - 1))
            new = _pick(draw, names + WEIRD_NAMES)
            log.append(f"node {i} ({node.name}) input {j}: {node.input[j]!r} -> {new!r}")
            node.input[j] = new
    elif kind == "rename_output":
        i = draw(st.integers(0, n - 1))
        node = nodes[i]
        if node.output:
            j = draw(st.integers(0, len(node.output) - 1))
            new = _pick(draw, names + WEIRD_NAMES)
            log.append(f"node {i} ({node.name}) output {j}: {node.output[j]!r} -> {new!r}")
            node.output[j] = new
    elif kind == "op_type":
        i = draw(st.integers(0, n - 1))
        new = _pick(draw, OP_TYPES)
        log.append(f"node {i} ({nodes[i].name}) op_type {nodes[i].op_type} -> {new!r}")
        nodes[i].op_type = new
    elif kind == "domain":
        i = draw(st.integers(0, n - 1))
        new = _pick(draw, DOMAINS)
        log.append(f"node {i} ({nodes[i].name}) domain -> {new!r}")
        nodes[i].domain = new
    elif kind == "drop_node":
        i = draw(st.integers(0, n - 1))
        log.append(f"drop node {i} ({nodes[i].name})")
        del nodes[i]
    elif kind == "dup_node":
        i = draw(st.integers(0, n - 1))
        at = draw(st.integers(0, n))
        copy = onnx.NodeProto()
        copy.CopyFrom(nodes[i])
        if draw(st.booleans()):
            copy.name += "_dup"
            for k in range(len(copy.output)):
                copy.output[k] += "_dup"
        log.append(f"duplicate node {i} ({nodes[i].name}) at {at} as {copy.name!r}")
        rest = list(nodes)
        rest.insert(at, copy)
        del nodes[:]
        nodes.extend(rest)
    elif kind == "swap_nodes":
        i, j = draw(st.integers(0, n - 1)), draw(st.integers(0, n - 1))
        log.append(f"swap nodes {i} and {j}")
        a, b = onnx.NodeProto(), onnx.NodeProto()
        a.CopyFrom(nodes[i])
        b.CopyFrom(nodes[j])
        nodes[i].CopyFrom(b)
        nodes[j].CopyFrom(a)
    elif kind == "node_name":
        i = draw(st.integers(0, n - 1))
        new = _pick(draw, [m.name for m in nodes] + WEIRD_NAMES)
        log.append(f"node {i} name {nodes[i].name!r} -> {new!r}")
        nodes[i].name = new
    elif kind in ("attr_delete", "attr_int", "attr_ints", "attr_type"):
        with_attrs = [k for k in range(n) if nodes[k].attribute]
        if not with_attrs:
            return
        i = _pick(draw, with_attrs)
        attrs = nodes[i].attribute
        j = draw(st.integers(0, len(attrs) - 1))
        a = attrs[j]
        where = f"node {i} ({nodes[i].name}) attribute {a.name}"
        if kind == "attr_delete":
            log.append(f"{where}: deleted")
            del attrs[j]
        elif kind == "attr_int":
            v = _pick(draw, INTERESTING_INTS)
            log.append(f"{where}: i = {v}")
            a.i = v
        elif kind == "attr_ints":
            vals = draw(st.lists(st.sampled_from(INTERESTING_INTS), max_size=6))
            log.append(f"{where}: ints = {vals}")
            a.type = AttributeProto.INTS
            del a.ints[:]
            a.ints.extend(vals)
        else:
            t = draw(st.sampled_from([AttributeProto.FLOAT, AttributeProto.INT,
                                      AttributeProto.STRING, AttributeProto.INTS,
                                      AttributeProto.TENSOR, AttributeProto.GRAPH,
                                      AttributeProto.UNDEFINED]))
            log.append(f"{where}: type -> {t}")
            a.type = t
    elif kind == "opset":
        v = draw(st.sampled_from([0, 1, 6, 7, 9, 10, 11, 13, 17, 21, 23, 24, 99, -1, 2**40]))
        if model.opset_import:
            log.append(f"opset {model.opset_import[0].version} -> {v}")
            model.opset_import[0].version = v
        else:
            model.opset_import.add(domain="", version=v)
    elif kind == "extra_opset":
        dom = _pick(draw, DOMAINS)
        v = draw(st.sampled_from([1, 7, 17, 99]))
        log.append(f"add opset import {dom!r} {v}")
        model.opset_import.add(domain=dom, version=v)
    elif kind == "ir_version":
        v = draw(st.sampled_from([0, 1, 3, 4, 7, 8, 9, 10, 11, 12, 99, -1]))
        log.append(f"ir_version -> {v}")
        model.ir_version = v
    elif kind in ("input_dim", "input_dtype", "input_noshape", "drop_input"):
        if not g.input:
            return
        i = draw(st.integers(0, len(g.input) - 1))
        vi = g.input[i]
        tt = vi.type.tensor_type
        if kind == "input_dim" and tt.shape.dim:
            k = draw(st.integers(0, len(tt.shape.dim) - 1))
            if draw(st.booleans()):
                v = _pick(draw, INTERESTING_DIMS)
                log.append(f"input {vi.name} dim {k} -> {v}")
                tt.shape.dim[k].dim_value = v
            else:
                p = _pick(draw, ["N", "", "batch"])
                log.append(f"input {vi.name} dim {k} -> param {p!r}")
                tt.shape.dim[k].dim_param = p
        elif kind == "input_dtype":
            v = draw(st.integers(0, 25))
            log.append(f"input {vi.name} elem_type -> {v}")
            tt.elem_type = v
        elif kind == "input_noshape":
            log.append(f"input {vi.name}: shape cleared")
            tt.ClearField("shape")
        else:
            log.append(f"drop graph input {vi.name}")
            del g.input[i]
    elif kind == "output_rename":
        if g.output:
            new = _pick(draw, names + WEIRD_NAMES)
            log.append(f"graph output {g.output[0].name!r} -> {new!r}")
            g.output[0].name = new
    elif kind == "drop_outputs":
        log.append("drop all graph outputs")
        del g.output[:]
    elif kind in ("init_dims", "init_dtype", "init_data", "drop_init", "init_rename",
                  "init_external"):
        if not g.initializer:
            return
        i = draw(st.integers(0, len(g.initializer) - 1))
        t = g.initializer[i]
        if kind == "init_dims":
            dims = draw(st.lists(st.sampled_from(INTERESTING_DIMS + [2, 8, 10]), max_size=5))
            log.append(f"initializer {t.name} dims {list(t.dims)} -> {dims}")
            del t.dims[:]
            t.dims.extend(dims)
        elif kind == "init_dtype":
            v = draw(st.integers(0, 25))
            log.append(f"initializer {t.name} data_type {t.data_type} -> {v}")
            t.data_type = v
        elif kind == "init_data":
            cut = draw(st.integers(0, max(0, len(t.raw_data))))
            extra = draw(st.binary(max_size=16))
            log.append(f"initializer {t.name} raw_data cut at {cut} + {len(extra)} bytes")
            t.raw_data = t.raw_data[:cut] + extra
        elif kind == "drop_init":
            log.append(f"drop initializer {t.name}")
            del g.initializer[i]
        elif kind == "init_rename":
            new = _pick(draw, names + WEIRD_NAMES)
            log.append(f"initializer {t.name!r} renamed {new!r}")
            t.name = new
        else:
            loc = _pick(draw, LOCATIONS)
            offset = draw(st.sampled_from(["0", "4", "-4", "abc", "", "99999999999"]))
            length = draw(st.sampled_from([None, "0", "16", "-1", "x", "10000000000"]))
            log.append(f"initializer {t.name} external: {loc!r} offset {offset} length {length}")
            t.ClearField("raw_data")
            t.data_location = TensorProto.EXTERNAL
            del t.external_data[:]
            for key, value in (("location", loc), ("offset", offset), ("length", length)):
                if value is not None:
                    e = t.external_data.add()
                    e.key, e.value = key, value
    elif kind == "value_info":
        name = _pick(draw, names)
        dims = draw(st.lists(st.sampled_from(INTERESTING_DIMS), max_size=4))
        dtype = draw(st.integers(0, 16))
        log.append(f"value_info {name!r}: type {dtype} dims {dims}")
        vi = g.value_info.add()
        vi.name = name
        vi.type.tensor_type.elem_type = dtype
        for d in dims:
            vi.type.tensor_type.shape.dim.add().dim_value = d
    elif kind == "add_input_slot":
        i = draw(st.integers(0, n - 1))
        new = _pick(draw, names + [""])
        log.append(f"node {i} ({nodes[i].name}) extra input {new!r}")
        nodes[i].input.append(new)
    elif kind == "drop_input_slot":
        i = draw(st.integers(0, n - 1))
        if nodes[i].input:
            log.append(f"node {i} ({nodes[i].name}) drops its last input")
            del nodes[i].input[-1]


def mutate_bytes(draw, data: bytes, log: list[str]) -> bytes:
    if not data:
        return data
    kind = draw(st.sampled_from(["bitflip", "truncate", "delete", "insert", "dup", "byte"]))
    pos = draw(st.integers(0, len(data) - 1))
    if kind == "bitflip":
        bit = draw(st.integers(0, 7))
        log.append(f"flip bit {bit} of byte {pos}")
        return data[:pos] + bytes([data[pos] ^ (1 << bit)]) + data[pos + 1:]
    if kind == "truncate":
        log.append(f"truncate at {pos}")
        return data[:pos]
    if kind == "delete":
        size = draw(st.integers(1, 64))
        log.append(f"delete {size} bytes at {pos}")
        return data[:pos] + data[pos + size:]
    if kind == "insert":
        extra = draw(st.binary(min_size=1, max_size=32))
        log.append(f"insert {extra.hex()} at {pos}")
        return data[:pos] + extra + data[pos:]
    if kind == "dup":
        size = draw(st.integers(1, 256))
        log.append(f"duplicate {size} bytes at {pos}")
        return data[:pos] + data[pos:pos + size] + data[pos:]
    value = draw(st.sampled_from([0x00, 0xFF, 0x7F, 0x80, 0x08, 0x12]))
    log.append(f"byte {pos} = {value:#04x}")
    return data[:pos] + bytes([value]) + data[pos + 1:]


# -- the pipeline ----------------------------------------------------------------------------


def pipeline(path: Path, shapes: str | None, region_config: RegionConfig,
             prepare: bool = False) -> None:
    graph = load_model(path, InputShapes.parse(shapes))
    tree = discover_regions(graph, region_config)
    index = PatternIndex(graph, tree)
    for runtime in RUNTIMES:
        rules = profile_for(runtime).rules
        for pattern in index.patterns:
            enumerate_points(graph, tree, index, pattern, rules)
    if prepare:  # what `inspect` does: ONNX Runtime preprocessing and opset upgrade too
        from qdq_optuna.config import Config
        from qdq_optuna.runtimes.prepared import PreparedModel

        cfg = Config(maximum_sequence_region_size=region_config.maximum_sequence_region_size,
                     minimum_topdown_search_size=region_config.minimum_topdown_search_size)
        for runtime in RUNTIMES:
            PreparedModel.prepare(path, runtime=runtime, input_shapes=shapes, config=cfg)


def _place(exc: BaseException) -> str:
    """Innermost frame inside qdq_optuna (else the innermost frame): where to fix it."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if "qdq_optuna" in f.filename]
    f = (ours or frames or [None])[-1]
    if f is None:
        return "?"
    return f"{Path(f.filename).name}:{f.lineno} ({f.name})"


def _reason(exc: UserError, path: Path) -> str:
    """The gist of a refusal (names and numbers dropped), to see what the fuzzer reaches."""
    text = str(exc).replace(str(path), "").lstrip(": ")
    return re.sub(r"'[^']*'|\d+", "_", text)[:70]


def _on_alarm(signum, frame):
    raise _Hang("example exceeded --example-timeout")


def make_batch(sources: dict[str, bytes], args, stats: Stats, work: Path):
    findings_dir = Path(args.findings)
    names = sorted(sources)

    @settings(max_examples=BATCH, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck), verbosity=Verbosity.quiet)
    @given(data=st.data())
    def one(data):
        draw = data.draw
        log: list[str] = []
        name = draw(st.sampled_from(names))
        log.append(f"model {name}")
        model = onnx.ModelProto()
        model.ParseFromString(sources[name])
        for _ in range(draw(st.integers(1, 3))):
            mutate_proto(draw, model, log)
        blob = model.SerializeToString()
        if draw(st.integers(0, 5)) == 0:
            for _ in range(draw(st.integers(1, 3))):
                blob = mutate_bytes(draw, blob, log)
        shapes = None
        if draw(st.integers(0, 4)) == 0:
            inputs = [i.name for i in model.graph.input] or ["x"]
            who = draw(st.sampled_from(inputs + ["nosuch"]))
            dims = draw(st.lists(st.sampled_from([1, 2, 3, 8, 16, 0, 10**6]), min_size=1,
                                 max_size=5))
            shapes = f"{who}:{'x'.join(map(str, dims))}"
            log.append(f"--input-shapes {shapes}")
        cfg = RegionConfig(draw(st.integers(1, 12)), draw(st.integers(1, 12)))
        log.append(f"RegionConfig({cfg.maximum_sequence_region_size}, "
                   f"{cfg.minimum_topdown_search_size})")
        run_one(blob, shapes, cfg, log, stats, findings_dir, work, args)

    return one


def run_one(blob: bytes, shapes, cfg, log, stats: Stats, findings_dir: Path, work: Path, args):
    path = work / "model.onnx"
    path.write_bytes(blob)
    (findings_dir / "current.onnx").write_bytes(blob)
    (findings_dir / "current.txt").write_text("\n".join(log) + "\n", encoding="utf-8")
    digest = hashlib.sha256(blob).hexdigest()
    stats.examples += 1
    started = time.monotonic()
    problem: BaseException | None = None
    signal.alarm(args.example_timeout)
    try:
        pipeline(path, shapes, cfg, args.prepare)
        stats.accepted += 1
    except UserError as exc:
        stats.refused[type(exc).__name__] += 1
        stats.reasons[_reason(exc, path)] += 1
    except Exception as exc:  # everything else is a finding
        problem = exc
    finally:
        signal.alarm(0)
    elapsed = time.monotonic() - started
    stats.slowest = max(stats.slowest, elapsed)
    if problem is None and elapsed > args.slow:
        problem = _Hang(f"took {elapsed:.1f} s (> --slow {args.slow} s)")
    if problem is None and hashlib.sha256(path.read_bytes()).hexdigest() != digest:
        problem = AssertionError("load_model changed the file on disk")
    if problem is not None:
        record(problem, blob, shapes, cfg, log, stats, findings_dir, args.prepare)


def record(exc, blob, shapes, cfg, log, stats: Stats, findings_dir: Path,
           prepare: bool) -> None:
    key = (type(exc).__name__, _place(exc))
    if key in stats.findings:
        return
    n = len(stats.findings) + 1
    stem = findings_dir / f"finding-{n:02d}-{type(exc).__name__}"
    onnx_path = stem.with_suffix(".onnx")
    onnx_path.write_bytes(blob)
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    replay = (f"python benchmarks/fuzz_loading.py --replay {onnx_path}"
              + (" --prepare" if prepare else "")
              + (f" --input-shapes {shapes}" if shapes else "")
              + f" --region-sizes {cfg.maximum_sequence_region_size},"
                f"{cfg.minimum_topdown_search_size}")
    text = ("\n".join(log) + f"\n\nreproduce: {replay}\n\n{tb}")
    stem.with_suffix(".txt").write_text(text, encoding="utf-8")
    stats.findings[key] = onnx_path
    first = (str(exc).strip().splitlines() or [""])[0][:200]
    print(f"\nFINDING {n}: {key[0]} at {key[1]}: {first}", flush=True)
    print("  mutations: " + "; ".join(log), flush=True)
    print(f"  reproduce: {replay}", flush=True)
    print("  " + tb.strip().replace("\n", "\n  "), flush=True)


# -- main ------------------------------------------------------------------------------------


def replay(args) -> int:
    sizes = [int(v) for v in args.region_sizes.split(",")]
    # a finding raises here, with its full traceback
    pipeline(Path(args.replay), args.input_shapes, RegionConfig(*sizes), args.prepare)
    print("ok: accepted")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=300, help="how long to fuzz (default 300)")
    ap.add_argument("--models", default=DEFAULT_MODELS,
                    help="comma-separated zoo models (test sizes) to mutate")
    ap.add_argument("--seed", type=int, default=None, help="hypothesis seed (default: random)")
    ap.add_argument("--findings", default=str(Path(tempfile.gettempdir()) / "qdq-optuna-fuzz"),
                    help="folder for reproducers (default: qdq-optuna-fuzz in the temp folder)")
    ap.add_argument("--slow", type=float, default=10.0,
                    help="seconds before an example is a finding")
    ap.add_argument("--example-timeout", type=int, default=60,
                    help="seconds before an example is interrupted")
    ap.add_argument("--memory-mb", type=int, default=8192,
                    help="address-space limit, so absurd allocations fail fast (0: none)")
    ap.add_argument("--prepare", action="store_true",
                    help="also run PreparedModel.prepare (ONNX Runtime preprocessing, opset "
                         "upgrade) on both runtimes, as `inspect` does")
    ap.add_argument("--top", type=int, default=15, help="refusal kinds to list at the end")
    ap.add_argument("--replay",
                    help="run one saved model through the pipeline and show the traceback")
    ap.add_argument("--input-shapes", help="with --replay")
    ap.add_argument("--region-sizes", default="10,10", help="with --replay: MAXSEQ,MINTOPDOWN")
    args = ap.parse_args(argv)
    if args.memory_mb:
        limit = args.memory_mb << 20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    if args.replay:
        return replay(args)

    signal.signal(signal.SIGALRM, _on_alarm)
    sources = {name: zoo.build(name, "small").SerializeToString()
               for name in args.models.split(",") if name}
    findings_dir = Path(args.findings)
    findings_dir.mkdir(parents=True, exist_ok=True)
    work = findings_dir / "work"
    work.mkdir(exist_ok=True)
    # a file that external-data mutations can point at, inside and outside the model's folder
    (work / "w.bin").write_bytes(random.Random(0).randbytes(4096))
    (findings_dir / "w.bin").write_bytes(random.Random(1).randbytes(4096))

    stats = Stats()
    started = time.monotonic()
    deadline = started + args.seconds
    batch = 0
    print(f"fuzzing {', '.join(sources)} for {args.seconds:.0f} s; reproducers in {findings_dir}/",
          flush=True)
    while time.monotonic() < deadline:
        test = make_batch(sources, args, stats, work)
        if args.seed is not None:
            test = hypothesis_seed(args.seed * 100_003 + batch)(test)
        test()
        batch += 1
        print(f"\r{stats.examples} examples, {stats.accepted} accepted, "
              f"{sum(stats.refused.values())} refused, {len(stats.findings)} findings",
              end="", flush=True)
    elapsed = time.monotonic() - started
    print(f"\n\n{stats.examples} examples in {elapsed:.0f} s ({stats.examples / elapsed:.1f}/s); "
          f"accepted {stats.accepted}, refused {dict(stats.refused)}; "
          f"slowest {stats.slowest:.2f} s")
    print("most common refusals:")
    for reason, count in stats.reasons.most_common(args.top):
        print(f"  {count:6d}  {reason}")
    if stats.findings:
        print(f"{len(stats.findings)} findings:")
        for (kind, place), path in stats.findings.items():
            print(f"  {kind} at {place}: {path}")
        return 1
    print("no findings")
    return 0


if __name__ == "__main__":
    sys.exit(main())
