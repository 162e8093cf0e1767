"""Permissions of staged copies: read-only sources, non-root stagers, private source paths.

Real users through setpriv (nobody, and a numeric uid without a passwd entry), real tmpfs."""

from __future__ import annotations

import filecmp
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from shmstage.service.protocol import socket_path
from shmstage.stage.build import copier

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux)"),
]

NOBODY = 65534
ALICE = 4242  # no passwd entry: a numeric uid, like a cluster user the node does not know


def as_user(uid: int, gid: int | None = None) -> list[str]:
    return ["setpriv", f"--reuid={uid}", f"--regid={uid if gid is None else gid}", "--clear-groups"]


@pytest.fixture
def world(open_tmpfs):
    """A tmpfs every user can reach, room for a chunked file and its copy."""
    return open_tmpfs("600M")


def own(path: Path, uid: int) -> None:
    for p in [path, *path.rglob("*")]:
        os.lchown(p, uid, uid)


def read_only_tree(src: Path, big: bool = True) -> None:
    """A 0444 file above the copier's chunking threshold, small 0444 files, a 0555 directory."""
    (src / "ro").mkdir(parents=True)
    for i in range(20):
        (src / "ro" / f"s{i}").write_bytes(os.urandom(100 + i))
        (src / "ro" / f"s{i}").chmod(0o444)
    if big:
        with open(src / "big", "wb") as f:
            f.write(os.urandom(4096))
            f.truncate(2 * copier.CHUNK + 4096)  # split into chunks: several workers write it
            f.write(b"tail")
        (src / "big").chmod(0o444)
    (src / "ro").chmod(0o555)


