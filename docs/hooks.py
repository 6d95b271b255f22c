"""MkDocs build hook: pages that are generated, so no figure or option is copied by hand.

Two directives, each an HTML comment on lines of its own in a page's Markdown:

``<!-- cli-reference -->``
    every command of ``qdq-optuna`` with its options, read from ``qdq_optuna.cli.commands.build_parser``.

``<!-- fields-reference MODULE.CLASS -->``
    a table of a dataclass's fields (``TuneOptions``, ``Config``): name, type, default, flag
    and what it does, read from the same field metadata the command line is built from.

``<!-- results ... -->``
    a YAML body naming a file under ``benchmarks/results/`` (``file:``) and, for JSON and CSV,
    the ``columns:`` to show (dotted paths into each row -> column title; ``missing:`` the text
    for a column some rows lack, ``where:`` a filter on values). Markdown files are
    included as they are (their title dropped, headings moved one level down).

A missing file or column raises, so ``mkdocs build --strict`` fails instead of showing a hole.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
from pathlib import Path

import yaml
from mkdocs.exceptions import PluginError

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
_RESULTS_RE = re.compile(r"^<!-- results\n(.*?)\n-->$", re.S | re.M)
_CLI_RE = re.compile(r"^<!-- cli-reference -->$", re.M)
_FIELDS_RE = re.compile(r"^<!-- fields-reference ([\w.]+) -->$", re.M)


def on_config(config):
    """The package's version in the site's title, so a reader knows which release a page is."""
    from qdq_optuna import __version__

    config["site_name"] = f"{config['site_name']} {__version__}"
    return config


def on_page_markdown(markdown: str, page, config, files) -> str:
    """Expand the directives of one page (MkDocs calls this for every page)."""
    markdown = _RESULTS_RE.sub(lambda m: _results(yaml.safe_load(m.group(1)), page), markdown)
    markdown = _FIELDS_RE.sub(lambda m: fields_reference(m.group(1)), markdown)
    return _CLI_RE.sub(lambda m: cli_reference(), markdown)


_ROLE_RE = re.compile(r":(?:class|func|meth|attr|data|mod|exc|obj):<code>(~?)([^<]*?)"
                      r"(?: &lt;[\w.]+&gt;)?</code>")


def on_page_content(html: str, page, config, files) -> str:
    """Docstrings use Sphinx roles (``:class:`~a.B` ``) that Markdown leaves as literal text."""
    return sphinx_roles(html)


def sphinx_roles(html: str) -> str:
    """``:class:<code>~a.b.C</code>`` -> ``<code>C</code>`` (``~``: the last name, as Sphinx)."""
    return _ROLE_RE.sub(lambda m: "<code>" + (m.group(2).rsplit(".", 1)[-1] if m.group(1)
                                              else m.group(2)) + "</code>", html)


# --- benchmark results ------------------------------------------------------------------------

def _results(spec: dict, page) -> str:
    path = RESULTS / spec["file"]
    if not path.is_file():
        raise PluginError(f"{page.file.src_path}: benchmarks/results/{spec['file']} not found")
    source = f"\n\n*Rendered at build time from `benchmarks/results/{spec['file']}`.*\n"
    if path.suffix == ".md":
        return _included_markdown(path.read_text(encoding="utf-8")) + source
    if path.suffix == ".csv":
        with path.open(newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
    elif path.suffix == ".json":
        data = json.loads(path.read_text(encoding="utf-8"))
        rows = data[spec.get("rows", "rows")] if isinstance(data, dict) else data
    else:
        raise PluginError(f"{path.name}: no renderer for {path.suffix} files")
    rows = [r for r in rows if _matches(r, spec.get("where", {}))]
    return table(rows, spec["columns"], path.name, spec.get("missing", {})) + source


def _included_markdown(text: str) -> str:
    lines = text.splitlines()
    if lines and lines[0].startswith("# "):
        lines = lines[1:]
    return "\n".join("#" + line if line.startswith("#") else line for line in lines).strip()


def _matches(row: dict, where: dict) -> bool:
    return all(str(lookup(row, key)) == str(value) for key, value in where.items())


def lookup(row: dict, dotted: str):
    """``row["a"]["b"]`` for ``"a.b"``; a key that itself holds dots is tried whole first."""
    if dotted in row:
        return row[dotted]
    head, _, rest = dotted.partition(".")
    if not rest or not isinstance(row.get(head), dict):
        raise KeyError(dotted)
    return lookup(row[head], rest)


def cell(value) -> str:
    """One value as a table cell: floats to 4 significant digits, a pair as a range."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list) and len(value) == 2 and all(
            isinstance(v, (int, float)) for v in value):
        return f"{cell(float(value[0]))}-{cell(float(value[1]))}"
    if isinstance(value, list):
        return ", ".join(cell(v) for v in value)
    if isinstance(value, dict):
        return ", ".join(f"{k} {cell(v)}" for k, v in value.items())
    text = str(value)
    try:  # a CSV number arrives as text
        return cell(float(text)) if "." in text else text.replace("|", "\\|")
    except ValueError:
        return text.replace("|", "\\|")


