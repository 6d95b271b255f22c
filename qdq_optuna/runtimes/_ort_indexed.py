"""ONNX Runtime's ``quantize_static`` with its name lookups answered from indexes.

Why: its QDQ quantizer finds the readers of each tensor it quantizes by walking every node, and
each initializer by walking every initializer, so its time grows with the square of the graph:
on a 4,755-node decoder ``quantize_static`` took 360 s, 80 % of it in those walks. Inside
:func:`indexed_lookups` the same helpers answer from dictionaries kept in step with the
quantizer's own edits (nodes added, inputs renamed, initializers added or removed), so the tool
writes the same file (a test compares the two byte for byte) in a fraction of the time.

The helpers are replaced only where their source is the one this was checked against (the
hashes below; another ONNX Runtime runs its own code, slower but unchanged) and only for graphs
of at least ``MIN_NODES`` nodes, where the walks cost more than the rest of the tool.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import threading
from collections.abc import Iterator
from typing import Any

MIN_NODES = 1000

# sha256 (first 16 hex digits) of the two modules whose edits the indexes follow, as ONNX
# Runtime 1.32 has them: the quantizer that edits the graph, and the model wrapper it edits with
_CHECKED = {
    "onnxruntime.quantization.onnx_model": "3d98ad52611d43a1",
    "onnxruntime.quantization.qdq_quantizer": "6c6c061ae90ea4a0",
}

_LOCK = threading.RLock()
_SMALL_LIST = 64  # a list this short is searched as the tool does


def _source_hash(obj: Any) -> str:
    return hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()[:16]


def _helpers() -> dict[str, tuple[Any, str, Any]]:
    """name -> (owner, attribute, current value) of each helper replaced."""
    from onnxruntime.quantization import onnx_model, quant_utils

    model = onnx_model.ONNXModel
    return {
        "ONNXModel.replace_input_of_all_nodes": (model, "replace_input_of_all_nodes",
                                                 model.replace_input_of_all_nodes),
        "ONNXModel.replace_input_of_nodes": (model, "replace_input_of_nodes",
                                             model.replace_input_of_nodes),
        "ONNXModel.replace_node_input": (model, "replace_node_input",
                                         model.__dict__["replace_node_input"]),
        "ONNXModel.add_node": (model, "add_node", model.add_node),
        "ONNXModel.get_initializer": (model, "get_initializer", model.get_initializer),
        "ONNXModel.topological_sort": (model, "topological_sort", model.topological_sort),
        "ONNXModel.clean_initializers": (model, "clean_initializers", model.clean_initializers),
        "ONNXModel.remove_initializer": (model, "remove_initializer", model.remove_initializer),
        "ONNXModel.initializer_extend": (model, "initializer_extend", model.initializer_extend),
        "quant_utils.find_by_name": (quant_utils, "find_by_name", quant_utils.find_by_name),
    }


def applies() -> bool:
    """Whether this ONNX Runtime's quantizer is the one the indexes were checked against."""
    import importlib

    try:
        _helpers()
        for name, expected in _CHECKED.items():
            if _source_hash(importlib.import_module(name)) != expected:
                return False
    except (ImportError, AttributeError, OSError, TypeError):
        return False
    return True


class _Readers:
    """Tensor name -> the nodes of one graph that may read it (a superset: each is checked
    before it is changed)."""

    def __init__(self, nodes) -> None:
        self.nodes = nodes  # held, so its id is not reused while indexed
        self.members: set[int] = set()  # ids of the indexed nodes (held in ``by_name``)
        self.by_name: dict[str, list] = {}
        for node in nodes:
            self.add(node)

    def add(self, node, names=None) -> None:
        self.members.add(id(node))
        for name in node.input if names is None else names:
            if name:
                self.by_name.setdefault(name, []).append(node)


class _ByName:
    """Name -> first item of a protobuf list, kept in step with appends and with removals made
    through the model wrapper; rebuilt when the list shrank otherwise or an item was renamed
    (the quantizer names its new tensors before it adds them)."""

    def __init__(self, items) -> None:
        self.items = items  # held, so its id is not reused while indexed
        self.rebuild()

    def rebuild(self) -> None:
        self.first: dict[str, Any] = {}
        self.repeated: set[str] = set()
        self.count = 0
        self.extend()

    def extend(self) -> None:
        items = self.items
        first = self.first
        for i in range(self.count, len(items)):
            item = items[i]
            if item.name in first:
                self.repeated.add(item.name)
            else:
                first[item.name] = item
        self.count = len(items)

    def removed(self, item, count_before: int) -> None:
        """``item`` was just removed from the list (which held ``count_before`` items)."""
        if (count_before != self.count or len(self.items) != count_before - 1
                or item.name in self.repeated or self.first.get(item.name) is not item):
            self.rebuild()
            return
        del self.first[item.name]
        self.count -= 1

    def find(self, name: str):
        if len(self.items) < self.count:
            self.rebuild()
        elif len(self.items) > self.count:
            self.extend()
        item = self.first.get(name)
        if item is not None and item.name != name:
            self.rebuild()
            item = self.first.get(name)
        return item


class _Checked:
    """How many items of an initializer list ONNX Runtime's own check has already passed."""

    def __init__(self, items) -> None:
        self.items = items
        self.count = 0


