"""The staging engine on real files in real tmpfs mounts, with real processes and signals."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest

from shmstage.errors import CapacityError, RefusedError, ShmstageError
from shmstage.stage import evict, find, list_staged, stage, verify
from shmstage.stage.build import copier
from shmstage.stage.sources.walk import walk

pytestmark = pytest.mark.root


@pytest.fixture
def tmp_path(open_tmp_path):
    """Sources every user can reach: under pytest's 0700 tmp_path a copy's root would rightly
    lose its group and other bits (test_stage_perms), and snapshots would differ."""
    return open_tmp_path


# --- helpers -----------------------------------------------------------------------


def make_tree(root: Path, *, files: int = 20, size: int = 5000) -> Path:
    """A small dataset with classes, a read-only dir, odd modes, in-tree links, a hard link."""
    root.mkdir(parents=True)
    for c in range(4):
        d = root / f"class{c}"
        d.mkdir()
        for i in range(files // 4):
            (d / f"img{i:03d}.jpg").write_bytes(os.urandom(size + i))
    (root / "class0" / "img000.jpg").chmod(0o600)
    (root / "class1" / "run.sh").write_text("#!/bin/sh\n")
    (root / "class1" / "run.sh").chmod(0o755)
    (root / "empty").mkdir()
    (root / "meta").mkdir()
    (root / "meta" / "labels.txt").write_text("a\nb\n")
    (root / "meta" / "latest").symlink_to("labels.txt")
    (root / "meta" / "up").symlink_to("../class2")
    (root / "meta" / "dangling").symlink_to("nothing-here")
    os.link(root / "meta" / "labels.txt", root / "meta" / "labels-hard.txt")
    (root / "meta").chmod(0o555)
    os.utime(root / "class2", ns=(1_000_000_000, 1_500_000_000_123))
    return root


def snapshot(root: Path) -> dict[str, tuple]:
    """Everything that must match: type, mode, mtime, size, content or link target."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames + ([] if dirpath != str(root) else ["."]):
            p = os.path.normpath(os.path.join(dirpath, n))
            st = os.lstat(p)
            rel = os.path.relpath(p, root)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("l", os.readlink(p), st.st_mtime_ns)
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("d", stat.S_IMODE(st.st_mode), st.st_mtime_ns)
            else:
                digest = hashlib.sha1(Path(p).read_bytes()).hexdigest()
                out[rel] = ("f", stat.S_IMODE(st.st_mode), st.st_mtime_ns, st.st_size, digest)
    return out


def run_cli(
    shmstage_bin: list[str], *args: str, env: dict | None = None, **kw
) -> subprocess.CompletedProcess:
    return subprocess.run([*shmstage_bin, *args], capture_output=True, text=True, env=env, **kw)


def slow_env(seconds: float) -> dict[str, str]:
    return {**os.environ, copier.SLOW_ENV: str(seconds)}


