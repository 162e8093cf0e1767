"""Which source a user means: ``resolve`` turns what was typed into a kind and the location
the store records, and ``open_source`` gives the :class:`~shmstage.stage.sources.base.Source`
of that kind.  The one module that knows every kind (a new kind is added here).
"""

from __future__ import annotations

import os
from typing import Any

from shmstage.errors import RefusedError
from shmstage.stage.sources import azure, gcs, s3, s3store, tarformat
from shmstage.stage.sources.base import Source
from shmstage.stage.sources.directory import DirSource
from shmstage.stage.sources.tar import TarSource

# Schemes of object stores (docs/object-stores.md); Azure's other spellings (obstore's and
# fsspec's: azure, abfs, abfss, adl) are recorded as az://.  A kind is its recorded scheme.
URL_SCHEMES = ("s3", "gs", "az", "azure", "abfs", "abfss", "adl")
LISTED_KINDS = ("s3", "gs", "az")


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


def _parse(scheme: str, raw: str) -> s3store.S3Url:
    """The object-store URL in ``raw``, parsed by its store's module."""
    if scheme == "s3":
        return s3store.parse(raw)
    if scheme == "gs":
        return gcs.parse(raw)
    return azure.parse(raw)


def open_listed(kind: str, location: str) -> Source:
    """The ``Source`` behind a listed kind's location."""
    if kind == "gs":
        return gcs.GCSSource(location)
    if kind == "az":
        return azure.AzureSource(location)
    assert kind == "s3", kind
    return s3.S3Source(location)


def open_source(kind: str, location: str, strip_components: int = 0, peers: Any = None) -> Source:
    """The ``Source`` behind ``resolve``'s answer (``peers``: a directory read with other nodes)."""
    if kind == "dir":
        return DirSource(location, peers)
    if kind == "tar":
        return TarSource(location, strip_components)
    return open_listed(kind, location)
