"""The one output convention every command follows.

Results are typed values (dataclasses).  ``--json`` prints them as one JSON
document on stdout; otherwise a command-specific renderer prints a compact
table.  Progress and logs go to stderr, never stdout.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import PurePath
from typing import Any

import click

from shmstage.terminal import printable


def jsonable(value: Any) -> Any:
    """Turn results (dataclasses, enums, paths, tuples) into plain JSON values."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, PurePath):
        return str(value)
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in value]
    return value


def dumps(value: Any) -> str:
    return json.dumps(jsonable(value), indent=2)


def json_option(f: Callable[..., Any]) -> Callable[..., Any]:
    """Add ``--json`` (parameter ``as_json``) to a command."""
    return click.option(
        "--json",
        "as_json",
        is_flag=True,
        help="Print the result as JSON on stdout (schema in docs/cli.md).",
    )(f)


def emit(result: Any, as_json: bool, render: Callable[[Any], None]) -> None:
    """Print ``result`` as JSON or through ``render``."""
    if as_json:
        click.echo(dumps(result))
    else:
        render(result)


def table(rows: Sequence[Sequence[Any]], headers: Sequence[str] | None = None) -> str:
    """A plain left-aligned table; numbers right-aligned.  Cells go through
    :func:`~shmstage.terminal.printable` (a SOURCE path is its owner's choice)."""
    cells = [[("" if c is None else printable(str(c), colors=True)) for c in row] for row in rows]
    if headers:
        cells.insert(0, list(headers))
    if not cells:
        return ""
    widths = [max(len(r[i]) for r in cells if i < len(r)) for i in range(max(map(len, cells)))]
    lines = []
    for n, row in enumerate(cells):
        parts = []
        for i, c in enumerate(row):
            numeric = n > 0 or not headers
            numeric = numeric and _looks_numeric(c)
            parts.append(c.rjust(widths[i]) if numeric else c.ljust(widths[i]))
        lines.append("  ".join(parts).rstrip())
        if n == 0 and headers:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _looks_numeric(text: str) -> bool:
    try:
        float(text.replace(",", "").rstrip("x%"))
    except ValueError:
        return False
    return True


_VERDICT_COLORS = {"OK": "green", "WARN": "yellow", "FAIL": "red", "CHANGED": "yellow"}


def verdict(word: str) -> str:
    """A verdict word, coloured when stdout is a terminal."""
    return click.style(word, fg=_VERDICT_COLORS.get(word.upper()), bold=True)


def log(message: str) -> None:
    """A status line on stderr (never mixed into results on stdout)."""
    click.echo(message, err=True)


def stderr_is_tty() -> bool:
    return sys.stderr.isatty() and os.environ.get("TERM") != "dumb"


def quiet_option(f: Callable[..., Any]) -> Callable[..., Any]:
    return click.option("--quiet", "-q", is_flag=True, help="No progress or logs on stderr.")(f)


def wraps_result(render: Callable[[Any], None]) -> Callable[..., Any]:
    """Decorator: the command returns a result; print it as JSON or via ``render``."""

    def deco(f: Callable[..., Any]) -> Callable[..., Any]:
        @json_option
        @functools.wraps(f)
        def wrapper(*args: Any, as_json: bool, **kwargs: Any) -> Any:
            result = f(*args, **kwargs)
            emit(result, as_json, render)
            return result

        return wrapper

    return deco