def wait_for(cond, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError("timed out waiting")
        time.sleep(0.02)


def partial_files(dest: Path, name: str) -> int:
    part = dest / ".shmstage" / "partial" / name
    return sum(len(f) for _, _, f in os.walk(part)) if part.exists() else 0


# --- exactness, no-op, incremental ----------------------------------------------------


def test_staged_tree_equals_source_exactly(tmpfs, tmp_path):
    """Files, dirs, modes, mtimes, in-tree symlinks and hard links are reproduced exactly."""
    src = make_tree(tmp_path / "ds")
    dest = tmpfs("64M") / "shmstage"
    ds = stage(src, dest=dest)
    assert ds.path == str(dest / "ds") and ds.changed and ds.files == 23
    assert snapshot(src) == snapshot(Path(ds.path))
    staged = Path(ds.path) / "meta"
    assert os.lstat(staged / "labels.txt").st_ino == os.lstat(staged / "labels-hard.txt").st_ino


def test_nothing_added_inside_the_dataset(tmpfs, tmp_path):
    """Bookkeeping lives in DEST/.shmstage; DEST holds only it and the dataset."""
    src = make_tree(tmp_path / "ds")
    dest = tmpfs("64M") / "shmstage"
    ds = stage(src, dest=dest)
    assert sorted(os.listdir(dest)) == [".shmstage", "ds"]
    assert sorted(os.listdir(ds.path)) == sorted(os.listdir(src))


def test_restage_unchanged_is_a_noop(tmpfs, tmp_path):
    """A second stage of an unchanged source copies nothing and keeps the same tree."""
    src = make_tree(tmp_path / "ds")
    dest = tmpfs("64M") / "shmstage"
    first = stage(src, dest=dest)
    ino = os.lstat(first.path).st_ino
    again = stage(src, dest=dest)
    assert not again.changed and again.copied_bytes == 0 and again.path == first.path
    assert os.lstat(again.path).st_ino == ino
    assert again.last_used >= first.last_used


def test_changed_source_copies_only_what_changed(tmpfs, tmp_path):
    """Unchanged files are hard-linked from the old version; only the changed file is copied."""
    src = make_tree(tmp_path / "ds")
    dest = tmpfs("64M") / "shmstage"
    first = stage(src, dest=dest)
    keep_ino = os.lstat(Path(first.path) / "class1" / "img000.jpg").st_ino
    (src / "class3" / "img001.jpg").write_bytes(b"new content")
    (src / "class3" / "added.jpg").write_bytes(b"xyz")
    second = stage(src, dest=dest)
    assert second.changed and second.copied_bytes == len(b"new content") + 3
    assert os.lstat(Path(second.path) / "class1" / "img000.jpg").st_ino == keep_ino
    assert snapshot(src) == snapshot(Path(second.path))
    assert os.listdir(dest / ".shmstage" / "partial") == []
    assert os.listdir(dest / ".shmstage" / "trash") == []


def test_big_file_is_split_across_workers(tmpfs, tmp_path, monkeypatch):
    """Files above two chunks are copied in parallel chunks and still match byte for byte."""
    monkeypatch.setattr(copier, "CHUNK", 1 << 20)
    src = tmp_path / "shards"
    src.mkdir()
    (src / "a.bin").write_bytes(os.urandom((5 << 20) + 123))
    tasks, chunked = copier.make_tasks(
        [(str(src / "a.bin"), "x", (5 << 20) + 123, 0, 0, 0o644, "a.bin")], chunk=1 << 20
    )
    assert chunked == [0] and len(tasks) == 6
    ds = stage(src, dest=tmpfs("64M") / "d", workers=3, verify="checksum")
    assert snapshot(src) == snapshot(Path(ds.path))


def test_stream_slots_take_the_chunks_in_the_order_they_were_dealt(tmpfs, tmp_path, monkeypatch):
    """With more workers than stream slots, the chunks of big files start in the order they
    were dealt (each file front to back) and never more at once than there are slots.  A
    worker that took a chunk first and a slot after could start chunks out of order (the one
    that just freed a slot takes it back before the woken waiter runs): readahead broken and
    two streams on one tmpfs file, the 4-shard copy 1.6x slower."""
    monkeypatch.setattr(copier, "CHUNK", 1 << 20)
    monkeypatch.setattr(copier, "streams", lambda src: 1)
    src = tmp_path / "shards"
    src.mkdir()
    for n in "abc":
        (src / f"{n}.bin").write_bytes(os.urandom(6 << 20))
    log = tmp_path / "sendfile.log"
    real = os.sendfile

    def sendfile(out: int, in_: int, offset: int, count: int) -> int:  # runs in the workers
        name = os.path.basename(os.readlink(f"/proc/self/fd/{in_}"))
        fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        os.write(fd, f"{name} {offset >> 20}\n".encode())  # one small append: atomic
        os.close(fd)
        return real(out, in_, offset, count)

    monkeypatch.setattr(os, "sendfile", sendfile)
    ds = stage(src, dest=tmpfs("64M") / "d", workers=8)
    assert snapshot(src) == snapshot(Path(ds.path))
    started = []
    for line in log.read_text().splitlines():
        if not started or started[-1] != line:  # a chunk may take several sendfile calls
            started.append(line)
    dealt = [f"{n}.bin {k}" for k in range(6) for n in "abc"]
    assert started == dealt  # one slot: one chunk at a time, in the dealt order


@pytest.mark.parametrize("fail_at", [1, 2, 3, 4])
def test_a_pipe_the_copier_cannot_make_leaves_no_descriptor_open(tmp_path, monkeypatch, fail_at):
    """EMFILE on the copier's n-th pipe (task, chunk, result, stream slots): the error goes
    up and every descriptor made so far is closed (a node service lives on after it)."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "f").write_bytes(b"x")
    (tmp_path / "dst").mkdir()
    jobs = [(f"{tmp_path}/src/f", f"{tmp_path}/dst/f", 1, 0, 0, 0o644, "f")]
    real, calls = os.pipe, [0]

    def pipe() -> tuple[int, int]:
        calls[0] += 1
        if calls[0] == fail_at:
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return real()

    for make in (
        lambda: copier.run(jobs, copier.make_tasks(jobs)[0], 2),
        lambda: copier.Stream(f"{tmp_path}/src/", f"{tmp_path}/dst/", 2).__enter__(),
    ):
        before = set(os.listdir("/proc/self/fd"))
        calls[0] = 0
        monkeypatch.setattr(os, "pipe", pipe)
        with pytest.raises(OSError, match="Too many open files"):
            make()
        monkeypatch.setattr(os, "pipe", real)
        assert set(os.listdir("/proc/self/fd")) <= before


def test_a_copy_worker_killed_mid_copy_is_named_with_its_signal(tmpfs, tmp_path, monkeypatch):
    """A worker killed by a signal makes the stage fail with that signal named, however the
    other workers ended (they take the end markers and exit: the results pipe ends first)."""
    monkeypatch.setenv(copier.SLOW_ENV, "0.05")
    src = make_tree(tmp_path / "ds", files=80)
    dest = tmpfs("64M") / "d"

    def kill_one() -> None:  # a worker, once the copy runs (0.05 s per file: seconds left)
        for _ in range(500):
            kids = psutil.Process().children()
            if kids:
                time.sleep(0.3)
                kids[0].send_signal(signal.SIGTERM)
                return
            time.sleep(0.01)

    t = threading.Thread(target=kill_one)
    t.start()
    try:
        with pytest.raises(ShmstageError, match="killed by signal 15 \\(SIGTERM\\)"):
            stage(src, dest=dest, workers=4)
    finally:
        t.join()
    assert not (dest / "ds").exists()


# --- refusals -------------------------------------------------------------------------


def test_link_outside_the_tree_is_refused(tmpfs, tmp_path):
    """A symlink leaving the source tree is refused before anything is written."""
    src = make_tree(tmp_path / "ds")
    (src / "class0" / "passwd").symlink_to("/etc/passwd")
    dest = tmpfs("64M") / "shmstage"
    with pytest.raises(
        RefusedError, match=r"symlink that points outside it: .*passwd -> /etc/passwd"
    ):
        stage(src, dest=dest)
    assert not (dest / "ds").exists()


def test_link_escaping_only_in_combination_is_refused(tmp_path):
    """`a -> .` plus `b -> a/..` looks inside lexically but resolves outside: refused."""
    src = tmp_path / "ds"
    src.mkdir()
    (src / "a").symlink_to(".")
    (src / "b").symlink_to("a/..")
    with pytest.raises(RefusedError, match="points outside"):
        walk(str(src))


def test_symlink_loop_is_kept_as_links(tmpfs, tmp_path):
    """Links that loop inside the tree are copied as links, never followed."""
    src = tmp_path / "ds"
    src.mkdir()
    (src / "a").symlink_to("b")
    (src / "b").symlink_to("a")
    ds = stage(src, dest=tmpfs("16M") / "d")
    assert os.readlink(Path(ds.path) / "a") == "b"


def test_special_files_are_refused(tmp_path):
    """A FIFO in the source is refused with a clear message."""
    src = tmp_path / "ds"
    src.mkdir()
    os.mkfifo(src / "pipe")
    with pytest.raises(RefusedError, match="named pipe at .*pipe"):
        stage(src, dest=tmp_path / "dest")


def test_capacity_refused_before_writing(tmpfs, tmp_path):
    """A dataset larger than the tmpfs is refused with the numbers and the remount hint; nothing written."""
    src = tmp_path / "big"
    src.mkdir()
    (src / "a.bin").write_bytes(os.urandom(6 << 20))
    dest = tmpfs("4M") / "shmstage"
    with pytest.raises(CapacityError) as e:
        stage(src, dest=dest, reserve=0)
    assert "needs 6.0 MiB" in str(e.value) and "shmstage remount" in str(e.value)
    assert not (dest / "big").exists()
    assert os.listdir(dest / ".shmstage" / "partial") == []


def test_reserve_is_kept_free(tmpfs, tmp_path):
    """Data that fits only without the reserve is refused."""
    src = tmp_path / "ds"
    src.mkdir()
    (src / "a.bin").write_bytes(os.urandom(3 << 20))
    with pytest.raises(CapacityError, match="2.0 MiB reserve"):
        stage(src, dest=tmpfs("4M") / "d", reserve=2 << 20)


def test_planted_symlink_as_dest_is_refused(tmpfs, tmp_path):
    """In a sticky world-writable dir, a DEST planted as a symlink is refused and not followed."""
    shm = tmpfs("16M", mode="1777")
    target = tmp_path / "victim"
    target.mkdir()
    (shm / "shmstage").symlink_to(target)
    src = make_tree(tmp_path / "ds")
    with pytest.raises(RefusedError, match="is a symlink; refusing to follow it"):
        stage(src, dest=shm / "shmstage")
    assert os.listdir(target) == []


def test_dest_owned_by_another_user_is_refused(tmpfs, tmp_path):
    """A DEST directory owned by another non-root user is refused."""
    shm = tmpfs("16M", mode="1777")
    (shm / "shmstage").mkdir()
    os.chown(shm / "shmstage", 12345, 12345)
    with pytest.raises(RefusedError, match="owned by uid 12345"):
        stage(make_tree(tmp_path / "ds"), dest=shm / "shmstage")


def test_planted_bookkeeping_symlink_is_refused(tmpfs, tmp_path):
    """A symlink planted as DEST/.shmstage is refused."""
    shm = tmpfs("16M", mode="1777")
    (shm / ".shmstage").symlink_to(tmp_path)
    with pytest.raises(RefusedError, match=r"\.shmstage is a symlink"):
        stage(make_tree(tmp_path / "ds"), dest=shm)


def test_same_name_other_source_is_refused(tmpfs, tmp_path):
    """Two different sources with one name: refused unless --force, which replaces."""
    a = make_tree(tmp_path / "a" / "ds")
    b = make_tree(tmp_path / "b" / "ds")
    dest = tmpfs("64M") / "d"
    stage(a, dest=dest)
    with pytest.raises(RefusedError, match="already holds"):
        stage(b, dest=dest)
    ds = stage(b, dest=dest, force=True)
    assert ds.source == str(b) and snapshot(b) == snapshot(Path(ds.path))


# --- tar sources ----------------------------------------------------------------------


def _tar(path: Path, members: list[tuple[str, bytes | None, str | None]], mode: str = "w") -> Path:
    with tarfile.open(path, mode) as tf:
        for name, data, link in members:
            info = tarfile.TarInfo(name)
            info.mtime = 1_700_000_000
            if link is not None:
                info.type, info.linkname = tarfile.SYMTYPE, link
                tf.addfile(info)
            elif data is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tf.addfile(info)
            else:
                info.size, info.mode = len(data), 0o640
                import io

                tf.addfile(info, io.BytesIO(data))
    return path


@pytest.mark.parametrize("suffix,mode", [(".tar", "w"), (".tar.gz", "w:gz")])
def test_tar_source_is_extracted_exactly(tmpfs, tmp_path, suffix, mode):
    """A tar archive is staged as its tree; restaging the same archive is a no-op."""
    arc = _tar(
        tmp_path / f"data{suffix}",
        [("d", None, None), ("d/a.txt", b"hello", None), ("d/l", None, "a.txt")],
        mode,
    )
    dest = tmpfs("16M") / "s"
    ds = stage(arc, dest=dest)
    assert ds.name == "data" and ds.files == 1
    a = Path(ds.path) / "d" / "a.txt"
    assert a.read_bytes() == b"hello" and stat.S_IMODE(a.stat().st_mode) == 0o640
    assert a.stat().st_mtime == 1_700_000_000 and os.readlink(Path(ds.path) / "d" / "l") == "a.txt"
    assert not stage(arc, dest=dest).changed


@pytest.mark.parametrize(
    "member,why",
    [
        (("../evil.txt", b"x", None), "absolute path or '..'"),
        (("/etc/evil.txt", b"x", None), "absolute path or '..'"),
        (("d/../../evil", b"x", None), "absolute path or '..'"),
        (("esc", None, "../../etc/passwd"), "points outside the tree"),
        (("abs", None, "/etc/passwd"), "points outside the tree"),
    ],
)
def test_unsafe_tar_members_are_refused(tmpfs, tmp_path, member, why):
    """Members with ../, absolute paths or escaping links are refused; nothing is extracted."""
    arc = _tar(tmp_path / "bad.tar", [("ok.txt", b"fine", None), member])
    dest = tmpfs("16M") / "s"
    with pytest.raises(RefusedError, match=why):
        stage(arc, dest=dest)
    assert not (dest / "bad").exists() and not (tmp_path / "evil.txt").exists()
    assert os.listdir(dest / ".shmstage" / "partial") == []


def test_tar_member_through_symlink_is_refused(tmp_path):
    """A member written through a symlink the archive created is refused."""
    arc = _tar(tmp_path / "t.tar", [("l", None, "."), ("l/x", b"x", None)])
    with pytest.raises(RefusedError, match="through the symlink"):
        stage(arc, dest=tmp_path / "dest")


# --- verify / find / list / evict ----------------------------------------------------------


def test_verify_catches_a_flipped_byte_only_with_checksum(tmpfs, tmp_path):
    """A flipped byte with the mtime restored passes the quick check and fails --checksum."""
    src = make_tree(tmp_path / "ds")
    ds = stage(src, dest=tmpfs("64M") / "d")
    victim = Path(ds.path) / "class2" / "img001.jpg"
    st = victim.stat()
    data = bytearray(victim.read_bytes())
    data[100] ^= 0xFF
    victim.write_bytes(bytes(data))
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert verify("ds", dest=Path(ds.path).parent).ok
    report = verify("ds", dest=Path(ds.path).parent, checksum=True)
    assert not report.ok
    assert [(d.path, d.problem) for d in report.differences] == [("class2/img001.jpg", "content")]


def test_verify_finds_changed_missing_and_extra(tmpfs, tmp_path):
    """Changed, missing and extra files are each reported."""
    src = make_tree(tmp_path / "ds")
    dest = tmpfs("64M") / "d"
    ds = stage(src, dest=dest)
    root = Path(ds.path)
    (root / "class0" / "img001.jpg").write_bytes(b"short")
    (root / "class1" / "img002.jpg").unlink()
    (root / "class3" / "stray.txt").write_text("x")
    problems = {(d.path, d.problem) for d in verify("ds", dest=dest).differences}
    assert problems == {
        ("class0/img001.jpg", "changed"),
        ("class1/img002.jpg", "missing"),
        ("class3/stray.txt", "extra"),
    }


def test_find_by_name_and_source(tmpfs, tmp_path):
    """find() answers by name or by source path, and None for what is not staged."""
    src = make_tree(tmp_path / "ds")
    dest = tmpfs("64M") / "d"
    ds = stage(src, dest=dest)
    assert find("ds", dest=dest).path == ds.path
    assert find(str(src), dest=dest).path == ds.path
    assert find("other", dest=dest) is None
    assert find("ds", dest=tmp_path / "nowhere") is None


def test_find_updates_last_used(tmpfs, tmp_path):
    """find() records a use: list shows a later last_used, staged_at stays."""
    dest = tmpfs("64M") / "d"
    ds = stage(make_tree(tmp_path / "ds"), dest=dest)
    time.sleep(0.05)
    found = find("ds", dest=dest)
    listed = list_staged(dest)[0]
    assert found.last_used > ds.last_used and listed.last_used == pytest.approx(
        found.last_used, abs=0.01
    )
    assert listed.staged_at == ds.staged_at


def test_evict_by_name_all_and_age(tmpfs, tmp_path):
    """evict removes one dataset, --older-than only stale ones, --all the rest; --dry-run nothing."""
    dest = tmpfs("64M") / "d"
    stage(make_tree(tmp_path / "a"), dest=dest)
    stage(make_tree(tmp_path / "b"), dest=dest)
    stage(make_tree(tmp_path / "c"), dest=dest)
    assert evict("a", dest=dest) == ["a"]
    assert not (dest / "a").exists() and [d.name for d in list_staged(dest)] == ["b", "c"]
    assert evict(older_than=3600, dest=dest) == []
    assert evict(all=True, dest=dest, dry_run=True) == ["b", "c"]
    assert (dest / "b").exists()
    assert evict(all=True, dest=dest) == ["b", "c"]
    assert sorted(os.listdir(dest)) == [".shmstage"]
    with pytest.raises(ShmstageError, match="a is not staged in"):
        evict("a", dest=dest)


def test_evict_leaves_no_lock_file_and_restage_works(tmpfs, tmp_path):
    """evict removes the dataset's lock file too (nothing accumulates), and staging again works."""
    dest = tmpfs("64M") / "d"
    src = make_tree(tmp_path / "a")
    stage(src, dest=dest)
    locks = dest / ".shmstage" / "locks"
    assert (locks / "a.lock").exists()
    evict("a", dest=dest)
    assert not (locks / "a.lock").exists()
    assert stage(src, dest=dest).changed


def test_lock_waiter_relocks_after_evict_unlinks_the_file(tmp_path):
    """A waiter blocked on a lock that evict unlinks ends up holding the new lock file, not the
    unlinked one (else two processes could both think they hold the lock)."""
    import threading

    from shmstage.stage.store import Store

    store = Store(tmp_path / "d")
    store.open(create=True)
    held = threading.Event()
    release = threading.Event()
    got: list[str] = []

    def holder() -> None:
        with store.lock("x"):
            held.set()
            release.wait(10)
            store.drop_lock("x")

    def waiter() -> None:
        import fcntl

        with store.lock("x"):
            # the file now at the lock path must be the one we hold: another flock on it fails
            try:
                fd = os.open(store.lock_path("x"), os.O_RDWR)
            except FileNotFoundError:
                got.append("missing")
                return
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                got.append("not held")
            except BlockingIOError:
                got.append("held")
            finally:
                os.close(fd)

    t1 = threading.Thread(target=holder)
    t1.start()
    assert held.wait(10)
    t2 = threading.Thread(target=waiter)
    t2.start()
    time.sleep(0.2)  # let the waiter block in flock
    release.set()
    t1.join(10)
    t2.join(10)
    assert got == ["held"]


# --- concurrency and faults -------------------------------------------------------------


def test_eight_concurrent_stagers_make_one_copy(tmpfs, tmp_path, shmstage_bin, procs):
    """8 processes staging one source at once: one copies, the others wait, all print the same path."""
    src = make_tree(tmp_path / "ds", files=40)
    dest = tmpfs("64M") / "d"
    env = slow_env(0.08)  # ~3 s of copying: every process starts while the first holds the lock
    stagers = [
        procs.start(
            [*shmstage_bin, "stage", str(src), "--dest", str(dest), "--json"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(8)
    ]
    results = [p.communicate(timeout=120) for p in stagers]
    assert [p.returncode for p in stagers] == [0] * 8, results
    docs = [json.loads(out) for out, _ in results]
    assert {d["path"] for d in docs} == {str(dest / "ds")}
    assert sum(d["changed"] for d in docs) == 1
    assert sum("waiting for another shmstage (pid " in err for _, err in results) >= 1
    assert snapshot(src) == snapshot(dest / "ds")


def test_different_datasets_stage_in_parallel(tmpfs, tmp_path, shmstage_bin, procs):
    """Two datasets staged at the same time both complete."""
    dest = tmpfs("64M") / "d"
    srcs = [make_tree(tmp_path / n) for n in ("a", "b")]
    stagers = [
        procs.start(
            [*shmstage_bin, "stage", str(s), "--dest", str(dest), "--quiet"],
            stdout=subprocess.PIPE,
            text=True,
        )
        for s in srcs
    ]
    outs = [p.communicate(timeout=60)[0] for p in stagers]
    assert outs == [f"{dest / 'a'}\n", f"{dest / 'b'}\n"]


def test_sigkill_mid_copy_then_restage_resumes(tmpfs, tmp_path, shmstage_bin, procs):
    """SIGKILL mid-copy publishes nothing; the next run resumes the partial copy and completes."""
    src = make_tree(tmp_path / "ds", files=40)
    dest = tmpfs("64M") / "d"
    p = procs.start(
        [*shmstage_bin, "stage", str(src), "--dest", str(dest), "--workers", "2", "--quiet"],
        env=slow_env(0.2),
    )
    wait_for(lambda: partial_files(dest, "ds") >= 4)
    p.kill()
    p.wait()
    assert not (dest / "ds").exists()
    assert partial_files(dest, "ds") >= 4
    ds = stage(src, dest=dest)
    assert snapshot(src) == snapshot(Path(ds.path))
    assert 0 < ds.copied_bytes < ds.bytes  # what the killed run finished was kept
    assert os.listdir(dest / ".shmstage" / "partial") == []


@pytest.mark.parametrize(
    "sig,code,line",
    [
        (
            signal.SIGTERM,
            -signal.SIGTERM,
            "Error: interrupted by SIGTERM; the partial copy was removed",
        ),
        (signal.SIGINT, -signal.SIGINT, "Interrupted."),
    ],
)
def test_signal_mid_copy_removes_partial(tmpfs, tmp_path, shmstage_bin, sig, code, line, procs):
    """SIGTERM / Ctrl-C mid-copy: one line, then death by that signal (a shell loop stops),
    no partial copy, nothing published."""
    src = make_tree(tmp_path / "ds", files=40)
    dest = tmpfs("64M") / "d"
    p = procs.start(
        [*shmstage_bin, "stage", str(src), "--dest", str(dest)],
        env=slow_env(0.2),
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for(lambda: partial_files(dest, "ds") >= 2)
    p.send_signal(sig)
    _, err = p.communicate(timeout=30)
    assert p.returncode == code, err
    assert err.splitlines()[-1] == line
    assert not (dest / "ds").exists()
    assert os.listdir(dest / ".shmstage" / "partial") == []


@pytest.mark.parametrize(
    "sig,line",
    [
        (signal.SIGTERM, "Error: interrupted by SIGTERM; the partial copy was removed"),
        (signal.SIGINT, "Interrupted."),
    ],
)
def test_more_signals_during_the_cleanup_do_not_cut_it_short(
    tmpfs, tmp_path, shmstage_bin, sig, line, procs
):
    """An impatient user signals again and again while stage removes its partial copy: the
    cleanup still finishes (nothing in partial/ or trash/, no lock, no new manifest) and
    stage dies of the first signal with its one line."""
    src = tmp_path / "ds"
    for d in range(20):
        (src / f"d{d}").mkdir(parents=True)
        for f in range(200):
            (src / f"d{d}" / f"f{f}").write_text(str(f))
    dest = tmpfs("128M") / "d"
    p = procs.start(
        [*shmstage_bin, "stage", str(src), "--dest", str(dest), "--workers", "1"],
        env=slow_env(0.0005),
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for(lambda: partial_files(dest, "ds") >= 1500, timeout=120)
    state = dest / ".shmstage"

    def cleaning() -> bool:
        return any(os.listdir(state / d) for d in ("partial", "trash"))

    p.send_signal(sig)
    while p.poll() is None and cleaning():  # again and again until the copy is gone
        p.send_signal(sig)
        time.sleep(0.002)
    _, err = p.communicate(timeout=60)
    assert p.returncode == -sig, err
    assert err.splitlines()[-1] == line
    assert not cleaning()
    left = sorted(str(p.relative_to(state)) for p in state.rglob("*") if p.is_file())
    assert not [f for f in left if "ds" in f], left


def test_enospc_mid_copy_is_clean(tmpfs, tmp_path, shmstage_bin, procs):
    """Dest filling up mid-copy: clear error, partial removed, other datasets untouched."""
    shm = tmpfs("12M")
    dest = shm / "d"
    other = make_tree(tmp_path / "other")
    stage(other, dest=dest, reserve=0)
    src = tmp_path / "ds"
    src.mkdir()
    for i in range(12):
        (src / f"f{i:02d}").write_bytes(os.urandom(400_000))
    p = procs.start(
        [*shmstage_bin, "stage", str(src), "--dest", str(dest), "--reserve", "0", "--workers", "1"],
        env=slow_env(0.1),
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for(lambda: partial_files(dest, "ds") >= 1)
    filler = shm / "filler"
    with open(filler, "wb") as f:  # someone else fills the tmpfs
        try:
            while True:
                f.write(b"\0" * 65536)
        except OSError:
            pass
    _, err = p.communicate(timeout=60)
    filler.unlink()
    assert p.returncode == 1
    assert err.startswith(f"Error: no space left on {dest} while copying f")
    assert "partial copy was removed" in err
    assert not (dest / "ds").exists() and os.listdir(dest / ".shmstage" / "partial") == []
    assert verify("other", dest=dest, checksum=True).ok


@pytest.mark.parametrize(
    "how,message",
    [
        ("rewrite", "changed during the copy: {f} (its size or mtime differs from the scan)"),
        ("delete", "vanished during the copy: {f}"),
        # the same size and mtime, another inode, the old one still linked in the tree: the
        # worker queued f9's reads ahead, and must not copy what the rename took out of it
        ("rename", "{f} is not the file the scan found"),
    ],
)
def test_source_changing_during_copy_is_an_error(
    tmpfs, tmp_path, shmstage_bin, how, message, procs
):
    """A source file rewritten or deleted while it is being staged ends with a clear error."""
    src = tmp_path / "ds"
    src.mkdir()
    for i in range(10):
        (src / f"f{i}").write_bytes(b"x" * 1000)
    dest = tmpfs("16M") / "d"
    p = procs.start(
        [*shmstage_bin, "stage", str(src), "--dest", str(dest), "--workers", "1"],
        env=slow_env(0.2),
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for(lambda: partial_files(dest, "ds") >= 1)
    if how == "rewrite":
        (src / "f9").write_bytes(b"y" * 2000)
    elif how == "rename":
        st = (src / "f9").stat()
        os.link(src / "f9", src / "f9.old")  # (not copied: the scan did not list it)
        (src / "f9.new").write_bytes(b"y" * 1000)
        os.utime(src / "f9.new", ns=(st.st_atime_ns, st.st_mtime_ns))
        os.rename(src / "f9.new", src / "f9")
    else:
        (src / "f9").unlink()
    _, err = p.communicate(timeout=60)
    assert p.returncode == 1
    what = message.format(f=src / "f9")
    if how == "rename":
        assert err.startswith(f"Error: source file {what}"), err
    else:
        assert err == f"Error: source file {what}; re-run when the source is stable\n"
    assert not (dest / "ds").exists()
    assert os.listdir(dest / ".shmstage" / "partial") == []


def test_a_worker_out_of_file_descriptors_reads_ahead_less_and_copies_all(tmpfs, tmp_path, shmstage_bin):
    """Each worker opens the next files of its batch ahead (their reads queued): with a
    low open-file limit it runs out of descriptors doing so, gives some back, and copies
    every file all the same (it used to be one open at a time)."""
    src = tmp_path / "ds"
    src.mkdir()
    for i in range(600):
        (src / f"f{i:03d}").write_bytes(os.urandom(100 + i))

    def low_limit() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_NOFILE, (40, 40))

    dest = tmpfs("16M") / "d"
    r = subprocess.run(
        [*shmstage_bin, "stage", str(src), "--dest", str(dest), "--workers", "2", "-q"],
        capture_output=True, text=True, timeout=120, preexec_fn=low_limit,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert verify("ds", dest=dest, checksum=True).ok
    assert sorted(p.name for p in (dest / "ds").iterdir()) == sorted(p.name for p in src.iterdir())


def test_unreadable_file_is_named(request):
    """A file the stager cannot read is named in the error (staged as an unprivileged user)."""
    base = Path(tempfile.mkdtemp(prefix="shmstage-test-"))  # pytest's tmp_path is private to root
    request.addfinalizer(lambda: shutil.rmtree(base, ignore_errors=True))
    base.chmod(0o755)
    shm = base / "shm"
    shm.mkdir()
    shm.chmod(0o1777)
    src = base / "ds"
    src.mkdir(mode=0o755)
    (src / "ok").write_text("fine")
    (src / "secret").write_text("no")
    (src / "secret").chmod(0o600)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the library, in-process, as nobody (no need to exec the CLI)
        code = 0
        try:
            os.close(r)
            os.setgid(65534)
            os.setuid(65534)
            try:
                stage(src, dest=shm / "nobody")
            except ShmstageError as e:
                os.write(w, str(e).encode())
                code = e.exit_code
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        message = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 1, message
    assert message == (
        f"cannot read source file {src / 'secret'}: Permission denied; "
        "stage as a user who can read every file of the source"
    )
    assert not (shm / "nobody" / "ds").exists()


@pytest.mark.skipif(sys.platform != "linux", reason="Linux page cache")
def test_source_pages_are_dropped(tmpfs, tmp_path):
    """After staging, the source's pages are not kept in the page cache (RAM used once)."""
    src = tmp_path / "ds"
    src.mkdir()
    (src / "a.bin").write_bytes(os.urandom(8 << 20))
    os.sync()
    stage(src, dest=tmpfs("64M") / "d")
    import mmap

    fd = os.open(src / "a.bin", os.O_RDONLY)
    try:
        m = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)  # private: never written, just probed
        resident = _resident_pages(m)
        m.close()
    finally:
        os.close(fd)
    assert resident < (8 << 20) // 4096 // 10


def _resident_pages(m) -> int:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    length = len(m)
    pages = (length + 4095) // 4096
    vec = (ctypes.c_ubyte * pages)()
    buf = (ctypes.c_char * length).from_buffer(m)
    rc = libc.mincore(ctypes.c_void_p(ctypes.addressof(buf)), ctypes.c_size_t(length), vec)
    del buf
    assert rc == 0
    return sum(v & 1 for v in vec)
