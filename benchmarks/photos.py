"""Real photographs as model inputs: crops of the pictures scikit-image ships (no download),
preprocessed as each model of ``real_models.py`` expects (its ``inputs`` kind), split into a
calibration set and a held-out set the tune never sees.

Calibration: printed text (``text``, every other crop) and natural photos (``astronaut``,
``coffee``, ``chelsea``); held out: another printed page (``page``, every other crop) and a
natural photo (``rocket``). A detector gets square-ish crops of the picture scaled to cover its
input (a printed picture much smaller than the input is first tiled into a page at print size,
so a page detector's crops hold lines of text); a text line classifier gets horizontal strips.

    python benchmarks/photos.py ppocr-det --out /tmp/ppocr   # calibration.npz, heldout.npz
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import real_models

#: every other crop printed text (``text``), the rest natural photos
CALIBRATION = ("text", "astronaut", "text", "coffee", "text", "chelsea")
#: every other crop another printed page (``page``), the rest a natural photo
HELD_OUT = ("page", "rocket")
#: printed text among them (text-line classifiers read strips of these only); a page-sized
#: input gets these tiled at print size (a few zooms), not one line blown up to fill it: a
#: text detector's map of a crop with no text is ~1e-7 everywhere, where cosine and relative
#: L2 measure nothing
TEXT = ("text", "page")
#: the print size (zoom range) at which a page-sized input shows each printed picture so that a
#: text detector finds its text: PP-OCRv4's detector finds the lines of ``page`` at 1-2x and
#: the large curved letters of ``text`` only from 3.5x on (no text pixel at 1-3x)
PRINT_ZOOM = {"text": (3.5, 5.0), "page": (1.0, 2.0)}


def picture(name: str) -> np.ndarray:
    """A scikit-image picture as float RGB in 0..255, HxWx3."""
    from skimage import data

    img = np.asarray(getattr(data, name)(), dtype=np.float32)
    if img.ndim == 2:
        img = np.repeat(img[..., None], 3, axis=2)
    return img[..., :3]


def crops(names, height: int, width: int, samples: int, seed: int) -> list[np.ndarray]:
    """``samples`` crops of ``height`` x ``width`` (HxWx3, 0..255), taken in turn from each
    picture scaled so that it covers the crop (at a random extra zoom of 1-1.6x)."""
    from skimage.transform import resize

    rng = np.random.default_rng(seed)
    out = []
    for k in range(samples):
        img = picture(names[k % len(names)])
        if names[k % len(names)] in TEXT and min(height, width) > 2 * min(img.shape[:2]):
            img = _page(img, height, width, rng, PRINT_ZOOM[names[k % len(names)]])
        zoom = max(height / img.shape[0], width / img.shape[1])
        zoom *= 1.0 if img.shape[:2] == (height, width) else rng.uniform(1.0, 1.6)
        h, w = max(height, round(img.shape[0] * zoom)), max(width, round(img.shape[1] * zoom))
        big = resize(img, (h, w), preserve_range=True, anti_aliasing=True)
        y, x = rng.integers(0, h - height + 1), rng.integers(0, w - width + 1)
        out.append(big[y:y + height, x:x + width].astype(np.float32))
    return out


def _page(img: np.ndarray, height: int, width: int, rng, zoom: tuple[float, float]
          ) -> np.ndarray:
    """A printed picture tiled into a page that covers ``height`` x ``width`` at a print size
    drawn from ``zoom``, from a random offset (lines of text as a page-sized input shows
    them)."""
    from skimage.transform import rescale

    img = rescale(img, rng.uniform(*zoom), channel_axis=2, preserve_range=True,
                  anti_aliasing=True)
    reps = (height // img.shape[0] + 2, width // img.shape[1] + 2, 1)
    tiled = np.tile(img, reps)
    y, x = rng.integers(0, img.shape[0]), rng.integers(0, img.shape[1])
    return tiled[y:y + height, x:x + width].astype(np.float32)


def _imagenet(img: np.ndarray) -> np.ndarray:
    mean, std = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])
    return ((img / 255.0 - mean) / std).transpose(2, 0, 1)


PREPROCESS = {  # a real_models input kind -> HxWx3 0..255 crop -> one sample
    "page": lambda im: ((im / 255.0 - 0.5) / 0.5).transpose(2, 0, 1),
    "textline": lambda im: ((im / 255.0 - 0.5) / 0.5).transpose(2, 0, 1),
    "scene01": lambda im: (im / 255.0).transpose(2, 0, 1),
    "scene255": lambda im: im.transpose(2, 0, 1),
    "document": _imagenet,
    "imagenet": _imagenet,
    "bgr_nhwc": lambda im: im[..., ::-1] - np.array([104.0, 117.0, 123.0]),
    "face_nhwc": lambda im: (im - 127.5) / 128.0,
}


def photo_feeds(name: str, split: str, samples: int, seed: int = 0) -> dict[str, np.ndarray]:
    """``samples`` photo inputs for model ``name`` (``split``: calibration or heldout)."""
    kind = real_models.MODELS[name].inputs
    if kind not in PREPROCESS:
        raise SystemExit(f"{name}: its inputs ({kind}) are not pictures")
    (key, shape), = list(real_models.shapes_of(name).items())[:1]
    nhwc = kind.endswith("nhwc")
    height, width = (shape[1], shape[2]) if nhwc else (shape[2], shape[3])
    names = CALIBRATION if split == "calibration" else HELD_OUT
    if kind == "textline":
        names = tuple(n for n in names if n in TEXT)
    batch = [PREPROCESS[kind](c) for c in crops(names, height, width, samples, seed)]
    return {key: np.stack(batch).astype(np.float32)}


def saved_feeds(name: str, folder: Path, calibration: int = 16, held_out: int = 8
                ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """``name``'s calibration and held-out photo inputs, also saved as
    ``folder/calibration.npz`` and ``folder/heldout.npz``."""
    folder.mkdir(parents=True, exist_ok=True)
    cal = photo_feeds(name, "calibration", calibration, 0)
    held = photo_feeds(name, "heldout", held_out, 1)
    np.savez(folder / "calibration.npz", **cal)
    np.savez(folder / "heldout.npz", **held)
    return cal, held


def write(name: str, folder: Path, calibration: int = 16, held_out: int = 8) -> Path:
    """``folder/calibration.npz`` and ``folder/heldout.npz`` for ``name``; returns the model."""
    saved_feeds(name, folder, calibration, held_out)
    return real_models.fetch(name, None)


def every_point(name: str, folder: Path, held_out: int = 8):
    """``name`` written with its photo sets into ``folder`` and prepared for ONNX Runtime:
    (calibration feeds, held-out feeds, the prepared model, its exporter with scales made as a
    run makes them, the plan with every candidate point on)."""
    from qdq_optuna.model import calibration
    from qdq_optuna.runtimes.prepared import PreparedModel

    path = write(name, folder, held_out=held_out)
    cal = dict(np.load(folder / "calibration.npz"))
    held = dict(np.load(folder / "heldout.npz"))
    pm = PreparedModel.prepare(str(path), runtime="onnxruntime",
                               input_shapes=real_models.MODELS[name].input_shapes)
    stats = calibration.collect_statistics(pm.graph.full_model(), pm.candidate_tensors(), cal)
    exporter = pm.exporter(pm.run_scales(stats))
    uses = set()
    for pp in pm.tunable:
        uses |= pp.uses(pp.ids)
    return cal, held, pm, exporter, exporter.plan(uses), path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", choices=sorted(n for n, m in real_models.MODELS.items()
                                            if m.inputs in PREPROCESS))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--calibration", type=int, default=16)
    ap.add_argument("--held-out", type=int, default=8)
    args = ap.parse_args(argv)
    path = write(args.model, args.out, args.calibration, args.held_out)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
