"""The model side in one object, prepared for one runtime's rules: load -> preprocess ->
regions -> patterns -> insertion points.

``inspect`` prints it, ``tune`` searches over it, the exporter turns its schemes into models.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import onnx

from qdq_optuna.config import Config
from qdq_optuna.model.graph import (
    Graph,
    InputShapes,
    inline_external_limit,
    load_model,
    ort_basic_optimize,
    transform_graph,
)
from qdq_optuna.model.precision import HighPrecisionModel, convert_precision
from qdq_optuna.placement.dynamic import use_mode
from qdq_optuna.placement.export import QDQExporter, check_quant_type, required_opset, upgrade_for
from qdq_optuna.placement.filters import NodeFilter
from qdq_optuna.placement.patterns import PatternIndex
from qdq_optuna.placement.points import PatternPoints, enumerate_points
from qdq_optuna.placement.regions import RegionConfig, RegionTree, discover_regions
from qdq_optuna.placement.rules import Preprocess, RuntimeRules
from qdq_optuna.runtimes import DEFAULT_RUNTIME, Runtime, profile_for

log = logging.getLogger("qdq_optuna")


def _external_digest(path: str | os.PathLike, model_digest: str) -> str:
    """The model file's digest combined with its external data files' digests."""
    proto = onnx.load(str(path), load_external_data=False)
    locations = sorted({e.value for t in proto.graph.initializer for e in t.external_data
                        if e.key == "location"})
    h = hashlib.sha256(model_digest.encode())
    for location in locations:
        h.update(location.encode() + b"\0" + file_sha256(Path(path).parent / location).encode())
    return h.hexdigest()


def file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@dataclass
class PreparedModel:
    graph: Graph
    tree: RegionTree
    index: PatternIndex
    points: list[PatternPoints]
    rules: RuntimeRules
    quant_type: str
    source: str
    source_sha256: str
    preprocess: Preprocess
    #: quant types an insertion point may choose from (``--quant-type mixed``); empty otherwise
    mixed_types: tuple[str, ...] = ()
    #: where exporters of a model whose weights stay on disk (external mode) keep their work
    #: folders (the run's output folder; a temporary folder when None)
    data_dir: Path | None = None
    #: the float part converted to FP16/BF16 before region search (None: FP32), with the FP32
    #: model that calibration and weight quantization read
    high_precision: HighPrecisionModel | None = None
    #: nodes and op types kept free of Q/DQ (``--exclude-nodes``, ``--op-types``)
    node_filter: NodeFilter = NodeFilter()

    @classmethod
    def prepare(
        cls,
        model: str | os.PathLike | onnx.ModelProto,
        *,
        runtime: str | RuntimeRules | Runtime | None = None,
        quant_type: str | None = None,
        input_shapes: InputShapes | str | None = None,
        config: Config | None = None,
        preprocess: str | Preprocess = Preprocess.AUTO,
        high_precision: str = "fp32",
        keep_io_types: bool = True,
        exclude_nodes: str | Iterable[str] | None = None,
        op_types: str | Iterable[str] | None = None,
        upgrade_opset: bool = True,
        fed_inputs: Iterable[str] = (),
    ) -> PreparedModel:
        """The model side of a run: regions, patterns, the insertion points the rules allow.

        Args:
            model: the float model, a path or an ``onnx.ModelProto`` (never modified).
            runtime: whose fusion rules place the Q/DQ (``--runtime``), or the rules.
            quant_type: the activation type (``--quant-type``; default: the runtime's).
            input_shapes: fixed symbolic input dims (``--input-shapes``).
            preprocess: ``auto``, ``none`` or ``ort-basic`` (``--preprocess``).
            high_precision: the float part's precision: ``fp32``, ``fp16`` or ``bf16``.
            keep_io_types: with fp16/bf16, graph inputs and outputs stay FP32.
            exclude_nodes: nodes whose inputs never carry Q/DQ (``--exclude-nodes``).
            op_types: the op types whose inputs may carry Q/DQ (``--op-types``).
            upgrade_opset: False: a model needing a newer opset is refused, not upgraded.
            fed_inputs: the inputs calibration data feeds (other initializer inputs: constants).
            config: region sizes and the default quant type."""
        cfg = config or Config()
        node_filter = NodeFilter.parse(exclude_nodes, op_types)
        rules = (runtime if isinstance(runtime, RuntimeRules) else runtime.rules
                 if isinstance(runtime, Runtime) else profile_for(runtime or DEFAULT_RUNTIME).rules)
        mixed = quant_type == "mixed"  # every point chooses none or one of the rules' types
        qtype = check_quant_type(rules.default_quant_type if mixed else
                                 quant_type or cfg.default_quant_type or rules.default_quant_type)
        if qtype not in rules.quant_types:
            from qdq_optuna.errors import OptionError

            raise OptionError(
                f"--quant-type {qtype} is not supported by the {rules.name} rules "
                f"(choose from {', '.join(rules.quant_types)})"
            )
        shapes = input_shapes if isinstance(input_shapes, InputShapes) else InputShapes.parse(input_shapes)
        preprocess = Preprocess.parse(preprocess)
        graph = load_model(model, shapes, fed=fed_inputs)
        if isinstance(model, onnx.ModelProto):
            source, digest = "<model>", hashlib.sha256(model.SerializeToString()).hexdigest()
        else:
            source, digest = str(model), file_sha256(model)
            if graph.external_dir is not None:  # the weights on disk are part of the model
                digest = _external_digest(model, digest)
        graph, mode = _preprocessed(graph, rules, preprocess)
        graph, hp = _high_precision(graph, high_precision, keep_io_types, upgrade_opset)
        qtypes = rules.quant_types if mixed else [qtype]
        need = required_opset(graph, qtypes)
        if graph.opset < need and not upgrade_opset:
            from qdq_optuna.errors import OptionError

            raise OptionError(f"--no-opset-upgrade: quantizing with {', '.join(qtypes)} "
                              f"(per-channel weights{', FP16/BF16 scales' if hp else ''}) needs "
                              f"opset >= {need}; the model has opset {graph.opset}")
        if graph.opset < need:  # the version converter's new nodes are named opsetN/...
            graph = transform_graph(
                graph, lambda m: upgrade_for(Graph.from_model(m, graph.path), qtypes).model,
                created_prefix=f"opset{need}/")
        rules = node_filter.restrict(rules, graph)
        tree = discover_regions(graph, RegionConfig(cfg.maximum_sequence_region_size,
                                                    cfg.minimum_topdown_search_size))
        index = PatternIndex(graph, tree)
        points = [enumerate_points(graph, tree, index, p, rules) for p in index.patterns]
        return cls(graph, tree, index, points, rules, qtype, source, digest, mode,
                   mixed_types=tuple(rules.quant_types) if mixed else (), high_precision=hp,
                   node_filter=node_filter)

    @property
    def tunable(self) -> list[PatternPoints]:
        """Patterns with at least one insertion point, in study order (first appearance)."""
        return [pp for pp in self.points if pp.points]

    def exporter(self, scales=None, config: Config | None = None, quant_type: str | None = None) -> QDQExporter:
        cfg = config or Config()
        return QDQExporter(
            self.graph, self.rules, quant_type or self.quant_type, scales=scales,
            default_scale=cfg.default_q_scale, default_zero_point=cfg.default_q_zero_point,
            data_dir=self.data_dir, high_precision=self.high_precision,
        )

    def run_scales(self, stats, method: str | None = None) -> dict:
        """Activation scales as a run makes them from calibration statistics (``method``: the
        calibration method, the default one when None): each range cut where every reader of
        the tensor stops telling values apart (a Sigmoid's saturated logits, a Relu's
        negatives), and the inputs of a Concat sharing the output's scale as far as the
        runtime's 8-bit Concat kernel copies rather than requantizes them (its rules'
        ``concat_share_ratio``; ONNX Runtime's QLinearConcat, OpenVINO's Concatenation: our
        export of NNCF's placement of a real YOLOv8n ran 0.86x NNCF's file without it, 0.99x
        with it); mixed precision gets one scale per (tensor, type)."""
        from qdq_optuna.model import calibration

        method = method or calibration.DEFAULT_METHOD
        hp = self.high_precision
        bounds = calibration.reader_bounds(hp.source if hp is not None else self.graph)
        scales = calibration.activation_scales(stats, method=method, quant_type=self.quant_type,
                                               bounds=bounds)
        ratio = self.rules.concat_share_ratio
        if ratio is not None and hp is None:
            scales = calibration.share_concat_scales(self.graph.nodes, scales, self.quant_type,
                                                     ratio=ratio)
        for qtype in self.mixed_types:
            typed = calibration.activation_scales(stats, method=method, quant_type=qtype,
                                                  bounds=bounds)
            scales.update({(t, qtype): v for t, v in typed.items()})
        return scales

    def candidate_tensors(self) -> list[str]:
        """Every activation tensor some point can quantize (what calibration must cover)."""
        tensors: set[str] = set()
        for pp in self.points:
            tensors.update(u[0] for u in pp.uses(pp.ids) if use_mode(u) is None)
        return sorted(tensors)

    def to_json(self) -> dict:
        """The stable ``inspect --json`` document (add keys freely, never rename).

        Nodes are named as in the user's file (:meth:`Graph.name_of`); ``graph`` says which
        graph the regions describe and ``node_origins`` maps the nodes preprocessing created
        or fused to the file's nodes they stand for."""
        g = self.graph
        tuned = {r for pp in self.tunable for r in pp.pattern.regions}
        regions = []
        for r in self.tree.regions:
            nodes = r.nodes if r.type.value == "LEAF" else r.all_nodes
            regions.append({
                "id": r.id,
                "type": r.type.value,
                "level": r.level,
                "parent": r.parent,
                "children": list(r.children),
                "nodes": [g.name_of(n) for n in nodes],
                "file_nodes": list(dict.fromkeys(lb for n in nodes for lb in g.origin(n).labels)),
                "inputs": list(r.inputs),
                "outputs": list(r.outputs),
                "kind": r.kind,
                "tuned": r.id in tuned,
            })
        weights = self.weight_report()
        patterns = [self._pattern_json(pp, weights["by_point"]) for pp in self.points]
        return {
            "model": self.source,
            "sha256": self.source_sha256,
            "runtime": self.rules.name,
            "quant_type": self.quant_type,
            "preprocess": self.preprocess.value,
            "high_precision": self.high_precision.precision if self.high_precision else "fp32",
            "opset": g.opset,
            "nodes": len(g.nodes),
            "graph": self.described_graph(),
            "node_origins": {g.name_of(i): list(o.labels) for i, o in enumerate(g.origins)
                             if o.label is None or o.absorbed},
            "weights": {"quantized": weights["quantized"], "float": weights["float"]},
            "regions": regions,
            "patterns": patterns,
        }

    def _pattern_json(self, pp: PatternPoints, weights_by_point: dict) -> dict:
        g = self.graph
        p = pp.pattern
        return {
            "id": p.id,
            "signature": p.signature,
            "regions": list(p.regions),
            "ops": list(p.ops),
            "tuned": bool(pp.points),
            "insertion_points": [
                {
                    "id": pt.id,
                    "kind": pt.kind,
                    "resolved": {str(r): tensors for r, tensors in pp.tensors(pt.id).items()},
                    "uses": {
                        str(r): [[t, g.name_of(n), s] for t, n, s in uses]
                        for r, uses in pp.resolved[pt.id].items()
                    },
                    "weights": weights_by_point[(p.id, pt.id)],
                }
                for pt in pp.points
            ],
            "concat_groups": pp.concat_groups,
            "fusion_groups": pp.fusion_groups,
            "dropped_points": pp.dropped,
        }

    def described_graph(self) -> dict:
        """Which graph the regions and points describe, next to the user's file."""
        g = self.graph
        if self.preprocess is Preprocess.ORT_BASIC:
            text = ("ONNX Runtime's basic-optimized graph (constants folded, Conv+BatchNorm and "
                    "MatMul+Add fused): the graph ONNX Runtime runs, so Q/DQ go where its "
                    "kernels are")
        else:
            text = "the model as given"
        hp = self.high_precision
        if hp is not None:
            text += (f", its float part converted to {hp.precision.upper()} ({len(hp.kept_fp32)} "
                     "nodes kept FP32, Casts at their boundaries"
                     + ("" if hp.keep_io_types else ", inputs and outputs converted too") + ")")
        folded = len(g.vanished) if g.origins else 0
        if folded:
            text += f"; {folded} of the file's nodes were folded into weights or removed"
        if g.defaults_taken:
            text += (f"; {len(g.defaults_taken)} initializers the file lists as graph inputs "
                     "(default values, not fed by the data) are constants")
        return {"description": text, "file_nodes": g.file_nodes, "nodes": len(g.nodes),
                "created": sum(1 for o in g.origins if o.label is None),
                "vanished": list(g.vanished), "defaults_taken": list(g.defaults_taken)}

    def weight_report(self) -> dict:
        """Which weights of Conv/ConvTranspose/Gemm/MatMul the Q/DQ of some insertion point
        brings along (quantized when that point is on), which stay float and why."""
        from qdq_optuna.placement.rules import WEIGHTED_OPS

        g = self.graph
        exporter = QDQExporter(g, self.rules, self.quant_type)
        by_point: dict[tuple[str, str], dict[str, list[str]]] = {}
        quantized: set[str] = set()
        for pp in self.points:
            for pt in pp.points:
                per_region = {}
                for r, uses in pp.resolved[pt.id].items():
                    plan = exporter.plan(uses)
                    per_region[str(r)] = sorted({g.nodes[n].input[s] for n, s, _ in plan.weights})
                    quantized.update(per_region[str(r)])
                by_point[(pp.pattern.id, pt.id)] = per_region
        floats: dict[str, str] = {}
        for idx, node in enumerate(g.nodes):
            spec = WEIGHTED_OPS.get(node.op_type)
            if spec is None or len(node.input) <= spec.weight_slot:
                continue
            w = node.input[spec.weight_slot]
            if not w or w in quantized or not g.is_float(w) and w in g.initializers:
                continue
            if w in g.initializers:
                floats[w] = f"no insertion point quantizes the input of {g.name_of(idx)}"
            elif g.is_constant(w):
                floats[w] = "computed from constants by a node loading does not fold"
        return {"quantized": sorted(quantized), "float": dict(sorted(floats.items())),
                "by_point": by_point}


