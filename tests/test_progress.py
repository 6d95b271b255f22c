"""Progress on stderr (``qdq_optuna._progress``): bars in a terminal, plain lines in a log, and
log records and warnings that never land inside a bar."""

from __future__ import annotations

import fcntl
import io
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import textwrap
from pathlib import Path

from qdq_optuna._progress import Progress

REPO = Path(__file__).resolve().parent.parent

# a run of two patterns: warnings, log lines and Optuna's own logger while a pattern runs, and a
# pattern long enough for heartbeats (every 0.1 s here)
SCRIPT = textwrap.dedent("""
    import logging, sys, time, warnings
    import optuna
    from qdq_optuna._progress import Progress

    logging.basicConfig(format="qdq-optuna: %(levelname)s: %(message)s")
    log = logging.getLogger("qdq_optuna")
    with Progress(heartbeat_s=0.1) as progress:
        progress.stage("patterns", 2)
        with progress.pattern("P000", 3, detail="2 regions, 4 points") as p:
            p.trial("0.500 ms")
            warnings.warn("a library warning")
            log.warning("a log line")
            optuna.logging.get_logger("optuna").warning("Trial 1 failed with value None.")
            time.sleep(0.35)
            p.trial("0.400 ms")
            p.finish(gain=1.25, note="2 points")
        with progress.pattern("P001", 2) as p:
            p.trial()
            p.finish(note="nothing committed")
    print("done", file=sys.stderr)
""")

MESSAGES = ("a library warning", "qdq-optuna: WARNING: a log line", "Trial 1 failed with value None.")


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))}


def test_a_log_gets_lines_without_redraws(tmp_path):
    err = tmp_path / "stderr.txt"
    with open(err, "w") as fh:
        proc = subprocess.run([sys.executable, "-c", SCRIPT], stderr=fh, stdout=subprocess.PIPE,
                              env=_env(), timeout=60)
    text = err.read_text()
    assert proc.returncode == 0, text
    assert "\r" not in text and "\x1b[" not in text, repr(text)
    lines = text.splitlines()
    assert "[1/2] P000 (2 regions, 4 points): 2 trials, gain 1.250x, 2 points, " in text
    assert any(line.startswith("[2/2] P001: 1 trial, nothing committed, ") for line in lines)
    beats = [line for line in lines if "still running" in line]
    assert beats and beats[0].startswith("[1/2] P000 (2 regions, 4 points): still running, 1/3 "
                                         "trials, best 0.500 ms, ")
    for message in MESSAGES:
        assert any(message in line for line in lines), (message, text)
    assert lines[-1] == "done"


