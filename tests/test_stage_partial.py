"""``stage --partial``: a dataset larger than the tmpfs keeps the largest part that fits in RAM,
stable across epochs and restages, the rest read from the source through DatasetFiles;
``list``/``--json`` show the resident fraction; evict and gc remove the view with the copy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shmstage.bench.throttle import blkio_throttle, block_device
from shmstage.datasetfiles import DatasetFiles
from shmstage.errors import RefusedError

FILE = 256 << 10
pytestmark = pytest.mark.root


def make_src(root: Path, files: int = 48) -> dict[str, bytes]:
    out = {}
    for i in range(files):
        rel = f"class{i % 4}/img{i:03d}.bin"
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        data = os.urandom(FILE - 512 * (i % 7))
        (root / rel).write_bytes(data)
        out[rel] = data
    return out


def sh(*args: str, **kw) -> subprocess.CompletedProcess:
    exe = os.path.join(os.path.dirname(sys.executable), "shmstage")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=120, **kw)


def resident_files(copy: Path) -> dict[str, tuple[int, int]]:
    """rel -> (inode, mtime_ns) of every file in the copy: what a rewrite would change."""
    out = {}
    for p in copy.rglob("*"):
        if p.is_file():
            st = p.stat()
            out[str(p.relative_to(copy))] = (st.st_ino, st.st_mtime_ns)
    return out


def test_partial_keeps_the_largest_part_that_fits_and_lists_every_file(tmpfs, tmp_path):
    """1.5x the tmpfs: a part stays (what fits after the reserve), the record and --json say
    the fraction, DatasetFiles names every file and reads each right; a restage rewrites
    nothing; verify checks the part; evict removes the view with it."""
    shm = tmpfs("8M")
    src = tmp_path / "src"
    data = make_src(src)
    dest = shm / "store"
    r = sh("stage", str(src), "--dest", str(dest), "--partial", "--reserve", "1M", "--json")
    assert r.returncode == 0, r.stderr
    ds = json.loads(r.stdout)
    in_ram = resident_files(dest / "src")
    assert ds["total_bytes"] == sum(map(len, data.values())) and ds["total_files"] == 48
    assert ds["bytes"] == sum(len(data[n]) for n in in_ram) and ds["files"] == len(in_ram)
    assert 0.4 < ds["resident"] < 0.7 and ds["resident"] == ds["bytes"] / ds["total_bytes"]
    assert os.statvfs(shm).f_bfree * os.statvfs(shm).f_frsize >= 1 << 20  # the reserve is kept
    files = DatasetFiles(dest / "src")
    assert files.kind == "partial" and files.names == tuple(sorted(data))
    assert all(files.read(n) == data[n] for n in files.names)
    assert files.served == (ds["bytes"], ds["total_bytes"] - ds["bytes"])
    r = sh("stage", str(src), "--dest", str(dest), "--partial", "--reserve", "1M")
    assert r.returncode == 0 and "is up to date" in r.stderr, r.stderr
    assert resident_files(dest / "src") == in_ram
    r = sh("list", "--dest", str(dest), "--json")
    (row,) = json.loads(r.stdout)
    assert row["resident"] == ds["resident"] and row["total_files"] == 48
    assert "of" in sh("list", "--dest", str(dest)).stdout  # "N% of SIZE" in RAM
    r = sh("verify", "src", "--dest", str(dest))
    assert r.returncode == 0 and f"{len(in_ram)} files match" in r.stdout, r.stdout + r.stderr
    assert sh("evict", "src", "--dest", str(dest)).returncode == 0
    assert not (dest / ".shmstage" / "views" / "src").exists() and not (dest / "src").exists()


def test_a_dataset_that_fits_is_staged_as_without_partial(tmpfs, tmp_path):
    shm = tmpfs("16M")
    make_src(tmp_path / "src", files=8)
    r = sh("stage", str(tmp_path / "src"), "--dest", str(shm), "--partial", "--json")
    assert r.returncode == 0, r.stderr
    ds = json.loads(r.stdout)
    assert ds["resident"] == 1.0 and ds["total_bytes"] is None
    assert not (shm / ".shmstage" / "views").exists()
    assert DatasetFiles(shm / "src").kind == "copy"


def test_a_changed_source_restages_the_part_and_the_view(tmpfs, tmp_path):
    """A file changed at the source: a resident one is copied again, a non-resident one's
    size and mtime are updated in the view (the job reads the new bytes, never a refusal)."""
    shm = tmpfs("8M")
    src = tmp_path / "src"
    data = make_src(src)
    args = ("stage", str(src), "--dest", str(shm), "--partial", "--reserve", "1M", "-q")
    assert sh(*args).returncode == 0
    in_ram = resident_files(shm / "src")
    inside = sorted(in_ram)[0]
    outside = sorted(set(data) - set(in_ram))[0]
    for rel in (inside, outside):
        (src / rel).write_bytes(b"new " + rel.encode())
    r = sh(*args)
    assert r.returncode == 0, r.stderr
    files = DatasetFiles(shm / "src")
    assert files.read(inside) == b"new " + inside.encode()
    assert files.read(outside) == b"new " + outside.encode()


def test_partial_refuses_an_archive_in_one_line(tmpfs, tmp_path):
    shm = tmpfs("8M")
    make_src(tmp_path / "src", files=2)
    subprocess.run(["tar", "-cf", str(tmp_path / "a.tar"), "-C", str(tmp_path), "src"], check=True)
    r = sh("stage", str(tmp_path / "a.tar"), "--dest", str(shm), "--partial")
    assert r.returncode != 0 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("Error: --partial stages directories, and ")


EPOCH = """
import os, random, sys
from shmstage.datasetfiles import DatasetFiles
f = DatasetFiles(sys.argv[1])
order = list(f.names)
random.Random(int(sys.argv[2])).shuffle(order)
print(sum(len(f.read(n)) for n in order))
"""


def _read_bytes(group: Path, device: str) -> int:
    for line in (group / "blkio.throttle.io_service_bytes").read_text().splitlines():
        parts = line.split()
        if parts[:2] == [device, "Read"]:
            return int(parts[2])
    return 0


def test_partial_epochs_read_only_the_rest_from_the_source(tmpfs, tmp_path):
    """Three shuffled epochs over a 1.5x dataset: the disk reads of epochs 2 and 3 are the
    non-resident bytes (within 2%), and the part in RAM is the same files, same inodes and
    mtimes, before and after (nothing evicted or rewritten; a restage between epochs too)."""
    try:
        block_device(tmp_path)
    except RefusedError:
        pytest.skip("tmp_path is not on a block device")
    if not Path("/sys/fs/cgroup/blkio/blkio.throttle.io_service_bytes").exists():
        pytest.skip("needs cgroup v1 blkio accounting")
    shm = tmpfs("8M")
    src = tmp_path / "src"
    data = make_src(src)
    args = ("stage", str(src), "--dest", str(shm), "--partial", "--reserve", "1M", "--json")
    r = sh(*args)
    assert r.returncode == 0, r.stderr
    ds = json.loads(r.stdout)
    in_ram = resident_files(shm / "src")
    outside = ds["total_bytes"] - ds["bytes"]
    reads = []
    with blkio_throttle(tmp_path, 10**10, name="shmstage-test-partial") as t:
        for epoch in range(3):
            os.sync()  # dirty pages are not dropped
            for rel in data:  # cold source: each epoch's reads reach the disk
                fd = os.open(src / rel, os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
            before = _read_bytes(t.cgroup, t.device)
            job = subprocess.run(
                [sys.executable, "-c", EPOCH, str(shm / "src"), str(epoch)],
                capture_output=True, text=True, timeout=120, preexec_fn=t.enter,
            )  # fmt: skip
            assert job.returncode == 0, job.stderr
            assert int(job.stdout) == sum(map(len, data.values()))
            reads.append(_read_bytes(t.cgroup, t.device) - before)
            assert sh(*args).returncode == 0  # a restage between epochs: a no-op
            assert resident_files(shm / "src") == in_ram
    assert reads[0] >= outside  # epoch 1 reads the rest cold too
    for got in reads[1:]:
        assert abs(got - outside) <= 0.02 * outside, (reads, outside)


def test_a_partial_copy_made_whole_loses_its_view_and_staged_path_says_partial(tmpfs, tmp_path):
    """A plain `stage` of a partial copy once its tier is large enough: the whole copy is
    published and the view removed after it (DatasetFiles reads all of it from RAM);
    before that, staged_path() warns that only part is in RAM."""
    import warnings

    from shmstage.errors import ShmstageWarning
    from shmstage.loader import staged_path

    shm = tmpfs("8M")
    src = tmp_path / "src"
    make_src(src, files=12)  # 3 MiB
    r = sh("stage", str(src), "--dest", str(shm), "--reserve", "5M", "--partial")
    assert r.returncode == 0, r.stderr  # the edge: the plan says it fits, the copy does not
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert staged_path(src, dest=shm) == shm / "src"
    assert any(
        issubclass(w.category, ShmstageWarning) and "only part" in str(w.message) for w in seen
    )
    r = sh("stage", str(src), "--dest", str(shm), "--reserve", "1M", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["resident"] == 1.0
    assert not (shm / ".shmstage" / "views" / "src").exists()
    files = DatasetFiles(shm / "src")
    assert files.kind == "copy" and len(files.names) == 12
