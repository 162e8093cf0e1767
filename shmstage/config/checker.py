"""The node config's value checkers: each takes a key path and a YAML node (which keeps its
line) and returns the value, or records a problem and returns ``MISSING`` so that checking
goes on and one run lists every problem.  The sections are in :mod:`shmstage.config.schema`.
"""

from __future__ import annotations

import os
import re
from typing import Any, Callable

import yaml

from shmstage.config.model import Problem
from shmstage.sizes import SizeError, check_reserve, is_percent, parse_size

Node = yaml.Node
MISSING = object()


def line_of(node: Node | None) -> int | None:
    return node.start_mark.line + 1 if node is not None else None


def kind_of(node: Node, value: Any = None) -> str:
    if isinstance(node, yaml.MappingNode):
        return "a mapping"
    if isinstance(node, yaml.SequenceNode):
        return "a list"
    if value is None:
        return "nothing (null)"
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, (int, float)):
        return f"a number ({value})"
    return f"{value!r}"


def join_key(key: str, child: str) -> str:
    return f"{key}.{child}" if key else child


class Checker:
    def __init__(self, loader: yaml.SafeLoader) -> None:
        self.loader = loader
        self.problems: list[Problem] = []

    def fail(self, key: str, node: Node | None, reason: str) -> Any:
        self.problems.append(Problem(key, line_of(node), reason))
        return MISSING

    def peek(self, node: Node) -> Any:
        """A scalar's value for messages (None for collections or unreadable values)."""
        if not isinstance(node, yaml.ScalarNode):
            return None
        try:
            return self.loader.construct_object(node, deep=True)
        except yaml.YAMLError:
            return None

    def scalar(self, key: str, node: Node) -> Any:
        if not isinstance(node, yaml.ScalarNode):
            return self.fail(key, node, f"expected a single value, got {kind_of(node)}")
        try:
            return self.loader.construct_object(node, deep=True)
        except yaml.YAMLError as e:
            return self.fail(key, node, f"cannot read this value: {getattr(e, 'problem', e)}")

    def mapping(
        self, key: str, node: Node, fields: dict[str, Callable[[str, Node], Any]]
    ) -> dict[str, Any]:
        """Check a mapping against ``fields`` (name -> checker); unknown keys are problems."""
        out: dict[str, Any] = {}
        if not isinstance(node, yaml.MappingNode):
            self.fail(
                key,
                node,
                f"expected a mapping with keys {', '.join(fields)}; got {kind_of(node, self.peek(node))}",
            )
            return out
        seen: set[str] = set()
        for key_node, value_node in node.value:
            name = self.scalar(key, key_node)
            if not isinstance(name, str):
                self.fail(key, key_node, f"keys must be names, got {kind_of(key_node, name)}")
                continue
            path = join_key(key, name)
            if name in seen:
                self.fail(path, key_node, "duplicate key")
                continue
            seen.add(name)
            check = fields.get(name)
            if check is None:
                self.fail(path, key_node, f"unknown key; expected one of: {', '.join(fields)}")
                continue
            value = check(path, value_node)
            if value is not MISSING:
                out[name] = value
        return out

    # -- value checkers: (key path, node) -> value or MISSING -------------------------------

    def string(self, key: str, node: Node) -> Any:
        value = self.scalar(key, node)
        if value is MISSING:
            return value
        if not isinstance(value, str) or not value:
            return self.fail(key, node, f"expected text, got {kind_of(node, value)}")
        return value

    def optional_string(self, key: str, node: Node) -> Any:
        value = self.scalar(key, node)
        if value is None or value is MISSING:
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            # `version: 9.10` reads as the float 9.1: keep the text as written
            return node.value
        return self.string(key, node)

    def abspath(self, key: str, node: Node) -> Any:
        value = self.string(key, node)
        if value is MISSING:
            return value
        if not os.path.isabs(value):
            return self.fail(key, node, f"{value!r} is not an absolute path")
        return os.path.normpath(value)

    def source(self, key: str, node: Node) -> Any:
        """A dataset's source: an absolute path or an object-store URL (s3://, gs://, az://)."""
        from shmstage.errors import RefusedError
        from shmstage.stage.sources import kinds as sources

        if not (isinstance(node, yaml.ScalarNode) and sources.is_url(str(node.value))):
            return self.abspath(key, node)
        value = self.string(key, node)
        if value is MISSING:
            return value
        try:
            return sources.resolve(value)[1]
        except RefusedError as e:
            return self.fail(key, node, e.message)

    def boolean(self, key: str, node: Node) -> Any:
        value = self.scalar(key, node)
        if value is MISSING:
            return value
        if not isinstance(value, bool):
            return self.fail(key, node, f"expected true or false, got {kind_of(node, value)}")
        return value

    def integer(self, key: str, node: Node, minimum: int) -> Any:
        value = self.scalar(key, node)
        if value is MISSING:
            return value
        if isinstance(value, bool) or not isinstance(value, int):
            return self.fail(key, node, f"expected a whole number, got {kind_of(node, value)}")
        if value < minimum:
            return self.fail(key, node, f"must be at least {minimum}, got {value}")
        return value

    def reserve(self, key: str, node: Node) -> Any:
        """What ``--reserve`` takes: bytes, a size or N% (of the tmpfs); 0 but not 100%."""
        value = self.size(key, node, percent=True, zero=True)
        if isinstance(value, str):
            try:
                check_reserve(value)  # the same rule and words as --reserve
            except SizeError as e:
                return self.fail(key, node, str(e))
        return value

    def size(
        self,
        key: str,
        node: Node,
        *,
        percent: bool = False,
        auto: bool = False,
        zero: bool = False,
    ) -> Any:
        value = self.scalar(key, node)
        if value is MISSING:
            return value
        allowed = (
            "bytes or a size like 64G"
            + (", N%" if percent else "")
            + (' or "auto"' if auto else "")
        )
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            return self.fail(key, node, f"expected {allowed}, got {kind_of(node, value)}")
        if isinstance(value, str):
            value = value.strip()
            if value.lower() == "auto":
                return (
                    "auto"
                    if auto
                    else self.fail(key, node, f'"auto" is not allowed here; use {allowed}')
                )
            if is_percent(value):
                if not percent:
                    return self.fail(key, node, f"a percentage is not allowed here; use {allowed}")
                try:
                    parse_size(value, percent_of=100)
                except SizeError as e:
                    return self.fail(key, node, str(e))
                return value.replace(" ", "")
        try:
            n = parse_size(value)
        except SizeError as e:
            return self.fail(key, node, str(e))
        if percent and n == 0 and not zero:
            return self.fail(key, node, "a tmpfs size must be more than 0")
        return n

    def mode(self, key: str, node: Node) -> Any:
        if not isinstance(node, yaml.ScalarNode):
            return self.fail(key, node, f"expected a single value, got {kind_of(node)}")
        text = str(node.value).strip()  # as written: YAML reads an unquoted 0755 as 493
        if not re.fullmatch(r"[0-7]{3,4}", text):
            return self.fail(
                key, node, f'{text!r} is not an octal file mode; use e.g. "0755" or "1777"'
            )
        return text.zfill(4)
