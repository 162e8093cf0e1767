"""The C library through ctypes, loaded once for the whole process (prctl, renameat2,
mmap/mincore, unshare/mount). Each caller sets argtypes only for the functions it calls."""

from __future__ import annotations

import ctypes
import functools


@functools.cache
def load_libc() -> ctypes.CDLL:
    """This process's C library, with errno kept for ``ctypes.get_errno()``; raises OSError
    where there is none to load (callers that can do without catch it)."""
    return ctypes.CDLL(None, use_errno=True)
