"""The dashboard for real: a small tune, its artifacts, a live optuna-dashboard and a browser.

One run of ``zoo.build("tiny_concat")`` with a deterministic latency function
(``_latency_fns.rewards_groups``, a few schemes per pattern) is tuned once for the module. Then:

* every pattern study has its note and two artifacts (a PNG convergence curve and an SVG of the
  representative region) in ``OUTPUT/artifacts``, uploaded through Optuna's artifact API;
* ``python -m qdq_optuna dashboard OUTPUT --port N`` is started as a subprocess and its API
  lists the studies, serves the notes and the artifacts;
* the run's overview study (``RUN``: a note with the run's figures, phases and studies, the
  whole-run convergence picture, small user attrs, no trials) is the first card of the study
  list; the bookkeeping study ``RUN/_run`` has small user attrs and no trial values, so no
  plot or importance of it errs, and ``optuna studies`` prints short lines for both;
* when Chromium is on PATH (``chromium`` or ``chromium-browser``), headless Chromium renders the
  study list and a study's pages: ``--dump-dom`` must show the study names and the note after
  the client-side rendering, and the screenshots must be non-blank PNGs. The screenshots and DOM
  dumps are kept in ``$QDQ_OPTUNA_TEST_ARTIFACTS/dashboard`` (default: the test's tmp_path).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import time
import urllib.request
import xml.etree.ElementTree as ET
import zlib
from pathlib import Path

import _latency_fns as fns
import onnx
import optuna
import pytest

from qdq_optuna import Config, tune
from qdq_optuna.backends.callable import CallableBackend
from qdq_optuna.examples import zoo
from qdq_optuna.outputs.dashboard import ARTIFACT_DIR, convergence_png, pattern_note, region_svg
from qdq_optuna.record.storage import open_storage
from qdq_optuna.runtimes.prepared import PreparedModel

pytestmark = pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")

RUN_ID = "dash"
SVG_NS = "{http://www.w3.org/2000/svg}"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SERVER_START_S = 60
BROWSER_TIMEOUT_S = 90
#: the dashboard server's stderr (set by the ``server`` fixture)
SERVER_LOGS: dict[str, Path] = {}


# -- helpers --------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == PNG_MAGIC, "not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def png_colours(data: bytes) -> int:
    """Distinct colours of a PNG (decoded with Pillow, which matplotlib brings along)."""
    from io import BytesIO

    from PIL import Image

    with Image.open(BytesIO(data)) as im:
        colours = im.convert("RGB").getcolors(maxcolors=1 << 24)
    return len(colours)


def assert_non_blank_png(path: Path, size: tuple[int, int] | None = None) -> None:
    data = path.read_bytes()
    w, h = png_size(data)
    if size is not None:
        assert (w, h) == size, f"{path.name}: {w}x{h}, expected {size}"
    assert w > 100 and h > 100
    # a blank page compresses to almost nothing and has a handful of colours
    assert len(zlib.compress(data)) > 5000, f"{path.name} looks blank"
    try:
        colours = png_colours(data)
    except ImportError:
        return
    assert colours > 30, f"{path.name}: only {colours} colours, looks blank"


def pattern_studies(out: Path) -> dict[str, optuna.Study]:
    storage = open_storage(f"sqlite:///{out / 'studies.db'}", heartbeat=False)
    names = [s.study_name for s in storage.get_all_studies()]
    return {n: optuna.load_study(study_name=n, storage=storage) for n in names
            if n.startswith(f"{RUN_ID}/") and n not in (f"{RUN_ID}/_run", f"{RUN_ID}/_starts")}


def visit_stem(attrs: dict) -> str:
    """The file names of a visit's pictures: ``P002_round1``, ``P002_recipe_round1``."""
    lane = f"{attrs['lane']}_" if attrs["lane"] else ""
    return f"{attrs['pattern_id']}_{lane}round{attrs['round']}"


def get(url: str, timeout: float = 10) -> tuple[int, str, bytes]:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.headers.get("Content-Type", ""), r.read()


def get_json(url: str) -> dict:
    return json.loads(get(url)[2])


