"""A local directory as a source: a threaded walk (walk.py) lists it; its owners and groups
are read through the top the walk opened (beneath.SourceTree), never by path again.

build/fromdir.py fills its files (the forked copier, or with peers the cluster exchange),
and makes its first copy while the walk runs.  Where the stager is root, copies keep owners
like ``cp -a``.
"""

from __future__ import annotations

import errno
import os
from typing import Any

from shmstage.errors import ShmstageError
from shmstage.identity import Caller, is_denied
from shmstage.stage.sources.base import Listing, Source
from shmstage.stage.sources.beneath import SOURCE_TOP, SourceTree, split_ident
from shmstage.stage.sources.owners import keeps_owner, stager_groups
from shmstage.stage.sources.walk import Tree, scan_threads, unreadable_by_reader, walk


class DirSource(Source):
    """A directory, walked once; build/fromdir.py copies what the walk found."""

    kind = "dir"

    def __init__(self, location: str, peers: Any = None, reader: Caller | None = None) -> None:
        self.location = location
        self.peers = peers  # a cluster.Peers: each node reads a share, they exchange the rest
        # whose file-system ids every read of the source uses (the walk, the copier's opens,
        # owners' lstats): the caller of the node service; None: this process's own
        self.reader = reader
        self.prefix = location.rstrip("/") + "/"
        self.own = keeps_owner()  # root copies like `cp -a`: every entry keeps its owner
        # a user's copies keep the source's group where it is one of the user's, else they get
        # no group bits (the walk clears them)
        self.groups = None if self.own else stager_groups()
        # entries record their ACLs and the copy gets them verbatim (acls.py): staging sets
        # it where root stages onto a DEST that takes ACLs
        self.acls = False
        self.tree: Tree | None = None
        # the top, opened once before the walk and kept till the end: owners, groups and the
        # cluster's reads come through the very directory the walk listed, never by path again
        self._below: SourceTree | None = None

    def __del__(self) -> None:
        if self._below is not None:
            self._below.close()

    def top(self) -> SourceTree:
        """The source's top as the walk opens it (once; kept for the whole stage)."""
        if self._below is None:
            try:
                self._below = SourceTree(self.location, reader=self.reader)
            except OSError as e:
                if self.reader is not None and is_denied(e):
                    raise unreadable_by_reader(self.location, e.strerror or "") from None
                raise ShmstageError(f"cannot read {self.location}: {e.strerror}") from None
        return self._below

    def listing(self) -> Listing:
        tree = walk(
            self.location,
            threads=scan_threads(self.location),
            idents=True,
            groups=self.groups,
            top=self.top(),
            acls=self.acls,
        )
        self.tree = tree
        return Listing(
            tree.root,
            tree.entries,
            None,
            tree.bytes,
            tree.files,
            tree.atimes,
            {SOURCE_TOP: split_ident(tree.top)},  # verify reads through this top only
        )

    def owner(self, rel: str) -> os.stat_result | None:
        if not self.own:
            return None
        return self.lstat(rel)

    def group(self, rel: str) -> int | None:
        if self.groups is None:
            return None
        gid = self.lstat(rel).st_gid
        return gid if gid in self.groups else None

    def lstat(self, rel: str) -> os.stat_result:
        """The source entry's lstat, never through a directory swapped for a symlink since."""
        try:
            return self.top().lstat(rel)
        except OSError as e:
            if self.reader is not None and is_denied(e):
                raise unreadable_by_reader(self.prefix + rel, e.strerror or "") from None
            raise replaced(self.prefix + rel, e) from None


def replaced(path: str, e: OSError | None) -> ShmstageError:
    """An entry reached through what is no longer the walked tree (a directory swapped for a
    symlink since): refused, as the copier refuses it."""
    if e is not None and e.errno not in (errno.ELOOP, errno.ENOTDIR, errno.EXDEV):
        return ShmstageError(f"cannot read source entry {path}: {e.strerror}")
    return ShmstageError(
        f"source entry {path} is not what the scan found: a directory on its path was replaced "
        "(by a symlink or another directory) since; nothing was published: re-run when the "
        "source is stable, and check who can change it"
    )
