"""Privacy by proof (issue 22 item 3): the engine called with ``reader=Caller(...)`` reads the
source only with the reader's credentials, writes the store as root, and hands out a copy
only to someone who could read all of its source.

Each stage runs as the node service runs it: a forked child of this (root) test process that
adopted the reader's groups, then calls the engine.  Real users' ids, real files, no CLI."""

from __future__ import annotations

import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from shmstage.identity import Caller, adopt_groups
from shmstage.stage import engine
from shmstage.stage.build import copier

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux)"),
]

ALICE = 4371  # owns the sources
BOB = 4372  # asks for them
CAROL = 4373  # neither
TEAM = 4380  # alice's and (sometimes) bob's group
VICTIM = 4374  # owns a 0700 vault


def in_child(fn: Callable[[], Any]) -> Any:
    """``fn()`` in a forked child; its result, or ("error", class name, message) for a
    ShmstageError; anything else fails the test with the child's traceback."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        os.close(r)
        from shmstage.errors import ShmstageError

        try:
            out: Any = ("ok", fn())
        except ShmstageError as e:
            out = ("error", type(e).__name__, str(e))
        except BaseException:  # noqa: BLE001 - sent to the parent
            out = ("crash", traceback.format_exc())
        with os.fdopen(w, "wb") as f:
            pickle.dump(out, f)
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    out = pickle.loads(data)
    assert out[0] != "crash", out[1]
    return out[1] if out[0] == "ok" else out


def stage_as(reader: Caller, src: Path, dest: Path, **kw: Any) -> Any:
    """engine.stage(src, reader=reader) as the service's per-request child runs it: the
    dataset's (path, changed), or ("error", kind, message)."""

    def run() -> tuple[str, bool]:
        adopt_groups(reader)
        ds = engine.stage(str(src), dest=str(dest), reader=reader, **kw)
        return ds.path, ds.changed

    return in_child(run)


def as_user(uid: int, *groups: int) -> list[str]:
    grp = f"--groups={','.join(map(str, groups))}" if groups else "--clear-groups"
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", grp]


def can_read(uid: int, path: Path, *groups: int) -> bool:
    return (
        subprocess.run([*as_user(uid, *groups), "cat", str(path)], capture_output=True).returncode
        == 0
    )


def tree(top: Path) -> list[str]:
    return sorted(str(p.relative_to(top)) for p in top.rglob("*"))


def nothing_staged(dest: Path, name: str) -> None:
    """No dataset, no partial tree, no manifest of ``name`` under DEST."""
    assert not (dest / name).exists()
    book = dest / ".shmstage"
    if book.exists():
        assert not list((book / "partial").iterdir()), tree(book / "partial")
        assert not [p for p in (book / "manifests").iterdir() if name in p.name]
        assert not [p for p in (book / "meta").iterdir() if name in p.name]


@pytest.fixture
def world(open_tmp_path: Path) -> Path:
    """``src/`` (alice's, 0755) with a/ (three 0644 files); tests add what they need."""
    src = open_tmp_path / "src"
    (src / "a").mkdir(parents=True)
    for i in range(3):
        (src / "a" / f"f{i}").write_bytes(b"x" * (100 + i))
    own(src, ALICE)
    return open_tmp_path


def own(top: Path, uid: int, gid: int | None = None) -> None:
    for p in [top, *top.rglob("*")]:
        os.lchown(p, uid, uid if gid is None else gid)


BOB_ALONE = Caller(BOB, BOB, ())
BOB_IN_TEAM = Caller(BOB, BOB, (TEAM,))


def test_a_file_the_reader_cannot_read_is_refused_and_nothing_lands(world):
    """A 0600 file of alice's: bob's stage is refused in one line, and DEST holds nothing."""
    src, dest = world / "src", world / "dest"
    (src / "secret").write_bytes(b"S" * 5000)
    os.chown(src / "secret", ALICE, ALICE)
    (src / "secret").chmod(0o600)
    out = stage_as(BOB_ALONE, src, dest)
    assert out == (
        "error",
        "RefusedError",
        f"you cannot read {src}/secret at the source (Permission denied): nothing staged",
    )
    nothing_staged(dest, "src")


