"""Hostile inputs through the real command line: every bad file, tensor or option gives exactly
one ``qdq-optuna: error: ...`` line naming it, exit status 2, no traceback, and every input file
is left byte-for-byte as it was.

The corpus lives in ``tests/hostile`` (each case writes its bad files at test time). All cases
run up front in a module-scoped fixture, a few subprocesses at a time, so the whole file stays
well under two minutes on two cores; each case is then checked by its own test.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import onnx
import pytest
from hostile import CASES, PWNED_MARKER, Case, Ctx

from qdq_optuna.examples import zoo

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 90
WORKERS = max(2, min(4, os.cpu_count() or 2))


@dataclass
class Outcome:
    argv: list[str]
    returncode: int
    stdout: str
    stderr: str
    before: dict[str, str]
    after: dict[str, str]
    root: Path


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.pop("QDQ_OPTUNA_TEST_POSTGRES_URL", None)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def _hashes(*roots: Path, skip: Path | None = None) -> dict[str, str]:
    """sha256 of every regular file under (or at) ``roots``, ``skip`` excluded."""
    out: dict[str, str] = {}
    for root in roots:
        paths = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        for p in paths:
            if skip is not None and p.is_relative_to(skip):
                continue
            out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def cli(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "qdq_optuna", *argv], cwd=cwd, env=_env(), capture_output=True,
        text=True, timeout=TIMEOUT_S, stdin=subprocess.DEVNULL,
    )


@pytest.fixture(scope="module")
def good_model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("shared") / "good.onnx"
    onnx.save(zoo.build("tiny_chain"), str(path))
    return path


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory, good_model) -> dict[str, Outcome]:
    """Build every case in its own folder and run them all through the CLI."""
    base = tmp_path_factory.mktemp("hostile")
    jobs: dict[str, tuple[Ctx, list[str]]] = {}
    for c in CASES:
        root = base / c.id
        root.mkdir()
        ctx = Ctx(root=root, good=good_model, out=root / "out")
        jobs[c.id] = (ctx, c.build(ctx))

    def run(item: tuple[str, tuple[Ctx, list[str]]]) -> tuple[str, Outcome]:
        cid, (ctx, argv) = item
        before = _hashes(ctx.root, ctx.good, skip=ctx.out)
        proc = cli(argv, ctx.root)
        after = _hashes(ctx.root, ctx.good, skip=ctx.out)
        return cid, Outcome(argv, proc.returncode, proc.stdout, proc.stderr, before, after,
                            ctx.root)

    with ThreadPoolExecutor(WORKERS) as pool:
        return dict(pool.map(run, jobs.items()))


def test_corpus_is_large_and_unique():
    ids = [c.id for c in CASES]
    assert len(ids) >= 28
    assert len(ids) == len(set(ids)), "duplicate case ids"
    assert all(c.needles for c in CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile_input(case: Case, outcomes: dict[str, Outcome]):
    o = outcomes[case.id]
    shown = f"argv={o.argv}\nrc={o.returncode}\nstdout={o.stdout!r}\nstderr={o.stderr!r}"
    assert "Traceback" not in o.stdout + o.stderr, shown
    assert o.returncode == 2, shown
    lines = o.stderr.splitlines()
    assert len(lines) == 1 and lines[0].strip(), f"not exactly one line on stderr\n{shown}"
    line = lines[0]
    assert line.startswith("qdq-optuna: error: "), shown
    assert line[len("qdq-optuna: error: "):].strip(), shown
    for needle in case.needles:
        assert needle in line, f"{needle!r} not named in the error\n{shown}"
    assert o.after == o.before, f"input files changed or vanished\n{shown}"
    assert not (o.root / PWNED_MARKER).exists(), f"a YAML payload was executed\n{shown}"
    assert "pwned" not in o.stdout, shown


def test_extension_does_not_matter(tmp_path, good_model):
    """Content decides, not the file name: a valid model called .txt is inspected normally."""
    path = tmp_path / "model.txt"
    path.write_bytes(good_model.read_bytes())
    before = _hashes(path)
    proc = cli(["inspect", str(path)], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "model.txt: 7 nodes" in proc.stdout
    assert proc.stderr == ""
    assert _hashes(path) == before
