"""POSIX ACLs and who reads a copy: named entries of the source (a deny, a share) mean in
the copy what they meant at the source; an ancestor's ACL or "negative" bits close the
copy's top; a source's symlinks are resolved as the reader.  Real tmpfs, real users."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from shmstage.identity import Caller
from shmstage.stage import engine
from shmstage.stage.sources import acls
from tests.test_stage_reader import ALICE, BOB, CAROL, can_read, own, stage_as

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux)"),
]

MALLORY = 4375
INTERNS = 4381
INTERN = 4376  # a member of INTERNS only
ALICE_ALONE = Caller(ALICE, ALICE, ())


def set_acl(path: Path | str, mode: int, users=(), groups=(), default: bool = False) -> None:
    """An ACL on ``path``: ``mode``'s classes plus named ``users``/``groups`` ([(id, perm)]),
    mask rwx; the default ACL of a directory with ``default``."""
    ents = [(0x01, mode >> 6 & 7, 0xFFFFFFFF)]
    ents += [(0x02, p, u) for u, p in sorted(users)]
    ents += [(0x04, mode >> 3 & 7, 0xFFFFFFFF)]
    ents += [(0x08, p, g) for g, p in sorted(groups)]
    ents += [(0x10, 7, 0xFFFFFFFF), (0x20, mode & 7, 0xFFFFFFFF)]
    raw = struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in ents)
    name = "system.posix_acl_default" if default else "system.posix_acl_access"
    os.setxattr(path, name, raw, follow_symlinks=False)


@pytest.fixture
def base(open_tmpfs) -> Path:
    top = open_tmpfs("32M")
    top.chmod(0o755)
    return top


def test_a_link_through_a_directory_the_reader_cannot_search_tells_nothing(base):
    """mallory's source holds an absolute link through alice's 0700 home: whether ``cur`` in
    it is a symlink (it is) or not there at all, her stage gets the same answer."""
    home = base / "alice"
    (home / "a" / "b").mkdir(parents=True)
    os.symlink(home / "a" / "b", home / "cur")
    home.chmod(0o700)
    own(home, ALICE)
    src = base / "m" / "src"
    src.mkdir(parents=True)
    (src / "f").write_bytes(b"x")
    own(base / "m", MALLORY)
    outcomes = []
    for i, guess in enumerate(("cur", "nothere")):
        link = src / "probe"
        if os.path.lexists(link):
            link.unlink()
        os.symlink(f"{home}/{guess}/../../../m/src/f", link)
        os.lchown(link, MALLORY, MALLORY)
        out = stage_as(Caller(MALLORY, MALLORY, ()), src, base / "dest", name=f"p{i}")
        outcomes.append(out[:2] if out[0] == "error" else "staged")
    assert outcomes[0] == outcomes[1] == ("error", "RefusedError"), outcomes


def test_an_ancestor_acl_that_shuts_a_user_out_closes_the_copy_top(base):
    """proj/ (0755) carries ``user:mallory:---``: mallory cannot reach proj/data at the
    source, so the copy's top is closed to group and other (owner only)."""
    proj = base / "proj"
    (proj / "data").mkdir(parents=True)
    (proj / "data" / "f").write_bytes(b"SECRET")
    (proj / "data" / "f").chmod(0o644)
    set_acl(proj, 0o755, users=[(MALLORY, 0)])
    own(proj, ALICE)
    assert not can_read(MALLORY, proj / "data" / "f") and can_read(CAROL, proj / "data" / "f")
    path, _ = stage_as(ALICE_ALONE, proj / "data", base / "dest")
    assert os.stat(path).st_mode & 0o077 == 0
    assert not can_read(MALLORY, Path(path) / "f")
    assert can_read(ALICE, Path(path) / "f")


def test_an_ancestor_with_negative_group_bits_closes_the_copy_top(base):
    """proj/ is 0705, group INTERNS: an intern may not pass though others may; the copy's
    "other" class would be the interns too, so the copy's top is owner-only."""
    proj = base / "proj"
    (proj / "data").mkdir(parents=True)
    (proj / "data" / "f").write_bytes(b"SECRET")
    (proj / "data" / "f").chmod(0o644)
    own(proj, ALICE)
    os.chown(proj, ALICE, INTERNS)
    proj.chmod(0o705)
    assert not can_read(INTERN, proj / "data" / "f", INTERNS)
    assert can_read(CAROL, proj / "data" / "f")
    path, _ = stage_as(ALICE_ALONE, proj / "data", base / "dest")
    assert os.stat(path).st_mode & 0o077 == 0
    assert not can_read(INTERN, Path(path) / "f", INTERNS)
    assert can_read(ALICE, Path(path) / "f")


def test_a_reader_an_ancestor_acl_lets_in_is_let_into_the_closed_top(base):
    """proj/ is 0700 plus ``user:bob:r-x``: bob's own stage is handed the copy and reads
    it (the grant); carol is refused at the source and cannot read the copy."""
    proj = base / "proj"
    (proj / "data").mkdir(parents=True)
    (proj / "data" / "f").write_bytes(b"SHARED")
    (proj / "data" / "f").chmod(0o644)
    set_acl(proj, 0o700, users=[(BOB, 5)])
    own(proj, ALICE)
    path, _ = stage_as(ALICE_ALONE, proj / "data", base / "dest")
    assert stage_as(Caller(BOB, BOB, ()), proj / "data", base / "dest") == (path, False)
    assert can_read(BOB, Path(path) / "f")
    assert not can_read(CAROL, Path(path) / "f")


