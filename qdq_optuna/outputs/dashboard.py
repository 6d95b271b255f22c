"""optuna-dashboard for a run: notes and pictures on every pattern study, and the server.

Each pattern study gets, when its scheme is committed (:class:`PatternPictures`, the search's
commit callback):

* a Markdown note (:func:`pattern_note`): the pattern's ops, its member regions with their
  nodes, a legend of its insertion points, the committed scheme, its gain and the reference;
* two study artifacts in the run's artifact store (``OUTPUT/artifacts``): a convergence curve
  (PNG, best-so-far latency per trial against the reference) and a picture of the pattern's
  representative region with the best trial's Q/DQ marked (SVG, drawn here, no graphviz).

Pictures are a convenience: any error while drawing or uploading them is logged and the run
goes on. ``qdq-optuna dashboard OUTPUT`` (:func:`serve`) serves the storage and the artifact
store together.
"""

from __future__ import annotations

import contextlib
import errno
import html
import logging
import math
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import optuna
from optuna.trial import TrialState

from qdq_optuna.errors import UserError, install_hint
from qdq_optuna.record import PatternAttr as A
from qdq_optuna.record import storage_of, study_id
from qdq_optuna.run_folder import STUDIES_DB

if TYPE_CHECKING:
    from qdq_optuna.placement.points import PatternPoints
    from qdq_optuna.runtimes.prepared import PreparedModel

log = logging.getLogger("qdq_optuna")

#: the run's artifact store, relative to the output folder
ARTIFACT_DIR = "artifacts"
#: study user attr that lists a pattern's uploaded artifacts
ARTIFACTS_ATTR = A.ARTIFACTS
#: member regions listed by name in a note (the rest are counted)
NOTE_MAX_REGIONS = 12
NOTE_MAX_TENSORS = 4

_warned: set[str] = set()
#: an optional extra that is not installed is an INFO line, not a WARNING on every default run
NOT_INSTALLED = logging.INFO


def _warn_once(key: str, message: str, level: int = logging.WARNING) -> None:
    if key not in _warned:
        _warned.add(key)
        log.log(level, message)


def artifact_store(output_dir: str | Path) -> optuna.artifacts.FileSystemArtifactStore:
    """The run's artifact store, ``OUTPUT/artifacts`` (created when missing)."""
    path = Path(output_dir) / ARTIFACT_DIR
    path.mkdir(parents=True, exist_ok=True)
    return optuna.artifacts.FileSystemArtifactStore(str(path))


# -- the note -------------------------------------------------------------------------------
def _code(text: object) -> str:
    """``text`` as inline Markdown code that survives a table cell."""
    return "`" + str(text).replace("`", "'").replace("|", "\\|") + "`"


def _tensors(tensors: list[str]) -> str:
    shown = ", ".join(_code(t) for t in tensors[:NOTE_MAX_TENSORS])
    more = len(tensors) - NOTE_MAX_TENSORS
    return shown + (f" … (+{more})" if more > 0 else "")


def _on(value: object) -> bool:
    """Whether a point's parameter value puts Q/DQ there (0/"none" is off; a mixed-precision
    study may use type indices or type names)."""
    return value not in (0, None, False, "none", "0", "")


def pattern_note(attrs: dict, metric_names: list[str] | None = None) -> str:
    """The Markdown note shown on a pattern study's page (from the study's user attrs)."""
    pid = attrs.get(A.PATTERN_ID, "?")
    regions = list(attrs.get(A.REGIONS, []))
    region_nodes = attrs.get(A.REGION_NODES) or {}
    ops = attrs.get(A.OPS, [])
    metrics = ", ".join(f"`{m}`" for m in (metric_names or ["latency_ms"]))
    rnd = int(attrs.get(A.ROUND) or 0)
    lane = f"{attrs[A.LANE]} " if attrs.get(A.LANE) else ""
    lines = [
        f"## Pattern {pid}" + (f" — {lane}descent round {rnd}" if rnd else ""),
        "",
        f"- metric: {metrics} (minimize), one trial = one Q/DQ scheme applied to all "
        f"{len(regions)} member region(s)",
        f"- ops ({len(ops)}): {' → '.join(ops) or '—'}",
        f"- signature {_code(attrs.get(A.SIGNATURE, ''))}",
    ]
    if rnd:
        start = ", ".join(_code(p) for p in attrs.get(A.FROM, [])) or "the empty scheme"
        lines.append(f"- tuned with every other pattern's standing scheme in place, starting "
                     f"from its own standing scheme ({start})")
    if A.REFERENCE_MS in attrs:
        what = ("the whole standing model, this pattern's scheme included" if rnd
                else "everything committed before this pattern")
        lines.append(f"- reference ({what}): **{float(attrs[A.REFERENCE_MS]):.4f} ms**")
    if A.BASELINE_MS in attrs:
        base = float(attrs[A.BASELINE_MS])
        lines.append(f"- baseline (the user's model): {base:.4f} ms")
    types = attrs.get(A.COMMITTED_TYPES) or {}
    if A.COMMITTED in attrs:
        on = [p for p, v in (attrs.get(A.COMMITTED) or {}).items() if _on(v)]
        gain = float(attrs.get(A.GAIN, 1.0))
        scheme = ", ".join(_code(p) + (f" ({types[p]})" if p in types else "") for p in on)
        scheme = scheme or "the empty scheme (no Q/DQ)"
        lines.append(f"- **committed**: {scheme}")
        reason = attrs.get(A.COMMIT_REASON, "")
        lines.append(f"- gain over the reference: **{gain:.3f}x** ({reason})")
        for partner, scheme in (attrs.get(A.PARTNER) or {}).items():
            on = ", ".join(_code(p) for p, v in scheme.items() if _on(v)) or "nothing"
            lines.append(f"- chain move: pattern {partner}'s scheme set to {on} with it")
        if A.CANDIDATE_TRIAL in attrs:
            lines.append(f"- candidate: trial #{attrs[A.CANDIDATE_TRIAL]}")
        if isinstance(attrs.get(A.COMMITTED_ERROR), (int, float)):
            lines.append(f"- output error after this commit: {attrs[A.COMMITTED_ERROR]:.4g}")
    else:
        lines.append("- not committed yet (the search of this pattern is running or was cut off)")

    lines += ["", f"### Member regions ({len(regions)})", ""]
    for r in regions[:NOTE_MAX_REGIONS]:
        nodes = region_nodes.get(str(r), region_nodes.get(r, []))
        lines.append(f"- region {r}: {', '.join(_code(n) for n in nodes) or '—'}")
    if len(regions) > NOTE_MAX_REGIONS:
        lines.append(f"- … and {len(regions) - NOTE_MAX_REGIONS} more")

    kinds = attrs.get(A.POINT_KINDS, {})
    committed = attrs.get(A.COMMITTED) or {}
    point_tensors = attrs.get(A.POINT_TENSORS, {})
    points = attrs.get(A.POINTS) or list(point_tensors)
    lines += ["", f"### Insertion points ({len(points)})", "",
              "Parameters of this study, one `IntDistribution(0, 1)` each; tensors over all "
              "member regions.", "",
              "| # | point | kind | tensors | committed |", "|---|---|---|---|---|"]
    for i, p in enumerate(points):
        mark = "—" if A.COMMITTED in attrs else ""
        if _on(committed.get(p, 0)):
            mark = "**Q/DQ**" + (f" {types[p]}" if p in types else "")
        lines.append(f"| p{i} | {_code(p)} | {kinds.get(p, '')} | "
                     f"{_tensors(point_tensors.get(p, []))} | {mark} |")

    artifacts = attrs.get(ARTIFACTS_ATTR) or []
    if artifacts:
        lines += ["", "### Artifacts", "",
                  "Shown below and under *Study Artifacts* on the study's main page (files of "
                  f"the run's `{ARTIFACT_DIR}/` store):", ""]
        for a in artifacts:
            lines.append(f"- {_code(a.get('file', ''))}: {a.get('what', '')}")
        for a in artifacts:
            if a.get("url"):
                lines += ["", f"![{a.get('what', a.get('file', ''))}]({a['url']})"]
    return "\n".join(lines) + "\n"


