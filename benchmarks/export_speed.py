"""How fast is one trial's Q/DQ export, and how long does the model analysis take?

Builds the full-size ResNet-18-like zoo model (~47 MB of float weights; or loads ``--model``),
runs ``load_model`` + ``upgrade_for``, times region discovery and pattern grouping, enumerates
the insertion points for ONNX Runtime CPU and TensorRT, and then times
``QDQExporter.to_bytes(plan)`` for three plans per runtime:

* ``half``: the uses of a random half of all offered points,
* ``all``:  every offered point,
* ``none``: the float model.

Each is compared with the naive way to produce the same model: copy the ``ModelProto``, insert
the Q/DQ nodes and initializers, rewire the consumers, ``SerializeToString()``. The naive
exporter gets the quantized weights precomputed (as the real one caches them), so the
comparison is copy + insert + serialize against byte concatenation.

    python benchmarks/export_speed.py --repeats 50
    python benchmarks/export_speed.py --model model.onnx --input-shapes input:1x3x224x224 \\
        --json export.json

Run it on an otherwise idle machine; never two benchmarks at once.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qdq_optuna.errors import UserError  # noqa: E402
from qdq_optuna.examples import zoo  # noqa: E402
from qdq_optuna.model.graph import Graph, InputShapes, load_model  # noqa: E402
from qdq_optuna.placement.export import QDQExporter, QuantPlan, upgrade_for, weight_scales  # noqa: E402
from qdq_optuna.placement.patterns import PatternIndex  # noqa: E402
from qdq_optuna.placement.points import enumerate_points  # noqa: E402
from qdq_optuna.placement.regions import discover_regions  # noqa: E402
from qdq_optuna.placement.rules import WEIGHTED_OPS, RuntimeRules  # noqa: E402
from qdq_optuna.runtimes.onnxruntime import ONNXRUNTIME_CPU  # noqa: E402
from qdq_optuna.runtimes.tensorrt import TENSORRT  # noqa: E402

_ZP = {"int8": (np.int8, TensorProto.INT8), "uint8": (np.uint8, TensorProto.UINT8)}


def stats_ms(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    p90 = ordered[min(len(ordered) - 1, int(round(0.9 * (len(ordered) - 1))))]
    return {
        "min_ms": ordered[0] * 1e3,
        "median_ms": statistics.median(ordered) * 1e3,
        "p90_ms": p90 * 1e3,
    }


def timed(fn: Callable[[], object], repeats: int) -> tuple[list[float], object]:
    samples, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        samples.append(time.perf_counter() - start)
    return samples, result


class NaiveExporter:
    """Copy the ModelProto, insert Q/DQ, serialize: what an export costs without the tricks.

    Produces the same model as :class:`QDQExporter` (same scales, zero points, weights and
    int32 biases; names may differ), reading the parameters from it.
    """

    def __init__(self, exporter: QDQExporter) -> None:
        self.exporter = exporter
        self.graph = exporter.graph
        self._weights: dict[tuple[str, int | None, str], tuple[onnx.TensorProto, ...]] = {}

    def _weight(self, node: int, slot: int, qtype: str):
        graph = self.graph
        name = graph.nodes[node].input[slot]
        op = graph.nodes[node].op_type
        rules = self.exporter.rules
        axis = None if op in rules.per_tensor_weight_ops else WEIGHTED_OPS[op].axis(graph, node)
        key = (name, axis, qtype)
        if key not in self._weights:  # precomputed once, like the real exporter's cache
            w = numpy_helper.to_array(graph.initializer(name)).astype(np.float32)
            scales = weight_scales(w, axis, qtype)
            shape = [1] * w.ndim
            if axis is not None:
                shape[axis] = -1
            q = np.clip(np.rint(w / scales.reshape(shape)), -127, 127).astype(np.int8)
            self._weights[key] = (
                numpy_helper.from_array(q, f"{name}__nq"),
                numpy_helper.from_array(scales, f"{name}__ns"),
                numpy_helper.from_array(np.zeros(scales.shape, np.int8), f"{name}__nz"),
                axis,
                scales,
            )
        return self._weights[key]

    def to_bytes(self, plan: QuantPlan) -> bytes:
        graph = self.graph
        model = onnx.ModelProto()
        model.CopyFrom(graph.model)
        g = model.graph
        after: dict[int, list[onnx.NodeProto]] = {}
        head: list[onnx.NodeProto] = []
        act_of: dict[int, tuple[str, str]] = {}
        for tensor, consumers, qtype in plan.activations:
            if qtype not in _ZP:
                raise SystemExit(f"naive exporter: quant type {qtype} not supported")
            scale, zp = self.exporter.activation_params(tensor, qtype)
            np_type, _ = _ZP[qtype]
            s_name, z_name = f"{tensor}__s", f"{tensor}__z"
            g.initializer.append(numpy_helper.from_array(
                np.array(scale, dtype=np.float32), s_name))
            g.initializer.append(numpy_helper.from_array(np.array(zp, dtype=np_type), z_name))
            q = helper.make_node("QuantizeLinear", [tensor, s_name, z_name], [f"{tensor}__q"],
                                 name=f"{tensor}__Q")
            dq = helper.make_node("DequantizeLinear", [f"{tensor}__q", s_name, z_name],
                                  [f"{tensor}__dq"], name=f"{tensor}__DQ")
            prod = graph.producer.get(tensor)
            (after.setdefault(prod[0], []) if prod else head).extend([q, dq])
            for n, s in consumers:
                g.node[n].input[s] = f"{tensor}__dq"
                act_of.setdefault(n, (tensor, qtype))
        replaced: set[str] = set()
        done: set[str] = set()
        for n, s, qtype in plan.weights:
            name = graph.nodes[n].input[s]
            qw, ws, wz, axis, scales = self._weight(n, s, qtype)
            if qw.name not in done:
                done.add(qw.name)
                g.initializer.extend([qw, ws, wz])
                head.append(helper.make_node(
                    "DequantizeLinear", [qw.name, ws.name, wz.name], [f"{name}__dq"],
                    name=f"{name}__DQ", **({"axis": axis} if axis is not None else {})))
            g.node[n].input[s] = f"{name}__dq"
            replaced.add(name)
            node = graph.nodes[n]
            rules = self.exporter.rules
            if n in act_of and node.op_type in rules.quantize_bias_ops and len(node.input) > 2 \
                    and node.input[2] in graph.initializers:
                tensor, act_q = act_of[n]
                a_scale, _ = self.exporter.activation_params(tensor, act_q)
                b = numpy_helper.to_array(graph.initializer(node.input[2])).astype(np.float64)
                b_scales = (a_scale * np.broadcast_to(scales, b.shape)).astype(np.float32)
                qb = np.clip(np.rint(b / b_scales), -(2**31), 2**31 - 1).astype(np.int32)
                bias = node.input[2]
                g.initializer.extend([
                    numpy_helper.from_array(qb, f"{bias}__nq"),
                    numpy_helper.from_array(b_scales, f"{bias}__ns"),
                    numpy_helper.from_array(np.zeros(b.shape, np.int32), f"{bias}__nz"),
                ])
                head.append(helper.make_node(
                    "DequantizeLinear", [f"{bias}__nq", f"{bias}__ns", f"{bias}__nz"],
                    [f"{bias}__dq"], name=f"{bias}__DQ", axis=0))
                g.node[n].input[2] = f"{bias}__dq"
                replaced.add(bias)
        if replaced:  # drop float weights nobody reads any more
            still_read = {t for node in g.node for t in node.input}
            keep = [t for t in g.initializer if t.name not in replaced or t.name in still_read]
            del g.initializer[:]
            g.initializer.extend(keep)
        if head or after:
            nodes = list(head)
            for idx, node in enumerate(g.node):
                nodes.append(node)
                nodes.extend(after.get(idx, []))
            copies = [onnx.NodeProto() for _ in nodes]
            for c, node in zip(copies, nodes):
                c.CopyFrom(node)
            del g.node[:]
            g.node.extend(copies)
        return model.SerializeToString()


def build_plans(pps, exporter: QDQExporter, seed: int) -> dict[str, QuantPlan]:
    refs = [(pp, pid) for pp in pps for pid in pp.ids]
    rng = random.Random(seed)
    half = rng.sample(refs, len(refs) // 2)

    def uses(chosen):
        out = set()
        for pp, pid in chosen:
            out |= pp.uses([pid])
        return out

    return {
        "half": exporter.plan(uses(half)),
        "all": exporter.plan(uses(refs)),
        "none": exporter.plan([]),
    }


def verify(fast: bytes, naive: bytes, graph: Graph) -> float:
    """Largest output difference between the two exports on one random input."""
    import onnxruntime as ort

    rng = np.random.default_rng(0)
    feeds = {}
    for vi in graph.model.graph.input:
        if vi.name in graph.initializers:
            continue
        tt = vi.type.tensor_type
        shape = [d.dim_value or 1 for d in tt.shape.dim]
        if tt.elem_type == TensorProto.INT64:
            feeds[vi.name] = rng.integers(0, 10, shape, dtype=np.int64)
        else:
            feeds[vi.name] = rng.standard_normal(shape).astype(np.float32)
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    outs = []
    for blob in (fast, naive):
        sess = ort.InferenceSession(blob, opts, providers=["CPUExecutionProvider"])
        outs.append(sess.run(None, feeds))
    return max(float(np.max(np.abs(a - b))) for a, b in zip(*outs))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="an ONNX file (default: zoo.resnet_like())")
    parser.add_argument("--input-shapes", help="NAME:DxD,... for symbolic input dims")
    parser.add_argument("--repeats", type=int, default=50, help="exports timed per plan")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random half")
    parser.add_argument("--runtime", choices=["onnxruntime", "tensorrt", "both"], default="both")
    parser.add_argument("--no-verify", action="store_true",
                        help="skip running both exports of the 'half' plan in ONNX Runtime")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")

    t0 = time.perf_counter()
    if args.model:
        source: object = args.model
        label = str(args.model)
    else:
        source = zoo.resnet_like()
        label = "zoo.resnet_like()"
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    try:
        graph = load_model(source, InputShapes.parse(args.input_shapes))
    except UserError as exc:
        parser.exit(exc.exit_code, f"{parser.prog}: error: {exc}\n")
    load_s = time.perf_counter() - t0

    rules_list: list[RuntimeRules] = {
        "onnxruntime": [ONNXRUNTIME_CPU], "tensorrt": [TENSORRT],
        "both": [ONNXRUNTIME_CPU, TENSORRT],
    }[args.runtime]
    t0 = time.perf_counter()
    graph = upgrade_for(graph, [r.default_quant_type for r in rules_list])
    upgrade_s = time.perf_counter() - t0

    analysis_repeats = max(1, min(args.repeats, 10))
    region_samples, tree = timed(lambda: discover_regions(graph), analysis_repeats)
    pattern_samples, index = timed(lambda: PatternIndex(graph, tree), analysis_repeats)
    size_mb = graph.model.ByteSize() / 1e6
    result: dict = {
        "model": label,
        "nodes": len(graph.nodes),
        "model_mb": round(size_mb, 2),
        "opset": graph.opset,
        "regions": len(tree.regions),
        "tuning_regions": len(tree.tuning),
        "patterns": len(index.patterns),
        "repeats": args.repeats,
        "python": platform.python_version(),
        "onnx": onnx.__version__,
        "machine": platform.machine(),
        "setup_s": {"build": build_s, "load_model": load_s, "upgrade_for": upgrade_s},
        "analysis": {
            "discover_regions": stats_ms(region_samples),
            "pattern_index": stats_ms(pattern_samples),
        },
        "runtimes": {},
    }

    rows = []
    for rules in rules_list:
        qtype = rules.default_quant_type
        t0 = time.perf_counter()
        pps = [enumerate_points(graph, tree, index, p, rules) for p in index.patterns]
        points_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        exporter = QDQExporter(graph, rules, qtype)
        init_s = time.perf_counter() - t0
        naive = NaiveExporter(exporter)
        plans = build_plans(pps, exporter, args.seed)
        entry: dict = {
            "quant_type": qtype,
            "points": sum(len(pp.points) for pp in pps),
            "enumerate_points_ms": points_s * 1e3,
            "exporter_init_ms": init_s * 1e3,
            "plans": {},
        }
        for name, plan in plans.items():
            t0 = time.perf_counter()
            first = exporter.to_bytes(plan)  # fills the exporter's caches
            first_s = time.perf_counter() - t0
            naive.to_bytes(plan)  # and the naive one's weight cache
            fast_samples, fast = timed(partial(exporter.to_bytes, plan), args.repeats)
            naive_samples, slow = timed(partial(naive.to_bytes, plan), args.repeats)
            assert fast == first, "to_bytes is not deterministic"
            check = {}
            if name == "half" and not args.no_verify:
                check["max_abs_diff_vs_naive"] = verify(fast, slow, graph)
            fast_stats, naive_stats = stats_ms(fast_samples), stats_ms(naive_samples)
            entry["plans"][name] = {
                "qdq_pairs": plan.qdq_pairs,
                "activations": len(plan.activations),
                "bytes": len(fast),
                "first_export_ms": first_s * 1e3,
                "to_bytes": fast_stats,
                "naive": naive_stats,
                "speedup_median": naive_stats["median_ms"] / fast_stats["median_ms"],
                **check,
            }
            rows.append((rules.name, name, plan.qdq_pairs, len(fast) / 1e6, fast_stats,
                         naive_stats))
        result["runtimes"][rules.name] = entry

    print(f"model: {label}: {result['nodes']} nodes, {size_mb:.1f} MB, opset {graph.opset}; "
          f"{result['regions']} regions, {result['tuning_regions']} tuning regions, "
          f"{result['patterns']} patterns")
    print(f"setup: build {build_s:.2f} s, load_model {load_s:.2f} s, "
          f"upgrade_for {upgrade_s:.2f} s")
    an = result["analysis"]
    print(f"discover_regions: median {an['discover_regions']['median_ms']:.1f} ms; "
          f"PatternIndex: median {an['pattern_index']['median_ms']:.1f} ms "
          f"({analysis_repeats} runs)")
    for rname, entry in result["runtimes"].items():
        print(f"{rname}: {entry['points']} points, enumerate_points "
              f"{entry['enumerate_points_ms']:.1f} ms, QDQExporter() "
              f"{entry['exporter_init_ms']:.1f} ms")
    print()
    header = (f"{'runtime':<12}{'plan':<6}{'Q/DQ':>6}{'MB':>7}   "
              f"{'to_bytes min/med/p90 ms':>26}   {'naive min/med/p90 ms':>26}{'speedup':>9}")
    print(header)
    print("-" * len(header))
    for rname, plan_name, pairs, mb, fast, slow in rows:
        f = f"{fast['min_ms']:.1f}/{fast['median_ms']:.1f}/{fast['p90_ms']:.1f}"
        s = f"{slow['min_ms']:.1f}/{slow['median_ms']:.1f}/{slow['p90_ms']:.1f}"
        print(f"{rname:<12}{plan_name:<6}{pairs:>6}{mb:>7.1f}   {f:>26}   {s:>26}"
              f"{slow['median_ms'] / fast['median_ms']:>8.1f}x")
    for rname, entry in result["runtimes"].items():
        diff = entry["plans"]["half"].get("max_abs_diff_vs_naive")
        if diff is not None:
            print(f"{rname}: 'half' export vs naive export, max |output difference| = {diff:.3g}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
