"""The view of a ``stage --partial`` copy (kind "partial" of issue 23's format 1, read by
views.py and DatasetFiles): every file of the dataset with its size, mtime and whether it is
in RAM under DEST/<name>.  Written before the part is published, removed with the copy."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from contextlib import suppress

from shmstage.stage.store import access
from shmstage.stage.store.checks import mkdir_checked
from shmstage.stage.store.layout import Store
from shmstage.stage.store.trees import rmtree

VIEWS = "views"


def view_dir(store: Store, name: str) -> str:
    return os.path.join(store.book, VIEWS, name)


def escape(rel: str) -> str:
    """A path as one field of the ``files`` list (tab, newline and % percent-encoded)."""
    return rel.replace("%", "%25").replace("\t", "%09").replace("\n", "%0A")


def write(
    store: Store, name: str, source: str, files: Iterable[tuple[str, int, int, bool]]
) -> None:
    """Write (or replace, each file atomically: ``files`` then ``view.json``) the partial
    view of ``name``; ``files``: (rel, size, mtime_ns, resident), sorted by rel.  Readable
    by who may read the copy (as its manifest), or by its stager only until it is published."""
    mkdir_checked(os.path.join(store.book, VIEWS), 0o755)
    where = view_dir(store, name)
    mkdir_checked(where, 0o755)
    top = store.path(name) if os.path.isdir(store.path(name)) else store.partial(name)
    lines = "".join(f"{escape(r)}\t{s}\t{m}\t{1 if res else 0}\n" for r, s, m, res in files)
    head = {
        "format": 1, "kind": "partial", "name": name, "source": source,
        "root": store.path(name), "final": store.path(name), "socket": None,
        "pid": None, "pid_start": None,
    }  # fmt: skip
    for entry, text in (("files", lines), ("view.json", json.dumps(head))):
        if _same(os.path.join(where, entry), text):
            continue  # unchanged: a restage of a current copy rewrites nothing
        tmp = os.path.join(where, f".{entry}.{os.getpid()}.tmp")
        with suppress(FileNotFoundError):
            os.unlink(tmp)
        fd = os.open(
            tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
        try:
            access.share_like(fd, access.bookkeeping_access(top))
            with os.fdopen(fd, "w", encoding="utf-8", errors="surrogateescape") as f:
                fd = -1
                f.write(text)
        finally:
            if fd >= 0:
                os.close(fd)
        os.rename(tmp, os.path.join(where, entry))


def _same(path: str, text: str) -> bool:
    try:
        with open(path, encoding="utf-8", errors="surrogateescape") as f:
            return f.read() == text
    except OSError:
        return False


def drop(store: Store, name: str) -> None:
    """Remove ``name``'s partial view (its copy became whole, or went)."""
    where = view_dir(store, name)
    try:
        with open(os.path.join(where, "view.json"), "rb") as f:
            kind = json.loads(f.read()).get("kind")
    except FileNotFoundError:
        return
    except (OSError, ValueError):
        kind = "partial"  # unreadable or half: not a live stager's (it writes atomically)
    if kind == "partial" and os.path.isdir(where) and not os.path.islink(where):
        rmtree(where)