def _preprocessed(graph: Graph, rules: RuntimeRules, preprocess: Preprocess
                  ) -> tuple[Graph, Preprocess]:
    """The graph the rules see (ONNX Runtime's basic fusions for its own rules, by default)
    and the preprocessing actually applied."""
    mode = rules.preprocess if preprocess is Preprocess.AUTO else preprocess
    if mode is Preprocess.ORT_BASIC and graph.external_dir is not None:
        log.warning("the model's weights stay on disk (external data over %d bytes): "
                    "tuning it without ONNX Runtime preprocessing (--preprocess none)",
                    inline_external_limit())
        mode = Preprocess.NONE
    if mode is Preprocess.ORT_BASIC:
        pre = transform_graph(graph, ort_basic_optimize, name_all=True)
        if _loads_in_ort(pre.model):
            graph = pre
        else:  # never trade a working model for a preprocessed one ORT cannot load
            log.warning("ONNX Runtime cannot reload its own preprocessed model; "
                        "tuning the model as given (--preprocess none)")
            mode = Preprocess.NONE
    return graph, mode


def _high_precision(graph: Graph, high_precision: str, keep_io_types: bool,
                    upgrade_opset: bool = True) -> tuple[Graph, HighPrecisionModel | None]:
    """The float part converted (see precision.py): regions, points and exports then work on
    the converted graph."""
    hp = None
    if high_precision != "fp32":
        def to_high_precision(m: onnx.ModelProto) -> onnx.ModelProto:
            nonlocal hp
            hp = convert_precision(Graph.from_model(m, graph.path), high_precision,
                                   keep_io_types=keep_io_types, upgrade_opset=upgrade_opset)
            return hp.model

        graph = transform_graph(graph, to_high_precision, created_prefix=f"{high_precision}/")
    return graph, hp


def _loads_in_ort(model: onnx.ModelProto) -> bool:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 4
    try:
        ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    except Exception:
        return False
    return True

