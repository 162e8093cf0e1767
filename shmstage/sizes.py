"""Sizes and ages as people write them: ``64G``, ``512MiB``, ``1.5T``, ``50%``, ``7d``.

Suffixes follow mount(8) and ``docker --shm-size``: ``K``/``M``/``G``/``T``/``P`` and
``KiB``... are powers of 1024; ``KB``/``MB``/``GB``/``TB`` are powers of 1000.
A percentage is of a base the caller supplies (e.g. memory available to the node).
"""

from __future__ import annotations

import re

from shmstage.errors import ShmstageError

_BINARY = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}
_DECIMAL = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "PB": 10**15}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")
_PCT_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%\s*$")
_AGE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_AGE_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


class SizeError(ShmstageError):
    exit_code = 2


def _multiplier(suffix: str) -> int | None:
    s = suffix.upper()
    if s.endswith("IB") and len(s) == 3:  # KiB, MiB, GiB...
        return _BINARY.get(s[0])
    if s in _DECIMAL:
        return _DECIMAL[s]
    return _BINARY.get(s)


def is_percent(text: str) -> bool:
    return bool(_PCT_RE.match(str(text)))


def parse_size(text: str | int, *, percent_of: int | None = None) -> int:
    """Return bytes for ``text``; ``N%`` needs ``percent_of`` (the base in bytes)."""
    if isinstance(text, bool):
        raise SizeError(f"invalid size {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise SizeError(f"invalid size {text}: must not be negative")
        return text
    raw = str(text)
    pct = _PCT_RE.match(raw)
    if pct:
        value = float(pct.group(1))
        if not 0 < value <= 100:
            raise SizeError(f"invalid size {raw!r}: a percentage must be in (0, 100]")
        if percent_of is None:
            raise SizeError(f"invalid size {raw!r}: a percentage is not allowed here")
        return int(percent_of * value / 100)
    m = _SIZE_RE.match(raw)
    if not m:
        hint = " (sizes must not be negative)" if raw.strip().startswith("-") else ""
        raise SizeError(
            f"invalid size {raw!r}{hint}: use bytes or a number with K, M, G, T "
            "(powers of 1024; KiB/GiB too, KB/GB are powers of 1000) or N%"
        )
    mult = _multiplier(m.group(2))
    if mult is None:
        raise SizeError(
            f"invalid size {raw!r}: unknown unit {m.group(2)!r}; use K, M, G, T, KiB, GiB, KB, GB or N%"
        )
    return int(float(m.group(1)) * mult)


def check_reserve(text: str | int) -> None:
    """A reserve (``--reserve``, the config's ``reserve``): a size, or N% of the tmpfs with N
    below 100 (a 100% reserve leaves nothing to stage into)."""
    raw = str(text)
    pct = _PCT_RE.match(raw) if isinstance(text, str) else None
    if pct and not 0 < float(pct.group(1)) < 100:
        raise SizeError(
            f"invalid reserve {raw.strip()!r}: a percentage must be above 0% and below 100% "
            "of the tmpfs (0 for no reserve)"
        )
    parse_size(text, percent_of=100)


def format_size(n: int | float) -> str:
    """``1536`` -> ``'1.5 KiB'``; exact bytes below 1 KiB."""
    n = float(n)
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{sign}{int(n)} B" if unit == "B" else f"{sign}{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def mount_size(n: int) -> str:
    """Bytes as a tmpfs ``size=`` value: the largest exact unit (``64G``, ``1536M``)."""
    for suffix, mult in (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("k", 1 << 10)):
        if n % mult == 0 and n >= mult:
            return f"{n // mult}{suffix}"
    return str(n)


def parse_age(text: str) -> float:
    """Seconds for ``90``, ``30m``, ``12h``, ``7d``, ``2w``."""
    m = _AGE_RE.match(str(text))
    if not m:
        raise SizeError(f"invalid age {text!r}: use a number with s, m, h, d or w (e.g. 7d)")
    return float(m.group(1)) * _AGE_UNITS[m.group(2)]
