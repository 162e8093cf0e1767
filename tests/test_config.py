"""The YAML node config: what it accepts, and one clear message for every kind of bad input."""

from __future__ import annotations

import textwrap

import pytest

from shmstage.config import (
    ConfigError,
    DatasetConfig,
    LoaderConfig,
    PillowSimdConfig,
    ServiceConfig,
    ShareConfig,
    ShmConfig,
    StoreTmpfsConfig,
    TierConfig,
    load_config,
    loader_env,
    node_service,
    node_shares,
    node_store_tmpfs,
    parse_config,
    share_for,
)

FULL = """\
version: 1
shm:
  path: /dev/shm
  size: 75%
  persist: true
  fstab: /etc/fstab
dest: /dev/shm/shmstage
reserve: 4G
datasets:
  - source: /nfs/imagenet/train
    name: imagenet-train
    verify: checksum
  - source: /nfs/coco/
  - /nfs/laion
pillow_simd:
  enabled: true
  python: /opt/venv/bin/python
  version: 9.5.0.post1
loader:
  num_workers: 8
  pin_memory: true
  prefetch_factor: 4
"""


def parse(text: str):
    return parse_config(textwrap.dedent(text), "node.yaml")


def test_full_example_parses_into_typed_sections():
    """Every section of the documented schema lands in its typed field."""
    cfg = parse(FULL)
    assert cfg.version == 1
    assert cfg.shm == ShmConfig(path="/dev/shm", size="75%", persist=True, fstab="/etc/fstab")
    assert cfg.dest == "/dev/shm/shmstage"
    assert cfg.reserve == 4 << 30
    assert cfg.datasets == (
        DatasetConfig("/nfs/imagenet/train", "imagenet-train", "checksum"),
        DatasetConfig("/nfs/coco", "coco", "size"),
        DatasetConfig("/nfs/laion", "laion", "size"),
    )
    assert cfg.pillow_simd == PillowSimdConfig(True, "/opt/venv/bin/python", "9.5.0.post1")
    assert cfg.loader == LoaderConfig(num_workers=8, pin_memory=True, prefetch_factor=4)


def test_defaults_for_a_minimal_file():
    """A file with only datasets leaves /dev/shm alone and stages under /dev/shm/shmstage."""
    cfg = parse("datasets: [/data/a]\n")
    assert cfg.shm == ShmConfig(path="/dev/shm", size=None, persist=False, fstab="/etc/fstab")
    assert cfg.dest == "/dev/shm/shmstage"
    assert cfg.reserve is None
    assert cfg.pillow_simd.enabled is False
    assert cfg.loader == LoaderConfig()


def test_dest_follows_shm_path_unless_given():
    """Without `dest`, copies go to <shm.path>/shmstage so they land on the tmpfs being sized."""
    assert parse("shm: {path: /mnt/ram}\n").dest == "/mnt/ram/shmstage"
    assert parse("shm: {path: /mnt/ram}\ndest: /scratch/x\n").dest == "/scratch/x"


def test_dest_lists_storage_tiers_with_cache_settings():
    """`dest` as tiers: a comma list or a YAML list of paths and {path, cache}; the first
    tier is where prepare stages, and dest_tiers is what `stage --dest` takes."""
    cfg = parse("dest: /dev/shm/s, /nvme/s\n")
    assert cfg.tiers == (TierConfig("/dev/shm/s"), TierConfig("/nvme/s"))
    assert (cfg.dest, cfg.dest_tiers) == ("/dev/shm/s", "/dev/shm/s,/nvme/s")
    cfg = parse(
        "dest:\n  - path: /dev/shm/s\n    cache: {max_size: 60%, policy: lru}\n  - /nvme/s\n"
    )
    assert cfg.tiers == (TierConfig("/dev/shm/s", "60%", "lru"), TierConfig("/nvme/s"))
    assert parse("dest: /x\n").tiers == (TierConfig("/x"),)
    assert parse("shm: {path: /mnt/ram}\n").tiers == (TierConfig("/mnt/ram/shmstage"),)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("dest: /a,rel\n", "1: dest: 'rel' is not an absolute path"),
        ("dest: /a,/a\n", "1: dest: the same tier is listed twice"),
        ("dest: []\n", "1: dest: expected a path, or a list of tiers (fastest first)"),
        (
            "dest:\n  - {cache: {max_size: 1G}}\n",
            "2: dest[0]: missing path; every tier needs a path",
        ),
        (
            "dest:\n  - {path: /a, cache: {policy: fifo}}\n",
            "2: dest[0].cache.policy: 'fifo' is not a cache policy; use lru",
        ),
        (
            "dest:\n  - {path: /a, cache: {max_size: 0%}}\n",
            "2: dest[0].cache.max_size: invalid size '0%': a percentage must be in (0, 100]",
        ),
    ],
)
def test_bad_tiers_are_refused_with_key_path_and_line(text, message):
    """Each kind of bad tier list is one problem with its key path and line."""
    with pytest.raises(ConfigError) as info:
        parse_config(text, "node.yaml")
    assert str(info.value) == f"node.yaml:{message}"


