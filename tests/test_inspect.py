"""inspect: verdicts from node facts, the dataset walk, the JSON schema and exit codes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from shmstage import inspection, system
from shmstage.inspection import (
    FAIL,
    OK,
    WARN,
    Check,
    CpuInfo,
    MemoryInfo,
    PillowInfo,
    ShmInfo,
    TorchInfo,
)

GIB = 1 << 30
NO_TORCH = TorchInfo(False, None, None, False, (), None)


@pytest.fixture(autouse=True)
def fast_probes(monkeypatch):
    """Keep CLI tests fast: no torch import unless a test asks for the real probe."""
    monkeypatch.setattr(inspection, "torch_info", lambda: NO_TORCH)


def mem(total=64 * GIB, limit=None, usage=None) -> MemoryInfo:
    ceiling = total if limit is None else min(total, limit)
    return MemoryInfo(total, total // 2, total // 2, ceiling, 2, "/", limit, usage)


def shm(size=32 * GIB, used=0, fstype="tmpfs", mountpoint="/dev/shm", path="/dev/shm") -> ShmInfo:
    return ShmInfo(
        path, True, mountpoint, fstype, path == mountpoint, fstype in ("tmpfs", "ramfs"),
        size, used, size - used, ("rw", "nosuid"),
    )  # fmt: skip


# --- verdicts ----------------------------------------------------------------


def test_healthy_shm_is_ok():
    """A roomy tmpfs within RAM is OK and the detail shows size, use and options."""
    check = inspection.check_shm(shm(), mem())
    assert check == Check(
        "shm", OK, "/dev/shm: tmpfs 32.0 GiB, 0 B used, 32.0 GiB free (rw,nosuid)", None
    )


def test_docker_sized_shm_warns_and_says_how_to_grow(monkeypatch):
    """Docker's 64M default is flagged; as root the advice is a remount command."""
    monkeypatch.setattr(system, "has_cap_sys_admin", lambda proc="/proc": True)
    check = inspection.check_shm(shm(size=64 << 20), mem())
    assert check.verdict == WARN and "too small for DataLoader workers" in check.detail
    assert check.advice == "grow it: shmstage remount --path /dev/shm --size 50%"


def test_small_shm_in_a_container_points_at_docker_and_kubernetes(monkeypatch):
    """Without CAP_SYS_ADMIN the advice is the container-level fix, not remount."""
    monkeypatch.setattr(system, "has_cap_sys_admin", lambda proc="/proc": False)
    advice = inspection.check_shm(shm(size=64 << 20), mem()).advice
    assert "docker run --shm-size=16g" in advice and "emptyDir {medium: Memory" in advice


def test_unlimited_tmpfs_warns():
    """A tmpfs mounted with size=0 (statvfs size 0) is reported as unlimited, not as too small."""
    check = inspection.check_shm(shm(size=0), mem())
    assert (check.verdict, check.detail) == (
        WARN,
        "/dev/shm: tmpfs without a size limit (rw,nosuid)",
    )


def test_shm_bigger_than_the_cgroup_limit_warns():
    """A tmpfs that could outgrow the memory limit is a WARN (filling it would OOM)."""
    check = inspection.check_shm(shm(size=32 * GIB), mem(limit=16 * GIB))
    assert check.verdict == WARN
    assert "bigger than the 16.0 GiB this node/cgroup can hold" in check.detail


def test_missing_and_non_tmpfs_paths_fail():
    """--path that does not exist, or is on a disk, is a FAIL row (not an exception)."""
    missing = ShmInfo("/nope", False, None, None, False, False, None, None, None, ())
    assert inspection.check_shm(missing, mem()) == Check(
        "shm", FAIL, "/nope does not exist", "pass the tmpfs to use with --path (usually /dev/shm)"
    )
    disk = inspection.check_shm(shm(fstype="ext4", mountpoint="/", path="/tmp"), mem())
    assert (disk.verdict, disk.detail) == (FAIL, "/tmp (on /) is ext4, not RAM-backed tmpfs")


