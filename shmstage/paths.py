"""Path relations the library checks in several places, written once."""

from __future__ import annotations


def is_within(path: str, root: str) -> bool:
    """``path`` is ``root`` or lies below it. Plain string logic on normalized paths: resolve
    symlinks first (os.path.realpath) where that matters."""
    return path == root or path.startswith(root.rstrip("/") + "/")
