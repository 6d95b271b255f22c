"""The model side in one object: load -> preprocess -> regions -> patterns -> insertion points.

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

from .config import Config
from .export import QDQExporter, check_quant_type, upgrade_for
from .graph import Graph, InputShapes, inline_external_limit, load_model, ort_basic_optimize
from .insertion.filters import NodeFilter
from .insertion.points import PatternPoints, enumerate_points
from .insertion.rules import RuntimeRules, rules_for
from .patterns import PatternIndex
from .regions import RegionConfig, RegionTree, discover_regions

PREPROCESS = ("auto", "none", "ort-basic")
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
    preprocess: str
    #: quant types an insertion point may choose from (``--quant-type mixed``); empty otherwise
    mixed_types: tuple[str, ...] = ()
    #: where exporters of a model whose weights stay on disk (external mode) keep their work
    #: folders (the run's output folder; a temporary folder when None)
    data_dir: Path | None = None
    #: nodes and op types kept free of Q/DQ (``--exclude-nodes``, ``--op-types``)
    node_filter: NodeFilter = NodeFilter()

    @classmethod
    def prepare(
        cls,
        model: str | os.PathLike | onnx.ModelProto,
        *,
        runtime: str = "onnxruntime",
        quant_type: str | None = None,
        input_shapes: InputShapes | str | None = None,
        config: Config | None = None,
        preprocess: str = "auto",
        exclude_nodes: str | Iterable[str] | None = None,
        op_types: str | Iterable[str] | None = None,
    ) -> PreparedModel:
        """``exclude_nodes`` (names or regular expressions) and ``op_types`` (the op types
        whose inputs may carry Q/DQ) narrow every insertion point (:mod:`.insertion.filters`)."""
        cfg = config or Config()
        node_filter = NodeFilter.parse(exclude_nodes, op_types)
        rules = rules_for(runtime)
        mixed = quant_type == "mixed"  # every point chooses none or one of the rules' types
        qtype = check_quant_type(rules.default_quant_type if mixed else
                                 quant_type or cfg.default_quant_type or rules.default_quant_type)
        if qtype not in rules.quant_types:
            from .errors import OptionError

            raise OptionError(
                f"--quant-type {qtype} is not supported by the {rules.name} rules "
                f"(choose from {', '.join(rules.quant_types)})"
            )
        shapes = input_shapes if isinstance(input_shapes, InputShapes) else InputShapes.parse(input_shapes)
        if preprocess not in PREPROCESS:
            from .errors import OptionError

            raise OptionError(f"--preprocess: unknown {preprocess!r} (choose from {', '.join(PREPROCESS)})")
        graph = load_model(model, shapes)
        if isinstance(model, onnx.ModelProto):
            source, digest = "<model>", hashlib.sha256(model.SerializeToString()).hexdigest()
        else:
            source, digest = str(model), file_sha256(model)
            if graph.external_dir is not None:  # the weights on disk are part of the model
                digest = _external_digest(model, digest)
        mode = ("ort-basic" if rules.name == "onnxruntime" else "none") if preprocess == "auto" else preprocess
        if mode == "ort-basic" and graph.external_dir is not None:
            log.warning("the model's weights stay on disk (external data over %d bytes): "
                        "tuning it without ONNX Runtime preprocessing (--preprocess none)",
                        inline_external_limit())
            mode = "none"
        if mode == "ort-basic":
            pre = ort_basic_optimize(graph.full_model())
            if _loads_in_ort(pre):
                graph = Graph.from_model(pre, graph.path)
            else:  # never trade a working model for a preprocessed one ORT cannot load
                log.warning("ONNX Runtime cannot reload its own preprocessed model; "
                            "tuning the model as given (--preprocess none)")
                mode = "none"
        graph = upgrade_for(graph, rules.quant_types if mixed else [qtype])
        rules = node_filter.restrict(rules, graph)
        tree = discover_regions(
            graph,
            RegionConfig(cfg.maximum_sequence_region_size, cfg.minimum_topdown_search_size),
        )
        index = PatternIndex(graph, tree)
        points = [enumerate_points(graph, tree, index, p, rules) for p in index.patterns]
        return cls(graph, tree, index, points, rules, qtype, source, digest, mode,
                   mixed_types=tuple(rules.quant_types) if mixed else (), node_filter=node_filter)

    @property
    def tunable(self) -> list[PatternPoints]:
        """Patterns with at least one insertion point, in study order (first appearance)."""
        return [pp for pp in self.points if pp.points]

    def exporter(self, scales=None, config: Config | None = None, quant_type: str | None = None) -> QDQExporter:
        cfg = config or Config()
        return QDQExporter(
            self.graph, self.rules, quant_type or self.quant_type, scales=scales,
            default_scale=cfg.default_q_scale, default_zero_point=cfg.default_q_zero_point,
            data_dir=self.data_dir,
        )

    def candidate_tensors(self) -> list[str]:
        """Every activation tensor some point can quantize (what calibration must cover)."""
        tensors: set[str] = set()
        for pp in self.points:
            tensors.update(u[0] for u in pp.uses(pp.ids))
        return sorted(tensors)

    def to_json(self) -> dict:
        """The stable ``inspect --json`` document (add keys freely, never rename)."""
        g = self.graph
        regions = []
        for r in self.tree.regions:
            regions.append({
                "id": r.id,
                "type": r.type.value,
                "level": r.level,
                "parent": r.parent,
                "children": list(r.children),
                "nodes": [g.name_of(n) for n in (r.nodes if r.type.value == "LEAF" else r.all_nodes)],
                "inputs": list(r.inputs),
                "outputs": list(r.outputs),
                "kind": r.kind,
                "tuned": r.id in set(self.tree.tuning),
            })
        patterns = []
        for pp in self.points:
            p = pp.pattern
            patterns.append({
                "id": p.id,
                "signature": p.signature,
                "regions": list(p.regions),
                "ops": list(p.ops),
                "insertion_points": [
                    {
                        "id": pt.id,
                        "kind": pt.kind,
                        "resolved": {str(r): tensors for r, tensors in pp.tensors(pt.id).items()},
                        "uses": {
                            str(r): [[t, g.name_of(n), s] for t, n, s in uses]
                            for r, uses in pp.resolved[pt.id].items()
                        },
                    }
                    for pt in pp.points
                ],
                "concat_groups": pp.concat_groups,
                "fusion_groups": pp.fusion_groups,
                "dropped_points": pp.dropped,
            })
        return {
            "model": self.source,
            "sha256": self.source_sha256,
            "runtime": self.rules.name,
            "quant_type": self.quant_type,
            "preprocess": self.preprocess,
            "opset": g.opset,
            "nodes": len(g.nodes),
            "regions": regions,
            "patterns": patterns,
        }


def _loads_in_ort(model: onnx.ModelProto) -> bool:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 4
    try:
        ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    except Exception:
        return False
    return True


def output_path(path: str | os.PathLike) -> Path:
    return Path(path).expanduser()
