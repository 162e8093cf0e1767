"""Which source a user means: ``resolve`` turns what was typed into a kind and the location
the store records, and ``open_source`` gives the :class:`~shmstage.stage.sources.base.Source`
of that kind.  The one module that knows every kind (a new kind is added here).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from shmstage.errors import RefusedError
from shmstage.identity import Caller, Share, is_denied, reading_as
from shmstage.stage.sources import tarformat
from shmstage.stage.sources.base import Source
from shmstage.stage.sources.callerenv import caller_environment
from shmstage.stage.sources.directory import DirSource
from shmstage.stage.sources.walk import unreadable_by_reader

if TYPE_CHECKING:  # the object stores' modules load when one is used (http.client, ssl: 25 ms)
    from shmstage.stage.sources.s3store import S3Url

# Schemes of object stores (docs/object-stores.md); Azure's other spellings (obstore's and
# fsspec's: azure, abfs, abfss, adl) are recorded as az://.  A kind is its recorded scheme.
URL_SCHEMES = ("s3", "gs", "az", "azure", "abfs", "abfss", "adl")
LISTED_KINDS = ("s3", "gs", "az")


def is_url(raw: str) -> bool:
    scheme, sep, _ = raw.partition("://")
    return bool(sep) and scheme.isalnum()


def resolve(raw: str, reader: Caller | None = None) -> tuple[str, str]:
    """``(kind, location)`` for what the user typed: ``dir`` / ``tar`` with the real path,
    or an object-store kind with its normalized URL.  Refuses what cannot be a source.
    ``reader``: the path is looked up (and an archive's first bytes read) with the reader's
    file-system ids, so what it is is told only to someone who may read it."""
    if is_url(raw):
        scheme = raw.partition("://")[0].lower()
        if scheme not in URL_SCHEMES:
            raise RefusedError(
                f"unknown source scheme {scheme}:// in {raw}: use a path, s3://, gs:// or az://"
            )
        where = _parse(scheme, raw)
        return where.scheme, where.url
    checked = reader is not None and not reader.is_root
    with reading_as(reader):
        source = os.path.realpath(raw)
        try:
            st = os.stat(source)
        except OSError as e:
            if checked and is_denied(e):
                raise unreadable_by_reader(raw, e.strerror or "") from None
            raise RefusedError(f"source {raw} does not exist") from None
        if checked and not stat.S_ISDIR(st.st_mode):  # a file: may the reader open it?
            try:
                os.close(os.open(source, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC))
            except OSError as e:
                if is_denied(e):
                    raise unreadable_by_reader(raw, e.strerror or "") from None
        if stat.S_ISDIR(st.st_mode):
            return "dir", source
        tarformat.detect(source, raw)  # by content, not name; says what else the file is
    return "tar", source


def location_of(raw: str) -> str:
    """What the store records for ``raw`` (no checks): a URL normalized, a path made real."""
    scheme = raw.partition("://")[0].lower()
    if is_url(raw) and scheme in URL_SCHEMES:
        return _parse(scheme, raw).url
    return os.path.realpath(raw)


def _parse(scheme: str, raw: str) -> S3Url:
    """The object-store URL in ``raw``, parsed by its store's module."""
    from shmstage.stage.sources import azure, gcs, s3store

    if scheme == "s3":
        return s3store.parse(raw)
    if scheme == "gs":
        return gcs.parse(raw)
    return azure.parse(raw)


def open_listed(
    kind: str,
    location: str,
    reader: Caller | None = None,
    credentials: Mapping[str, str] | None = None,
    share: Share | None = None,
) -> Source:
    """The ``Source`` behind a listed kind's location.  With a reader or ``credentials``, the
    store is opened with the caller's credentials only (s3store.caller_environment) and the
    copy is the reader's, shared as ``share`` says."""
    from shmstage.stage.sources import azure, gcs, s3

    cls = {"gs": gcs.GCSSource, "az": azure.AzureSource, "s3": s3.S3Source}[kind]
    if reader is None and credentials is None:
        return cls(location)
    with caller_environment(credentials, reader):
        src = cls(location)
    src.readable_by(reader, share)
    return src


def open_source(
    kind: str,
    location: str,
    strip_components: int = 0,
    peers: Any = None,
    reader: Caller | None = None,
    credentials: Mapping[str, str] | None = None,
    share: Share | None = None,
) -> Source:
    """The ``Source`` behind ``resolve``'s answer (``peers``: a directory read with other nodes;
    ``reader``: whose file-system ids read it; ``credentials``: an object store's, instead of
    this process's environment; ``share``: who else may read an object-store copy)."""
    if reader is not None and reader.is_root:
        reader = None
    if kind == "dir":
        return DirSource(location, peers, reader)
    if kind == "tar":
        from shmstage.stage.sources.tar import TarSource  # archives only

        return TarSource(location, strip_components, reader)
    return open_listed(kind, location, reader, credentials, share)
