"""Leases: a running job's staged dataset cannot be evicted from under it (issue 11, item 3).

Real processes throughout: a `shmstage run` job, plain python holders, real SIGKILL."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from shmstage.stage import find, holders, stage
from shmstage.stage.store.leases import command_of

HINT = "wait for the job to finish or pass --force (the job will fail reading files that are gone)"


def make_src(root: Path, files: int = 4) -> Path:
    for c in ("a", "b"):
        (root / c).mkdir(parents=True, exist_ok=True)
        for i in range(files):
            (root / c / f"{i}.bin").write_bytes(os.urandom(500 + i))
    return root


def wait_for(cond, what: str, proc: subprocess.Popen | None = None, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process exited ({proc.returncode}) before {what}")
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()


def cli(shmstage_bin, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*shmstage_bin, *args], capture_output=True, text=True, timeout=120)


HOLDER = textwrap.dedent(
    """
    import sys, time, shmstage
    with shmstage.lease(sys.argv[1], dest=sys.argv[2] if len(sys.argv) > 2 else None) as ds:
        print(ds.path, flush=True)
        time.sleep(300)
    """
)


def start_holder(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", HOLDER, *args], stdout=subprocess.PIPE, text=True
    )


def test_run_job_holds_lease_evict_refuses_until_force(shmstage_bin, tmp_path):
    """While `run --stage SRC -- sleep` runs, evict NAME refuses naming run's pid and command
    (exit 2), --all / --older-than skip it with a note (exit 0), --force removes it."""
    src, dest = make_src(tmp_path / "imagenet"), tmp_path / "dest"
    job = subprocess.Popen(
        [*shmstage_bin, "run", "--stage", str(src), "--dest", str(dest), "--", "sleep", "60"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        held = wait_for(lambda: holders("imagenet", dest), "the run's lease", job)
        assert [h.pid for h in held] == [job.pid]
        r = cli(shmstage_bin, "evict", "imagenet", "--dest", str(dest))
        assert r.returncode == 2 and r.stdout == ""
        assert r.stderr == (
            f"Error: imagenet is in use by pid {job.pid} ({command_of(job.pid)}); {HINT}\n"
        )
        assert "run --stage" in command_of(job.pid)
        for selector in (["--all"], ["--older-than", "0s"]):
            r = cli(shmstage_bin, "evict", *selector, "--dest", str(dest), "--json")
            assert r.returncode == 0, r.stderr
            report = json.loads(r.stdout)
            assert report["evicted"] == []
            assert [(u["name"], u["holders"][0]["pid"]) for u in report["in_use"]] == [
                ("imagenet", job.pid)
            ]
            assert f"note: imagenet is in use by pid {job.pid}" in r.stderr
        assert find("imagenet", dest=dest) is not None and (dest / "imagenet" / "a").is_dir()
        listed = json.loads(cli(shmstage_bin, "list", "--dest", str(dest), "--json").stdout)
        assert listed[0]["leased_by"] == [job.pid]
        r = cli(shmstage_bin, "evict", "imagenet", "--dest", str(dest), "--force")
        assert r.returncode == 0 and r.stdout == "evicted: imagenet\n"
        assert f"warning: evicted imagenet while in use by pid {job.pid}" in r.stderr
        assert not (dest / "imagenet").exists()
        assert job.poll() is None  # the job itself is not touched
    finally:
        kill(job)


def test_lease_dies_with_its_holder(shmstage_bin, tmp_path):
    """A shmstage.lease() holder killed by SIGKILL leaves no lease behind: evict then works."""
    src, dest = make_src(tmp_path / "ds"), tmp_path / "dest"
    ds = stage(src, dest=dest)
    holder = start_holder(ds.path)
    try:
        assert holder.stdout.readline().strip() == ds.path
        r = cli(shmstage_bin, "evict", "ds", "--dest", str(dest))
        assert r.returncode == 2 and f"in use by pid {holder.pid} (" in r.stderr
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=30)
        assert holders("ds", dest) == ()
        r = cli(shmstage_bin, "evict", "ds", "--dest", str(dest))
        assert r.returncode == 0 and r.stdout == "evicted: ds\n", r.stderr
    finally:
        kill(holder)


def test_lease_by_name_and_source_and_refuses_unstaged(tmp_path):
    """lease() takes a name, a source or a path inside the copy; an unstaged one is an error."""
    import shmstage
    from shmstage.errors import ShmstageError

    src, dest = make_src(tmp_path / "ds"), tmp_path / "dest"
    ds = stage(src, dest=dest)
    for key in ("ds", str(src), ds.path + "/a"):
        with shmstage.lease(key, dest=dest) as got:
            assert got.path == ds.path and [h.pid for h in holders("ds", dest)] == [os.getpid()]
        assert holders("ds", dest) == ()
    with (
        pytest.raises(ShmstageError, match="nope is not staged in"),
        shmstage.lease("nope", dest=dest),
    ):
        pass


LOADER_JOB = textwrap.dedent(
    """
    import sys, time
    from shmstage.loader import make_loader, staged_path

    class Folder:  # what torchvision's ImageFolder looks like to make_loader
        def __init__(self, root):
            self.root = root
        def __len__(self):
            return 1
        def __getitem__(self, i):
            return 0

    mode, where = sys.argv[1], sys.argv[2]
    if mode == "make_loader":
        loader = make_loader(Folder(where), batch_size=1, num_workers=0)
    else:
        path = staged_path(where)
    print("ready", flush=True)
    time.sleep(300)
    """
)


@pytest.mark.parametrize("mode", ["make_loader", "staged_path"])
def test_plain_python_job_leases_through_loader(shmstage_bin, tmp_path, mode):
    """A job started by plain python (no shmstage run) is protected by make_loader over a
    dataset rooted in the staged copy, or by staged_path(); the lease ends with the process."""
    src, dest = make_src(tmp_path / "ds"), tmp_path / "dest"
    ds = stage(src, dest=dest)
    where = os.path.join(ds.path, "a") if mode == "make_loader" else str(src)
    job = subprocess.Popen(
        [sys.executable, "-c", LOADER_JOB, mode, where],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "SHMSTAGE_DEST": str(dest)},
    )
    try:
        assert job.stdout.readline().strip() == "ready"
        r = cli(shmstage_bin, "evict", "ds", "--dest", str(dest))
        assert r.returncode == 2 and f"Error: ds is in use by pid {job.pid} (" in r.stderr
        job.terminate()
        job.wait(timeout=30)
        r = cli(shmstage_bin, "evict", "ds", "--dest", str(dest))
        assert r.returncode == 0, r.stderr
    finally:
        kill(job)


def test_cleanup_keeps_a_dataset_another_job_leases(shmstage_bin, tmp_path):
    """run --cleanup does not evict what it copied while another job leases it; it says so."""
    src, dest = make_src(tmp_path / "ds"), tmp_path / "dest"
    flag = tmp_path / "other-job-has-it"
    other = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                """
                import sys, time, pathlib, shmstage
                from shmstage.errors import ShmstageError
                while True:  # wait for the run below to stage it
                    try:
                        held = shmstage.lease("ds", dest=sys.argv[1])
                        held.__enter__()
                        break
                    except ShmstageError:
                        time.sleep(0.05)
                pathlib.Path(sys.argv[2]).touch()
                time.sleep(300)
                """
            ),
            str(dest),
            str(flag),
        ],
    )
    try:
        r = subprocess.run(
            [*shmstage_bin, "run", "--stage", str(src), "--dest", str(dest), "--cleanup",
             "--", "sh", "-c", f"until [ -e {flag} ]; do sleep 0.05; done"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        assert f"not evicting ds: in use by pid {other.pid}" in r.stderr
        assert find("ds", dest=dest) is not None
    finally:
        kill(other)


def test_prepare_does_not_refresh_a_leased_dataset(tmp_path):
    """prepare leaves a changed dataset that a job leases as it is (skipped, with the holder)."""
    from shmstage.config import DatasetConfig, NodeConfig
    from shmstage.prepare import SKIPPED, _stage

    src, dest = make_src(tmp_path / "ds"), tmp_path / "dest"
    ds = stage(src, dest=dest)
    (src / "a" / "new.bin").write_bytes(b"x")
    config = NodeConfig(path=None, dest=str(dest), reserve=0)
    dataset = DatasetConfig(source=str(src), name="ds")
    holder = start_holder(ds.path)
    try:
        assert holder.stdout.readline().strip() == ds.path
        status, detail = _stage(config, dataset, dry_run=False)
        assert status == SKIPPED and f"in use by pid {holder.pid}" in detail
        assert not (dest / "ds" / "a" / "new.bin").exists()
    finally:
        kill(holder)


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux)")
@pytest.mark.root
def test_reader_who_cannot_write_dest_can_lease(shmstage_bin):
    """A job running as nobody leases a dataset root staged (read-only access to DEST is
    enough); root's evict then refuses, naming that job."""
    base = Path(tempfile.mkdtemp(prefix="shmstage-lease-"))  # tmp_path is 0700: nobody can't enter
    try:
        base.chmod(0o755)
        src, dest = make_src(base / "ds"), base / "dest"
        ds = stage(src, dest=dest)
        drop = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
        holder = subprocess.Popen(
            [*drop, sys.executable, "-c", HOLDER, ds.path], stdout=subprocess.PIPE, text=True
        )
        try:
            assert holder.stdout.readline().strip() == ds.path
            r = cli(shmstage_bin, "evict", "ds", "--dest", str(dest))
            assert r.returncode == 2 and f"Error: ds is in use by pid {holder.pid} (" in r.stderr
        finally:
            kill(holder)
        assert cli(shmstage_bin, "evict", "ds", "--dest", str(dest)).returncode == 0
    finally:
        shutil.rmtree(base)


def test_evict_writes_a_holders_escape_sequences_escaped(shmstage_bin, tmp_path):
    """A lease holder names itself (its script's name: clear the line, move up, write the
    clipboard); evict's refusal shows those bytes escaped, never raw on the terminal."""
    src, dest = make_src(tmp_path / "ds"), tmp_path / "dest"
    ds = stage(src, dest=dest)
    evil = "\x1b[2K\x1b[1A\x1b]52;c;cm0gLXJmIH4K\x1b\\job.py"
    (tmp_path / evil).write_text(HOLDER)
    holder = subprocess.Popen(
        [sys.executable, str(tmp_path / evil), ds.path], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == ds.path
        r = cli(shmstage_bin, "evict", "ds", "--dest", str(dest))
        assert r.returncode == 2
        assert "\x1b" not in r.stderr
        assert f"in use by pid {holder.pid} (\\x1b[2K\\x1b[1A\\x1b]52;c;" in r.stderr
    finally:
        kill(holder)
