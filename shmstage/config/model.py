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

    @property
    def dest_tiers(self) -> str:
        """``dest`` as ``stage --dest`` takes it: the tiers joined by commas."""
        return ",".join(t.path for t in self.tiers) if self.tiers else self.dest
