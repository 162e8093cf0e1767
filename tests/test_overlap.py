"""``run --no-wait`` (issue 23 items 1-2): the job reads a dataset while it is copied, through
the live view (tests/overlap_job.py speaks the protocol from the contract alone); demanded
files are copied first; a killed stager or a changed source never publishes or mixes."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shmstage.stage.store.views import read_view

JOB = str(Path(__file__).with_name("overlap_job.py"))
SLOW = "SHMSTAGE_TEST_SLOW_COPY"


def _tree(root: Path, files: int, size: int = 3000) -> dict[str, str]:
    """A source of ``files`` files in a few directories; {rel: sha256}."""
    sums = {}
    for i in range(files):
        rel = f"d{i % 4}/f{i:04d}.bin"
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        data = os.urandom(size + i)
        path.write_bytes(data)
        sums[rel] = hashlib.sha256(data).hexdigest()
    return sums


def _env(slow: float) -> dict[str, str]:
    return {**os.environ, SLOW: str(slow)}


def _run(shmstage_bin, dest, src, job_args, slow, **kw):
    argv = [*shmstage_bin, "run", "--no-wait", "--no-service", "--dest", str(dest)]
    argv += ["--stage", str(src), "--", sys.executable, JOB, str(dest), src.name, *job_args]
    return subprocess.run(argv, env=_env(slow), capture_output=True, text=True, timeout=120, **kw)


def _wait(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_job_reads_every_file_right_while_the_copy_runs(tmpfs, tmp_path, shmstage_bin):
    """The job starts before the copy ends, reads each file once (demanding the ones not
    landed), gets the source's bytes, and the copy is then published with the view gone."""
    src = tmp_path / "ds"
    sums = _tree(src, 120)
    dest = tmpfs("64M")
    out = tmp_path / "out.json"
    p = _run(shmstage_bin, dest, src, [str(out)], 0.05)
    assert p.returncode == 0, p.stderr
    got = json.loads(out.read_text())
    assert got["sums"] == sums
    assert got["how"]["demanded"] > 0  # it did not wait for the whole copy
    assert got["how"]["source"] == 0  # and never read the source itself
    assert "the job starts now" in p.stderr
    assert read_view(dest, "ds") is None
    for rel, digest in sums.items():
        assert hashlib.sha256((dest / "ds" / rel).read_bytes()).hexdigest() == digest
    assert not [e for e in os.listdir(dest / ".shmstage" / "views") if not e.startswith(".")]
    assert not [e for e in os.listdir(dest / ".shmstage" / "views") if e.endswith(".sock")]


def test_a_demanded_file_lands_before_files_queued_earlier(tmpfs, tmp_path, shmstage_bin):
    """The last file in listing order, asked for first, lands behind only what the workers
    already had (a task each and QUEUED more, of BATCH_FILES files), not behind the rest."""
    from shmstage.stage.build import copier, ondemand

    src = tmp_path / "ds"
    _tree(src, 300, 500)
    dest = tmpfs("64M")
    out = tmp_path / "out.json"
    last = sorted(f"d{i % 4}/f{i:04d}.bin" for i in range(300))[-1]
    p = _run(shmstage_bin, dest, src, [str(out), "--first", last], 0.1)
    assert p.returncode == 0, p.stderr
    got = json.loads(out.read_text())
    ahead = (copier.default_workers() + ondemand.QUEUED + 1) * ondemand.BATCH_FILES
    assert got["before"] is not None and got["before"] + ahead < got["total"] - 1, got
    assert got["position"] - got["before"] <= ahead, got