#: the least time between two drawings of the commit callback: drawing a pattern's pictures
#: and the run's note takes about a second on a 2-core CPU, and a cost-model run commits a
#: pattern every second or two (drawing each took 30 % of a small YOLO-like model's run;
#: ``benchmarks/results/run_overhead.md``)
REDRAW_S = 10.0


class PatternPictures:
    """The commit callback of a run: a pattern study's pictures and note, and the run's note,
    once decided. Drawn at most every ``every_s`` seconds; what a commit in between decided
    waits for the next drawing or :meth:`flush` (the run's end). A measured run's visits
    take longer than that, so its dashboard follows each commit."""

    def __init__(self, output_dir: str | Path, prepared: PreparedModel, *,
                 every_s: float | None = None) -> None:
        self.out = Path(output_dir)
        self.prepared = prepared
        self.every_s = REDRAW_S if every_s is None else every_s
        self._pending: dict[str, tuple[optuna.Study, PatternPoints]] = {}
        self._drawn = -math.inf

    def __call__(self, study: optuna.Study, pp: PatternPoints) -> None:
        self._pending[study.study_name] = (study, pp)
        if time.monotonic() - self._drawn >= self.every_s:
            self.flush()

    def flush(self) -> None:
        """Draw every pattern study committed since the last drawing, and the run's note."""
        pending, self._pending = self._pending, {}
        runs = {}
        for study, pp in pending.values():
            save_pattern_artifacts(study, self.out, pp, self.prepared)  # logs, never raises
            save_pattern_note(study)
            run_id = study.user_attrs.get(A.RUN_ID)
            if run_id is not None:
                runs[run_id] = storage_of(study)
        for run_id, storage in runs.items():  # the run's note follows the run as it goes
            try:
                save_run_note(storage, run_id)
            except Exception as exc:  # a note must never cost a run
                log.warning("dashboard note of run %s not saved: %s", run_id, exc)
        self._drawn = time.monotonic()


def save_pattern_note(study: optuna.Study) -> None:
    with contextlib.suppress(ImportError):
        from optuna_dashboard import save_note

        save_note(study, pattern_note(study.user_attrs, study.metric_names))


# -- artifacts ------------------------------------------------------------------------------
def _complete(study: optuna.Study) -> list:
    """COMPLETE trials with a finite latency (the first objective), by number."""
    trials = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    return sorted((t for t in trials if t.values and math.isfinite(t.values[0])),
                  key=lambda t: t.number)