def _run_in_terminal(code: str) -> str:
    """Run ``code`` with stderr on a pseudo-terminal; what the terminal received."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))  # 120 columns
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=slave, stdout=subprocess.DEVNULL,
                            env=_env())
    os.close(slave)
    out = b""
    while True:
        ready, _, _ = select.select([master], [], [], 60)
        if not ready:
            break
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    proc.wait(timeout=60)
    os.close(master)
    assert proc.returncode == 0, out
    return out.decode(errors="replace")


def test_a_terminal_gets_bars_and_clean_message_lines():
    text = _run_in_terminal(SCRIPT)
    assert "\r" in text and "trial" in text  # bars were drawn
    assert "still running" not in text  # no heartbeats under a bar
    # what each terminal line finally shows: the text after its last carriage return, minus
    # the cursor codes tqdm uses to clear a bar before writing above it
    shown = [line.rsplit("\r", 1)[-1].replace("\x1b[A", "").strip()
             for line in text.replace("\r\n", "\n").split("\n")]
    for message in MESSAGES:
        owners = [line for line in shown if message in line]
        assert owners, (message, text)
        assert all("%|" not in line and "it/s" not in line for line in owners), owners
    assert any(line.startswith("[1/2] P000 (2 regions, 4 points): 2 trials, gain 1.250x")
               for line in shown), shown


def test_disabled_progress_prints_nothing():
    stream = io.StringIO()
    with Progress(False, stream=stream, heartbeat_s=0.01) as progress:
        progress.stage("patterns", 1)
        with progress.pattern("P000", 2) as p:
            p.trial("1 ms")
            p.finish(gain=1.5)
        progress.write("a note")
    assert stream.getvalue() == ""


def test_refinement_stages_are_named_in_lines():
    stream = io.StringIO()
    with Progress(stream=stream, heartbeat_s=0) as progress:
        progress.stage("patterns", 1)
        with progress.pattern("P000", 2) as p:
            p.finish(gain=1.1)
        progress.stage("refine 1", 3, done=1)
        with progress.pattern("P002", 4, done=1) as p:
            p.trial()
            p.finish(note="standing scheme kept")
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("[1/1] P000: 0 trials, gain 1.100x, ")
    assert lines[1].startswith("[refine 1 2/3] P002: 2 trials, standing scheme kept, ")


def test_a_skipped_pattern_has_its_line_and_the_count_reaches_the_end():
    """Without its line, a round whose last visit is skipped seems to stop at 3/4."""
    stream = io.StringIO()
    with Progress(stream=stream, heartbeat_s=0) as progress:
        progress.stage("round 1", 2)
        with progress.pattern("P000", 2) as p:
            p.finish(gain=1.1)
        progress.skip("P001", "nothing changed near it since its last visit")
        assert progress._stage_done == 2
    lines = stream.getvalue().splitlines()
    assert lines[1] == "[round 1 2/2] P001: skipped, nothing changed near it since its last visit"


def test_tune_piped_to_a_file_has_no_redraws(tmp_path):
    from qdq_optuna.examples import zoo

    model = tmp_path / "m.onnx"
    model.write_bytes(zoo.build("tiny_residual").SerializeToString())
    err = tmp_path / "stderr.txt"
    with open(err, "w") as fh:
        proc = subprocess.run(
            [sys.executable, "-m", "qdq_optuna", "tune", "-m", str(model), "-o",
             str(tmp_path / "out"), "-b", "costmodel", "-n", "4"],
            stderr=fh, stdout=subprocess.PIPE, env=_env(), timeout=120, cwd=tmp_path)
    text = err.read_text()
    assert proc.returncode == 0, text
    assert "\r" not in text and "\x1b[" not in text
    assert "P000" in text  # one line per pattern
    assert "[starts 1/" in text and "[round 1 1/" in text  # the phases, counted

    # a run cut by --timeout, rerun, says it is resuming, what is done and what is left; the
    # cost model behind a sleep per measurement, so the cut comes before the run's end on any
    # machine (the bare cost model finished this run inside its 3 s on a fast CI machine, and
    # the rerun then rightly said the run was finished)
    out2 = tmp_path / "cut"
    argv = [sys.executable, "-m", "qdq_optuna", "tune", "-m", str(model), "-o", str(out2),
            "-b", "tests._latency_fns:sleepy_costmodel", "--runtime", "tensorrt", "-n", "4"]
    slow = {**_env(), "QDQ_TEST_SLEEP_S": "0.3"}
    cut = subprocess.run([*argv, "--timeout", "3"], stderr=subprocess.PIPE,
                         stdout=subprocess.DEVNULL, env=slow, timeout=120, cwd=tmp_path,
                         check=True, text=True)
    assert "--timeout 3s cut the run short" in cut.stderr, cut.stderr
    with open(err, "w") as fh:
        proc = subprocess.run(argv, stderr=fh, stdout=subprocess.PIPE,
                              env={**slow, "QDQ_TEST_SLEEP_S": "0.02"}, timeout=120,
                              cwd=tmp_path)
    text = err.read_text()
    assert proc.returncode == 0, text
    line = next(line for line in text.splitlines() if line.startswith("resuming run 'cut'"))
    assert "done" in line and "left:" in line, line
