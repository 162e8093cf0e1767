"""What a dataset is read from: a local directory, a tar archive or an object-store prefix.

``resolve`` turns what the user typed into a kind and the location the store records.  A
listed source (an object-store prefix; later the cluster exchange) implements ``Source``:
``listing`` says what the tree holds (plan.py's entry tuples plus a change key per file) and
``fetch`` fills files into open files under partial/<name>.  The engine (lock, fit, partial,
publish, manifest) is written once above it (stage/listed.py).  The directory and the tar
archive keep their own fill paths, the forked sendfile copier (stage/copy.py) and the
streaming extractor (stage/tar.py): the same listing/fill split, with the fast paths kept.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from shmstage.errors import RefusedError
from shmstage.stage import tarformat

# Schemes of object stores (docs/object-stores.md); Azure's other spellings (obstore's and
# fsspec's: azure, abfs, abfss, adl) are recorded as az://.  A kind is its recorded scheme.
URL_SCHEMES = ("s3", "gs", "az", "azure", "abfs", "abfss", "adl")
LISTED_KINDS = ("s3", "gs", "az")

Tick = Callable[[int, int], None]  # (bytes, files) just written


@dataclass(frozen=True)
class Listing:
    """A listed source: the tree it stages to and what identifies each file's content."""

    location: str  # what the store records as the source (a URL without credentials)
    entries: list[tuple]  # (path, kind, size, mtime_ns, mode, extra), "." first, parents first
    keys: dict[str, list[Any]]  # file path -> change key (equal keys: same bytes)
    bytes: int
    files: int


@dataclass(frozen=True)
class Want:
    """One file to fetch into partial/: ``path`` relative to the tree's root."""

    path: str
    size: int
    mtime_ns: int  # set once the last byte is in (what makes a file count as done)
    mode: int
    key: list[Any]  # its change key from the listing (fetch refuses other content)


class Source(Protocol):
    kind: str
    location: str

    def listing(self) -> Listing: ...

    def fetch(
        self, wants: Sequence[Want], root: str, tick: Tick, workers: int | None, checksum: bool
    ) -> None:
        """Write every wanted file under ``root`` (its directories exist), then set its mode
        and mtime; raise a ShmstageError (nothing half-fetched counts as done) on failure."""


def is_url(raw: str) -> bool:
    scheme, sep, _ = raw.partition("://")
    return bool(sep) and scheme.isalnum()


def resolve(raw: str) -> tuple[str, str]:
    """``(kind, location)`` for what the user typed: ``dir`` / ``tar`` with the real path,
    or an object-store kind with its normalized URL.  Refuses what cannot be a source."""
    if is_url(raw):
        scheme = raw.partition("://")[0].lower()
        if scheme not in URL_SCHEMES:
            raise RefusedError(
                f"unknown source scheme {scheme}:// in {raw}: use a path, s3://, gs:// or az://"
            )
        where = _parse(scheme, raw)
        return where.scheme, where.url
    source = os.path.realpath(raw)
    if not os.path.exists(source):
        raise RefusedError(f"source {raw} does not exist")
    if os.path.isdir(source):
        return "dir", source
    tarformat.detect(source, raw)  # by content, not name; says what else the file is
    return "tar", source


def location_of(raw: str) -> str:
    """What the store records for ``raw`` (no checks): a URL normalized, a path made real."""
    scheme = raw.partition("://")[0].lower()
    if is_url(raw) and scheme in URL_SCHEMES:
        return _parse(scheme, raw).url
    return os.path.realpath(raw)


def _parse(scheme: str, raw: str) -> Any:
    """The object-store URL (s3.S3Url) in ``raw``, parsed by its store's module."""
    if scheme == "s3":
        from shmstage.stage.s3 import parse
    elif scheme == "gs":
        from shmstage.stage.gcs import parse
    else:
        from shmstage.stage.azure import parse
    return parse(raw)


def open_listed(kind: str, location: str) -> Source:
    """The ``Source`` behind a listed kind's location."""
    if kind == "gs":
        from shmstage.stage.gcs import GCSSource

        return GCSSource(location)
    if kind == "az":
        from shmstage.stage.azure import AzureSource

        return AzureSource(location)
    from shmstage.stage.s3 import S3Source

    assert kind == "s3", kind
    return S3Source(location)