def convergence_png(path: str | Path, trials: list[tuple[int, float]], *,
                    reference_ms: float | None, title: str) -> None:
    """Best-so-far latency against trial number, every trial as a dot, the reference dashed."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 3.6), dpi=100)
    # fixed margins: a tight layout draws the figure twice (a third of the picture's time)
    fig.subplots_adjust(left=0.12, right=0.98, bottom=0.14, top=0.9)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    if trials:
        xs = [n for n, _ in trials]
        ys = [v for _, v in trials]
        best, b = [], math.inf
        for v in ys:
            b = min(b, v)
            best.append(b)
        ax.scatter(xs, ys, s=14, color="#9aa5b1", label="trial", zorder=2)
        ax.step(xs, best, where="post", color="#1f6feb", linewidth=2, label="best so far", zorder=3)
    if reference_ms is not None:
        ax.axhline(reference_ms, color="#d1242f", linestyle="--", linewidth=1.2,
                   label=f"reference {reference_ms:.3f} ms")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("trial")
    ax.set_ylabel("latency (ms)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    if trials or reference_ms is not None:
        ax.legend(fontsize=8, loc="best")
    fig.savefig(str(path), format="png")


def _short(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _wrap(text: str, width: int) -> list[str]:
    import textwrap

    return textwrap.wrap(text, width, break_long_words=True, break_on_hyphens=False) or [""]


def _bezier(p0, c0, c1, p1, t: float) -> tuple[float, float]:
    u = 1 - t
    return tuple(u**3 * a + 3 * u * u * t * b + 3 * u * t * t * c + t**3 * d
                 for a, b, c, d in zip(p0, c0, c1, p1))


def region_svg(graph, nodes: list[int], point_uses: dict[str, list[tuple[str, int, int]]], *,
               chosen: set[str], committed: set[str], kinds: dict[str, str] | None = None,
               types: dict[str, str] | None = None, title: str = "") -> str:
    """An SVG picture of one region: its nodes as boxes in layers (topological order), the
    activation edges between them, the tensors entering and leaving it, and every insertion
    point as a marker on the edge(s) it covers: filled red for the points of ``chosen`` (the
    best trial), outlined for points that are offered but off. A legend lists the points."""
    return _RegionPicture(graph, nodes, point_uses, chosen=chosen, committed=committed,
                          kinds=kinds or {}, types=types or {}, title=title).svg()


def _esc(s: object) -> str:
    return html.escape(str(s), quote=True)


class _RegionPicture:
    """The layout and the SVG parts of :func:`region_svg`."""

    box_w, box_h, gap_x, gap_y, margin = 168, 42, 30, 50, 24

    def __init__(self, graph, nodes: list[int], point_uses: dict, *, chosen: set[str],
                 committed: set[str], kinds: dict[str, str], types: dict[str, str],
                 title: str) -> None:
        self.graph = graph
        self.point_uses = point_uses
        self.chosen, self.committed, self.kinds, self.types = chosen, committed, kinds, types
        self.members = list(dict.fromkeys(nodes))
        self.inside = set(self.members)
        self.order = {n: i for i, n in enumerate(self.members)}
        self.pid_of_use: dict[tuple[str, int, int], list[str]] = {}
        for pid, uses in point_uses.items():
            for u in uses:
                self.pid_of_use.setdefault(tuple(u), []).append(pid)
        self.index = {pid: i for i, pid in enumerate(point_uses)}
        self.parts: list[str] = []
        self.marks: list[str] = []
        self.lanes = {"left": 0, "right": 0}
        self._rows()
        self._layout(title)

    # -- layout --------------------------------------------------------------------------
    def _rows(self) -> None:
        """Items by row: ("in", tensor) | ("node", index) | ("out", tensor)."""
        graph, inside = self.graph, self.inside
        # layers: a node sits one below its lowest in-region producer; inputs are layer 0
        layer: dict[int, int] = {}
        ext_in: list[str] = []
        for n in self.members:
            lv = 1
            for t in graph.nodes[n].input:
                if not t or not graph.is_activation(t):
                    continue
                p = graph.producer.get(t)
                if p is not None and p[0] in inside:
                    lv = max(lv, layer[p[0]] + 1)
                elif t not in ext_in:
                    ext_in.append(t)
            layer[n] = lv
        self.ext_out: list[str] = []
        for n in self.members:
            for t in graph.nodes[n].output:
                if t and (t in graph.graph_outputs
                          or any(c not in inside for c, _ in graph.consumers.get(t, []))):
                    self.ext_out.append(t)
        self.last = max(layer.values(), default=0) + 1
        self.rows: dict[int, list[tuple[str, object]]] = {0: [("in", t) for t in ext_in]}
        for n in self.members:
            self.rows.setdefault(layer[n], []).append(("node", n))
        self.rows[self.last] = [("out", t) for t in self.ext_out]
        self.row_of = {it: r for r, its in self.rows.items() for it in its}

    def source(self, t: str) -> tuple[str, object]:
        p = self.graph.producer.get(t)
        return ("node", p[0]) if p is not None and p[0] in self.inside else ("in", t)

    def _bary(self, item) -> float:
        """The mean x of an item's sources (one barycentre pass keeps crossings down)."""
        kind, key = item
        if kind == "node":
            srcs = [self.source(t) for t in self.graph.nodes[key].input if t]
        else:
            srcs = [self.source(key)]
        xs = [self.pos[s][0] for s in srcs if s in self.pos]
        return sum(xs) / len(xs) if xs else self.order.get(key, 0) * 1e-3

    def _layout(self, title: str) -> None:
        box_w, box_h, gap_x, gap_y, margin = (self.box_w, self.box_h, self.gap_x, self.gap_y,
                                              self.margin)
        widest = max((len(v) for v in self.rows.values()), default=1)
        self.width = max(margin * 2 + widest * box_w + (widest - 1) * gap_x + 120, 720)
        self.title_lines = _wrap(title, int((self.width - 2 * margin) / 7.6)) if title else []
        top = margin + 18 * len(self.title_lines) + (10 if self.title_lines else 0)
        self.pos: dict[tuple[str, object], tuple[float, float]] = {}
        for r in sorted(self.rows):
            items = self.rows[r]
            if r > 0:
                items.sort(key=self._bary)
            row_w = len(items) * box_w + (len(items) - 1) * gap_x
            x0 = (self.width - row_w) / 2
            for i, item in enumerate(items):
                self.pos[item] = (x0 + i * (box_w + gap_x) + box_w / 2, top + r * (box_h + gap_y))
        self.graph_h = top + self.last * (box_h + gap_y) + box_h + 16

    def row_extent(self, r: int) -> tuple[float, float]:
        xs = [self.pos[it][0] for it in self.rows.get(r, [])]
        if not xs:
            return self.width / 2, self.width / 2
        return min(xs) - self.box_w / 2, max(xs) + self.box_w / 2

    # -- parts ---------------------------------------------------------------------------
    def mark(self, x: float, y: float, pids: list[str]) -> None:
        index, chosen = self.index, self.chosen
        on = [p for p in pids if p in chosen]
        label = ",".join(f"p{index[p]}" for p in pids)
        tip = "; ".join(f"p{index[p]} {p}: {'Q/DQ' if p in chosen else 'off'}" for p in pids)
        w = max(30, 7 * len(label) + 10)
        if on:
            style, text_fill, cls = 'fill="#d1242f" stroke="#82071e"', "#ffffff", "qdq on"
        else:
            style = 'fill="#ffffff" stroke="#8c959f" stroke-dasharray="3,2"'
            text_fill, cls = "#57606a", "qdq off"
        self.marks.append(
            f'<g class="{cls}"><title>{_esc(tip)}</title>'
            f'<rect x="{x - w / 2:.1f}" y="{y - 9:.1f}" width="{w}" height="18" rx="9" {style}/>'
            f'<text x="{x:.1f}" y="{y + 4:.1f}" text-anchor="middle" font-size="11" '
            f'fill="{text_fill}">{_esc(label)}</text></g>')

    def edge(self, src: tuple, dst: tuple, dx: float, tensor: str, pids: list[str]) -> None:
        x1, y1 = self.pos[src]
        x2, y2 = self.pos[dst]
        y1 += self.box_h / 2
        y2 -= self.box_h / 2
        x2 += dx
        r1, r2 = self.row_of[src], self.row_of[dst]
        if r2 - r1 > 1:  # around the rows in between, in a lane of its own
            lo = min(self.row_extent(r)[0] for r in range(r1 + 1, r2))
            hi = max(self.row_extent(r)[1] for r in range(r1 + 1, r2))
            side = "left" if (x1 + x2) / 2 < self.width / 2 else "right"
            self.lanes[side] += 1
            lane = lo - 16 * self.lanes[side] if side == "left" else hi + 16 * self.lanes[side]
            ya, yb = y1 + self.gap_y / 2, y2 - self.gap_y / 2
            d = (f"M{x1:.1f},{y1:.1f} C{x1:.1f},{ya:.1f} {lane:.1f},{y1:.1f} {lane:.1f},{ya:.1f} "
                 f"L{lane:.1f},{yb:.1f} ")
            last_seg = ((lane, yb), (lane, y2), (x2, yb), (x2, y2))
        else:
            cy = (y2 - y1) * 0.5
            d = f"M{x1:.1f},{y1:.1f} "
            last_seg = ((x1, y1), (x1, y1 + cy), (x2, y2 - cy), (x2, y2))
        _, c0, c1, p1 = last_seg
        d += f"C{c0[0]:.1f},{c0[1]:.1f} {c1[0]:.1f},{c1[1]:.1f} {p1[0]:.1f},{p1[1]:.1f}"
        on = any(p in self.chosen for p in pids)
        color, w, arrow = ("#d1242f", 2.6, "arrow-on") if on else ("#57606a", 1.3, "arrow")
        self.parts.append(
            f'<path class="edge{" qdq-edge" if on else ""}" d="{d}" fill="none" '
            f'stroke="{color}" stroke-width="{w}" marker-end="url(#{arrow})">'
            f"<title>{_esc(tensor)}</title></path>")
        if pids:  # the pair sits on the tensor just before the consumer
            if r2 - r1 > 1:  # on the lane, staggered: neighbouring lanes' marks don't collide
                bx, by = last_seg[0][0], last_seg[0][1] - 8 - 22 * ((self.lanes[side] - 1) % 3)
            else:
                bx, by = _bezier(*last_seg, 0.6)
            self.mark(bx, by, pids)

    def _edges(self) -> None:
        graph = self.graph
        for n in self.members:  # one edge per activation input slot of each node
            ins = [(s, t) for s, t in enumerate(graph.nodes[n].input)
                   if t and graph.is_activation(t)]
            ins.sort(key=lambda st: self.pos[self.source(st[1])][0])  # entries like the sources
            for k, (slot, t) in enumerate(ins):
                dx = (k - (len(ins) - 1) / 2) * 44
                self.edge(self.source(t), ("node", n), dx, t,
                          self.pid_of_use.get((t, n, slot), []))
        for t in self.ext_out:  # tensors leaving the region: outside uses carry RegionOutputs
            outside = [(t, c, s) for c, s in graph.consumers.get(t, []) if c not in self.inside]
            pids = sorted({pid for u in outside for pid in self.pid_of_use.get(u, [])},
                          key=self.index.get)
            self.edge(self.source(t), ("out", t), 0.0, t, pids)

    def _boxes(self) -> list[str]:
        box_w, box_h = self.box_w, self.box_h
        boxes: list[str] = []
        for item, (cx, cy) in self.pos.items():
            kind, key = item
            x, y = cx - box_w / 2, cy - box_h / 2
            if kind == "node":
                nd = self.graph.nodes[key]
                name = self.graph.name_of(key)
                boxes.append(
                    f'<g class="node"><title>{_esc(name)} ({_esc(nd.op_type)})</title>'
                    f'<rect x="{x:.1f}" y="{y:.1f}" width="{box_w}" height="{box_h}" rx="5" '
                    f'fill="#ddf4ff" stroke="#0969da"/>'
                    f'<text x="{cx:.1f}" y="{cy - 3:.1f}" text-anchor="middle" font-size="13" '
                    f'font-weight="bold" fill="#0a3069">{_esc(nd.op_type)}</text>'
                    f'<text x="{cx:.1f}" y="{cy + 13:.1f}" text-anchor="middle" font-size="10" '
                    f'fill="#57606a">{_esc(_short(name, 28))}</text></g>')
            else:
                label = ("in: " if kind == "in" else "out: ") + _short(str(key), 22)
                boxes.append(
                    f'<g class="tensor {kind}"><title>{_esc(key)}</title>'
                    f'<rect x="{x + 8:.1f}" y="{y + 8:.1f}" width="{box_w - 16}" '
                    f'height="{box_h - 16}" rx="13" fill="#f6f8fa" stroke="#8c959f"/>'
                    f'<text x="{cx:.1f}" y="{cy + 4:.1f}" text-anchor="middle" font-size="11" '
                    f'fill="#24292f">{_esc(label)}</text></g>')
        return boxes

    def _legend(self) -> tuple[list[str], float]:
        """The legend's lines, and the picture's height below it."""
        margin, chosen, types = self.margin, self.chosen, self.types
        pre = 'xml:space="preserve" style="white-space:pre"'
        legend = [f'<text x="{margin}" y="{self.graph_h:.1f}" font-size="13" font-weight="bold" '
                  f'fill="#24292f">Insertion points: red = Q/DQ in the trial shown, '
                  f'* = committed, grey = off</text>']
        y = self.graph_h + 20
        state_w = 7 + max((len(types.get(p, "")) + 1 for p in chosen), default=0)
        for pid, uses in self.point_uses.items():
            tensors = sorted({u[0] for u in uses})
            state = "off"
            if pid in chosen:
                state = " ".join(x for x in ("Q/DQ", types.get(pid, ""),
                                             "*" if pid in self.committed else "") if x)
            color = "#d1242f" if pid in chosen else "#57606a"
            text = (f"{'p' + str(self.index[pid]):<4}{state:<{state_w}} {pid}  "
                    f"[{self.kinds.get(pid, '')}]  {_short(', '.join(tensors), 70)}")
            legend.append(f'<text x="{margin}" y="{y:.1f}" font-size="11" fill="{color}" '
                          f'font-family="monospace" {pre}>{_esc(text)}</text>')
            y += 16
        return legend, y + margin - 10

    def svg(self) -> str:
        self._edges()
        boxes = self._boxes()
        legend, height = self._legend()
        width, margin = self.width, self.margin
        head = "".join(
            f'<text x="{margin}" y="{margin + 8 + 18 * i}" font-size="13" font-weight="bold" '
            f'fill="#24292f">{_esc(line)}</text>' for i, line in enumerate(self.title_lines))
        arrow = ('<marker id="{id}" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="9" '
                 'markerHeight="9" markerUnits="userSpaceOnUse" orient="auto">'
                 '<path d="M0,0 L10,5 L0,10 z" fill="{c}"/></marker>')
        return (
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
            f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="Helvetica, Arial, sans-serif">'
            f'<defs>{arrow.format(id="arrow", c="#57606a")}'
            f'{arrow.format(id="arrow-on", c="#d1242f")}'
            f'</defs><rect width="100%" height="100%" fill="#ffffff"/>{head}'
            + "".join(self.parts) + "".join(boxes) + "".join(self.marks) + "".join(legend)
            + "</svg>\n"
        )


