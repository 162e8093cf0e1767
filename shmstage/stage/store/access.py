"""Who may read a staged copy: never anyone who could not read it at its source.

A staged tree keeps its source's modes, but the source may be shut off by a
directory above it (``/home/alice`` at 0700) that the copy under DEST does not
have.  ``restrict_root`` clears, on the published root, the permission class
(owner, group, other) that some directory on the way to the source denies;
``grant`` lets one user who proved they can read the source (the node service's
freshness check, run as them) through that root again: a POSIX ACL entry
``user:UID:r-x`` on it, which ``restrict_root`` keeps while ``revoke`` (stage/topaccess.py
re-checks every granted user at each use of the dataset) has not taken it back.

A dataset's bookkeeping (its manifest and record name the source and every file) is readable
by exactly who may pass its top: ``bookkeeping_access`` and ``share_like``.
"""

from __future__ import annotations

import errno
import fcntl
import os
import pwd
import stat
import struct
from collections.abc import Collection, Iterator
from contextlib import contextmanager

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
    real = os.path.realpath(source)
    chain = _path_to(real, kind)
    who = (
        (owner, _groups_of(owner, group)),
        (None, frozenset((group,))),
        (None, frozenset()),
    )
    clear = 0
    for (bits, _name), (uid, gids) in zip(_CLASSES, who):
        if not all(_may(st, uid, gids, want) for st, want in chain):
            clear |= bits
    if _unmodelled(real, chain):
        clear |= stat.S_IRWXG | stat.S_IRWXO
    return clear


def _unmodelled(source: str, chain: list[tuple[os.stat_result, int]]) -> bool:
    """Whether the path to ``source`` shuts out users the three classes above cannot stand
    for, so that only the owner (and users ``grant`` lets in) may keep the copy's top:

    * a directory above the source, or the source itself, with an extended ACL (a named
      ``user:mallory:---`` or ``group:interns:---``: a user the copy's group or other class
      would let in; the copy's top never keeps its source's ACL);
    * a directory above with "negative" bits, a class granted what a class before it is
      not (0705: the members of its group may not pass, though others may; 0075: its owner
      may not): "other" in the copy is also those members, that owner."""
    path = os.path.dirname(source)
    paths = []
    while True:
        paths.append(path)
        if path == os.path.dirname(path):
            break
        path = os.path.dirname(path)
    for (st, want), path in zip(chain, [*paths, source]):
        owner, group, other = st.st_mode >> 6 & want, st.st_mode >> 3 & want, st.st_mode & want
        if path != source and (other & ~group or (group | other) & ~owner):
            return True
        if _extended(path):
            return True
    return False


def _extended(path: str) -> bool:
    """Whether ``path`` has an access ACL naming users or groups (or a mask): more than its
    mode says.  Unreadable: assumed so (a restriction, never a widening)."""
    try:
        entries = _acl_entries(path)
    except OSError:
        return True
    return any(tag in (_USER, _GROUP, _MASK) for tag, _, _ in entries)


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
    with acl_guard(root):
        return _restrict_root(root, source, kind, mode, owner)


def _restrict_root(
    root: str, source: str, kind: str, mode: int | None, owner: os.stat_result | None
) -> int:
    named = granted(root)
    st = os.lstat(root)
    if (
        os.geteuid() == 0
        and owner is not None
        and kind in ("tar", "dir")
        and (st.st_uid, st.st_gid) != (owner.st_uid, owner.st_gid)
    ):
        copy_owner(root, owner)
        st = os.lstat(root)
    now = without_grants(root, stat.S_IMODE(st.st_mode), named)
    new = (now if mode is None else mode) & ~denied_classes(source, kind, st.st_uid, st.st_gid)
    if new != now:
        os.chmod(root, new, follow_symlinks=False)  # (sets an ACL's mask: written again below)
        if named:
            _write_acl(root, new, named)
    return new


# POSIX ACLs as the kernel stores them in system.posix_acl_access (linux/posix_acl_xattr.h):
# a version, then (tag, perm, id) entries sorted by tag, then id.
_ACL = "system.posix_acl_access"
_HEADER, _ENTRY = struct.Struct("<I"), struct.Struct("<HHI")
_VERSION, _NO_ID = 2, 0xFFFFFFFF
_USER_OBJ, _USER, _GROUP_OBJ, _GROUP, _MASK, _OTHER = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
_SEARCH = 0o5  # r-x: list and pass through the copy's top directory


def _acl_entries(path: str) -> list[tuple[int, int, int]]:
    try:
        raw = os.getxattr(path, _ACL, follow_symlinks=False)
    except OSError as e:
        if e.errno in (errno.ENODATA, errno.EOPNOTSUPP):
            return []
        raise
    return [_ENTRY.unpack_from(raw, off) for off in range(_HEADER.size, len(raw), _ENTRY.size)]


def without_grants(path: str, mode: int, named: dict[int, int] | None = None) -> int:
    """``path``'s mode as it would be without the users ``grant`` let in: where an ACL names
    users, the mode's group bits are the ACL's mask; the owning group's are its own entry."""
    if not (granted(path) if named is None else named):
        return mode
    group = next((perm for t, perm, _ in _acl_entries(path) if t == _GROUP_OBJ), 0)
    return mode & ~0o070 | group << 3


