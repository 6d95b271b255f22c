"""The package's shape: no import circle, no unit over its size limit, one owner of the
stored run's keys (measured with ``benchmarks/structure.py``, which prints the figures)."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

if os.environ.get("QDQ_OPTUNA_TEST_INSTALLED") == "1":  # the suite copied beside a wheel
    pytest.skip("checks the source tree: run from the checkout (.ci/run does, before the wheel)",
                allow_module_level=True)


def _load_structure():
    spec = importlib.util.spec_from_file_location("structure", REPO / "benchmarks" / "structure.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


structure = _load_structure()

#: units over the limits in modules other changes are reshaping at the same time; each may not
#: grow past its size here (split them there, then drop them from this list)
KNOWN_OVER: dict[str, int] = {}


def test_no_import_circle_in_the_package():
    graph = structure.import_graph(REPO)
    assert "qdq_optuna.search._run" in graph and graph["qdq_optuna.search._run"]
    assert structure.circles(graph) == []


def test_the_import_walk_finds_a_circle():
    """The check itself: two modules importing each other (one inside a function) are one."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert structure.circles(graph) == [["a", "b", "c"]]
    tree = ast.parse("import os\ndef f():\n    from .b import x\nif TYPE_CHECKING:\n"
                     "    from .c import y\n")
    assert structure._imports(tree, "qdq_optuna.a", False) == {"qdq_optuna.b", "qdq_optuna.b.x"}


def test_no_class_over_400_and_no_function_over_80_lines():
    over = {f"{r['module']}.{r['unit']}": r["lines"] for r in structure.too_long(
        structure.units(REPO))}
    new = {u: n for u, n in over.items() if u not in KNOWN_OVER}
    assert not new, f"over the limits: {new}"
    grown = {u: n for u, n in over.items() if u in KNOWN_OVER and n > KNOWN_OVER[u]}
    assert not grown, f"grew past their size: {grown}"


#: the longest class under search/ (a phase, a study, the tuner: well under the package's 400)
SEARCH_CLASS_LIMIT = 250


def _search_classes_over(rows: list[dict]) -> dict[str, int]:
    return {f"{r['module']}.{r['unit']}": r["lines"] for r in rows
            if r["kind"] == "class" and r["module"].startswith("qdq_optuna.search.")
            and r["lines"] > SEARCH_CLASS_LIMIT}


def test_no_class_under_search_over_250_lines():
    """The tuner, the starts phase and a pattern study keep their cohesive parts in their own
    functions and modules (the conclusion, the start repairs, a study's trials)."""
    assert _search_classes_over(structure.units(REPO)) == {}


def test_the_search_class_size_check_finds_a_long_class(tmp_path):
    search = tmp_path / "qdq_optuna" / "search"
    search.mkdir(parents=True)
    for folder in (tmp_path / "qdq_optuna", search):
        (folder / "__init__.py").write_text("")
    body = "    x = 1\n" * SEARCH_CLASS_LIMIT
    (search / "_run.py").write_text("class Tuner:\n" + body + "class Small:\n    y = 2\n")
    (tmp_path / "qdq_optuna" / "big.py").write_text("class Big:\n" + body)
    assert _search_classes_over(structure.units(tmp_path)) == {
        "qdq_optuna.search._run.Tuner": SEARCH_CLASS_LIMIT + 1}


def test_unit_sizes_are_measured_from_the_first_line_to_the_last(tmp_path):
    pkg = tmp_path / "qdq_optuna"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "m.py").write_text("@decorator\ndef f():\n" + "    x = 1\n" * 80
                              + "class C:\n    def g(self):\n        pass\n")
    rows = {r["unit"]: r for r in structure.units(tmp_path)}
    assert rows["f"]["lines"] == 82 and rows["C"]["lines"] == 3 and rows["C.g"]["lines"] == 2
    assert [r["unit"] for r in structure.too_long(list(rows.values()))] == ["f"]


@pytest.mark.parametrize("name", ["POINTS", "CONCAT_GROUPS", "FUSION_GROUPS", "POINT_USES",
                                  "POINT_TENSORS", "NUM_CHOICES", "VISIT"])
def test_the_record_writes_the_keys_our_sampler_reads(name):
    from qdq_optuna.record import PatternAttr, SystemAttr, TrialAttr
    from samplers.qdq_mutation import _sampler, _visit

    assert getattr(PatternAttr, name) == getattr(_sampler if hasattr(_sampler, f"{name}_ATTR")
                                                 else _visit, f"{name}_ATTR")
    assert SystemAttr.DUPLICATE == _sampler.DUPLICATE_KEY
    assert SystemAttr.PHASE == _sampler.PHASE_KEY
    # the move engine reads what the objective writes on a visit's trials
    assert (TrialAttr.IMPROVED, TrialAttr.QDQ_COUNT, TrialAttr.TRANSIENT,
            TrialAttr.DUPLICATE_OF) == (_visit.IMPROVED_KEY, _visit.QDQ_COUNT_KEY,
                                        _visit.TRANSIENT_KEY, _visit.DUPLICATE_OF_KEY)


def _module_map() -> list[str]:
    """The module map of the docs' architecture page (it was the README's)."""
    text = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    block = text.split("## Module map", 1)[1].split("```\n", 2)[1]
    return block.splitlines()


def test_the_module_map_lists_every_module():
    """Every module of the package is in the docs' module map, and the map names no other."""
    listed, package = set(), ""
    for line in _module_map()[1:]:
        words = line.split()
        if not words or not (words[0].endswith(".py") or words[0].endswith("/")):
            continue
        indent = len(line) - len(line.lstrip())
        if indent == 2:
            package = words[0] if words[0].endswith("/") else ""
            if package:  # a package's header stands for its __init__.py
                listed.add(package + "__init__.py")
                continue
        listed.add((package if indent > 2 else "") + words[0])
    files = {p.relative_to(REPO / "qdq_optuna").as_posix()
             for p in (REPO / "qdq_optuna").rglob("*.py")}
    assert files - listed == set(), "modules missing from docs/architecture.md's map"
    assert listed - files == set(), "docs/architecture.md's map names modules that do not exist"


def test_search_modules_import_only_the_ones_listed_below_them():
    lines = _module_map()
    start = next(i for i, line in enumerate(lines) if line.startswith("  search/"))
    order = []
    for line in lines[start + 1:]:
        if not line.startswith("    "):
            break
        if line.split()[0].endswith(".py"):
            order.append(line.split()[0])
    assert order[0] == "_run.py" and "_options.py" in order
    graph = structure.import_graph(REPO)
    rank = {f"qdq_optuna.search.{name[:-3]}": i for i, name in enumerate(order)}
    for module, i in rank.items():
        for target in graph[module]:
            assert rank.get(target, len(order)) > i, f"{module} imports {target}, listed above it"


