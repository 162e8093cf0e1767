"""How much of a file set is in the page cache (mincore), and dropping it (fadvise), so the
demo's original run reads from disk, not RAM."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence

from shmstage.libc import load_libc


def _libc() -> ctypes.CDLL:
    libc = load_libc()
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    return libc


def cached_share(paths: Sequence[str]) -> float | None:
    """The share of these files' pages in the page cache (mincore), None if it cannot be read."""
    try:
        libc = _libc()
    except (OSError, AttributeError):
        return None
    page = os.sysconf("SC_PAGE_SIZE")
    resident = total = 0
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                continue
            addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED: touches no page
            if addr in (None, ctypes.c_void_p(-1).value):
                return None
            pages = (size + page - 1) // page
            vec = ctypes.create_string_buffer(pages)
            ok = libc.mincore(addr, size, vec) == 0
            libc.munmap(addr, size)
            if not ok:
                return None
            resident += sum(b & 1 for b in vec.raw)
            total += pages
        finally:
            os.close(fd)
    return resident / total if total else None


def evict_from_page_cache(paths: Sequence[str]) -> None:
    """Drop these files' clean pages from the page cache (no root needed; other files untouched)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
