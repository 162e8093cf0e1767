"""shmstage: stage datasets into RAM-backed tmpfs and keep GPUs fed.

The library is importable without torch; only :mod:`shmstage.loader` needs it.
"""

from __future__ import annotations

__version__ = "0.1.0"

from shmstage.errors import ShmstageError  # noqa: E402

__all__ = ["ShmstageError", "__version__"]