def _stages() -> list[str]:
    """The pipeline's folders, in the map's order."""
    return [line.split()[0].rstrip("/") for line in _module_map()[1:]
            if line.startswith("  ") and not line.startswith("   ") and line.split()[0].endswith("/")]


def _upward(graph: dict[str, set[str]], stages: list[str]) -> list[str]:
    rank = {name: i for i, name in enumerate(stages)}

    def stage(module: str) -> int | None:
        parts = module.split(".")
        return rank.get(parts[1]) if len(parts) > 2 or (len(parts) == 2 and parts[1] in rank) else None

    found = []
    for module, targets in sorted(graph.items()):
        here = stage(module)
        for target in sorted(targets):
            there = stage(target)
            if here is not None and there is not None and there > here:
                found.append(f"{module} -> {target}")
    return found


def test_no_folder_imports_a_stage_listed_below_it():
    stages = _stages()
    assert stages[:3] == ["examples", "model", "placement"] and stages[-1] == "cli"
    assert _upward(structure.import_graph(REPO), stages) == []


def test_the_stage_check_finds_an_upward_import():
    graph = {"qdq_optuna.model.graph": {"qdq_optuna.placement.rules"},
             "qdq_optuna.placement.rules": {"qdq_optuna.model.graph", "qdq_optuna.errors"}}
    assert _upward(graph, ["model", "placement"]) == [
        "qdq_optuna.model.graph -> qdq_optuna.placement.rules"]


def test_no_private_search_module_is_imported_outside_the_search():
    graph = structure.import_graph(REPO)
    found = [f"{m} -> {t}" for m, targets in graph.items()
             if m != "qdq_optuna.search" and not m.startswith("qdq_optuna.search.")
             for t in targets if t.startswith("qdq_optuna.search._")]
    assert found == []


# -- Optuna's private attributes: one adapter ----------------------------------------------------
#: the one module allowed to name them
OPTUNA_ADAPTER = "qdq_optuna/record/_optuna.py"
#: where the check looks
CHECKED = ("qdq_optuna", "benchmarks", "samplers")
#: samplers/ is an OptunaHub package on its own (it cannot import ours): like Optuna's samplers
#: it writes a trial's system attrs through ``study._storage``, in this one function only
SAMPLER_ADAPTER = ("samplers/qdq_mutation/_sampler.py", "set_system_attrs")


def _optuna_private_names() -> set[str]:
    """The private attributes and methods of Optuna's study, trial and storage classes (read
    from Optuna's source, so a new Optuna brings its own), less those our own classes also
    use on ``self`` (``_lock``: a name, not Optuna's)."""
    import inspect

    import optuna
    from optuna.storages import BaseStorage, RDBStorage
    from optuna.storages._cached_storage import _CachedStorage
    from optuna.trial import FrozenTrial, Trial

    names: set[str] = set()
    for cls in (optuna.Study, Trial, FrozenTrial, BaseStorage, RDBStorage, _CachedStorage):
        for klass in cls.__mro__:
            if not klass.__module__.startswith("optuna"):
                continue
            names |= {n for n in vars(klass) if n.startswith("_") and not n.startswith("__")}
            names |= _self_privates(ast.parse(inspect.getsource(klass)))
    ours: set[str] = set()
    for root in CHECKED:
        for path in (REPO / root).rglob("*.py"):
            ours |= _self_privates(ast.parse(path.read_text(encoding="utf-8")))
    return names - ours


def _self_privates(tree: ast.AST) -> set[str]:
    return {node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id == "self" and node.attr.startswith("_")
            and not node.attr.startswith("__")}


