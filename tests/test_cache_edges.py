"""The node cache at its edges (issue 20): a renumbered block device, tiers listed in
another order, make-room under a memory cgroup, restages under make-room and max_size,
concurrent stagers against max_size, and non-root jobs' use of root-staged datasets.

Real loop devices, tmpfs tiers in the test's private mount namespace, real cgroups, real
concurrent stagers and real users (setpriv)."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shmstage import system
from shmstage.stage.build import copier
from tests.test_cache import make_ds, names_in, sh
from tests.test_stage_lease import wait_for

pytestmark = pytest.mark.root

MIB = 1 << 20


@pytest.fixture
def tmp_path(open_tmp_path):
    """Sources every user can reach (see tests/test_stage.py)."""
    return open_tmp_path


def _losetup(*args: str) -> str:
    return subprocess.run(
        ["losetup", *args], capture_output=True, text=True, check=True, timeout=60
    ).stdout.strip()


def test_gc_keeps_every_dataset_after_the_block_device_is_renumbered(tmp_path, shmstage_bin):
    """A tier on an ext4 file system whose loop device is re-attached under another number
    (as NVMe disks are renumbered at boot): the datasets are still listed, a restage is a
    no-op, and gc removes nothing."""
    img = tmp_path / "tier.img"
    with open(img, "wb") as f:
        f.truncate(64 * MIB)
    subprocess.run(["mkfs.ext4", "-q", str(img)], check=True, timeout=120)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    tier = mnt / "shmstage"
    attached: list[str] = []
    mounted = False
    try:
        attached.append(_losetup("--find", "--show", str(img)))
        subprocess.run(["mount", attached[0], str(mnt)], check=True, timeout=60)
        mounted = True
        srcs = [make_ds(tmp_path / n, 2, files=3) for n in ("a", "b")]
        for src in srcs:
            r = sh(shmstage_bin, "stage", str(src), "--dest", str(tier), "--reserve", "1M", "-q")
            assert r.returncode == 0, r.stderr
        before = os.stat(mnt).st_dev
        subprocess.run(["umount", str(mnt)], check=True, timeout=60)
        mounted = False
        # The image is attached again while the first device still holds it: another number.
        attached.append(_losetup("--find", "--show", str(img)))
        _losetup("-d", attached.pop(0))
        subprocess.run(["mount", attached[0], str(mnt)], check=True, timeout=60)
        mounted = True
        assert os.stat(mnt).st_dev != before
        r = sh(shmstage_bin, "gc", "--dest", str(tier), "--json")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["removed"] == []
        assert names_in(tier) == ["a", "b"]
        listed = json.loads(sh(shmstage_bin, "list", "--dest", str(tier), "--json").stdout)
        assert [x["name"] for x in listed] == ["a", "b"]
        r = sh(shmstage_bin, "stage", str(srcs[0]), "--dest", str(tier), "--reserve", "1M")
        assert r.returncode == 0 and r.stderr.startswith("a is up to date"), r.stderr
        r = sh(shmstage_bin, "verify", "b", "--dest", str(tier))
        assert r.returncode == 0, r.stdout + r.stderr
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(mnt)], check=False, timeout=60)
        for dev in attached:
            subprocess.run(["losetup", "-d", dev], check=False, timeout=60)


@pytest.fixture
def two_tiers(tmpfs):
    """Two tmpfs tiers, each large enough for the datasets here: (tier1, tier2)."""
    return tmpfs("16M", name="ram") / "shmstage", tmpfs("16M", name="nvme") / "shmstage"


def test_stagers_listing_tiers_in_opposite_orders_make_one_copy(
    two_tiers, tmp_path, shmstage_bin, procs
):
    """`--dest A,B` and `--dest B,A` staging one dataset at once: the second waits for the
    first, whatever the order, then finds its copy; one copy, and both print its path."""
    t1, t2 = two_tiers
    src = make_ds(tmp_path / "ds", 4, files=16)
    common = ["stage", str(src), "--reserve", "1M", "--workers", "1"]
    slow = {**os.environ, copier.SLOW_ENV: "0.1"}
    pa = procs.start(
        [*shmstage_bin, *common, "--dest", f"{t1},{t2}"], env=slow,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    wait_for(lambda: (t1 / ".shmstage" / "partial" / "ds" / "0.bin").exists(), "a copying", pa)
    rb = sh(shmstage_bin, *common, "--dest", f"{t2},{t1}")
    out_a, err_a = pa.communicate(timeout=120)
    assert pa.returncode == 0 and out_a == f"{t1}/ds\n", err_a
    assert rb.returncode == 0 and rb.stdout == f"{t1}/ds\n", rb.stderr
    assert "ds is up to date" in rb.stderr
    assert names_in(t1) == ["ds"] and names_in(t2) == []


PROBE = "from shmstage import system; print(system.memory().usable)"


@pytest.fixture
def memory_cgroup():
    """A fresh cgroup v1 memory cgroup under ours: its path (skip where there is none)."""
    mine = system._cgroup_paths("/proc").get("memory")
    root = Path("/sys/fs/cgroup/memory")
    if mine is None or not root.is_dir() or Path("/sys/fs/cgroup/cgroup.controllers").exists():
        pytest.skip("needs a cgroup v1 memory hierarchy")
    cg = root / mine.strip("/") / f"shmstage-cache-test-{os.getpid()}"
    try:
        cg.mkdir()
    except OSError as e:
        pytest.skip(f"cannot create a memory cgroup: {e}")
    yield cg
    for _ in range(100):  # its processes have exited; the kernel frees it shortly after
        try:
            cg.rmdir()
            break
        except OSError:
            time.sleep(0.1)


def in_cgroup(cg: Path, argv: list[str]) -> subprocess.CompletedProcess:
    """Run ``argv`` as a process of the cgroup ``cg`` (its memory is charged there)."""
    script = f'echo $$ > {cg}/cgroup.procs && exec "$@"'
    return subprocess.run(
        ["sh", "-c", script, "sh", *argv], capture_output=True, text=True, timeout=300
    )


def test_make_room_counts_the_ram_evicting_frees_under_a_memory_cgroup(
    tmpfs, tmp_path, shmstage_bin, memory_cgroup
):
    """In a memory cgroup whose limit, not the tmpfs, is what is short: make-room counts the
    RAM that evicting the LRU dataset gives back, evicts that one only, and stages."""
    cg = memory_cgroup
    tier = tmpfs("512M", name="ram") / "shmstage"
    (cg / "memory.limit_in_bytes").write_text(str(1 << 30))
    args = ["--dest", str(tier), "--reserve", "1M", "--workers", "1"]
    for n in ("a", "b"):
        r = in_cgroup(cg, [*shmstage_bin, "stage", str(make_ds(tmp_path / n, 100)), *args])
        assert r.returncode == 0, r.stderr
    # Lower the limit so ~50 MiB stays usable: the 100 MiB of "c" fits only once "a" is gone.
    usable = int(in_cgroup(cg, [sys.executable, "-c", PROBE]).stdout)
    (cg / "memory.limit_in_bytes").write_text(str((1 << 30) - usable + 50 * MIB))
    c = make_ds(tmp_path / "c", 100)
    r = in_cgroup(cg, [*shmstage_bin, "stage", str(c), *args])
    assert r.returncode == 2 and "is usable (the memory cgroup limit)" in r.stderr, r.stderr
    r = in_cgroup(cg, [*shmstage_bin, "stage", str(c), *args, "--make-room", "--json"])
    assert r.returncode == 0, r.stderr
    assert [v["name"] for v in json.loads(r.stdout)["evicted"]] == ["a"]
    assert names_in(tier) == ["b", "c"]


def test_make_room_in_a_job_cgroup_does_not_count_ram_charged_elsewhere(
    tmpfs, tmp_path, shmstage_bin, memory_cgroup
):
    """Datasets staged outside a job's memory cgroup (root's prepare) hold pages charged
    there: evicting them gives the job's cgroup nothing back.  make-room in the job refuses
    up front, dry run and real run alike, and evicts nothing (it used to evict every
    dataset, one by one, then refuse)."""
    cg = memory_cgroup
    tier = tmpfs("512M", name="ram") / "shmstage"
    args = ["--dest", str(tier), "--reserve", "1M", "--workers", "1"]
    for n in ("a", "b"):  # staged outside the job's cgroup
        r = sh(shmstage_bin, "stage", str(make_ds(tmp_path / n, 60)), *args, "-q")
        assert r.returncode == 0, r.stderr
    (cg / "memory.limit_in_bytes").write_text(str(60 * MIB))
    c = make_ds(tmp_path / "c", 60)
    for extra in (["--dry-run"], []):
        r = in_cgroup(cg, [*shmstage_bin, "stage", str(c), *args, "--make-room", *extra])
        assert r.returncode == 2, (extra, r.stdout, r.stderr)
        assert "is usable (the memory cgroup limit)" in r.stderr, r.stderr
        assert "would evict" not in r.stdout
        assert names_in(tier) == ["a", "b"]


def _job_cgroup_own_tmpfs(tmpfs, tmp_path, shmstage_bin, cg):
    """a and b (60 MiB each) staged outside the job's cgroup ``cg``, which then holds
    150 MiB of tmpfs pages of its own (scratch in /dev/shm) and has 20 MiB usable left.
    Returns (tier, stage arguments)."""
    tier = tmpfs("512M", name="ram") / "shmstage"
    junk = tmpfs("256M", name="junk")
    args = ["--dest", str(tier), "--reserve", "1M", "--workers", "1"]
    for n in ("a", "b"):  # staged outside the job's cgroup
        r = sh(shmstage_bin, "stage", str(make_ds(tmp_path / n, 60)), *args, "-q")
        assert r.returncode == 0, r.stderr
    (cg / "memory.limit_in_bytes").write_text(str(1 << 30))
    r = in_cgroup(cg, ["sh", "-c", f"head -c {150 * MIB} /dev/zero > {junk}/x"])
    assert r.returncode == 0, r.stderr
    usable = int(in_cgroup(cg, [sys.executable, "-c", PROBE]).stdout)
    (cg / "memory.limit_in_bytes").write_text(str((1 << 30) - usable + 20 * MIB))
    return tier, args


def test_make_room_does_not_count_a_victim_charged_elsewhere_as_the_jobs_own_tmpfs(
    tmpfs, tmp_path, shmstage_bin, memory_cgroup
):
    """The job's cgroup holds 150 MiB of its own tmpfs pages; "a" and "b" were staged
    outside it.  Any shmem of the cgroup is no proof that a victim's pages are charged
    there: make-room refuses up front, dry run and real run alike, and keeps both (it used
    to say it would evict "a", evict it, then refuse)."""
    tier, args = _job_cgroup_own_tmpfs(tmpfs, tmp_path, shmstage_bin, memory_cgroup)
    c = make_ds(tmp_path / "c", 60)
    for extra in (["--dry-run"], []):
        r = in_cgroup(memory_cgroup, [*shmstage_bin, "stage", str(c), *args, "--make-room", *extra])
        assert r.returncode == 2, (extra, r.stdout, r.stderr)
        assert "is usable (the memory cgroup limit)" in r.stderr, r.stderr
        assert "would evict" not in r.stdout
        assert names_in(tier) == ["a", "b"]


def test_make_room_evicts_no_more_once_the_engine_refused_after_evicting(
    tmpfs, tmp_path, shmstage_bin, memory_cgroup
):
    """The records of "a" and "b" claim the job's memory cgroup although their pages are
    charged elsewhere (a miscount make-room cannot see): it evicts "a", and the engine
    refuses (the cgroup got nothing back).  It then stops: "b" stays (it used to evict "b"
    too, and refuse: the tier emptied one victim at a time), and the refusal names "a"."""
    cg = memory_cgroup
    tier, args = _job_cgroup_own_tmpfs(tmpfs, tmp_path, shmstage_bin, cg)
    probe = "from shmstage import system; print(system.memory_cgroup_id())"
    job = in_cgroup(cg, [sys.executable, "-c", probe]).stdout.strip()
    assert job.endswith(f"/{cg.name}"), job
    for n in ("a", "b"):
        meta = tier / ".shmstage" / "meta" / f"{n}.json"
        meta.write_text(json.dumps({**json.loads(meta.read_text()), "memcg": job}))
    c = make_ds(tmp_path / "c", 60)
    r = in_cgroup(cg, [*shmstage_bin, "stage", str(c), *args, "--make-room"])
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "after evicting a; not evicting more for it" in r.stderr, r.stderr
    assert names_in(tier) == ["b"]


def rewrite(src: Path, files: int) -> None:
    """New bytes (and a new mtime) in the first ``files`` files of a make_ds tree."""
    for i in range(files):
        f = src / f"{i}.bin"
        size = f.stat().st_size
        f.write_bytes(os.urandom(size))
        os.utime(f, (1e9 + i, 1e9 + i))


def changed_restage(tmpfs, tmp_path: Path, shmstage_bin) -> tuple[Path, Path, list[str]]:
    """big (12 MiB, 12 files) and other (5 MiB) staged into a 24 MiB tier, then 7 of big's
    files rewritten: its 7 changed MiB fit only once other is evicted; the whole new
    version (12 MiB) would not fit even then.  Returns (tier, big, stage arguments)."""
    tier = tmpfs("24M", name="ram") / "shmstage"
    big, other = make_ds(tmp_path / "big", 12, files=12), make_ds(tmp_path / "other", 5)
    args = ["--dest", str(tier), "--reserve", "1M"]
    for src in (big, other):
        r = sh(shmstage_bin, "stage", str(src), *args, "-q")
        assert r.returncode == 0, r.stderr
    rewrite(big, 7)
    return tier, big, args


def test_a_restage_with_make_room_evicts_for_what_changed(tmpfs, tmp_path, shmstage_bin):
    """A restage --make-room whose changed files do not fit next to its old version evicts
    the other dataset and restages (7 MiB copied), instead of sizing the whole new version
    and refusing."""
    tier, big, args = changed_restage(tmpfs, tmp_path, shmstage_bin)
    r = sh(shmstage_bin, "stage", str(big), *args, "--make-room", "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert [v["name"] for v in got["evicted"]] == ["other"]
    assert (got["changed"], got["copied_bytes"]) == (True, 7 * MIB)
    assert names_in(tier) == ["big"]
    assert sh(shmstage_bin, "verify", "big", "--dest", str(tier)).returncode == 0


def test_dry_run_of_a_restage_decides_as_the_real_run(tmpfs, tmp_path, shmstage_bin):
    """stage --dry-run of a restage runs the real fit: refused with the real run's very
    error (exit 2) when the changes do not fit; with --make-room it names the dataset the
    real run would evict and what it would copy; nothing is removed."""
    tier, big, args = changed_restage(tmpfs, tmp_path, shmstage_bin)
    dry = sh(shmstage_bin, "stage", str(big), *args, "--dry-run")
    real = sh(shmstage_bin, "stage", str(big), *args)
    assert real.returncode == 2
    assert real.stderr.startswith("Error: dataset does not fit: needs 7.0 MiB")
    assert (dry.returncode, dry.stderr) == (2, real.stderr), dry.stdout
    r = sh(shmstage_bin, "stage", str(big), *args, "--make-room", "--dry-run")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith(f"would evict other from {tier} (5.0 MiB, last used ")
    assert lines[1:] == [f"would restage in place (7.0 MiB to copy) into tier 1: {tier}/big"]
    assert names_in(tier) == ["big", "other"]


def capped(tmp_path: Path, tier: Path, max_size: str) -> dict[str, str]:
    """A node config giving ``tier`` a cache max_size: the environment that points at it."""
    cfg = tmp_path / "node.yaml"
    cfg.write_text(
        f"version: 1\ndest:\n  - path: {tier}\n    cache: {{max_size: {max_size}, policy: lru}}\n"
    )
    return {"SHMSTAGE_CONFIG": str(cfg)}


def test_a_restage_in_place_keeps_the_tier_under_max_size(tmpfs, tmp_path, shmstage_bin):
    """A dataset restaged in place that grew past what its tier's max_size leaves: the LRU
    other dataset is evicted, as for a first copy; the new version alone over max_size is
    refused and the old version stays."""
    tier = tmpfs("48M", name="ram") / "shmstage"
    env = capped(tmp_path, tier, "20M")
    other, big = make_ds(tmp_path / "other", 8), make_ds(tmp_path / "big", 10, files=10)
    for src in (other, big):
        r = sh(shmstage_bin, "stage", str(src), "--reserve", "1M", "-q", env=env)
        assert r.returncode == 0, r.stderr
    (big / "more.bin").write_bytes(os.urandom(4 * MIB))  # 14 + 8 MiB > 20
    r = sh(shmstage_bin, "stage", str(big), "--reserve", "1M", env=env)
    assert r.returncode == 0, r.stderr
    assert f"evicted other from {tier} to make room" in r.stderr
    assert names_in(tier) == ["big"]
    (big / "huge.bin").write_bytes(os.urandom(8 * MIB))  # 22 MiB alone
    r = sh(shmstage_bin, "stage", str(big), "--reserve", "1M", env=env)
    assert r.returncode == 2, r.stderr
    assert "big (22.0 MiB) is larger than the cache's max_size (20.0 MiB)" in r.stderr
    assert names_in(tier) == ["big"]


def test_concurrent_stagers_do_not_exceed_max_size(tmpfs, tmp_path, shmstage_bin, procs):
    """Two stagers of different datasets that each fit a tier's max_size alone but not
    together: the second counts the first's dataset while it is still being copied, and,
    with nothing it may evict, is refused before writing; the tier stays under max_size."""
    tier = tmpfs("64M", name="ram") / "shmstage"
    env = capped(tmp_path, tier, "20M")
    a, b = make_ds(tmp_path / "a", 12, files=12), make_ds(tmp_path / "b", 12, files=12)
    args = ["--reserve", "1M", "--workers", "1"]
    pa = procs.start(
        [*shmstage_bin, "stage", str(a), *args],
        env={**os.environ, **env, copier.SLOW_ENV: "0.2"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    wait_for(lambda: (tier / ".shmstage" / "partial" / "a" / "0.bin").exists(), "a copying", pa)
    rb = sh(shmstage_bin, "stage", str(b), *args, env=env)
    out_a, err_a = pa.communicate(timeout=120)
    assert pa.returncode == 0 and out_a == f"{tier}/a\n", err_a
    assert rb.returncode == 2, rb.stderr
    assert "12.0 MiB of it by stages in progress" in rb.stderr
    assert names_in(tier) == ["a"]


USE = "import sys, shmstage\nwith shmstage.lease(sys.argv[1], dest=sys.argv[2]) as ds: print(ds.path)\n"


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux)")
def test_a_non_root_jobs_use_counts_for_lru_on_a_root_managed_tier(open_tmpfs, shmstage_bin):
    """Root stages "used" then "other"; a job running as nobody leases "used" and ends: that
    use makes "other" the least recently used, so root's make-room evicts "other".  nobody
    can bump the time and nothing else: not remove the stamp, not store data in it."""
    base = open_tmpfs("20M", name="ram")
    tier = base / "shmstage"
    srcs = {
        n: make_ds(base.parent / "src" / n, m) for n, m in (("used", 4), ("other", 4), ("new", 13))
    }
    for n in ("used", "other"):
        r = sh(shmstage_bin, "stage", str(srcs[n]), "--dest", str(tier), "--reserve", "1M", "-q")
        assert r.returncode == 0, r.stderr
    time.sleep(0.05)  # a distinct LAST USED for the job's use
    nobody = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
    r = subprocess.run(
        [*nobody, sys.executable, "-c", USE, "used", str(tier)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0 and r.stdout == f"{tier}/used\n", r.stderr
    listed = json.loads(sh(shmstage_bin, "list", "--dest", str(tier), "--json").stdout)
    used = {x["name"]: x["last_used"] for x in listed}
    assert used["used"] > used["other"]
    stamp = tier / ".shmstage" / "meta" / ".used.used"
    for attack in (
        ["rm", "-f", str(stamp)],
        ["mv", str(stamp), str(stamp) + "x"],
        ["touch", "-d", "2001-01-01", str(stamp)],  # any time but now takes the owner
    ):
        r = subprocess.run([*nobody, *attack], capture_output=True, timeout=60)
        assert r.returncode != 0, attack
    # What is written to it goes nowhere (a device like /dev/null): no RAM to fill.
    subprocess.run([*nobody, "sh", "-c", f"head -c 1M /dev/zero > {stamp}"], timeout=60)
    st = stamp.lstat()
    assert stat.S_ISCHR(st.st_mode) and st.st_size == 0 and st.st_mtime == used["used"]
    assert (stamp.read_bytes(), shutil.disk_usage(base).used < 9 * MIB) == (b"", True)
    r = sh(shmstage_bin, "stage", str(srcs["new"]), "--dest", str(tier), "--reserve", "1M",
           "--make-room", "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert [v["name"] for v in json.loads(r.stdout)["evicted"]] == ["other"]
    assert names_in(tier) == ["new", "used"]


def test_two_stagers_of_one_dataset_under_max_size_neither_refuse_nor_evict(
    tmpfs, tmp_path, shmstage_bin, procs
):
    """The `run --stage` recipe: two jobs stage the same dataset into a tier with a max_size
    at once.  The second does not count the first's claim for that very dataset on top of
    its own size: it is neither refused nor evicts the other dataset (6 + 12 MiB fit in
    26 MiB); it waits, then finds the dataset up to date."""
    tier = tmpfs("64M", name="ram") / "shmstage"
    env = capped(tmp_path, tier, "26M")
    ds, other = make_ds(tmp_path / "ds", 12, files=12), make_ds(tmp_path / "other", 6)
    args = ["--reserve", "1M", "--workers", "1"]
    r = sh(shmstage_bin, "stage", str(other), *args, "-q", env=env)
    assert r.returncode == 0, r.stderr
    pa = procs.start(
        [*shmstage_bin, "stage", str(ds), *args],
        env={**os.environ, **env, copier.SLOW_ENV: "0.2"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    wait_for(lambda: (tier / ".shmstage" / "partial" / "ds" / "0.bin").exists(), "ds copying", pa)
    rb = sh(shmstage_bin, "stage", str(ds), *args, env=env)
    out_a, err_a = pa.communicate(timeout=120)
    assert pa.returncode == 0 and out_a == f"{tier}/ds\n", err_a
    assert rb.returncode == 0 and rb.stdout == f"{tier}/ds\n", rb.stderr
    assert "evicted" not in rb.stderr and "ds is up to date" in rb.stderr, rb.stderr
    assert names_in(tier) == ["ds", "other"]


@pytest.mark.parametrize("alias", ["symlink", "bind"])
def test_one_tier_named_through_two_paths_is_one_tier(tmpfs, tmp_path, shmstage_bin, alias):
    """`--dest RAM,NVME,ALIAS-of-NVME` (a symlinked parent, or a bind mount such as
    /scratch over /local/nvme) names the NVME tier twice: it is one tier, locked once (the
    stager used to block on its own placing lock forever)."""
    ram, nvme = tmpfs("16M", name="ram"), tmpfs("16M", name="nvme")
    other = tmp_path / "other"
    if alias == "symlink":
        other.symlink_to(nvme)
    else:
        other.mkdir()
        subprocess.run(["mount", "--bind", str(nvme), str(other)], check=True, timeout=60)
        tmpfs.mounted.append(other)
    src = make_ds(tmp_path / "ds", 1)
    dest = f"{ram}/s,{nvme}/s,{other}/s"
    r = subprocess.run(
        [*shmstage_bin, "stage", str(src), "--dest", dest, "--reserve", "1M"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0 and r.stdout == f"{ram}/s/ds\n", r.stderr
    r = sh(shmstage_bin, "list", "--dest", dest, "--json")
    assert [x["name"] for x in json.loads(r.stdout)] == ["ds"], r.stderr


NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
HOLD = """import fcntl, os, sys, time
held = 0
for path in sys.argv[1:]:
    try:
        fd = os.open(path, os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held += 1
    except OSError:
        pass
print(held, flush=True)
time.sleep(120)
"""


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux)")
def test_another_user_cannot_stop_stages_into_a_capped_tier(open_tmpfs, shmstage_bin, procs):
    """The max_size lock and the claims of root's tier are root's alone: nobody cannot open
    them, so cannot flock them and freeze every stage into the tier (they used to flock
    inflight/ itself, 0755: root's next stage blocked forever, silently)."""
    base = open_tmpfs("64M", name="ram")
    tier = base / "shmstage"
    env = capped(base.parent, tier, "20M")
    a, b = make_ds(base.parent / "src" / "a", 1), make_ds(base.parent / "src" / "b", 1)
    r = sh(shmstage_bin, "stage", str(a), "--reserve", "1M", "-q", env=env)
    assert r.returncode == 0, r.stderr
    flying = tier / ".shmstage" / "inflight"
    holder = procs.start(
        [*NOBODY, sys.executable, "-c", HOLD, str(flying), str(flying / ".capping")],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    held = holder.stdout.readline()
    r = subprocess.run(
        [*shmstage_bin, "stage", str(b), "--reserve", "1M", "-q"],
        capture_output=True, text=True, timeout=60, env={**os.environ, **env},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert names_in(tier) == ["a", "b"]
    assert held == "0\n" and stat.S_IMODE(flying.stat().st_mode) == 0o700


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux)")
def test_a_killed_stagers_claim_is_reaped_and_nobody_can_keep_it(open_tmpfs, shmstage_bin, procs):
    """A stager of a capped tier is SIGKILLed mid-copy: its claim stays behind.  nobody cannot
    open it to hold it (it used to be 0644 in a 0755 directory: held, it counted as a live
    stage forever); gc removes it, and a dataset that fits max_size alone is staged."""
    base = open_tmpfs("64M", name="ram")
    tier = base / "shmstage"
    env = capped(base.parent, tier, "20M")
    a = make_ds(base.parent / "src" / "a", 12, files=12)
    b = make_ds(base.parent / "src" / "b", 12, files=12)
    args = ["--reserve", "1M", "--workers", "1"]
    pa = procs.start(
        [*shmstage_bin, "stage", str(a), *args, "-q"],
        env={**os.environ, **env, copier.SLOW_ENV: "0.2"},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    wait_for(lambda: (tier / ".shmstage" / "partial" / "a" / "0.bin").exists(), "a copying", pa)
    pa.kill()
    pa.wait(timeout=60)
    flying = tier / ".shmstage" / "inflight"
    claims = [p for p in flying.iterdir() if not p.name.startswith(".")]
    assert len(claims) == 1
    mode = stat.S_IMODE(claims[0].stat().st_mode)
    holder = procs.start(
        [*NOBODY, sys.executable, "-c", HOLD, str(claims[0])], stdout=subprocess.PIPE, text=True
    )
    held = holder.stdout.readline()
    r = sh(shmstage_bin, "gc", "--dest", str(tier), "--json")
    assert r.returncode == 0, r.stderr
    assert not claims[0].exists()
    r = sh(shmstage_bin, "stage", str(b), *args, env=env)
    assert r.returncode == 0, r.stderr
    assert names_in(tier) == ["b"] and (held, mode) == ("0\n", 0o600)


def test_stagers_in_two_pid_namespaces_make_two_claims(tmpfs, tmp_path, shmstage_bin, procs):
    """Two containers (each shmstage is pid 1 of its pid namespace) stage one dataset into a
    capped tier: each makes its own claim; the second no longer opens (and empties) the
    first's claim and waits on it while holding the tier's max_size lock."""
    tier = tmpfs("64M", name="ram") / "shmstage"
    env = {**os.environ, **capped(tmp_path, tier, "40M"), copier.SLOW_ENV: "0.3"}
    ds = make_ds(tmp_path / "ds", 12, files=12)
    argv = ["unshare", "--pid", "--fork", *shmstage_bin, "stage", str(ds), "--reserve", "1M",
            "--workers", "1", "-q"]  # fmt: skip
    out = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    p1 = procs.start(argv, env=env, **out)
    wait_for(lambda: (tier / ".shmstage" / "partial" / "ds" / "0.bin").exists(), "copying", p1)
    p2 = procs.start(argv, env=env, **out)
    flying = tier / ".shmstage" / "inflight"

    def claims() -> list[str] | None:
        try:
            got = sorted(p.read_text() for p in flying.iterdir() if not p.name.startswith("."))
        except FileNotFoundError:  # one finished meanwhile
            return None
        return got if len(got) == 2 and all(got) else None

    got = wait_for(claims, "two claims", p2)
    assert got == [f"{12 * MIB}\n"] * 2
    for p in (p1, p2):
        o, e = p.communicate(timeout=120)
        assert p.returncode == 0 and o == f"{tier}/ds\n", e
    assert names_in(tier) == ["ds"]


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux)")
def test_staging_into_the_first_tier_makes_no_other_tiers_store(open_tmpfs, shmstage_bin):
    """A dataset that goes to the first tier creates nothing in the later ones: nobody's
    `--dest SHM/shmstage-nobody,SHM/shmstage` no longer makes the node's shared store (owned
    by nobody, refusing root), nor root's `--dest RAM,/mnt/nvme/shmstage` a .shmstage tree
    under a mount point whose disk is not mounted."""
    shm = open_tmpfs("64M", name="shm")
    src = make_ds(shm.parent / "src" / "a", 1)
    own, shared = shm / "shmstage-nobody", shm / "shmstage"
    r = subprocess.run(
        [*NOBODY, *shmstage_bin, "stage", str(src), "--dest", f"{own},{shared}",
         "--reserve", "1M", "-q"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0 and r.stdout == f"{own}/a\n", r.stderr
    made_shared = shared.exists()
    r = sh(shmstage_bin, "stage", str(src), "--dest", str(shared), "--reserve", "1M", "-q")
    assert r.returncode == 0, r.stderr
    nvme = shm.parent / "mnt" / "nvme"
    nvme.mkdir(parents=True)
    r = sh(shmstage_bin, "stage", str(src), "--name", "b", "--reserve", "1M", "-q",
           "--dest", f"{shm / 'ram'},{nvme / 'shmstage'}")  # fmt: skip
    assert r.returncode == 0 and r.stdout == f"{shm / 'ram'}/b\n", r.stderr
    assert (made_shared, list(nvme.iterdir())) == (False, [])


def test_dry_run_honours_force(tmpfs, tmp_path, shmstage_bin):
    """stage --dry-run --force decides as the real run: replacing a dataset of another
    source is not refused with "pass --force", and a forced restage of an unchanged 20 MiB
    source that has no room for a second full copy is refused, as the real run is."""
    tier = tmpfs("32M", name="ram") / "shmstage"
    one, two, big = (
        make_ds(tmp_path / "one", 4),
        make_ds(tmp_path / "two", 4),
        make_ds(tmp_path / "big", 20),
    )
    args = ["--dest", str(tier), "--reserve", "1M"]
    for src, name in ((two, "ds"), (big, "big")):
        r = sh(shmstage_bin, "stage", str(src), "--name", name, *args, "-q")
        assert r.returncode == 0, r.stderr
    r = sh(shmstage_bin, "stage", str(one), "--name", "ds", *args, "--force", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"would restage in place (4.0 MiB to copy) into tier 1: {tier}/ds\n"
    dry = sh(shmstage_bin, "stage", str(big), "--name", "big", *args, "--force", "--dry-run")
    real = sh(shmstage_bin, "stage", str(big), "--name", "big", *args, "--force", "-q")
    assert real.returncode == 2, real.stderr
    assert (dry.returncode, dry.stderr) == (2, real.stderr), dry.stdout


def test_prepare_keeps_the_tier_under_its_max_size(tmpfs, tmp_path, shmstage_bin):
    """prepare stages into a tier whose node config sets cache.max_size as stage does: the
    LRU unleased dataset goes to make room (it used to be ignored: 22 MiB in a 20 MiB cache)."""
    tier = tmpfs("64M", name="ram") / "shmstage"
    old, a = make_ds(tmp_path / "old", 10), make_ds(tmp_path / "a", 12)
    cfg = tmp_path / "node.yaml"
    cfg.write_text(
        f"version: 1\ndest:\n  - path: {tier}\n    cache: {{max_size: 20M, policy: lru}}\n"
        f"reserve: 1M\ndatasets:\n  - {a}\n"
    )
    env = {"SHMSTAGE_CONFIG": str(cfg), "SHMSTAGE_PREPARE_LOCK": str(tmp_path / "prepare.lock")}
    r = sh(shmstage_bin, "stage", str(old), "--reserve", "1M", "-q", env=env)
    assert r.returncode == 0, r.stderr
    r = sh(shmstage_bin, "prepare", "--config", str(cfg), "--json", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    step = next(s for s in json.loads(r.stdout)["steps"] if s["step"] == "stage a")
    assert step["status"] == "changed" and "evicted old" in step["detail"], step
    assert names_in(tier) == ["a"]
