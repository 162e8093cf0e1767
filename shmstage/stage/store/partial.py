"""What sits in partial/ beside a tree being built: the source marker that lets a killed run
resume, and clearing what a finished, failed or killed run left (its partial tree, marker,
new manifest, dead trash, and a first stage's lock file when nothing else is left)."""

from __future__ import annotations

import os
from contextlib import suppress

from shmstage.stage.store.layout import Store
from shmstage.stage.store.locks import alive, trash_owner
from shmstage.stage.store.trees import listdir, rmtree


def drop_unused_lock(store: Store, name: str) -> None:
    """A failed first stage (a full tmpfs, a refusal) leaves nothing of ``name``: not even its
    lock file.  Unlinked while we hold it, as evict does (waiters then lock a new file)."""
    left = (
        store.path(name),
        store.partial(name),
        os.path.join(store.partial_dir, f".{name}.source"),
        store.meta_path(name),
        store.next_path(name),
        store.manifest_path(name),
        store.new_manifest_path(name),
    )
    with suppress(OSError):
        if not any(os.path.lexists(p) for p in left):
            store.drop_lock(name)


def clear_dead_trash(store: Store, name: str) -> None:
    for entry in listdir(store.trash_dir):
        owner, pid, start = trash_owner(entry)
        if owner == name and pid is not None and not alive(pid, start):
            rmtree(os.path.join(store.trash_dir, entry))


def drop_leftovers(store: Store, name: str, marker: str) -> None:
    """The published copy is current: what a killed run left in partial/ is of no use."""
    store.discard(store.partial(name))
    remove_marker(marker)
    with suppress(FileNotFoundError):
        os.unlink(store.new_manifest_path(name))


def write_marker(path: str, source: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8", errors="surrogateescape") as f:
        f.write(source)  # a path's bytes, UTF-8 or not


def read_marker(path: str) -> str | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, encoding="utf-8", errors="surrogateescape") as f:
        return f.read()


def remove_marker(path: str) -> None:
    with suppress(FileNotFoundError):
        os.unlink(path)


def restore_marker(path: str, source: str | None) -> None:
    if source is None:
        remove_marker(path)
    elif read_marker(path) != source:
        write_marker(path, source)
