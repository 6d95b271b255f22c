"""What a run writes beside its storage: ``state.yaml`` and the pattern cache.

Both are read from the stored run (:class:`~qdq_optuna.record.run.RunRecord`), which stays the
truth: ``state.yaml`` is a readable snapshot, the pattern cache (``--pattern-cache``) a file a
later run starts from.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from optuna.trial import TrialState

from qdq_optuna.placement.seeds import PatternCache
from qdq_optuna.record.run import RunRecord
from qdq_optuna.record.schema import TrialAttr
from qdq_optuna.run_folder import RunFolder


def write_state(record: RunRecord, out: Path, status: str, run: dict,
                lane: str | None = None) -> None:
    """``state.yaml``: a readable snapshot (``run``: storage, fingerprint, baseline and
    counters of this process, in that order; ``lane``: the lane whose standing model the
    patterns show, once the starts are decided)."""
    patterns = []
    rows = {}
    visits = record.visits()
    if lane is not None and record.starts() is not None:
        rows = {r.pattern_id: r for r in record.committed(lane)[1]}
    for pp in record.tunable:
        pid = pp.pattern.id
        mine = [v for v in visits if v.pattern_id == pid]
        row = {"id": pid, "signature": pp.pattern.signature,
               "regions": len(pp.pattern.regions), "points": len(pp.ids),
               "status": "pending", "visits": len(mine), "decided": sum(v.decided for v in mine)}
        if mine:
            row["status"] = "committed" if row["visits"] == row["decided"] else "running"
        r = rows.get(pid)
        if r is not None:
            row["standing"] = sorted(record.space.on(r.scheme))
            row["gain"] = round(float(r.gain), 4)
        patterns.append(row)
    state = {"status": status, "run_id": record.run_id, **run, "patterns": patterns,
             "resume": "rerun the same command to continue"}
    RunFolder(out).write_state(yaml.safe_dump(state, sort_keys=False))


def write_pattern_cache(record: RunRecord, folder: RunFolder, *, minimum_distance: int,
                        max_entries: int, lane: str | None = None) -> None:
    """Every measured scheme of every pattern with the whole model's latency it gave, the
    standing scheme (``lane``'s) first, for ``--pattern-cache`` of a later run."""
    cache = PatternCache()
    standing = record.standing(lane) if lane is not None and record.starts() else {}
    by_pattern: dict[str, list] = {}
    for visit in record.visits():
        for t in record.visit_trials(visit):
            if t.state == TrialState.COMPLETE and t.values and not t.user_attrs.get(
                    TrialAttr.PARTNER):
                by_pattern.setdefault(visit.pattern_id, []).append(
                    (record.space.on(t.params), t.values[0]))
    for pp in record.tunable:
        schemes = by_pattern.get(pp.pattern.id, [])
        if pp.pattern.id in standing:  # first: below every measured latency
            best = min((lat for _, lat in schemes), default=0.0)
            schemes.append((record.space.on(standing[pp.pattern.id]), max(best - 1e-6, 0.0)))
        if schemes:
            cache.add(pp.pattern.signature, schemes, minimum_distance=minimum_distance,
                      max_entries=max_entries)
    folder.write_pattern_cache(cache.to_yaml())
