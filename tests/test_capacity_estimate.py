"""One fit rule: inspect, stage and prepare size a source with the same estimator (pages of
the kernel's page size, hard links once, archives by their extracted size, inodes) and
print the same numbers; plus --reserve N%, the remount shrink guard and the disk note."""

from __future__ import annotations

import json
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

from shmstage import prepare, system
from shmstage.sizes import format_size
from shmstage.stage.build.estimate import estimate

MIB = 1 << 20
PAGE = os.sysconf("SC_PAGE_SIZE")


def small_files(root: Path, n: int, size: int = 100) -> Path:
    root.mkdir(parents=True)
    for d in range(n // 1000 + 1):
        (root / f"d{d:02d}").mkdir()
    for i in range(n):
        (root / f"d{i // 1000:02d}" / f"{i:05d}").write_bytes(b"x" * size)
    return root


def inspect_json(shmstage_bin, *args: str, env: dict | None = None) -> tuple[int, dict]:
    r = subprocess.run(
        [*shmstage_bin, "inspect", "--json", *args], capture_output=True, text=True, env=env
    )
    return r.returncode, json.loads(r.stdout)


def run(shmstage_bin, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*shmstage_bin, *args], capture_output=True, text=True)


def test_estimator_counts_pages_links_inodes(tmp_path):
    """Pages of SC_PAGE_SIZE per file, hard links once (but an inode each), symlinks an
    inode (and a page when the target is 128 bytes or more), directories an inode."""
    src = tmp_path / "ds"
    (src / "sub").mkdir(parents=True)
    (src / "a").write_bytes(b"a" * (PAGE + 1))
    (src / "sub" / "b").write_bytes(b"b")
    os.link(src / "a", src / "a-hard")
    (src / "short").symlink_to("a")
    (src / "long").symlink_to("x" * 200)
    est = estimate(src)
    assert (est.bytes, est.files, est.inodes) == (PAGE + 2, 3, 7)
    assert est.page_bytes == 2 * PAGE + PAGE + PAGE  # a, b, the long symlink
    assert est.page_size == PAGE


@pytest.mark.root
def test_inspect_and_stage_agree_on_20k_small_files(tmpfs, tmp_path, shmstage_bin):
    """20,000 files of 100 B take 20,000 pages on tmpfs: inspect says so (not "1.9 MiB"),
    stage refuses with the very same number, and where it fits the tmpfs really grows so."""
    src = small_files(tmp_path / "ds", 20_000)
    need = 20_000 * PAGE
    small = tmpfs("48M", name="small")
    code, doc = inspect_json(shmstage_bin, "--path", str(small), "--dataset", str(src))
    d = doc["dataset"]
    assert code == 1 and d["fit"]["fits"] is False
    assert d["page_bytes"] == d["fit"]["needed"] == need
    assert (d["bytes"], d["files"], d["inodes"]) == (2_000_000, 20_000, 20_000 + 21 + 1)
    r = run(shmstage_bin, "stage", str(src), "--dest", str(small / "shmstage"), "--quiet")
    assert r.returncode == 2
    assert r.stderr.startswith(f"Error: dataset does not fit: needs {format_size(need)} + ")

    big = tmpfs("128M", name="big")
    code, doc = inspect_json(shmstage_bin, "--path", str(big), "--dataset", str(src))
    assert code == 0 and doc["dataset"]["fit"]["needed"] == need
    before = os.statvfs(big)
    r = run(shmstage_bin, "stage", str(src), "--dest", str(big / "shmstage"), "--quiet")
    assert r.returncode == 0, r.stderr
    after = os.statvfs(big)
    grew = (before.f_bfree - after.f_bfree) * after.f_frsize
    assert need <= grew < need + 4 * MIB  # the estimate is the truth (+ bookkeeping)