def artifact_dir(tmp_path: Path) -> Path:
    base = os.environ.get("QDQ_OPTUNA_TEST_ARTIFACTS")
    d = (Path(base) if base else tmp_path) / "dashboard"
    d.mkdir(parents=True, exist_ok=True)
    return d


def chromium_exe() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def run_chromium(exe: str, url: str, profile: Path, *args: str,
                 window: tuple[int, int] = (1400, 1000)) -> subprocess.CompletedProcess:
    cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           "--disable-dev-shm-usage", "--hide-scrollbars", f"--user-data-dir={profile}",
           f"--window-size={window[0]},{window[1]}", "--virtual-time-budget=10000", *args, url]
    return subprocess.run(cmd, capture_output=True, timeout=BROWSER_TIMEOUT_S, check=False)


# -- the run --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("dashboard")
    model = base / "tiny_concat.onnx"
    onnx.save(zoo.build("tiny_concat"), str(model))
    out = base / "out"
    tune(model, out, benchmark=CallableBackend(fns.rewards_groups, deterministic=True), runtime="onnxruntime",
         timing="fast", config=Config(schemes_per_region=4), run_id=RUN_ID, progress=False)
    return out


@pytest.fixture(scope="module")
def server(run, tmp_path_factory):
    """``python -m qdq_optuna dashboard OUT --port N``; yields the base URL."""
    port = free_port()
    logs = tmp_path_factory.mktemp("server")
    with open(logs / "stdout", "w") as so, open(logs / "stderr", "w") as se:
        proc = subprocess.Popen([sys.executable, "-m", "qdq_optuna", "dashboard", str(run),
                                 "--port", str(port)], stdout=so, stderr=se)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVER_START_S
        while True:
            assert proc.poll() is None, (f"dashboard exited {proc.returncode}: "
                                         f"{(logs / 'stderr').read_text()}")
            if base in (logs / "stdout").read_text():
                break
            assert time.monotonic() < deadline, "dashboard did not print its URL"
            time.sleep(0.1)
        line = (logs / "stdout").read_text().strip().splitlines()[0]
        assert line.startswith(f"optuna-dashboard: {base}/dashboard"), line
        SERVER_LOGS["stderr"] = logs / "stderr"
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# -- artifacts and notes --------------------------------------------------------------------
def test_pictures_are_drawn_at_most_every_interval_and_all_at_the_end(tmp_path, monkeypatch):
    """Drawing costs about a second; a cost-model run commits faster than that. Within the
    interval commits wait, and the run's end draws every one of them."""
    from qdq_optuna.outputs import dashboard

    batches: list[int] = []
    real = dashboard.PatternPictures.flush

    def flush(self):
        batches.append(len(self._pending))
        real(self)

    monkeypatch.setattr(dashboard.PatternPictures, "flush", flush)
    model = tmp_path / "tiny_concat.onnx"
    onnx.save(zoo.build("tiny_concat"), str(model))
    for every_s, out in ((3600.0, tmp_path / "slow"), (0.0, tmp_path / "fast")):
        monkeypatch.setattr(dashboard, "REDRAW_S", every_s)
        batches.clear()
        tune(model, out, benchmark=CallableBackend(fns.rewards_groups, deterministic=True),
             runtime="onnxruntime", timing="fast", config=Config(schemes_per_region=4),
             run_id=RUN_ID, progress=False)
        studies = pattern_studies(out)
        assert len(studies) >= 2
        assert sum(batches) == len(studies)
        if every_s:  # the first commit at once, the others at the run's end
            assert batches == [1, len(studies) - 1]
        else:  # each commit drawn as it lands; the end has nothing left
            assert batches == [1] * len(studies) + [0]
        for name, study in studies.items():
            assert {a["file"] for a in study.user_attrs["artifacts"]} == {
                f"{visit_stem(study.user_attrs)}_convergence.png",
                f"{visit_stem(study.user_attrs)}_region.svg"}, name


