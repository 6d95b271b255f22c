"""report.md's "Where the time went": each phase's wall time (report.json ``wall_time``)
next to what it decided, read from the report's own keys (the starts, the descent, the recipe
file, the final A/B), so a phase that spent minutes and decided nothing shows as such."""

from __future__ import annotations

#: the phases in the order a run passes them, and how the table names them
PHASE_NAMES = {"preparing": "preparing", "baseline": "baseline", "starts": "starts",
               "descent": "descent", "lanes": "which lane ships", "guard": "accuracy guard",
               "recipe_file": "recipe file A/B", "session_settings": "session settings A/B",
               "final": "final A/B", "finish": "finish"}


def _f(x, fmt: str = "{:.3f}") -> str:
    return "—" if x is None else fmt.format(x)


def _starts(r: dict) -> str:
    starts = r.get("starts") or []
    chosen = next((s["name"] for s in starts if s.get("chosen")), "float")
    measured = sum(1 for s in starts if s.get("latency_ms") is not None)
    return f"{measured} measured, best = {chosen}"


def _recipe_file(r: dict) -> str:
    rf = r.get("recipe_file") or {}
    if not rf:
        return "no recipe file"
    if rf.get("failure"):
        return "not measured"
    return "the recipe file ships" if rf.get("shipped") else "the tuned model ships"


def _session_settings(r: dict) -> str:
    ss = r.get("session_settings") or {}
    if not ss.get("candidates"):
        return "none tried"
    shipped = ss.get("shipped")
    return f"ships with {shipped['name']}" if shipped else "the runtime's defaults ship"


def decided(phase: str, r: dict) -> str:
    """What ``phase`` decided, in words, from report.json ``r`` (nothing for a phase that
    decides nothing of its own)."""
    words = _DECIDED.get(phase)
    return words(r) if words is not None else ""


def _descent(r: dict) -> str:
    lanes = (r.get("descent") or {}).get("lanes") or {}
    if not lanes:
        return "not run"
    visits = sum(v["visits"] for v in lanes.values())
    commits = sum(v["changed"] for v in lanes.values())
    gain = max((v["gain"] for v in lanes.values()), default=1.0)
    skips = r.get("descent_skipped") or []
    from qdq_optuna.search import NOT_EXPECTED_PREFIX  # skipped by the lane's score

    expected = sum(1 for s in skips if s["reason"].startswith(NOT_EXPECTED_PREFIX))
    noise = sum(1 for s in skips if "within noise" in s["reason"]) - expected
    text = (f"{visits} visits, {commits} commit{'s' if commits != 1 else ''}, "
            f"gain {gain:.3f}x")
    if len(skips) > noise + expected:
        text += f"; {len(skips) - noise - expected} skipped by the runtime's report"
    if noise:
        text += f"; {noise} skipped: gap within noise"
    if expected:
        text += (f"; {expected} skipped: gap expected within noise by what the lane's "
                 "visits realized")
    return text


def time_spent_lines(r: dict) -> list[str]:
    """The "Where the time went" table (nothing when the report has no ``wall_time``)."""
    wall = r.get("wall_time") or {}
    if not wall:
        return []
    total = sum(p["seconds"] for p in wall.values())
    lines = ["## Where the time went", "",
             f"{total:.0f} s in all (wall time of this process; sessions: fresh timing "
             "sessions created, with their creation and timed-run seconds).", "",
             "| phase | seconds | sessions | what it decided | steps |",
             "|---|---|---|---|---|"]
    for phase, p in wall.items():
        t = p.get("timing") or {}
        sessions = (f"{t['loads']} ({_f(t.get('load_s'), '{:.1f}')} s + "
                    f"{_f(t.get('timing_s'), '{:.1f}')} s)" if t.get("loads") else "—")
        steps = ", ".join(f"{k} {v:.1f} s" for k, v in (p.get("steps") or {}).items()
                          if v >= 0.05)
        lines.append(f"| {PHASE_NAMES.get(phase, phase)} | {p['seconds']:.1f} | {sessions} | "
                     f"{decided(phase, r) or '—'} | {steps or '—'} |")
    return lines + [""]


#: each phase's decision in words, from report.json
_DECIDED = {
    "preparing": lambda r: f"{len(r.get('patterns') or [])} patterns to tune",
    "baseline": lambda r: f"baseline {_f(r.get('in_search_baseline_latency_ms'), '{:.4g}')} ms",
    "starts": _starts,
    "descent": lambda r: _descent(r),
    "lanes": lambda r: f"ships lane {(r.get('descent') or {}).get('shipped', 'main')}",
    "recipe_file": _recipe_file,
    "session_settings": _session_settings,
    "final": lambda r: f"speedup {_f(r.get('speedup'))}x",
}
