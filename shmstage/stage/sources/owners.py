"""Whose copies a stage makes: root keeps the source's owners (like ``cp -a``), anyone else
owns what they stage and may keep a source's group only where it is one of their own.
Facts about the stager, read where the directory source and the copier decide owners.
"""

from __future__ import annotations

import os


def keeps_owner() -> bool:
    """Root gives each copy its source's owner and group (as `cp -a` does), so the modes
    mean the same users as at the source; anyone else owns what they stage."""
    return os.geteuid() == 0


def stager_groups() -> frozenset[int]:
    """The groups this process may give what it creates (chgrp to one's own groups needs no
    privilege).  A user's copy of a file of another group keeps that group only if it is one
    of these; else the walk clears the group bits (walk.Walker ``groups``)."""
    return frozenset(os.getgroups()) | {os.getegid()}
