"""What reaches a terminal: text other users chose (a source path, a lease holder's argv)."""

from __future__ import annotations

import re

# A colour (SGR) sequence, as click.style writes them: it changes colours, nothing else.
_SGR = re.compile(r"(\x1b\[[0-9;]*m)")


def printable(text: str, keep: str = "", colors: bool = False) -> str:
    """``text`` with every non-printable character (but those in ``keep``) written as its
    Python escape (\\x1b, \\n, \\u202e): a path or an argv another user chose goes into this
    user's (or root's) terminal, where raw escape sequences could rewrite the screen, the
    title or the clipboard (OSC 52).  ``colors``: colour sequences stay (a table's cells
    that the command itself styled)."""
    if text.isprintable():
        return text
    if colors:
        return "".join(
            part if i % 2 else printable(part, keep) for i, part in enumerate(_SGR.split(text))
        )
    return "".join(c if c.isprintable() or c in keep else repr(c)[1:-1] for c in text)