class _Indexed:
    """The indexed stand-ins of one :func:`indexed_lookups` block and the indexes they keep."""

    def __init__(self, originals: dict[str, Any]) -> None:
        self.originals = originals
        self.readers: dict[int, _Readers] = {}  # id(graph.node) -> the readers of that graph
        self.lists: dict[int, _ByName] = {}
        self.checked: dict[int, _Checked] = {}
        self.replace_node_input = originals["ONNXModel.replace_node_input"].__func__
        self.find_by_name = originals["quant_utils.find_by_name"]

    def readers_of(self, model) -> _Readers:
        nodes = model.model.graph.node
        index = self.readers.get(id(nodes))
        if index is None or index.nodes is not nodes:
            index = self.readers[id(nodes)] = _Readers(nodes)
        return index

    def find(self, item_name, item_list):
        if len(item_list) < _SMALL_LIST:
            return self.find_by_name(item_name, item_list)
        index = self.lists.get(id(item_list))
        if index is None or index.items is not item_list:
            index = self.lists[id(item_list)] = _ByName(item_list)
        return index.find(item_name)

    def stand_ins(self) -> dict[str, Any]:
        """Helper name -> what stands in for it (closures over this object)."""
        me, originals, find = self, self.originals, self.find

        def replace_input_of_all_nodes(self, old_input_name, new_input_name):
            index = me.readers_of(self)
            seen = set()
            for node in index.by_name.pop(old_input_name, ()):
                if id(node) in seen or old_input_name not in node.input:
                    continue
                seen.add(id(node))
                me.replace_node_input(node, old_input_name, new_input_name)
                index.add(node, (new_input_name,))

        def replace_input_of_nodes(self, old_input_name, new_input_name, node_names_set):
            originals["ONNXModel.replace_input_of_nodes"](self, old_input_name, new_input_name,
                                                          node_names_set)
            index = me.readers_of(self)
            for node in index.by_name.get(old_input_name, ()):
                if node.name in node_names_set:
                    index.add(node, (new_input_name,))

        def replace_node_input(node, old_input_name, new_input_name):
            me.replace_node_input(node, old_input_name, new_input_name)
            for index in me.readers.values():
                if id(node) in index.members:
                    index.add(node, (new_input_name,))

        def add_node(self, node):
            originals["ONNXModel.add_node"](self, node)
            me.readers_of(self).add(self.model.graph.node[len(self.model.graph.node) - 1])

        def get_initializer(self, name):
            return me.find(name, self.model.graph.initializer)

        def remove_initializer(self, tensor):
            items = self.model.graph.initializer
            before = len(items)
            originals["ONNXModel.remove_initializer"](self, tensor)
            index = me.lists.get(id(items))
            if index is not None and index.items is items and len(items) < before:
                index.removed(tensor, before)

        def initializer_extend(self, inits):
            # the tool checks every initializer already there each time it adds one; the ones
            # it passed before are not checked again
            if len(inits) == 0:
                return originals["ONNXModel.initializer_extend"](self, inits)  # its own error
            items = self.model.graph.initializer
            done = me.checked.get(id(items))
            if done is None or done.items is not items or len(items) < done.count:
                done = me.checked[id(items)] = _Checked(items)
            for i in range(done.count, len(items)):
                self._check_init(items[i], "gain")
            for init in inits:
                self._check_init(init)
                items.append(init)
            done.count = len(items)

        def rebuilding(name):
            def call(self, *args, **kwargs):
                result = originals[name](self, *args, **kwargs)
                me.readers.pop(id(self.model.graph.node), None)  # rebuilt: index it again
                me.lists.clear()
                me.checked.clear()
                return result
            return call

        return {
            "ONNXModel.replace_input_of_all_nodes": replace_input_of_all_nodes,
            "ONNXModel.replace_input_of_nodes": replace_input_of_nodes,
            "ONNXModel.replace_node_input": staticmethod(replace_node_input),
            "ONNXModel.add_node": add_node,
            "ONNXModel.get_initializer": get_initializer,
            "ONNXModel.remove_initializer": remove_initializer,
            "ONNXModel.initializer_extend": initializer_extend,
            "ONNXModel.topological_sort": rebuilding("ONNXModel.topological_sort"),
            "ONNXModel.clean_initializers": rebuilding("ONNXModel.clean_initializers"),
            "quant_utils.find_by_name": find,
        }


@contextlib.contextmanager
def indexed_lookups(node_count: int, min_nodes: int | None = None) -> Iterator[bool]:
    """Within this block ONNX Runtime's quantizer finds readers and initializers by index
    (graphs of at least ``min_nodes`` nodes, default :data:`MIN_NODES`, on the checked ONNX
    Runtime); yields whether it does."""
    if node_count < (MIN_NODES if min_nodes is None else min_nodes) or not applies():
        yield False
        return
    with _LOCK:
        helpers = _helpers()
        indexed = _Indexed({name: value for name, (_, _, value) in helpers.items()})
        stand_ins = indexed.stand_ins()
        find = stand_ins["quant_utils.find_by_name"]
        # modules that imported find_by_name by name hold their own reference to it
        importers = _find_by_name_importers(indexed.find_by_name)
        try:
            for name, (owner, attr, _) in helpers.items():
                setattr(owner, attr, stand_ins[name])
            for module in importers:
                module.find_by_name = find
            yield True
        finally:
            for _name, (owner, attr, value) in helpers.items():
                setattr(owner, attr, value)
            for module in importers:
                module.find_by_name = indexed.find_by_name


def _find_by_name_importers(find_by_name) -> list:
    import sys

    return [module for name, module in list(sys.modules.items())
            if name.startswith("onnxruntime.quantization") and module is not None
            and getattr(module, "find_by_name", None) is find_by_name]