def test_cgroup_limit_below_ram_warns_that_tmpfs_is_charged():
    """A memory limit under physical RAM WARNs: staged pages count against the writer's cgroup."""
    check = inspection.check_memory(mem(limit=8 * GIB, usage=GIB))
    assert check.verdict == WARN
    assert check.detail == (
        "RAM 64.0 GiB, 32.0 GiB available; cgroup v2 limit 8.0 GiB, 1.0 GiB used; "
        "tmpfs pages count against the limit of the cgroup that writes them"
    )
    assert inspection.check_memory(mem()).verdict == OK


def test_cpu_without_avx2_warns():
    """No AVX2 on x86 is a WARN (pillow-simd's AVX2 build would not run); with it, OK."""
    good = CpuInfo(8, 16, 8.0, "x86_64", True, ("avx512f",))
    assert inspection.check_cpu(good) == Check(
        "cpu", OK, "8 usable (affinity 16, quota 8); AVX2 yes, AVX-512 yes (1 flags)", None
    )
    assert inspection.check_cpu(CpuInfo(8, 8, None, "x86_64", False, ())).verdict == WARN
    assert inspection.check_cpu(CpuInfo(8, 8, None, "aarch64", False, ())).verdict == OK


def test_memlock():
    """Unlimited locked memory is OK; a limit WARNs with the RDMA fix."""
    assert inspection.check_memlock(None).verdict == OK
    check = inspection.check_memlock(64 << 10)
    assert (check.verdict, check.detail) == (WARN, "ulimit -l 64.0 KiB")
    assert "ulimit -l unlimited" in check.advice


@pytest.mark.parametrize(
    ("info", "verdict", "detail"),
    [
        (NO_TORCH, WARN, "torch not installed"),
        (TorchInfo(True, "2.13.0+cpu", None, False, (), None), WARN, "torch 2.13.0+cpu: CPU-only build"),
        (TorchInfo(True, "2.13.0", "12.8", False, (), None), WARN,
         "torch 2.13.0, CUDA 12.8 build, no GPU visible"),
        (TorchInfo(True, "2.13.0", "12.8", True, ("H100", "H100"), None), OK,
         "torch 2.13.0, CUDA 12.8, 2 GPUs (H100)"),
        (TorchInfo(True, None, None, False, (), "OSError: libcudart.so"), FAIL,
         "torch does not import: OSError: libcudart.so"),
    ],
)  # fmt: skip
def test_torch_verdicts(info, verdict, detail):
    """torch: missing/CPU-only/no GPU WARN, GPUs OK, a broken install FAILs."""
    check = inspection.check_torch(info)
    assert (check.verdict, check.detail) == (verdict, detail)


def test_pillow_verdicts():
    """pillow-simd is OK; stock Pillow WARNs with the pillow helper's next step."""
    simd = PillowInfo(
        "pillow-simd", "9.5.0.post2", True, True, True, "nothing to do", "verified", 8120
    )
    assert inspection.check_pillow(simd) == Check(
        "pillow",
        OK,
        "pillow-simd 9.5.0.post2, libjpeg-turbo yes, AVX2 build yes, "
        "AVX2 code verified (8120 instructions)",
        None,
    )
    stock = PillowInfo("Pillow", "11.0.0", True, None, False, "run shmstage pillow-simd")
    assert inspection.check_pillow(stock).advice == "run shmstage pillow-simd"


def test_next_step_prefers_fail_then_priority():
    """The one next-step line comes from the worst verdict, then the most important check."""
    checks = (
        Check("memlock", WARN, "", "memlock advice"),
        Check("torch", WARN, "", "torch advice"),
        Check("fit", FAIL, "", "fit advice"),
    )
    assert inspection.next_step(checks, "/d") == "fit advice"
    assert inspection.next_step(checks[:2], "/d") == "torch advice"
    assert inspection.next_step((Check("shm", OK, "", None),), "/d") == "ready: shmstage stage /d"


