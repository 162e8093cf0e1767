"""The demo's data: a deterministic synthetic JPEG dataset, and an ImageFolder-like reader.

``generate`` writes photo-like JPEGs (ImageNet-like sizes, 50-150 KB) into class
folders; ``ImageFolder`` reads any such tree with an ImageNet training transform
built from Pillow and numpy only (no torchvision), so ``shmstage bench loader``
and the demo trainer measure the same decode + crop + flip work real jobs do.
"""

from __future__ import annotations

import io
import math
import os
import random
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from shmstage import system
from shmstage.errors import ShmstageError

IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".webp"})

# ImageNet-like frame sizes (most photos are 500 x 375 or 375 x 500).
_WIDTHS = (500, 500, 500, 375, 640, 333)
_HEIGHTS = (375, 375, 333, 500, 480)


@dataclass(frozen=True)
class GeneratedDataset:
    path: str  # the dataset root (class folders inside)
    images: int
    classes: int
    bytes: int  # total JPEG bytes
    seconds: float  # time to generate


def _resample(image_module: Any, name: str) -> Any:
    """``Image.Resampling.NAME`` (Pillow >= 9.1), else the old module constant (older pillow-simd)."""
    return getattr(getattr(image_module, "Resampling", image_module), name)


def _photo_like_jpeg(seed: int, index: int) -> bytes:
    """One JPEG: a smooth colour field, a few shapes, and grain (so it compresses like a photo)."""
    import numpy as np
    from PIL import Image, ImageDraw

    rng = np.random.default_rng([seed, index])
    w, h = int(rng.choice(_WIDTHS)), int(rng.choice(_HEIGHTS))
    grain = max(4, int(rng.lognormal(math.log(19), 0.3)))  # drives the file size: ~50-150 KB
    small = rng.integers(
        0, 256, size=(int(rng.integers(3, 7)), int(rng.integers(3, 7)), 3), dtype=np.uint8
    )
    base = Image.fromarray(small).resize((w, h), _resample(Image, "BICUBIC"))
    draw = ImageDraw.Draw(base)
    for _ in range(int(rng.integers(3, 9))):
        x0, y0 = int(rng.integers(0, w)), int(rng.integers(0, h))
        x1, y1 = x0 + int(rng.integers(20, w // 2)), y0 + int(rng.integers(20, h // 2))
        fill = tuple(int(c) for c in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)([x0, y0, x1, y1], fill=fill)
    fine = rng.integers(-grain, grain + 1, size=(h, w, 1), dtype=np.int16)
    coarse_small = rng.integers(0, 256, size=(h // 4, w // 4), dtype=np.uint8)
    coarse = np.asarray(
        Image.fromarray(coarse_small).resize((w, h), _resample(Image, "BILINEAR")), dtype=np.int16
    )
    pixels = np.asarray(base, dtype=np.int16) + fine + (((coarse - 128) * grain) >> 6)[..., None]
    out = io.BytesIO()
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(out, "JPEG", quality=90)
    return out.getvalue()


def image_path(root: str | os.PathLike[str], index: int, classes: int) -> Path:
    return Path(root) / f"class_{index % classes:03d}" / f"img_{index:06d}.jpg"


def generate(
    root: str | os.PathLike[str],
    *,
    images: int = 1000,
    classes: int = 10,
    seed: int = 0,
    workers: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> GeneratedDataset:
    """Write ``images`` JPEGs into ``classes`` class folders under ``root``.

    The same (images, classes, seed) gives byte-identical files with the same
    Pillow/libjpeg. ``progress(done, total)`` is called now and then.
    """
    if images < 1 or classes < 1:
        raise ShmstageError(
            f"need at least one image and one class (got {images} images, {classes} classes)"
        )
    try:
        import numpy  # noqa: F401
        import PIL  # noqa: F401
    except ImportError as e:
        raise ShmstageError(
            f"generating the demo dataset needs {e.name}: pip install 'shmstage[torch]'"
        ) from None
    start = time.perf_counter()
    root = Path(root)
    for c in range(min(classes, images)):
        (root / f"class_{c:03d}").mkdir(parents=True, exist_ok=True)

    def write(index: int) -> int:
        data = _photo_like_jpeg(seed, index)
        image_path(root, index, classes).write_bytes(data)
        return len(data)

    total = 0
    # Pillow's encoder and numpy release the GIL, so threads use every core.
    with ThreadPoolExecutor(max_workers=workers or system.usable_cpus()) as pool:
        for done, size in enumerate(pool.map(write, range(images)), 1):
            total += size
            if progress is not None and (done % 100 == 0 or done == images):
                progress(done, images)
    return GeneratedDataset(
        str(root), images, min(classes, images), total, time.perf_counter() - start
    )


# --- reading ------------------------------------------------------------------


def read_bytes(path: str | BinaryIO) -> bytes:
    """The "none" transform: read the file, decode nothing (measures pure I/O)."""
    if not isinstance(path, str):  # an open file (ImageFolder over DatasetFiles)
        return path.read()
    with open(path, "rb") as f:
        return f.read()


class Files(Protocol):
    """What ImageFolder reads through instead of the file system: ``DatasetFiles``'s API."""

    @property
    def names(self) -> Sequence[str]: ...

    def open(self, name: str) -> BinaryIO: ...


class ImagenetTrain:
    """Decode + RandomResizedCrop(size) + horizontal flip + to a normalized CHW float32 array.

    The same steps as torchvision's ImageNet training transform (scale 0.08-1,
    ratio 3/4-4/3, bilinear), with Pillow and numpy only. Randomness comes from
    :mod:`random`, which the DataLoader seeds differently in every worker.
    """

    MEAN = (0.485, 0.456, 0.406)
    STD = (0.229, 0.224, 0.225)

    def __init__(self, size: int = 224) -> None:
        self.size = size

    def crop_box(self, width: int, height: int) -> tuple[int, int, int, int]:
        area = width * height
        for _ in range(10):
            target = area * random.uniform(0.08, 1.0)
            ratio = math.exp(random.uniform(math.log(3 / 4), math.log(4 / 3)))
            w = round(math.sqrt(target * ratio))
            h = round(math.sqrt(target / ratio))
            if 0 < w <= width and 0 < h <= height:
                x, y = random.randint(0, width - w), random.randint(0, height - h)
                return x, y, x + w, y + h
        side = min(width, height)  # fallback: central square crop
        x, y = (width - side) // 2, (height - side) // 2
        return x, y, x + side, y + side

    def __call__(self, path: str | BinaryIO) -> Any:
        import numpy as np
        from PIL import Image

        with Image.open(path) as img:
            img = img.convert("RGB")
        img = img.resize(
            (self.size, self.size), _resample(Image, "BILINEAR"), box=self.crop_box(*img.size)
        )
        if random.random() < 0.5:
            img = img.transpose(getattr(Image, "Transpose", Image).FLIP_LEFT_RIGHT)
        pixels = np.asarray(img, dtype=np.float32) * (1 / 255)
        pixels = (pixels - np.asarray(self.MEAN, np.float32)) / np.asarray(self.STD, np.float32)
        return np.ascontiguousarray(pixels.transpose(2, 0, 1))


TRANSFORMS: dict[str, Callable[[int], Callable[[str], Any]]] = {
    "imagenet": ImagenetTrain,
    "none": lambda size: read_bytes,
}


class ImageFolder:
    """A map-style dataset over ``root/<class>/<image>`` (like torchvision's ImageFolder).

    Items are ``(transform(path), class_index)``; the default collate turns the
    numpy arrays into tensors, so this works with any DataLoader.  With ``files``
    (a ``shmstage.loader.DatasetFiles``: a copy still being staged) the names come
    from it and the transform gets the file it opens, from RAM or from the source.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        transform: Callable[[Any], Any] | None = None,
        files: Files | None = None,
    ) -> None:
        self.root = os.fspath(root)
        self.files = files
        self.transform = transform or ImagenetTrain()
        if files is not None:
            self._index(files.names)
            return
        if not os.path.isdir(self.root):
            raise ShmstageError(
                f"{self.root}: not a directory; pass a folder of class subfolders with images"
            )
        self.classes = sorted(
            e.name for e in os.scandir(self.root) if e.is_dir() and not e.name.startswith(".")
        )
        self.samples: list[tuple[str, int]] = []
        for index, name in enumerate(self.classes):
            for dirpath, dirnames, filenames in os.walk(os.path.join(self.root, name)):
                dirnames.sort()
                self.samples.extend(
                    (os.path.join(dirpath, f), index)
                    for f in sorted(filenames)
                    if os.path.splitext(f)[1].lower() in IMAGE_EXTENSIONS
                )
        self._check()

    def _index(self, names: Sequence[str]) -> None:
        """Samples from relative names ``<class>/.../<image>``, in the file system's order."""
        images = sorted(
            n for n in names if "/" in n and os.path.splitext(n)[1].lower() in IMAGE_EXTENSIONS
        )
        self.classes = sorted({n.split("/", 1)[0] for n in images if not n.startswith(".")})
        index = {name: i for i, name in enumerate(self.classes)}
        self.samples = [(n, index[n.split("/", 1)[0]]) for n in images if not n.startswith(".")]
        self._check()

    def _check(self) -> None:
        if not self.samples:
            raise ShmstageError(
                f"{self.root}: no images found; expected class subfolders with .jpg/.png files "
                "(the ImageFolder layout, e.g. DIR/cat/001.jpg)"
            )

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        path, target = self.samples[index]
        if self.files is None:
            return self.transform(path), target
        with self.files.open(path) as f:
            return self.transform(f), target


def make_transform(name: str, size: int = 224) -> Callable[[str], Any]:
    try:
        return TRANSFORMS[name](size)
    except KeyError:
        raise ShmstageError(
            f"unknown transform {name!r}; use one of: {', '.join(TRANSFORMS)}"
        ) from None
