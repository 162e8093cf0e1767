"""Crash states and gc (issue 11, items 5 and 9): a SIGKILL at any step of a stage leaves
something `list` shows and `gc` / `evict --all` removes, and a re-run completes.

Real processes and real SIGKILL (the engine's test-only $SHMSTAGE_TEST_KILL_AT hook)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shmstage.stage import find, gc, list_staged, stage, verify
from shmstage.stage.staging import KILL_STEPS

STAGER = (
    "import sys; from shmstage.stage import stage; stage(sys.argv[1], dest=sys.argv[2], workers=1)"
)


def make_src(root: Path, files: int = 4, tag: bytes = b"") -> Path:
    for c in ("a", "b"):
        (root / c).mkdir(parents=True, exist_ok=True)
        for i in range(files):
            (root / c / f"{i}.bin").write_bytes(tag + os.urandom(500 + i))
    return root


def skeleton(dest: Path) -> list[str]:
    # counters.json: the metrics' persistent counters (stage/counters.py), kept on purpose, and
    # the store-wide locks (locks/.counters, reservations/.fitting), which are the store's
    kept = {"counters.json", ".counters", ".fitting"}
    return sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.name not in kept)


EMPTY = [
    ".shmstage",
    *(
        f".shmstage/{d}"
        for d in (
            "leases",
            "locks",
            "manifests",
            "meta",
            "partial",
            "reservations",
            "served",
            "trash",
        )
    ),
]


def trees(dest: Path) -> set[str]:
    """Every dataset-sized tree on disk: DEST/<name>, partial/<name>, trash/*."""
    out = {str(p) for p in dest.iterdir() if p.name != ".shmstage"}
    for d in ("partial", "trash"):
        out |= {str(p) for p in (dest / ".shmstage" / d).iterdir() if not p.name.startswith(".")}
    return out


def cli(shmstage_bin, *args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*shmstage_bin, *args], capture_output=True, text=True, timeout=120, **kw)


def listed(shmstage_bin, dest: Path) -> list[dict]:
    r = cli(shmstage_bin, "list", "--dest", str(dest), "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def killed_stage(src: Path, dest: Path, step: str) -> None:
    r = subprocess.run(
        [sys.executable, "-c", STAGER, str(src), str(dest)],
        env={**os.environ, "SHMSTAGE_TEST_KILL_AT": step},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == -signal.SIGKILL, (step, r.returncode, r.stderr)


# A first publish has no old tree to exchange or trash: those steps exist only on republish.
CASES = [
    pytest.param(step, republish, id=f"{step}-{'republish' if republish else 'first'}")
    for republish in (False, True)
    for step in KILL_STEPS
    if republish or step not in ("exchange", "trash")
]


@pytest.mark.parametrize(("step", "republish"), CASES)
def test_sigkill_at_each_publish_step_is_visible_and_recoverable(
    shmstage_bin, tmp_path, step, republish
):
    """SIGKILL at `step`: every tree left is in `list`; a re-run publishes the new version
    exactly; a second kill followed by `evict --all` leaves only the empty skeleton."""
    src, dest = make_src(tmp_path / "ds"), tmp_path / "dest"
    if republish:
        stage(src, dest=dest)
        (src / "a" / "0.bin").write_bytes(b"version 2")
        (src / "b" / "1.bin").unlink()
    killed_stage(src, dest, step)
    on_disk = trees(dest)
    shown = {d["path"] for d in listed(shmstage_bin, dest)}
    assert on_disk <= shown, f"invisible after a kill at {step}: {on_disk - shown}"
    if republish:  # readers never lose the dataset
        assert find("ds", dest=dest) is not None
    ds = stage(src, dest=dest)
    assert verify("ds", dest=dest, checksum=True).ok
    assert (Path(ds.path) / "a" / "0.bin").read_bytes() == (src / "a" / "0.bin").read_bytes()
    assert not (Path(ds.path) / "b" / "1.bin").exists() if republish else True
    assert [d.state for d in list_staged(dest, unfinished=True)] == ["staged"]
    gc(dest)  # whatever the re-run could not know was junk (an orphaned trash tree)
    assert trees(dest) == {ds.path}

    (src / "a" / "2.bin").write_bytes(b"version 3")
    killed_stage(src, dest, step)
    r = cli(shmstage_bin, "evict", "--all", "--dest", str(dest))
    assert r.returncode == 0, r.stderr
    assert skeleton(dest) == EMPTY


@pytest.mark.parametrize("step", KILL_STEPS)
def test_sigterm_at_each_publish_step_leaves_a_consistent_store(shmstage_bin, tmp_path, step):
    """SIGTERM at `step` of a republish: exit 143, a complete dataset stays published (old or
    new), no invisible tree; a re-run publishes the new version."""
    src, dest = make_src(tmp_path / "ds"), tmp_path / "dest"
    stage(src, dest=dest)
    (src / "a" / "0.bin").write_bytes(b"version 2")
    r = cli(
        shmstage_bin,
        "stage",
        str(src),
        "--dest",
        str(dest),
        "--workers",
        "1",
        "--quiet",
        env={**os.environ, "SHMSTAGE_TEST_KILL_AT": f"{step}:TERM"},
    )
    assert r.returncode == -signal.SIGTERM, r.stderr
    assert r.stderr.startswith("Error: interrupted by SIGTERM") and "Traceback" not in r.stderr
    assert trees(dest) <= {d["path"] for d in listed(shmstage_bin, dest)}
    assert find("ds", dest=dest) is not None and verify("ds", dest=dest).ok
    stage(src, dest=dest)
    assert (dest / "ds" / "a" / "0.bin").read_bytes() == b"version 2"
    assert verify("ds", dest=dest, checksum=True).ok
    assert trees(dest) == {str(dest / "ds")}


def start_stopped_stager(src: Path, dest: Path) -> subprocess.Popen:
    """A real stager, stopped (SIGSTOP to it and its forked copier workers) once its partial
    tree has bytes in it."""
    proc = subprocess.Popen(
        [sys.executable, "-c", STAGER, str(src), str(dest)], start_new_session=True
    )
    part = dest / ".shmstage" / "partial" / src.name
    deadline = time.monotonic() + 60
    while not (part.is_dir() and any(f.stat().st_size for f in part.rglob("*.bin"))):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc)
            pytest.fail(f"stager ended ({proc.returncode}) before copying")
        time.sleep(0.002)
    os.killpg(proc.pid, signal.SIGSTOP)
    return proc


def stop(proc: subprocess.Popen) -> None:
    """SIGKILL the stager and its workers; wait until all are gone."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.02)
    raise AssertionError("the stager's workers outlived it")


def big_src(root: Path) -> Path:
    # Many files so the copy is still running when the test stops it.
    for c in range(20):
        d = root / f"c{c}"
        d.mkdir(parents=True)
        for i in range(100):
            (d / f"{i}.bin").write_bytes(os.urandom(2000))
    return root


def test_gc_during_a_live_stage_leaves_it_alone(shmstage_bin, tmp_path):
    """gc while another process stages skips its partial tree and lock; that stage completes."""
    src, dest = big_src(tmp_path / "ds"), tmp_path / "dest"
    proc = start_stopped_stager(src, dest)
    try:
        entry = [d for d in listed(shmstage_bin, dest) if d["name"] == "ds"]
        assert [(e["state"], e["stager_alive"], e["stager_pid"]) for e in entry] == [
            ("unfinished", True, proc.pid)
        ]
        assert entry[0]["source"] == str(src) and entry[0]["bytes"] > 0
        r = cli(shmstage_bin, "gc", "--dest", str(dest), "--json")
        assert r.returncode == 0, r.stderr
        report = json.loads(r.stdout)
        part = str(dest / ".shmstage" / "partial" / "ds")
        assert part not in [x["path"] for x in report["removed"]]
        assert part in [x["path"] for x in report["skipped"]]
        assert Path(part).is_dir()
        os.killpg(proc.pid, signal.SIGCONT)
        assert proc.wait(timeout=120) == 0
        assert verify("ds", dest=dest, checksum=True).ok
    finally:
        stop(proc)


def test_killed_stage_is_listed_and_gc_removes_it(shmstage_bin, tmp_path):
    """A stager killed mid-copy: list shows it unfinished (source, bytes so far, stager dead),
    gc --dry-run removes nothing, gc removes it all, evict --all leaves the skeleton."""
    src, dest = big_src(tmp_path / "ds"), tmp_path / "dest"
    other = make_src(tmp_path / "other")
    stage(other, dest=dest)
    stop(start_stopped_stager(src, dest))
    r = cli(shmstage_bin, "list", "--dest", str(dest))
    assert r.returncode == 0
    row = next(line for line in r.stdout.splitlines() if line.startswith("ds "))
    assert "unfinished, nobody working" in row and row.endswith(str(src))
    entry = next(d for d in listed(shmstage_bin, dest) if d["name"] == "ds")
    assert (entry["state"], entry["stager_alive"], entry["source"]) == (
        "unfinished",
        False,
        str(src),
    )
    assert entry["bytes"] > 0
    before = skeleton(dest)
    dry = gc(dest, dry_run=True)
    assert skeleton(dest) == before
    assert str(dest / ".shmstage" / "partial" / "ds") in [x.path for x in dry.removed]
    done = gc(dest)
    assert [x.path for x in done.removed] == [x.path for x in dry.removed]
    assert [d.name for d in list_staged(dest, unfinished=True)] == ["other"]
    assert [list((dest / ".shmstage" / d).iterdir()) for d in ("partial", "trash")] == [[], []]
    assert find("other", dest=dest) is not None  # a published dataset is never gc's business
    stage(src, dest=dest)  # a fresh stage after gc works
    r = cli(shmstage_bin, "evict", "--all", "--dest", str(dest))
    assert r.returncode == 0 and r.stdout == "evicted: ds, other\n"
    assert skeleton(dest) == EMPTY


# --- issue 20: a full tmpfs, reused pids, placing locks ------------------------------------


def fill(path: Path) -> None:
    """Write ``path`` until the file system has not one byte left."""
    with open(path, "wb", buffering=0) as f:
        for chunk in (1 << 16, 1):
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"x" * chunk)


@pytest.mark.root
def test_a_full_tmpfs_hands_out_a_current_dataset_and_refuses_a_new_one_in_one_line(
    shmstage_bin, tmpfs, tmp_path
):
    """On a tmpfs filled to the brim, an up-to-date dataset needs no space: `stage` and `run
    --stage` hand it out (exit 0); staging a new one fails with one line and leaves nothing."""
    mnt = tmpfs("8M")
    dest = mnt / "dest"
    src, new = make_src(tmp_path / "ds"), make_src(tmp_path / "new")
    assert cli(shmstage_bin, "stage", str(src), "--dest", str(dest), "--quiet").returncode == 0
    fill(mnt / "filler")
    assert os.statvfs(mnt).f_bavail == 0  # the premise
    again = cli(shmstage_bin, "stage", str(src), "--dest", str(dest))
    assert (again.returncode, again.stdout) == (0, f"{dest / 'ds'}\n"), again.stderr
    job = cli(shmstage_bin, "run", "--stage", str(src), "--dest", str(dest), "--", "true")
    assert job.returncode == 0, job.stderr
    refused = cli(shmstage_bin, "stage", str(new), "--dest", str(dest))
    assert refused.returncode in (1, 2)
    lines = refused.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), refused.stderr
    assert f"{dest}" in lines[0] and ("no space left" in lines[0] or "does not fit" in lines[0])
    assert [list((dest / ".shmstage" / d).iterdir()) for d in ("partial", "trash")] == [[], []]
    assert not (dest / "new").exists()
    assert not (dest / ".shmstage" / "locks" / "new.lock").exists()  # not even its lock file
    assert gc(dest).removed == ()


def in_new_pid_namespace(
    argv: list[str], keep_pid_2: bool = False, **kw
) -> subprocess.CompletedProcess:
    """Run ``argv`` in a new pid namespace (with its own /proc) as its pid 2; with
    ``keep_pid_2`` a `sleep` takes pid 2 instead, so that pid is alive while ``argv`` runs."""
    script = 'sleep 60 & "$@"; s=$?; kill $!; exit $s' if keep_pid_2 else '"$@"; true'
    return subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c", script, "sh", *argv],
        capture_output=True, text=True, timeout=120, **kw,
    )  # fmt: skip


@pytest.mark.root
@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare (util-linux)")
def test_gc_removes_trash_whose_owners_pid_now_names_another_process(shmstage_bin, tmp_path):
    """A republish killed after moving the old tree to trash, in a container (pid namespace);
    in the next container the same pid is a different, live process: gc removes the trash."""
    src, dest = make_src(tmp_path / "ds"), tmp_path / "dest"
    stage(src, dest=dest)
    (src / "a" / "new.bin").write_bytes(b"changed")
    killed = in_new_pid_namespace(
        [sys.executable, "-c", STAGER, str(src), str(dest)],
        env={**os.environ, "SHMSTAGE_TEST_KILL_AT": "trash"},
    )
    assert killed.returncode == 0, killed.stderr
    trash = dest / ".shmstage" / "trash"
    (entry,) = os.listdir(trash)
    assert entry.split(".")[1].split("-")[0] == "2"  # the premise: the stager was pid 2
    time.sleep(0.05)  # a later start time, in clock ticks
    done = in_new_pid_namespace([*shmstage_bin, "gc", "--dest", str(dest)], keep_pid_2=True)
    assert done.returncode == 0, done.stderr
    assert "being removed by pid" not in done.stdout
    assert os.listdir(trash) == []
    assert verify("ds", dest=dest, checksum=True).ok


def test_trash_owner_is_a_pid_and_its_start_time(shmstage_bin, tmp_path):
    """gc keeps trash whose remover (pid and start time) lives, removes it when the pid lives
    but started at another time, and keeps an entry of the old pid-only form while it lives."""
    src, dest = make_src(tmp_path / "ds"), tmp_path / "dest"
    stage(src, dest=dest)
    trash = dest / ".shmstage" / "trash"
    me = os.getpid()
    stat = Path(f"/proc/{me}/stat").read_bytes()
    start = int(stat[stat.rindex(b")") + 2 :].split()[19])  # field 22: start time in ticks
    live, reused, old = f"ds.{me}-{start}.1", f"ds.{me}-{start + 1}.2", f"ds.{me}.3"
    for entry in (live, reused, old):
        (trash / entry).mkdir()
    r = cli(shmstage_bin, "gc", "--dest", str(dest))
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(trash)) == sorted([live, old])
    assert r.stdout.count(f"being removed by pid {me}") == 2


def placing(tier: Path, name: str) -> Path:
    return tier / ".shmstage" / "placing" / name


def test_gc_and_evict_remove_placing_locks_nobody_holds(shmstage_bin, tmp_path):
    """Staging into tiers leaves placing/<name>: gc keeps it while held and removes it once
    free; evict of the dataset removes it too."""
    src, fast, slow = make_src(tmp_path / "ds"), tmp_path / "fast", tmp_path / "slow"
    tiers = f"{fast},{slow}"
    assert cli(shmstage_bin, "stage", str(src), "--dest", tiers, "--quiet").returncode == 0
    lock = placing(fast, "ds")
    assert lock.exists()  # the premise
    fd = os.open(lock, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        r = cli(shmstage_bin, "gc", "--dest", tiers, "--json")
        assert r.returncode == 0, r.stderr
        assert str(lock) in [x["path"] for x in json.loads(r.stdout)["skipped"]]
        assert lock.exists()
    finally:
        os.close(fd)
    r = cli(shmstage_bin, "gc", "--dest", tiers, "--json")
    assert r.returncode == 0, r.stderr
    assert str(lock) in [x["path"] for x in json.loads(r.stdout)["removed"]]
    assert not lock.exists()
    assert cli(shmstage_bin, "stage", str(src), "--dest", tiers, "--quiet").returncode == 0
    assert lock.exists()
    r = cli(shmstage_bin, "evict", "ds", "--dest", tiers)
    assert r.returncode == 0, r.stderr
    assert not lock.exists()
    # staged in the slow tier (restaged where it is), placed under the fast tier's lock
    assert cli(shmstage_bin, "stage", str(src), "--dest", str(slow), "--quiet").returncode == 0
    assert cli(shmstage_bin, "stage", str(src), "--dest", tiers, "--quiet").returncode == 0
    assert (slow / "ds").is_dir() and lock.exists()
    r = cli(shmstage_bin, "evict", "ds", "--dest", tiers)
    assert r.returncode == 0, r.stderr
    assert not (slow / "ds").exists() and not lock.exists()


def test_a_stager_waiting_on_a_placing_lock_that_is_removed_locks_the_new_one(
    shmstage_bin, tmp_path
):
    """While a stager waits on placing/<name>, its holder unlinks it (as gc does): the stager
    must then hold a lock others can see at that path, not the unlinked file."""
    src, fast, slow = big_src(tmp_path / "ds"), tmp_path / "fast", tmp_path / "slow"
    lock = placing(fast, "ds")
    lock.parent.mkdir(parents=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    proc = subprocess.Popen(
        [*shmstage_bin, "stage", str(src), "--dest", f"{fast},{slow}", "--workers", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        ready, _, _ = select.select([proc.stderr], [], [], 60)
        assert ready and proc.stderr.readline().startswith("waiting for another shmstage")
        os.unlink(lock)
        os.close(fd)
        fd = -1
        part = fast / ".shmstage" / "partial" / "ds"
        deadline = time.monotonic() + 60
        # bytes landed: its copier worker runs (a SIGSTOP mid-fork could stop it for good)
        while not (part.is_dir() and any(f.stat().st_size for f in part.rglob("*.bin"))):
            assert proc.poll() is None and time.monotonic() < deadline, "no partial copy"
            time.sleep(0.002)
        os.killpg(proc.pid, signal.SIGSTOP)  # mid-copy, still placing
        assert lock.exists()
        probe = os.open(lock, os.O_RDONLY)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(probe)
        os.killpg(proc.pid, signal.SIGCONT)
        assert proc.wait(timeout=120) == 0
    finally:
        if fd >= 0:
            os.close(fd)
        stop(proc)
        proc.stderr.close()


def deep_chain(top: Path, depth: int) -> None:
    """``depth`` nested directories d/d/d/... under ``top``, a file at the bottom (made
    through directory fds: the path would be longer than PATH_MAX)."""
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(depth):
        os.mkdir("d", dir_fd=fd)
        nxt = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = nxt
    os.close(os.open("leaf", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))
    os.close(fd)


@pytest.fixture
def deep_tmp(tmp_path):
    """tmp_path, emptied by rm (iterative) afterwards: pytest's own cleanup of a tree deeper
    than the recursion limit, left by a failed test, would fail in a later session."""
    yield tmp_path
    subprocess.run(["rm", "-rf", str(tmp_path)], check=False, timeout=120)


def test_evict_and_gc_remove_trees_deeper_than_the_recursion_limit(shmstage_bin, deep_tmp):
    """A staged dataset grown 1200 directories deep (more than Python's recursion limit):
    evict removes it (it used to die of RecursionError with a traceback), and gc removes a
    trash entry as deep (it used to be wedged on it for good)."""
    dest = deep_tmp / "dest"
    for name in ("ds", "other"):
        r = cli(shmstage_bin, "stage", str(make_src(deep_tmp / name)), "--dest", str(dest), "-q")
        assert r.returncode == 0, r.stderr
    deep_chain(dest / "ds", 1200)
    r = cli(shmstage_bin, "evict", "ds", "--dest", str(dest))
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert not (dest / "ds").exists()
    junk = dest / ".shmstage" / "trash" / "other.1-1.1"  # pid 1 started at 1: dead
    junk.mkdir()
    deep_chain(junk, 1200)
    r = cli(shmstage_bin, "gc", "--dest", str(dest))
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert list((dest / ".shmstage" / "trash").iterdir()) == []
    assert (dest / "other").is_dir()


def test_a_tree_deeper_than_the_open_file_limit_is_refused_in_one_line(shmstage_bin, deep_tmp):
    """Removing holds a directory fd per level (never a path): deeper than the hard limit
    on open files allows, evict says so in one line, exit 1, and the dataset stays listed."""
    dest = deep_tmp / "dest"
    r = cli(shmstage_bin, "stage", str(make_src(deep_tmp / "ds")), "--dest", str(dest), "-q")
    assert r.returncode == 0, r.stderr
    deep_chain(dest / "ds", 300)

    def low_limit() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))

    r = subprocess.run(
        [*shmstage_bin, "evict", "ds", "--dest", str(dest)],
        capture_output=True, text=True, timeout=120, preexec_fn=low_limit,
    )  # fmt: skip
    assert r.returncode == 1, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "raise the open-file limit (ulimit -n), then run gc" in r.stderr, r.stderr
    r = cli(shmstage_bin, "gc", "--dest", str(dest))
    assert r.returncode == 0, r.stderr
    assert not (dest / "ds").exists()


@pytest.mark.root
@pytest.mark.root
def test_evict_without_dac_override_leaves_a_mounted_private_directory_as_it_was(
    shmstage_bin, tmp_path, tmpfs
):
    """Root without CAP_DAC_OVERRIDE/DAC_READ_SEARCH evicts a dataset with another user's
    0700 directory bind-mounted inside: the mount's owner and mode stay (removal used to take
    it over, chown and chmod 0700, before noticing it was another file system)."""
    dest = tmpfs("16M", name="tier") / "shmstage"
    r = cli(shmstage_bin, "stage", str(make_src(tmp_path / "ds")), "--dest", str(dest), "-q")
    assert r.returncode == 0, r.stderr
    private = tmp_path / "private"
    private.mkdir()
    (private / "keep").write_text("keep")
    os.chown(private, 4242, 4242)
    os.chmod(private, 0o700)
    target = dest / "ds" / "a"
    subprocess.run(["mount", "--bind", str(private), str(target)], check=True)
    caps = "-dac_override,-dac_read_search"
    try:
        r = subprocess.run(
            ["setpriv", f"--inh-caps={caps}", f"--bounding-set={caps}",
             *shmstage_bin, "evict", "ds", "--dest", str(dest)],
            capture_output=True, text=True,
        )  # fmt: skip
        assert r.returncode == 1, r.stderr
        assert "is a mount point inside the dataset" in r.stderr, r.stderr
        st = os.stat(private)
        assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (4242, 4242, 0o700)
        assert (private / "keep").read_text() == "keep"
    finally:
        for line in reversed(Path("/proc/self/mounts").read_text().splitlines()):
            point = line.split()[1]
            if point.startswith(str(dest)) and point != str(dest.parent):
                subprocess.run(["umount", point], check=False, capture_output=True)


def test_evict_never_descends_into_a_mount_inside_the_dataset(shmstage_bin, tmp_path, tmpfs):
    """A file system mounted on a directory of a staged dataset: evict refuses in one line
    naming the mount point and removes nothing of the mounted file system (it used to empty
    it, then fail with "run this again"); once unmounted, gc removes the rest."""
    dest = tmpfs("16M", name="tier") / "shmstage"
    r = cli(shmstage_bin, "stage", str(make_src(tmp_path / "ds")), "--dest", str(dest), "-q")
    assert r.returncode == 0, r.stderr
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "keep").write_text("keep")
    subprocess.run(["mount", "--bind", str(precious), str(dest / "ds" / "a")], check=True)
    try:
        r = cli(shmstage_bin, "evict", "ds", "--dest", str(dest))
        assert r.returncode == 1, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert "/a is a mount point inside the dataset: unmount it, then run gc" in r.stderr
        assert (precious / "keep").read_text() == "keep"
        mounted = r.stderr.split(": ")[2].removesuffix(" is a mount point inside the dataset")
    finally:
        with contextlib.suppress(Exception):
            subprocess.run(["umount", mounted], check=True)
        subprocess.run(["umount", str(dest / "ds" / "a")], check=False, capture_output=True)
    r = cli(shmstage_bin, "gc", "--dest", str(dest))
    assert r.returncode == 0, r.stderr
    assert trees(dest) == set() and (precious / "keep").read_text() == "keep"


def test_gc_lines_write_out_escape_sequences_in_paths(capsys):
    """A leftover's path is a name anyone with write access to the store chose: gc's plain
    lines show an escape sequence in it as text, never send it to the terminal."""
    from shmstage.cli.staged_cmd import _render_gc
    from shmstage.stage.store.gc import GcReport, Leftover

    evil = "/d/.shmstage/partial/x\x1b]0;pwned\x07y"
    _render_gc(
        GcReport(
            "/d",
            True,
            (Leftover(evil, "partial tree", 10),),
            (Leftover(evil + "2", "lock", 0, "held by pid 1\x1b[2J"),),
        )
    )
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out, out
    assert "would remove partial tree: /d/.shmstage/partial/x" in out
