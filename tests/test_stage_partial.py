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


# --- hostile review 23-B: a view and its copy change together; the resident set's choice ---


def _consistent(dest: Path, name: str = "src") -> None:
    """The published copy and its view agree: a partial record has the view of exactly
    that tree (each resident file in it, as listed), a whole one has none."""
    from shmstage.stage.store.layout import Store
    from shmstage.stage.store.views import read_view

    record = Store(dest).published(name)
    view = read_view(dest, name)
    assert record is not None
    assert (view is not None) == (record.total_bytes is not None), (record, view)
    if view is not None:
        listed = view.files()
        for rel, size, mtime, res in zip(
            *(listed.names, listed.sizes, listed.mtimes, listed.resident)
        ):
            if res:
                st = os.lstat(dest / name / rel)
                assert (st.st_size, st.st_mtime_ns) == (size, mtime), rel


@pytest.mark.parametrize("step", ["record", "exchange", "final"])
def test_a_kill_during_a_restage_leaves_the_copy_its_own_view(tmpfs, tmp_path, step):
    """A whole copy restaged --partial (a file changed, the source grew) and a partial copy
    made whole, each SIGKILLed at a publish step: the copy then published has the view of
    that very tree, or none when whole; gc and the next stage keep it so."""
    shm = tmpfs("8M")
    src = tmp_path / "src"
    data = make_src(src, files=16)  # 4 MiB: fits whole
    args = ("stage", str(src), "--dest", str(shm), "--reserve", "1M", "-q")
    assert sh(*args).returncode == 0
    first = sorted(data)[0]
    (src / first).write_bytes(os.urandom(FILE))  # a file in RAM changes
    make_src(src / "more", files=16)  # the source outgrows the tmpfs
    env = {**os.environ, "SHMSTAGE_TEST_KILL_AT": step}
    assert sh(*args, "--partial", env=env).returncode == -9
    _consistent(shm)
    assert sh("gc", "--dest", str(shm)).returncode == 0
    _consistent(shm)
    assert sh(*args, "--partial").returncode == 0
    _consistent(shm)
    files = DatasetFiles(shm / "src")
    assert files.kind == "partial" and files.read(first) == (src / first).read_bytes()
    # partial -> whole, killed: never the old partial view over the whole copy
    subprocess.run(["rm", "-rf", str(src / "more"), str(src / sorted(data)[1])], check=True)
    assert sh(*args, env=env).returncode == -9
    _consistent(shm)
    assert sh(*args).returncode == 0
    _consistent(shm)
    files = DatasetFiles(shm / "src")
    assert files.kind == "copy" and set(files.names) == set(data) - {sorted(data)[1]}


_POLL_VIEW = """
import os, sys
from shmstage.stage.store.views import read_view
print("ready", flush=True)
seen = missing = 0
while not os.path.exists(sys.argv[2]):
    seen += 1
    missing += read_view(sys.argv[1], "src") is None
print(seen, missing, flush=True)
"""


