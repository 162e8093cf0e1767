"""The YAML node config (``/etc/shmstage.yaml``): one declarative description of a node.

``load_config`` reads and validates the whole file before anything runs; every problem is
reported with its key path (``datasets[1].verify``) and line.  The schema is in docs/config.md.
Here: where the file is and what other commands read from it; the typed values are in
:mod:`shmstage.config.model`, the validation in :mod:`shmstage.config.schema`.
"""

from __future__ import annotations

import os

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
from shmstage.stage.cache.makeroom import CachePolicy
from shmstage.stage.cache.tiers import joined, split

__all__ = [
    "configured",
    "DEFAULT_PATH",
    "ENV_VAR",
    "VERIFY_MODES",
    "VERSION",
    "ConfigError",
    "DatasetConfig",
    "LoaderConfig",
    "NodeConfig",
    "PillowSimdConfig",
    "Problem",
    "ServiceConfig",
    "ShareConfig",
    "ShmConfig",
    "StoreTmpfsConfig",
    "TierConfig",
    "config_path",
    "load_config",
    "loader_env",
    "node_dest",
    "node_reserve",
    "node_service",
    "node_shares",
    "node_store_tmpfs",
    "node_tiers",
    "parse_config",
    "share_for",
]

DEFAULT_PATH = "/etc/shmstage.yaml"
ENV_VAR = "SHMSTAGE_CONFIG"


def parse_config(text: str, path: str = "<config>") -> NodeConfig:
    """The node config in ``text`` (:func:`shmstage.config.schema.parse_config`); the schema
    and the YAML parser load only when a config is read, not for every command."""
    from shmstage.config.schema import parse_config as parse

    return parse(text, path)


def config_path(path: str | os.PathLike[str] | None = None) -> tuple[str, bool]:
    """The file to read and whether the user chose it (``--config``/``$SHMSTAGE_CONFIG``)."""
    if path is not None:
        return os.fspath(path), True
    env = os.environ.get(ENV_VAR)
    if env:
        return env, True
    return DEFAULT_PATH, False


def load_config(path: str | os.PathLike[str] | None = None) -> NodeConfig:
    """Read and validate the node config; raise ConfigError listing every problem."""
    file, explicit = config_path(path)
    try:
        with open(file, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        if explicit:
            raise ConfigError(
                f"config file {file} does not exist; check --config / ${ENV_VAR}"
            ) from None
        raise ConfigError(
            f"no node config at {DEFAULT_PATH}; write one (see docs/config.md) or pass --config PATH"
        ) from None
    except IsADirectoryError:
        raise ConfigError(
            f"config path {file} is a directory; pass the YAML file with --config"
        ) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read config {file}: {e}") from None
    return parse_config(text, file)


def loader_env(path: str | os.PathLike[str] | None = None) -> dict[str, str]:
    """SHMSTAGE_* loader variables from the config's ``loader`` section.

    ``{}`` when no config was asked for and the default file does not exist; an invalid
    config, or a missing file named by ``path``/``$SHMSTAGE_CONFIG``, raises ConfigError.
    """
    file, explicit = config_path(path)
    if not explicit and not os.path.exists(file):
        return {}
    loader = load_config(file).loader
    env: dict[str, str] = {}
    if loader.num_workers is not None:
        env["SHMSTAGE_NUM_WORKERS"] = str(loader.num_workers)
    if loader.pin_memory is not None:
        env["SHMSTAGE_PIN_MEMORY"] = "1" if loader.pin_memory else "0"
    if loader.prefetch_factor is not None:
        env["SHMSTAGE_PREFETCH_FACTOR"] = str(loader.prefetch_factor)
    return env


def node_dest(path: str | os.PathLike[str] | None = None) -> str | None:
    """The node's staging destination from its config; None when there is no config file.

    ``shmstage run`` stages there by default, so a job finds what ``prepare`` staged.
    """
    file, explicit = config_path(path)
    if not explicit and not os.path.exists(file):
        return None
    return load_config(file).dest_tiers


def node_reserve(path: str | os.PathLike[str] | None = None) -> int | None:
    """The node config's ``reserve`` (bytes); None when there is no config file or it sets none.

    ``stage`` and ``run`` keep it free as ``prepare`` does, so the recipe that stages from the
    job leaves DataLoader workers the room the node's owner asked for."""
    file, explicit = config_path(path)
    if not explicit and not os.path.exists(file):
        return None
    return load_config(file).reserve


def node_tiers(path: str | os.PathLike[str] | None = None) -> tuple[TierConfig, ...]:
    """The tiers (with their cache settings) of the node config; () when there is none."""
    file, explicit = config_path(path)
    if not explicit and not os.path.exists(file):
        return ()
    return load_config(file).tiers


def _existing(path: str | os.PathLike[str] | None) -> NodeConfig | None:
    """The node config, or None when none was asked for and the default file does not exist."""
    file, explicit = config_path(path)
    if not explicit and not os.path.exists(file):
        return None
    return load_config(file)


def node_service(path: str | os.PathLike[str] | None = None) -> ServiceConfig | None:
    """The config's ``service`` section (defaults when it has none); None without a config."""
    config = _existing(path)
    return config.service if config is not None else None


def node_store_tmpfs(path: str | os.PathLike[str] | None = None) -> StoreTmpfsConfig | None:
    """The store's own tmpfs (``store_tmpfs``); None when the config has none or there is none."""
    config = _existing(path)
    return config.store_tmpfs if config is not None else None


def node_shares(path: str | os.PathLike[str] | None = None) -> tuple[ShareConfig, ...]:
    """Who else may read an object-store copy (``shares``); () without a config."""
    config = _existing(path)
    return config.shares if config is not None else ()


def share_for(source: str, shares: tuple[ShareConfig, ...]) -> tuple[int | None, bool]:
    """(gid, everyone) that may read the copy of object-store ``source`` besides its requester.

    The share with the longest prefix that contains ``source`` wins; a prefix matches whole
    path components (``s3://b/data`` shares ``s3://b/data/train``, not ``s3://b/data-private``).
    (None, False): the requester alone."""
    source = source.rstrip("/")
    best: ShareConfig | None = None
    for share in shares:
        top = share.source.rstrip("/")
        if (source == top or source.startswith(top + "/")) and (
            best is None or len(top) > len(best.source.rstrip("/"))
        ):
            best = share
    if best is None:
        return None, False
    return (None, True) if best.everyone else (best.gid, False)


def configured(
    dest: str | os.PathLike[str] | None, config_path: str | os.PathLike[str] | None = None
) -> tuple[str, dict[str, CachePolicy]]:
    """Where to stage and each tier's cache policy: ``dest`` (else ``$SHMSTAGE_DEST``, else
    the node config's ``dest``, else /dev/shm/shmstage), with the config's ``cache`` settings
    for the tiers it names."""
    tiers = node_tiers(config_path)
    if dest is None and not os.environ.get("SHMSTAGE_DEST") and tiers:
        dest = joined(tuple(t.path for t in tiers))
    policies = {t.path: CachePolicy(t.max_size, t.policy) for t in tiers if t.max_size is not None}
    return joined(split(dest)), policies
