"""Path relations the library checks in several places, written once."""

from __future__ import annotations

import os


def is_within(path: str, root: str) -> bool:
    """``path`` is ``root`` or lies below it. Plain string logic on normalized paths: resolve
    symlinks first (os.path.realpath) where that matters."""
    return path == root or path.startswith(root.rstrip("/") + "/")


# Mounts the system owns: the store's own tmpfs must never be one of them, nor lie beneath
# those whose whole tree is the system's (a remount or chmod there breaks every user's
# /dev/shm, /tmp or runtime directory).
_SYSTEM_EXACT = ("/", "/run", "/tmp", "/var/tmp")
_SYSTEM_TREES = ("/dev", "/proc", "/sys", "/run/user", "/run/lock", "/run/shm", "/run/shmstage")


def system_mount(path: str) -> str | None:
    """The system directory ``path`` is or lies in, when it may not hold a mount of ours
    (compare a resolved ``path``: each such directory is checked as spelled and resolved)."""
    for root in _SYSTEM_EXACT:
        if path in {root, os.path.realpath(root)}:
            return root
    for root in _SYSTEM_TREES:
        if is_within(path, root) or is_within(path, os.path.realpath(root)):
            return root
    return None
