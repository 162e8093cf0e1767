"""A source entry's POSIX ACLs and what they mean for its copy (walk.py reads them for every
entry that grants its group or others anything).

Where the copy can carry them (root stages onto a DEST that supports ACLs: :func:`supported`),
the entry records them (:func:`encode`) and build/tree.py's ``apply_acls`` writes them onto the
copy verbatim: owners and groups are kept, so ``user:mallory:---`` or ``user:bob:r--`` means
the same users as at the source.  Where it cannot, the copy's mode is narrowed so that nobody
reads more than the ACL let them (:func:`read`): a restriction, never a widening.
"""

from __future__ import annotations

import errno
import os
import struct
from typing import NamedTuple

_ACL = "system.posix_acl_access"
_DEFAULT = "system.posix_acl_default"
# linux/posix_acl_xattr.h: a 4-byte version, then (tag, perm, id) entries
_USER, _GROUP_OBJ, _GROUP, _MASK = 0x02, 0x04, 0x08, 0x10
_ACL_ENTRY = struct.Struct("<HHI")


class Found(NamedTuple):
    """What :func:`read` found on one entry."""

    keep: int  # the group and other bits (0o077 form) a copy without the ACL may keep
    has: bool | None  # whether it has an access ACL (None: not asked, or not known)
    recorded: str | None  # its ACLs as an entry records them (:func:`encode`); None: none


NONE = Found(0o077, None, None)  # not asked: no group bits, the mode says it all
PLAIN = Found(0o077, False, None)  # asked: no ACL (most entries: one object for all of them)


def acl_group(path: str, mode: int) -> int:
    """The group and other bits (``0o077`` form) a copy of ``path`` without its ACL may keep."""
    return read(path, mode).keep


def read(path: str, mode: int, directory: bool = False) -> Found:
    """``path``'s ACLs: what its copy may keep of ``mode`` where the copy has no ACL, and
    the ACLs themselves (a directory's default ACL too) where they say more than the mode.

    With an access ACL the mode's group bits are the ACL's mask, not what the owning group
    may (``group::---`` with ``user:bob:r--`` shows as 0640); named entries may deny what
    the group or other class grants (``user:mallory:---`` on a 0644 file).  Without the ACL,
    such users fall into the copy's group or other class: the group keeps what ``group::``,
    the mask and every named user allow; other what every named user and group allows."""
    if not mode & 0o070:
        # no group bits (a mask of ---): the kernel consults no ACL (acl_permission_check),
        # the mode says it all; a default ACL matters to no reader (one syscall saved)
        return NONE
    try:  # listxattr first: most files have no ACL, and a raised ENODATA costs twice as much
        names = os.listxattr(path, follow_symlinks=False)
        if not names:  # most files have no extended attribute at all
            return PLAIN
        listed = _ACL in names
        listed_default = directory and _DEFAULT in names
    except OSError:  # E2BIG (more names than a listing holds), or none listable: ask for it
        listed = listed_default = True
    if not listed and not listed_default:
        return PLAIN
    access = _get(path, _ACL) if listed else None
    default = _get(path, _DEFAULT) if listed_default and directory else None
    if access is None:
        keep, has = 0o077, None
    else:
        keep, has = _narrowed(access), True
        if not any(t in (_USER, _GROUP, _MASK) for t, _, _ in _entries(access)):
            access = None  # a minimal ACL: the mode says all of it
    recorded = encode(access, default) if access is not None or default is not None else None
    return Found(keep, has, recorded)


def _get(path: str, name: str) -> bytes | None:
    try:
        return os.getxattr(path, name, follow_symlinks=False)
    except OSError:  # none (ENODATA), none supported, or gone (the stat tells)
        return None


def _entries(raw: bytes) -> list[tuple[int, int, int]]:
    return [
        _ACL_ENTRY.unpack_from(raw, off)
        for off in range(4, len(raw) - _ACL_ENTRY.size + 1, _ACL_ENTRY.size)
    ]


def _narrowed(raw: bytes) -> int:
    entries = _entries(raw)
    mask = next((perm for tag, perm, _ in entries if tag == _MASK), 0o7)
    group = next((perm for tag, perm, _ in entries if tag == _GROUP_OBJ), 0) & mask
    other = 0o7
    for tag, perm, _ in entries:
        if tag == _USER:  # a named user in the owning group gets its entry, not the group's
            group &= perm & mask
            other &= perm & mask
        elif tag == _GROUP:  # a member of it only (else the owning group's entry counts too)
            other &= perm & mask
    return group << 3 | other


def encode(access: bytes | None, default: bytes | None) -> str:
    """The manifest's form (JSON: a string): ``<access hex>/<default hex>``, either empty."""
    return f"{(access or b'').hex()}/{(default or b'').hex()}"


def apply(path: str, recorded: str) -> None:
    """Write the ACLs :func:`encode` recorded onto ``path`` (after its owner and mode: the
    access ACL sets the mode's group bits to its mask, as at the source).  Raises OSError
    (EOPNOTSUPP where the file system takes no ACL)."""
    access, _, default = recorded.partition("/")
    if access:
        os.setxattr(path, _ACL, bytes.fromhex(access), follow_symlinks=False)
    if default:
        os.setxattr(path, _DEFAULT, bytes.fromhex(default), follow_symlinks=False)


def supported(directory: str) -> bool:
    """Whether files under ``directory`` (DEST's) can carry ACLs: tmpfs and most local file
    systems can; one mounted ``noacl`` (or without them) answers EOPNOTSUPP."""
    try:
        os.getxattr(directory, _ACL, follow_symlinks=False)
    except OSError as e:
        return e.errno not in (errno.EOPNOTSUPP, errno.ENOTSUP)
    return True
