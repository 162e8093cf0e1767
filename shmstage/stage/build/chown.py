"""The one rule for a copy's owner and group, on every path that writes one (the copier's
workers, directories and symlinks of partial/<name>, the cluster exchange): root gives the
source's owner (like ``cp -a``); a user keeps a source's group only where it is one of hers.
"""

from __future__ import annotations

import os

from shmstage import system
from shmstage.stage.store.access import copy_owner


def made_here(directory: str) -> tuple[int, int] | None:
    """The owner and group a file made in ``directory`` (one of partial/<name>, never setgid)
    gets, where known without asking: ours on tmpfs, which has no grpid option.  None
    elsewhere: on an ext4 or xfs DEST mounted ``grpid`` a new file takes its directory's
    group, so give_owner sets the owner of every file there."""
    mount = system.mount_of(directory)
    if mount is None or mount.fstype != "tmpfs":
        return None
    return os.geteuid(), os.getegid()


def copy_group(path: str | int, gid: int) -> None:
    """A user's copy gets its source's group ``gid``, one of :func:`~shmstage.stage.sources.owners.stager_groups`."""
    if isinstance(path, int):
        os.fchown(path, -1, gid)
    else:
        os.chown(path, -1, gid, follow_symlinks=False)


def give_owner(
    fd: int | str,
    st: os.stat_result,
    mode: int,
    own: bool,
    groups: frozenset[int] | None,
    made: tuple[int, int] | None = None,
) -> bool:
    """The one rule for a copied file's owner and group (every path: the copier, the
    cluster exchange; ``fd`` or a path): root (``own``) gives it its source's owner and group (``st``); a
    user's copy gets the source's group where it is one of ``groups`` (else it keeps the
    stager's, and the walk cleared the group bits of ``mode``).  False: the source's group
    is not one of ours any more though the walk saw one (``mode`` grants the group more
    than others): the source changed since the walk.  ``made``: the owner and group the
    file got when it was made, where known (:func:`made_here`): no chown when it is already
    the right one."""
    if own:
        if made is None or (st.st_uid, st.st_gid) != made:
            copy_owner(fd, st)
    elif groups is not None and (made is None or st.st_gid != made[1]):
        if st.st_gid in groups:
            copy_group(fd, st.st_gid)
        elif mode & 0o070 & ~((mode & 0o7) << 3):
            return False
    return True
