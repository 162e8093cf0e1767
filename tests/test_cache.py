"""The node cache (issue 14): storage tiers, LRU make-room under leases, metrics.

Real tmpfs tiers in the test's private mount namespace, real stagers, real lease holders
and real SIGKILL; the metrics file is read back with prometheus_client's own parser."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from shmstage.stage import engine, holders
from shmstage.stage.build import copier
from shmstage.stage.build.estimate import estimate
from shmstage.stage.cache import makeroom
from shmstage.stage.store import Store, counters
from tests.test_stage_lease import HOLDER, kill, wait_for

pytestmark = pytest.mark.root

MIB = 1 << 20


@pytest.fixture
def tmp_path(open_tmp_path):
    """Sources every user can reach (see tests/test_stage.py)."""
    return open_tmp_path


def make_ds(root: Path, mib: int, files: int = 1) -> Path:
    """A dataset of ``files`` files, ``mib`` MiB in all, distinct bytes."""
    root.mkdir(parents=True)
    for i in range(files):
        (root / f"{i}.bin").write_bytes(os.urandom(mib * MIB // files))
    return root


def sh(shmstage_bin, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*shmstage_bin, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def hold(procs, name: str, dest: Path | str) -> subprocess.Popen:
    """A process holding a lease on ``name`` (prints the path once it holds it)."""
    p = procs.start(
        [sys.executable, "-c", HOLDER, name, str(dest)], stdout=subprocess.PIPE, text=True
    )
    assert p.stdout.readline().strip().endswith("/" + name)
    return p


def names_in(tier: Path) -> list[str]:
    return (
        sorted(d.name for d in tier.iterdir() if not d.name.startswith("."))
        if tier.exists()
        else []
    )


@pytest.fixture
def two_tiers(tmpfs):
    """A small and a large tmpfs: (tier1, tier2, "tier1,tier2")."""
    t1 = tmpfs("8M", name="ram") / "shmstage"
    t2 = tmpfs("48M", name="nvme") / "shmstage"
    return t1, t2, f"{t1},{t2}"


def test_larger_than_tier1_lands_in_tier2_and_is_found_there(two_tiers, tmp_path, shmstage_bin):
    """A dataset larger than tier 1 is staged into tier 2 with the reason tier 1 was skipped;
    a small one goes to tier 1; restaging finds each where it is (no second copy); list
    shows the tier and `run` hands the job the tier-2 path ({staged} and SHMSTAGE_DATA)."""
    t1, t2, dest = two_tiers
    big, small = make_ds(tmp_path / "big", 12), make_ds(tmp_path / "small", 2)
    r = sh(shmstage_bin, "stage", str(big), "--dest", dest, "--reserve", "1M")
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"{t2}/big\n"
    assert f"skipped tier {t1}: needs 12.0 MiB + 1.0 MiB reserve but only " in r.stderr
    assert f"tier 2 of 2: {t2}\n" in r.stderr
    r = sh(shmstage_bin, "stage", str(small), "--reserve", "1M", env={"SHMSTAGE_DEST": dest})
    assert r.returncode == 0 and r.stdout == f"{t1}/small\n", r.stderr
    # Tier 1 has room for "big" now? No, but even if it had: it is found where it is.
    r = sh(shmstage_bin, "stage", str(big), "--dest", dest, "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert (got["path"], got["tier"], got["tier_index"], got["changed"]) == (
        f"{t2}/big", str(t2), 1, False,
    )  # fmt: skip
    assert names_in(t1) == ["small"] and names_in(t2) == ["big"]
    listed = json.loads(sh(shmstage_bin, "list", "--dest", dest, "--json").stdout)
    assert [(x["name"], x["tier"]) for x in listed] == [("small", str(t1)), ("big", str(t2))]
    table = sh(shmstage_bin, "list", "--dest", dest).stdout
    assert table.splitlines()[0].split()[:2] == ["TIER", "NAME"]
    assert f"2:{t2}" in table
    r = sh(
        shmstage_bin, "run", "--stage", str(big), "--dest", dest, "--",
        "sh", "-c", 'echo "$1 $SHMSTAGE_DATA"', "job", "{staged}",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"{t2}/big {t2}/big\n"


def test_concurrent_stagers_race_for_tier1_the_loser_goes_to_tier2(
    two_tiers, tmp_path, shmstage_bin, procs
):
    """Two stagers of different datasets that each fit tier 1 alone but not together: the
    second sees the first's reservation, skips tier 1 before writing a byte, and lands in
    tier 2; nobody runs out of space."""
    t1, t2, dest = two_tiers
    a = make_ds(tmp_path / "a", 4, files=16)
    b = make_ds(tmp_path / "b", 4, files=16)
    args = ["--dest", dest, "--reserve", "1M", "--workers", "1"]
    pa = procs.start(
        [*shmstage_bin, "stage", str(a), *args],
        env={**os.environ, copier.SLOW_ENV: "0.1"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    wait_for(lambda: (t1 / ".shmstage" / "partial" / "a" / "0.bin").exists(), "a copying", pa)
    rb = sh(shmstage_bin, "stage", str(b), *args)
    out_a, err_a = pa.communicate(timeout=120)
    assert pa.returncode == 0 and out_a == f"{t1}/a\n", err_a
    assert rb.returncode == 0 and rb.stdout == f"{t2}/b\n", rb.stderr
    assert "promised to other stagers" in rb.stderr
    assert "space left" not in err_a + rb.stderr


def test_two_stagers_of_one_dataset_share_one_copy_in_one_tier(
    two_tiers, tmp_path, shmstage_bin, procs
):
    """Two stagers of the same dataset with two tiers: the second waits for the first (and
    says so, naming its pid), then finds the copy; it is in one tier only."""
    t1, t2, dest = two_tiers
    src = make_ds(tmp_path / "ds", 4, files=16)
    args = ["stage", str(src), "--dest", dest, "--reserve", "1M", "--workers", "1"]
    pa = procs.start(
        [*shmstage_bin, *args], env={**os.environ, copier.SLOW_ENV: "0.1"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    wait_for(lambda: (t1 / ".shmstage" / "partial" / "ds" / "0.bin").exists(), "a copying", pa)
    rb = sh(shmstage_bin, *args)
    out_a, err_a = pa.communicate(timeout=120)
    assert pa.returncode == 0 and out_a == f"{t1}/ds\n", err_a
    assert rb.returncode == 0 and rb.stdout == f"{t1}/ds\n", rb.stderr
    assert f"waiting for another shmstage (pid {pa.pid}) staging this dataset..." in rb.stderr
    assert "ds is up to date" in rb.stderr
    assert names_in(t1) == ["ds"] and names_in(t2) == []


def stage_lru(shmstage_bin, procs, tier: Path, tmp_path: Path) -> subprocess.Popen:
    """old (leased), a, c staged in this order into ``tier`` (4 MiB each): the LRU order is
    old, a, c, and old is held by a live job; returns the holder."""
    for n in ("old", "a", "c"):
        src = make_ds(tmp_path / n, 4)
        r = sh(shmstage_bin, "stage", str(src), "--dest", str(tier), "--reserve", "1M", "-q")
        assert r.returncode == 0, r.stderr
        if n == "old":
            holder = hold(procs, "old", tier)
    return holder


def test_make_room_evicts_only_the_lru_unleased(tmpfs, tmp_path, shmstage_bin, procs):
    """Of one leased and two unleased datasets, make-room evicts the least recently used
    unleased one only (the leased one is older still and stays); --dry-run says so first and
    removes nothing; more than all unleased can free is refused with nothing removed."""
    tier = tmpfs("20M", name="ram") / "shmstage"
    stage_lru(shmstage_bin, procs, tier, tmp_path)
    new = make_ds(tmp_path / "new", 9)
    args = ["stage", str(new), "--dest", str(tier), "--reserve", "1M"]
    r = sh(shmstage_bin, *args)
    assert r.returncode == 2 and r.stderr.startswith("Error: dataset does not fit: ")
    r = sh(shmstage_bin, *args, "--make-room", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0].startswith(f"would evict a from {tier} (4.0 MiB, last used ")
    assert r.stdout.splitlines()[1] == f"would stage 9.0 MiB into tier 1: {tier}/new"
    assert len(r.stdout.splitlines()) == 2
    assert names_in(tier) == ["a", "c", "old"]
    too_big = make_ds(tmp_path / "huge", 16)
    r = sh(
        shmstage_bin, "stage", str(too_big), "--dest", str(tier), "--reserve", "1M", "--make-room"
    )
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("Error: dataset does not fit: needs 16.0 MiB + 1.0 MiB reserve ")
    assert "even after evicting all 2 unleased dataset(s), 8.0 MiB; 1 more leased" in r.stderr
    assert names_in(tier) == ["a", "c", "old"]  # refused before removing anything
    r = sh(shmstage_bin, *args, "--make-room", "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert [v["name"] for v in got["evicted"]] == ["a"]
    assert names_in(tier) == ["c", "new", "old"]
    assert counters.read(tier).evictions == 1
    # A dataset already staged in the full tier is restaged in place: nothing to evict.
    for extra in (["--dry-run"], []):
        r = sh(shmstage_bin, "stage", str(tmp_path / "c"), "--dest", str(tier), "--reserve", "1M",
               "--make-room", *extra)  # fmt: skip
        assert r.returncode == 0 and "evict" not in r.stdout + r.stderr, r.stdout + r.stderr
    assert r.stderr.startswith("c is up to date")
    assert names_in(tier) == ["c", "new", "old"]


def test_sigkilled_lease_holder_no_longer_blocks_make_room(tmpfs, tmp_path, shmstage_bin, procs):
    """A lease held by a process that is then SIGKILLed does not keep its dataset: the make-room
    that was refused while it lived evicts it (LRU first) once it is dead."""
    tier = tmpfs("20M", name="ram") / "shmstage"
    holder = stage_lru(shmstage_bin, procs, tier, tmp_path)
    new = make_ds(tmp_path / "new", 16)
    args = ["stage", str(new), "--dest", str(tier), "--reserve", "1M", "--make-room"]
    r = sh(shmstage_bin, *args)
    assert r.returncode == 2 and "1 more leased by running jobs" in r.stderr, r.stderr
    os.kill(holder.pid, signal.SIGKILL)
    kill(holder)
    assert holders("old", tier) == ()
    r = sh(shmstage_bin, *args)
    assert r.returncode == 0, r.stderr
    assert f"evicted old from {tier} to make room" in r.stderr
    evicted = [line.split()[1] for line in r.stderr.splitlines() if line.startswith("evicted ")]
    assert evicted == ["old", "a", "c"]  # LRU order: the dead job's dataset is the oldest
    assert names_in(tier) == ["new"]


def test_a_victim_leased_after_the_plan_is_kept(tmpfs, tmp_path, procs):
    """make-room's plan chose a dataset, then a job leased it: the eviction refuses it (the
    lease is taken exclusively first) and it stays, with a note saying why."""
    tier = tmpfs("20M", name="ram") / "shmstage"
    for n in ("a", "b"):
        engine.stage(make_ds(tmp_path / n, 4), dest=tier, reserve="1M")
    est = estimate(make_ds(tmp_path / "new", 17), tier)
    room = makeroom.plan(est, "new", str(tier), "1M")
    assert room.fits and [v.name for v in room.victims] == ["a", "b"]
    holder = hold(procs, "a", tier)
    removed, notes = makeroom.evict(room, engine.evict_report)
    assert [v.name for v in removed] == ["b"]
    assert notes == [f"kept a: leased meanwhile by pid {holder.pid} ({notes[0].split('(', 1)[1]}"]
    assert names_in(tier) == ["a"]


def test_cache_max_size_from_the_config_evicts_lru(tmpfs, tmp_path, shmstage_bin):
    """A tier with `cache: {max_size: 50%}` in the node config keeps its datasets under that
    size by itself (no --make-room): the LRU one goes."""
    tier = tmpfs("20M", name="ram") / "shmstage"
    cfg = tmp_path / "node.yaml"
    cfg.write_text(
        f"version: 1\ndest:\n  - path: {tier}\n    cache: {{max_size: 50%, policy: lru}}\n"
    )
    env = {"SHMSTAGE_CONFIG": str(cfg)}
    for n in ("a", "b"):
        r = sh(shmstage_bin, "stage", str(make_ds(tmp_path / n, 4)), "--reserve", "1M", env=env)
        assert r.returncode == 0 and r.stdout == f"{tier}/{n}\n", r.stderr
    r = sh(shmstage_bin, "stage", str(make_ds(tmp_path / "c", 4)), "--reserve", "1M", env=env)
    assert r.returncode == 0, r.stderr
    assert f"evicted a from {tier}" in r.stderr
    assert names_in(tier) == ["b", "c"]
    r = sh(shmstage_bin, "stage", str(make_ds(tmp_path / "d", 11)), "--reserve", "1M", env=env)
    assert r.returncode == 2 and "is larger than the cache's max_size (10.0 MiB)" in r.stderr
    assert names_in(tier) == ["b", "c"]


def test_metrics_textfile_parses_with_prometheus_client(two_tiers, tmp_path, shmstage_bin, procs):
    """`metrics --textfile DIR` writes DIR/shmstage.prom (no temporary file left) that
    prometheus_client parses: tier sizes, per-dataset bytes/files/leases, and the persistent
    counters (hits, misses, bytes copied, evictions)."""
    from prometheus_client.parser import text_string_to_metric_families

    t1, t2, dest = two_tiers
    small, big = make_ds(tmp_path / "small", 2, files=4), make_ds(tmp_path / "big", 12)
    for src in (small, small, big):
        assert (
            sh(shmstage_bin, "stage", str(src), "--dest", dest, "--reserve", "1M").returncode == 0
        )
    assert sh(shmstage_bin, "evict", "big", "--dest", dest).returncode == 0
    assert sh(shmstage_bin, "stage", str(big), "--dest", dest, "--reserve", "1M").returncode == 0
    hold(procs, "small", t1)
    out = tmp_path / "textfile"
    out.mkdir()
    r = sh(shmstage_bin, "metrics", "--textfile", str(out), "--dest", dest)
    assert r.returncode == 0 and r.stdout == "", r.stderr
    assert os.listdir(out) == ["shmstage.prom"]
    families = {
        f.name: {tuple(sorted(s.labels.items())): s.value for s in f.samples}
        for f in text_string_to_metric_families((out / "shmstage.prom").read_text())
    }
    ram, nvme = (("tier", str(t1)),), (("tier", str(t2)),)
    assert families["shmstage_stage_hits"] == {ram: 1, nvme: 0}
    assert families["shmstage_stage_misses"] == {ram: 1, nvme: 2}
    assert families["shmstage_copied_bytes"] == {ram: 2 * MIB, nvme: 24 * MIB}
    assert families["shmstage_evictions"] == {ram: 0, nvme: 1}
    assert families["shmstage_dataset_files"] == {
        (("name", "small"), *ram): 4, (("name", "big"), *nvme): 1,
    }  # fmt: skip
    assert families["shmstage_dataset_leases"][(("name", "small"), *ram)] == 1
    assert families["shmstage_dataset_bytes"][(("name", "big"), *nvme)] == 12 * MIB
    sizes = families["shmstage_tier_size_bytes"]
    assert sorted(sizes.values()) == [8 * MIB, 48 * MIB]
    r = sh(shmstage_bin, "metrics", "--textfile", str(tmp_path / "missing"), "--dest", dest)
    assert r.returncode == 1 and r.stderr.startswith(
        f"Error: textfile directory {tmp_path / 'missing'} does not exist; "
    )


def test_counters_add_up_under_concurrency(tmp_path):
    """Four processes adding to the same counters at once lose no increment."""
    dest = tmp_path / "dest"
    Store(dest).open()
    code = (
        "import sys\nfrom shmstage.stage.store import counters\n"
        "for _ in range(50): counters.add(sys.argv[1], hits=1, copied_bytes=3)\n"
    )
    ps = [subprocess.Popen([sys.executable, "-c", code, str(dest)]) for _ in range(4)]
    assert [p.wait(timeout=120) for p in ps] == [0, 0, 0, 0]
    assert counters.read(dest) == counters.Counters(hits=200, copied_bytes=600)


def test_worked_example_two_tiers_three_jobs(tmpfs, tmp_path, shmstage_bin, procs):
    """docs/cache.md's worked example, scaled to MiB: RAM tier with max_size 60%, an NVMe
    tier; job 1 stages imagenet (RAM) and ends; job 2 runs on coco (RAM) and laion (larger
    than max_size: NVMe); job 3's openimages evicts imagenet (LRU, unleased), never the coco
    that job 2 still reads."""
    ram = tmpfs("20M", name="shm") / "shmstage"
    nvme = tmpfs("48M", name="nvme") / "shmstage"
    cfg = tmp_path / "shmstage.yaml"
    cfg.write_text(
        f"version: 1\ndest:\n  - path: {ram}\n    cache: {{max_size: 60%, policy: lru}}\n"
        f"  - {nvme}\n"
    )
    env = {"SHMSTAGE_CONFIG": str(cfg)}
    src = {n: make_ds(tmp_path / "nfs" / n, m) for n, m in (
        ("imagenet", 6), ("coco", 3), ("laion", 14), ("openimages", 5))}  # fmt: skip
    r = sh(shmstage_bin, "run", "--stage", str(src["imagenet"]), "--", "true", env=env)
    assert r.returncode == 0, r.stderr
    job2 = procs.start(
        [*shmstage_bin, "run", "--stage", str(src["coco"]), "--stage", str(src["laion"]),
         "--", "sleep", "60"],
        env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    wait_for(lambda: holders("laion", nvme), "job 2's leases", job2)
    assert holders("coco", ram)
    r = sh(
        shmstage_bin, "run", "--stage", str(src["openimages"]), "--",
        "sh", "-c", 'echo "$SHMSTAGE_DATA"', env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"{ram}/openimages\n"
    assert f"evicted imagenet from {ram} to make room\n" in r.stderr
    assert names_in(ram) == ["coco", "openimages"] and names_in(nvme) == ["laion"]
    listed = json.loads(sh(shmstage_bin, "list", "--json", env=env).stdout)
    assert [(x["name"], x["tier"], bool(x["leased_by"])) for x in listed] == [
        ("coco", str(ram), True), ("openimages", str(ram), False), ("laion", str(nvme), True),
    ]  # fmt: skip
    assert counters.read(ram).evictions == 1