def test_read_only_files_and_dirs_stage_as_non_root(world, shmstage_bin):
    """nobody stages a 0444 chunked file, 0444 small files and a 0555 dir; modes kept, verify clean."""
    src, dest = world / "src", world / "dest"
    read_only_tree(src)
    own(src, NOBODY)
    done = subprocess.run(
        [*as_user(NOBODY), *shmstage_bin, "stage", str(src), "--dest", str(dest)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    staged = dest / "src"
    assert (staged / "big").stat().st_mode & 0o7777 == 0o444
    assert filecmp.cmp(src / "big", staged / "big", shallow=False)
    assert (staged / "ro").stat().st_mode & 0o7777 == 0o555
    assert (staged / "ro" / "s3").stat().st_mode & 0o7777 == 0o444
    assert (staged / "ro" / "s3").read_bytes() == (src / "ro" / "s3").read_bytes()
    check = subprocess.run(
        [*as_user(NOBODY), *shmstage_bin, "verify", "src", "--dest", str(dest), "--checksum"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert check.returncode == 0, check.stdout + check.stderr


def test_unreadable_file_is_named_and_nothing_is_published(world, shmstage_bin):
    """A 0000 file stops a non-root stager with one line naming it; no partial copy is left."""
    src, dest = world / "src", world / "dest"
    read_only_tree(src, big=False)
    (src / "secret").write_bytes(b"x")
    (src / "secret").chmod(0)
    own(src, NOBODY)
    done = subprocess.run(
        [*as_user(NOBODY), *shmstage_bin, "stage", str(src), "--dest", str(dest)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1] == (
        f"Error: cannot read source file {src / 'secret'}: Permission denied; "
        "stage as a user who can read every file of the source"
    )
    assert not (dest / "src").exists()
    assert os.listdir(dest / ".shmstage" / "partial") == []


def test_resume_after_kill_with_read_only_files_in_the_partial_copy(world, shmstage_bin, procs):
    """SIGKILL a non-root stager once 0444 files sit in partial/; the next run completes."""
    src, dest = world / "src", world / "dest"
    read_only_tree(src)
    own(src, NOBODY)
    argv = [*as_user(NOBODY), *shmstage_bin, "stage", str(src), "--dest", str(dest)]
    argv += ["--workers", "1"]  # one file at a time: the kill lands mid-copy
    env = {**os.environ, copier.SLOW_ENV: "0.2"}
    p = procs.start(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    part = dest / ".shmstage" / "partial" / "src" / "ro"
    deadline = time.monotonic() + 60
    while not (part.exists() and len(os.listdir(part)) >= 3):
        assert p.poll() is None and time.monotonic() < deadline, "no partial copy appeared"
        time.sleep(0.02)
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
    assert (part / "s0").stat().st_mode & 0o7777 == 0o444
    done = subprocess.run(argv, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert filecmp.cmp(src / "big", dest / "src" / "big", shallow=False)
    assert sorted(os.listdir(dest / "src" / "ro")) == sorted(os.listdir(src / "ro"))
    check = subprocess.run(
        [*as_user(NOBODY), *shmstage_bin, "verify", "src", "--dest", str(dest)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert check.returncode == 0, check.stdout + check.stderr


# --- who may read the copy ----------------------------------------------------------


def private_home(world: Path) -> Path:
    """/…/home/alice (0700, alice) holding data/ (0755) with a 0644 file: readable only by alice."""
    home = world / "home" / "alice"
    (home / "data" / "sub").mkdir(parents=True)
    (home / "data" / "sub" / "f").write_text("alice's\n")
    (world / "home").chmod(0o755)
    home.chmod(0o700)
    own(home, ALICE)
    return home


def can_read(uid: int, path: Path) -> bool:
    done = subprocess.run([*as_user(uid), "cat", str(path)], capture_output=True)
    return done.returncode == 0


def test_root_stages_a_private_dataset_its_owner_reads_it_others_do_not(world, shmstage_bin):
    """Root stages /home/alice/data (home 0700): alice reads the copy, nobody cannot; verify clean."""
    home = private_home(world)
    dest = world / "dest"
    assert not can_read(NOBODY, home / "data" / "sub" / "f")  # the premise
    done = subprocess.run(
        [*shmstage_bin, "stage", str(home / "data"), "--dest", str(dest)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    staged = dest / "data"
    st = staged.stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (ALICE, ALICE, 0o700)
    assert (staged / "sub" / "f").stat().st_uid == ALICE  # every entry keeps its owner, like cp -a
    assert can_read(ALICE, staged / "sub" / "f")
    assert not can_read(NOBODY, staged / "sub" / "f")
    check = subprocess.run(
        [*shmstage_bin, "verify", "data", "--dest", str(dest)], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr
    again = subprocess.run(
        [*shmstage_bin, "stage", str(home / "data"), "--dest", str(dest), "--json"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert '"changed": false' in again.stdout  # the restricted root is not a change to re-copy
    gone = subprocess.run(
        [*shmstage_bin, "evict", "data", "--dest", str(dest)], capture_output=True, text=True
    )
    assert gone.returncode == 0, gone.stderr
    assert not staged.exists()


def test_owner_stages_a_private_dataset_others_cannot_read_it(world, shmstage_bin):
    """alice herself stages her data under a world-searchable DEST: nobody cannot read it."""
    home = private_home(world)
    dest = world / "dest"
    done = subprocess.run(
        [*as_user(ALICE), *shmstage_bin, "stage", str(home / "data"), "--dest", str(dest)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert (dest / "data").stat().st_mode & 0o777 == 0o700
    assert can_read(ALICE, dest / "data" / "sub" / "f")
    assert not can_read(NOBODY, dest / "data" / "sub" / "f")


def test_private_archive_is_not_readable_by_others(world, shmstage_bin):
    """Root stages alice's tar from her 0700 home: the copy is hers, nobody cannot read it."""
    home = private_home(world)
    archive = home / "data.tar"
    with tarfile.open(archive, "w") as t:
        t.add(home / "data", arcname=".")
    os.chown(archive, ALICE, ALICE)
    dest = world / "dest"
    done = subprocess.run(
        [*shmstage_bin, "stage", str(archive), "--dest", str(dest)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert can_read(ALICE, dest / "data" / "sub" / "f")
    assert not can_read(NOBODY, dest / "data" / "sub" / "f")


def hostile_modes_tar(path: Path, archive_mode: int, group: int) -> None:
    """alice's archive whose members ask for a world-writable dir and file, a 0600 file, a
    setuid file and a sticky dir (as archives made with umask 000 or on Windows do)."""
    import io

    with tarfile.open(path, "w") as tf:
        for name, mode, body in (
            (".", 0o755, None),
            ("ds", 0o777, None),
            ("ds/labels.txt", 0o666, b"cat\n"),
            ("ds/mine.txt", 0o600, b"alice-private\n"),
            ("ds/suid", 0o4755, b"#!/bin/sh\n"),
            ("tmp", 0o1777, None),
        ):
            ti = tarfile.TarInfo(name)
            ti.mode = mode
            if body is None:
                ti.type = tarfile.DIRTYPE
                tf.addfile(ti)
            else:
                ti.size = len(body)
                tf.addfile(ti, io.BytesIO(body))
    os.chown(path, ALICE, group)
    path.chmod(archive_mode)


def test_tar_members_are_the_archive_owners_and_never_writable_by_others(world, shmstage_bin):
    """Root stages alice's 0644 archive whose members are 0777/0666/0600/4755/1777: every member
    is alice's (she reads her 0600 member), nothing is group/other-writable, setuid or sticky,
    and nobody can rewrite or replace a file."""
    (world / "alice").mkdir()
    archive = world / "alice" / "data.tar"
    hostile_modes_tar(archive, 0o644, ALICE)
    dest = world / "dest"
    done = subprocess.run(
        [*shmstage_bin, "stage", str(archive), "--dest", str(dest)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    top = dest / "data"
    want = {"": 0o755, "ds": 0o755, "ds/labels.txt": 0o644, "ds/mine.txt": 0o600,
            "ds/suid": 0o755, "tmp": 0o755}  # fmt: skip
    for rel, mode in want.items():
        st = os.lstat(top / rel)
        assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (ALICE, ALICE, mode), rel
    assert can_read(ALICE, top / "ds" / "mine.txt")
    assert can_read(NOBODY, top / "ds" / "labels.txt")
    evil = subprocess.run(
        [*as_user(NOBODY), "sh", "-c",
         f"echo POISON > {top}/ds/labels.txt || rm -f {top}/ds/suid || touch {top}/tmp/x"],
        capture_output=True,
    )  # fmt: skip
    assert evil.returncode != 0
    assert (top / "ds" / "labels.txt").read_bytes() == b"cat\n"
    assert (top / "ds" / "suid").exists() and not (top / "tmp" / "x").exists()


def test_tar_members_get_no_bits_for_a_class_that_cannot_read_the_archive(world, shmstage_bin):
    """alice's archive is 0640 (group 4243): members keep group read, other gets nothing on
    any member nor on the copy's top; a 0600 archive leaves group nothing either."""
    (world / "alice").mkdir()
    for archive_mode, group_bits, other_bits in ((0o640, 0o050, 0), (0o600, 0, 0)):
        archive = world / "alice" / f"d{archive_mode:o}.tar"
        hostile_modes_tar(archive, archive_mode, 4243)
        dest = world / f"dest{archive_mode:o}"
        done = subprocess.run(
            [*shmstage_bin, "stage", str(archive), "--dest", str(dest)],
            capture_output=True, text=True,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        top = dest / archive.stem
        for rel in ("", "ds", "ds/labels.txt", "ds/suid", "tmp"):
            st = os.lstat(top / rel)
            assert (st.st_uid, st.st_gid) == (ALICE, 4243), rel
            assert st.st_mode & 0o070 in (group_bits, group_bits & 0o040), (rel, oct(st.st_mode))
            assert st.st_mode & 0o007 == other_bits, (rel, oct(st.st_mode))
        assert not can_read(NOBODY, top / "ds" / "labels.txt")
        assert can_read(ALICE, top / "ds" / "mine.txt")


def test_world_readable_source_stays_world_readable(world, shmstage_bin):
    """A source every user can read is staged readable by every user (root and non-root stager)."""
    src = world / "pub"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "f").write_text("hello\n")
    for who, dest in ((None, world / "d1"), (ALICE, world / "d2")):
        prefix = as_user(who) if who is not None else []
        done = subprocess.run(
            [*prefix, *shmstage_bin, "stage", str(src), "--dest", str(dest)],
            capture_output=True, text=True,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert (dest / "pub").stat().st_mode & 0o777 == 0o755
        assert can_read(NOBODY, dest / "pub" / "sub" / "f")


def test_restaging_an_unchanged_source_follows_its_path(world, shmstage_bin):
    """Nothing to copy, but a directory above the source closed (then opened): the copy follows."""
    src = world / "gate" / "pub"
    src.mkdir(parents=True)
    (src / "f").write_text("x\n")
    dest = world / "dest"
    argv = [*shmstage_bin, "stage", str(src), "--dest", str(dest), "--quiet"]
    modes = []
    for gate in (0o755, 0o700, 0o755):
        (world / "gate").chmod(gate)
        done = subprocess.run(argv, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        modes.append((dest / "pub").stat().st_mode & 0o777)
    assert modes == [0o755, 0o700, 0o755]
    assert can_read(NOBODY, dest / "pub" / "f")


def test_restage_does_not_link_what_the_owner_planted_in_the_copy(world, shmstage_bin):
    """Root keeps alice's ownership, so alice can swap a folder of her copy for a symlink into
    another private dataset; root's next incremental stage must not hard-link from there."""
    home = private_home(world)
    dest = world / "dest"
    other = world / "bob" / "data" / "sub"  # a private dataset with a look-alike file
    other.mkdir(parents=True)
    shutil.copy2(home / "data" / "sub" / "f", other / "f")
    (other / "f").write_text("bob's!\n")  # same size as alice's
    st = (home / "data" / "sub" / "f").stat()
    os.utime(other / "f", ns=(st.st_atime_ns, st.st_mtime_ns))
    (world / "bob").chmod(0o700)
    stage = [*shmstage_bin, "stage", "--dest", str(dest), "--quiet"]
    for src in (world / "bob" / "data", home / "data"):
        done = subprocess.run([*stage, str(src), "--name", src.parent.name], capture_output=True)
        assert done.returncode == 0, done.stderr
    plant = f"cd {dest / 'alice'} && mv sub sub.old && ln -s {dest / 'bob' / 'sub'} sub"
    done = subprocess.run([*as_user(ALICE), "sh", "-c", plant], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    (home / "data" / "new").write_text("a change, so the next stage is incremental\n")
    done = subprocess.run([*stage, str(home / "data"), "--name", "alice"], capture_output=True)
    assert done.returncode == 0, done.stderr
    staged = dest / "alice" / "sub" / "f"
    assert not staged.is_symlink() and staged.read_text() == "alice's\n"
    assert staged.stat().st_ino != (dest / "bob" / "sub" / "f").stat().st_ino


def test_restage_copies_a_file_deleted_from_the_published_copy(world, shmstage_bin):
    """A user who deleted a file from their staged copy can still stage the changed source."""
    src, dest = world / "src", world / "dest"
    read_only_tree(src, big=False)
    (src / "top").write_text("top\n")
    own(src, NOBODY)
    argv = [*as_user(NOBODY), *shmstage_bin, "stage", str(src), "--dest", str(dest), "--quiet"]
    assert subprocess.run(argv, capture_output=True).returncode == 0
    rm = subprocess.run([*as_user(NOBODY), "rm", str(dest / "src" / "top")])
    assert rm.returncode == 0
    (src / "new").write_text("x")
    done = subprocess.run(argv, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (dest / "src" / "top").read_text() == "top\n"


# --- users on a store root manages (issue 20, items 12 and 13) ---------------------------------


def one_error_line(done: subprocess.CompletedProcess) -> str:
    """The single stderr line of a refused command (no traceback, nothing else)."""
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), done.stderr
    return lines[0]


def test_non_root_user_uses_what_root_staged_and_is_told_what_else_needs_root(
    world, shmstage_bin, procs
):
    """On a store root staged: nobody's stage of the current dataset prints its path, `run
    --stage` runs the job, and staging anything new, restaging or evicting is one line, exit 2."""
    src, dest = world / "pub", world / "dest"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "f").write_text("hello\n")
    done = subprocess.run(
        [*shmstage_bin, "stage", str(src), "--dest", str(dest), "--quiet"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    user = [*as_user(NOBODY), *shmstage_bin]
    again = subprocess.run(
        [*user, "stage", str(src), "--dest", str(dest)], capture_output=True, text=True
    )
    assert (again.returncode, again.stdout) == (0, f"{dest / 'pub'}\n"), again.stderr
    job = subprocess.run(
        [*user, "run", "--stage", str(src), "--dest", str(dest), "--", "cat",
         str(dest / "pub" / "sub" / "f")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert (job.returncode, job.stdout) == (0, "hello\n"), job.stderr
    # the job's lease lives in root's store (a read-only fd): root's evict sees it
    held = procs.start(
        [*user, "run", "--stage", str(src), "--dest", str(dest), "--", "sh", "-c",
         "echo ready; exec sleep 60"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    assert held.stdout.readline() == "ready\n"
    busy = subprocess.run(
        [*shmstage_bin, "evict", "pub", "--dest", str(dest)], capture_output=True, text=True
    )
    assert busy.returncode == 2 and "Error: pub is in use by pid " in busy.stderr, busy.stderr
    held.terminate()  # run passes it to the job and exits
    held.wait(timeout=30)
    managed = (  # no service answers (issue 22 item 8)
        f"{dest} is managed by root and no shmstage service answers on {socket_path()}: ask "
        "an admin to start it (systemctl start shmstage) or stage into a directory of your "
        "own with --dest, e.g. --dest /dev/shm/shmstage-$USER"
    )
    other = world / "other"
    other.mkdir()
    (other / "g").write_text("x\n")
    new = subprocess.run(
        [*user, "stage", str(other), "--dest", str(dest)], capture_output=True, text=True
    )
    assert new.returncode == 2
    assert one_error_line(new) == f"Error: other is not staged in {dest}; {managed}"
    gone = subprocess.run(
        [*user, "evict", "pub", "--dest", str(dest)], capture_output=True, text=True
    )
    assert gone.returncode == 2 and one_error_line(gone) == f"Error: {managed}"
    (src / "new").write_text("a change\n")
    stale = subprocess.run(
        [*user, "run", "--stage", str(src), "--dest", str(dest), "--", "true"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert stale.returncode == 2
    assert one_error_line(stale) == (f"Error: pub in {dest} is out of date with {src}; {managed}")
    assert (dest / "pub" / "sub" / "f").read_text() == "hello\n"  # nothing was touched


def test_non_root_stages_and_restages_a_read_only_top_directory(world, shmstage_bin):
    """nobody stages a source whose top directory is 0555 (its copy's ".." must change on
    publish), and restages it after a change; the copy keeps 0555 and verifies clean."""
    src, dest = world / "src", world / "dest"
    (src / "x").mkdir(parents=True)
    (src / "x" / "f").write_text("1\n")
    own(src, NOBODY)
    src.chmod(0o555)
    argv = [*as_user(NOBODY), *shmstage_bin, "stage", str(src), "--dest", str(dest), "--quiet"]
    for change in (None, "y"):
        if change:
            src.chmod(0o755)
            (src / change).write_text("2\n")
            os.lchown(src / change, NOBODY, NOBODY)
            src.chmod(0o555)
        done = subprocess.run(argv, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        assert (dest / "src").stat().st_mode & 0o7777 == 0o555
    assert (dest / "src" / "y").read_text() == "2\n"
    check = subprocess.run(
        [*as_user(NOBODY), *shmstage_bin, "verify", "src", "--dest", str(dest)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert check.returncode == 0, check.stdout + check.stderr
    assert os.listdir(dest / ".shmstage" / "partial") == []
    assert os.listdir(dest / ".shmstage" / "trash") == []


NO_DAC = ["setpriv", "--inh-caps=-dac_override", "--bounding-set=-dac_override"]


def test_root_without_dac_override_stages_another_users_directory(world, shmstage_bin):
    """Root without CAP_DAC_OVERRIDE stages and restages alice's directory (the copy is hers),
    and what a killed run of it leaves, its own gc removes; evict removes the dataset."""
    src = world / "alice" / "data"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "f").write_text("alice's\n")
    (src / "t").write_text("top\n")
    own(world / "alice", ALICE)
    dest = world / "dest"
    stage = [*NO_DAC, *shmstage_bin, "stage", str(src), "--dest", str(dest), "--quiet"]
    for change in (None, "g"):
        if change:
            (src / "sub" / change).write_text("more\n")
            os.lchown(src / "sub" / change, ALICE, ALICE)
        done = subprocess.run(stage, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        assert (dest / "data").stat().st_uid == ALICE  # like cp -a
    assert (dest / "data" / "sub" / "g").read_text() == "more\n"
    killed = subprocess.run(
        [*NO_DAC, *shmstage_bin, "stage", str(src), "--dest", str(world / "d2")],
        capture_output=True, env={**os.environ, "SHMSTAGE_TEST_KILL_AT": "build"},
    )  # fmt: skip
    assert killed.returncode == -signal.SIGKILL
    part = world / "d2" / ".shmstage" / "partial" / "data"
    assert (part / "sub").stat().st_uid == ALICE  # the premise: a tree root cannot write into
    gc = subprocess.run(
        [*NO_DAC, *shmstage_bin, "gc", "--dest", str(world / "d2")], capture_output=True, text=True
    )
    assert gc.returncode == 0, gc.stderr
    assert not part.exists()
    gone = subprocess.run(
        [*NO_DAC, *shmstage_bin, "evict", "data", "--dest", str(dest)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert gone.returncode == 0, gone.stderr
    assert not (dest / "data").exists()
    assert os.listdir(dest / ".shmstage" / "trash") == []


# Root (without CAP_DAC_OVERRIDE) removes ALICE's tree; the first time it must chmod a
# directory of it, ALICE swaps TOP/x for a symlink to FARM, where FARM/c -> VICTIM: the worst
# moment for a removal that acts by path after making room (issue 20, store finding 1).
SWAP_AT_FIRST_CHMOD = r"""
import os, subprocess, sys
from shmstage.stage import store
top, farm, uid = sys.argv[1:]
real, swapped = os.fchmod, []
def fchmod(fd, mode):
    real(fd, mode)
    if not swapped:
        swapped.append(1)
        subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "sh", "-c",
                        'mv "$1/x" "$1/s" && ln -s "$2" "$1/x"', "sh", top, farm], check=True, cwd="/")
os.fchmod = fchmod
store.rmtree(top)
print("swapped" if swapped else "not swapped")
"""


def test_removal_never_follows_a_link_planted_where_a_directory_was(world, shmstage_bin):
    """The tree's owner swaps one of its directories for a symlink mid-removal: root's removal
    never acts on what is outside the tree (VICTIM/f is root's, outside), and the tree goes."""
    top, farm, victim = world / "store" / "data", world / "farm", world / "victim"
    (top / "x" / "c").mkdir(parents=True)
    (top / "x" / "c" / "f").write_text("alice's\n")
    farm.mkdir()
    (farm / "c").symlink_to(victim)
    own(world / "store", ALICE)
    own(farm, ALICE)
    os.chown(world / "store", 0, 0)  # DEST: root's
    victim.mkdir()
    (victim / "f").write_text("root's, outside the store\n")
    done = subprocess.run(
        [*NO_DAC, sys.executable, "-c", SWAP_AT_FIRST_CHMOD, str(top), str(farm), str(ALICE)],
        capture_output=True, text=True, cwd="/",
    )  # fmt: skip
    assert (victim / "f").read_text() == "root's, outside the store\n", done.stderr
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "swapped"  # the premise: the owner swapped mid-removal
    assert os.listdir(world / "store") == []
    assert (farm / "c").is_symlink()


NO_DAC_READ = [
    "setpriv",
    "--inh-caps=-dac_override,-dac_read_search",
    "--bounding-set=-dac_override,-dac_read_search",
]


def test_evicting_a_dataset_its_owner_locked_leaves_dest_as_it_was(world, open_tmpfs, shmstage_bin):
    """Root without CAP_DAC_OVERRIDE/CAP_DAC_READ_SEARCH stages alice's directory (the copy is
    hers); she chmods it 000; root's evict removes it and changes nothing else: neither a DEST
    directory nor a DEST that is the tmpfs root itself (mode 1777) becomes 0700."""
    src = world / "alice" / "data"
    (src / "d").mkdir(parents=True)
    (src / "d" / "a").write_text("alice's\n")
    own(world / "alice", ALICE)
    for dest in (world / "store", open_tmpfs("16M", name="shm2")):
        stage = [*NO_DAC_READ, *shmstage_bin, "stage", str(src), "--dest", str(dest), "--quiet"]
        done = subprocess.run(stage, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        mode = dest.stat().st_mode & 0o7777
        done = subprocess.run([*as_user(ALICE), "chmod", "000", str(dest / "data")])
        assert done.returncode == 0
        gone = subprocess.run(
            [*NO_DAC_READ, *shmstage_bin, "evict", "data", "--dest", str(dest)],
            capture_output=True, text=True,
        )  # fmt: skip
        assert dest.stat().st_mode & 0o7777 == mode
        assert gone.returncode == 0, gone.stderr
        assert not (dest / "data").exists()


def test_restage_repairs_the_root_a_stager_killed_inside_publish_left(world, shmstage_bin):
    """Root without CAP_DAC_OVERRIDE stages alice's 0555 directory; a stager killed between the
    publish rename and putting the root's owner and mode back (Store.publish) leaves the root
    root's and 0755; an unchanged restage puts back alice's ownership and the 0555 mode."""
    src = world / "alice" / "data"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "f").write_text("alice's\n")
    own(world / "alice", ALICE)
    src.chmod(0o555)
    dest = world / "dest"
    stage = [*NO_DAC, *shmstage_bin, "stage", str(src), "--dest", str(dest)]
    done = subprocess.run(stage, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    root = dest / "data"
    assert (root.stat().st_uid, root.stat().st_mode & 0o7777) == (ALICE, 0o555)
    os.chown(root, 0, 0)  # what the kill leaves: _movable made it ours and writable
    root.chmod(0o755)
    again = subprocess.run(stage, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr
    assert "up to date" in again.stderr
    assert (root.stat().st_uid, root.stat().st_gid, root.stat().st_mode & 0o7777) == (
        ALICE,
        ALICE,
        0o555,
    )


def test_hand_out_of_a_source_with_a_part_the_user_may_not_read_is_refused(world, shmstage_bin):
    """Root staged a source with a 0700 directory in it; nobody's `stage` and `run --stage` of
    it are refused in one line (exit 2) naming that directory, not failed (exit 1)."""
    src = world / "src"
    (src / "pub").mkdir(parents=True)
    (src / "priv").mkdir()
    (src / "pub" / "a").write_text("a\n")
    (src / "priv" / "s").write_text("secret\n")
    (src / "priv").chmod(0o700)
    dest = world / "store"
    done = subprocess.run([*shmstage_bin, "stage", str(src), "--dest", str(dest), "--quiet"])
    assert done.returncode == 0
    for how in (["stage", str(src)], ["run", "--stage", str(src)]):
        argv = [*as_user(NOBODY), *shmstage_bin, *how, "--dest", str(dest)]
        done = subprocess.run([*argv, *(["--", "true"] if how[0] == "run" else [])],
                              capture_output=True, text=True)  # fmt: skip
        assert done.returncode == 2, done.stderr
        line = one_error_line(done)
        assert f"cannot read source directory {src / 'priv'}: Permission denied" in line
        assert "not handed out to you" in line


def test_evict_of_a_tree_holding_what_the_user_may_not_remove_fails_in_one_line(
    world, shmstage_bin
):
    """nobody's own store; root put a directory of its own into nobody's dataset: nobody's
    evict fails in one line (exit 1) saying what it could not remove, no traceback."""
    src = world / "src"
    (src / "d").mkdir(parents=True)
    (src / "d" / "f").write_text("f\n")
    own(src, NOBODY)
    dest = world / "mine"
    stage = [*as_user(NOBODY), *shmstage_bin, "stage", str(src), "--dest", str(dest), "--quiet"]
    assert subprocess.run(stage).returncode == 0
    (dest / "src" / "d" / "roots").mkdir()
    (dest / "src" / "d" / "roots" / "r").write_text("root's\n")
    done = subprocess.run(
        [*as_user(NOBODY), *shmstage_bin, "evict", "src", "--dest", str(dest)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    line = one_error_line(done)
    trash = dest / ".shmstage" / "trash"
    assert line.startswith(f"Error: cannot remove {trash}/src."), line  # where it is left
    assert "Operation not permitted; it holds files you may not remove" in line
    assert [p.name for p in trash.glob("*/d/roots/r")] == ["r"]


@pytest.mark.parametrize("max_size", [None, "20M"])
def test_non_root_new_dataset_on_a_root_store_is_one_clear_line_with_or_without_max_size(
    world, shmstage_bin, max_size
):
    """A non-root user's new dataset on a store root manages: the same "managed by root"
    line and exit 2 whether the tier has a max_size or not, and --dry-run says the same (with
    max_size it used to fail on the owner-only max_size lock: "cannot lock .../.capping:
    Permission denied", exit 1, while the dry run said it would stage, exit 0)."""
    src, dest = world / "pub", world / "dest"
    src.mkdir()
    (src / "f").write_text("hello\n")
    config = world / "node.yaml"  # every user reads it
    cache = f"\n    cache: {{max_size: {max_size}, policy: lru}}" if max_size else ""
    config.write_text(f"version: 1\ndest:\n  - path: {dest}{cache}\n")
    config.chmod(0o644)
    env = {**os.environ, "SHMSTAGE_CONFIG": str(config)}
    done = subprocess.run(
        [*shmstage_bin, "stage", str(src), "-q"], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr
    other = world / "other"
    other.mkdir()
    (other / "g").write_text("x\n")
    managed = f"Error: other is not staged in {dest}; {dest} is managed by root and no shmstage"
    for extra in ([], ["--dry-run"]):
        new = subprocess.run(
            [*as_user(NOBODY), *shmstage_bin, "stage", str(other), *extra],
            capture_output=True, text=True, env=env, timeout=120,
        )  # fmt: skip
        assert new.returncode == 2, (extra, new.stdout, new.stderr)
        assert one_error_line(new).startswith(managed), (extra, new.stderr)
    assert sorted(p.name for p in dest.iterdir()) == [".shmstage", "pub"]


def test_non_root_new_dataset_skips_a_root_tier_with_max_size_for_its_own(world, shmstage_bin):
    """--dest ROOTSTORE,MINE where root's tier has a max_size: a non-root user's new dataset
    goes to their own tier, saying why root's was skipped (it used to fail on root's
    owner-only max_size lock, exit 1), and the dry run says the same."""
    src, root_tier, mine = world / "pub", world / "dest", world / "mine"
    src.mkdir()
    (src / "f").write_text("hello\n")
    mine.mkdir()
    os.chown(mine, NOBODY, NOBODY)
    config = world / "node.yaml"
    config.write_text(
        f"version: 1\ndest:\n  - path: {root_tier}\n    cache: {{max_size: 20M, policy: lru}}\n"
    )
    config.chmod(0o644)
    env = {**os.environ, "SHMSTAGE_CONFIG": str(config)}
    done = subprocess.run(
        [*shmstage_bin, "stage", str(src), "-q"], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr
    other = world / "other"
    other.mkdir()
    (other / "g").write_text("x\n")
    tiers = f"{root_tier},{mine / 's'}"
    user = [*as_user(NOBODY), *shmstage_bin, "stage", str(other), "--dest", tiers]
    dry = subprocess.run([*user, "--dry-run"], capture_output=True, text=True, env=env)
    assert dry.returncode == 0, dry.stderr
    assert f"would skip tier {root_tier}: other is not staged in {root_tier}; " in dry.stdout
    assert "would stage" in dry.stdout and f"into tier 2: {mine / 's' / 'other'}" in dry.stdout
    new = subprocess.run(user, capture_output=True, text=True, env=env, timeout=120)
    assert (new.returncode, new.stdout) == (0, f"{mine / 's' / 'other'}\n"), new.stderr
    assert f"skipped tier {root_tier}: other is not staged in {root_tier}; " in new.stderr


@pytest.mark.skipif(shutil.which("mkfs.ext4") is None, reason="needs mkfs.ext4 (e2fsprogs)")
@pytest.mark.parametrize("who", ["root", "user"])
def test_a_grpid_dest_gives_copies_their_sources_group_not_the_directorys(
    tmp_path, open_tmpfs, shmstage_bin, who
):
    """On an ext4 DEST mounted grpid a new file takes its directory's group (4242 here); the
    copier skips the chown only where it knows a new file's group (tmpfs), so root's copy of a
    root:root file, and a user's copy of a file of her own group, keep the source's group."""
    img = tmp_path / "ext4.img"
    with open(img, "wb") as f:
        f.truncate(96 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(img)], check=True)
    mnt = open_tmpfs("1M", name="grpid")  # a mount point every user can reach
    subprocess.run(["mount", "-o", "loop,grpid", str(img), str(mnt)], check=True)
    try:
        mnt.chmod(0o755)
        uid, gid = (0, 0) if who == "root" else (1000, 1000)
        cache = mnt / "cache"
        cache.mkdir(mode=0o755)
        os.chown(cache, uid, 4242)
        src = open_tmpfs("64M") / "ds"
        src.mkdir()
        (src / "small").write_bytes(os.urandom(100_000))
        (src / "big").write_bytes(os.urandom(20 << 20))  # a stream (copy.STREAM_MIN)
        for p in (src, src / "small", src / "big"):
            os.chown(p, uid, gid)
        for p in (src / "small", src / "big"):
            p.chmod(0o640)
        run = [*shmstage_bin, "stage", str(src), "--dest", str(cache), "--reserve", "0"]
        if who == "user":
            run = [*as_user(1000, 1000), *run]
        done = subprocess.run(run, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        staged = Path(done.stdout.strip())
        for name in ("small", "big"):
            st = (staged / name).stat()
            assert (st.st_uid, st.st_gid) == (uid, gid), (name, st.st_uid, st.st_gid)
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