def save_pattern_artifacts(study: optuna.Study, output_dir: str | Path, pp: PatternPoints,
                           prepared: PreparedModel) -> list[dict]:
    """Draw and upload a pattern's convergence curve and region picture to the run's artifact
    store, and list them in the study's ``artifacts`` user attr. Never raises: a failure is
    logged as a warning and the run goes on (each picture on its own)."""
    try:
        return _save_pattern_artifacts(study, Path(output_dir), pp, prepared)
    except Exception as exc:  # the pictures must never cost a run
        log.warning("dashboard artifacts for %s not saved: %s: %s", study.study_name,
                    type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return []


def _warn(study: optuna.Study, what: str, exc: BaseException) -> None:
    first = str(exc).splitlines()[0] if str(exc) else ""
    log.warning("dashboard artifact %s for %s not saved: %s: %s", what, study.study_name,
                type(exc).__name__, first)


def _best_trial(study: optuna.Study, complete: list):
    """The trial whose scheme the picture shows: the commit rule's candidate, else the fastest."""
    if not complete:
        return None
    by_number = {t.number: t for t in complete}
    candidate = study.user_attrs.get(A.CANDIDATE_TRIAL)
    if candidate in by_number:
        return by_number[candidate]
    return min(complete, key=lambda t: (t.values[0], t.number))


def _save_pattern_artifacts(study, out: Path, pp, prepared) -> list[dict]:
    from optuna.artifacts import upload_artifact

    started = time.perf_counter()
    attrs = study.user_attrs
    rnd = int(attrs.get(A.ROUND) or 0)
    lane = attrs.get(A.LANE) or ""
    pid = pp.pattern.id + (f"_{lane + '_' if lane else ''}round{rnd}" if rnd else "")  # file names
    complete = _complete(study)
    best = _best_trial(study, complete)
    ref = attrs.get(A.REFERENCE_MS)
    committed = {p for p, v in (attrs.get(A.COMMITTED) or {}).items() if _on(v)}
    chosen = {p for p, v in best.params.items() if _on(v)} if best is not None else set()
    types = dict(attrs.get(A.COMMITTED_TYPES) or {})
    if best is not None:  # a mixed-precision study names the type in the parameter
        types.update({p: v for p, v in best.params.items() if isinstance(v, str) and _on(v)})
    store = artifact_store(out)
    made: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="qdq-artifacts-") as tmp:
        files: list[tuple[Path, str]] = []
        png = Path(tmp) / f"{pid}_convergence.png"
        try:
            best_txt = (f"trial #{best.number}: {best.values[0]:.4f} ms" if best is not None
                        else "no trial finished")
            convergence_png(png, [(t.number, float(t.values[0])) for t in complete],
                            reference_ms=ref, title=f"{study.study_name}, {best_txt}")
            files.append((png, "convergence: best-so-far latency per trial vs the reference"))
        except ImportError:
            _warn_once("matplotlib", "matplotlib is not installed: no convergence curves in "
                       f"the dashboard ({install_hint('dashboard')})", NOT_INSTALLED)
        except Exception as exc:
            _warn(study, png.name, exc)
        rep = pp.pattern.representative
        svg = Path(tmp) / f"{pid}_region.svg"
        who = f"trial #{best.number}" if best is not None else "no trial"
        try:
            svg.write_text(region_svg(
                prepared.graph, prepared.tree[rep].all_nodes,
                {p: pp.resolved[p].get(rep, []) for p in pp.ids},
                chosen=chosen, committed=committed, kinds={p.id: p.kind for p in pp.points},
                types=types,
                title=f"{study.study_name}: region {rep} (1 of {len(pp.pattern.regions)} "
                      f"members), Q/DQ of {who}. Committed: "
                      f"{', '.join(sorted(committed)) or 'the empty scheme'}.",
            ), encoding="utf-8")
            files.append((svg, f"region {rep} with the Q/DQ of {who} marked"))
        except Exception as exc:
            _warn(study, svg.name, exc)
        for path, what in files:
            try:
                artifact_id = upload_artifact(artifact_store=store, file_path=str(path),
                                              study_or_trial=study)
            except Exception as exc:
                _warn(study, path.name, exc)
                continue
            made.append({"file": path.name, "artifact_id": artifact_id, "what": what,
                         "url": f"/artifacts/{study_id(study)}/{artifact_id}"})
    if made:
        study.set_user_attr(ARTIFACTS_ATTR, made)
    log.debug("%s: artifacts in %.3f s", study.study_name, time.perf_counter() - started)
    return made


