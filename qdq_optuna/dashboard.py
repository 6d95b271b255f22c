"""optuna-dashboard for a run: Markdown notes on every pattern study, and the server launcher."""

from __future__ import annotations

import contextlib
from pathlib import Path

import optuna

from .errors import UserError


def pattern_note(attrs: dict) -> str:
    """The Markdown note shown on a pattern study's page."""
    lines = [
        f"## Pattern {attrs.get('pattern_id', '?')}",
        "",
        f"- signature `{attrs.get('signature', '')}`",
        f"- ops: {' → '.join(attrs.get('ops', []))}",
        f"- member regions: {', '.join(map(str, attrs.get('regions', [])))}",
    ]
    if "reference_ms" in attrs:
        lines.append(f"- reference (before this pattern): {attrs['reference_ms']:.4f} ms")
    committed = sorted(p for p, v in (attrs.get("committed") or {}).items() if v)
    if "committed" in attrs:
        lines.append(f"- committed: {', '.join(committed) or 'empty scheme'} "
                     f"(gain {float(attrs.get('gain', 1.0)):.3f}x; {attrs.get('commit_reason', '')})")
    lines += ["", "| point | kind | tensors |", "|---|---|---|"]
    kinds = attrs.get("qdq_point_kinds", {})
    for pid, tensors in attrs.get("qdq_point_tensors", {}).items():
        shown = ", ".join(f"`{t}`" for t in tensors[:4]) + (" …" if len(tensors) > 4 else "")
        lines.append(f"| `{pid}` | {kinds.get(pid, '')} | {shown} |")
    return "\n".join(lines) + "\n"


def save_pattern_note(study: optuna.Study) -> None:
    with contextlib.suppress(ImportError):
        from optuna_dashboard import save_note

        save_note(study, pattern_note(study.user_attrs))


def serve(output_dir: str | Path, *, host: str = "127.0.0.1", port: int = 8080,
          storage: str | None = None) -> None:
    try:
        from optuna_dashboard import run_server
    except ImportError:
        raise UserError("the dashboard needs optuna-dashboard: pip install 'qdq-optuna[dashboard]'") from None
    out = Path(output_dir)
    if storage is None:
        db = out / "studies.db"
        if not db.is_file():
            raise UserError(f"{out}: no studies.db here (pass --storage URL for another storage)")
        storage = f"sqlite:///{db.resolve()}"
    from .storage import open_storage

    print(f"optuna-dashboard: http://{host}:{port}/  (Ctrl-C to stop)", flush=True)
    run_server(open_storage(storage, heartbeat=False), host=host, port=port)
