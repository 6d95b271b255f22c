"""Node filters as users know them from ``quantize_static`` (``nodes_to_exclude``,
``op_types_to_quantize``) and NVIDIA's quantizer (``--nodes_to_exclude``, ``--op_types_to_quantize``).

A filter narrows a runtime's rules: a use whose consuming node is excluded, or whose op type is
not among the op types to quantize, is never a Q/DQ site. Every insertion point, seed and
starting scheme resolves through the rules, so none of them can put Q/DQ on such a use, and a
promotion (TensorRT's Concat inputs) that would cover one is not applied.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import onnx

from qdq_optuna.errors import OptionError
from qdq_optuna.model.graph import GRAPH_OUTPUT, Graph, Use
from qdq_optuna.placement.rules import RuntimeRules

log = logging.getLogger("qdq_optuna")


def _names(value: str | Iterable[str] | None, option: str, split: bool) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else list(value)
    out: list[str] = []
    for item in items:
        if not isinstance(item, str):
            raise OptionError(f"{option}: expected names, got {item!r}")
        parts = item.split(",") if split else [item]
        out.extend(p.strip() for p in parts if p.strip())
    return tuple(dict.fromkeys(out))


#: the conversions themselves (never "a node the user excluded")
_CONVERSIONS = frozenset({"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear"})
#: integer ops a recipe tool writes, and the op each stands for
_INTEGER_OPS = {"MatMulInteger": "MatMul", "ConvInteger": "Conv", "MatMulNBits": "MatMul",
                "DynamicQuantizeMatMul": "MatMul", "MatMulIntegerToFloat": "MatMul"}
#: the suffix ONNX Runtime's quantizers add to a node they rewrite as an integer op
_TOOL_SUFFIX = re.compile(r"(_quant|_Q\d+)$")


@dataclass(frozen=True)
class NodeFilter:
    """``exclude_nodes``: node names or regular expressions matching a whole name (an unnamed
    node is ``#<index>``, as ``inspect`` prints it); ``op_types``: the only op types whose
    inputs may carry Q/DQ (empty: every op type the runtime's rules allow)."""

    exclude_nodes: tuple[str, ...] = ()
    op_types: tuple[str, ...] = ()

    @classmethod
    def parse(cls, exclude_nodes: str | Iterable[str] | None = None,
              op_types: str | Iterable[str] | None = None) -> NodeFilter:
        """Names as given in Python or on the command line (op types may be comma-separated);
        an op type ONNX does not define is one error line with the closest names."""
        ops = _names(op_types, "--op-types", split=True)
        known = {s.name for s in onnx.defs.get_all_schemas_with_history() if s.domain in ("", "ai.onnx")}
        for op in ops:
            if op not in known:
                close = difflib.get_close_matches(op, sorted(known), n=3, cutoff=0.6)
                hint = f" (did you mean {', '.join(close)}?)" if close else ""
                raise OptionError(f"--op-types: {op!r} is not an ONNX op type{hint}")
        return cls(_names(exclude_nodes, "--exclude-nodes", split=False), ops)

    def __bool__(self) -> bool:
        return bool(self.exclude_nodes or self.op_types)

    def to_dict(self) -> dict:
        """For a resume fingerprint and reports (empty lists when the filter is off)."""
        return {"exclude_nodes": list(self.exclude_nodes), "op_types": list(self.op_types)}

    def excluded(self, graph: Graph) -> dict[int, str]:
        """Node index -> why none of its inputs may carry Q/DQ."""
        out: dict[int, str] = {}
        names = [graph.name_of(i) for i in range(len(graph.nodes))]
        for pattern in self.exclude_nodes:
            hits = [i for i, name in enumerate(names) if name == pattern]
            if not hits:
                try:
                    regex = re.compile(pattern)
                except re.error as exc:
                    raise OptionError(f"--exclude-nodes {pattern!r}: no node has this name and it "
                                      f"is not a regular expression ({exc})") from None
                hits = [i for i, name in enumerate(names) if regex.fullmatch(name)]
            if not hits:
                log.warning("--exclude-nodes %r matches no node of the model (names as "
                            "'qdq-optuna inspect' prints them)", pattern)
            for i in hits:
                out.setdefault(i, f"node excluded by --exclude-nodes {pattern!r}")
        if self.op_types:
            wanted = set(self.op_types)
            for i, node in enumerate(graph.nodes):
                if node.op_type not in wanted:
                    out.setdefault(i, f"{node.op_type} is not in --op-types")
        return out

    def quantized_against(self, model: onnx.ModelProto) -> list[str]:
        """The nodes of a written model (a runtime tool's recipe file) that run quantized
        although this filter keeps them float: an integer op (``MatMulInteger``,
        ``ConvInteger``, ``MatMulNBits``, ``QLinear*``; named as the tool names it, its
        source node's name plus ``_quant`` or ``_Q4``/``_Q8``) or an op reading a
        DequantizeLinear. A recipe tool is run on the whole model, so its file may quantize
        what the user excluded; such a file must not ship."""
        if not self:
            return []
        dq = {o for n in model.graph.node if n.op_type == "DequantizeLinear" for o in n.output}
        regexes = []
        for pattern in self.exclude_nodes:
            try:
                regexes.append(re.compile(pattern))
            except re.error:
                regexes.append(re.compile(re.escape(pattern)))
        found = []
        for n in model.graph.node:
            if n.op_type in _CONVERSIONS:
                continue
            op = _INTEGER_OPS.get(n.op_type) or (n.op_type[len("QLinear"):]
                                                 if n.op_type.startswith("QLinear") else None)
            if op is None and not any(t in dq for t in n.input):
                continue
            name = _TOOL_SUFFIX.sub("", n.name) if op else n.name
            op = op or n.op_type
            if (name and any(name == p or r.fullmatch(name)
                             for p, r in zip(self.exclude_nodes, regexes))) or (
                    self.op_types and op not in self.op_types):
                found.append(name or op)
        return found

    def restrict(self, rules: RuntimeRules, graph: Graph) -> RuntimeRules:
        """``rules`` that also refuse every use the filter excludes in ``graph``."""
        if not self:
            return rules
        excluded = self.excluded(graph)
        return dataclasses.replace(
            rules,
            use_filters=(*rules.use_filters, _ExcludedUses(excluded)),
            promotions=tuple(_GuardedPromotion(p, frozenset(excluded)) for p in rules.promotions),
        )


@dataclass(frozen=True, eq=False)
class _ExcludedUses:
    reasons: dict[int, str]

    def __call__(self, graph: Graph, use: Use) -> str | None:
        if use[1] == GRAPH_OUTPUT:  # the Q/DQ of the node that writes it
            producer = graph.producer.get(use[0])
            return self.reasons.get(producer[0]) if producer else None
        return self.reasons.get(use[1])


@dataclass(frozen=True)
class _GuardedPromotion:
    """A promotion that never covers an excluded consumer (it covers all of them or none)."""

    promote: Callable[[Graph, str, list[tuple[int, int]]], bool]
    excluded: frozenset[int]

    def __call__(self, graph: Graph, tensor: str, uncovered: list[tuple[int, int]]) -> bool:
        if any(n in self.excluded for n, _ in uncovered):
            return False
        return self.promote(graph, tensor, uncovered)