# -- the run's overview ------------------------------------------------------------------------
def _study_rows(storage, run_id: str) -> list[dict]:
    """Per pattern study of the run, in search order: what the overview lists."""
    from qdq_optuna.record import studies_in_order

    rows = []
    for study, attrs in studies_in_order(storage, run_id):
        complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        on = [p for p, v in (attrs.get(A.COMMITTED) or {}).items() if _on(v)]
        rows.append({"name": study.study_name, "pattern": attrs.get(A.PATTERN_ID, "?"),
                     "round": int(attrs.get(A.ROUND) or 0), "lane": attrs.get(A.LANE) or "",
                     "trials": len(complete),
                     "points": len(attrs.get(A.POINTS) or []),
                     "decided": A.COMMITTED in attrs, "on": on,
                     "gain": float(attrs.get(A.GAIN, 1.0)),
                     "reason": attrs.get(A.COMMIT_REASON) or ""})
    return rows


def _phase_lines(rows: list[dict], phases: dict | None, report: dict | None) -> list[str]:
    """The run's phases as a table (what each did, its trials) and what was measured."""
    r = report or {}
    lines = ["### Phases", "", "| phase | what | trials |", "|---|---|---|",
             f"| baseline | {r.get('baseline_model') or 'the model without Q/DQ'}, timed once "
             "for all workers | — |"]
    starts = r.get("starts") or []
    if starts:
        chosen = next((s["name"] for s in starts if s.get("chosen")), "none")
        feasible = sum(1 for s in starts if s.get("feasible"))
        lines.append(f"| starts | {len(starts)} whole-model placements measured "
                     f"({', '.join(s['name'] for s in starts)}), {feasible} within the accuracy "
                     f"bound; the standing model starts from **{chosen}** | — |")
    for lane in dict.fromkeys(row["lane"] for row in rows):
        for rnd in sorted({row["round"] for row in rows if row["lane"] == lane}):
            its = [row for row in rows if row["lane"] == lane and row["round"] == rnd]
            moved = sum(1 for row in its if row["gain"] != 1.0)
            name = (f"descent round {rnd}" if rnd else "pattern studies") + (
                f" (lane {lane})" if lane else "")
            lines.append(f"| {name} | {len(its)} visits, {sum(row['decided'] for row in its)} "
                         f"decided, {moved} changed the standing model (their gains multiply to "
                         f"{math.prod(row['gain'] for row in its):.3f}x) | "
                         f"{sum(row['trials'] for row in its)} |")
    if len((r.get("descent") or {}).get("lanes") or {}) > 1:
        lines.append(f"| lanes | the lanes' standing models compared; "
                     f"{_code(r['descent']['shipped'])} ships | — |")
    lines.append("| final | the accuracy guard, then `optimized.onnx` timed against the "
                 "baseline (interleaved A/B) | — |")
    if phases:
        counted = ", ".join(f"{k} {v}" for k, v in phases.items() if v)
        lines += ["", f"Measurements (times the backend was asked to time a model) by the "
                      f"process that finished the run: {counted}; {sum(phases.values())} in "
                      "all."]
    return lines