def test_a_directory_the_reader_cannot_enter_is_refused(world):
    """A 0700 directory of alice's: refused, naming it; nothing staged."""
    src, dest = world / "src", world / "dest"
    (src / "private").mkdir()
    (src / "private" / "x").write_bytes(b"p")
    own(src / "private", ALICE)
    (src / "private").chmod(0o700)
    out = stage_as(BOB_ALONE, src, dest)
    assert out == (
        "error",
        "RefusedError",
        f"you cannot read {src}/private at the source (Permission denied): nothing staged",
    )
    nothing_staged(dest, "src")


def test_a_file_readable_through_a_supplementary_group_is_staged_as_root_stages_it(world):
    """0640 alice:TEAM, bob in TEAM: staged; the copy keeps alice, TEAM and 0640."""
    src, dest = world / "src", world / "dest"
    (src / "team").write_bytes(b"T" * 3000)
    os.chown(src / "team", ALICE, TEAM)
    (src / "team").chmod(0o640)
    path, changed = stage_as(BOB_IN_TEAM, src, dest)
    assert changed and path == str(dest / "src")
    st = (dest / "src" / "team").stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (ALICE, TEAM, 0o640)
    assert (dest / "src" / "team").read_bytes() == b"T" * 3000
    assert (dest / "src").stat().st_uid == ALICE


def test_the_same_file_without_the_group_is_refused(world):
    """The same 0640 alice:TEAM file, bob not in TEAM: refused, nothing staged."""
    src, dest = world / "src", world / "dest"
    (src / "team").write_bytes(b"T" * 3000)
    os.chown(src / "team", ALICE, TEAM)
    (src / "team").chmod(0o640)
    out = stage_as(BOB_ALONE, src, dest)
    assert out[:2] == ("error", "RefusedError") and f"{src}/team" in out[2], out
    nothing_staged(dest, "src")


def test_an_archive_the_reader_cannot_read_is_refused(world):
    """A 0600 tar archive of alice's: refused before a header is read."""
    src, dest = world / "src", world / "dest"
    archive = world / "data.tar"
    subprocess.run(["tar", "-cf", str(archive), "-C", str(src), "."], check=True)
    os.chown(archive, ALICE, ALICE)
    archive.chmod(0o600)
    out = stage_as(BOB_ALONE, archive, dest)
    assert out[:2] == ("error", "RefusedError") and str(archive) in out[2], out
    nothing_staged(dest, "data")
    archive.chmod(0o644)  # readable: staged, as a root stager would
    path, changed = stage_as(BOB_ALONE, archive, dest)
    assert changed and (Path(path) / "a" / "f1").read_bytes() == b"x" * 101


def test_a_copy_is_handed_out_only_to_a_reader_who_can_read_every_file(world):
    """Staged by alice; bob, who cannot read one file of it, is refused and the copy stays
    as it was; once he can, he gets the same copy, unchanged."""
    src, dest = world / "src", world / "dest"
    (src / "secret").write_bytes(b"S" * 5000)
    os.chown(src / "secret", ALICE, ALICE)
    (src / "secret").chmod(0o600)
    path, changed = stage_as(Caller(ALICE, ALICE, ()), src, dest)
    assert changed
    before = {p: os.lstat(p) for p in [dest / "src", *(dest / "src").rglob("*")]}
    out = stage_as(BOB_ALONE, src, dest)
    assert out == (
        "error",
        "RefusedError",
        f"you cannot read {src}/secret at the source (Permission denied): nothing staged",
    )
    after = {p: os.lstat(p) for p in [dest / "src", *(dest / "src").rglob("*")]}
    assert {p: (s.st_ino, s.st_mtime_ns, s.st_mode) for p, s in before.items()} == {
        p: (s.st_ino, s.st_mtime_ns, s.st_mode) for p, s in after.items()
    }
    (src / "secret").chmod(0o644)
    assert stage_as(BOB_ALONE, src, dest) == (path, True)  # the mode changed: restaged
    assert stage_as(BOB_ALONE, src, dest) == (path, False)