def granted(path: str) -> dict[int, int]:
    """The users ``path``'s ACL names, with their permissions ({}: no ACL)."""
    return {uid: perm for tag, perm, uid in _acl_entries(path) if tag == _USER}


def _write_acl(path: str | int, mode: int, named: dict[int, int]) -> None:
    """The ACL of ``mode`` (owner, group, other) plus the ``named`` users; its mask lets the
    named users have their permissions (the owning group keeps only its own)."""
    group = mode >> 3 & 7
    mask = group
    for perm in named.values():
        mask |= perm
    entries = [(_USER_OBJ, mode >> 6 & 7, _NO_ID)]
    entries += [(_USER, named[uid], uid) for uid in sorted(named)]
    entries += [(_GROUP_OBJ, group, _NO_ID), (_MASK, mask, _NO_ID), (_OTHER, mode & 7, _NO_ID)]
    raw = _HEADER.pack(_VERSION) + b"".join(_ENTRY.pack(*e) for e in entries)
    if isinstance(path, int):
        os.setxattr(path, _ACL, raw)
    else:
        os.setxattr(path, _ACL, raw, follow_symlinks=False)


@contextmanager
def acl_guard(root: str) -> Iterator[None]:
    """Hold an exclusive flock on the directory ``root`` while its ACL is read, changed and
    written back: a grant and a revoke (both under the dataset's shared lock) must not undo
    each other's write.  Not a directory (an archive's copy is one file): no lock needed."""
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def grant(root: str, uid: int) -> bool:
    """Let ``uid`` list and pass through ``root`` (a copy's top that ``restrict_root``
    closed): an ACL entry ``user:uid:r-x``, the rest of the ACL as the mode says.  What is
    below the top keeps the source's modes.  False: nothing to do (``uid`` owns it, or
    everyone may pass already)."""
    with acl_guard(root):
        return _grant(root, uid)


def _grant(root: str, uid: int) -> bool:
    st = os.lstat(root)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid == uid or st.st_mode & 0o001:
        return False
    named = granted(root)
    if named.get(uid, 0) & _SEARCH == _SEARCH:
        return False
    mode = without_grants(root, stat.S_IMODE(st.st_mode), named)
    named[uid] = named.get(uid, 0) | _SEARCH
    _write_acl(root, mode, named)
    return True


def revoke(root: str, uids: Collection[int]) -> bool:
    """Take the ACL entries of ``uids`` (users who no longer pass the source path) off
    ``root``; the rest of its ACL stays.  No named user left: the ACL goes, the mode keeps
    the owning group's own bits.  False: none of them was named."""
    with acl_guard(root):
        named = granted(root)
        keep = {uid: perm for uid, perm in named.items() if uid not in uids}
        if keep == named:
            return False
        mode = without_grants(root, stat.S_IMODE(os.lstat(root).st_mode), named)
        if keep:
            _write_acl(root, mode, keep)
        else:
            os.removexattr(root, _ACL, follow_symlinks=False)  # leaves the mask as group bits
            os.chmod(root, mode, follow_symlinks=False)
        return True


def is_restriction(want: int, have: int) -> bool:
    """Whether ``have`` is the mode ``want`` with only read/write/search bits cleared
    (what :func:`restrict_root` does): ``verify`` does not count it as a difference."""
    return have & ~want == 0 and (want ^ have) & ~0o777 == 0


Access = tuple[int, int, dict[int, int]]  # mode, group (-1: the writer's), users let read


def bookkeeping_access(top: str) -> Access:
    """Who may read a file naming what the copy at ``top`` holds (its manifest, its record):
    who may list the top.  0644 where other may; else 0640 with the top's group where the
    group may; else 0600.  The top's owner and the users :func:`grant` let in read it through
    an ACL entry.  No top: 0600."""
    try:
        st = os.lstat(top)
    except OSError:
        return 0o600, -1, {}
    named = granted(top)
    mode = without_grants(top, stat.S_IMODE(st.st_mode), named)
    if mode & _SEARCH == _SEARCH:
        return 0o644, -1, {}
    readers = {uid: 4 for uid, perm in named.items() if perm & _SEARCH == _SEARCH}
    readers[st.st_uid] = 4  # the copy's owner (root staged alice's private data for her)
    if mode >> 3 & _SEARCH == _SEARCH:
        return 0o640, st.st_gid, readers
    return 0o600, -1, readers


def share_like(fd: int, want: Access) -> None:
    """Give the open bookkeeping file ``fd`` the access ``want`` (bookkeeping_access)."""
    mode, gid, readers = want
    st = os.fstat(fd)
    readers = {uid: perm for uid, perm in readers.items() if uid != st.st_uid}
    if gid != -1 and gid != st.st_gid:
        try:
            os.fchown(fd, -1, gid)
        except OSError:
            mode &= ~0o070  # not root, not in that group: the group class gets nothing
    os.fchmod(fd, mode)  # drops an old ACL's named entries from effect (its mask is the mode's)
    try:
        if readers:
            _write_acl(fd, mode, readers)
        else:
            os.removexattr(fd, _ACL)
    except OSError as e:
        if e.errno not in (errno.ENODATA, errno.EOPNOTSUPP):
            raise
