"""Files a run writes: atomically (temp file, fsync, rename), with the mode ``open()`` would
give, and temp files of killed processes cleaned up on the next start."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

#: in an exporter's work folder (external mode): the quantized weights, and where the input
#: model's own weight files are
WORK_WEIGHTS = "qdq_weights.bin"
WORK_SOURCES = "external_sources.json"


def temp_prefix(path: Path) -> str:
    """Prefix of the temporary files written next to ``path``: they carry the writer's pid, so
    :func:`remove_stale_temps` can tell a dead process's leftovers from a live write."""
    return f".{path.name}.pid{os.getpid()}."


#: where an internal error's traceback is kept, in the run's output folder (the CLI writes
#: it; a later attempt of the run removes it)
TRACEBACK_FILE = "internal_error.txt"


def remove_stale_temps(folder: str | os.PathLike) -> list[Path]:
    """Delete temporary files (``.NAME.pidN.*.tmp``) that killed processes left in ``folder``
    and its subfolders; a file whose writer still runs is left alone."""
    removed: list[Path] = []
    for tmp in sorted(Path(folder).rglob(".*.tmp")):
        if any(tmp.is_relative_to(r) for r in removed):
            continue  # inside a folder removed already
        parts = tmp.name.split(".")
        pid = next((int(p[3:]) for p in parts if p.startswith("pid") and p[3:].isdigit()), None)
        if pid is None or pid == os.getpid():
            continue
        try:
            os.kill(pid, 0)
            continue  # the writer is alive
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # alive, someone else's
        try:
            if tmp.is_dir() and not tmp.is_symlink():  # an external-mode work folder
                shutil.rmtree(tmp)
            else:
                tmp.unlink()
            removed.append(tmp)
        except OSError:
            pass
    return removed


def new_file_mode(path: str | os.PathLike) -> int:
    """The mode ``open(path, "w")`` would leave: an existing file's own, else 0o666 less the
    umask (``mkstemp`` makes 0600 files, which other users and groups could not read)."""
    try:
        return os.stat(path).st_mode & 0o777
    except OSError:
        pass
    try:  # Linux: read the umask without changing it (no window for other threads)
        with open("/proc/self/status", encoding="ascii") as fh:
            mask = next(int(line.split()[1], 8) for line in fh if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        mask = os.umask(0o022)
        os.umask(mask)
    return 0o666 & ~mask


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write to a temporary file in the same folder, fsync, then rename over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = new_file_mode(path)
    fd, tmp = tempfile.mkstemp(prefix=temp_prefix(path), suffix=".tmp", dir=path.parent)
    try:
        if hasattr(os, "fchmod"):
            os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def external_sources(model_path: str | os.PathLike) -> dict[str, str]:
    """Location -> file of every external data file a model in a work folder may reference:
    the input model's weight files where they are (``external_sources.json``) and the folder's
    quantized weights; {} for any other model. Whoever loads such a model by path gives these
    files to ONNX Runtime (:func:`map_external_sources`)."""
    folder = Path(model_path).parent
    manifest = folder / WORK_SOURCES
    if not manifest.is_file():
        return {}
    try:
        sources = dict(json.loads(manifest.read_text()))
    except (OSError, ValueError):
        return {}
    weights = folder / WORK_WEIGHTS
    if weights.is_file() and weights.stat().st_size:
        sources[WORK_WEIGHTS] = str(weights)
    return sources


def map_external_sources(options: Any, path: str) -> list:
    """Give ONNX Runtime (its ``SessionOptions``), from memory maps, the external data files an
    exported model references in the input model's folder; keep the returned maps alive until
    the session is created. Raises OSError when a file cannot be mapped."""
    import numpy as np

    sources = external_sources(path)
    if not sources:
        return []
    maps = [np.memmap(src, dtype=np.uint8, mode="r") for src in sources.values()]
    options.add_external_initializers_from_files_in_memory(
        list(sources), maps, [m.size for m in maps])
    return maps
