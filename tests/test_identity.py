"""shmstage.identity: a thread reads as the caller inside ``reading_as`` and as root outside
it, other threads untouched; groups adopted process-wide; the irreversible drop.

Real kernel credentials: each test that changes the process's groups or ids runs in a
forked child, so the test process stays root with its own groups."""

from __future__ import annotations

import os
import pickle
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from shmstage.errors import PermissionDenied
from shmstage.identity import Caller, Share, adopt_groups, become, fs_ids, reading_as

pytestmark = pytest.mark.root

ALICE = 4351
BOB = 4352
TEAM = 4360  # a group alice is in and bob is not


def in_child(fn: Callable[[], Any]) -> Any:
    """``fn()`` in a forked child; its result (or its exception, re-raised) comes back."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        os.close(r)
        try:
            out: Any = ("ok", fn())
        except BaseException as e:  # noqa: BLE001 - everything goes back to the parent
            out = ("err", (e, traceback.format_exc()))
        with os.fdopen(w, "wb") as f:
            pickle.dump(out, f)
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    kind, value = pickle.loads(data)
    if kind == "err":
        err, tb = value
        if isinstance(err, AssertionError):
            raise AssertionError(tb)
        raise err
    return value


def readable(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY)
    except PermissionError:
        return False
    os.close(fd)
    return True


@pytest.fixture
def secrets(open_tmp_path: Path) -> dict[str, Path]:
    """root's 0600 file, a TEAM-readable 0640 file of root, and alice's 0700 directory."""
    mine = open_tmp_path / "root-only"
    mine.write_text("root")
    mine.chmod(0o600)
    team = open_tmp_path / "team"
    team.write_text("team")
    os.chown(team, 0, TEAM)
    team.chmod(0o640)
    home = open_tmp_path / "alice"
    home.mkdir()
    (home / "f").write_text("alice")
    os.chown(home, ALICE, ALICE)
    home.chmod(0o700)
    return {"mine": mine, "team": team, "home": home}


def test_a_block_reads_with_the_callers_permissions_and_root_is_back_after(secrets):
    """Inside: root's 0600 file is refused to bob, alice's 0700 dir too; after: both open."""
    bob = Caller(BOB, BOB, ())
    with reading_as(bob):
        assert fs_ids() == (BOB, BOB)
        assert not readable(secrets["mine"])
        with pytest.raises(PermissionError):
            os.listdir(secrets["home"])
    assert fs_ids() == (0, 0)
    assert readable(secrets["mine"]) and os.listdir(secrets["home"]) == ["f"]


def test_the_owner_reads_her_own_directory_inside_the_block(secrets):
    """The kernel's owner rule applies to the caller: alice lists her 0700 home as alice."""
    with reading_as(Caller(ALICE, ALICE, ())):
        assert os.listdir(secrets["home"]) == ["f"]


def test_none_and_root_change_nothing():
    """reading_as(None) and reading_as(root) leave the thread root."""
    with reading_as(None):
        assert fs_ids() == (0, 0)
    with reading_as(Caller(0, 0, ())):
        assert fs_ids() == (0, 0)


def test_blocks_nest_and_each_restores_what_it_found():
    """alice inside bob inside nothing: each exit puts back the ids in force at its entry."""
    with reading_as(Caller(BOB, BOB, ())):
        with reading_as(Caller(ALICE, TEAM, ())):
            assert fs_ids() == (ALICE, TEAM)
            with reading_as(Caller(ALICE, TEAM, ())):  # the same ids: free, and kept on exit
                assert fs_ids() == (ALICE, TEAM)
            assert fs_ids() == (ALICE, TEAM)
        assert fs_ids() == (BOB, BOB)
    assert fs_ids() == (0, 0)


def test_an_exception_in_the_block_still_restores_root():
    with pytest.raises(RuntimeError), reading_as(Caller(BOB, BOB, ())):
        raise RuntimeError("boom")
    assert fs_ids() == (0, 0)


def test_the_switch_is_this_threads_only(secrets):
    """While the main thread reads as bob, another thread still reads as root."""
    seen: list[Any] = []
    go, done = threading.Event(), threading.Event()

    def other() -> None:
        go.wait(10)
        seen.append((fs_ids(), readable(secrets["mine"])))
        done.set()

    t = threading.Thread(target=other)
    t.start()
    with reading_as(Caller(BOB, BOB, ())):
        go.set()
        done.wait(10)
        assert not readable(secrets["mine"])
    t.join()
    assert seen == [((0, 0), True)]


def test_adopted_groups_open_a_group_readable_file_and_only_those(secrets):
    """In a child that adopted alice's groups (TEAM), the 0640 TEAM file opens as alice; in a
    child with bob's (none), it does not."""
    team = secrets["team"]

    def as_(caller: Caller) -> bool:
        adopt_groups(caller)
        with reading_as(caller):
            return readable(team)

    assert in_child(lambda: as_(Caller(ALICE, ALICE, (TEAM,))))
    assert not in_child(lambda: as_(Caller(BOB, BOB, ())))


def test_without_the_privilege_to_switch_the_block_fails_closed(secrets):
    """A process that is bob cannot read as alice: PermissionDenied, and nothing opened."""

    def try_it() -> str:
        become(Caller(BOB, BOB, ()))
        try:
            with reading_as(Caller(ALICE, ALICE, ())):
                return "switched"
        except PermissionDenied as e:
            return f"refused: {e} {fs_ids()}"

    out = in_child(try_it)
    assert out.startswith("refused: cannot read as") and out.endswith(f"({BOB}, {BOB})"), out


def test_become_drops_for_good(secrets):
    """After become(bob): ids are bob's everywhere, root's file is closed, setuid(0) fails."""

    def drop() -> tuple[Any, ...]:
        become(Caller(BOB, BOB, (TEAM,)))
        try:
            os.setuid(0)
            back = True
        except PermissionError:
            back = False
        return os.getresuid(), os.getresgid(), os.getgroups(), readable(secrets["mine"]), back

    assert in_child(drop) == ((BOB,) * 3, (BOB,) * 3, [TEAM], False, False)


def test_caller_of_self_and_share_defaults():
    me = Caller.of_self()
    assert (me.uid, me.gid, me.pid, me.is_root) == (0, os.getegid(), os.getpid(), True)
    assert not Caller(BOB, BOB, ()).is_root
    assert Share() == Share(None, False)