def test_every_pattern_study_has_note_attrs_and_artifacts(run):
    studies = pattern_studies(run)
    assert len(studies) >= 2
    store = run / ARTIFACT_DIR
    for name, study in studies.items():
        attrs = study.user_attrs
        assert study.metric_names == ["latency_ms"], name
        assert "committed" in attrs and "reference_ms" in attrs
        arts = attrs["artifacts"]
        files = {a["file"]: a for a in arts}
        pid = attrs["pattern_id"]
        rnd, lane = attrs["round"], attrs["lane"]
        stem = visit_stem(attrs)
        assert set(files) == {f"{stem}_convergence.png", f"{stem}_region.svg"}, name
        # uploaded through optuna.artifacts: the study's system attrs hold the metadata
        meta = {m.artifact_id: m for m in optuna.artifacts.get_all_artifact_meta(study)}
        for a in arts:
            assert a["artifact_id"] in meta
            assert meta[a["artifact_id"]].filename == a["file"]
            assert a["url"] == f"/artifacts/{study._study_id}/{a['artifact_id']}"
        png = (store / files[f"{stem}_convergence.png"]["artifact_id"]).read_bytes()
        assert meta[files[f"{stem}_convergence.png"]["artifact_id"]].mimetype == "image/png"
        assert png_size(png) == (640, 360)
        svg_id = files[f"{stem}_region.svg"]["artifact_id"]
        assert meta[svg_id].mimetype == "image/svg+xml"
        root = ET.fromstring((store / svg_id).read_text(encoding="utf-8"))
        assert root.tag == f"{SVG_NS}svg"
        titles = " ".join(t.text or "" for t in root.iter(f"{SVG_NS}title"))
        rep = str(attrs["regions"][0])
        for node in attrs["region_nodes"][rep]:
            assert node in titles, f"{name}: node {node} not drawn"
        text = " ".join(t.text or "" for t in root.iter(f"{SVG_NS}text"))
        for p in attrs["qdq_points"]:
            assert p in text, f"{name}: point {p} not in the legend"
        # the candidate trial's points (else the fastest trial's) are marked red, others off
        complete = study.get_trials(deepcopy=False,
                                    states=(optuna.trial.TrialState.COMPLETE,))
        best = next((t for t in complete if t.number == attrs.get("candidate_trial")),
                    min(complete, key=lambda t: (t.value, t.number)))
        on_marks = [g for g in root.iter(f"{SVG_NS}g") if g.get("class") == "qdq on"]
        assert bool(on_marks) == any(best.params.values()), name
        for p, v in attrs["committed"].items():
            if v:
                assert f"* {p}" in " ".join(text.split()), f"{name}: {p} not starred"
        # the note: ops, members with node names, points legend, committed, gain, reference
        note = pattern_note(attrs)
        assert f"## Pattern {pid}" in note
        assert " → ".join(attrs["ops"]) in note
        for node in attrs["region_nodes"][rep]:
            assert f"`{node}`" in note
        for p, kind in attrs["qdq_point_kinds"].items():
            assert f"| `{p}` | {kind} |" in note
        assert f"{attrs['reference_ms']:.4f} ms" in note
        assert f"{float(attrs['gain']):.3f}x" in note
        assert f"{stem}_convergence.png" in note and f"{stem}_region.svg" in note
        assert f"## Pattern {pid} — {lane + ' ' if lane else ''}descent round {rnd}" in note
        assert "starting from its own standing scheme" in note
    # at least one visit committed Q/DQ (rewards_groups has a real optimum); every pattern is
    # visited in round 1, each visit a study of its own, drawn
    assert any(any(s.user_attrs["committed"].values()) for s in studies.values())
    assert {s.user_attrs["pattern_id"] for n, s in studies.items() if n.endswith("/round1")} == {
        s.user_attrs["pattern_id"] for s in studies.values()}


def _note(study: optuna.Study) -> str:
    from optuna_dashboard._note import get_note_from_system_attrs

    attrs = study._storage.get_study_system_attrs(study._study_id)
    return get_note_from_system_attrs(attrs, None)["body"]