def _accuracy_lines(acc: dict) -> list[str]:
    from qdq_optuna.accuracy_words import data_phrase

    worst = min((e.get("cosine", 1.0) for e in acc.get("output_errors", {}).values()),
                default=1.0)
    lines = ["### Accuracy", "",
             f"Output error of `optimized.onnx` vs FP32 ({acc['measure']}, worst output): "
             f"**{acc['error']:.4g}** (cosine {worst:.4f}), measured on "
             f"{data_phrase(acc['data'])}; bound {acc['bound']:g} ({acc['bound_from']}): "
             f"**{acc['status']}**."]
    if acc.get("responsible_tensors"):
        lines += ["", f"The tuned placement's error was {acc['tuned_error']:.4g}: Q/DQ on "
                      + ", ".join(_code(t) for t in acc["responsible_tensors"])
                      + f" broke the bound, so `optimized.onnx` is the {acc['shipped']}."]
    return lines


def run_note(run_id: str, baseline_ms: float | None, rows: list[dict], *,
             report: dict | None = None, phases: dict | None = None,
             picture: dict | None = None) -> str:
    """The Markdown note of the run study: the run at a glance (``report``: once finished)."""
    r = report or {}
    state = ("running" if report is None else "finished" if r.get("complete")
             else "stopped by its timeout")
    lines = [f"## Run {run_id} — {state}", ""]
    if report is not None:
        hp = r.get("high_precision") or {}
        lines += [f"- model {_code(r.get('model'))}, backend {_code(r['backend'].get('name'))} "
                  f"(rules: {r.get('runtime')}), quant type {r.get('quant_type')}, high "
                  f"precision {hp.get('precision', 'fp32')}",
                  f"- output folder {_code(r.get('output'))}", "",
                  "| | latency (ms) |", "|---|---|",
                  f"| baseline (no Q/DQ) | {r['baseline_latency_ms']:.4f} |",
                  f"| tuned (`optimized.onnx`) | {r['final_latency_ms']:.4f} |", ""]
        lo, hi = r["speedup_ci"]
        lines += [f"**Speedup {r['speedup']:.3f}x** ({int(r['speedup_confidence'] * 100)} % "
                  f"interval {lo:.3f}–{hi:.3f}; interleaved re-measurement of the saved model "
                  f"against the baseline)", ""]
        if r.get("accuracy"):
            lines += _accuracy_lines(r["accuracy"]) + [""]
    else:
        so_far = math.prod(row["gain"] for row in rows)
        lines += [f"- baseline: {baseline_ms:.4f} ms" if baseline_ms else
                  "- baseline: not measured yet",
                  f"- {sum(row['decided'] for row in rows)} of {len(rows)} visits decided so "
                  f"far; their gains over the start multiply to {so_far:.3f}x (the search's "
                  "estimate; the final figure is measured when the run ends)", ""]
    if rows:
        lines += _phase_lines(rows, phases, report) + [""]
        lines += ["### Pattern studies", "", "| visit | trials | standing scheme | gain | note |",
                  "|---|---|---|---|---|"]
        for row in rows:
            scheme = ", ".join(_code(p) for p in row["on"][:NOTE_MAX_TENSORS])
            more = len(row["on"]) - NOTE_MAX_TENSORS
            scheme = (scheme + (f" … (+{more})" if more > 0 else "")) or "—"
            lines.append(f"| {_code(row['name'])} | {row['trials']} | "
                         f"{scheme if row['decided'] else 'running'} | {row['gain']:.3f}x | "
                         f"{row['reason'].replace('|', '/')} |")
        lines.append("")
    if picture:
        lines += ["### The whole run", "", f"![whole-run convergence]({picture['url']})", "",
                  "Speedup over the baseline of the fastest whole model within the accuracy "
                  "bound measured so far, after each measurement (the starts, then every "
                  "visit's trials); the final A/B's figure and interval on the right.", ""]
    lines += ["---", "",
              f"Visits: {_code(run_id + '/P000/round1')} and on (one study per pattern, round "
              f"and lane); starts: {_code(run_id + '/_starts')}; bookkeeping: "
              f"{_code(run_id + '/_run')}."
              + ("" if report is not None else
                 f" When the run finishes, its overview is the study {_code(run_id)}.")]
    return "\n".join(lines) + "\n"