@pytest.fixture
def team_home(open_tmp_path: Path) -> Path:
    """home/ (alice:TEAM, 0750) holding data/ (alice's, 0755, a 0644 file): the group TEAM
    may reach data, nobody else may."""
    home = open_tmp_path / "home"
    (home / "data").mkdir(parents=True)
    (home / "data" / "f").write_bytes(b"D" * 4000)
    own(home, ALICE)
    os.chown(home, ALICE, TEAM)
    home.chmod(0o750)
    return open_tmp_path


def test_the_copy_top_is_closed_where_the_source_path_is(team_home):
    """The source's parent lets only TEAM through: the copy's top keeps its owner (alice)
    and grants neither its group nor others; a user outside TEAM cannot read the copy."""
    src, dest = team_home / "home" / "data", team_home / "dest"
    path, _ = stage_as(Caller(ALICE, ALICE, ()), src, dest)
    st = os.stat(path)
    assert (st.st_uid, st.st_mode & 0o777) == (ALICE, 0o700)
    assert not can_read(CAROL, Path(path) / "f")
    assert not can_read(BOB, Path(path) / "f", TEAM)  # in TEAM, but not let in yet


def test_grant_lets_that_user_in_and_nobody_else(team_home):
    """engine.grant(name, dest, bob): bob (who could read the source) reads the copy; carol
    still cannot.  A current re-stage re-checks him as /etc/passwd and /etc/group say he is:
    no entry there (his groups unknown), so not in TEAM: the grant is taken back (the grant
    a user who still reaches the source keeps: test_service.py)."""
    src, dest = team_home / "home" / "data", team_home / "dest"
    path, _ = stage_as(Caller(ALICE, ALICE, ()), src, dest)
    engine.grant("data", str(dest), BOB)
    assert can_read(BOB, Path(path) / "f")
    assert not can_read(CAROL, Path(path) / "f")
    assert engine.verify("data", str(dest)).ok  # a grant is no change of the copy
    assert stage_as(Caller(ALICE, ALICE, ()), src, dest) == (path, False)
    assert not can_read(BOB, Path(path) / "f") and not can_read(CAROL, Path(path) / "f")
    assert can_read(ALICE, Path(path) / "f")


def test_a_reader_who_passed_the_check_is_let_in_by_the_stage_itself(team_home):
    """bob (in TEAM) asks for the copy alice staged: handed out after his own walk, and the
    copy's top lets him in; carol, refused at the source path, gets nothing."""
    src, dest = team_home / "home" / "data", team_home / "dest"
    path, _ = stage_as(Caller(ALICE, ALICE, ()), src, dest)
    assert stage_as(BOB_IN_TEAM, src, dest) == (path, False)
    assert can_read(BOB, Path(path) / "f")
    out = stage_as(Caller(CAROL, CAROL, ()), src, dest)
    assert out[:2] == ("error", "RefusedError") and "you cannot read" in out[2], out
    assert not can_read(CAROL, Path(path) / "f")


def test_root_in_process_closes_the_top_the_same_way(team_home):
    """Without a reader (root, in-process) the same ancestor rule applies."""
    src, dest = team_home / "home" / "data", team_home / "dest"
    ds = engine.stage(str(src), dest=str(dest))
    assert os.stat(ds.path).st_mode & 0o777 == 0o700
    assert not can_read(CAROL, Path(ds.path) / "f")


SECRET = b"TOP-SECRET-" + b"v" * 4085
DECOY = b"decoy------" + b"m" * 4085

STAGE_AS_READER = """
import os, sys
from shmstage.identity import Caller, adopt_groups
from shmstage.stage import engine
from shmstage.errors import ShmstageError
reader = Caller(int(sys.argv[3]), int(sys.argv[3]), ())
adopt_groups(reader)
try:
    engine.stage(sys.argv[1], dest=sys.argv[2], workers=1, reader=reader)
except ShmstageError as e:
    print(e, file=sys.stderr)
    sys.exit(e.exit_code)
"""


