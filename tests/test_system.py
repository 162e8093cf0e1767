"""Node facts read from faked /proc, cgroup (v1 and v2) and /sys trees."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shmstage import system

MOUNTINFO = """\
22 27 0:21 / /proc rw,relatime - proc proc rw
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw,discard
25 24 0:23 / /dev/shm rw,nosuid,nodev - tmpfs tmpfs rw,size=65536k
30 25 0:27 / /dev/shm rw,relatime - tmpfs shm rw,size=1048576k,mode=1777
40 27 0:40 / /data/my\\040set rw - nfs4 server:/export/my\\040set rw,vers=4.2
41 27 0:41 / /mnt/gcs rw - fuse.gcsfuse bucket rw
"""


def write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture
def proc(tmp_path: Path) -> Path:
    p = tmp_path / "proc"
    write(p, "self/mountinfo", MOUNTINFO)
    return p


def test_mountinfo_parses_tmpfs_options_and_escaped_paths(proc):
    """mountinfo gives fstype, source and superblock options; \\040 becomes a space."""
    found = {m.mountpoint: m for m in system.mounts(str(proc))}
    assert found["/dev/shm"].fstype == "tmpfs"
    assert found["/data/my set"].device == "server:/export/my set"
    assert found["/data/my set"].option("vers") == "4.2"
    assert found["/"].opts == ("rw", "relatime", "discard")


def test_mount_of_prefers_the_last_mount_on_the_longest_prefix(proc):
    """An over-mounted /dev/shm resolves to the mount on top, and subdirectories to their mount."""
    top = system.mount_of("/dev/shm", str(proc))
    assert top is not None and top.option("size") == "1048576k" and top.device == "shm"
    assert system.mount_of("/dev/shm/shmstage/x", str(proc)).mountpoint == "/dev/shm"
    assert system.mount_of("/dev/shmother", str(proc)).mountpoint == "/"
    assert system.mount_of("/data/my set/train", str(proc)).fstype == "nfs4"


def test_mount_field_escaping_round_trips():
    """fstab/mountinfo escaping handles space, tab, backslash and leaves UTF-8 alone."""
    raw = "/mnt/a b\tc\\d/é"
    escaped = system.escape_mount_field(raw)
    assert escaped == "/mnt/a\\040b\\011c\\134d/é"
    assert system.unescape_mount_field(escaped) == raw


@pytest.mark.parametrize(
    ("fstype", "network"),
    [("nfs", True), ("nfs4", True), ("lustre", True), ("cifs", True), ("fuse.gcsfuse", True),
     ("fuse.s3fs", True), ("beegfs", True), ("gpfs", True), ("ext4", False), ("xfs", False),
     ("tmpfs", False), ("fuseblk", False)],
)  # fmt: skip
def test_network_file_systems_are_recognised(fstype, network):
    """Shared/remote file systems (the ones staging helps most) are flagged as network."""
    assert system.is_network_fs(fstype) is network


# --- cgroup v2 --------------------------------------------------------------


def v2_tree(tmp_path: Path, cgroup_line: str = "0::/kubepods/pod1/ctr\n") -> tuple[Path, Path]:
    proc, cg = tmp_path / "proc", tmp_path / "cgroup"
    write(proc, "self/cgroup", cgroup_line)
    write(cg, "cgroup.controllers", "cpu memory io\n")
    return proc, cg


def test_v2_memory_takes_the_tightest_limit_on_the_path(tmp_path):
    """A parent's memory.max caps its children; usage comes from our own memory.current."""
    proc, cg = v2_tree(tmp_path)
    write(cg, "kubepods/memory.max", "8589934592\n")
    write(cg, "kubepods/pod1/memory.max", "max\n")
    write(cg, "kubepods/pod1/ctr/memory.max", "17179869184\n")
    write(cg, "kubepods/pod1/ctr/memory.current", "1073741824\n")
    got = system.cgroup_memory(str(proc), str(cg))
    assert got == system.CgroupMemory(2, "/kubepods/pod1/ctr", 8 << 30, 1 << 30)


def test_v2_unlimited_memory_is_none(tmp_path):
    """memory.max 'max' everywhere means no limit."""
    proc, cg = v2_tree(tmp_path, "0::/\n")
    write(cg, "memory.current", "123\n")
    got = system.cgroup_memory(str(proc), str(cg))
    assert (got.version, got.limit, got.usage) == (2, None, 123)


def test_v2_private_cgroup_namespace_falls_back_to_the_mount_root(tmp_path):
    """Inside a container the /proc/self/cgroup path may not exist under the mount: use its root."""
    proc, cg = v2_tree(tmp_path, "0::/../../host/path\n")
    write(cg, "memory.max", "4294967296\n")
    assert system.cgroup_memory(str(proc), str(cg)).limit == 4 << 30