def run_convergence_png(path: str | Path, curve: list[list[float]], *, title: str,
                        final: tuple[float, float | None, float | None] | None) -> None:
    """The whole run's progress curve (speedup estimate against measurements) and the final
    A/B's speedup with its interval."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(6.4, 3.6), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    xs = [c[0] for c in curve]
    ax.step(xs, [c[1] for c in curve], where="post", color="#1f6feb", linewidth=2,
            label="fastest feasible model so far")
    ax.axhline(1.0, color="#57606a", linestyle=":", linewidth=1, label="baseline")
    if final is not None:
        speedup, lo, hi = final
        x = xs[-1] if xs else 0
        yerr = None
        if lo is not None and hi is not None:
            yerr = [[max(speedup - lo, 0.0)], [max(hi - speedup, 0.0)]]
        ax.errorbar([x], [speedup], yerr=yerr, fmt="o", color="#d1242f", capsize=4,
                    label=f"final A/B {speedup:.3f}x")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("measurements")
    ax.set_ylabel("speedup over the baseline")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(str(path), format="png")


def bookkeeping_note(run_id: str) -> str:
    """The note of a finished run's bookkeeping study (``RUN/_run``)."""
    return (f"## Bookkeeping of run {run_id}\n\nThe run's overview is the study "
            f"{_code(run_id)}. This study holds what the run's workers agreed on (the baseline, "
            "the starts, each visit's reference, each commit, the lane that ships: its trials, "
            "stored without values) and, in its system attrs, the settings, the starts and "
            "every model measured.\n")


def save_run_note(storage, run_id: str) -> None:
    """While the run runs: its progress as the note of its bookkeeping study (the only
    run-level study until it finishes). Needs optuna-dashboard; nothing without it."""
    try:
        from optuna_dashboard import save_note
    except ImportError:
        return
    from qdq_optuna.record import RunAttr, run_study_name

    run_study = optuna.load_study(study_name=run_study_name(run_id), storage=storage)
    baseline = run_study.user_attrs.get(RunAttr.BASELINE_MS)
    save_note(run_study, run_note(run_id, baseline, _study_rows(storage, run_id)))