@pytest.mark.parametrize(
    ("size", "expected"),
    [
        ("64G", 64 << 30),
        ("512MiB", 512 << 20),
        (1048576, 1048576),
        ("50%", "50%"),
        ("auto", "auto"),
    ],
)
def test_shm_size_forms(size, expected):
    """shm.size takes bytes, a size with a unit, N% and auto."""
    assert parse(f"shm: {{size: {size!r}}}\n".replace("'", '"')).shm.size == expected


# (yaml, exact one-line message without the "node.yaml:" prefix)
BAD = [
    (
        "bogus: 1\n",
        "1: bogus: unknown key; expected one of: version, shm, dest, reserve, datasets, pillow_simd, loader, service, store_tmpfs, shares",
    ),
    (
        "shm:\n  path: /dev/shm\n  sizee: 4G\n",
        "3: shm.sizee: unknown key; expected one of: path, size, persist, fstab",
    ),
    (
        "datasets:\n  - source: /a\n    verfy: size\n",
        "3: datasets[0].verfy: unknown key; expected one of: source, name, verify",
    ),
    (
        "loader: {workers: 2}\n",
        "1: loader.workers: unknown key; expected one of: num_workers, pin_memory, prefetch_factor",
    ),
    (
        "pillow_simd: {enable: true}\n",
        "1: pillow_simd.enable: unknown key; expected one of: enabled, python, version",
    ),
    (
        "shm: [1, 2]\n",
        "1: shm: expected a mapping with keys path, size, persist, fstab; got a list",
    ),
    ("shm: 64G\n", "1: shm: expected a mapping with keys path, size, persist, fstab; got '64G'"),
    ("shm: {persist: maybe}\n", "1: shm.persist: expected true or false, got 'maybe'"),
    ("shm: {path: dev/shm}\n", "1: shm.path: 'dev/shm' is not an absolute path"),
    ("shm: {path: 5}\n", "1: shm.path: expected text, got a number (5)"),
    (
        "shm: {size: 12Q}\n",
        "1: shm.size: invalid size '12Q': unknown unit 'Q'; use K, M, G, T, KiB, GiB, KB, GB or N%",
    ),
    ("shm: {size: 150%}\n", "1: shm.size: invalid size '150%': a percentage must be in (0, 100]"),
    ("shm: {size: 0}\n", "1: shm.size: a tmpfs size must be more than 0"),
    (
        "shm: {size: true}\n",
        '1: shm.size: expected bytes or a size like 64G, N% or "auto", got a boolean (true)',
    ),
    (
        "reserve: 100%\n",
        "1: reserve: invalid reserve '100%': a percentage must be above 0% and below 100% of the tmpfs (0 for no reserve)",
    ),
    ("reserve: auto\n", '1: reserve: "auto" is not allowed here; use bytes or a size like 64G, N%'),
    (
        "reserve: -1G\n",
        "1: reserve: invalid size '-1G' (sizes must not be negative): use bytes or a number with K, M, G, T (powers of 1024; KiB/GiB too, KB/GB are powers of 1000) or N%",
    ),
    ("dest: relative/dir\n", "1: dest: 'relative/dir' is not an absolute path"),
    ("version: 2\n", "1: version: unsupported config version 2; this shmstage reads version 1"),
    ("datasets: /data/a\n", "1: datasets: expected a list of datasets, got '/data/a'"),
    (
        "datasets:\n  - source: /a\n    verify: sha256\n",
        "3: datasets[0].verify: 'sha256' is not a verify mode; use size or checksum",
    ),
    (
        "datasets:\n  - source: /a\n  - name: b\n",
        "3: datasets[1].source: missing; every dataset needs a source path",
    ),
    (
        "datasets:\n  - source: /a/x\n  - source: /b/x\n",
        "3: datasets[1].name: duplicate dataset name 'x' (also datasets[0]); give one a distinct `name:`",
    ),
    (
        "datasets:\n  - {source: /a, name: 'has space'}\n",
        "2: datasets[0].name: 'has space' is not a valid name; use letters, digits, '.', '_', '+' and '-' (at most 200, not starting with '.' or '-')",
    ),
    (
        "datasets:\n  - [/a]\n",
        "2: datasets[0]: expected a mapping with keys source, name, verify; got a list",
    ),
    ("datasets:\n  - source: [/a]\n", "2: datasets[0].source: expected a single value, got a list"),
    ("loader: {num_workers: -1}\n", "1: loader.num_workers: must be at least 0, got -1"),
    (
        "loader: {num_workers: 2.5}\n",
        "1: loader.num_workers: expected a whole number, got a number (2.5)",
    ),
    ("loader: {prefetch_factor: 0}\n", "1: loader.prefetch_factor: must be at least 1, got 0"),
    ("loader: {pin_memory: 1}\n", "1: loader.pin_memory: expected true or false, got a number (1)"),
    (
        "pillow_simd: {python: python3}\n",
        "1: pillow_simd.python: 'python3' is not an absolute path",
    ),
    ("shm: {}\nshm: {}\n", "2: shm: duplicate key"),
    (
        "- a\n- b\n",
        "1: expected a mapping with keys version, shm, dest, reserve, datasets, pillow_simd, loader, service, store_tmpfs, shares; got a list",
    ),
    ("shm: {size: 4G\n", "2: not valid YAML: expected ',' or '}', but got '<stream end>'"),
    ("", "the file is empty; see docs/config.md for the schema"),
]


