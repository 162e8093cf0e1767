"""``verify`` in one store: compare a published copy with its manifest and, with ``checksum``,
every byte with its source (a directory, a tar archive, or the ETags of an object store)."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from shmstage.errors import RefusedError, ShmstageError
from shmstage.identity import Caller, is_denied, reading_as
from shmstage.stage.build import copier
from shmstage.stage.sources import kinds as sources
from shmstage.stage.sources.beneath import SOURCE_TOP, SourceTree, join_ident
from shmstage.stage.sources.walk import unreadable_by_reader, walk
from shmstage.stage.store import access
from shmstage.stage.store.layout import Store
from shmstage.stage.store.names import check_name

VERIFY_MODES = ("size", "checksum")  # stage --verify: what the copy is checked with


@dataclass(frozen=True)
class Difference:
    path: str
    problem: str  # "missing", "extra", "changed", "content"
    detail: str = ""


@dataclass(frozen=True)
class VerifyReport:
    name: str
    path: str
    source: str
    checksum: bool
    files: int  # regular files checked
    ok: bool
    differences: list[Difference] = field(default_factory=list)


def verify(
    name: str,
    dest: str | os.PathLike[str] | None = None,
    checksum: bool = False,
    *,
    workers: int | None = None,
    reader: Caller | None = None,
    credentials: Mapping[str, str] | None = None,
) -> VerifyReport:
    """Compare DEST/<name> with its manifest (and, with ``checksum``, every byte with the
    source, read with ``reader``'s file-system ids: verify is no oracle on files the reader
    cannot read).  ``credentials``: unused (an object store is compared with its ETags as
    recorded), accepted as stage accepts them."""
    if reader is not None and reader.is_root:
        reader = None
    store = Store(dest)
    record = (
        store.open(create=False).published(check_name(name))
        if os.path.lexists(store.book)
        else None
    )
    manifest = store.manifest_for(record) if record else None
    if record is None or manifest is None:
        raise ShmstageError(f"{name} is not staged in {store.dest} (see `shmstage list`)")
    path = store.path(name)
    expected = {e[0]: _norm(e) for e in manifest["entries"]}
    # with the ACLs a copy may carry (acls.py): one that has lost or gained any is changed
    copied = walk(path, check_links=False, hardlinks=False, acls=True)
    actual = {e[0]: _norm(list(e)) for e in copied.entries}
    if "." in actual:  # users let in through a restricted top (access.grant) change no mode
        actual["."][4] = access.without_grants(path, actual["."][4])
    diffs: list[Difference] = []
    for rel, want in expected.items():
        have = actual.get(rel)
        if have is None:
            diffs.append(Difference(rel, "missing"))
        elif have != want and not (
            rel == "." and have[:4] == want[:4] and access.is_restriction(want[4], have[4])
        ):
            diffs.append(Difference(rel, "changed", _what_changed(want, have)))
    for rel in actual:
        if rel not in expected:
            diffs.append(Difference(rel, "extra"))
    files = sum(1 for e in expected.values() if e[1] == "f")
    if checksum:
        damaged = {d.path for d in diffs}
        if record.kind == "tar":
            _source_there(record.source, stat.S_ISREG, reader)
            from shmstage.stage.sources import tar as tarsrc  # archives only

            bad = tarsrc.compare(record.source, path, manifest.get("strip_components", 0), reader)
        elif record.kind in sources.LISTED_KINDS:  # against the ETags: no download
            from shmstage.stage.sources import s3

            bad = s3.compare(manifest, path)
        else:
            _source_there(record.source, stat.S_ISDIR, reader)
            top = _verified_top(record.source, manifest, reader)
            if reader is not None:  # every file readable by the reader, or one refusal line
                with top:
                    try:
                        walk(record.source, top=top)
                    except RefusedError as e:  # the walk's words are stage's: not "staged"
                        raise RefusedError(str(e).removesuffix(": nothing staged")) from None
                top = _verified_top(record.source, manifest, reader)
            jobs = [
                (
                    os.path.join(record.source, rel),
                    os.path.join(path, rel),
                    e[2],
                    e[3],
                    0,
                    e[4],
                    rel,
                )
                for rel, e in expected.items()
                if e[1] == "f" and rel not in damaged
            ]
            with top:  # the workers read below this very directory (inherited), never the path
                tops = {record.source.rstrip("/") + "/": top}
                bad = copier.compare(jobs, workers or copier.default_workers(), tops)
        diffs.extend(
            Difference(rel, "content", "bytes differ from the source")
            for rel in sorted(set(bad))
            if rel not in damaged
        )
    diffs.sort(key=lambda d: d.path)
    return VerifyReport(name, path, record.source, checksum, files, not diffs, diffs)


def _source_there(source: str, kind: Callable[[int], bool], reader: Caller | None) -> None:
    """The recorded source is still there, as ``reader`` sees it: a path they may not reach
    is their refusal ("you cannot read ..."), never "gone" (which it may not be)."""
    with reading_as(reader):
        try:
            mode: int | None = os.stat(source).st_mode
        except OSError as e:
            if is_denied(e):
                raise RefusedError(
                    f"you cannot read {source} at the source ({e.strerror or 'Permission denied'})"
                ) from None
            mode = None
    if mode is None or not kind(mode):
        raise ShmstageError(f"cannot compare checksums: the source {source} is gone")


def _verified_top(source: str, manifest: dict[str, Any], reader: Caller | None) -> SourceTree:
    """The source's top for verify --checksum, opened once: the directory the stage walked
    (its [dev, ino] in the manifest), else at least no symlink in its place (a manifest of
    an older stage): a top swapped for another directory would make verify an oracle on
    files its owner cannot read."""
    recorded = manifest.get(SOURCE_TOP)
    try:
        if recorded:
            return SourceTree(source, join_ident(recorded), reader)
        if os.path.islink(source.rstrip("/")):
            raise OSError(errno.ELOOP, "a symlink", source)
        return SourceTree(source, reader=reader)
    except OSError as e:
        if reader is not None and is_denied(e):
            raise unreadable_by_reader(source, e.strerror or "") from None
        if e.errno in (errno.EXDEV, errno.ELOOP, errno.ENOTDIR):
            raise ShmstageError(
                f"cannot compare checksums: the source {source} is not the directory that was "
                "staged (replaced since, by a symlink or another directory); re-stage it, and "
                "check who can change it"
            ) from None
        raise ShmstageError(
            f"cannot compare checksums: cannot read {source}: {e.strerror}"
        ) from None


def _norm(e: list[Any]) -> list[Any]:
    rel, kind, size, mtime, mode, extra = e
    if kind == "h":
        return [rel, "f", size, mtime, mode, None]
    if kind == "d":
        return [rel, "d", 0, 0, mode, None]  # a directory's mtime is not data
    return [rel, kind, size, mtime, mode, extra]


def _what_changed(want: list[Any], have: list[Any]) -> str:
    if want[1] != have[1]:
        kinds = {"f": "file", "d": "directory", "l": "symlink"}
        return f"{kinds.get(want[1], want[1])} became a {kinds.get(have[1], have[1])}"
    parts = []
    if want[2] != have[2]:
        parts.append(f"size {want[2]} -> {have[2]}")
    if want[3] != have[3]:
        parts.append("mtime")
    if want[4] != have[4]:
        parts.append(f"mode {want[4]:o} -> {have[4]:o}")
    if want[5] != have[5]:
        parts.append("ACL" if want[1] in ("f", "d") else f"target {want[5]} -> {have[5]}")
    return ", ".join(parts)