@pytest.mark.root
def test_a_tar_gz_is_sized_by_what_it_extracts_to(tmpfs, tmp_path, shmstage_bin):
    """A 32 MiB file compressed to a few KiB: inspect and prepare count 32 MiB, not the archive."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "zeros.bin").write_bytes(b"\0" * (32 * MIB))
    (data / "one.txt").write_text("1")
    archive = tmp_path / "data.tar.gz"
    with tarfile.open(archive, "w:gz") as tf:
        tf.add(data, arcname="data")
    assert archive.stat().st_size < MIB
    mnt = tmpfs("16M")
    code, doc = inspect_json(shmstage_bin, "--path", str(mnt), "--dataset", str(archive))
    d = doc["dataset"]
    assert code == 1 and d["kind"] == "tar"
    assert (d["bytes"], d["files"]) == (32 * MIB + 1, 2)
    assert d["fit"]["needed"] == 32 * MIB + PAGE
    r = run(shmstage_bin, "stage", str(archive), "--dest", str(mnt / "shmstage"), "--quiet")
    assert r.returncode == 2
    assert r.stderr.startswith(f"Error: dataset does not fit: needs {format_size(32 * MIB + PAGE)}")
    assert prepare.footprint(str(archive), str(mnt)) == (32 * MIB + PAGE, 2)


@pytest.mark.root
def test_inspect_checks_inodes(tmpfs, tmp_path, shmstage_bin):
    """A tmpfs with few inodes: inspect FAILs the fit on inodes (as stage refuses) although
    the bytes fit."""
    src = small_files(tmp_path / "ds", 300, size=10)
    mnt = tmpfs("64M,nr_inodes=200")
    code, doc = inspect_json(shmstage_bin, "--path", str(mnt), "--dataset", str(src))
    fit = doc["dataset"]["fit"]
    assert code == 1 and fit["fits"] is False and fit["inodes"] == 302
    assert "needs 302 inodes but" in fit["reason"]
    r = run(shmstage_bin, "stage", str(src), "--dest", str(mnt / "shmstage"), "--quiet")
    assert r.returncode == 2 and "needs 302 inodes but" in r.stderr


@pytest.mark.root
def test_inspect_honours_shmstage_dest(tmpfs, tmp_path, shmstage_bin):
    """SHMSTAGE_DEST is where stage would write, so it is where inspect checks the fit."""
    src = small_files(tmp_path / "ds", 10)
    mnt = tmpfs("16M")
    env = {**os.environ, "SHMSTAGE_DEST": str(mnt / "elsewhere")}
    code, doc = inspect_json(shmstage_bin, "--dataset", str(src), env=env)
    assert code == 0 and doc["dataset"]["dest"] == str(mnt / "elsewhere")
    assert doc["dataset"]["fit"]["free"] <= 16 * MIB


@pytest.mark.root
def test_reserve_as_a_percentage(tmpfs, tmp_path, shmstage_bin):
    """--reserve 50% is half the destination's size, for inspect and stage alike."""
    src = small_files(tmp_path / "ds", 10)
    mnt = tmpfs("64M")
    code, doc = inspect_json(
        shmstage_bin, "--path", str(mnt), "--dataset", str(src), "--reserve", "50%"
    )
    assert code == 0 and doc["dataset"]["fit"]["reserve"] == 32 * MIB
    r = run(shmstage_bin, "stage", str(src), "--dest", str(mnt / "d"), "--reserve", "10%", "-q")
    assert r.returncode == 0, r.stderr
    r = run(shmstage_bin, "stage", str(src), "--dest", str(mnt / "e"), "--reserve", "100%", "-q")
    assert r.returncode == 2 and "below 100% of the tmpfs" in r.stderr  # nothing would fit


@pytest.mark.root
def test_remount_shrink_needs_the_flag(tmpfs, shmstage_bin):
    """A --size smaller than the tmpfs is now is refused (exit 2, size kept) without --shrink,
    and warns with it."""
    mnt = tmpfs("64M")
    r = run(shmstage_bin, "remount", "--path", str(mnt), "--size", "32M")
    assert r.returncode == 2
    assert r.stderr == (
        f"Error: refusing to shrink {mnt} from 64.0 MiB to 32M; pass --shrink to make it smaller\n"
    )
    assert os.statvfs(mnt).f_blocks * os.statvfs(mnt).f_frsize == 64 * MIB
    r = run(shmstage_bin, "remount", "--path", str(mnt), "--size", "32M", "--shrink")
    assert r.returncode == 0, r.stderr
    assert f"shrinks {mnt} from 64.0 MiB to 32M" in r.stderr
    assert os.statvfs(mnt).f_blocks * os.statvfs(mnt).f_frsize == 32 * MIB


def test_stage_to_disk_says_so(tmp_path, shmstage_bin):
    """A --dest that is not tmpfs gets one line: the copy is on disk, not in RAM."""
    src = small_files(tmp_path / "ds", 3)
    dest = tmp_path / "dest"
    if system.mount_of(str(tmp_path)).fstype in ("tmpfs", "ramfs"):
        pytest.skip("tmp_path is on tmpfs here")
    r = run(shmstage_bin, "stage", str(src), "--dest", str(dest))
    assert r.returncode == 0, r.stderr
    assert "the copy is on disk, not in RAM" in r.stderr.splitlines()[-1]