def test_a_directory_swapped_for_a_symlink_during_a_reader_stage_leaks_nothing(
    open_tmp_path, procs
):
    """The reader (mallory=bob) swaps d/ for a link to a 0700 vault once the copy runs: the
    stage fails and the vault's bytes are nowhere under DEST."""
    src, vault, dest = open_tmp_path / "src", open_tmp_path / "vault", open_tmp_path / "dest"
    (src / "a").mkdir(parents=True)
    for i in range(6):
        (src / "a" / f"f{i}").write_bytes(os.urandom(100))
    (src / "d").mkdir()
    (src / "d" / "secret").write_bytes(DECOY)
    vault.mkdir()
    (vault / "secret").write_bytes(SECRET)
    own(src, BOB)
    own(vault, VICTIM)
    vault.chmod(0o700)
    env = {**os.environ, copier.SLOW_ENV: "0.5", "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    p = procs.start(
        [sys.executable, "-c", STAGE_AS_READER, str(src), str(dest), str(BOB)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    landing = dest / ".shmstage" / "partial" / "src" / "a" / "f0"
    deadline = time.monotonic() + 60
    while not landing.exists():
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()
        time.sleep(0.01)
    os.killpg(p.pid, signal.SIGSTOP)
    try:
        swap = f"mv {src}/d {src}/d.old && ln -s {vault} {src}/d"
        subprocess.run([*as_user(BOB), "sh", "-c", swap], check=True)
    finally:
        os.killpg(p.pid, signal.SIGCONT)
    _out, err = p.communicate(timeout=120)
    assert p.returncode != 0, err
    assert "d/secret" in err.decode() and "Traceback" not in err.decode(), err
    found = b"".join(f.read_bytes() for f in dest.rglob("*") if f.is_file() and not f.is_symlink())
    assert b"TOP-SECRET" not in found
    assert not (dest / "src").exists()


def test_verify_checksum_as_a_reader_who_cannot_read_a_file_is_refused(world):
    """verify --checksum reads the source as the reader: no oracle on alice's 0600 file."""
    src, dest = world / "src", world / "dest"
    (src / "secret").write_bytes(b"S" * 5000)
    os.chown(src / "secret", ALICE, ALICE)
    (src / "secret").chmod(0o600)
    engine.stage(str(src), dest=str(dest))  # root staged it

    def check(reader: Caller) -> bool:
        adopt_groups(reader)
        return engine.verify("src", str(dest), checksum=True, reader=reader).ok

    assert in_child(lambda: check(Caller(ALICE, ALICE, ()))) is True
    assert in_child(lambda: check(BOB_ALONE)) == (
        "error",
        "RefusedError",
        f"you cannot read {src}/secret at the source (Permission denied)",  # verify stages nothing
    )


def named_acl(path: Path, uid: int, mode: int) -> None:
    """An access ACL on ``path``: its mode's classes plus ``user:uid:---`` (mask = group bits)."""
    import struct

    g = mode >> 3 & 7
    entries = [(0x01, mode >> 6 & 7, 0xFFFFFFFF), (0x02, 0, uid), (0x04, g, 0xFFFFFFFF)]
    entries += [(0x10, g, 0xFFFFFFFF), (0x20, mode & 7, 0xFFFFFFFF)]
    raw = struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in entries)
    os.setxattr(path, "system.posix_acl_access", raw)


def test_an_acl_that_shuts_the_reader_out_of_one_file_among_alike_ones_is_seen(world):
    """Files alike in owner, group and mode share one kernel check, but not one with an ACL
    (``user:bob:---``): bob is refused on it."""
    src, dest = world / "src", world / "dest"
    mode = 0o644
    for name in ("f1", "f2", "shut", "f3"):
        (src / "a" / name).write_bytes(b"z" * 10)
        os.chown(src / "a" / name, ALICE, ALICE)
        (src / "a" / name).chmod(mode)
    named_acl(src / "a" / "shut", BOB, mode)
    assert can_read(CAROL, src / "a" / "shut") and not can_read(BOB, src / "a" / "shut")
    out = stage_as(BOB_ALONE, src, dest)
    assert out == (
        "error",
        "RefusedError",
        f"you cannot read {src}/a/shut at the source (Permission denied): nothing staged",
    )
    nothing_staged(dest, "src")


def test_a_reader_cannot_replace_another_users_copy_by_name_or_force(world):
    """alice stages her src as "shared"; bob (who can read his own, other source) staging it under
    that name is refused, with --force too, naming alice's copy; the copy stays alice's data.
    bob may not --force a restage of alice's copy of alice's source either; alice may."""
    alice = Caller(ALICE, ALICE, ())
    mine = world / "bobs"
    mine.mkdir()
    (mine / "f").write_bytes(b"bob-data")
    own(mine, BOB)
    dest = world / "dest"
    assert stage_as(alice, world / "src", dest, name="shared")[1] is True
    refused = (
        "error",
        "RefusedError",
        f"shared is uid {ALICE}'s copy of {world}/src: only they or root may replace it; "
        f"stage {mine} under another --name",
    )
    assert stage_as(BOB_ALONE, mine, dest, name="shared") == refused
    assert stage_as(BOB_ALONE, mine, dest, name="shared", force=True) == refused
    assert sorted(os.listdir(dest / "shared")) == ["a"]
    out = stage_as(BOB_ALONE, world / "src", dest, name="shared", force=True)
    assert out[:2] == ("error", "RefusedError") and "only they or root" in out[2], out
    assert stage_as(BOB_ALONE, world / "src", dest, name="shared")[1] is False  # using it is fine
    assert stage_as(alice, world / "src", dest, name="shared", force=True)[1] is True


def bookkeeping(dest: Path, name: str) -> list[Path]:
    book = dest / ".shmstage"
    return [book / "manifests" / f"{name}.json", book / "meta" / f"{name}.json"]


def test_a_private_copys_manifest_and_record_are_read_only_by_who_may_list_it(
    team_home, shmstage_bin
):
    """The copy's top is alice's 0700: its manifest and record (they name the source and every
    file) are 0600 root's, read by alice (ACL) and, once granted, bob; never carol.  alice's own
    in-process `list` on the root store shows it; carol's does not."""
    src, dest = team_home / "home" / "data", team_home / "dest"
    stage_as(Caller(ALICE, ALICE, ()), src, dest)
    for f in bookkeeping(dest, "data"):
        st = os.stat(f)
        assert (st.st_uid, st.st_mode & 0o707) == (0, 0o600), f
        assert can_read(ALICE, f) and not can_read(CAROL, f) and not can_read(BOB, f, TEAM), f
    engine.grant("data", str(dest), BOB)
    for f in bookkeeping(dest, "data"):
        assert can_read(BOB, f) and not can_read(CAROL, f), f
    for uid, shown in ((ALICE, True), (CAROL, False)):
        done = subprocess.run(
            [*as_user(uid), *shmstage_bin, "list", "--json", "--no-service", "--dest", str(dest)],
            capture_output=True, text=True,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert (str(src) in done.stdout) is shown, (uid, done.stdout)


def test_bookkeeping_follows_the_tops_group_and_other_access(team_home):
    """A top open to its group (0750): manifest and record 0640 with the top's group; a top
    open to all: 0644."""
    src, dest = team_home / "home" / "data", team_home / "dest"
    team_home.joinpath("home").chmod(0o755)
    os.chown(src, ALICE, TEAM)
    src.chmod(0o750)
    stage_as(Caller(ALICE, ALICE, ()), src, dest)
    assert os.stat(dest / "data").st_mode & 0o777 == 0o750
    for f in bookkeeping(dest, "data"):
        st = os.stat(f)
        assert (st.st_gid, st.st_mode & 0o777) == (TEAM, 0o640), f
        assert can_read(BOB, f, TEAM) and not can_read(CAROL, f), f
    src.chmod(0o755)
    engine.stage(str(src), dest=str(dest), force=True)
    for f in bookkeeping(dest, "data"):
        assert os.stat(f).st_mode & 0o777 == 0o644 and can_read(CAROL, f), f
