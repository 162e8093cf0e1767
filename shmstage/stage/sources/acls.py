"""What a source file's access ACL lets its owning group do: the copy has no ACL, so its group
bits are narrowed to that (walk.py reads it for every entry).
"""

from __future__ import annotations

import os
import struct

_ACL = "system.posix_acl_access"
_ACL_GROUP_OBJ = 0x04  # linux/posix_acl_xattr.h: the owning group's entry (group::)
_ACL_ENTRY = struct.Struct("<HHI")  # tag, perm, id; after a 4-byte version header


def acl_group(path: str, mode: int) -> int:
    """The group bits (``0o070`` form) a copy of ``path`` may keep.  With an access ACL the
    mode's group bits are the ACL's mask, not what the owning group may: ``group::---`` with
    ``user:bob:r--`` shows as 0640.  The copy has no ACL, so its group bits are the mask AND
    the owning group's entry: a member of the group reads the copy only if she could read the
    source (named users and groups lose their access: a restriction, never a widening)."""
    return acl_bits(path, mode)[0]


def acl_bits(path: str, mode: int) -> tuple[int, bool | None]:
    """:func:`acl_group`'s bits, and whether ``path`` has an access ACL (None: not asked)."""
    if not mode & 0o070:
        return 0o070, None  # nothing to narrow (most files: one syscall saved)
    try:  # listxattr first: most files have no ACL, and a raised ENODATA costs twice as much
        listed = _ACL in os.listxattr(path, follow_symlinks=False)
    except OSError:  # E2BIG (more names than a listing holds), or none listable: ask for it
        listed = True
    if not listed:
        return 0o070, False
    try:
        raw = os.getxattr(path, _ACL, follow_symlinks=False)
    except OSError:  # no ACL (ENODATA), none supported, or gone (the stat tells)
        return 0o070, None
    for off in range(4, len(raw) - _ACL_ENTRY.size + 1, _ACL_ENTRY.size):
        tag, perm, _ = _ACL_ENTRY.unpack_from(raw, off)
        if tag == _ACL_GROUP_OBJ:
            return (perm & 0o7) << 3, True
    return 0, True  # an ACL without its owning group's entry: malformed, grant the group nothing
