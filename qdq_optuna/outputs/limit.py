"""report.md's "The limit": the measured estimate of the fastest this model runs on this
runtime and machine (report.json ``limit``, from the run's kernel table), the shipped model's
gap to it, and where that gap is (by op type and pattern, and the rest no timed kernel
explains: ops outside the table, conversions)."""

from __future__ import annotations


def final_terms(r: dict) -> dict | None:
    """The limit in the final A/B's terms: its baseline less what the timed kernels save at
    their faster kernel (ms, as timed); the shipped model's gap to it; what the timed kernels
    explain of it."""
    lim = r.get("limit")
    base, tuned = r.get("baseline_latency_ms"), r.get("final_latency_ms")
    if not lim or lim.get("float_ms") is None or not base or not tuned:
        return None
    limit_ms = base - (lim["float_ms"] - lim["limit_ms"])
    if limit_ms <= 0:
        return None
    explained = sum(lim["gap_by_op"].values())
    return {"limit_ms": limit_ms, "tuned_ms": tuned, "gap": tuned / limit_ms - 1.0,
            "explained_ms": explained, "rest_ms": tuned - limit_ms - explained, "scale": 1.0}


def limit_lines(r: dict) -> list[str]:
    """The section (nothing without a kernel table: a deterministic backend, or no descent)."""
    t = final_terms(r)
    if t is None:
        return []
    lim = r["limit"]
    lines = ["## The limit", "",
             f"Estimated fastest on this runtime and machine: **{t['limit_ms']:.4g} ms** "
             f"({lim['timed_nodes']} nodes at their faster measured kernel"
             + (": " + ", ".join(f"{n} {op}" for op, n in lim["timed_by_op"].items())
                if lim.get("timed_by_op") else "")
             + (f"; {lim['conversions']} standalone Q/DQ their kernels need next to float "
                f"ops and the model's ends, {lim['conversions_ms']:.3g} ms"
                if lim.get("conversions") else "")
             + (f", {len(lim['kept_for_conversions'])} node(s) kept off their faster kernel "
                "to spare conversions" if lim.get("kept_for_conversions") else "")
             + "; every other op at its float time); the shipped model measured "
             f"{t['tuned_ms']:.4g} ms, **{t['gap']:+.1%}** from it. " + (
                 f"Of that, {t['explained_ms']:.3g} ms is timed kernels placed at their slower "
                 "kernel and conversions beyond the limit's, "
                 f"{t['rest_ms']:.3g} ms is outside the kernel table (ops without a "
                 "timed kernel, conversions next to them, how the kernels run together)."
                 if t["gap"] >= 0
                 else "It measured faster than the estimate: the kernels timed alone and the "
                 "whole models timed together disagree (a machine busy with other work, or "
                 "kernels that run faster inside the whole model), so the estimate is not a "
                 "bound here."), ""]
    if lim["gap_by_op"]:
        lines += ["| where | gap (ms) |", "|---|---|"]
        lines += [f"| op {op} | {ms * t['scale']:.3g} |" for op, ms in lim["gap_by_op"].items()]
        lines += [f"| pattern {p} | {ms * t['scale']:.3g} |"
                  for p, ms in list(lim["gap_by_pattern"].items())[:10]]
        lines.append("")
    return lines