# --- probes ------------------------------------------------------------------


def test_pillow_probe_uses_the_pillow_module():
    """inspect reports the flavor from shmstage.pillow.check(), not 'unknown'."""
    assert inspection.pillow_info().flavor in ("Pillow", "pillow-simd", "conflict", "none")


def test_torch_probe_when_torch_is_absent(monkeypatch):
    """No torch on the path: reported as not installed, without importing anything."""
    monkeypatch.undo()  # the real probe
    monkeypatch.setattr(inspection.importlib.util, "find_spec", lambda name: None)
    assert inspection.torch_info() == NO_TORCH


def test_torch_probe_with_torch_installed(monkeypatch):
    """With torch installed its version and CUDA state are reported."""
    pytest.importorskip("torch")
    monkeypatch.undo()
    info = inspection.torch_info()
    assert info.installed and info.error is None and info.version.startswith("2.")


# --- dataset walk --------------------------------------------------------------


def make_dataset(root: Path) -> Path:
    data = root / "data"
    (data / "a" / "b").mkdir(parents=True)
    (data / "x.bin").write_bytes(b"x" * 1000)
    (data / "a" / "y.bin").write_bytes(b"y" * 200)
    (data / "a" / "b" / "z.bin").write_bytes(b"")
    (data / "link-to-file").symlink_to(data / "x.bin")
    (data / "link-to-dir").symlink_to(data / "a")  # not followed: would double-count
    return data


def test_walk_counts_files_and_bytes(tmp_path):
    """Regular files count; symlinks are not followed (stage copies them as links)."""
    assert inspection.walk(str(make_dataset(tmp_path))) == (1200, 3, 0)
    assert inspection.walk(str(tmp_path / "data" / "x.bin")) == (1000, 1, 0)


def test_walk_counts_unreadable_directories(tmp_path, monkeypatch):
    """A directory that cannot be listed is counted, not fatal."""
    data = make_dataset(tmp_path)
    real_scandir = os.scandir

    def scandir(path):
        if str(path).endswith("/b"):
            raise PermissionError(13, "Permission denied")
        return real_scandir(path)

    monkeypatch.setattr(inspection.os, "scandir", scandir)
    assert inspection.walk(str(data)) == (1200, 2, 1)  # b/z.bin is behind the unreadable b/


# --- the command -----------------------------------------------------------------

SCHEMA_KEYS = [
    "schema_version", "shmstage_version", "hostname", "shm", "memory", "cpu", "memlock",
    "pillow", "torch", "dataset", "checks", "verdict", "next_step",
]  # fmt: skip


