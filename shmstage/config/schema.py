"""Validating the node config's YAML into a ``NodeConfig``: every problem found in one pass,
each with its key path (``datasets[1].verify``) and line.  The schema is in docs/config.md.
The value checkers they are built from are in :mod:`shmstage.config.checker`.
"""

from __future__ import annotations

import grp
import os
import re
from typing import Any

import yaml

from shmstage.config.checker import MISSING, Checker, Node, kind_of
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
from shmstage.paths import is_within, system_mount
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
        checker = _Sections(loader)
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


class _Sections(Checker):
    """The node config's sections, each checked key by key."""

    def __init__(self, loader: yaml.SafeLoader) -> None:
        super().__init__(loader)
        self.store_path_node: Node | None = None  # for a problem found after the section

    # -- sections --------------------------------------------------------------------------

    def document(self, root: Node | None, path: str) -> NodeConfig:
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
        if store is not None and (
            is_within(store.path, shm.path)
            or is_within(os.path.realpath(store.path), os.path.realpath(shm.path))
        ):
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

    def dest(self, key: str, node: Node) -> Any:
        """A path, paths separated by commas, or a list of paths / {path, cache} (tiers)."""
        if isinstance(node, yaml.ScalarNode):
            text = self.string(key, node)
            if text is MISSING:
                return text
            items: list[tuple[str, Node]] = [(p.strip(), node) for p in text.split(",")]
            tiers = [self.tier_path(key, n, p) for p, n in items]
        elif isinstance(node, yaml.SequenceNode) and node.value:
            tiers = [self.tier(f"{key}[{i}]", n) for i, n in enumerate(node.value)]
        else:
            return self.fail(key, node, "expected a path, or a list of tiers (fastest first)")
        if any(t is MISSING for t in tiers):
            return MISSING
        paths = [t.path for t in tiers]
        if len(set(paths)) != len(paths):
            return self.fail(key, node, "the same tier is listed twice")
        return tuple(tiers)

    def tier_path(self, key: str, node: Node, value: str) -> Any:
        if not value or not os.path.isabs(value):
            return self.fail(key, node, f"{value!r} is not an absolute path")
        return TierConfig(os.path.normpath(value))

    def tier(self, key: str, node: Node) -> Any:
        if isinstance(node, yaml.ScalarNode):
            path = self.abspath(key, node)
            return path if path is MISSING else TierConfig(path)
        fields = self.mapping(key, node, {"path": self.abspath, "cache": self.cache})
        if "path" not in fields:
            return self.fail(key, node, "missing path; every tier needs a path")
        cache = fields.get("cache", {})
        return TierConfig(fields["path"], cache.get("max_size"), cache.get("policy", "lru"))

    def cache(self, key: str, node: Node) -> Any:
        return self.mapping(
            key,
            node,
            {"max_size": lambda k, n: self.size(k, n, percent=True), "policy": self.policy},
        )

    def policy(self, key: str, node: Node) -> Any:
        value = self.scalar(key, node)
        if value != "lru":
            return self.fail(key, node, f"{kind_of(node, value)} is not a cache policy; use lru")
        return value

    def version(self, key: str, node: Node) -> Any:
        value = self.scalar(key, node)
        if value is MISSING:
            return value
        if value != VERSION or isinstance(value, bool):
            return self.fail(
                key,
                node,
                f"unsupported config version {value!r}; this shmstage reads version {VERSION}",
            )
        return value

    def shm(self, key: str, node: Node) -> Any:
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

    def datasets(self, key: str, node: Node) -> Any:
        if not isinstance(node, yaml.SequenceNode):
            value = self.peek(node)
            if value is None and isinstance(node, yaml.ScalarNode):
                return ()  # `datasets:` with nothing under it
            return self.fail(key, node, f"expected a list of datasets, got {kind_of(node, value)}")
        out: list[DatasetConfig] = []
        names: dict[str, int] = {}
        for i, item in enumerate(node.value):
            ikey = f"{key}[{i}]"
            if isinstance(item, yaml.ScalarNode):  # shorthand: `- /nfs/imagenet`
                source = self.source(ikey, item)
                if source is MISSING:
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

    def dataset_name(self, key: str, node: Node) -> Any:
        value = self.string(key, node)
        if value is MISSING:
            return value
        if not _NAME_RE.match(value):
            return self.fail(
                key,
                node,
                f"{value!r} is not a valid name; use letters, digits, '.', '_', '+' and '-' (at most 200, not starting with '.' or '-')",
            )
        return value

    def verify_mode(self, key: str, node: Node) -> Any:
        value = self.scalar(key, node)
        if value is MISSING:
            return value
        if value not in VERIFY_MODES:
            return self.fail(
                key, node, f"{kind_of(node, value)} is not a verify mode; use size or checksum"
            )
        return value

    def pillow_simd(self, key: str, node: Node) -> Any:
        fields = self.mapping(
            key,
            node,
            {"enabled": self.boolean, "python": self.abspath, "version": self.optional_string},
        )
        return PillowSimdConfig(**fields)

    def loader_section(self, key: str, node: Node) -> Any:
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

    def num_workers(self, key: str, node: Node) -> Any:
        value = self.scalar(key, node)
        if value == "auto":
            return value
        if value is MISSING:
            return value
        return self.integer(key, node, 0)

    # -- the node service: its switch, the store's own tmpfs, who else may read a copy -----

    def service(self, key: str, node: Node) -> Any:
        fields = self.mapping(key, node, {"enabled": self.boolean, "socket": self.abspath})
        return ServiceConfig(**fields)

    def store_tmpfs(self, key: str, node: Node) -> Any:
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
            return MISSING
        written = {self.peek(k) for k, _ in node.value}
        missing = [k for k in ("path", "size") if k not in written]
        if missing:
            what = " and ".join(missing)
            return self.fail(
                key, node, f"missing {what}; e.g. {{path: /var/cache/shmstage, size: 64G}}"
            )
        if "path" not in fields or "size" not in fields:
            return MISSING  # already reported
        return StoreTmpfsConfig(**fields)

    def store_path(self, key: str, node: Node) -> Any:
        self.store_path_node = node
        value = self.abspath(key, node)
        if value is MISSING:
            return value
        real = os.path.realpath(value)  # a symlink (Debian's /run/shm) names where it leads
        if system_mount(value) or system_mount(real):
            shown = value if real == value else f"{value} (that is {real})"
            return self.fail(
                key,
                node,
                f"{shown} cannot hold the store's own tmpfs; use a directory of its own such as "
                "/var/cache/shmstage (not / nor a system mount such as /dev/shm, which Slurm and "
                "Kubernetes give each job privately, /run or /tmp)",
            )
        return value

    def shares(self, key: str, node: Node) -> Any:
        if not isinstance(node, yaml.SequenceNode):
            value = self.peek(node)
            if value is None and isinstance(node, yaml.ScalarNode):
                return ()  # `shares:` with nothing under it
            return self.fail(key, node, f"expected a list of shares, got {kind_of(node, value)}")
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

    def share_source(self, key: str, node: Node) -> Any:
        """An object-store prefix: a directory's copy keeps the source's owner, group and mode."""
        from shmstage.stage.sources import kinds as sources

        if not (isinstance(node, yaml.ScalarNode) and sources.is_url(str(node.value))):
            return self.fail(
                key,
                node,
                f"expected an object-store prefix (s3://, gs://, az://), got {kind_of(node, self.peek(node))}; "
                "a directory's copy keeps its source's owner, group and mode",
            )
        return self.source(key, node)

    def group(self, key: str, node: Node) -> Any:
        """A group name (looked up on this node) or a gid: (gid, as written)."""
        value = self.scalar(key, node)
        if value is MISSING:
            return value
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value, str(value)
        if not isinstance(value, str) or not value:
            return self.fail(key, node, f"expected a group name or gid, got {kind_of(node, value)}")
        try:
            return grp.getgrnam(value).gr_gid, value
        except KeyError:
            return self.fail(key, node, f"no group {value!r} on this node (getent group {value})")
