"""Cgroup headroom counts reclaimable page cache as free (the kernel drops it before it
OOM-kills for the limit) but never tmpfs pages: fake cgroup trees, and a real v1 cgroup."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shmstage import system
from tests.test_system import v1_tree, v2_tree, write

GIB = 1 << 30
MIB = 1 << 20


V2_STAT = f"anon {GIB}\nfile {6 * GIB}\nshmem {GIB}\ninactive_file {5 * GIB}\nactive_file 0\n"
V1_STAT = (
    f"cache {3 * GIB}\nshmem {GIB}\ninactive_file {GIB}\ntotal_cache {3 * GIB}\n"
    f"total_shmem {GIB}\ntotal_inactive_file {2 * GIB}\ntotal_active_file 0\n"
)


@pytest.mark.parametrize(
    ("version", "limit", "usage", "stat", "reclaimable", "usable"),
    [
        # v2: 7 of 8 GiB used, 5 GiB of it inactive page cache: 6 GiB usable
        (2, 8 * GIB, 7 * GIB, V2_STAT, 5 * GIB, 6 * GIB),
        # v1: total_inactive_file (hierarchical) counts; cache, shmem and the local value do not
        (1, 4 * GIB, 4 * GIB, V1_STAT, 2 * GIB, 2 * GIB),
    ],
)
def test_inactive_file_is_reclaimable(tmp_path, version, limit, usage, stat, reclaimable, usable):
    """The headroom is limit - (usage - inactive page cache), from a fake cgroup tree."""
    if version == 2:
        proc, cg = v2_tree(tmp_path)
        here, files = "kubepods/pod1/ctr", ("memory.max", "memory.current")
    else:
        proc, cg = v1_tree(tmp_path)
        here, files = "memory/docker/abc", ("memory.limit_in_bytes", "memory.usage_in_bytes")
    write(cg, f"{here}/{files[0]}", str(limit))
    write(cg, f"{here}/{files[1]}", str(usage))
    write(cg, f"{here}/memory.stat", stat)
    got = system.cgroup_memory(str(proc), str(cg))
    assert got.reclaimable == reclaimable
    assert system.Memory(64 * GIB, 60 * GIB, got).usable == usable


def test_missing_memory_stat_counts_nothing_reclaimable(tmp_path):
    """Without memory.stat the headroom stays limit - usage (the safe side)."""
    proc, cg = v2_tree(tmp_path, "0::/\n")
    write(cg, "memory.max", str(2 * GIB))
    write(cg, "memory.current", str(GIB))
    got = system.cgroup_memory(str(proc), str(cg))
    assert got.reclaimable == 0
    assert system.Memory(64 * GIB, 60 * GIB, got).usable == GIB


PROBE = "from shmstage import system; print(system.memory().usable)"


@pytest.mark.root
def test_real_v1_cgroup_page_cache_is_usable_tmpfs_is_not(tmp_path):
    """In a real 512 MiB v1 memory cgroup: reading 400 MiB from disk leaves most of the limit
    usable; writing 200 MiB to a tmpfs from inside it takes 200 MiB away."""
    mine = system._cgroup_paths("/proc").get("memory")
    root = Path("/sys/fs/cgroup/memory")
    if mine is None or not root.is_dir() or (Path("/sys/fs/cgroup/cgroup.controllers")).exists():
        pytest.skip("needs a cgroup v1 memory hierarchy")
    cg = root / mine.strip("/") / f"shmstage-test-{os.getpid()}"
    try:
        cg.mkdir()
    except OSError as e:
        pytest.skip(f"cannot create a memory cgroup: {e}")
    data = tmp_path / "data.bin"
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    try:
        (cg / "memory.limit_in_bytes").write_text(str(512 * MIB))
        with open(data, "wb") as f:
            for _ in range(400):
                f.write(os.urandom(MIB))
        # Drop data's pages (written from outside the cgroup) so the read below charges it.
        fd = os.open(data, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        script = (
            f"echo $$ > {cg}/cgroup.procs && cat {data} > /dev/null && "
            f"{sys.executable} -c '{PROBE}' && "
            f"unshare --mount --propagation private sh -c 'mount -t tmpfs tmpfs {mnt} && "
            f'head -c {200 * MIB} /dev/zero > {mnt}/x && {sys.executable} -c "{PROBE}"\''
        )
        out = subprocess.run(
            ["sh", "-c", script], capture_output=True, text=True, check=True, timeout=120
        ).stdout.split()
        after_read, after_tmpfs = int(out[0]), int(out[1])
        charged = int((cg / "memory.max_usage_in_bytes").read_text())
        assert charged > 400 * MIB  # the page cache really was charged to the cgroup
        assert after_read > 400 * MIB  # limit - usage would say < 112 MiB
        assert after_tmpfs < after_read - 180 * MIB  # tmpfs pages are not reclaimable
    finally:
        for _ in range(50):  # its processes have exited; the kernel frees it shortly after
            try:
                cg.rmdir()
                break
            except OSError:
                time.sleep(0.1)


@pytest.mark.parametrize(
    ("writer", "mine", "charged"),
    [
        ("7:v1:/job", "7:v1:/job", True),  # its own cgroup
        ("7:v1:/job/step0", "7:v1:/job", True),  # a descendant: charged up to here too
        ("7:v1:/job", "7:v1:/job/step0", False),  # a parent's pages: not this cgroup's
        ("7:v1:/", "7:v1:/job", False),  # root's prepare, outside the job
        ("7:v1:/jobber", "7:v1:/job", False),  # a sibling whose name starts alike
        ("7:v2:/job", "7:v1:/job", False),  # another hierarchy
        ("8:v1:/", "7:v1:/", False),  # another cgroup namespace: "/" is another cgroup
        (None, "7:v1:/job", False),  # a record from before it was kept
        ("7:v1:/job", None, False),
    ],
)
def test_a_victims_pages_count_only_when_charged_to_the_stagers_cgroup(writer, mine, charged):
    assert system.charged_to(writer, mine) is charged


def test_ram_given_back_under_a_limit_is_only_what_is_charged_here():
    """The job's cgroup holds 1 GiB of its own tmpfs: evicting 1 GiB charged elsewhere frees
    nothing under its limit, though any shmem is charged to it (min(freed, shmem) was not)."""
    cg = system.CgroupMemory(1, "/job", 4 * GIB, 4 * GIB, 0, GIB)
    mem = system.Memory(64 * GIB, 32 * GIB, cg)
    assert mem.usable_after_freeing(GIB, charged=0) == 0
    assert mem.usable_after_freeing(GIB, charged=GIB) == GIB
    assert mem.usable_after_freeing(2 * GIB, charged=2 * GIB) == GIB  # at most its shmem
