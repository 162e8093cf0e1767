"""``FolderDataset``: torchvision's ImageFolder layout (one class per top-level directory)
read through ``DatasetFiles``, so it works on a copy still being staged or only partly in RAM.
No torch or torchvision import: a map-style dataset is ``__len__`` and ``__getitem__``."""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Iterable
from typing import Any

from shmstage.datasetfiles import DatasetFiles

__all__ = ["FolderDataset", "decode_image"]


def decode_image(data: bytes) -> Any:
    """The file's bytes as an RGB PIL image (what ImageFolder's default loader gives)."""
    from PIL import Image  # optional dependency: only a dataset that decodes needs it

    with Image.open(io.BytesIO(data)) as im:
        return im.convert("RGB")


class FolderDataset:
    """``ROOT/<class>/**/<file>`` -> ``(sample, class_index)``; ``sample`` is the file's bytes,
    or ``transform(bytes)`` (e.g. ``decode_image`` then torchvision transforms).  Files at
    the top level are not samples; ``extensions`` (".jpg", ...) keeps only those files.
    Unlike ImageFolder, symlinks are not followed (``DatasetFiles.names``: regular files, as
    the stager lists a copy; the ones skipped are warned of)."""

    def __init__(
        self,
        root: str | os.PathLike[str] | DatasetFiles,
        transform: Callable[[bytes], Any] | None = None,
        target_transform: Callable[[int], Any] | None = None,
        extensions: Iterable[str] | None = None,
    ) -> None:
        self.files = root if isinstance(root, DatasetFiles) else DatasetFiles(root)
        self.path = self.files.path  # make_loader leases what it finds here
        keep = tuple(e.lower() for e in extensions) if extensions is not None else None
        samples = [
            n for n in self.files.names if "/" in n and (keep is None or n.lower().endswith(keep))
        ]
        self.classes = sorted({n.split("/", 1)[0] for n in samples})
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        self.samples = [(n, self.class_to_idx[n.split("/", 1)[0]]) for n in samples]
        self.targets = [t for _, t in self.samples]
        self.transform = transform
        self.target_transform = target_transform

    def __len__(self) -> int:
        return len(self.samples)

    def want(self, indices: Iterable[int]) -> None:
        """A hint that these samples are read soon (``DatasetFiles.want``; make_loader)."""
        self.files.want(self.samples[i][0] for i in indices)

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        name, target = self.samples[index]
        sample: Any = self.files.read(name)
        if self.transform is not None:
            sample = self.transform(sample)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return sample, target
