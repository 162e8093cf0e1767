"""shmstage: stage datasets into RAM-backed tmpfs and keep GPUs fed.

The library is importable without torch; only :mod:`shmstage.loader` needs it.
"""

from __future__ import annotations

__version__ = "0.1.0"

from typing import TYPE_CHECKING, Any  # noqa: E402

from shmstage.errors import ShmstageError  # noqa: E402

if TYPE_CHECKING:
    from shmstage.stage.engine import lease

__all__ = ["ShmstageError", "__version__", "lease"]


def __getattr__(name: str) -> Any:
    # ``shmstage.lease`` without importing the staging engine on ``import shmstage``.
    if name == "lease":
        from shmstage.stage.engine import lease

        return lease
    raise AttributeError(f"module 'shmstage' has no attribute {name!r}")