def table(rows: list[dict], columns: dict, name: str, missing: dict | None = None) -> str:
    """A Markdown table of the chosen columns of every row.

    ``missing`` gives the text for a column a row may lack (any other gap raises).
    """
    missing = missing or {}
    if not rows:
        raise PluginError(f"{name}: no rows")
    out = ["| " + " | ".join(columns.values()) + " |", "|" + "---|" * len(columns)]
    for i, row in enumerate(rows):
        try:
            out.append("| " + " | ".join(_cell_of(row, c, missing) for c in columns) + " |")
        except KeyError as e:
            raise PluginError(f"{name}: row {i} has no {e.args[0]!r}") from None
    return "\n".join(out)


def _cell_of(row: dict, column: str, missing: dict) -> str:
    try:
        return cell(lookup(row, column))
    except KeyError:
        if column in missing:
            return str(missing[column])
        raise


# --- command line -----------------------------------------------------------------------------

def cli_reference() -> str:
    """Each command's usage and its options, grouped as ``qdq-optuna COMMAND -h`` groups them."""
    from qdq_optuna.cli.commands import build_parser

    parser = build_parser()
    parts = [_command("qdq-optuna", parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                parts.append(_command(f"qdq-optuna {name}", sub))
    return "\n\n".join(parts)


def _command(title: str, parser: argparse.ArgumentParser) -> str:
    out = [f"### `{title}`", "", (parser.description or "").replace("\n", " "), "",
           "```text", parser.format_usage().strip(), "```"]
    for group in parser._action_groups:
        actions = [a for a in group._group_actions
                   if a.help != argparse.SUPPRESS and not isinstance(a, argparse._SubParsersAction)]
        if not actions:
            continue
        out += ["", f"**{group.title}**" + (f": {group.description}" if group.description else ""),
                "", "| option | choices / value | help |", "|---|---|---|"]
        for a in actions:
            out.append(f"| {_flags(a)} | {_value(a)} | {_help(parser, a)} |")
    if parser.epilog:
        out += ["", "```text", parser.epilog.strip(), "```"]
    return "\n".join(out)


def _flags(action: argparse.Action) -> str:
    return ", ".join(f"`{s}`" for s in action.option_strings) or f"`{action.dest}`"


def _value(action: argparse.Action) -> str:
    if action.choices and not isinstance(action.choices, dict):
        return " \\| ".join(f"`{c}`" for c in action.choices)
    if action.nargs == 0:
        return ""
    return f"`{action.metavar or action.dest.upper()}`"


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    text = parser._get_formatter()._expand_help(action) if action.help else ""
    return " ".join(text.split()).replace("|", "\\|")


# --- dataclass fields (TuneOptions, Config) ---------------------------------------------------

def fields_reference(dotted: str) -> str:
    """Each field of the dataclass ``dotted`` as a table row: its keyword, type, default, the
    flag the command line builds from its metadata, and its help (the flag's, else the
    field's docstring)."""
    import dataclasses
    import importlib

    from qdq_optuna.config import field_flags

    module, _, name = dotted.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    docs = _field_docstrings(cls)
    out = ["| keyword | type | default | flag | what it does |", "|---|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        m = f.metadata
        about = m.get("help") or m.get("flag_help") or docs.get(f.name, "")
        if "flag_help" in m and f.name in docs:  # a setting's docstring says more
            about = docs[f.name]
        out.append(f"| `{f.name}` | {_code(str(f.type))} | {_default(f)} | "
                   f"{_field_flag_cell(f, field_flags(f))} | {_text(about)} |")
    return "\n".join(out)


def _field_docstrings(cls) -> dict[str, str]:
    """``name -> docstring`` of the fields of ``cls`` that have a string after them."""
    import ast
    import inspect
    import textwrap

    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    return {a.target.id: inspect.cleandoc(doc.value.value) for a, doc in zip(body, body[1:])
            if isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name)
            and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
            and isinstance(doc.value.value, str)}


def _default(f) -> str:
    import dataclasses

    if f.default is not dataclasses.MISSING:
        return _code(repr(f.default))
    if f.default_factory is not dataclasses.MISSING:
        return _code(f"{getattr(f.default_factory, '__name__', 'factory')}()")
    return "required"


def _field_flag_cell(f, flags: list[str]) -> str:
    if not flags:
        return "-"
    if f.default is True:  # --flag / --no-flag
        flags = [*flags, "--no-" + flags[-1][2:]]
    return ", ".join(f"`{flag}`" for flag in flags)


def _code(text: str) -> str:
    return "<code>" + text.replace("&", "&amp;").replace("<", "&lt;").replace("|", "&#124;") \
        + "</code>"


def _text(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")
