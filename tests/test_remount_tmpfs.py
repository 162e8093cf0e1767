"""remount for real: a tmpfs in the test session's private mount namespace, temporary fstabs."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from shmstage import system
from shmstage.sizes import format_size, mount_size

pytestmark = pytest.mark.root

MIB = 1 << 20


def size_of(path: Path) -> int:
    return os.statvfs(path).f_blocks * os.statvfs(path).f_frsize


def fill(path: Path, mib: int) -> None:
    (path / "data").write_bytes(b"\1" * (mib * MIB))


def test_grow(runner, cli, tmpfs):
    """remount --size grows a 16M tmpfs to 32M, keeping its files and other options."""
    mnt = tmpfs("16M", mode="1750")
    (mnt / "keep").write_text("data")
    result = runner.invoke(cli, ["remount", "--path", str(mnt), "--size", "32M"])
    assert result.exit_code == 0, result.output
    assert result.stdout == f"resized {mnt} from 16M to 32M\n"
    assert size_of(mnt) == 32 * MIB
    assert (mnt / "keep").read_text() == "data"
    assert system.mount_of(mnt).option("mode") == "1750"


def test_same_size_is_nothing_to_do(runner, cli, tmpfs):
    """Asking for the current size changes nothing and exits 0."""
    mnt = tmpfs("32M")
    result = runner.invoke(cli, ["remount", "--path", str(mnt), "--size", "32MiB"])
    assert result.exit_code == 0
    assert result.stdout == f"{mnt}: already 32M, nothing to do\n"


def test_shrink_keeps_data_when_it_fits(runner, cli, tmpfs):
    """Shrinking (with --shrink) to a size still above what is used works and keeps the files."""
    mnt = tmpfs("64M")
    fill(mnt, 8)
    result = runner.invoke(cli, ["remount", "--path", str(mnt), "--size", "16M", "--shrink"])
    assert result.exit_code == 0, result.output
    assert size_of(mnt) == 16 * MIB
    assert (mnt / "data").stat().st_size == 8 * MIB


def test_shrink_below_used_is_refused(runner, cli, tmpfs):
    """Shrinking below the bytes in use exits 2 with the exact reason and leaves the size."""
    mnt = tmpfs("32M")
    fill(mnt, 8)
    result = runner.invoke(cli, ["remount", "--path", str(mnt), "--size", "4M"])
    assert result.exit_code == 2
    assert result.stderr == (
        f"Error: refusing to shrink {mnt} to 4M: 8.0 MiB is in use; free space first "
        "(e.g. `shmstage evict`) or choose at least 8M\n"
    )
    assert size_of(mnt) == 32 * MIB


def test_beyond_ram_is_refused_unless_forced(runner, cli, tmpfs):
    """A size above RAM (or the cgroup limit) exits 2; --force does it and warns."""
    mnt = tmpfs("16M")
    mem = system.memory()
    too_big = (mem.ceiling // (1 << 30) + 2) << 30
    where = "this cgroup's memory limit" if mem.ceiling < mem.total else "RAM on this node"
    args = ["remount", "--path", str(mnt), "--size", mount_size(too_big)]
    result = runner.invoke(cli, args)
    assert result.exit_code == 2
    assert result.stderr == (
        f"Error: refusing to size {mnt} to {mount_size(too_big)}: more than the "
        f"{format_size(mem.ceiling)} of {where}; tmpfs pages live in RAM, so filling it would "
        "swap or OOM-kill processes; pass --force to do it anyway\n"
    )
    assert size_of(mnt) == 16 * MIB
    forced = runner.invoke(cli, [*args, "--force"])
    assert forced.exit_code == 0, forced.output
    assert size_of(mnt) == too_big
    assert "(--force)" in forced.stderr


def test_percent_is_of_the_memory_ceiling(runner, cli, tmpfs):
    """N% resolves against min(RAM, cgroup limit), rounded down to a MiB."""
    mnt = tmpfs("16M")
    result = runner.invoke(cli, ["remount", "--path", str(mnt), "--size", "1%", "--json"])
    assert result.exit_code == 0, result.output
    expected = (system.memory().ceiling // 100) // MIB * MIB
    doc = json.loads(result.stdout)
    assert (doc["new_size"], doc["remounted"], doc["changed"]) == (expected, True, True)
    assert size_of(mnt) == expected


def test_dry_run_changes_nothing(runner, cli, tmpfs, tmp_path):
    """--dry-run prints the exact command and fstab diff, and leaves mount and fstab alone."""
    mnt = tmpfs("16M")
    fstab = tmp_path / "fstab"
    fstab.write_text("UUID=1 / ext4 defaults 0 1\n")
    args = ["remount", "--path", str(mnt), "--size", "32M", "--persist", "--fstab", str(fstab)]
    result = runner.invoke(cli, [*args, "--dry-run"])
    assert result.exit_code == 0, result.output
    assert result.stdout == (
        "Dry run: nothing changed.\n"
        "Would run:\n"
        f"  mount -o remount,size=32M {mnt}\n"
        f"Would change {fstab} (the original kept as {fstab}.shmstage.bak):\n"
        f"--- {fstab}\n+++ {fstab}\n"
        "@@ -1 +1,2 @@\n"
        " UUID=1 / ext4 defaults 0 1\n"
        f"+tmpfs {mnt} tmpfs defaults,size=32M 0 0\n"
    )
    assert size_of(mnt) == 16 * MIB
    assert fstab.read_text() == "UUID=1 / ext4 defaults 0 1\n"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("fstab")) == ["fstab"]


def test_persist_updates_the_existing_line(runner, cli, tmpfs, tmp_path):
    """--persist rewrites only that line's size=, keeps other lines byte-identical, keeps a backup."""
    mnt = tmpfs("16M")
    other = (
        b"# static file system information\n"
        b"UUID=1\t/\text4\terrors=remount-ro 0 1\n"
        b"\n"
        b"#tmpfs  " + str(mnt).encode() + b"  tmpfs  size=1G  0 0\n"
        b"server:/x  /data  nfs4  ro,caf\xe9  0 0\n"
    )
    ours = b"tmpfs  " + str(mnt).encode() + b"  tmpfs  rw,nosuid,size=16M,mode=1777  0 0\n"
    fstab = tmp_path / "fstab"
    fstab.write_bytes(other + ours + b"/dev/sdb1 /scratch xfs defaults 0 2")
    before = fstab.read_bytes()
    args = ["remount", "--path", str(mnt), "--size", "48M", "--persist", "--fstab", str(fstab)]
    result = runner.invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert result.stdout == (
        f"resized {mnt} from 16M to 48M; persisted size=48M in {fstab} "
        f"(backup: {fstab}.shmstage.bak)\n"
    )
    assert fstab.read_bytes() == before.replace(b"size=16M", b"size=48M")
    assert (tmp_path / "fstab.shmstage.bak").read_bytes() == before
    assert size_of(mnt) == 48 * MIB
    again = runner.invoke(cli, args)
    assert again.exit_code == 0
    assert again.stdout == f"{mnt} and {fstab}: already 48M, nothing to do\n"
    assert fstab.read_bytes().count(str(mnt).encode() + b"  tmpfs") == 2  # comment + our line


