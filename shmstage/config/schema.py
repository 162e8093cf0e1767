"""Validating the node config's YAML into a ``NodeConfig``: every problem found in one pass,
each with its key path (``datasets[1].verify``) and line.  The schema is in docs/config.md.
Long because every key of the file has its own check, all on one checker that keeps going
after a problem so that a single run lists them all.
"""

from __future__ import annotations

import grp
import os
import re
from typing import Any, Callable

import yaml

from shmstage.config.model import (
    VERIFY_MODES,
    VERSION,
    ConfigError,
    DatasetConfig,
    LoaderConfig,
    NodeConfig,
    PillowSimdConfig,
    Problem,
    ServiceConfig,
    ShareConfig,
    ShmConfig,
    StoreTmpfsConfig,
    TierConfig,
)
from shmstage.paths import is_within
from shmstage.sizes import SizeError, check_reserve, is_percent, parse_size
from shmstage.stage.store import name_for

# The staging engine's dataset names (shmstage.stage.store): no leading dot or dash, at most 200.
_NAME_RE = re.compile(r"^[A-Za-z0-9_+][A-Za-z0-9._+-]{0,199}\Z")  # \Z: no final newline


def parse_config(text: str, path: str = "<config>") -> NodeConfig:
    """Validate YAML ``text`` (read from ``path``) into a NodeConfig."""
    loader = yaml.SafeLoader(text)
    try:
        try:
            root = loader.get_single_node()
        except yaml.MarkedYAMLError as e:
            mark = e.problem_mark or e.context_mark
            line = mark.line + 1 if mark else None
            reason = f"not valid YAML: {e.problem or e.context}"
            problem = Problem("", line, reason)
            raise ConfigError(problem.format(path), (problem,)) from None
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
        checker = _Checker(loader)
        config = checker.document(root, path)
    finally:
        loader.dispose()
    if checker.problems:
        problems = tuple(checker.problems)
        if len(problems) == 1:
            message = problems[0].format(path)
        else:
            lines = "\n".join("  " + p.format(path) for p in problems)
            message = f"invalid config {path} ({len(problems)} problems; nothing was run):\n{lines}"
        raise ConfigError(message, problems)
    return config


# -- validation over the composed node tree (nodes keep their line marks) ----------------

_Node = yaml.Node
_MISSING = object()


def _line(node: _Node | None) -> int | None:
    return node.start_mark.line + 1 if node is not None else None


def _kind(node: _Node, value: Any = None) -> str:
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


def _join(key: str, child: str) -> str:
    return f"{key}.{child}" if key else child


