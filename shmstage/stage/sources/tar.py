"""A tar archive as a source: its checked headers list it, one streaming extraction fills it
(stage/tar.py).  Not incremental: a changed archive is extracted whole, and an unchanged one
is known by its size, mtime and inode (the stamp) without reading it again."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from shmstage.errors import ShmstageError
from shmstage.stage.build import tar as tarsrc
from shmstage.stage.sources.base import Listing, Source, Tick, Want
from shmstage.stage.sources.walk import Tree, walk


class TarSource(Source):
    kind = "tar"
    incremental = False

    def __init__(self, location: str, strip_components: int = 0) -> None:
        self.location = location
        self.strip = strip_components
        self.archive: tarsrc.Archive | None = None
        self.fingerprint: list[int] = []

    def stamp(self) -> dict[str, Any]:
        st = os.stat(self.location)
        self.fingerprint = [st.st_size, st.st_mtime_ns, st.st_ino]
        return {"archive": self.fingerprint, "strip_components": self.strip}

    def listing(self) -> Listing:
        """The members as they will be extracted (the numbers inspect prints)."""
        record = self.stamp()
        archive = tarsrc.scan(self.location, self.strip)
        self.archive = archive
        return Listing(
            self.location, archive.entries(), None, archive.bytes, archive.files, record=record
        )

    def fetch(
        self,
        wants: Sequence[Want],
        root: str,
        tick: Tick,
        workers: int | None,
        checksum: bool,
        meanwhile: Callable[[], None] | None = None,
    ) -> Tree:
        """Extract the whole archive into ``root``; the tree it made, as walked."""
        assert self.archive is not None, "listing() first"
        tarsrc.extract(self.archive, root, tick)
        st = os.stat(self.location)
        if [st.st_size, st.st_mtime_ns, st.st_ino] != self.fingerprint:
            raise ShmstageError(
                f"cannot read tar archive {self.location}: it changed while it was being staged; "
                "re-run when it is stable"
            )
        return walk(root)  # also catches links that escape only in combination
