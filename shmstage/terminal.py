"""What reaches a terminal: text other users chose (a source path, a lease holder's argv)."""

from __future__ import annotations


def printable(text: str, keep: str = "") -> str:
    """``text`` with every non-printable character (but those in ``keep``) written as its
    Python escape (\\x1b, \\n, \\u202e): a path or an argv another user chose goes into this
    user's (or root's) terminal, where raw escape sequences could rewrite the screen, the
    title or the clipboard (OSC 52)."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c in keep else repr(c)[1:-1] for c in text)