def test_a_killed_stager_publishes_nothing_and_its_view_reads_dead(
    tmpfs, tmp_path, shmstage_bin, procs
):
    """SIGKILL the stager mid-copy: no copy is published, the view stays and says its stager
    is dead, run says so in one line (the job goes on); the next stage resumes and cleans."""
    src = tmp_path / "ds"
    sums = _tree(src, 200, 500)
    dest = tmpfs("64M")
    argv = [*shmstage_bin, "run", "--no-wait", "--no-service", "--dest", str(dest)]
    argv += ["--stage", str(src), "--", "sleep", "2"]
    run = procs.start(argv, env=_env(0.2), stderr=subprocess.PIPE, text=True)
    _wait(lambda: read_view(dest, "ds") is not None)
    view = read_view(dest, "ds")
    assert view.alive()
    os.kill(view.pid, signal.SIGKILL)
    _wait(lambda: not view.alive())
    _, err = run.communicate(timeout=60)
    assert run.returncode == 1, err  # the job succeeded, the copy did not
    assert err.count("exited before the copy was published") == 1, err
    assert "Traceback" not in err
    assert not (dest / "ds").exists()
    dead = read_view(dest, "ds")
    assert dead is not None and not dead.alive()
    assert os.path.exists(dead.socket)  # a killed stager's socket stays, until the view goes
    p = subprocess.run(
        [*shmstage_bin, "stage", "--no-service", "--dest", str(dest), str(src)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    assert read_view(dest, "ds") is None and not os.path.exists(dead.socket)
    for rel, digest in sums.items():
        assert hashlib.sha256((dest / "ds" / rel).read_bytes()).hexdigest() == digest


def test_a_source_file_rewritten_during_the_copy_is_refused_never_mixed(
    tmpfs, tmp_path, shmstage_bin
):
    """A file rewritten after the listing: the job's demand for it is refused (it fails in
    its own way), the stage fails in one line, and nothing is published."""
    src = tmp_path / "ds"
    _tree(src, 200, 500)
    dest = tmpfs("64M")
    out, go = tmp_path / "out.json", tmp_path / "go"
    victim = "d3/f0199.bin"
    argv = [*shmstage_bin, "run", "--no-wait", "--no-service", "--dest", str(dest)]
    argv += ["--stage", str(src), "--", sys.executable, JOB, str(dest), "ds", str(out)]
    argv += ["--first", victim, "--go", str(go)]
    p = subprocess.Popen(argv, env=_env(0.05), stderr=subprocess.PIPE, text=True)
    try:
        _wait(lambda: read_view(dest, "ds") is not None)
        (src / victim).write_bytes(b"new bytes, another size")
        go.touch()
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 3, err  # the job's own status: its read was refused
    assert f"refused {victim}" in err
    assert "changed during the copy" in err and "Traceback" not in err
    assert not (dest / "ds").exists()


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux)")
def test_another_user_reads_the_live_copy_only_where_they_may_read_it(
    open_tmpfs, open_tmp_path, shmstage_bin, procs
):
    """Root stages, nobody's job reads: a world-readable source's files come from RAM (the
    in-flight tree and the view let them in); a source they may not read: the view is shut."""
    nobody = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
    nobody += ["--inh-caps=-dac_override", "--bounding-set=-dac_override"]
    dest = open_tmpfs("64M")
    (open_tmp_path / "out").mkdir(mode=0o777)
    (open_tmp_path / "out").chmod(0o777)
    for name, mode in (("open", 0o755), ("shut", 0o700)):
        src = open_tmp_path / name
        sums = _tree(src, 60, 500)
        src.chmod(mode)
        out = open_tmp_path / "out" / f"{name}.json"
        argv = [*shmstage_bin, "run", "--no-wait", "--no-service", "--dest", str(dest)]
        argv += ["--stage", str(src), "--", *nobody, sys.executable, JOB, str(dest), name, str(out)]
        p = subprocess.run(argv, env=_env(0.05), capture_output=True, text=True, timeout=120)
        if mode == 0o755:
            assert p.returncode == 0, p.stderr
            got = json.loads(out.read_text())
            assert got["sums"] == sums and got["how"]["source"] == 0
            assert got["how"]["root"] > 0  # read from the in-flight tree, as nobody
        else:
            assert p.returncode != 0 and not out.exists(), p.stderr
            assert "PermissionError" in p.stderr or "no view" in p.stderr


def test_no_wait_on_a_current_copy_just_runs_and_on_a_tar_stages_first(
    tmpfs, tmp_path, shmstage_bin
):
    """Nothing to copy: the job runs on the published copy (no view). A tar archive cannot
    be read while it is copied: staged first, said in one line, then the job runs."""
    import tarfile

    src = tmp_path / "ds"
    _tree(src, 10)
    dest = tmpfs("64M")
    base = [*shmstage_bin, "run", "--no-wait", "--no-service", "--dest", str(dest)]
    first = subprocess.run(
        [*base, "--stage", str(src), "--", "true"], capture_output=True, text=True, timeout=60
    )
    assert first.returncode == 0, first.stderr
    probe = "import os,sys; sys.exit(os.path.exists(sys.argv[1] + '/.shmstage/views/ds'))"
    again = subprocess.run(
        [*base, "--stage", str(src), "--", sys.executable, "-c", probe, str(dest)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert again.returncode == 0 and "the job starts now" not in again.stderr, again.stderr
    archive = tmp_path / "t.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add(src, arcname=".")
    p = subprocess.run(
        [*base, "--stage", str(archive), "--", "test", "-d", "{staged}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, p.stderr
    said = [line for line in p.stderr.splitlines() if "--no-wait" in line]
    assert said == [
        f"shmstage: --no-wait: staging {archive} before the job starts: it is a tar archive, "
        "and only a directory is read while it is copied"
    ]


def test_a_second_no_wait_run_starts_at_once_on_the_live_copy(tmpfs, tmp_path, shmstage_bin, procs):
    """While one run's stager copies, another ``run --no-wait`` of the same source does not
    wait for the lock: its job reads the same live copy right away."""
    src = tmp_path / "ds"
    sums = _tree(src, 200, 500)
    dest = tmpfs("64M")
    base = [
        *shmstage_bin,
        "run",
        "--no-wait",
        "--no-service",
        "--dest",
        str(dest),
        "--stage",
        str(src),
    ]
    # slow enough that the copy is still under way once the second run (a Python start on a
    # loaded machine) looks for it
    first = procs.start([*base, "--", "sleep", "30"], env=_env(0.25), stderr=subprocess.DEVNULL)
    _wait(lambda: read_view(dest, "ds") is not None)
    out = tmp_path / "out.json"
    p = subprocess.run(
        [*base, "--", sys.executable, JOB, str(dest), "ds", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    assert "being copied by another shmstage" in p.stderr
    got = json.loads(out.read_text())
    assert got["sums"] == sums and got["how"]["demanded"] > 0 and got["how"]["source"] == 0
    first.kill()


def _cold(root: Path) -> None:
    """Drop the source's pages from the page cache (its own files only), so every read of
    it reaches the disk and is counted by the blkio group."""
    os.sync()
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


@pytest.mark.root
def test_a_throttled_source_is_read_once_while_the_job_reads_everything(
    tmpfs, tmp_path, shmstage_bin
):
    """Behind a blkio throttle, a job reading every file during the copy: the disk under the
    source reads at most 1.02x the dataset's blocks (no file read twice), all of it counted."""
    from shmstage.bench.throttle import RefusedError, blkio_throttle

    src = tmp_path / "ds"
    sums = _tree(src, 160, 100_000)
    # what the disk reads: whole blocks (a file of 100,001 bytes costs 25 blocks of 4 KiB)
    total = sum(-(-(src / rel).stat().st_size // 4096) * 4096 for rel in sums)
    dest = tmpfs("64M")
    out = tmp_path / "out.json"
    # The blkio group counts every read of the disk, the code's too: after another test
    # dropped the page cache, shmstage's and the job's imports would be counted as source
    # reads.  The same run on a tiny tree first, unthrottled, brings them back into memory.
    warm = tmp_path / "warm"
    _tree(warm, 2, 1000)
    argv = [*shmstage_bin, "run", "--no-wait", "--no-service", "--dest", str(dest)]
    argv += ["--stage", str(warm), "--", sys.executable, "-c", "import hashlib, json, socket"]
    subprocess.run(argv, capture_output=True, timeout=120, check=True)
    _cold(src)
    try:
        throttle = blkio_throttle(src, 40 << 20, name="shmstage-test-overlap")
        t = throttle.__enter__()
    except RefusedError as e:
        pytest.skip(str(e))
    try:
        argv = [*shmstage_bin, "run", "--no-wait", "--no-service", "--dest", str(dest)]
        argv += ["--stage", str(src), "--", sys.executable, JOB, str(dest), "ds", str(out)]
        p = subprocess.run(argv, capture_output=True, text=True, timeout=120, preexec_fn=t.enter)
        stats = (t.cgroup / "blkio.throttle.io_service_bytes").read_text() if t.version == 1 else ""
        if t.version == 2:
            stats = (t.cgroup / "io.stat").read_text()
    finally:
        throttle.__exit__(None, None, None)
    assert p.returncode == 0, p.stderr
    got = json.loads(out.read_text())
    assert got["sums"] == sums and got["how"]["source"] == 0 and got["how"]["demanded"] > 0
    read = 0
    for line in stats.splitlines():
        fields = line.split()
        if t.version == 1 and len(fields) == 3 and fields[0] == t.device and fields[1] == "Read":
            read = int(fields[2])
        if t.version == 2 and fields and fields[0] == t.device:
            read = int(dict(f.split("=") for f in fields[1:])["rbytes"])
    assert 0.95 * total <= read <= 1.02 * total, (read, total)


def test_sigterm_to_run_reaches_the_job_and_stops_the_copy(tmpfs, tmp_path, shmstage_bin, procs):
    """SIGTERM to ``run`` mid-copy: the job gets it, the copy stops, nothing is published,
    no stager or copy worker is left, and run dies of SIGTERM."""
    src = tmp_path / "ds"
    _tree(src, 200, 500)
    dest = tmpfs("64M")
    argv = [*shmstage_bin, "run", "--no-wait", "--no-service", "--dest", str(dest)]
    started = tmp_path / "started"
    argv += ["--stage", str(src), "--", "sh", "-c", f"touch {started}; exec sleep 60"]
    run = procs.start(argv, env=_env(0.2), stderr=subprocess.PIPE, text=True)
    _wait(started.exists)
    stager = read_view(dest, "ds").pid
    run.send_signal(signal.SIGTERM)
    _, err = run.communicate(timeout=60)
    assert run.returncode == -signal.SIGTERM, err
    assert "Traceback" not in err and "goes on reading" not in err
    assert not (dest / "ds").exists()
    assert not os.path.exists(f"/proc/{stager}")
    assert read_view(dest, "ds") is None or not read_view(dest, "ds").alive()


def test_hard_links_and_odd_names_are_read_during_the_copy(tmpfs, tmp_path, shmstage_bin):
    """A hard link inside the tree is served once its file lands (both names, same inode in
    the copy), and names with a tab, a newline or a percent sign go through the view."""
    src = tmp_path / "ds"
    sums = _tree(src, 80, 500)
    os.link(src / "d1/f0001.bin", src / "d2/link.bin")
    sums["d2/link.bin"] = sums["d1/f0001.bin"]
    for odd in ("tab\there", "new\nline", "100%"):
        (src / odd).write_bytes(odd.encode())
        sums[odd] = hashlib.sha256(odd.encode()).hexdigest()
    dest = tmpfs("64M")
    out = tmp_path / "out.json"
    p = _run(shmstage_bin, dest, src, [str(out), "--first", "d2/link.bin"], 0.05)
    assert p.returncode == 0, p.stderr
    got = json.loads(out.read_text())
    assert got["sums"] == sums and got["how"]["source"] == 0
    a, b = (dest / "ds/d1/f0001.bin").stat(), (dest / "ds/d2/link.bin").stat()
    assert (a.st_ino, a.st_nlink) == (b.st_ino, 2)


def test_cleanup_stops_an_unfinished_copy_and_says_nothing_of_it(tmpfs, tmp_path, shmstage_bin):
    """--cleanup: a job that exits before the copy ends leaves nothing staged, and run exits
    with the job's status, without a failure or a "not evicting" line."""
    src = tmp_path / "ds"
    _tree(src, 200, 500)
    dest = tmpfs("64M")
    argv = [*shmstage_bin, "run", "--no-wait", "--cleanup", "--no-service", "--dest", str(dest)]
    p = subprocess.run(
        [*argv, "--stage", str(src), "--", "true"],
        env=_env(0.2),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, p.stderr
    assert p.stderr.splitlines() == [
        f"shmstage: --no-wait: the job starts now; {src} is copied to {dest / 'ds'} while it runs"
    ]
    assert not (dest / "ds").exists()


WANT_JOB = """
import json, os, struct, sys
from shmstage.datasetfiles import DatasetFiles
dest, name, out, k = sys.argv[1:5]
files = DatasetFiles(os.path.join(dest, name))
log = os.path.join(dest, ".shmstage", "views", name, "landed")
def landed():
    with open(log, "rb") as f:
        data = f.read()
    return [i for (i,) in struct.iter_unpack("<I", data[: len(data) // 4 * 4])]
before = len(landed())
want = list(files.names[-int(k):])
files.want(want)
for n in want:
    files.read(n)
got = {"before": before, "order": landed(), "total": len(files)}
got["wanted"] = [files.names.index(n) for n in want]
json.dump(got, open(out, "w"))
"""


def test_hinted_files_land_before_any_bulk_work_handed_out_after_them(
    tmpfs, tmp_path, shmstage_bin
):
    """40 files hinted at once with ``want`` (pipelined: more than the workers and the queue
    hold), then read: behind the hint land only the bulk tasks the workers already had, then
    every hinted file (read one by one without the hint, bulk work lands between them)."""
    from shmstage.stage.build import copier, ondemand

    src = tmp_path / "ds"
    _tree(src, 400, 500)
    dest = tmpfs("64M")
    out = tmp_path / "out.json"
    argv = [*shmstage_bin, "run", "--no-wait", "--no-service", "--dest", str(dest)]
    argv += ["--stage", str(src), "--", sys.executable, "-c", WANT_JOB, str(dest), "ds"]
    p = subprocess.run(
        [*argv, str(out), "40"], env=_env(0.05), capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stderr
    got = json.loads(out.read_text())
    wanted = set(got["wanted"])
    order = got["order"][got["before"] :]
    last = max(order.index(i) for i in wanted)
    bulk = [i for i in order[: last + 1] if i not in wanted]
    in_hand = (copier.default_workers() + ondemand.QUEUED + 1) * ondemand.BATCH_FILES
    assert len(bulk) <= in_hand < got["total"] - got["before"] - len(wanted), got


def test_no_bulk_work_is_handed_out_while_a_demand_waits():
    """The feeding rule alone (pure logic, a stand-in copier): a task per worker and QUEUED
    more, of small batches; none at all while a demanded file is still being copied."""
    from collections import deque
    from types import SimpleNamespace

    from shmstage.stage.build import ondemand

    handed: list[list] = []

    class Stream:
        sent = 0
        results = SimpleNamespace(done=0)

        def add(self, jobs):
            handed.append(list(jobs))
            self.sent += 1
            return []

    copy = object.__new__(ondemand._Copy)
    server = SimpleNamespace(waiting={})
    jobs = [(f"s/{j}", f"d/{j}", 1000, 0, 0, 0, str(j)) for j in range(100)]
    copy.__dict__.update(
        stream=Stream(), live=SimpleNamespace(server=server), workers=8, jobs=jobs,
        todo=deque(range(100)), handed=bytearray(100), next_group=0, adding=-1, early=set(),
        groups={}, group_of={},
    )  # fmt: skip
    copy._feed()
    assert len(handed) == 8 + ondemand.QUEUED
    assert all(len(b) <= ondemand.BATCH_FILES for b in handed)
    copy.stream.results.done = len(handed)  # every task done, and a demand waits
    server.waiting[99] = ["a job"]
    copy._feed()
    assert len(handed) == 8 + ondemand.QUEUED
    del server.waiting[99]  # it landed: the bulk copy goes on
    copy._feed()
    assert len(handed) == 2 * (8 + ondemand.QUEUED)


def _top_mode(path: Path) -> int:
    return os.lstat(path).st_mode & 0o7777


@pytest.mark.parametrize("step", ["build", "manifest"])
def test_an_in_flight_tree_is_closed_to_others_at_every_kill_step(
    open_tmpfs, open_tmp_path, shmstage_bin, step
):
    """partial/ is 0711 (a live tree is entered by its readers): a plain stage's in-flight
    tree keeps its top 0700 until the publish, so a stager killed at any step (first copy
    or restage) leaves nothing others can read; the published copy gets the source's 0755."""
    src = open_tmp_path / "ds"
    _tree(src, 6)
    src.chmod(0o755)
    dest = open_tmpfs("16M")
    part = dest / ".shmstage" / "partial" / "ds"
    stage = [*shmstage_bin, "stage", "--no-service", "--dest", str(dest), str(src)]
    kill = {**os.environ, "SHMSTAGE_TEST_KILL_AT": step}
    r = subprocess.run(stage, env=kill, capture_output=True, text=True, timeout=120)
    assert r.returncode == -signal.SIGKILL, r.stderr
    assert _top_mode(part) & 0o077 == 0, oct(_top_mode(part))  # a first copy
    r = subprocess.run(stage, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert _top_mode(dest / "ds") == 0o755
    (src / "d0" / "f0000.bin").write_bytes(b"changed")
    r = subprocess.run(stage, env=kill, capture_output=True, text=True, timeout=120)
    assert r.returncode == -signal.SIGKILL, r.stderr
    assert _top_mode(part) & 0o077 == 0, oct(_top_mode(part))  # a restage
    r = subprocess.run(stage, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert _top_mode(dest / "ds") == 0o755
    assert (dest / "ds" / "d0" / "f0000.bin").read_bytes() == b"changed"


def test_a_live_tree_top_has_the_copy_access_never_more(open_tmpfs, tmp_path, shmstage_bin, procs):
    """A live tree is open to readers while in flight, but only as its copy will be: under
    root's 0700 tmp_path (others are denied the source) its top is 0700 from the view on,
    and stays so when the stager is killed."""
    src = tmp_path / "ds"
    _tree(src, 200, 500)
    src.chmod(0o755)
    dest = open_tmpfs("64M")
    argv = [*shmstage_bin, "run", "--no-wait", "--no-service", "--dest", str(dest)]
    argv += ["--stage", str(src), "--", "sleep", "1"]
    run = procs.start(argv, env=_env(0.2), stderr=subprocess.PIPE, text=True)
    _wait(lambda: read_view(dest, "ds") is not None)
    view = read_view(dest, "ds")
    assert _top_mode(Path(view.root)) & 0o077 == 0, oct(_top_mode(Path(view.root)))
    os.kill(view.pid, signal.SIGKILL)
    run.communicate(timeout=60)
    assert _top_mode(Path(view.root)) & 0o077 == 0, oct(_top_mode(Path(view.root)))


def test_sigterm_to_run_ends_it_while_its_stager_is_stopped(tmpfs, tmp_path, shmstage_bin, procs):
    """A SIGSTOPped stager does not hold run: SIGTERM to run stops the job, then the stager
    (SIGCONT + SIGTERM, SIGKILL after a grace), and run dies of SIGTERM."""
    src = tmp_path / "ds"
    _tree(src, 200, 500)
    dest = tmpfs("64M")
    started = tmp_path / "started"
    argv = [*shmstage_bin, "run", "--no-wait", "--no-service", "--dest", str(dest)]
    argv += ["--stage", str(src), "--", "sh", "-c", f"touch {started}; exec sleep 60"]
    run = procs.start(argv, env=_env(0.2), stderr=subprocess.PIPE, text=True)
    _wait(started.exists)
    stager = read_view(dest, "ds").pid
    os.kill(stager, signal.SIGSTOP)
    try:
        run.send_signal(signal.SIGTERM)
        _, err = run.communicate(timeout=90)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(stager, signal.SIGCONT)
    assert run.returncode == -signal.SIGTERM, err
    assert "Traceback" not in err
    assert not os.path.exists(f"/proc/{stager}")
    assert not (dest / "ds").exists()


@pytest.mark.parametrize("step", ["exchange", "final"])
def test_a_stager_killed_after_its_publish_is_no_failure(tmpfs, tmp_path, shmstage_bin, step):
    """Killed after the rename, before the view is removed: the copy is published and is
    this stager's tree, so run says no failure, exits with the job's status, and removes the
    dead view (later readers read the copy, not the source)."""
    src = tmp_path / "ds"
    sums = _tree(src, 40, 500)
    dest = tmpfs("64M")
    argv = [*shmstage_bin, "run", "--no-wait", "--no-service", "--dest", str(dest)]
    argv += ["--stage", str(src), "--", "sleep", "0.5"]
    env = {**_env(0.02), "SHMSTAGE_TEST_KILL_AT": step}
    p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "exited before" not in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert read_view(dest, "ds") is None
    for rel, digest in sums.items():
        assert hashlib.sha256((dest / "ds" / rel).read_bytes()).hexdigest() == digest


def test_a_joined_run_whose_copy_stopped_unpublished_says_so_and_fails(
    tmpfs, tmp_path, shmstage_bin, procs
):
    """Run B joins run A's live copy; A is stopped before the publish: B's job succeeds on
    the source, and B says in one line that the copy was not published, exiting 1."""
    src = tmp_path / "ds"
    _tree(src, 200, 500)
    dest = tmpfs("64M")
    base = [*shmstage_bin, "run", "--no-wait", "--no-service", "--dest", str(dest)]
    base += ["--stage", str(src), "--"]
    first = procs.start([*base, "sleep", "30"], env=_env(0.25), stderr=subprocess.DEVNULL)
    _wait(lambda: read_view(dest, "ds") is not None)
    started, stopped = tmp_path / "started", tmp_path / "stopped"
    job = f"touch {started}; while [ ! -e {stopped} ]; do sleep 0.05; done; sleep 1"
    second = procs.start([*base, "sh", "-c", job], stderr=subprocess.PIPE, text=True)
    _wait(started.exists)
    first.send_signal(signal.SIGTERM)
    first.wait(timeout=60)
    stopped.touch()
    _, err = second.communicate(timeout=60)
    assert "being copied by another shmstage" in err
    assert second.returncode == 1, err
    assert err.count("stopped before the copy was published") == 1, err
    assert not (dest / "ds").exists()


class _Counted:
    """A real socket that counts the calls made on it (which, not their effect, is asserted)."""

    def __init__(self, sock):
        self.sock, self.calls = sock, []

    def __getattr__(self, name):
        attr = getattr(self.sock, name)
        if callable(attr):
            self.calls.append(name)
        return attr


def _flooded(tmp_path, requests: int):
    """A demand server with one landed file and a client that sent ``requests`` requests for
    it and reads nothing; the server's end of that client is wrapped in _Counted."""
    import socket
    import struct

    from shmstage.stage.build.demand import DemandServer

    server = DemandServer(str(tmp_path / "d.sock"), 2)
    server.landed[0] = 1
    job = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    job.connect(server.path)
    server.handle([server.sock.fileno()])
    (fd,) = server.clients
    counted = _Counted(server.clients[fd].sock)
    server.clients[fd].sock = counted
    job.setblocking(False)
    payload = struct.pack("<I", 0) * requests
    while payload:
        try:
            payload = payload[job.send(payload) :]
        except BlockingIOError:
            pass
        except OSError:  # dropped by the server
            break
        server.handle([fd] if fd in server.clients else [])
    return server, job, fd, counted


def test_a_demand_client_that_reads_nothing_costs_a_send_per_buffer_and_is_dropped(tmp_path):
    """200k answers queued for a job that reads none: appended in place, sent only when the
    socket can take them (not one send per answer), and the client is dropped past the
    bound per connection, its buffer never growing beyond it."""
    from shmstage.stage.build.demand import MAX_UNSENT

    server, job, fd, counted = _flooded(tmp_path, 200_000)
    assert fd not in server.clients  # dropped: more than MAX_UNSENT left unread
    assert not server.waiting
    assert counted.calls.count("send") < 1000, counted.calls.count("send")
    assert server.clients == {} and MAX_UNSENT < 200_000 * 8
    job.close()
    server.close()


def test_publish_never_waits_for_a_demand_client_that_reads_nothing(tmp_path):
    """At the publish, each connection gets what fits in its socket without blocking (no
    blocking sendall with a timeout per client: 40 such clients held a publish 40 s)."""
    server, job, fd, counted = _flooded(tmp_path, 20_000)
    assert fd in server.clients  # its socket is full, answers wait unsent
    server.publish()
    assert not {"sendall", "setblocking", "settimeout"} & set(counted.calls), counted.calls
    assert not server.clients
    job.close()


def test_a_second_run_does_not_join_a_live_copy_of_a_source_changed_since(
    tmpfs, tmp_path, shmstage_bin, procs
):
    """A file changed at the source after the view was listed: a second ``run --no-wait``
    does not join that copy (its own walk disagrees with the view); it waits for the lock and
    restages, so its job and the published copy have the new bytes."""
    src = tmp_path / "ds"
    _tree(src, 200, 500)
    dest = tmpfs("64M")
    base = [*shmstage_bin, "run", "--no-wait", "--no-service", "--dest", str(dest)]
    base += ["--stage", str(src), "--"]
    first = procs.start([*base, "sleep", "0.5"], env=_env(0.05), stderr=subprocess.DEVNULL)
    _wait(lambda: read_view(dest, "ds") is not None)
    view = read_view(dest, "ds")
    index = view.files().names.index("d0/f0000.bin")
    _wait(lambda: index in view.landed_since()[0])  # copied already: its copy is now stale
    changed = src / "d0" / "f0000.bin"
    changed.write_bytes(b"new bytes")
    os.utime(changed, ns=(1, 1))  # whatever the clock's granularity
    out = tmp_path / "out.json"
    p = subprocess.run(
        [*base, sys.executable, JOB, str(dest), "ds", str(out)],
        # its own copy (of the one changed file, once the first run published) still runs
        # when its job starts: a second per copied file, not a race with the job's start
        env=_env(1.0),
        capture_output=True,
        text=True,
        timeout=120,
    )
    first.wait(timeout=60)
    assert p.returncode == 0, p.stderr
    assert "being copied by another shmstage" not in p.stderr
    got = json.loads(out.read_text())
    assert got["sums"]["d0/f0000.bin"] == hashlib.sha256(b"new bytes").hexdigest()
    assert (dest / "ds" / "d0" / "f0000.bin").read_bytes() == b"new bytes"