def acl_tree(base: Path) -> Path:
    """src/ (alice's, 0755): f (0644, ``user:mallory:---``), sub/ (0755, ``group:interns:---``
    and a default ACL) holding g (0644), shared (0600, ``user:bob:r--``)."""
    src = base / "src"
    (src / "sub").mkdir(parents=True)
    for p in (src / "f", src / "sub" / "g", src / "shared"):
        p.write_bytes(b"SECRET " + p.name.encode())
        p.chmod(0o644)
    (src / "shared").chmod(0o600)
    set_acl(src / "f", 0o644, users=[(MALLORY, 0)])
    set_acl(src / "sub", 0o755, groups=[(INTERNS, 0)])
    set_acl(src / "sub", 0o755, groups=[(INTERNS, 0)], default=True)
    set_acl(src / "shared", 0o600, users=[(BOB, 4)])
    own(src, ALICE)
    assert not can_read(MALLORY, src / "f") and can_read(CAROL, src / "f")
    assert not can_read(INTERN, src / "sub" / "g", INTERNS) and can_read(CAROL, src / "sub" / "g")
    assert can_read(BOB, src / "shared") and not can_read(CAROL, src / "shared")
    return src


def test_named_acl_entries_mean_in_the_copy_what_they_meant_at_the_source(base):
    """A named deny (``user:mallory:---`` on a file, ``group:interns:---`` on a directory)
    keeps them out of the copy; a file shared by ACL only (``user:bob:r--``) is readable
    by bob in the copy he is handed; everyone else reads what they read at the source."""
    src = acl_tree(base)
    path, _ = stage_as(ALICE_ALONE, src, base / "dest")
    copy = Path(path)
    assert not can_read(MALLORY, copy / "f")
    assert not can_read(INTERN, copy / "sub" / "g", INTERNS)
    assert can_read(CAROL, copy / "f") and can_read(CAROL, copy / "sub" / "g")
    assert not can_read(CAROL, copy / "shared")
    for rel in ("f", "sub", "shared"):
        name = "system.posix_acl_access"
        assert os.getxattr(copy / rel, name) == os.getxattr(src / rel, name), rel
    dflt = "system.posix_acl_default"
    assert os.getxattr(copy / "sub", dflt) == os.getxattr(src / "sub", dflt)
    # bob's own stage of it (the service's way): handed out, and he reads the shared file
    assert stage_as(Caller(BOB, BOB, ()), src, base / "dest") == (path, False)
    assert can_read(BOB, copy / "shared")
    assert engine.verify("src", str(base / "dest")).ok


def test_a_changed_acl_is_a_changed_source(base):
    """Only the ACL changes (mallory let in): the re-stage copies it again, and a re-stage
    after mallory is shut out again shuts her out of the copy too."""
    src = acl_tree(base)
    path, _ = stage_as(ALICE_ALONE, src, base / "dest")
    set_acl(src / "f", 0o644, users=[(MALLORY, 4)])
    assert stage_as(ALICE_ALONE, src, base / "dest") == (path, True)
    assert can_read(MALLORY, Path(path) / "f")
    set_acl(src / "f", 0o644, users=[(MALLORY, 0)])
    assert stage_as(ALICE_ALONE, src, base / "dest") == (path, True)
    assert not can_read(MALLORY, Path(path) / "f")


def test_a_dest_without_acls_narrows_the_modes_instead(base, monkeypatch):
    """Where DEST takes no ACL (acls.supported: ramfs, below; tmpfs always takes them, so
    the probe's answer is forced here) the copy has none, and its modes are narrowed so that
    nobody a named entry shut out reads it (mallory, the interns: nor anyone else in
    their class); the owner reads all."""
    src = acl_tree(base)
    monkeypatch.setattr(acls, "supported", lambda directory: False)
    path, _ = stage_as(ALICE_ALONE, src, base / "dest")
    copy = Path(path)
    assert not can_read(MALLORY, copy / "f")
    assert not can_read(INTERN, copy / "sub" / "g", INTERNS)
    assert not can_read(CAROL, copy / "shared")
    assert can_read(ALICE, copy / "f") and can_read(ALICE, copy / "sub" / "g")
    for rel in ("f", "sub", "shared"):
        assert "system.posix_acl_access" not in os.listxattr(copy / rel), rel
    assert engine.verify("src", str(base / "dest")).ok


def test_the_acl_probe_tells_a_file_system_without_acls(base):
    """tmpfs takes ACLs; ramfs (no xattrs at all) does not."""
    ram = base / "ram"
    ram.mkdir()
    subprocess.run(["mount", "-t", "ramfs", "ramfs", str(ram)], check=True)
    try:
        assert acls.supported(str(base)) and not acls.supported(str(ram))
    finally:
        subprocess.run(["umount", "-l", str(ram)], check=False)
