"""The node config as typed values: ``NodeConfig`` and its sections, and ``ConfigError`` with
the ``Problem`` list it reports.  What :mod:`shmstage.config.schema` builds from the YAML.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shmstage.errors import RefusedError

VERSION = 1
VERIFY_MODES = ("size", "checksum")


@dataclass(frozen=True)
class Problem:
    key: str  # key path, e.g. "datasets[1].verify" ("" for the document itself)
    line: int | None  # 1-based line in the file
    reason: str

    def format(self, path: str) -> str:
        where = f"{path}:{self.line}" if self.line else path
        return f"{where}: {self.key}: {self.reason}" if self.key else f"{where}: {self.reason}"


class ConfigError(RefusedError):
    """The node config is missing or invalid; nothing was run (exit 2)."""

    def __init__(self, message: str, problems: tuple[Problem, ...] = ()) -> None:
        super().__init__(message)
        self.problems = problems


@dataclass(frozen=True)
class ShmConfig:
    path: str = "/dev/shm"
    size: int | str | None = None  # bytes, "N%", "auto", or None = leave the size alone
    persist: bool = False
    fstab: str = "/etc/fstab"


@dataclass(frozen=True)
class DatasetConfig:
    source: str
    name: str
    verify: str = "size"


@dataclass(frozen=True)
class PillowSimdConfig:
    enabled: bool = False
    python: str | None = (
        None  # interpreter whose environment gets pillow-simd; None = shmstage's own
    )
    version: str | None = None


@dataclass(frozen=True)
class LoaderConfig:
    num_workers: int | str | None = None  # an int or "auto"
    pin_memory: bool | None = None
    prefetch_factor: int | None = None


@dataclass(frozen=True)
class TierConfig:
    """One storage tier of ``dest`` (fastest first) and its cache settings (docs/cache.md)."""

    path: str
    max_size: int | str | None = None  # bytes or "N%" of the tier's file system; None: no cap
    policy: str = "lru"


DEFAULT_SOCKET = "/run/shmstage/shmstage.sock"


@dataclass(frozen=True)
class ServiceConfig:
    """The node service (``shmstage serve``, docs/service.md): whether ``prepare`` installs,
    enables and starts its systemd unit, and the socket it listens on."""

    enabled: bool = False
    socket: str = DEFAULT_SOCKET


@dataclass(frozen=True)
class StoreTmpfsConfig:
    """A tmpfs of the store's own, mounted by ``prepare`` and persisted in fstab."""

    path: str
    size: int | str  # bytes or "N%" (of the RAM this node/cgroup can hold)
    mode: str = "0755"  # the mount's root: "0755" (the service stages) or "1777" (anyone)
    fstab: str = "/etc/fstab"


@dataclass(frozen=True)
class ShareConfig:
    """Who may read an object-store copy besides the user who asked for it: a group or all."""

    source: str  # an object-store prefix: s3://bucket/prefix (no trailing slash)
    gid: int | None = None
    everyone: bool = False
    group: str | None = None  # the group as written (a name or a number), for messages


@dataclass(frozen=True)
class NodeConfig:
    path: str | None  # the file it was read from
    version: int = VERSION
    shm: ShmConfig = field(default_factory=ShmConfig)
    dest: str = "/dev/shm/shmstage"  # the first (fastest) tier: where `prepare` stages
    # bytes or "N%" (of the tmpfs staged into), as --reserve takes; None = the default
    # reserve (10% of the tmpfs, at most 4 GiB)
    reserve: int | str | None = None
    datasets: tuple[DatasetConfig, ...] = ()
    pillow_simd: PillowSimdConfig = field(default_factory=PillowSimdConfig)
    loader: LoaderConfig = field(default_factory=LoaderConfig)
    tiers: tuple[TierConfig, ...] = ()  # every tier of `dest`, fastest first
    service: ServiceConfig = field(default_factory=ServiceConfig)
    store_tmpfs: StoreTmpfsConfig | None = None
    shares: tuple[ShareConfig, ...] = ()

    @property
    def dest_tiers(self) -> str:
        """``dest`` as ``stage --dest`` takes it: the tiers joined by commas."""
        return ",".join(t.path for t in self.tiers) if self.tiers else self.dest