def test_json_schema(runner, cli):
    """--json prints one document with schema_version 1 and every documented key."""
    result = runner.invoke(cli, ["inspect", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert list(doc) == SCHEMA_KEYS
    assert doc["schema_version"] == 1 and doc["dataset"] is None
    assert set(doc["shm"]) == {
        "path", "exists", "mountpoint", "fstype", "is_mountpoint", "memory_backed",
        "size", "used", "free", "options",
    }  # fmt: skip
    assert set(doc["memory"]) == {
        "total", "available", "usable", "ceiling", "cgroup_version", "cgroup_path",
        "cgroup_limit", "cgroup_usage", "cgroup_reclaimable",
    }  # fmt: skip
    assert [c["name"] for c in doc["checks"]] == [
        "shm",
        "memory",
        "cpu",
        "memlock",
        "pillow",
        "torch",
    ]
    assert all(c["verdict"] in ("OK", "WARN", "FAIL") for c in doc["checks"])
    assert doc["cpu"]["usable"] == system.usable_cpus()


def test_human_output_is_a_table_and_one_next_line(runner, cli):
    """One row per check (name, verdict, detail) and a final line saying what to do."""
    result = runner.invoke(cli, ["inspect"])
    assert result.exit_code == 0
    lines = result.stdout.splitlines()
    assert [ln.split()[0] for ln in lines[:6]] == [
        "shm",
        "memory",
        "cpu",
        "memlock",
        "pillow",
        "torch",
    ]
    assert all(ln.split()[1] in ("OK", "WARN", "FAIL") for ln in lines[:6])
    assert lines[6] == ""
    assert lines[7].split()[0] in ("OK", "WARN", "FAIL") and "Next: " in lines[7]


def test_bad_path_is_a_fail_row_not_an_error(runner, cli, tmp_path):
    """--path that does not exist still prints the report (exit 0) with a FAIL row."""
    result = runner.invoke(cli, ["inspect", "--path", str(tmp_path / "nope"), "--json"])
    assert result.exit_code == 0
    doc = json.loads(result.stdout)
    assert doc["checks"][0] == {
        "name": "shm",
        "verdict": "FAIL",
        "detail": f"{tmp_path}/nope does not exist",
        "advice": "pass the tmpfs to use with --path (usually /dev/shm)",
    }
    assert doc["verdict"] == "FAIL"


def test_missing_dataset_exits_2(runner, cli, tmp_path):
    """--dataset that does not exist: one Error line, exit 2, no report."""
    result = runner.invoke(cli, ["inspect", "--dataset", str(tmp_path / "nope")])
    assert result.exit_code == 2
    assert result.stdout == ""
    assert result.stderr == (
        f"Error: dataset {tmp_path}/nope does not exist; give the directory to stage with --dataset\n"
    )


def test_dataset_that_fits(runner, cli, tmp_path):
    """A small dataset is measured, its file system named, and the fit row is OK (exit 0)."""
    data = make_dataset(tmp_path)
    dest = tmp_path / "dest"
    result = runner.invoke(cli, ["inspect", "--dataset", str(data), "--dest", str(dest), "--json"])
    assert result.exit_code == 0, result.output
    d = json.loads(result.stdout)["dataset"]
    mount = system.mount_of(data)
    assert (d["bytes"], d["files"], d["unreadable"]) == (1200, 3, 0)
    assert (d["mountpoint"], d["fstype"], d["device"]) == (
        mount.mountpoint,
        mount.fstype,
        mount.device,
    )
    assert d["network"] is False and d["dest"] == str(dest)
    page = os.sysconf("SC_PAGE_SIZE")  # two non-empty files: a page each (links: in the inode)
    assert d["fit"]["fits"] is True and d["fit"]["needed"] == d["page_bytes"] >= 2 * page
    assert d["inodes"] == 8  # three directories, three files, two symlinks


def test_dataset_that_does_not_fit_exits_1(runner, cli, tmp_path):
    """A dataset larger than the destination's free space: FAIL row, report printed, exit 1."""
    data = tmp_path / "huge"
    data.mkdir()
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    with open(data / "sparse.bin", "wb") as f:
        f.truncate(free + (1 << 30))  # apparent size is what staging copies
    result = runner.invoke(cli, ["inspect", "--dataset", str(data), "--dest", str(tmp_path / "d")])
    assert result.exit_code == 1
    fit_row = next(ln for ln in result.stdout.splitlines() if ln.startswith("fit"))
    assert fit_row.split()[1] == "FAIL" and "does not fit in" in fit_row
    assert "Next: free space there or stage elsewhere with --dest" in result.stdout


def test_default_dest_follows_path():
    """The fit check uses stage's default under /dev/shm, else PATH/shmstage."""
    assert inspection.default_dest("/mnt/ram") == "/mnt/ram/shmstage"
    assert inspection.default_dest("/dev/shm").startswith("/")


def test_unreadable_dataset_exits_2(runner, cli, tmp_path, monkeypatch):
    """A dataset the user cannot read is a one-line refusal, not a traceback."""
    monkeypatch.setattr(inspection.os, "access", lambda path, mode: False)
    result = runner.invoke(cli, ["inspect", "--dataset", str(tmp_path)])
    assert result.exit_code == 2
    assert result.stderr == (
        f"Error: cannot read dataset {tmp_path}: permission denied; run as a user who can read it\n"
    )