def test_the_run_has_an_overview_and_small_bookkeeping(run):
    storage = open_storage(f"sqlite:///{run / 'studies.db'}", heartbeat=False)
    report = json.loads((run / "report.json").read_text())
    view = optuna.load_study(study_name=RUN_ID, storage=storage)
    assert view.user_attrs == {
        "run_id": RUN_ID, "status": "finished", "speedup": round(report["speedup"], 4),
        "baseline_latency_ms": report["baseline_latency_ms"],
        "final_latency_ms": report["final_latency_ms"], "accuracy_status": "within bound"}
    assert view.get_trials(deepcopy=False) == []
    note = _note(view)
    lo, hi = report["speedup_ci"]
    for expected in (f"## Run {RUN_ID} — finished", f"**Speedup {report['speedup']:.3f}x**",
                     f"interval {lo:.3f}–{hi:.3f}", f"{report['baseline_latency_ms']:.4f}",
                     "### Accuracy", "**within bound**", "random inputs", "### Phases",
                     "| starts |", "| descent round 1 |", "| final |",
                     "### Pattern studies", "### The whole run", "high precision fp32"):
        assert expected in note, expected
    for name in pattern_studies(run):
        assert f"`{name}`" in note
    # the whole-run picture: an artifact of the overview, embedded in its note
    (meta,) = optuna.artifacts.get_all_artifact_meta(view)
    assert meta.filename == "run_convergence.png" and meta.mimetype == "image/png"
    assert f"(/artifacts/{view._study_id}/{meta.artifact_id})" in note
    assert_non_blank_png(run / ARTIFACT_DIR / meta.artifact_id, (640, 360))
    # the bookkeeping: a few small user attrs, proposals without values, a note pointing on
    books = optuna.load_study(study_name=f"{RUN_ID}/_run", storage=storage)
    # (``winner``: only when lanes were compared)
    assert {"fingerprint", "created", "baseline_latency_ms", "baseline_model"} <= set(
        books.user_attrs) <= {"fingerprint", "created", "baseline_latency_ms", "baseline_model",
                              "winner"}
    proposals = books.get_trials(deepcopy=False)
    assert proposals and all(t.state == optuna.trial.TrialState.PRUNED and t.values is None
                             and set(t.user_attrs) == {"qdq:agree"} for t in proposals)
    assert f"The run's overview is the study `{RUN_ID}`" in _note(books)
    system = storage.get_study_system_attrs(books._study_id)
    assert any(k.startswith("measured:") for k in system) and "settings" in system
    assert "starts" in system
    # what `optuna studies` prints of them: short
    proc = subprocess.run([sys.executable, "-c", "import sys, optuna.cli; "
                           "sys.argv[0] = 'optuna'; sys.exit(optuna.cli.main())", "studies",
                           "--storage", f"sqlite:///{run / 'studies.db'}", "-f", "json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    listed = {s["name"]: s for s in json.loads(proc.stdout)}
    for name in (RUN_ID, f"{RUN_ID}/_run"):
        assert len(json.dumps(listed[name])) < 600, listed[name]


def test_every_pattern_is_drawn(tmp_path):
    """Each pattern's convergence picture and region SVG are written and well formed (their
    CPU cost is measured by ``benchmarks/estimate_and_drawing_speed.py``)."""
    pm = PreparedModel.prepare(zoo.build("yolo", "small"))
    for pp in pm.tunable:
        rep = pp.pattern.representative
        trials = [(i, 10.0 - 0.01 * i) for i in range(30)]
        png = tmp_path / f"{pp.pattern.id}.png"
        convergence_png(png, trials, reference_ms=10.0, title=pp.pattern.id)
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        svg = region_svg(pm.graph, pm.tree[rep].all_nodes,
                         {p: pp.resolved[p].get(rep, []) for p in pp.ids},
                         chosen=set(pp.ids[:2]), committed=set(pp.ids[:1]),
                         kinds={p.id: p.kind for p in pp.points}, title=pp.pattern.id)
        assert ET.fromstring(svg).tag.endswith("svg")


def test_a_broken_artifact_store_never_fails_the_run(tmp_path, caplog):
    model = tmp_path / "tiny_concat.onnx"
    onnx.save(zoo.build("tiny_concat"), str(model))
    out = tmp_path / "out"
    out.mkdir()
    (out / ARTIFACT_DIR).write_text("a file where the store should be")
    with caplog.at_level(logging.WARNING, logger="qdq_optuna"):
        result = tune(model, out, benchmark=CallableBackend(fns.rewards_groups, deterministic=True), runtime="onnxruntime",
                      timing="fast", config=Config(schemes_per_region=3), run_id=RUN_ID,
                      progress=False)
    assert result.optimized_model.is_file()
    assert "dashboard artifacts for dash/P000/round1 not saved" in caplog.text
    for study in pattern_studies(out).values():
        assert "committed" in study.user_attrs
        assert "artifacts" not in study.user_attrs
        assert "## Pattern" in pattern_note(study.user_attrs)


# -- the server -----------------------------------------------------------------------------
def test_server_lists_studies_notes_and_artifacts(run, server):
    summaries = get_json(f"{server}/api/studies")["study_summaries"]
    names = {s["study_name"]: s["study_id"] for s in summaries}
    studies = pattern_studies(run)
    assert set(studies) <= set(names)
    assert f"{RUN_ID}/_run" in names
    assert get_json(f"{server}/api/meta")["artifact_is_available"] is True
    for name, study in studies.items():
        detail = get_json(f"{server}/api/studies/{names[name]}")
        assert detail["objective_names"] == ["latency_ms"]
        assert detail["note"]["body"] == pattern_note(study.user_attrs, study.metric_names)
        listed = {a["filename"]: a for a in detail["artifacts"]}
        for a in study.user_attrs["artifacts"]:
            assert a["file"] in listed
            status, ctype, body = get(server + a["url"])
            assert status == 200
            assert ctype == ("image/png" if a["file"].endswith(".png") else "image/svg+xml")
            assert body == (run / ARTIFACT_DIR / a["artifact_id"]).read_bytes()
    status, ctype, body = get(f"{server}/dashboard")
    assert status == 200 and "text/html" in ctype
    # the overview and the bookkeeping: notes, the picture, no importance to compute
    view = get_json(f"{server}/api/studies/{names[RUN_ID]}")
    assert view["note"]["body"].startswith(f"## Run {RUN_ID} — finished")
    (art,) = view["artifacts"]
    status, ctype, body = get(f"{server}/artifacts/{names[RUN_ID]}/{art['artifact_id']}")
    assert status == 200 and ctype == "image/png" and body[:8] == PNG_MAGIC
    for name in (RUN_ID, f"{RUN_ID}/_run"):
        status, _, body = get(f"{server}/api/studies/{names[name]}/param_importances")
        assert status == 200 and json.loads(body) == {"param_importances": [[]]}


def test_busy_port_and_port_zero(run, tmp_path):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "qdq_optuna", "dashboard", str(run),
                            "--port", str(port)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("qdq-optuna: error: --port"), r.stderr
    assert "already in use" in err[0]
    # --port 0: a free port is picked and the URL names it
    out = tmp_path / "stdout"
    with open(out, "w") as so:
        proc = subprocess.Popen([sys.executable, "-m", "qdq_optuna", "dashboard", str(run),
                                 "--port", "0"], stdout=so, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + SERVER_START_S
        while "http://" not in out.read_text():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        url = out.read_text().split()[1]
        assert url.startswith("http://127.0.0.1:") and not url.startswith("http://127.0.0.1:0/")
        summaries = get_json(url.replace("/dashboard", "/api/studies"))["study_summaries"]
        assert any(s["study_name"].startswith(f"{RUN_ID}/") for s in summaries)
    finally:
        proc.terminate()
        proc.wait(10)


def test_cli_errors(tmp_path):
    from qdq_optuna.cli.commands import main

    assert main(["dashboard", str(tmp_path)]) == 2  # no studies.db
    assert main(["dashboard", str(tmp_path / "missing")]) == 2


# -- the browser ----------------------------------------------------------------------------
def test_browser_renders_the_studies_and_the_note(run, server, tmp_path):
    exe = chromium_exe()
    if exe is None:
        pytest.skip("no chromium or chromium-browser on PATH (apt-get install chromium): "
                    "the browser rendering was not checked")
    keep = artifact_dir(tmp_path)
    profile = tmp_path / "chromium-profile"
    names = {s["study_name"]: s["study_id"]
             for s in get_json(f"{server}/api/studies")["study_summaries"]}
    studies = pattern_studies(run)
    # the study to look at: the largest pattern that committed Q/DQ
    name = max(sorted(studies), key=lambda n: (any(studies[n].user_attrs["committed"].values()),
                                               len(studies[n].user_attrs["qdq_points"])))
    attrs = studies[name].user_attrs
    sid = names[name]
    pages = {
        "studies": f"{server}/dashboard",
        "study_top": f"{server}/dashboard/studies/{sid}",
        "study_note": f"{server}/dashboard/studies/{sid}/note",
        "run_note": f"{server}/dashboard/studies/{names[RUN_ID]}/note",
        "run_top": f"{server}/dashboard/studies/{names[RUN_ID]}",
        "bookkeeping_top": f"{server}/dashboard/studies/{names[RUN_ID + '/_run']}",
    }

    def dom(page: str) -> str:
        text = ""
        for _ in range(2):  # one retry: a slow machine may not finish rendering the first time
            r = run_chromium(exe, pages[page], profile, "--dump-dom")
            text = r.stdout.decode("utf-8", "replace")
            (keep / f"{page}.html").write_text(text, encoding="utf-8")
            if len(text) > 5000:
                break
        assert r.returncode == 0, r.stderr.decode("utf-8", "replace")[-2000:]
        return text

    listing = dom("studies")
    for n in studies:
        assert n in listing, f"{n} not rendered in the study list"
    # the first card (newest first, the list's default order) is the run's overview
    cards = re.findall(r"<h5[^>]*>\d+\. ([^<]+)</h5>", listing)
    assert cards[0] == RUN_ID and f"{RUN_ID}/_run" in cards, cards
    overview = dom("run_note")
    report = json.loads((run / "report.json").read_text())
    for expected in [f"Run {RUN_ID} — finished", f"Speedup {report['speedup']:.3f}x", "Phases",
                     "Accuracy", "within bound", "Pattern studies", "The whole run",
                     *studies]:
        assert expected in overview, f"{expected!r} not rendered in the run's note"
    (art,) = get_json(f"{server}/api/studies/{names[RUN_ID]}")["artifacts"]
    assert f'src="/artifacts/{names[RUN_ID]}/{art["artifact_id"]}"' in overview
    assert "run_convergence.png" in dom("run_top")
    dom("bookkeeping_top")
    note = dom("study_note")
    rep = str(attrs["regions"][0])
    for expected in [f"Pattern {attrs['pattern_id']}", "Member regions", "Insertion points",
                     *attrs["region_nodes"][rep], *attrs["qdq_points"],
                     f"{visit_stem(attrs)}_region.svg"]:
        assert expected in note, f"{expected!r} not rendered in the note"
    for a in attrs["artifacts"]:  # the pictures are embedded in the note
        assert f'src="{a["url"]}"' in note
    top = dom("study_top")
    assert "Study Artifacts" in top
    assert f"{visit_stem(attrs)}_convergence.png" in top

    shots = [(page, url, (1400, 1000)) for page, url in pages.items()]
    # the whole note with its embedded pictures (convergence curve, region)
    shots.append(("study_note_full", pages["study_note"], (1400, 2600)))
    shots.append(("run_note_full", pages["run_note"], (1400, 2600)))
    for page, url, window in shots:
        shot = keep / f"{page}.png"
        shot.unlink(missing_ok=True)
        r = run_chromium(exe, url, profile, f"--screenshot={shot}", window=window)
        assert r.returncode == 0 and shot.is_file(), r.stderr.decode("utf-8", "replace")[-2000:]
        assert_non_blank_png(shot, window)
    # every page rendered without an error in the server (importances, plots)
    log = SERVER_LOGS["stderr"].read_text()
    assert "Traceback" not in log and "division by zero" not in log, log[-3000:]
