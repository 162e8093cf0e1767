"""The view of a dataset not (all) in RAM (issue 23, format 1): ``DEST/.shmstage/views/<name>/``
with ``view.json``, ``files`` and, for a copy still running, ``landed``.  Read-only here.

STUB by helper B (the job side) until helper A's views.py (the writer and this reader) lands.
"""

from __future__ import annotations

import json
import os
from typing import Any

from shmstage.errors import ShmstageError
from shmstage.stage.store.layout import Store
from shmstage.stage.store.locks import running


class _Entry(tuple):
    __slots__ = ()
    rel = property(lambda self: self[0])
    size = property(lambda self: self[1])
    mtime_ns = property(lambda self: self[2])
    resident = property(lambda self: self[3])


class View:
    """A dataset not (all) in RAM: ``DEST/.shmstage/views/<name>/``."""

    def __init__(self, directory: str, meta: dict[str, Any], files: list[_Entry]) -> None:
        self.dir = directory
        self.kind: str = meta["kind"]
        self.name: str = meta["name"]
        self.source: str = meta["source"]
        self.root: str = meta["root"]
        self.final: str = meta["final"]
        self.socket: str | None = meta.get("socket")
        self.pid: int | None = meta.get("pid")
        self.pid_start: int | None = meta.get("pid_start")
        self.files = files

    def alive(self) -> bool:
        """Whether the stager that wrote this view still runs (pid and start time)."""
        return (
            self.pid is not None
            and self.pid_start is not None
            and running(self.pid, self.pid_start)
        )


def _unescape(rel: str) -> str:
    if "%" not in rel:
        return rel
    return rel.replace("%09", "\t").replace("%0A", "\n").replace("%0a", "\n").replace("%25", "%")


def read_view(dest: str, name: str) -> View | None:
    """The view of ``name`` in the store at ``dest``, or None when it has none."""
    directory = os.path.join(Store(dest).book, "views", name)
    try:
        with open(os.path.join(directory, "view.json"), "rb") as f:
            meta = json.loads(f.read())
        with open(os.path.join(directory, "files"), "rb") as f:
            text = f.read().decode("utf-8", "surrogateescape")
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ShmstageError(f"cannot read the view of {name} in {dest}: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != 1:
        raise ShmstageError(f"the view of {name} in {dest} is not one this shmstage reads")
    files = []
    for line in text.splitlines():
        rel, size, mtime, resident = line.split("\t")
        files.append(_Entry((_unescape(rel), int(size), int(mtime), resident == "1")))
    return View(directory, meta, files)