def test_v2_cpu_quota(tmp_path):
    """cpu.max '150000 100000' is 1.5 CPUs; a parent's tighter quota wins; 'max' is unlimited."""
    proc, cg = v2_tree(tmp_path)
    write(cg, "kubepods/pod1/ctr/cpu.max", "150000 100000\n")
    write(cg, "kubepods/pod1/cpu.max", "max 100000\n")
    assert system.cgroup_cpu_quota(str(proc), str(cg)) == 1.5
    write(cg, "kubepods/cpu.max", "50000 100000\n")
    assert system.cgroup_cpu_quota(str(proc), str(cg)) == 0.5
    assert system.usable_cpus(str(proc), str(cg)) == 1


def test_v2_no_cpu_quota(tmp_path):
    """No cpu.max (or only 'max') means no quota, and usable CPUs is the affinity set."""
    proc, cg = v2_tree(tmp_path, "0::/\n")
    write(cg, "cpu.max", "max 100000\n")
    assert system.cgroup_cpu_quota(str(proc), str(cg)) is None
    assert system.usable_cpus(str(proc), str(cg)) == system.affinity_cpus()


# --- cgroup v1 --------------------------------------------------------------

V1_CGROUP = """\
12:memory:/docker/abc
11:cpu,cpuacct:/docker/abc
1:name=systemd:/docker/abc
0::/
"""
V1_UNLIMITED = "9223372036854771712\n"


def v1_tree(tmp_path: Path) -> tuple[Path, Path]:
    proc, cg = tmp_path / "proc", tmp_path / "cgroup"
    write(proc, "self/cgroup", V1_CGROUP)
    write(cg, "memory/memory.limit_in_bytes", V1_UNLIMITED)
    write(cg, "memory/docker/memory.limit_in_bytes", V1_UNLIMITED)
    return proc, cg


def test_v1_memory_limit_and_usage(tmp_path):
    """v1 reads memory.limit_in_bytes on the path (the page-rounded 2^63 means unlimited)."""
    proc, cg = v1_tree(tmp_path)
    write(cg, "memory/docker/abc/memory.limit_in_bytes", "2147483648\n")
    write(cg, "memory/docker/abc/memory.usage_in_bytes", "1048576\n")
    got = system.cgroup_memory(str(proc), str(cg))
    assert got == system.CgroupMemory(1, "/docker/abc", 2 << 30, 1 << 20)


def test_v1_hierarchical_limit_from_memory_stat(tmp_path):
    """v1's hierarchical_memory_limit (a parent's limit) counts even when ours is unlimited."""
    proc, cg = v1_tree(tmp_path)
    write(cg, "memory/docker/abc/memory.limit_in_bytes", V1_UNLIMITED)
    write(cg, "memory/docker/abc/memory.stat", "cache 0\nhierarchical_memory_limit 3221225472\n")
    assert system.cgroup_memory(str(proc), str(cg)).limit == 3 << 30


def test_v1_unlimited_memory_is_none(tmp_path):
    """All-unlimited v1 reports limit None (not 8 EiB)."""
    proc, cg = v1_tree(tmp_path)
    write(cg, "memory/docker/abc/memory.limit_in_bytes", V1_UNLIMITED)
    got = system.cgroup_memory(str(proc), str(cg))
    assert (got.version, got.limit) == (1, None)