def save_run_overview(record, output_dir: str | Path, report: dict, phases: dict | None) -> None:
    """At the end of a run: the overview study (its small user attrs, the whole-run picture
    uploaded once per curve, its note) and the bookkeeping study's note. Never raises: a
    failure is one warning, the run stands."""
    try:
        _save_run_overview(record, Path(output_dir), report, phases)
    except Exception as exc:  # the overview must never cost a run
        log.warning("dashboard overview of run %s not saved: %s: %s", record.run_id,
                    type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")


def _save_run_overview(record, out: Path, report: dict, phases: dict | None) -> None:
    from qdq_optuna.record import OverviewAttr as O

    view = record.overview_study()
    acc = report.get("accuracy") or {}
    for key, value in ((O.RUN_ID, record.run_id),
                       (O.STATUS, "finished" if report.get("complete") else "timeout"),
                       (O.BASELINE_MS, report["baseline_latency_ms"]),
                       (O.FINAL_MS, report["final_latency_ms"]),
                       (O.SPEEDUP, round(float(report["speedup"]), 4)),
                       (O.ACCURACY, acc.get("status"))):
        view.set_user_attr(key, value)
    picture = _run_picture(record, view, out, report)
    try:
        from optuna_dashboard import save_note
    except ImportError:
        return
    save_note(view, run_note(record.run_id, None, _study_rows(record.storage, record.run_id),
                             report=report, phases=phases, picture=picture))
    save_note(record.run_study, bookkeeping_note(record.run_id))


def _run_picture(record, view: optuna.Study, out: Path, report: dict) -> dict | None:
    """The whole-run convergence picture as an artifact of the overview study (the one
    uploaded before when the curve and the final figure are the same)."""
    import hashlib
    import json

    from optuna.artifacts import upload_artifact

    from qdq_optuna.record import OverviewAttr, progress_curve, set_system_attr, study_system_attrs

    curve = progress_curve(record.storage, record.run_id)["curve"]
    lo, hi = report["speedup_ci"]
    final = (report["speedup"], lo, hi)
    digest = hashlib.sha256(json.dumps([curve, final]).encode()).hexdigest()[:16]
    stored = study_system_attrs(view).get(OverviewAttr.PICTURE)
    if stored and stored.get("digest") == digest:
        return stored
    with tempfile.TemporaryDirectory(prefix="qdq-artifacts-") as tmp:
        png = Path(tmp) / "run_convergence.png"
        try:
            run_convergence_png(png, curve, final=final,
                                title=f"run {record.run_id}: {report['speedup']:.3f}x")
        except ImportError:
            _warn_once("matplotlib", "matplotlib is not installed: no convergence curves in "
                       f"the dashboard ({install_hint('dashboard')})", NOT_INSTALLED)
            return None
        artifact_id = upload_artifact(artifact_store=artifact_store(out), file_path=str(png),
                                      study_or_trial=view)
    picture = {"file": "run_convergence.png", "artifact_id": artifact_id, "digest": digest,
               "url": f"/artifacts/{study_id(view)}/{artifact_id}"}
    set_system_attr(view, OverviewAttr.PICTURE, picture)
    return picture


# -- the server -----------------------------------------------------------------------------
def _server_classes(host: str):
    from socketserver import ThreadingMixIn
    from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

    class Server(ThreadingMixIn, WSGIServer):
        daemon_threads = True
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

    class QuietHandler(WSGIRequestHandler):
        def log_message(self, format: str, *args) -> None:  # noqa: A002 - the stdlib's name
            pass

    return Server, QuietHandler


def serve(output_dir: str | Path, *, host: str = "127.0.0.1", port: int = 8080,
          storage: str | None = None) -> None:
    """Serve the run's studies and artifacts with optuna-dashboard until Ctrl-C.

    ``port=0`` picks a free port; the URL printed names the port actually bound."""
    try:
        from optuna_dashboard import wsgi
    except ImportError:
        raise UserError("the dashboard needs optuna-dashboard: "
                        f"{install_hint('dashboard')}") from None
    from wsgiref.simple_server import make_server

    from qdq_optuna.record.storage import default_storage_url, open_storage, quiet_optuna

    out = Path(output_dir)
    if not out.is_dir():
        raise UserError(f"{out}: no such output folder")
    if storage is None:
        db = out / STUDIES_DB
        if not db.is_file():
            raise UserError(f"{out}: no studies.db here (pass --storage URL for another storage)")
        storage = default_storage_url(out)
    if not 0 <= port <= 65535:
        raise UserError(f"--port {port}: expected 0 (any free port) to 65535")
    quiet_optuna(False)
    rdb = open_storage(storage, heartbeat=False)
    try:
        store = artifact_store(out)
    except OSError as exc:
        log.warning("%s: no artifact store (%s); pictures will not show", out / ARTIFACT_DIR,
                    exc.strerror or exc)
        store = None
    app = wsgi(rdb, artifact_store=store)
    server_cls, handler_cls = _server_classes(host)
    try:
        httpd = make_server(host, port, app, server_class=server_cls, handler_class=handler_cls)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise UserError(f"--port {port}: {host}:{port} is already in use (pick another "
                            "--port, or --port 0 for any free one)") from None
        if exc.errno in (errno.EACCES, errno.EPERM):
            raise UserError(f"--port {port}: not allowed to bind {host}:{port} "
                            "(ports below 1024 need privileges)") from None
        raise UserError(f"--host {host}: cannot listen on {host}:{port} "
                        f"({exc.strerror or exc})") from None
    bound = httpd.server_port
    shown = f"[{host}]" if ":" in host else host
    print(f"optuna-dashboard: http://{shown}:{bound}/dashboard  (Ctrl-C to stop)", flush=True)
    if host not in ("127.0.0.1", "localhost", "::1"):
        print(f"qdq-optuna: note: listening on {host}, reachable from other machines; "
              "optuna-dashboard has no authentication", file=sys.stderr, flush=True)
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        httpd.server_close()