class _Checker:
    def __init__(self, loader: yaml.SafeLoader) -> None:
        self.loader = loader
        self.problems: list[Problem] = []
        self.store_path_node: _Node | None = None  # for a problem found after the section

    def fail(self, key: str, node: _Node | None, reason: str) -> Any:
        self.problems.append(Problem(key, _line(node), reason))
        return _MISSING

    def peek(self, node: _Node) -> Any:
        """A scalar's value for messages (None for collections or unreadable values)."""
        if not isinstance(node, yaml.ScalarNode):
            return None
        try:
            return self.loader.construct_object(node, deep=True)
        except yaml.YAMLError:
            return None

    def scalar(self, key: str, node: _Node) -> Any:
        if not isinstance(node, yaml.ScalarNode):
            return self.fail(key, node, f"expected a single value, got {_kind(node)}")
        try:
            return self.loader.construct_object(node, deep=True)
        except yaml.YAMLError as e:
            return self.fail(key, node, f"cannot read this value: {getattr(e, 'problem', e)}")

    def mapping(
        self, key: str, node: _Node, fields: dict[str, Callable[[str, _Node], Any]]
    ) -> dict[str, Any]:
        """Check a mapping against ``fields`` (name -> checker); unknown keys are problems."""
        out: dict[str, Any] = {}
        if not isinstance(node, yaml.MappingNode):
            self.fail(
                key,
                node,
                f"expected a mapping with keys {', '.join(fields)}; got {_kind(node, self.peek(node))}",
            )
            return out
        seen: set[str] = set()
        for key_node, value_node in node.value:
            name = self.scalar(key, key_node)
            if not isinstance(name, str):
                self.fail(key, key_node, f"keys must be names, got {_kind(key_node, name)}")
                continue
            path = _join(key, name)
            if name in seen:
                self.fail(path, key_node, "duplicate key")
                continue
            seen.add(name)
            check = fields.get(name)
            if check is None:
                self.fail(path, key_node, f"unknown key; expected one of: {', '.join(fields)}")
                continue
            value = check(path, value_node)
            if value is not _MISSING:
                out[name] = value
        return out

    # -- value checkers: (key path, node) -> value or _MISSING -------------------------------

    def string(self, key: str, node: _Node) -> Any:
        value = self.scalar(key, node)
        if value is _MISSING:
            return value
        if not isinstance(value, str) or not value:
            return self.fail(key, node, f"expected text, got {_kind(node, value)}")
        return value

    def optional_string(self, key: str, node: _Node) -> Any:
        value = self.scalar(key, node)
        if value is None or value is _MISSING:
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            # `version: 9.10` reads as the float 9.1: keep the text as written
            return node.value
        return self.string(key, node)

    def abspath(self, key: str, node: _Node) -> Any:
        value = self.string(key, node)
        if value is _MISSING:
            return value
        if not os.path.isabs(value):
            return self.fail(key, node, f"{value!r} is not an absolute path")
        return os.path.normpath(value)

    def source(self, key: str, node: _Node) -> Any:
        """A dataset's source: an absolute path or an object-store URL (s3://, gs://, az://)."""
        from shmstage.errors import RefusedError
        from shmstage.stage.sources import kinds as sources

        if not (isinstance(node, yaml.ScalarNode) and sources.is_url(str(node.value))):
            return self.abspath(key, node)
        value = self.string(key, node)
        if value is _MISSING:
            return value
        try:
            return sources.resolve(value)[1]
        except RefusedError as e:
            return self.fail(key, node, e.message)

    def boolean(self, key: str, node: _Node) -> Any:
        value = self.scalar(key, node)
        if value is _MISSING:
            return value
        if not isinstance(value, bool):
            return self.fail(key, node, f"expected true or false, got {_kind(node, value)}")
        return value

    def integer(self, key: str, node: _Node, minimum: int) -> Any:
        value = self.scalar(key, node)
        if value is _MISSING:
            return value
        if isinstance(value, bool) or not isinstance(value, int):
            return self.fail(key, node, f"expected a whole number, got {_kind(node, value)}")
        if value < minimum:
            return self.fail(key, node, f"must be at least {minimum}, got {value}")
        return value

    def reserve(self, key: str, node: _Node) -> Any:
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
        node: _Node,
        *,
        percent: bool = False,
        auto: bool = False,
        zero: bool = False,
    ) -> Any:
        value = self.scalar(key, node)
        if value is _MISSING:
            return value
        allowed = (
            "bytes or a size like 64G"
            + (", N%" if percent else "")
            + (' or "auto"' if auto else "")
        )
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            return self.fail(key, node, f"expected {allowed}, got {_kind(node, value)}")
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

    # -- sections --------------------------------------------------------------------------

    def document(self, root: _Node | None, path: str) -> NodeConfig:
        if root is None:
            self.fail("", None, "the file is empty; see docs/config.md for the schema")
            return NodeConfig(path=path)
        top = self.mapping(
            "",
            root,
            {
                "version": self.version,
                "shm": self.shm,
                "dest": self.dest,
                "reserve": self.reserve,
                "datasets": self.datasets,
                "pillow_simd": self.pillow_simd,
                "loader": self.loader_section,
                "service": self.service,
                "store_tmpfs": self.store_tmpfs,
                "shares": self.shares,
            },
        )
        shm = top.get("shm", ShmConfig())
        store = top.get("store_tmpfs")
        if store is not None and is_within(store.path, shm.path):
            self.fail(
                "store_tmpfs.path",
                self.store_path_node,
                f"{store.path} is on the shm tmpfs ({shm.path}); the store's own tmpfs needs a "
                "path of its own, e.g. /var/cache/shmstage",
            )
        # Staged copies live on the store's tmpfs, else the shm mount, unless `dest` says otherwise.
        home = store.path if store is not None else shm.path
        tiers = top.get("dest") or (TierConfig(os.path.join(home, "shmstage")),)
        return NodeConfig(
            path=path,
            version=top.get("version", VERSION),
            shm=shm,
            dest=tiers[0].path,
            tiers=tiers,
            reserve=top.get("reserve"),
            datasets=top.get("datasets", ()),
            pillow_simd=top.get("pillow_simd", PillowSimdConfig()),
            loader=top.get("loader", LoaderConfig()),
            service=top.get("service", ServiceConfig()),
            store_tmpfs=store,
            shares=top.get("shares", ()),
        )

    def dest(self, key: str, node: _Node) -> Any:
        """A path, paths separated by commas, or a list of paths / {path, cache} (tiers)."""
        if isinstance(node, yaml.ScalarNode):
            text = self.string(key, node)
            if text is _MISSING:
                return text
            items: list[tuple[str, _Node]] = [(p.strip(), node) for p in text.split(",")]
            tiers = [self.tier_path(key, n, p) for p, n in items]
        elif isinstance(node, yaml.SequenceNode) and node.value:
            tiers = [self.tier(f"{key}[{i}]", n) for i, n in enumerate(node.value)]
        else:
            return self.fail(key, node, "expected a path, or a list of tiers (fastest first)")
        if any(t is _MISSING for t in tiers):
            return _MISSING
        paths = [t.path for t in tiers]
        if len(set(paths)) != len(paths):
            return self.fail(key, node, "the same tier is listed twice")
        return tuple(tiers)

    def tier_path(self, key: str, node: _Node, value: str) -> Any:
        if not value or not os.path.isabs(value):
            return self.fail(key, node, f"{value!r} is not an absolute path")
        return TierConfig(os.path.normpath(value))

    def tier(self, key: str, node: _Node) -> Any:
        if isinstance(node, yaml.ScalarNode):
            path = self.abspath(key, node)
            return path if path is _MISSING else TierConfig(path)
        fields = self.mapping(key, node, {"path": self.abspath, "cache": self.cache})
        if "path" not in fields:
            return self.fail(key, node, "missing path; every tier needs a path")
        cache = fields.get("cache", {})
        return TierConfig(fields["path"], cache.get("max_size"), cache.get("policy", "lru"))

    def cache(self, key: str, node: _Node) -> Any:
        return self.mapping(
            key,
            node,
            {"max_size": lambda k, n: self.size(k, n, percent=True), "policy": self.policy},
        )

    def policy(self, key: str, node: _Node) -> Any:
        value = self.scalar(key, node)
        if value != "lru":
            return self.fail(key, node, f"{_kind(node, value)} is not a cache policy; use lru")
        return value

    def version(self, key: str, node: _Node) -> Any:
        value = self.scalar(key, node)
        if value is _MISSING:
            return value
        if value != VERSION or isinstance(value, bool):
            return self.fail(
                key,
                node,
                f"unsupported config version {value!r}; this shmstage reads version {VERSION}",
            )
        return value

    def shm(self, key: str, node: _Node) -> Any:
        fields = self.mapping(
            key,
            node,
            {
                "path": self.abspath,
                "size": lambda k, n: self.size(k, n, percent=True, auto=True),
                "persist": self.boolean,
                "fstab": self.abspath,
            },
        )
        return ShmConfig(**fields)

    def datasets(self, key: str, node: _Node) -> Any:
        if not isinstance(node, yaml.SequenceNode):
            value = self.peek(node)
            if value is None and isinstance(node, yaml.ScalarNode):
                return ()  # `datasets:` with nothing under it
            return self.fail(key, node, f"expected a list of datasets, got {_kind(node, value)}")
        out: list[DatasetConfig] = []
        names: dict[str, int] = {}
        for i, item in enumerate(node.value):
            ikey = f"{key}[{i}]"
            if isinstance(item, yaml.ScalarNode):  # shorthand: `- /nfs/imagenet`
                source = self.source(ikey, item)
                if source is _MISSING:
                    continue
                fields: dict[str, Any] = {"source": source}
            else:
                fields = self.mapping(
                    ikey,
                    item,
                    {
                        "source": self.source,
                        "name": self.dataset_name,
                        "verify": self.verify_mode,
                    },
                )
                if not isinstance(item, yaml.MappingNode):
                    continue
                if "source" not in fields:
                    if not any(self.peek(k) == "source" for k, _ in item.value):
                        self.fail(
                            f"{ikey}.source", item, "missing; every dataset needs a source path"
                        )
                    continue
            name = fields.get("name") or name_for(fields["source"])
            if name in names:
                self.fail(
                    f"{ikey}.name",
                    item,
                    f"duplicate dataset name {name!r} (also datasets[{names[name]}]); give one a distinct `name:`",
                )
                continue
            names[name] = i
            out.append(
                DatasetConfig(
                    source=fields["source"], name=name, verify=fields.get("verify", "size")
                )
            )
        return tuple(out)

    def dataset_name(self, key: str, node: _Node) -> Any:
        value = self.string(key, node)
        if value is _MISSING:
            return value
        if not _NAME_RE.match(value):
            return self.fail(
                key,
                node,
                f"{value!r} is not a valid name; use letters, digits, '.', '_', '+' and '-' (at most 200, not starting with '.' or '-')",
            )
        return value

    def verify_mode(self, key: str, node: _Node) -> Any:
        value = self.scalar(key, node)
        if value is _MISSING:
            return value
        if value not in VERIFY_MODES:
            return self.fail(
                key, node, f"{_kind(node, value)} is not a verify mode; use size or checksum"
            )
        return value

    def pillow_simd(self, key: str, node: _Node) -> Any:
        fields = self.mapping(
            key,
            node,
            {"enabled": self.boolean, "python": self.abspath, "version": self.optional_string},
        )
        return PillowSimdConfig(**fields)

    def loader_section(self, key: str, node: _Node) -> Any:
        fields = self.mapping(
            key,
            node,
            {
                "num_workers": self.num_workers,
                "pin_memory": self.boolean,
                "prefetch_factor": lambda k, n: self.integer(k, n, 1),
            },
        )
        return LoaderConfig(**fields)

    def num_workers(self, key: str, node: _Node) -> Any:
        value = self.scalar(key, node)
        if value == "auto":
            return value
        if value is _MISSING:
            return value
        return self.integer(key, node, 0)

    # -- the node service: its switch, the store's own tmpfs, who else may read a copy -----

    def service(self, key: str, node: _Node) -> Any:
        fields = self.mapping(key, node, {"enabled": self.boolean, "socket": self.abspath})
        return ServiceConfig(**fields)

    def store_tmpfs(self, key: str, node: _Node) -> Any:
        fields = self.mapping(
            key,
            node,
            {
                "path": self.store_path,
                "size": lambda k, n: self.size(k, n, percent=True),
                "mode": self.mode,
                "fstab": self.abspath,
            },
        )
        if not isinstance(node, yaml.MappingNode):
            return _MISSING
        written = {self.peek(k) for k, _ in node.value}
        missing = [k for k in ("path", "size") if k not in written]
        if missing:
            what = " and ".join(missing)
            return self.fail(
                key, node, f"missing {what}; e.g. {{path: /var/cache/shmstage, size: 64G}}"
            )
        if "path" not in fields or "size" not in fields:
            return _MISSING  # already reported
        return StoreTmpfsConfig(**fields)

    def store_path(self, key: str, node: _Node) -> Any:
        self.store_path_node = node
        value = self.abspath(key, node)
        if value is _MISSING:
            return value
        if value == "/" or is_within(value, "/dev/shm"):
            return self.fail(
                key,
                node,
                f"{value} cannot hold the store's own tmpfs; use a directory of its own such as "
                "/var/cache/shmstage (not / nor /dev/shm, which Slurm and Kubernetes give each job privately)",
            )
        return value

    def mode(self, key: str, node: _Node) -> Any:
        if not isinstance(node, yaml.ScalarNode):
            return self.fail(key, node, f"expected a single value, got {_kind(node)}")
        text = str(node.value).strip()  # as written: YAML reads an unquoted 0755 as 493
        if not re.fullmatch(r"[0-7]{3,4}", text):
            return self.fail(
                key, node, f'{text!r} is not an octal file mode; use e.g. "0755" or "1777"'
            )
        return text.zfill(4)

    def shares(self, key: str, node: _Node) -> Any:
        if not isinstance(node, yaml.SequenceNode):
            value = self.peek(node)
            if value is None and isinstance(node, yaml.ScalarNode):
                return ()  # `shares:` with nothing under it
            return self.fail(key, node, f"expected a list of shares, got {_kind(node, value)}")
        out: list[ShareConfig] = []
        seen: dict[str, int] = {}
        for i, item in enumerate(node.value):
            ikey = f"{key}[{i}]"
            fields = self.mapping(
                ikey,
                item,
                {"source": self.share_source, "group": self.group, "everyone": self.boolean},
            )
            if not isinstance(item, yaml.MappingNode):
                continue
            written = {self.peek(k) for k, _ in item.value}
            if "source" not in written:
                self.fail(
                    f"{ikey}.source", item, "missing; every share needs an object-store prefix"
                )
                continue
            everyone = fields.get("everyone", False)
            if "group" in written and everyone:
                self.fail(ikey, item, "give group or everyone: true, not both")
                continue
            if "group" not in written and not everyone:
                self.fail(ikey, item, "missing group; name a group (or gid), or say everyone: true")
                continue
            if "source" not in fields or ("group" in written and "group" not in fields):
                continue  # already reported
            source = fields["source"]
            if source in seen:
                self.fail(
                    f"{ikey}.source", item, f"{source} is shared twice (also {key}[{seen[source]}])"
                )
                continue
            seen[source] = i
            gid, group = fields.get("group", (None, None))
            out.append(ShareConfig(source, gid, everyone, group))
        return tuple(out)

    def share_source(self, key: str, node: _Node) -> Any:
        """An object-store prefix: a directory's copy keeps the source's owner, group and mode."""
        from shmstage.stage.sources import kinds as sources

        if not (isinstance(node, yaml.ScalarNode) and sources.is_url(str(node.value))):
            return self.fail(
                key,
                node,
                f"expected an object-store prefix (s3://, gs://, az://), got {_kind(node, self.peek(node))}; "
                "a directory's copy keeps its source's owner, group and mode",
            )
        return self.source(key, node)

    def group(self, key: str, node: _Node) -> Any:
        """A group name (looked up on this node) or a gid: (gid, as written)."""
        value = self.scalar(key, node)
        if value is _MISSING:
            return value
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value, str(value)
        if not isinstance(value, str) or not value:
            return self.fail(key, node, f"expected a group name or gid, got {_kind(node, value)}")
        try:
            return grp.getgrnam(value).gr_gid, value
        except KeyError:
            return self.fail(key, node, f"no group {value!r} on this node (getent group {value})")
