"""Warm starts: the pattern cache (YAML) and importing an existing Q/DQ model's placement.

Both only ever produce *seeds*: schemes enqueued into a pattern's study before the sampler's own
proposals (``enqueue_trial(..., skip_if_exists=True)``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import yaml

from qdq_optuna.errors import UserError
from qdq_optuna.model.graph import load_model
from qdq_optuna.placement.points import PatternPoints

CACHE_VERSION = 1


class PatternCache:
    """signature -> list of schemes (point id -> value) with their measured latency."""

    def __init__(self, entries: dict[str, dict] | None = None) -> None:
        self.entries: dict[str, dict] = entries or {}

    # -- reading -----------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | os.PathLike) -> PatternCache:
        path = Path(path)
        if not path.is_file():
            raise UserError(f"--pattern-cache {path}: no such file")
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        except yaml.YAMLError as exc:
            first = str(exc).strip().splitlines()[0]
            raise UserError(f"--pattern-cache {path}: not safe YAML ({first})") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise UserError(f"--pattern-cache {path}: cannot read ({exc})") from None
        if not isinstance(data, dict) or not isinstance(data.get("patterns"), dict):
            raise UserError(f"--pattern-cache {path}: expected a mapping with a 'patterns' mapping")
        if data.get("version", CACHE_VERSION) != CACHE_VERSION:
            raise UserError(f"--pattern-cache {path}: unsupported version {data.get('version')!r}")
        entries = {}
        for sig, entry in data["patterns"].items():
            if not isinstance(entry, dict) or not isinstance(entry.get("schemes", []), list):
                raise UserError(f"--pattern-cache {path}: pattern {sig!r} is malformed")
            schemes = []
            for s in entry.get("schemes", []):
                if not isinstance(s, dict) or not isinstance(s.get("points", []), list):
                    raise UserError(f"--pattern-cache {path}: a scheme of pattern {sig!r} is malformed")
                if not all(isinstance(p, str) for p in s.get("points", [])):
                    raise UserError(f"--pattern-cache {path}: point ids of pattern {sig!r} must be strings")
                schemes.append({"points": list(s.get("points", [])), "latency_ms": s.get("latency_ms")})
            entries[str(sig)] = {"schemes": schemes}
        return cls(entries)

    def seeds_for(self, pp: PatternPoints) -> list[dict[str, int]]:
        entry = self.entries.get(pp.pattern.signature)
        if not entry:
            return []
        known = set(pp.ids)
        seeds = []
        for s in entry["schemes"]:
            on = [p for p in s["points"] if p in known]
            if len(on) != len(s["points"]):
                continue  # written for another point set: not this pattern after all
            seeds.append({pid: int(pid in on) for pid in pp.ids})
        return seeds

    def check_matches(self, path: str, points: Iterable[PatternPoints]) -> int:
        sigs = {pp.pattern.signature for pp in points}
        hits = sum(1 for s in self.entries if s in sigs)
        if self.entries and hits == 0:
            raise UserError(
                f"--pattern-cache {path}: none of its {len(self.entries)} patterns occurs in this "
                "model (a cache for another model?)"
            )
        return hits

    # -- writing -----------------------------------------------------------------------------
    def add(self, signature: str, schemes: list[tuple[list[str], float]], *,
            minimum_distance: int, max_entries: int) -> None:
        """Keep the best schemes, each at least ``minimum_distance`` points from a better one."""
        merged = {tuple(sorted(p)): lat for p, lat in schemes}
        for old in self.entries.get(signature, {}).get("schemes", []):
            key = tuple(sorted(old["points"]))
            if old.get("latency_ms") is not None and key not in merged:
                merged[key] = float(old["latency_ms"])
        kept: list[tuple[tuple[str, ...], float]] = []
        for pts, lat in sorted(merged.items(), key=lambda kv: (kv[1], kv[0])):
            if all(len(set(pts) ^ set(k)) >= minimum_distance for k, _ in kept):
                kept.append((pts, lat))
            if max_entries and len(kept) >= max_entries:
                break
        self.entries[signature] = {
            "schemes": [{"points": list(p), "latency_ms": round(float(lat), 6)} for p, lat in kept]
        }

    def to_yaml(self) -> str:
        """The cache as its file holds it (``--pattern-cache`` reads it back)."""
        return yaml.safe_dump({"version": CACHE_VERSION, "patterns": self.entries},
                              sort_keys=True)


def baseline_tensors(path: str | os.PathLike) -> set[str]:
    """Activations an existing Q/DQ model quantizes: the *inputs* of its QuantizeLinear nodes
    (those names exist in the float model; the DQ inputs do not); a quantized graph output by
    its own name (the tool renamed the tensor behind it, its DQ writes the output)."""
    from qdq_optuna.placement.export import graph_output_names

    graph = load_model(path, allow_qdq=True)
    qs = [n for n in graph.nodes if n.op_type == "QuantizeLinear"]
    if not qs:
        raise UserError(f"--qdq-baseline {path}: contains no QuantizeLinear node")
    renamed = graph_output_names(graph.model)
    return {renamed.get(n.input[0], n.input[0]) for n in qs if n.input[0] not in graph.initializers}


def baseline_seed(pp: PatternPoints, tensors: set[str]) -> dict[str, int] | None:
    """The scheme turning on every point whose tensors the baseline model quantizes."""
    scheme = {}
    for pid in pp.ids:
        covered = {u[0] for uses in pp.resolved[pid].values() for u in uses}
        scheme[pid] = int(bool(covered) and covered <= tensors)
    return scheme if any(scheme.values()) else None