def test_v1_cpu_quota_from_the_combined_cpu_cpuacct_mount(tmp_path):
    """v1 cfs_quota_us/cfs_period_us under cpu,cpuacct/; -1 means unlimited."""
    proc, cg = v1_tree(tmp_path)
    write(cg, "cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "250000\n")
    write(cg, "cpu,cpuacct/docker/abc/cpu.cfs_period_us", "100000\n")
    write(cg, "cpu,cpuacct/docker/cpu.cfs_quota_us", "-1\n")
    write(cg, "cpu,cpuacct/docker/cpu.cfs_period_us", "100000\n")
    assert system.cgroup_cpu_quota(str(proc), str(cg)) == 2.5


def test_no_memory_cgroup(tmp_path):
    """Without a memory controller the version is None and nothing limits."""
    proc, cg = tmp_path / "proc", tmp_path / "cgroup"
    write(proc, "self/cgroup", "1:name=systemd:/\n")
    cg.mkdir()
    assert system.cgroup_memory(str(proc), str(cg)) == system.CgroupMemory(None, None, None, None)


def test_memory_usable_and_ceiling_respect_the_cgroup():
    """usable = min(available, limit - usage); ceiling = min(RAM, limit)."""
    cg = system.CgroupMemory(2, "/x", 10 << 30, 4 << 30)
    mem = system.Memory(total=64 << 30, available=60 << 30, cgroup=cg)
    assert (mem.usable, mem.ceiling) == (6 << 30, 10 << 30)
    free = system.Memory(64 << 30, 60 << 30, system.CgroupMemory(2, "/", None, 1))
    assert (free.usable, free.ceiling) == (60 << 30, 64 << 30)


# --- CPU flags, capabilities, block devices ---------------------------------


def test_cpu_flags_avx2_and_avx512(tmp_path):
    """Flags come from the first 'flags' line of cpuinfo."""
    write(tmp_path, "cpuinfo", "processor : 0\nflags\t\t: fpu sse4_2 avx avx2 avx512f avx512bw\n")
    assert system.has_avx2(str(tmp_path))
    assert system.avx512_flags(str(tmp_path)) == ("avx512bw", "avx512f")
    write(tmp_path, "cpuinfo", "processor : 0\nflags\t\t: fpu sse4_2 avx\n")
    assert not system.has_avx2(str(tmp_path)) and system.avx512_flags(str(tmp_path)) == ()


@pytest.mark.parametrize(
    ("capeff", "expected"),
    [("000001ffffffffff", True), ("00000000a80425fb", False), ("0000000000000000", False)],
)
def test_cap_sys_admin_from_status(tmp_path, capeff, expected):
    """Full root has CAP_SYS_ADMIN; Docker's default set (a80425fb) and nobody do not."""
    write(tmp_path, "self/status", f"Name:\tx\nCapEff:\t{capeff}\n")
    assert system.has_cap_sys_admin(str(tmp_path)) is expected


def test_block_device_of_a_partition_reads_its_disk(tmp_path):
    """A file on sda1 reports disk sda and sda's queue/rotational."""
    dev = os.stat(tmp_path).st_dev
    sys_root = tmp_path / "sys"
    disk = sys_root / "devices" / "pci0" / "block" / "sda"
    write(disk, "queue/rotational", "1\n")
    (disk / "sda1").mkdir()
    link = sys_root / "dev" / "block" / f"{os.major(dev)}:{os.minor(dev)}"
    link.parent.mkdir(parents=True)
    link.symlink_to(disk / "sda1")
    assert system.block_device(tmp_path, str(sys_root)) == system.BlockDevice("sda", True)
    write(disk, "queue/rotational", "0\n")
    assert system.block_device(tmp_path, str(sys_root)).rotational is False


def test_block_device_is_none_without_a_disk(tmp_path):
    """No /sys/dev/block entry (NFS, tmpfs, overlay) means no disk to describe."""
    (tmp_path / "sys").mkdir()
    assert system.block_device(tmp_path, str(tmp_path / "sys")) is None
    assert system.block_device(tmp_path / "missing") is None


MEMINFO = "MemTotal:        8000000 kB\nMemFree:         1000000 kB\nMemAvailable:    {avail}\nBuffers:          100000 kB\nCached:          2000000 kB\nSReclaimable:     100000 kB\nShmem:            100000 kB\nActive:          1800000 kB\nInactive:        1800000 kB\nActive(file):     900000 kB\nInactive(file):   900000 kB\n"


@pytest.mark.parametrize(
    "avail", ["5000000 kB", "12000000 kB", "0 kB", None], ids=["plain", "over", "zero", "none"]
)
def test_node_memory_is_what_psutil_reports(tmp_path, avail):
    """/proc/meminfo read without psutil (~15 ms to import) gives psutil's answer: MemTotal and
    MemAvailable as they stand, and where psutil does not take MemAvailable as it stands (more
    than the total, as lxcfs may say; 0; missing before Linux 3.14) its own estimate."""
    psutil = pytest.importorskip("psutil")
    text = MEMINFO.format(avail=avail) if avail else MEMINFO.replace("MemAvailable:    {avail}\n", "")
    (tmp_path / "meminfo").write_text(text)
    was, psutil.PROCFS_PATH = psutil.PROCFS_PATH, str(tmp_path)
    try:
        vm = psutil.virtual_memory()
    finally:
        psutil.PROCFS_PATH = was
    assert system.node_memory(str(tmp_path)) == (vm.total, vm.available)
    if avail == "5000000 kB":
        assert vm.available == 5_000_000 * 1024
    if avail == "12000000 kB":
        assert vm.available == 1_000_000 * 1024  # MemFree: psutil's fallback
