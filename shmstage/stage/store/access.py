"""Who may read a staged copy: never anyone who could not read it at its source.

A staged tree keeps its source's modes, but the source may be shut off by a
directory above it (``/home/alice`` at 0700) that the copy under DEST does not
have.  ``restrict_root`` clears, on the published root, the permission class
(owner, group, other) that some directory on the way to the source denies.
"""

from __future__ import annotations

import errno
import os
import pwd
import stat

_CLASSES = ((stat.S_IRWXU, "owner"), (stat.S_IRWXG, "group"), (stat.S_IRWXO, "other"))


def copy_owner(path: str | int, st: os.stat_result) -> None:
    """chown ``path`` (or an fd) to ``st``'s owner and group, best effort: root in a user
    namespace cannot give away to an unmapped uid (EINVAL) or lacks CAP_CHOWN (EPERM); the
    copy then stays root's, and access.restrict_root judges the owner it really has."""
    try:
        if isinstance(path, int):
            os.fchown(path, st.st_uid, st.st_gid)
        else:
            os.chown(path, st.st_uid, st.st_gid, follow_symlinks=False)
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.EINVAL):
            raise


def _may(st: os.stat_result, uid: int | None, gids: frozenset[int], want: int) -> bool:
    """The kernel's rule for one inode: owner bits, else group bits, else other bits.

    ``want`` is 1 (search/execute) or 4 (read).  uid None: a user owning nothing here."""
    if uid == 0:
        return True  # CAP_DAC_OVERRIDE / CAP_DAC_READ_SEARCH
    if uid is not None and st.st_uid == uid:
        bits = st.st_mode >> 6
    elif st.st_gid in gids:
        bits = st.st_mode >> 3
    else:
        bits = st.st_mode
    return bool(bits & want)


def _groups_of(uid: int, gid: int) -> frozenset[int]:
    try:
        return frozenset(os.getgrouplist(pwd.getpwuid(uid).pw_name, gid))
    except (KeyError, OSError):  # a uid without a passwd entry: its primary group only
        return frozenset((gid,))


def _path_to(source: str, kind: str) -> list[tuple[os.stat_result, int]]:
    """(stat, wanted access) for every directory above ``source`` and, when ownership
    changes in the copy, the source itself: what a reader had to pass to get at it."""
    chain: list[tuple[os.stat_result, int]] = []
    path = os.path.dirname(source)
    while True:
        chain.append((os.stat(path), 1))
        if path == os.path.dirname(path):
            break
        path = os.path.dirname(path)
    chain.append((os.stat(source), 1 if kind == "dir" else 4))
    return chain


def denied_classes(source: str, kind: str, owner: int, group: int) -> int:
    """Mode bits to clear on a staged root owned by ``owner``:``group`` (0: none).

    The owner class is the copy's owner with its groups; the group class a member of
    ``group`` only; the other class a user in neither and owning nothing on the way.
    A class keeps its bits only if the kernel would have let it through every directory
    above the source and into the source itself (under the source's ownership)."""
    chain = _path_to(os.path.realpath(source), kind)
    who = (
        (owner, _groups_of(owner, group)),
        (None, frozenset((group,))),
        (None, frozenset()),
    )
    clear = 0
    for (bits, _name), (uid, gids) in zip(_CLASSES, who):
        if not all(_may(st, uid, gids, want) for st, want in chain):
            clear |= bits
    return clear


def restrict_root(
    root: str,
    source: str,
    kind: str,
    mode: int | None = None,
    owner: os.stat_result | None = None,
) -> int:
    """Clear on ``root`` (the built copy of ``source``) what its source path denies.

    ``owner``: as root, the copy's root gets this stat's owner and group first (the
    source's top as checked by the caller: a stager killed inside Store.publish leaves the
    root ours, and an unchanged source re-checked here puts it back), so the owner of a
    dataset in a private home keeps reading the copy.  Never a stat of the source path
    taken here: its owner may have swapped it for a link to someone else's directory since
    the walk.  ``mode``: the unrestricted mode to start from (the manifest's, when
    re-checking a published copy whose source path may have opened or closed since);
    default: root's own.  Returns the new mode."""
    st = os.lstat(root)
    if (
        os.geteuid() == 0
        and owner is not None
        and kind in ("tar", "dir")
        and (st.st_uid, st.st_gid) != (owner.st_uid, owner.st_gid)
    ):
        copy_owner(root, owner)
        st = os.lstat(root)
    now = stat.S_IMODE(st.st_mode)
    new = (now if mode is None else mode) & ~denied_classes(source, kind, st.st_uid, st.st_gid)
    if new != now:
        os.chmod(root, new, follow_symlinks=False)
    return new


def is_restriction(want: int, have: int) -> bool:
    """Whether ``have`` is the mode ``want`` with only read/write/search bits cleared
    (what :func:`restrict_root` does): ``verify`` does not count it as a difference."""
    return have & ~want == 0 and (want ^ have) & ~0o777 == 0