def test_persist_adds_a_missing_line_once(runner, cli, tmpfs, tmp_path):
    """Without a line for the mount point one is appended; a second run does not duplicate it."""
    mnt = tmpfs("16M")
    fstab = tmp_path / "fstab"
    fstab.write_text("UUID=1 / ext4 defaults 0 1\n")
    args = ["remount", "--path", str(mnt), "--size", "16M", "--persist", "--fstab", str(fstab)]
    first = runner.invoke(cli, [*args, "--json"])
    assert first.exit_code == 0, first.output
    doc = json.loads(first.stdout)
    assert (doc["remounted"], doc["fstab_changed"], doc["changed"]) == (False, True, True)
    assert doc["backup"] == f"{fstab}.shmstage.bak"
    expected = f"UUID=1 / ext4 defaults 0 1\ntmpfs {mnt} tmpfs defaults,size=16M 0 0\n"
    assert fstab.read_text() == expected
    second = runner.invoke(cli, [*args, "--json"])
    assert json.loads(second.stdout)["changed"] is False
    assert fstab.read_text() == expected


def test_subdirectory_of_a_tmpfs_is_refused(runner, cli, tmpfs):
    """A directory inside a tmpfs is not its mount point; the error names the mount point."""
    mnt = tmpfs("16M")
    (mnt / "sub").mkdir()
    result = runner.invoke(cli, ["remount", "--path", str(mnt / "sub"), "--size", "32M"])
    assert result.exit_code == 2
    assert result.stderr == (
        f"Error: {mnt}/sub is not a tmpfs mount point (it is inside the tmpfs mounted at {mnt}; "
        f"use --path {mnt}); remount only resizes tmpfs mounts such as /dev/shm\n"
    )


@pytest.fixture
def world_tmpfs(open_tmpfs):
    """A 16M tmpfs under a directory everyone can reach (pytest's tmp_path is root-only)."""
    return open_tmpfs("16M")


def test_not_root_names_docker_and_kubernetes(shmstage_bin, world_tmpfs):
    """Run as `nobody`, remount exits 1 with the --shm-size / emptyDir hint and changes nothing."""
    cmd = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", *shmstage_bin]
    done = subprocess.run(
        [*cmd, "remount", "--path", str(world_tmpfs), "--size", "32M"],
        capture_output=True,
        text=True,
        env={**os.environ, "HOME": "/"},
    )
    assert done.returncode == 1, done.stderr
    assert done.stdout == ""
    assert done.stderr == (
        f"Error: cannot resize {world_tmpfs}: changing a mount needs root with CAP_SYS_ADMIN, which "
        "this process lacks. On the host run it as root (sudo shmstage remount --size 32M); in a "
        "container the size is set when it starts: `docker run --shm-size=32m`, or on Kubernetes "
        f"mount an `emptyDir: {{medium: Memory, sizeLimit: 32Mi}}` volume at {world_tmpfs}\n"
    )
    assert size_of(world_tmpfs) == 16 * MIB


def test_unlimited_tmpfs_is_refused(runner, cli, tmpfs):
    """A size=0 tmpfs cannot get a limit by remounting: exit 2 with the mount command to use."""
    mnt = tmpfs("0")
    result = runner.invoke(cli, ["remount", "--path", str(mnt), "--size", "32M"])
    assert result.exit_code == 2
    assert result.stderr == (
        f"Error: {mnt} is a tmpfs without a size limit (size=0) and the kernel cannot add one by "
        f"remounting; unmount it and mount it again: mount -t tmpfs -o size=32M tmpfs {mnt}\n"
    )
