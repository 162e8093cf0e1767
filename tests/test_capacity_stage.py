"""Capacity while staging, with real stagers on a real tmpfs: a resume on a tight tmpfs
(only what is still to copy counts; a refusal keeps the partial) and concurrent stagers
of different datasets sharing one tmpfs (a store-wide reservation)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from shmstage.stage.build import copier
from tests.test_stage import snapshot, wait_for

pytestmark = pytest.mark.root


@pytest.fixture
def tmp_path(open_tmp_path):
    """Sources every user can reach (see tests/test_stage.py)."""
    return open_tmp_path


MIB = 1 << 20


def make_big_tree(root: Path, big: int, big_size: int, small: int, small_size: int) -> Path:
    """``big`` files larger than the copier's chunk and ``small`` small ones, distinct bytes."""
    root.mkdir(parents=True)
    for i in range(big):
        block = bytes([i + 1]) * MIB
        with open(root / f"big{i}.bin", "wb") as f:
            for _ in range(big_size // MIB):
                f.write(block)
    (root / "small").mkdir()
    for i in range(small):
        (root / "small" / f"{i:04d}.bin").write_bytes(i.to_bytes(4, "big") * (small_size // 4))
    return root


def used_bytes(path: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(FileNotFoundError):
                total += os.lstat(os.path.join(dirpath, f)).st_blocks * 512
    return total


def stager(shmstage_bin, src: Path, dest: Path, *extra: str, slow: float = 0.0) -> subprocess.Popen:
    env = {**os.environ, copier.SLOW_ENV: str(slow)} if slow else None
    return subprocess.Popen(
        [
            *shmstage_bin,
            "stage",
            str(src),
            "--dest",
            str(dest),
            "--workers",
            "2",
            "--quiet",
            *extra,
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def reap(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.communicate()


def test_resume_after_sigkill_on_a_tight_tmpfs(tmpfs, tmp_path, shmstage_bin):
    """SIGKILL with > 40% copied into a tmpfs that holds the dataset + reserve once but not
    twice: a re-run counts only what is still to copy and completes; a refusal (exit 2)
    leaves the resumable partial exactly where it was."""
    src = make_big_tree(tmp_path / "ds", big=2, big_size=70 * MIB, small=400, small_size=100_000)
    total = used_bytes(src)
    mnt = tmpfs("256M")
    dest = mnt / "shmstage"
    part = dest / ".shmstage" / "partial" / "ds"
    p = stager(shmstage_bin, src, dest, slow=0.05)
    try:
        wait_for(lambda: used_bytes(part) > 0.4 * total or p.poll() is not None, timeout=120)
        assert p.poll() is None, "the stager finished before it could be killed"
        p.send_signal(signal.SIGKILL)
        p.wait()
    finally:
        reap(p)
    assert p.returncode == -signal.SIGKILL
    assert not (dest / "ds").exists()
    held = used_bytes(part)
    assert held > 0.4 * total

    # A refusal (here: a reserve too big for what is left) changes nothing, partial included.
    before = sorted(os.listdir(part / "small"))
    r = subprocess.run(
        [*shmstage_bin, "stage", str(src), "--dest", str(dest), "--reserve", "200M", "--quiet"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("Error: dataset does not fit: needs ") and r.stderr.count("\n") == 1
    assert sorted(os.listdir(part / "small")) == before and used_bytes(part) == held

    r = subprocess.run(
        [*shmstage_bin, "stage", str(src), "--dest", str(dest), "--quiet"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(dest / "ds")
    assert snapshot(src) == snapshot(dest / "ds")
    assert os.listdir(dest / ".shmstage" / "partial") == []


def test_concurrent_stagers_share_the_free_space(tmpfs, tmp_path, shmstage_bin):
    """Two real stagers of different datasets into a tmpfs where only one fits with the
    reserve: the second is refused before writing a byte (exit 2, one line), the first
    completes, nobody hits ENOSPC and the reserve stays free."""
    a = make_big_tree(tmp_path / "a", big=0, big_size=0, small=120, small_size=MIB)
    b = make_big_tree(tmp_path / "b", big=0, big_size=0, small=120, small_size=MIB)
    mnt = tmpfs("256M")
    dest = mnt / "shmstage"
    pa = stager(shmstage_bin, a, dest, slow=0.05)
    pb = None
    try:
        # B's fit check runs while A has copied some but far from all of its data.
        wait_for(lambda: used_bytes(dest / ".shmstage" / "partial" / "a") > 8 * MIB)
        assert pa.poll() is None
        pb = stager(shmstage_bin, b, dest)
        out_b, err_b = pb.communicate(timeout=120)
        out_a, err_a = pa.communicate(timeout=120)
    finally:
        reap(*(x for x in (pa, pb) if x is not None))
    assert pa.returncode == 0, err_a
    assert pb.returncode == 2, err_b
    assert err_b.startswith("Error: dataset does not fit: needs ") and err_b.count("\n") == 1
    assert "promised to other stagers" in err_b
    assert "No space" not in err_a + err_b and "no space" not in err_a + err_b
    assert not (dest / ".shmstage" / "partial" / "b").exists() and not (dest / "b").exists()
    assert snapshot(a) == snapshot(dest / "a")
    assert shutil.disk_usage(mnt).free >= int(256 * MIB * 0.1)  # the reserve is still free
    # The winner's reservation is gone with it: B fits now that A is written? No: A + B + reserve
    # exceed the tmpfs, so B is refused again, by the plain free space this time.
    r = subprocess.run(
        [*shmstage_bin, "stage", str(b), "--dest", str(dest), "--quiet"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "promised" not in r.stderr


def test_a_dead_stagers_reservation_does_not_count(tmpfs, tmp_path, shmstage_bin):
    """A stager killed with SIGKILL leaves a reservation file nobody holds: it promises nothing."""
    a = make_big_tree(tmp_path / "a", big=0, big_size=0, small=60, small_size=MIB)
    b = make_big_tree(tmp_path / "b", big=0, big_size=0, small=60, small_size=MIB)
    mnt = tmpfs("256M")
    dest = mnt / "shmstage"
    pa = stager(shmstage_bin, a, dest, slow=0.2)
    try:
        wait_for(lambda: used_bytes(dest / ".shmstage" / "partial" / "a") > 2 * MIB)
        assert (dest / ".shmstage" / "reservations" / "a").exists()
        pa.send_signal(signal.SIGKILL)
        pa.wait()
    finally:
        reap(pa)
    # The dead stager's partial still holds its pages; its promise of the rest is void.
    r = subprocess.run(
        [*shmstage_bin, "stage", str(b), "--dest", str(dest), "--quiet", "--reserve", "150M"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr


def test_first_copy_that_outgrows_the_tmpfs_midway_is_refused_whole(tmpfs, tmp_path, shmstage_bin):
    """A first copy claims space as its walk finds data and starts copying before the walk
    ends.  When a later part does not fit, the copy stops, everything it wrote is removed,
    and the refusal gives the whole dataset's numbers, as a check before the first byte
    would (exit 2: nothing changed)."""
    src = tmp_path / "ds"
    for d in range(4):  # 4 directories of 40 MiB: the first two are handed out together
        (src / f"d{d}").mkdir(parents=True)
        for i in range(10):
            (src / f"d{d}" / f"{i}.bin").write_bytes(bytes([d * 10 + i]) * (4 * MIB))
    mnt = tmpfs("112M")
    dest = mnt / "shmstage"
    free = shutil.disk_usage(mnt).free
    p = stager(shmstage_bin, src, dest, slow=0.02)
    try:
        out, err = p.communicate(timeout=120)
    finally:
        reap(p)
    assert p.returncode == 2, err
    assert err.startswith("Error: dataset does not fit: needs 160.0 MiB + ") and err.count("\n") == 1
    assert not (dest / "ds").exists()
    assert os.listdir(dest / ".shmstage" / "partial") == []
    assert shutil.disk_usage(mnt).free >= free - MIB  # what it copied is gone again
    # Where it just fits (160 MiB + the 18 MiB reserve on 180 MiB), the same tree stages whole
    # and exact, although the second step's check runs while the first step's files are
    # half written (counted in DEST's used space and in what is left to write).
    bigger = tmpfs("180M", name="bigger")
    p = stager(shmstage_bin, src, bigger / "s", slow=0.05)
    try:
        out, err = p.communicate(timeout=120)
    finally:
        reap(p)
    assert p.returncode == 0, err
    assert snapshot(src) == snapshot(bigger / "s" / "ds")


def test_tar_restage_after_a_kill_counts_the_leftover_partial_as_freed(
    tmpfs, tmp_path, shmstage_bin
):
    """A tar stage killed after its extraction and manifest leaves a whole partial tree; the re-run
    extracts again into a tmpfs that cannot hold two copies: the fit check counts the
    leftover as freed (the builder is shared with directories), so it completes."""
    import tarfile

    src = make_big_tree(tmp_path / "ds", big=2, big_size=70 * MIB, small=100, small_size=100_000)
    archive = tmp_path / "ds.tar"
    with tarfile.open(archive, "w") as tf:
        tf.add(src, arcname=".")
    mnt = tmpfs("256M")
    dest = mnt / "shmstage"
    part = dest / ".shmstage" / "partial" / "ds"
    killed = subprocess.run(
        [*shmstage_bin, "stage", str(archive), "--dest", str(dest), "--quiet"],
        env={**os.environ, "SHMSTAGE_TEST_KILL_AT": "manifest"},
        capture_output=True,
        text=True,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert used_bytes(part) >= used_bytes(src)  # the whole tree, left behind
    r = subprocess.run(
        [*shmstage_bin, "stage", str(archive), "--dest", str(dest), "--quiet"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr

    def contents(root: Path) -> dict[str, str]:  # tar keeps whole-second mtimes: bytes only
        return {k: v[-1] for k, v in snapshot(root).items() if v[0] == "f"}

    assert contents(src) == contents(dest / "ds") and len(contents(src)) == 102
    assert os.listdir(dest / ".shmstage" / "partial") == []