# The node service's keys (issue 22): service, store_tmpfs, shares.
BAD += [
    (
        "service: {enabled: yes please}\n",
        "1: service.enabled: expected true or false, got 'yes please'",
    ),
    ("service: {socket: run/s.sock}\n", "1: service.socket: 'run/s.sock' is not an absolute path"),
    (
        "service: {port: 1}\n",
        "1: service.port: unknown key; expected one of: enabled, socket",
    ),
    (
        "store_tmpfs: {path: /var/cache/shmstage}\n",
        "1: store_tmpfs: missing size; e.g. {path: /var/cache/shmstage, size: 64G}",
    ),
    (
        "store_tmpfs:\n  size: 1G\n",
        "2: store_tmpfs: missing path; e.g. {path: /var/cache/shmstage, size: 64G}",
    ),
    (
        "store_tmpfs: {path: /dev/shm/store, size: 1G}\n",
        "1: store_tmpfs.path: /dev/shm/store cannot hold the store's own tmpfs; use a directory of its own such as /var/cache/shmstage (not / nor a system mount such as /dev/shm, which Slurm and Kubernetes give each job privately, /run or /tmp)",
    ),
    (
        "shm: {path: /mnt/ram}\nstore_tmpfs:\n  path: /mnt/ram\n  size: 1G\n",
        "3: store_tmpfs.path: /mnt/ram is on the shm tmpfs (/mnt/ram); the store's own tmpfs needs a path of its own, e.g. /var/cache/shmstage",
    ),
    (
        "store_tmpfs:\n  path: /srv/store\n  size: 0\n",
        "3: store_tmpfs.size: a tmpfs size must be more than 0",
    ),
    (
        "store_tmpfs:\n  path: /srv/store\n  size: 1G\n  mode: 0789\n",
        '4: store_tmpfs.mode: \'0789\' is not an octal file mode; use e.g. "0755" or "1777"',
    ),
    (
        "store_tmpfs: {path: /srv/store, size: 1G, uid: 0}\n",
        "1: store_tmpfs.uid: unknown key; expected one of: path, size, mode, fstab",
    ),
    ("shares: s3://b/p\n", "1: shares: expected a list of shares, got 's3://b/p'"),
    (
        "shares:\n  - {source: /nfs/data, group: root}\n",
        "2: shares[0].source: expected an object-store prefix (s3://, gs://, az://), got '/nfs/data'; a directory's copy keeps its source's owner, group and mode",
    ),
    (
        "shares:\n  - {source: s3://bkt/p, group: no-such-group-here}\n",
        "2: shares[0].group: no group 'no-such-group-here' on this node (getent group no-such-group-here)",
    ),
    (
        "shares:\n  - {source: s3://bkt/p, group: -1}\n",
        "2: shares[0].group: expected a group name or gid, got a number (-1)",
    ),
    (
        "shares:\n  - {source: s3://bkt/p, group: root, everyone: true}\n",
        "2: shares[0]: give group or everyone: true, not both",
    ),
    (
        "shares:\n  - {source: s3://bkt/p}\n",
        "2: shares[0]: missing group; name a group (or gid), or say everyone: true",
    ),
    (
        "shares:\n  - {group: root}\n",
        "2: shares[0].source: missing; every share needs an object-store prefix",
    ),
    (
        "shares:\n  - {source: s3://bkt/p, everyone: true}\n  - {source: s3://bkt/p/, group: 0}\n",
        "3: shares[1].source: s3://bkt/p is shared twice (also shares[0])",
    ),
    (
        "shares:\n  - {source: s3://bkt/p, everyone: true, groups: [root]}\n",
        "2: shares[0].groups: unknown key; expected one of: source, group, everyone",
    ),
]