def _private_uses(tree: ast.AST, names: set[str]) -> list[tuple[int, str]]:
    """``x._storage``, ``trial._trial_id``, ``super()._get_stale_trial_ids``: an attribute
    named like one of Optuna's private ones, on anything but ``self`` / ``cls``."""
    return sorted((node.lineno, node.attr) for node in ast.walk(tree)
                  if isinstance(node, ast.Attribute) and node.attr in names
                  and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")))


def test_optuna_private_attributes_only_in_the_adapter():
    names = _optuna_private_names()
    assert {"_storage", "_study_id", "_trial_id", "_get_stale_trial_ids"} <= names
    found = []
    for root in CHECKED:
        for path in sorted((REPO / root).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if rel == OPTUNA_ADAPTER:
                continue
            tree = ast.parse(path.read_text(encoding="utf-8"))
            if rel == SAMPLER_ADAPTER[0]:  # its one adapter function left out
                tree.body = [n for n in tree.body if getattr(n, "name", None) != SAMPLER_ADAPTER[1]]
            found += [f"{rel}:{line} .{attr}" for line, attr in _private_uses(tree, names)]
    assert found == [], f"Optuna private attributes outside {OPTUNA_ADAPTER}: {found}"
    adapter = ast.parse((REPO / OPTUNA_ADAPTER).read_text(encoding="utf-8"))
    assert _private_uses(adapter, names), "the adapter no longer uses any: update this check"


def test_the_private_attribute_check_finds_one():
    tree = ast.parse("def f(study, trial):\n    s = study._storage.get_trial(trial._trial_id)\n"
                     "    self._lock = 1\n    return super()._get_stale_trial_ids(s)\n")
    assert _private_uses(tree, {"_storage", "_trial_id", "_lock", "_get_stale_trial_ids"}) == [
        (2, "_storage"), (2, "_trial_id"), (4, "_get_stale_trial_ids")]


def test_the_stored_run_page_lists_every_key():
    """docs/stored_run.md's key table names every stored key of the schema, and no other."""
    from qdq_optuna.record import key_table

    text = (REPO / "docs" / "stored_run.md").read_text(encoding="utf-8")
    table = text.split("## Keys", 1)[1]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    listed = {(row.split("|")[1].strip().strip("`"), row.split("|")[2].strip().strip("`"))
              for row in rows}
    expected = {(cls, key) for cls, _, key in key_table()}
    assert expected - listed == set(), "keys missing from docs/stored_run.md"
    assert listed - expected == set(), "docs/stored_run.md lists keys the schema lacks"


# -- one profile per runtime ---------------------------------------------------------------------
def _named_strings(node: ast.AST) -> set[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(set(), *(_named_strings(e) for e in node.elts))
    return set()


def _comparisons_of(tree: ast.AST, names: set[str]) -> list[str]:
    """``x == "name"``, ``x != "name"``, ``x in ("name", ...)`` with one of ``names``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(
                isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for op in node.ops):
            if set().union(*(_named_strings(x) for x in (node.left, *node.comparators))) & names:
                found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def _runtime_comparisons(root: Path, allowed: str = "qdq_optuna/runtimes/") -> list[str]:
    from qdq_optuna.runtimes import RUNTIME_NAMES

    found = []
    for folder in CHECKED:
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if not rel.startswith(allowed):
                found += [f"{rel}:{hit}" for hit in _comparisons_of(
                    ast.parse(path.read_text(encoding="utf-8")), set(RUNTIME_NAMES))]
    return found


def test_no_runtime_name_is_compared_outside_the_profiles():
    """What differs between runtimes is asked of the run's profile (``qdq_optuna/runtimes/``),
    never decided by comparing a runtime's name."""
    assert _runtime_comparisons(REPO) == []


def test_every_runtime_of_the_backend_table_has_its_profile():
    """``profile_for`` finds each runtime a backend names in ``runtimes/NAME.py``, whose rules
    are that runtime's; an unknown name is one line naming ``--runtime``."""
    from qdq_optuna.errors import OptionError
    from qdq_optuna.runtimes import RUNTIME_NAMES, Runtime, profile_for

    for name in RUNTIME_NAMES:
        profile = profile_for(name)
        assert isinstance(profile, Runtime) and profile.name == profile.rules.name == name
    with pytest.raises(OptionError, match=r"^--runtime: unknown runtime 'tpu'"):
        profile_for("tpu")


def test_the_runtime_check_finds_a_comparison(tmp_path):
    (tmp_path / "qdq_optuna" / "runtimes").mkdir(parents=True)
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "samplers").mkdir()
    (tmp_path / "qdq_optuna" / "m.py").write_text(
        'a = runtime == "onnxruntime"\nb = rules.name in ("tensorrt", "x")\nc = x == "fp32"\n')
    (tmp_path / "qdq_optuna" / "runtimes" / "ok.py").write_text('a = name == "openvino"\n')
    assert _runtime_comparisons(tmp_path) == [
        "qdq_optuna/m.py:1: runtime == 'onnxruntime'",
        "qdq_optuna/m.py:2: rules.name in ('tensorrt', 'x')"]


#: the tools only a runtime's profile or backend imports (its quantizer, its engine);
#: ONNX Runtime is not among them: it scores every candidate, whatever the runtime
RUNTIME_TOOLS = frozenset({"nncf", "modelopt"})
#: where a runtime's name may be written
RUNTIME_HOMES = ("qdq_optuna/runtimes/", "qdq_optuna/backends/")


def _docstrings(tree: ast.AST) -> set[int]:
    return {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and n.body and isinstance(n.body[0], ast.Expr)
            and isinstance(n.body[0].value, ast.Constant)}


def _defined_names(node: ast.AST) -> list[str]:
    """The names ``node`` defines: a function, class, argument, keyword or assigned name."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, (ast.arg, ast.keyword)):
        return [node.arg] if node.arg else []
    if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
        return [node.id]
    return []


def _runtime_names_in(tree: ast.AST, names: set[str]) -> list[str]:
    """Where a runtime's name is written in code (prose aside: docstrings, comments): a string
    naming it, an import of its own tool, a name defined after it."""
    tools = (names - {"onnxruntime"}) | RUNTIME_TOOLS
    skip, found = _docstrings(tree), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and id(node) not in skip and node.value in names | RUNTIME_TOOLS:
            found.append(f"{node.lineno}: {node.value!r}")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = ([a.name for a in node.names] if isinstance(node, ast.Import)
                       else [node.module or ""] if not node.level else [])
            found += [f"{node.lineno}: import {m}" for m in modules if m.split(".")[0] in tools]
        found += [f"{node.lineno}: {n}" for n in _defined_names(node)
                  if any(name in n.lower() for name in names | RUNTIME_TOOLS)]
    return sorted(set(found), key=lambda h: (int(h.split(":")[0]), h))


def _runtime_names_outside(root: Path) -> list[str]:
    from qdq_optuna.runtimes import RUNTIME_NAMES

    found = []
    for path in sorted((root / "qdq_optuna").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if not rel.startswith(RUNTIME_HOMES):
            found += [f"{rel}:{hit}" for hit in _runtime_names_in(
                ast.parse(path.read_text(encoding="utf-8")), set(RUNTIME_NAMES))]
    return found


def test_a_runtimes_name_is_written_only_in_its_profile_and_backend():
    """A runtime lives in one place: its profile (``runtimes/``) and its backend
    (``backends/``). Elsewhere in the package no string names it, no module imports its tool
    and no function, argument or variable is named after it."""
    assert _runtime_names_outside(REPO) == []


def test_the_runtime_name_check_finds_each_form(tmp_path):
    (tmp_path / "qdq_optuna" / "runtimes").mkdir(parents=True)
    (tmp_path / "qdq_optuna" / "m.py").write_text(
        '"""Runs NNCF\'s recipe for openvino."""\nimport nncf\nimport onnxruntime\n'
        'from openvino import Core\nbackend = "onnxruntime"\nRULES = {"tensorrt": 1}\n'
        'def nncf_recipe(model, openvino=False):\n    """openvino"""  # tensorrt\n'
        'TENSORRT_OPS = {"Conv"}\nscored(openvino=True)\nx = "fp16"\n')
    (tmp_path / "qdq_optuna" / "runtimes" / "openvino.py").write_text(
        'import nncf\nx = "openvino"\n')
    assert _runtime_names_outside(tmp_path) == [
        "qdq_optuna/m.py:2: import nncf", "qdq_optuna/m.py:4: import openvino",
        "qdq_optuna/m.py:5: 'onnxruntime'", "qdq_optuna/m.py:6: 'tensorrt'",
        "qdq_optuna/m.py:7: nncf_recipe", "qdq_optuna/m.py:7: openvino",
        "qdq_optuna/m.py:9: TENSORRT_OPS", "qdq_optuna/m.py:10: openvino"]


#: the number words docs/architecture.md may use for the files a new runtime touches
_NUMBERS = {"two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7}


def _files_a_runtime_touches_per_the_docs() -> int:
    text = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    found = re.search(r"A new runtime touches (\w+) files", text)
    assert found, "docs/architecture.md no longer says how many files a new runtime touches"
    return _NUMBERS[found.group(1)]


def test_a_new_runtime_is_the_files_the_architecture_page_counts(tmp_path, monkeypatch):
    """A toy runtime, made here as the files a new runtime adds or edits (its backend module,
    its backend-table row, its profile module), tunes a model end to end: its rules place the
    Q/DQ, its recipe is a start, its words say how the guard scored. Anything else a runtime
    needed (a second registry, a name-keyed table) would fail the run, and docs/architecture.md
    states the count this test makes."""
    import sys
    import types

    import qdq_optuna
    from qdq_optuna import backends
    from qdq_optuna.backends.costmodel import CostModelBackend
    from qdq_optuna.examples import zoo
    from qdq_optuna.placement import starts
    from qdq_optuna.placement.rules import RuntimeRules
    from qdq_optuna.runtimes import Runtime, profile_for

    touched: set[str] = set()

    def add_module(name: str, **members) -> None:
        module = types.ModuleType(name)
        module.__dict__.update(members)
        monkeypatch.setitem(sys.modules, name, module)
        touched.add(name.replace(".", "/") + ".py")

    class ToyBackend(CostModelBackend):
        name = "toy"

    class Toy(Runtime):
        name = "toy"
        rules = RuntimeRules(name="toy", default_quant_type="int8", quant_types=("int8",),
                             fusion_group_ops=frozenset({"Conv", "Gemm", "MatMul"}))
        default_scales = "default"

        def recipe_start(self, pm, model, *, input_shapes=None, data=None, keep=None):
            everything = starts.all_on_start(pm)
            return starts.start_from_uses(pm, "recipe:toy", everything.uses)

        def scored_as(self, bf16, fused, runner):
            return "the toy runtime's own words"

    add_module("qdq_optuna.backends.toy", ToyBackend=ToyBackend)
    monkeypatch.setitem(backends.BACKENDS, "toy", backends.BackendSpec(
        "qdq_optuna.backends.toy", "ToyBackend", "toy", None))
    touched.add(Path(backends.__file__).relative_to(REPO).as_posix())
    add_module("qdq_optuna.runtimes.toy", PROFILE=Toy())

    assert profile_for("toy").rules.name == "toy"
    result = qdq_optuna.tune(zoo.build("tiny_residual"), tmp_path / "out", backend="toy",
                             seed=0, progress=False,
                             config=qdq_optuna.Config(schemes_per_region=4))
    report = result.report
    assert report["runtime"] == "toy" and report["complete"]
    assert "recipe:toy" in [s["name"] for s in report["starts"]]
    assert report["accuracy"]["scored_as"] == "the toy runtime's own words"
    assert sorted(touched) == ["qdq_optuna/backends/__init__.py", "qdq_optuna/backends/toy.py",
                               "qdq_optuna/runtimes/toy.py"]
    assert len(touched) == _files_a_runtime_touches_per_the_docs()


def test_the_file_count_is_read_from_the_architecture_page():
    """The companion: the count the toy runtime is held to is the page's, and a page that
    claimed fewer files than the toy runtime needs would fail the test above."""
    assert _files_a_runtime_touches_per_the_docs() == 3
    assert _NUMBERS["two"] < 3


# -- quant types: one QuantType, compared as members ---------------------------------------------
def _quant_type_comparisons(root: Path) -> list[str]:
    from qdq_optuna.model.calibration import QUANT_TYPES

    found = []
    for folder in CHECKED:
        for path in sorted((root / folder).rglob("*.py")):
            found += [f"{path.relative_to(root).as_posix()}:{hit}" for hit in _comparisons_of(
                ast.parse(path.read_text(encoding="utf-8")), set(QUANT_TYPES))]
    return found


def test_no_quant_type_is_compared_as_a_string():
    """A quant type is asked as a ``QuantType`` member (``qtype == QuantType.FP8``); the
    names are checked in one place, ``QuantType.parse``."""
    assert _quant_type_comparisons(REPO) == []


def test_the_quant_type_check_finds_a_string_comparison(tmp_path):
    for folder in CHECKED:
        (tmp_path / folder).mkdir()
    (tmp_path / "qdq_optuna" / "m.py").write_text(
        'a = qtype == "fp8"\nb = q in ("uint8", "int8")\nc = q == QuantType.FP8\n')
    assert _quant_type_comparisons(tmp_path) == [
        "qdq_optuna/m.py:1: qtype == 'fp8'", "qdq_optuna/m.py:2: q in ('uint8', 'int8')"]


# -- closed choices: enums, not strings ---------------------------------------------------------
#: comparisons against a string literal in the package (a closed choice of ours, a key, a
#: verdict's words, ...; a node's ``op_type`` against an ONNX op type is ONNX's open vocabulary
#: and not counted): our closed choices are ``(str, Enum)`` members (``Scales``,
#: ``SevenBitWeights``, ``BiasMode``, ``Until``, ``QuantType``, ``KernelDecision``,
#: ``QuantMode``, ``Timing``, ``Preprocess``, ``DropType``), compared by identity. This count may only go down: lower it when a change
#: turns more of them into members
STRING_COMPARISONS_AT_MOST = 196


def _string_comparisons(root: Path) -> list[str]:
    """``x == "a"``, ``x != "a"``, ``x in ("a", "b")``: every comparison of a value with a
    string literal in ``root``'s package, but a node's ``op_type`` with an ONNX op type."""
    found = []
    for path in sorted((root / "qdq_optuna").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            sides = (node.left, *node.comparators) if isinstance(node, ast.Compare) else ()
            if sides and any(
                    isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for op in node.ops) \
                    and any(_named_strings(x) for x in sides) \
                    and not any(isinstance(x, ast.Attribute) and x.attr == "op_type"
                                for x in sides):
                found.append(f"{path.relative_to(root).as_posix()}:{node.lineno}")
    return found


def test_string_comparisons_only_go_down():
    """A closed choice is an enum: its members are compared, its strings are parsed once (the
    command line still takes the same words)."""
    found = _string_comparisons(REPO)
    assert len(found) <= STRING_COMPARISONS_AT_MOST, (
        f"{len(found)} comparisons against a string literal, over {STRING_COMPARISONS_AT_MOST}: "
        "make the new closed choice an enum")


def test_the_string_comparison_count_finds_each_form(tmp_path):
    (tmp_path / "qdq_optuna").mkdir()
    (tmp_path / "qdq_optuna" / "m.py").write_text(
        'a = mode == "sequential"\nb = x in ("all", "first")\nc = "x" != y\n'
        'd = mode is BiasMode.JOINT\ne = x == 1\nf = "a" + b\ng = n.op_type == "Conv"\n')
    assert _string_comparisons(tmp_path) == ["qdq_optuna/m.py:1", "qdq_optuna/m.py:2",
                                             "qdq_optuna/m.py:3"]


def test_closed_choices_take_the_command_lines_words():
    """The enums take the words the command line and earlier callers use, and refuse others
    in one line naming the option."""
    from qdq_optuna.errors import OptionError
    from qdq_optuna.measure.bias import MODES, BiasMode
    from qdq_optuna.measure.timing import Until
    from qdq_optuna.placement.export import Scales
    from qdq_optuna.placement.rules import SevenBitWeights
    from qdq_optuna.search import TuneOptions

    assert Scales.parse("default") is Scales.DEFAULT and Until("precision") is Until.PRECISION
    assert BiasMode("joint") is BiasMode.JOINT and MODES == tuple(BiasMode)
    assert SevenBitWeights("") is SevenBitWeights.NONE
    options = TuneOptions(model="m.onnx", output_dir="out", scales="calibrated")
    assert options.scales is Scales.CALIBRATED
    with pytest.raises(OptionError, match=r"^--scales: unknown 'calibrate' \(choose from auto, "
                                          r"default, calibrated\)$"):
        TuneOptions(model="m.onnx", output_dir="out", scales="calibrate")


def test_tune_options_parse_their_closed_choices():
    """``--timing``, ``--preprocess`` and ``--metric-drop-type`` take today's words (the
    command line's choices read from their enums), become members, and refuse others in
    one line naming the option."""
    import dataclasses

    from qdq_optuna.errors import OptionError
    from qdq_optuna.measure.accuracy import DropType
    from qdq_optuna.measure.timing import Timing
    from qdq_optuna.placement.rules import Preprocess
    from qdq_optuna.search import TuneOptions

    default = TuneOptions(model="m.onnx", output_dir="out")
    assert (default.timing, default.preprocess, default.metric_drop_type) == (
        Timing.ROBUST, Preprocess.AUTO, DropType.ABSOLUTE)
    given = TuneOptions(model="m.onnx", output_dir="out", timing="fast", preprocess="ort-basic",
                        metric_drop_type="relative")
    assert given.timing is Timing.FAST and given.preprocess is Preprocess.ORT_BASIC
    assert given.metric_drop_type is DropType.RELATIVE
    choices = {f.name: f.metadata["choices"] for f in dataclasses.fields(TuneOptions)}
    assert choices["timing"] == ("fast", "robust")
    assert choices["preprocess"] == ("auto", "none", "ort-basic")
    assert choices["metric_drop_type"] == ("absolute", "relative")
    for name, word, needle in (("timing", "quick", "--timing: unknown 'quick'"),
                               ("preprocess", "ort", "--preprocess: unknown 'ort'"),
                               ("metric_drop_type", "percent",
                                "--metric-drop-type: unknown 'percent'")):
        with pytest.raises(OptionError) as caught:
            TuneOptions(model="m.onnx", output_dir="out", **{name: word})
        assert str(caught.value).startswith(needle) and "\n" not in str(caught.value)


# -- the run folder: one owner of a run's file names and writes -----------------------------------
#: calls that write a file
WRITES = {"atomic_write_bytes", "atomic_write_json", "write_bytes", "write_text", "save_model",
          "safe_dump", "dump"}


def _run_files_under(folder: Path) -> list[str]:
    """Output file names spelled, and files written, by the modules under ``folder``."""
    from qdq_optuna.run_folder import OUTPUT_NAMES

    found = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and node.value in OUTPUT_NAMES:
                found.append((path.name, node.lineno, repr(node.value)))
            elif isinstance(node, ast.Call):
                name = getattr(node.func, "attr", getattr(node.func, "id", None))
                if name in WRITES or name == "open" and len(node.args) > 1:
                    found.append((path.name, node.lineno, f"{ast.unparse(node.func)}()"))
    return [f"{name}:{line}: {what}" for name, line, what in sorted(found)]


def test_the_search_names_and_writes_no_run_file():
    """``search/`` decides and records; ``run_folder.py`` owns the names and the writes."""
    assert _run_files_under(REPO / "qdq_optuna" / "search") == []


def test_the_run_file_check_finds_a_name_and_a_write(tmp_path):
    (tmp_path / "m.py").write_text('p = out / "state.yaml"\natomic_write_bytes(p, b"")\n'
                                   'open(p, "w")\nopen(p)\nRunFolder(out).save_standing(e, u)\n')
    assert _run_files_under(tmp_path) == ["m.py:1: 'state.yaml'",
                                          "m.py:2: atomic_write_bytes()", "m.py:3: open()"]


#: the dashboard's pictures are Optuna artifacts, drawn into a temporary folder and uploaded to
#: the study's artifact store: no file of the run's folder
ARTIFACT_DRAWINGS = "dashboard.py"


def _run_file_writes(folder: Path, skip: tuple[str, ...] = ()) -> list[str]:
    """File writes by the modules under ``folder``: the calls of :data:`WRITES` (a YAML or
    JSON ``dump`` only into a stream), ``.save(...)`` of a model, an exporter or a cache, and
    ``open`` for writing."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        if path.name in skip:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call):
                continue
            name = getattr(node.func, "attr", getattr(node.func, "id", None))
            dumps_to_stream = name in ("dump", "safe_dump") and len(node.args) > 1
            if (name in WRITES - {"dump", "safe_dump"} or dumps_to_stream or name == "save"
                    or name == "open" and len(node.args) > 1):
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node.func)}()")
    return found


def test_one_writer_for_the_run_folder():
    """What the search, the record and the outputs leave in a run's folder (reports, state,
    pattern cache, calibration statistics, the shipped model, the Pareto front) is written by
    ``RunFolder`` (``run_folder.py``, atomically through ``_files.py``), never by them."""
    package = REPO / "qdq_optuna"
    assert _run_file_writes(package / "search") == []
    assert _run_file_writes(package / "record") == []
    assert _run_file_writes(package / "outputs", skip=(ARTIFACT_DRAWINGS,)) == []
    assert _run_file_writes(package, skip=()) != [], "the check no longer sees any write"


def test_the_run_file_write_check_finds_each_form(tmp_path):
    (tmp_path / "m.py").write_text(
        'cache.save(path)\nexporter.save(plan, out / name)\nyaml.safe_dump(doc, fh)\n'
        'text = yaml.safe_dump(doc)\nopen(p, "w")\nopen(p)\natomic_write_bytes(p, b"")\n'
        'RunFolder(out).write_state(text)\n')
    assert _run_file_writes(tmp_path) == [
        "m.py:1: cache.save()", "m.py:2: exporter.save()", "m.py:3: yaml.safe_dump()",
        "m.py:5: open()", "m.py:7: atomic_write_bytes()"]


# -- one accuracy bound --------------------------------------------------------------------------
#: the options the accuracy bound is built from
BOUND_OPTIONS = {"max_output_error", "max_metric_drop", "metric_drop_type", "accuracy_confidence"}
#: where they may be read: their definition and checks, where the bound is built, the bound
BOUND_BUILDERS = {"search/_options.py", "search/_settings.py", "search/_prepare.py",
                  "measure/bound.py"}


def _bound_option_reads(root: Path) -> list[str]:
    """Reads of :data:`BOUND_OPTIONS` as attributes (``options.max_output_error``) in the
    modules under ``root`` outside :data:`BOUND_BUILDERS`."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel in BOUND_BUILDERS:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr in BOUND_OPTIONS:
                found.append(f"{rel}:{node.lineno}: .{node.attr}")
    return found


def test_the_accuracy_bound_is_read_from_one_object():
    """Every feasibility check, the report and the fingerprint read the guard's
    ``AccuracyBound`` (``measure/bound.py``), built once from the options while preparing:
    no other module reads the options it is built from."""
    assert _bound_option_reads(REPO / "qdq_optuna") == []


def test_the_bound_option_check_finds_a_read(tmp_path):
    (tmp_path / "search").mkdir()
    (tmp_path / "search" / "_pattern.py").write_text(
        "x = s.settings.max_output_error\ny = o.max_metric_drop\nf(max_output_error=1)\n")
    (tmp_path / "search" / "_prepare.py").write_text("x = options.max_output_error\n")
    assert _bound_option_reads(tmp_path) == ["search/_pattern.py:1: .max_output_error",
                                             "search/_pattern.py:2: .max_metric_drop"]


#: the modules that write files and are no run folder's writer, each with why; every other
#: module under qdq_optuna/ writes through ``run_folder.py`` (and ``_files.py`` under it)
OTHER_WRITERS = {
    "backends/tensorrt.py": "TensorRT's timing cache, beside the user's engine files",
    "backends/trtexec.py": "the model handed to the trtexec binary, in a temporary folder",
    "cli/bench.py": "`qdq-optuna bench`'s own folder: models, records, tables",
    "cli/commands.py": "`qdq-optuna export`'s model at --output; JSON on stdout",
    "measure/kernels.py": "the kernel timings' cache (--kernel-cache), shared by runs",
    "outputs/dashboard.py": "the dashboard's pictures, drawn in a temporary folder",
    "placement/export.py": "the exporter's model file and external weights (RunFolder calls it)",
    "runtimes/onnxruntime.py": "the model handed to quantize_static, in a temporary folder",
}
#: where a run's output files are written
RUN_FOLDER_WRITERS = ("run_folder.py", "_files.py")
_WRITE_MODES = re.compile(r"[wax+]")


def _file_writes(root: Path) -> dict[str, int]:
    """File writes per module under ``root``: the calls of :data:`WRITES` (a YAML or JSON
    ``dump`` only into a stream), ``.save(...)`` (onnx, numpy, an exporter, a cache),
    ``np.savez``, and ``open`` with a writing mode."""
    found: dict[str, int] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call):
                continue
            name = getattr(node.func, "attr", getattr(node.func, "id", None))
            if name == "open":
                mode = node.args[1] if len(node.args) > 1 else next(
                    (k.value for k in node.keywords if k.arg == "mode"), None)
                writes = (isinstance(mode, ast.Constant) and isinstance(mode.value, str)
                          and bool(_WRITE_MODES.search(mode.value)))
            else:
                writes = (name in WRITES - {"dump", "safe_dump"} or name in ("save", "savez")
                          or name in ("dump", "safe_dump") and len(node.args) > 1)
            if writes:
                found[rel] = found.get(rel, 0) + 1
    return found


def test_every_other_file_write_is_a_named_exception():
    """What a run leaves is written by ``RunFolder``; the few modules that write other files
    (a tool's temporary input, a cache shared by runs, a command's own output) are named,
    each with why. A new writer elsewhere fails here."""
    writers = {m for m in _file_writes(REPO / "qdq_optuna")
               if m not in RUN_FOLDER_WRITERS}
    assert writers == set(OTHER_WRITERS)


def test_the_file_write_count_finds_each_form(tmp_path):
    (tmp_path / "outputs").mkdir()
    (tmp_path / "outputs" / "pareto.py").write_text(
        'onnx.save(m, p)\nnp.save(p, a)\nopen(p, "wb")\nopen(p, mode="a")\nopen(p, "rb")\n'
        'open(p)\natomic_write_json(p, {})\np.write_text("x")\njson.dump(d, fh)\n'
        'json.dumps(d)\nnp.savez(p, a=a)\n')
    (tmp_path / "run_folder.py").write_text('atomic_write_bytes(p, b"")\n')
    assert _file_writes(tmp_path) == {"outputs/pareto.py": 8, "run_folder.py": 1}


# -- typed boundaries ------------------------------------------------------------------------------
def _any_fields(source: str, cls: str) -> list[str]:
    """The fields of class ``cls`` whose annotation names ``Any``."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return [ast.unparse(s.target) for s in node.body if isinstance(s, ast.AnnAssign)
                    and any(isinstance(n, ast.Name) and n.id == "Any"
                            for n in ast.walk(s.annotation))]
    raise AssertionError(f"no class {cls}")


def test_the_search_outcome_has_no_any_field():
    """What the search concluded crosses to the outputs with its types."""
    source = (REPO / "qdq_optuna" / "search" / "_outcome.py").read_text(encoding="utf-8")
    assert _any_fields(source, "SearchOutcome") == []


def test_the_any_check_finds_an_any_field():
    assert _any_fields("class S:\n    a: int\n    b: Any\n    c: dict[str, Any] | None\n",
                       "S") == ["b", "c"]


def _dict_returns(source: str, cls: str) -> set[str]:
    """Public methods of ``cls`` whose return annotation names a bare ``dict``."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for f in node.body:
                if isinstance(f, ast.FunctionDef) and not f.name.startswith("_") and f.returns:
                    subscripted = {id(s.value) for s in ast.walk(f.returns)
                                   if isinstance(s, ast.Subscript)}
                    if any(isinstance(n, ast.Name) and n.id == "dict" and id(n) not in subscripted
                           for n in ast.walk(f.returns)):
                        found.add(f.name)
    return found


def test_no_run_record_method_returns_a_bare_dict():
    """What the record reads out of its studies comes back typed (``record/records.py``:
    ``AgreedStarts``, ``Visit``, ``VisitEntry``, ``PatternStanding``); the stored dicts stay
    inside the record."""
    source = (REPO / "qdq_optuna" / "record" / "run.py").read_text(encoding="utf-8")
    assert _dict_returns(source, "RunRecord") == set()


def test_the_dict_check_finds_a_bare_dict_return():
    source = ("class R:\n    def a(self) -> dict: ...\n    def b(self) -> dict | None: ...\n"
              "    def c(self) -> dict[str, int]: ...\n    def d(self) -> list[dict]: ...\n"
              "    def _e(self) -> dict: ...\n    def f(self) -> Rec: ...\n")
    assert _dict_returns(source, "R") == {"a", "b", "d"}


#: the stages whose work the outputs read from the search's outcome instead of doing it
MEASURING = ("qdq_optuna.measure", "qdq_optuna.backends")


def _measuring_imports(folder: Path) -> list[str]:
    """Imports of ``measure/`` or ``backends/`` by the modules under ``folder``: every import
    statement, inside functions and ``if TYPE_CHECKING:`` too, relative ones resolved."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        package = ["qdq_optuna", *path.relative_to(folder.parent).parent.parts]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package[:len(package) - node.level + 1] if node.level else []
                names = [".".join(base + ([node.module] if node.module else []))]
            else:
                continue
            found += [f"{path.name}:{node.lineno}: {n}" for n in names
                      if any(n == m or n.startswith(m + ".") for m in MEASURING)]
    return sorted(found, key=lambda h: (h.split(":")[0], int(h.split(":")[1])))


def test_the_outputs_import_nothing_that_measures():
    """The outputs word what the search measured (``SearchOutcome``, the run record); they
    import no module of ``measure/`` or ``backends/``."""
    assert _measuring_imports(REPO / "qdq_optuna" / "outputs") == []


def test_the_measuring_import_check_finds_each_form(tmp_path):
    out = tmp_path / "outputs"
    out.mkdir()
    (out / "m.py").write_text(
        "from qdq_optuna.measure.timing import X\nif TYPE_CHECKING:\n"
        "    from qdq_optuna.backends.what_ran import WhatRan\ndef f():\n"
        "    import qdq_optuna.backends\n    from ..measure import kernels\n"
        "    from qdq_optuna.measurements import y\n    from qdq_optuna.record import z\n")
    assert _measuring_imports(out) == [
        "m.py:1: qdq_optuna.measure.timing", "m.py:3: qdq_optuna.backends.what_ran",
        "m.py:5: qdq_optuna.backends", "m.py:6: qdq_optuna.measure"]


#: the plan measurer's methods that measure nothing (every other public one measures)
PLAN_MEASURER_BOOKKEEPING = {"deterministic", "set_deadline", "whole", "known"}


def _plan_measuring_methods() -> set[str]:
    """``PlanMeasurer``'s public methods that measure (read from its class, so a new one counts)."""
    from qdq_optuna.search._plans import PlanMeasurer

    return {n for n in vars(PlanMeasurer) if not n.startswith("_")
            and callable(getattr(PlanMeasurer, n))} - PLAN_MEASURER_BOOKKEEPING


def _measuring_calls(folder: Path, methods: set[str]) -> list[str]:
    """Calls ``x.m(...)`` of a measuring method ``m`` by the modules under ``folder``."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in methods:
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node.func)}()")
    return sorted(found)


def test_the_outputs_call_no_measuring_method():
    """The search measures (a two-objective front too, :mod:`qdq_optuna.search._pareto`); the
    outputs word and write what it measured and call no measuring method of the plan measurer."""
    methods = _plan_measuring_methods()
    assert {"compare", "measure", "error", "latency", "same_model"} <= methods
    assert _measuring_calls(REPO / "qdq_optuna" / "outputs", methods) == []


def test_the_measuring_call_check_finds_each_method(tmp_path):
    out = tmp_path / "outputs"
    out.mkdir()
    (out / "m.py").write_text(
        "def f(o, plans):\n    cmp = plans.compare(a, b, 'pareto')\n"
        "    e = o.plans.error(exporter, plan)\n    n = plans.measurements\n"
        "    plans.set_deadline(None)\n    return e.get('error')\n")
    assert _measuring_calls(out, _plan_measuring_methods()) == [
        "m.py:2: plans.compare()", "m.py:3: o.plans.error()"]


#: the calls that prepare a run: options resolved, the backend made, the model prepared, the
#: user's data read, the storage and the run record opened, the measuring objects built
PREPARING = {"backend_for", "check_runtime_named", "Settings.profile_of", "Settings.resolve",
             "PreparedModel.prepare", "read_data", "input_data", "open_storage",
             "delete_run", "RunRecord", "remove_stale_temps", "PatternCache.load",
             "baseline_tensors", "calibrated_scales", "error_scorer", "PlanMeasurer", "Guard"}
#: search modules that may prepare: the preparation stage, and the ask/tell API (the caller
#: measures; it opens its own small run from its arguments)
PREPARERS = {"_prepare.py", "autotuner.py"}


def _preparing_calls(folder: Path) -> list[str]:
    """Calls of :data:`PREPARING` in the modules under ``folder`` other than the preparers."""
    found = []
    for path in sorted(folder.glob("*.py")):
        if path.name in PREPARERS:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            name = f.id if isinstance(f, ast.Name) else (
                f"{f.value.id}.{f.attr}" if isinstance(f, ast.Attribute)
                and isinstance(f.value, ast.Name) else None)
            if name in PREPARING:
                found.append((path.name, node.lineno, name))
    return [f"{n}:{line}: {name}()" for n, line, name in sorted(found)]


def test_the_search_prepares_nothing():
    """Preparing a run is its own stage (``search/_prepare.py``): ``tune()`` hands the search
    what was prepared, and no other module of the pipeline's search prepares."""
    assert _preparing_calls(REPO / "qdq_optuna" / "search") == []


def test_the_preparing_check_finds_each_call(tmp_path):
    (tmp_path / "_run.py").write_text(
        "b = backend_for(o)\npm = PreparedModel.prepare(m)\nr = RunRecord(s, 'r', [], sp)\n"
        "x = self.prepared.prepare(m)\ny = record.open_storage\n")
    (tmp_path / "_prepare.py").write_text("b = backend_for(o)\n")
    assert _preparing_calls(tmp_path) == [
        "_run.py:1: backend_for()", "_run.py:2: PreparedModel.prepare()", "_run.py:3: RunRecord()"]


# -- benchmarks as clients -----------------------------------------------------------------------
#: the one quiet-machine wait of the benchmarks (and the one module that reads the load)
LOAD_WAIT = "benchmarks/_common.py:wait_quiet"
_SYS_PATH_EDIT = re.compile(r"sys\.path\s*(\.\s*(insert|append|extend)\b|\[[^\]]*\]\s*=|\+?=)")


def _benchmark_trees(root: Path):
    for path in sorted((root / "benchmarks").glob("*.py")):
        yield path.relative_to(root).as_posix(), ast.parse(path.read_text(encoding="utf-8"))


def _in_order(found: list[str]) -> list[str]:
    """``path:line ...`` hits in file and line order (``ast.walk`` goes breadth first)."""
    return sorted(found, key=lambda h: (h.split(":")[0], int(h.split(":")[1].split()[0])))


def _is_sys_path(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "path"
            and isinstance(node.value, ast.Name) and node.value.id == "sys")


def _sys_path_edits(root: Path) -> list[str]:
    """``sys.path.insert(...)``, ``sys.path[:0] = ...``, ``sys.path += ...``, also in the code
    a benchmark runs in a child interpreter (a string)."""
    found = []
    for rel, tree in _benchmark_trees(root):
        for node in ast.walk(tree):
            call = (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and _is_sys_path(node.func.value))
            targets = (node.targets if isinstance(node, ast.Assign) else
                       [node.target] if isinstance(node, ast.AugAssign) else [])
            assigned = any(_is_sys_path(t.value if isinstance(t, ast.Subscript) else t)
                           for t in targets)
            child = (isinstance(node, ast.Constant) and isinstance(node.value, str)
                     and _SYS_PATH_EDIT.search(node.value))
            if call or assigned or child:
                found.append(f"{rel}:{node.lineno}")
    return _in_order(found)


def _test_imports(root: Path) -> list[str]:
    """Imports of ``tests`` or of a module of ``tests/`` by its bare name (what a benchmark
    that put ``tests/`` on sys.path did); a benchmark's own modules are not the tests'."""
    own = {p.stem for p in (root / "benchmarks").glob("*.py")}
    theirs = ({p.stem for p in (root / "tests").glob("*.py")}
              | {p.name for p in (root / "tests").iterdir() if (p / "__init__.py").exists()}
              | {"tests"}) - own
    found = []
    for rel, tree in _benchmark_trees(root):
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            found += [f"{rel}:{node.lineno} {n}" for n in names if n.split(".")[0] in theirs]
    return _in_order(found)


def _calls(node: ast.AST) -> set[str]:
    """The names called inside ``node`` (``os.getloadavg()`` -> ``getloadavg``)."""
    return {c.func.attr if isinstance(c.func, ast.Attribute) else c.func.id
            for c in ast.walk(node) if isinstance(c, ast.Call)
            and isinstance(c.func, (ast.Attribute, ast.Name))}


def _load_waits(root: Path) -> tuple[list[str], list[str]]:
    """The functions that sleep while reading the load or wrap the wait under a name of their
    own (waits), and the functions outside ``benchmarks/_common.py`` that read it themselves."""
    waits, reads = [], []
    for rel, tree in _benchmark_trees(root):
        for f in ast.walk(tree):
            if not isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            called = _calls(f)
            if "getloadavg" in called and rel != LOAD_WAIT.split(":")[0]:
                reads.append(f"{rel}:{f.name}")
            reads_load = called & {"getloadavg", "load_now", "load_avg", "wait_quiet"}
            wrapper = "wait_quiet" in called and ("wait" in f.name or "quiet" in f.name)
            if reads_load and ("sleep" in called or wrapper):
                waits.append(f"{rel}:{f.name}")
    return waits, reads


def _private_writes(root: Path) -> list[str]:
    """``obj._x = ...`` (also augmented, subscripted and ``setattr(obj, "_x", ...)`` with a
    name that starts with an underscore) on anything but ``self`` / ``cls``."""
    def private(node: ast.AST) -> bool:
        while isinstance(node, ast.Subscript):
            node = node.value
        return (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")))

    def underscore(node: ast.AST) -> bool:  # "_x", "_" + key, f"_{key}"
        while isinstance(node, ast.BinOp):
            node = node.left
        if isinstance(node, ast.JoinedStr) and node.values:
            node = node.values[0]
        return (isinstance(node, ast.Constant) and isinstance(node.value, str)
                and node.value.startswith("_") and not node.value.startswith("__"))

    found = []
    for rel, tree in _benchmark_trees(root):
        for node in ast.walk(tree):
            targets = (node.targets if isinstance(node, ast.Assign) else
                       [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            targets = [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
            set_call = (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                        and node.func.id == "setattr" and len(node.args) >= 2
                        and underscore(node.args[1]))
            if set_call or any(private(t) for t in targets):
                found.append(f"{rel}:{node.lineno}")
    return _in_order(found)


def test_benchmarks_are_clients_of_the_package():
    """A benchmark imports the installed ``qdq_optuna`` like any client: no sys.path edit, no
    import from ``tests/`` (what both need lives in the package or ``benchmarks/_common.py``),
    one quiet-machine wait, no write to a package object's private attribute."""
    assert _sys_path_edits(REPO) == []
    assert _test_imports(REPO) == []
    assert _load_waits(REPO) == ([LOAD_WAIT], [])
    assert _private_writes(REPO) == []


def test_the_client_checks_find_each_breach(tmp_path):
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "tests" / "hostile").mkdir(parents=True)
    for name in ("tests/_runs.py", "tests/test_costmodel.py", "tests/hostile/__init__.py"):
        (tmp_path / name).write_text("")
    (tmp_path / "benchmarks" / "_common.py").write_text(
        "import os, time\ndef wait_quiet(x):\n    while os.getloadavg()[0] > x:\n"
        "        time.sleep(1)\n")
    (tmp_path / "benchmarks" / "photos.py").write_text("")
    (tmp_path / "benchmarks" / "a.py").write_text(
        "import sys\nimport photos\nsys.path.insert(0, 'x')\nsys.path[:0] = ['y']\n"
        "sys.path += ['z']\nCHILD = 'import sys\\nsys.path.append(sys.argv[1])'\n"
        "import test_costmodel as tc\nfrom _runs import check_visit\nimport tests.corpus\n"
        "from hostile import x\nfrom . import sibling\n"
        "def gate(limit):\n    import os, time\n    while load_now() > limit:\n"
        "        time.sleep(5)\n"
        "def reading():\n    return os.getloadavg()\n"
        "def wait_for_quiet():\n    return wait_quiet(1.2)\n"
        "class Mine:\n    def __init__(self):\n        self._own = 1\n"
        "def ablate(sampler, key, value, tc):\n    sampler._climb = 0\n"
        "    sampler._cache['k'] = 1\n    a, tc._x = 1, 2\n    sampler._n += 1\n"
        "    setattr(sampler, '_' + key, value)\n    setattr(sampler, f'_{key}', value)\n"
        "    setattr(sampler, 'public', value)\n    tc.FLOAT = 1\n")
    assert _sys_path_edits(tmp_path) == ["benchmarks/a.py:3", "benchmarks/a.py:4",
                                         "benchmarks/a.py:5", "benchmarks/a.py:6"]
    assert _test_imports(tmp_path) == ["benchmarks/a.py:7 test_costmodel",
                                       "benchmarks/a.py:8 _runs", "benchmarks/a.py:9 tests.corpus",
                                       "benchmarks/a.py:10 hostile"]
    assert _load_waits(tmp_path) == (["benchmarks/_common.py:wait_quiet", "benchmarks/a.py:gate",
                                      "benchmarks/a.py:wait_for_quiet"], ["benchmarks/a.py:reading"])
    assert _private_writes(tmp_path) == [f"benchmarks/a.py:{n}" for n in range(24, 30)]