def test_a_view_rewritten_in_place_is_never_missing(tmpfs, tmp_path):
    """An up-to-date restage whose non-resident files changed rewrites the view: a reader
    polling meanwhile always finds one (the old or the new, swapped in one step)."""
    from shmstage.stage.resident import Subset
    from shmstage.stage.store.layout import Store
    from shmstage.stage.store.views import read_view

    shm = tmpfs("8M")
    src = tmp_path / "src"
    make_src(src)
    args = ("stage", str(src), "--dest", str(shm), "--partial", "--reserve", "1M", "-q")
    assert sh(*args).returncode == 0
    store = Store(shm)
    listed = read_view(shm, "src").files()
    rows = list(zip(listed.names, listed.sizes, listed.mtimes, listed.resident))
    stop = tmp_path / "stop"
    poll = subprocess.Popen(
        [sys.executable, "-c", _POLL_VIEW, str(shm), str(stop)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert poll.stdout.readline().strip() == "ready"
        subset = Subset(str(src), "1M", None)
        subset.total = (1, 1)
        for i in range(300):  # the files outside RAM changed: new mtimes, a new view
            subset.files = [(n, s, m + (i + 1) * (not r), r) for n, s, m, r in rows]
            subset.current(store, "src", store.published("src"))
    finally:
        stop.touch()
        out, _ = poll.communicate(timeout=60)
    seen, missing = map(int, out.split())
    assert seen > 0 and missing == 0, (seen, missing)
    assert read_view(shm, "src").files().mtimes != listed.mtimes


def test_a_restage_counts_the_copy_in_ram_as_its_own_room(tmpfs, tmp_path):
    """A whole copy whose source outgrows the tmpfs keeps every file it holds (the restage
    links them: no new pages), as much as the same source into an empty tmpfs, and the next
    identical restage copies nothing."""
    shm, empty = tmpfs("8M"), tmpfs("8M")
    src = tmp_path / "src"
    make_src(src, files=20)  # 5 MiB
    args = ("--reserve", "1M", "--json")
    assert sh("stage", str(src), "--dest", str(shm), *args).returncode == 0
    held = resident_files(shm / "src")
    make_src(src / "more", files=12)
    r = sh("stage", str(src), "--dest", str(shm), "--partial", *args)
    assert r.returncode == 0, r.stderr
    ds = json.loads(r.stdout)
    assert set(held) <= set(resident_files(shm / "src"))
    fresh = json.loads(sh("stage", str(src), "--dest", str(empty), "--partial", *args).stdout)
    assert ds["bytes"] >= fresh["bytes"] and ds["total_bytes"] == fresh["total_bytes"]
    again = json.loads(sh("stage", str(src), "--dest", str(shm), "--partial", *args).stdout)
    assert again["copied_bytes"] == 0 and again["bytes"] == ds["bytes"]


def test_a_partial_view_follows_the_copy_top_made_private(tmpfs, open_tmp_path):
    shm = tmpfs("8M")
    src = open_tmp_path / "src"
    make_src(src)
    src.chmod(0o755)
    args = ("stage", str(src), "--dest", str(shm), "--partial", "--reserve", "1M", "-q")
    assert sh(*args).returncode == 0
    view = shm / ".shmstage" / "views" / "src"
    assert (view / "files").stat().st_mode & 0o004
    src.chmod(0o700)
    assert sh(*args).returncode == 0
    assert (shm / "src").stat().st_mode & 0o077 == 0
    for f in ("files", "view.json"):
        assert (view / f).stat().st_mode & 0o077 == 0, f


def test_partial_prices_symlinks_and_keeps_a_part(tmpfs, tmp_path):
    """Long symlinks take a tmpfs page each: the choice counts them, so --partial keeps a
    part instead of the fit check refusing it all."""
    shm = tmpfs("8M")
    src = tmp_path / "src"
    make_src(src, files=32)  # 8 MiB
    (src / "links").mkdir()
    target = "../" + "x" * 200
    for i in range(1500):  # ~6 MiB of pages on 4 KiB pages
        os.symlink(target + str(i), src / "links" / f"l{i}")
    r = sh("stage", str(src), "--dest", str(shm), "--partial", "--reserve", "1M", "--json")
    assert r.returncode == 0, r.stderr
    assert 0 < json.loads(r.stdout)["resident"] < 1


def test_partial_with_no_wait_is_refused_in_one_line(tmpfs, tmp_path):
    shm = tmpfs("8M")
    make_src(tmp_path / "src", files=2)
    r = sh(
        "run",
        "--stage",
        str(tmp_path / "src"),
        "--dest",
        str(shm),
        "--partial",
        "--no-wait",
        "--",
        "true",
    )
    assert r.returncode == 2 and "--partial and --no-wait do not combine" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (shm / "src").exists()


def test_partial_dry_run_says_the_part_a_real_run_keeps(tmpfs, tmp_path):
    shm = tmpfs("8M")
    src = tmp_path / "src"
    make_src(src)
    args = ("stage", str(src), "--dest", str(shm), "--partial", "--reserve", "1M")
    r = sh(*args, "--dry-run", "--json")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    text = sh(*args, "--dry-run")
    assert text.returncode == 0 and "--partial would keep" in text.stdout
    assert not (shm / "src").exists()
    ds = json.loads(sh(*args, "--json").stdout)
    assert (plan["bytes"], plan["files"], plan["total_bytes"]) == (
        ds["bytes"],
        ds["files"],
        ds["total_bytes"],
    )