@pytest.mark.parametrize(("text", "message"), BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_input_gets_its_own_message_with_key_path_and_line(text, message):
    """Each kind of bad input is rejected with `file:line: key.path: reason`."""
    with pytest.raises(ConfigError) as info:
        parse_config(text, "node.yaml")
    expected = f"node.yaml:{message}" if message[0].isdigit() else f"node.yaml: {message}"
    assert str(info.value) == expected
    assert info.value.exit_code == 2


def test_every_problem_is_reported_at_once():
    """A file with several problems lists them all (one line each) so they can be fixed in one go."""
    text = "shm: {size: 12Q}\ndatasets:\n  - source: /a\n    verify: md5\nextra: 1\n"
    with pytest.raises(ConfigError) as info:
        parse_config(text, "node.yaml")
    assert str(info.value).splitlines() == [
        "invalid config node.yaml (3 problems; nothing was run):",
        "  node.yaml:1: shm.size: invalid size '12Q': unknown unit 'Q'; use K, M, G, T, KiB, GiB, KB, GB or N%",
        "  node.yaml:4: datasets[0].verify: 'md5' is not a verify mode; use size or checksum",
        "  node.yaml:5: extra: unknown key; expected one of: version, shm, dest, reserve, datasets, pillow_simd, loader, service, store_tmpfs, shares",
    ]
    assert [p.key for p in info.value.problems] == ["shm.size", "datasets[0].verify", "extra"]


def test_unsafe_yaml_tags_are_refused():
    """Python object tags are not constructed (safe loading only)."""
    with pytest.raises(ConfigError, match=r"node.yaml:1: dest: cannot read this value"):
        parse_config("dest: !!python/name:os.system ''\n", "node.yaml")


def test_missing_default_config_names_the_option(monkeypatch, tmp_path):
    """No file at the default path: the error says to write one or pass --config."""
    monkeypatch.delenv("SHMSTAGE_CONFIG", raising=False)
    monkeypatch.setattr("shmstage.config.DEFAULT_PATH", str(tmp_path / "shmstage.yaml"))
    with pytest.raises(ConfigError) as info:
        load_config()
    assert str(info.value) == (
        f"no node config at {tmp_path / 'shmstage.yaml'}; write one (see docs/config.md) or pass --config PATH"
    )


def test_env_var_picks_the_file_and_a_missing_one_is_an_error(monkeypatch, tmp_path):
    """$SHMSTAGE_CONFIG is read when no path is given; a missing named file is an error."""
    good = tmp_path / "node.yaml"
    good.write_text("dest: /x/y\n")
    monkeypatch.setenv("SHMSTAGE_CONFIG", str(good))
    assert load_config().dest == "/x/y"
    monkeypatch.setenv("SHMSTAGE_CONFIG", str(tmp_path / "nope.yaml"))
    with pytest.raises(
        ConfigError, match=r"nope.yaml does not exist; check --config / \$SHMSTAGE_CONFIG"
    ):
        load_config()


def test_loader_env_maps_the_loader_section(tmp_path):
    """loader_env gives the SHMSTAGE_* variables `shmstage run` exports, only for keys that are set."""
    f = tmp_path / "node.yaml"
    f.write_text("loader: {num_workers: 6, pin_memory: false, prefetch_factor: 3}\n")
    assert loader_env(f) == {
        "SHMSTAGE_NUM_WORKERS": "6",
        "SHMSTAGE_PIN_MEMORY": "0",
        "SHMSTAGE_PREFETCH_FACTOR": "3",
    }
    f.write_text("loader: {num_workers: auto}\n")
    assert loader_env(f) == {"SHMSTAGE_NUM_WORKERS": "auto"}


def test_loader_env_is_empty_without_a_config(monkeypatch, tmp_path):
    """No config file at the default path is not an error for `shmstage run`: no variables."""
    monkeypatch.delenv("SHMSTAGE_CONFIG", raising=False)
    monkeypatch.setattr("shmstage.config.DEFAULT_PATH", str(tmp_path / "absent.yaml"))
    assert loader_env() == {}


def test_loader_env_rejects_an_invalid_config(tmp_path):
    """An invalid config is not silently ignored by `shmstage run`."""
    f = tmp_path / "node.yaml"
    f.write_text("loader: {num_workers: many}\n")
    with pytest.raises(
        ConfigError, match="loader.num_workers: expected a whole number, got 'many'"
    ):
        loader_env(f)


def test_cli_reports_config_errors_before_running_anything(runner, cli, tmp_path):
    """`prepare` with a bad config exits 2 with the error line and runs no step."""
    f = tmp_path / "node.yaml"
    f.write_text("shm:\n  size: lots\n")
    result = runner.invoke(cli, ["prepare", "--config", str(f), "--json"])
    assert result.exit_code == 2
    assert result.stdout == ""
    assert result.stderr == (
        f"Error: {f}:2: shm.size: invalid size 'lots': use bytes or a number with K, M, G, T "
        "(powers of 1024; KiB/GiB too, KB/GB are powers of 1000) or N%\n"
    )


@pytest.mark.parametrize(
    ("written", "expected"),
    [
        ("9.10", "9.10"),
        ("9.5", "9.5"),
        ("10", "10"),
        ("'9.10'", "9.10"),
        ("9.5.0.post1", "9.5.0.post1"),
    ],
)
def test_pillow_simd_version_keeps_the_text_as_written(written, expected):
    """`version: 9.10` is read by YAML as the float 9.1; the pin must stay "9.10"."""
    cfg = parse(f"pillow_simd:\n  enabled: true\n  version: {written}\n")
    assert cfg.pillow_simd.version == expected


# --- reserve: stage and run keep the node config's, the command line wins ----------------


def test_node_reserve_reads_the_config(tmp_path, monkeypatch):
    """node_reserve: the config's reserve in bytes; None without a config file or a reserve."""
    from shmstage.config import node_reserve

    cfg = tmp_path / "node.yaml"
    cfg.write_text("reserve: 60M\n")
    assert node_reserve(cfg) == 60 << 20
    monkeypatch.setenv("SHMSTAGE_CONFIG", str(cfg))
    assert node_reserve() == 60 << 20
    cfg.write_text("datasets: []\n")
    assert node_reserve(cfg) is None
    monkeypatch.delenv("SHMSTAGE_CONFIG")
    monkeypatch.setattr("shmstage.config.DEFAULT_PATH", str(tmp_path / "absent.yaml"))
    assert node_reserve() is None


def _ten_mib_dataset(root):
    import os

    root.mkdir()
    for i in range(10):
        (root / f"{i}.bin").write_bytes(os.urandom(1 << 20))
    return root


@pytest.mark.root
@pytest.mark.parametrize("command", ["stage", "run"])
def test_stage_and_run_keep_the_node_configs_reserve(tmpfs, tmp_path, shmstage_bin, command):
    """A 60M config reserve refuses 10M on a 64M tmpfs; --reserve, then its variable, win over it."""
    import os
    import subprocess

    src = _ten_mib_dataset(tmp_path / "ds")
    mnt = tmpfs("64M")
    cfg = tmp_path / "node.yaml"
    cfg.write_text("reserve: 60M\n")
    job = ["--", "true"] if command == "run" else ["-q"]
    source = ["--stage", str(src)] if command == "run" else [str(src)]

    def sh(dest, *extra, **env):
        return subprocess.run(
            [*shmstage_bin, command, *source, "--dest", str(mnt / dest), *extra, *job],
            capture_output=True, text=True, timeout=120,
            env={**os.environ, "SHMSTAGE_CONFIG": str(cfg), **env},
        )  # fmt: skip

    r = sh("a")
    assert r.returncode == 2, r.stderr
    assert "+ 60.0 MiB reserve" in r.stderr and "Traceback" not in r.stderr
    assert not (mnt / "a" / "ds").exists()
    r = sh("b", "--reserve", "1M", **{f"SHMSTAGE_{command.upper()}_RESERVE": "63M"})
    assert r.returncode == 0, r.stderr  # the command line wins over the variable
    r = sh("c", **{f"SHMSTAGE_{command.upper()}_RESERVE": "1M"})
    assert r.returncode == 0, r.stderr  # the variable wins over the config
    r = sh("d", **{f"SHMSTAGE_{command.upper()}_RESERVE": "63M"})
    assert r.returncode == 2 and "+ 63.0 MiB reserve" in r.stderr, r.stderr


def test_reserve_takes_what_the_reserve_option_takes():
    """reserve: bytes, a size or N% of the tmpfs (as --reserve); 0 is no reserve; 100% is refused."""
    assert parse("reserve: 10%\n").reserve == "10%"
    assert parse("reserve: 12.5 %\n").reserve == "12.5%"
    assert parse("reserve: 0\n").reserve == 0
    assert parse("reserve: 1G\n").reserve == 1 << 30


def test_auto_size_keeps_a_percentage_reserve_of_the_size_it_computes(monkeypatch, tmp_path):
    """shm.size: auto with reserve: 20%: the reserve is 20% of the tmpfs it sizes (base / 0.8)."""
    from shmstage import prepare, system

    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setattr(system, "disk_usage", lambda path: type("U", (), {"used": 0})())
    monkeypatch.setattr(prepare, "footprint", lambda path, dest=None: (0, 0))
    cfg = parse(f"shm: {{path: {shm}, size: auto}}\ndest: {shm}/d\nreserve: 20%\n")
    size = prepare.auto_size(cfg)
    assert size == 2 << 20  # 1 MiB of bookkeeping is 80%: 1.25 MiB, rounded up to MiB
    assert (
        prepare.auto_size(parse(f"shm: {{path: {shm}, size: auto}}\ndest: {shm}/d\nreserve: 0\n"))
        == 1 << 20
    )


@pytest.mark.root
@pytest.mark.parametrize("command", ["stage", "run"])
def test_stage_and_run_keep_a_percentage_reserve_of_the_tmpfs(
    tmpfs, tmp_path, shmstage_bin, command
):
    """A config reserve of 90% refuses 10M on a 64M tmpfs (57.6M kept free), as --reserve 90% does; 10% lets it in."""
    import os
    import subprocess

    src = _ten_mib_dataset(tmp_path / "ds")
    mnt = tmpfs("64M")
    cfg = tmp_path / "node.yaml"
    job = ["--", "true"] if command == "run" else ["-q"]
    source = ["--stage", str(src)] if command == "run" else [str(src)]

    def sh(dest, reserve):
        cfg.write_text(f"reserve: {reserve}\n")
        return subprocess.run(
            [*shmstage_bin, command, *source, "--dest", str(mnt / dest), *job],
            capture_output=True, text=True, timeout=120,
            env={**os.environ, "SHMSTAGE_CONFIG": str(cfg)},
        )  # fmt: skip

    r = sh("a", "90%")
    assert r.returncode == 2, r.stderr
    assert "+ 57.6 MiB reserve" in r.stderr and "Traceback" not in r.stderr
    r = sh("b", "10%")
    assert r.returncode == 0, r.stderr
    assert (mnt / "b" / "ds").is_dir()


def test_service_keys_parse_into_typed_sections():
    """service, store_tmpfs and shares land in their typed fields; a group name becomes its gid."""
    cfg = parse(
        """\
        service: {enabled: true, socket: /run/x/s.sock}
        store_tmpfs: {path: /var/cache/shmstage/, size: 50%, mode: 1777, fstab: /tmp/fstab}
        shares:
          - {source: "s3://bkt/pub/", everyone: true}
          - {source: s3://bkt/pub/team, group: root}
          - {source: gs://bkt2/x, group: 4242}
        """
    )
    assert cfg.service == ServiceConfig(enabled=True, socket="/run/x/s.sock")
    assert cfg.store_tmpfs == StoreTmpfsConfig("/var/cache/shmstage", "50%", "1777", "/tmp/fstab")
    assert cfg.shares == (
        ShareConfig("s3://bkt/pub", None, True, None),
        ShareConfig("s3://bkt/pub/team", 0, False, "root"),
        ShareConfig("gs://bkt2/x", 4242, False, "4242"),
    )


def test_service_defaults_and_store_mode_as_written():
    """No service section: off, on the default socket; an unquoted 0755 stays 0755 (not 493)."""
    cfg = parse("datasets: []\n")
    assert cfg.service == ServiceConfig(False, "/run/shmstage/shmstage.sock")
    assert cfg.store_tmpfs is None and cfg.shares == ()
    cfg = parse("store_tmpfs: {path: /srv/s, size: 64G, mode: 0755}\n")
    assert cfg.store_tmpfs == StoreTmpfsConfig("/srv/s", 64 << 30, "0755", "/etc/fstab")
    assert parse("store_tmpfs: {path: /srv/s, size: 1G, mode: 755}\n").store_tmpfs.mode == "0755"
    assert parse("store_tmpfs: {path: /srv/s, size: 1G}\n").store_tmpfs.mode == "0755"


def test_dest_defaults_to_the_store_tmpfs():
    """With store_tmpfs and no dest, copies go to <store_tmpfs.path>/shmstage; dest still wins."""
    assert parse("store_tmpfs: {path: /srv/s, size: 1G}\n").dest == "/srv/s/shmstage"
    text = "store_tmpfs: {path: /srv/s, size: 1G}\ndest: /scratch/x\n"
    assert parse(text).dest == "/scratch/x"


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("s3://bkt/pub/team/imagenet", (1001, False)),  # the longest prefix: the team's group
        ("s3://bkt/pub/team", (1001, False)),
        ("s3://bkt/pub/team/", (1001, False)),
        ("s3://bkt/pub/other", (None, True)),  # only the shorter, everyone share contains it
        ("s3://bkt/pub", (None, True)),
        ("s3://bkt/public", (None, False)),  # a prefix matches whole components only
        ("s3://bkt/pub/teamx", (None, True)),
        ("s3://bkt", (None, False)),
        ("gs://bkt/pub/team", (None, False)),  # another scheme: another store
        ("s3://other/a", (7, False)),
    ],
)
def test_share_for_longest_prefix_wins(source, expected):
    """share_for picks the longest share prefix containing the source, by whole components."""
    shares = (
        ShareConfig("s3://bkt/pub", None, True),
        ShareConfig("s3://bkt/pub/team", 1001, False, "ml"),
        ShareConfig("s3://other", 7, False, "7"),
    )
    assert share_for(source, shares) == expected
    assert share_for(source, ()) == (None, False)


def test_node_service_store_and_shares_read_the_config(tmp_path, monkeypatch):
    """The node_* readers: None / () without a config file, the sections with one."""
    monkeypatch.delenv("SHMSTAGE_CONFIG", raising=False)
    monkeypatch.setattr("shmstage.config.DEFAULT_PATH", str(tmp_path / "absent.yaml"))
    assert node_service() is None and node_store_tmpfs() is None and node_shares() == ()
    path = tmp_path / "node.yaml"
    path.write_text(
        "service: {enabled: true}\nstore_tmpfs: {path: /srv/s, size: 2G}\n"
        "shares: [{source: s3://bkt/a, group: 0}]\n"
    )
    assert node_service(path) == ServiceConfig(True)
    assert node_store_tmpfs(path) == StoreTmpfsConfig("/srv/s", 2 << 30)
    assert node_shares(path) == (ShareConfig("s3://bkt/a", 0, False, "0"),)
    path.write_text("datasets: []\n")
    assert node_service(path) == ServiceConfig() and node_store_tmpfs(path) is None
