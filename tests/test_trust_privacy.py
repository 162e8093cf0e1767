"""What a staged copy may reveal: sources swapped under a root stager, the group of a user's
copy, symlinks that climb out of the staged tree, names that are not what they seem.

Real tmpfs, real users through setpriv, real processes stopped and resumed with signals."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from shmstage.stage.build import copier
from shmstage.stage.sources import beneath

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux)"),
]

MALLORY = 4343  # owns the source's subdirectories: she may rename and link in them
VICTIM = 4344  # owns a 0700 directory mallory cannot read
SECRET = b"TOP-SECRET-" + b"v" * 4085  # one page: the decoy has the same size
DECOY = b"decoy------" + b"m" * 4085


def as_user(uid: int, gid: int | None = None, groups: str | None = None) -> list[str]:
    grp = f"--groups={groups}" if groups else "--clear-groups"
    return ["setpriv", f"--reuid={uid}", f"--regid={uid if gid is None else gid}", grp]


def own(path: Path, uid: int, gid: int | None = None) -> None:
    for p in [path, *path.rglob("*")]:
        os.lchown(p, uid, uid if gid is None else gid)


def everything_under(top: Path) -> bytes:
    """The bytes of every regular file under ``top`` (never following links)."""
    out = []
    for dirpath, _dirs, files in os.walk(top):
        for f in files:
            p = os.path.join(dirpath, f)
            if os.path.isfile(p) and not os.path.islink(p):
                out.append(Path(p).read_bytes())
    return b"".join(out)


# --- 1. a directory swapped for a symlink while root copies --------------------------


def swap_world(world: Path) -> tuple[Path, Path]:
    """src/ (mallory's) with a/ (8 files, copied first) and d/secret (her decoy); vault/ (0700,
    the victim's) holds a secret of the decoy's size and mtime."""
    src, vault = world / "src", world / "vault"
    (src / "a").mkdir(parents=True)
    for i in range(8):
        (src / "a" / f"f{i}").write_bytes(os.urandom(100))
    (src / "d").mkdir()
    (src / "d" / "secret").write_bytes(DECOY)
    vault.mkdir()
    (vault / "secret").write_bytes(SECRET)
    st = (src / "d" / "secret").stat()
    os.utime(vault / "secret", ns=(st.st_atime_ns, st.st_mtime_ns))
    own(src, MALLORY)
    own(vault, VICTIM)
    vault.chmod(0o700)
    assert subprocess.run([*as_user(MALLORY), "cat", str(vault / "secret")]).returncode != 0
    return src, vault


def stage_and_act_mid_copy(
    procs, argv: list[str], landed: Path, act: Callable[[], None], slow: str = "0.5"
) -> tuple[int, str]:
    """Run the stage ``argv`` one file every ``slow`` seconds (one worker); once ``landed``
    exists (the copy is under way) stop its session, ``act``, let it go on; (exit, stderr)."""
    env = {**os.environ, copier.SLOW_ENV: slow}
    p = procs.start(
        [*argv, "--workers", "1"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while not landed.exists():
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()
        time.sleep(0.01)
    os.killpg(p.pid, signal.SIGSTOP)
    try:
        act()
    finally:
        os.killpg(p.pid, signal.SIGCONT)
    _out, err = p.communicate(timeout=120)  # (the old copier waited for a FIFO's writer)
    return p.returncode, err.decode()


def stage_with_swap(world: Path, shmstage_bin, procs, src: Path, vault: Path, dest: Path):
    """Root stages ``src`` one file at a time; once the copy is under way (a/ landing), the
    stager is stopped, mallory replaces d/ with a symlink to the vault, and it goes on."""
    argv = [*shmstage_bin, "stage", str(src), "--dest", str(dest)]
    swap = f"mv {src}/d {src}/d.old && ln -s {vault} {src}/d"
    landed = dest / ".shmstage" / "partial" / "src" / "a" / "f0"  # a/ takes 4 s: d/ after it
    rc, err = stage_and_act_mid_copy(
        procs, argv, landed, lambda: subprocess.run([*as_user(MALLORY), "sh", "-c", swap], check=True)
    )
    return rc, "", err


def test_dir_swapped_for_a_symlink_mid_copy_is_refused_and_the_secret_never_lands(
    open_tmpfs, shmstage_bin, procs
):
    """A first copy: d/ becomes a symlink to a 0700 dir after the walk; exit 1 naming d/secret."""
    world = open_tmpfs("64M")
    src, vault = swap_world(world)
    dest = world / "dest"
    rc, _out, err = stage_with_swap(world, shmstage_bin, procs, src, vault, dest)
    assert rc == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "d/secret" in lines[0], err
    assert b"TOP-SECRET" not in everything_under(dest)
    assert not (dest / "src").exists()


@pytest.mark.parametrize("swap_in", ["symlink", "directory", "nothing"])
def test_a_dir_swapped_while_its_batch_is_copied_is_refused(
    open_tmpfs, shmstage_bin, procs, swap_in
):
    """A worker opens a batch's directory once and its files by name: b/ renamed away while
    b/'s batch is copied (b/f0 landed, f1-f7 to come), a symlink or another directory with
    the same names put in its place (or nothing): the batch's directory is not at its path when
    the batch ends, so the stage fails in one line naming a file of b/ (as a per-file open
    by path did), nothing is published and nothing of the vault lands."""
    world = open_tmpfs("64M")
    src, vault, dest = world / "src", world / "vault", world / "dest"
    (src / "b").mkdir(parents=True)
    vault.mkdir()
    for i in range(8):
        (src / "b" / f"f{i}").write_bytes(os.urandom(100))
        (vault / f"f{i}").write_bytes(SECRET)
    own(src, MALLORY)
    own(vault, VICTIM)
    vault.chmod(0o700)
    argv = [*shmstage_bin, "stage", str(src), "--dest", str(dest)]
    put = {"symlink": f"ln -s {vault} {src}/b", "directory": f"cp -a {src}/b.old {src}/b"}
    swap = [*as_user(MALLORY), "sh", "-c", f"mv {src}/b {src}/b.old && {put.get(swap_in, 'true')}"]
    landed = dest / ".shmstage" / "partial" / "src" / "b" / "f0"
    rc, err = stage_and_act_mid_copy(
        procs, argv, landed, lambda: subprocess.run(swap, check=True), slow="0.2"
    )
    assert rc == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: source file ") and "/b/f" in lines[0], err
    # gone with nothing in its place: "vanished", as the next file's open by path said
    assert ("vanished" if swap_in == "nothing" else "was replaced") in lines[0], err
    assert b"TOP-SECRET" not in everything_under(dest)
    assert not (dest / "src").exists()


def test_a_dir_its_owner_closes_before_its_batch_is_one_permission_line(
    open_tmpfs, shmstage_bin, procs
):
    """A user stages her own tree and, while a/ is copied, makes x/ unsearchable: x/b's batch
    cannot open its directory (nor its read-ahead hint): one line, "cannot read source file
    .../x/b/g0: Permission denied", exit 1, nothing published (the hint once failed with an
    internal error instead)."""
    world = open_tmpfs("64M")
    src, dest = world / "src", world / "dest"
    (src / "a").mkdir(parents=True)
    (src / "x" / "b").mkdir(parents=True)
    for i in range(4):
        (src / "a" / f"f{i}").write_bytes(os.urandom(100))
        (src / "x" / "b" / f"g{i}").write_bytes(os.urandom(100))
    dest.mkdir()
    own(src, MALLORY)
    own(dest, MALLORY)
    argv = [*as_user(MALLORY), *shmstage_bin, "stage", str(src), "--dest", str(dest)]
    close = [*as_user(MALLORY), "chmod", "000", str(src / "x")]
    landed = dest / ".shmstage" / "partial" / "src" / "a" / "f0"
    act = lambda: subprocess.run(close, check=True)  # noqa: E731
    rc, err = stage_and_act_mid_copy(procs, argv, landed, act, slow="0.2")
    (src / "x").chmod(0o755)
    assert rc == 1, err
    lines = err.strip().splitlines()
    assert lines == [
        f"Error: cannot read source file {src}/x/b/g0: Permission denied; stage as a user who "
        "can read every file of the source"
    ], err
    assert not (dest / "src").exists()


def test_restage_with_a_dir_swapped_for_a_symlink_mid_copy_is_refused(
    open_tmpfs, shmstage_bin, procs
):
    """A restage (changed files only): the same swap is refused; the published copy stays."""
    world = open_tmpfs("64M")
    src, vault = swap_world(world)
    dest = world / "dest"
    first = subprocess.run(
        [*shmstage_bin, "stage", str(src), "--dest", str(dest)], capture_output=True, text=True
    )
    assert first.returncode == 0, first.stderr
    for i in range(8):  # a/ and d/secret changed: the restage copies them again
        (src / "a" / f"f{i}").write_bytes(os.urandom(100))
    (src / "d" / "secret").write_bytes(DECOY[::-1])
    st = (src / "d" / "secret").stat()
    os.utime(vault / "secret", ns=(st.st_atime_ns, st.st_mtime_ns))
    rc, _out, err = stage_with_swap(world, shmstage_bin, procs, src, vault, dest)
    assert rc == 1, err
    assert "d/secret" in err and "Traceback" not in err, err
    assert b"TOP-SECRET" not in everything_under(dest)
    assert (dest / "src" / "d" / "secret").read_bytes() == DECOY


def test_verify_checksum_does_not_read_through_a_swapped_dir(open_tmpfs, shmstage_bin):
    """verify --checksum after d/ became a symlink: a difference (exit 3), never 'OK'."""
    world = open_tmpfs("64M")
    src, vault = swap_world(world)
    dest = world / "dest"
    (vault / "secret").write_bytes(DECOY)  # same bytes: only the path tells them apart
    st = (src / "d" / "secret").stat()
    os.utime(vault / "secret", ns=(st.st_atime_ns, st.st_mtime_ns))
    done = subprocess.run(
        [*shmstage_bin, "stage", str(src), "--dest", str(dest)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    os.rename(src / "d", src / "d.old")
    os.symlink(vault, src / "d")
    check = subprocess.run(
        [*shmstage_bin, "verify", "src", "--dest", str(dest), "--checksum"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert check.returncode == 3, check.stdout + check.stderr
    assert "d/secret" in check.stdout + check.stderr


@pytest.mark.parametrize("openat2", [True, False], ids=["openat2", "per-component"])
def test_source_tree_opens_below_its_root_and_never_through_a_symlink(
    tmp_path, monkeypatch, openat2
):
    """SourceTree.open: a plain path opens; a symlinked directory on the way is ELOOP/ENOTDIR,
    with openat2 and with the per-component fallback of older kernels."""
    import errno

    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_bytes(b"ok")
    (tmp_path / "vault").mkdir()
    (tmp_path / "vault" / "f").write_bytes(b"secret")
    (tmp_path / "l").symlink_to(tmp_path / "vault")
    monkeypatch.setattr(beneath, "_openat2", [] if openat2 else [False])
    with beneath.SourceTree(str(tmp_path)) as tree:
        fd = tree.open("d/f", os.O_RDONLY)
        try:
            assert os.read(fd, 10) == b"ok"
        finally:
            os.close(fd)
        with pytest.raises(OSError) as e:
            tree.open("l/f", os.O_RDONLY)
        assert e.value.errno in (errno.ELOOP, errno.ENOTDIR)
        assert tree.lstat("d/f").st_size == 2
        with pytest.raises(OSError):
            tree.lstat("l/f")


@pytest.mark.parametrize("openat2", [True, False], ids=["openat2", "per-component"])
def test_source_tree_opens_a_name_in_a_directory_it_found_and_never_a_symlink(
    tmp_path, monkeypatch, openat2
):
    """SourceTree.open_dir + open(name, at=): the copier's per-task directory.  The directory
    is found beneath the top without a symlink on the way; a name in it opens, a symlink by
    that name is ELOOP, and "..", "." or a path with "/" are refused (EXDEV) rather than
    resolved from the directory."""
    import errno

    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_bytes(b"ok")
    (tmp_path / "vault").mkdir()
    (tmp_path / "vault" / "f").write_bytes(b"secret")
    (tmp_path / "d" / "link").symlink_to(tmp_path / "vault" / "f")
    (tmp_path / "l").symlink_to(tmp_path / "vault")
    monkeypatch.setattr(beneath, "_openat2", [] if openat2 else [False])
    with beneath.SourceTree(str(tmp_path)) as tree:
        at = tree.open_dir("d")
        try:
            fd = tree.open_file("f", os.O_RDONLY, at=at)
            try:
                assert os.read(fd, 10) == b"ok"
            finally:
                os.close(fd)
            with pytest.raises(OSError) as e:
                tree.open("link", os.O_RDONLY, at)
            assert e.value.errno == errno.ELOOP
            for bad in ("..", ".", "", "../vault/f", "x/f"):
                with pytest.raises(OSError) as e:
                    tree.open(bad, os.O_RDONLY, at)
                assert e.value.errno == errno.EXDEV, bad
        finally:
            os.close(at)
        with pytest.raises(OSError) as e:
            tree.open_dir("l")
        assert e.value.errno in (errno.ELOOP, errno.ENOTDIR)
        top = tree.open_dir("")
        try:
            assert os.fstat(top).st_ino == (tmp_path).stat().st_ino
        finally:
            os.close(top)


# --- 2. the group of a copy a user stages ------------------------------------------

STAGER, PRIMARY, PROJECT = 4345, 4346, 4347  # the stager, its primary group, the data's group
COLLEAGUE = 4348  # in the stager's primary group only


def group_world(world: Path) -> Path:
    """src/ (0755, the stager's, group PROJECT): a 0640 file and a 0750 directory with a 0640
    file: only the stager and PROJECT's members read them."""
    src = world / "gsrc"
    (src / "sub").mkdir(parents=True)
    (src / "f").write_bytes(b"project data\n")
    (src / "sub" / "g").write_bytes(b"more project data\n")
    own(src, STAGER, PROJECT)
    src.chmod(0o755)
    (src / "sub").chmod(0o750)
    (src / "f").chmod(0o640)
    (src / "sub" / "g").chmod(0o640)
    return src


def stage_as(src: Path, dest: Path, shmstage_bin, groups: str | None, *more: str):
    return subprocess.run(
        [*as_user(STAGER, PRIMARY, groups), *shmstage_bin, "stage", str(src), "--dest", str(dest)]
        + list(more),
        capture_output=True,
        text=True,
    )


def test_a_user_outside_the_source_group_gets_no_group_bits(open_tmpfs, shmstage_bin):
    """The stager is not in the data's group: no copy is readable by the stager's primary group
    (group bits cleared on files and directories); verify is clean, a restage copies nothing."""
    world = open_tmpfs("64M")
    src = group_world(world)
    dest = world / "dest"
    done = stage_as(src, dest, shmstage_bin, None)
    assert done.returncode == 0, done.stderr
    for rel in ("f", "sub", "sub/g"):
        st = (dest / "gsrc" / rel).lstat()
        assert st.st_gid == PROJECT or st.st_mode & 0o070 == 0, (rel, st.st_gid, oct(st.st_mode))
    assert (dest / "gsrc").stat().st_mode & 0o777 == 0o755  # what others may, the group may
    peek = subprocess.run([*as_user(COLLEAGUE, PRIMARY), "cat", str(dest / "gsrc" / "f")])
    assert peek.returncode != 0  # the premise of the leak: at the source she could not
    check = subprocess.run(
        [*as_user(STAGER, PRIMARY), *shmstage_bin, "verify", "gsrc", "--dest", str(dest)],
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    again = stage_as(src, dest, shmstage_bin, None, "--json")
    assert again.returncode == 0 and '"changed": false' in again.stdout, again.stdout + again.stderr


def test_a_user_in_the_source_group_keeps_it(open_tmpfs, shmstage_bin):
    """The stager is in the data's group: every copy keeps that group and the source's mode."""
    world = open_tmpfs("64M")
    src = group_world(world)
    dest = world / "dest"
    done = stage_as(src, dest, shmstage_bin, str(PROJECT))
    assert done.returncode == 0, done.stderr
    for rel, mode in (("f", 0o640), ("sub", 0o750), ("sub/g", 0o640)):
        st = (dest / "gsrc" / rel).lstat()
        assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (STAGER, PROJECT, mode), rel
    check = subprocess.run(
        [
            *as_user(STAGER, PRIMARY, str(PROJECT)),
            *shmstage_bin,
            "verify",
            "gsrc",
            "--dest",
            str(dest),
        ],
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stdout + check.stderr


# --- 3. symlinks that climb out through the tree's top ----------------------------


def test_a_link_that_climbs_through_the_root_back_into_the_source_is_refused(
    tmp_path, tmpfs, shmstage_bin
):
    """x -> ../../..$SRC/data stays in SRC at the source, but in the copy it reads the slow
    source: refused (exit 2, one line naming the link), nothing published."""
    src = tmp_path / "src"
    (src / "data").mkdir(parents=True)
    (src / "data" / "f").write_bytes(b"slow\n")
    up = "/".join([".."] * len(src.parts))  # from src/ up to / (and no further)
    (src / "x").symlink_to(up + str(src) + "/data")
    assert (src / "x" / "f").read_bytes() == b"slow\n"  # the premise: it resolves inside SRC
    dest = tmpfs("16M") / "dest"
    done = subprocess.run(
        [*shmstage_bin, "stage", str(src), "--dest", str(dest)], capture_output=True, text=True
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("Error: "), done.stderr
    assert f"{src}/x ->" in done.stderr
    assert not (dest / "src").exists()


@pytest.mark.parametrize("via_link", [False, True], ids=["direct", "through-a-link"])
def test_a_link_into_another_dataset_is_refused(tmp_path, tmpfs, shmstage_bin, via_link):
    """Source L staged as M: x -> ../L/data (or a -> . plus x -> a/../L/data) stays in L at
    the source but reads dataset L under DEST once staged as M: refused."""
    src = tmp_path / "L"
    (src / "data").mkdir(parents=True)
    (src / "data" / "f").write_bytes(b"L's\n")
    if via_link:
        (src / "a").symlink_to(".")
        (src / "x").symlink_to("a/../L/data")
    else:
        (src / "x").symlink_to("../L/data")
    assert (src / "x" / "f").read_bytes() == b"L's\n"
    dest = tmpfs("16M") / "dest"
    done = subprocess.run(
        [*shmstage_bin, "stage", str(src), "--dest", str(dest), "--name", "M"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"{src}/x ->" in done.stderr and done.stderr.count("\n") == 1, done.stderr
    assert not (dest / "M").exists()


def test_links_that_stay_inside_still_stage(tmp_path, tmpfs, shmstage_bin):
    """In-tree links, also through other links and a loop, are kept as links."""
    src = tmp_path / "src"
    (src / "d" / "e").mkdir(parents=True)
    (src / "d" / "e" / "f").write_bytes(b"x")
    (src / "up").symlink_to("d/e/..")
    (src / "g").symlink_to("up/e/f")
    (src / "d" / "e" / "back").symlink_to("../../d/e/f")
    (src / "loop").symlink_to("loop")
    dest = tmpfs("16M") / "dest"
    done = subprocess.run(
        [*shmstage_bin, "stage", str(src), "--dest", str(dest)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert (dest / "src" / "g").read_bytes() == b"x"
    assert (dest / "src" / "d" / "e" / "back").read_bytes() == b"x"
    assert os.readlink(dest / "src" / "loop") == "loop"


# --- 4. names -------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["ds\n", "-ds"], ids=["trailing-newline", "leading-dash"])
def test_a_name_with_a_final_newline_or_a_leading_dash_is_refused(
    tmp_path, tmpfs, shmstage_bin, name
):
    """'ds\\n' (the shell strips the newline: the job reads ds) and '-ds' (an option): exit 2."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_bytes(b"x")
    dest = tmpfs("16M") / "dest"
    done = subprocess.run(
        [*shmstage_bin, "stage", str(src), "--dest", str(dest), "--name", name],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith("Error: invalid dataset name") and done.stderr.count("\n") == 1
    assert not dest.exists() or os.listdir(dest) in ([], [".shmstage"])


def test_a_source_path_that_is_not_utf8_stages_with_the_same_bytes(tmp_path, tmpfs, shmstage_bin):
    """A source dir named b'src\\xe9' holding b'd\\xff/f\\xe9': staged (exit 0), the copy has
    the same bytes names, verify --checksum is clean."""
    src = os.fsencode(tmp_path) + b"/src\xe9"
    os.makedirs(src + b"/d\xff")
    with open(src + b"/d\xff/f\xe9", "wb") as f:
        f.write(b"latin-1 named\n")
    dest = os.fsencode(tmpfs("16M") / "dest")
    done = subprocess.run(
        [*map(os.fsencode, shmstage_bin), b"stage", src, b"--dest", dest, b"--name", b"lat"],
        capture_output=True,
    )
    assert done.returncode == 0, done.stderr
    with open(dest + b"/lat/d\xff/f\xe9", "rb") as f:
        assert f.read() == b"latin-1 named\n"
    check = subprocess.run(
        [*map(os.fsencode, shmstage_bin), b"verify", b"lat", b"--dest", dest, b"--checksum"],
        capture_output=True,
    )
    assert check.returncode == 0, check.stdout + check.stderr


def test_an_archive_link_that_climbs_out_through_another_link_is_refused(
    tmp_path, tmpfs, shmstage_bin
):
    """A tar with a -> . and x -> a/../L/data (normpath says inside) staged as M: exit 2."""
    import tarfile

    archive = tmp_path / "L.tar"
    with tarfile.open(archive, "w") as tf:
        for name, target in (("a", "."), ("x", "a/../L/data")):
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tf.addfile(info)
    dest = tmpfs("16M") / "dest"
    done = subprocess.run(
        [*shmstage_bin, "stage", str(archive), "--dest", str(dest), "--name", "M"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "'x'" in done.stderr and done.stderr.count("\n") == 1, done.stderr
    assert not (dest / "M").exists()


# --- the source's top swapped (hostile review findings 1 and 8) ------------------------


def top_swap_world(world: Path, big: int = 0) -> tuple[Path, Path]:
    """src/ (mallory's: a/ with 8 files, a_big of ``big`` bytes, secret: her decoy) and vault/
    (the victim's, 0700) laid out alike: the same names, sizes and mtimes, the vault's secret
    his."""
    src, vault = world / "home" / "src", world / "vault"
    for top in (src, vault):
        (top / "a").mkdir(parents=True)
    for i in range(8):
        (src / "a" / f"f{i}").write_bytes(os.urandom(100))
    if big:
        (src / "a_big").write_bytes(os.urandom(big))
    (src / "secret").write_bytes(DECOY)
    subprocess.run(["cp", "-a", f"{src}/.", f"{vault}/"], check=True)
    (vault / "secret").write_bytes(SECRET)
    st = (src / "secret").stat()
    os.utime(vault / "secret", ns=(st.st_atime_ns, st.st_mtime_ns))
    own(src.parent, MALLORY)
    own(vault, VICTIM)
    vault.chmod(0o700)
    (vault / "secret").chmod(0o600)
    return src, vault


def swap_top(src: Path, vault: Path) -> None:
    """Mallory renames her source away and puts a symlink to the vault in its place."""
    swap = f"mv {src} {src}.old && ln -s {vault} {src}"
    subprocess.run([*as_user(MALLORY), "sh", "-c", swap], check=True)


def owners_under(top: Path) -> set[int]:
    return {os.lstat(p).st_uid for p in [top, *top.rglob("*")]}


def test_top_swapped_mid_copy_lends_no_owner_of_the_other_tree(open_tmpfs, shmstage_bin, procs):
    """Finding 8: the top itself becomes a symlink to the vault once the copy is under way:
    the directories' owners still come from the tree the walk listed (not the victim's)."""
    world = open_tmpfs("64M")
    src, vault = top_swap_world(world)
    dest = world / "dest"
    argv = [*shmstage_bin, "stage", str(src), "--dest", str(dest)]
    landed = dest / ".shmstage" / "partial" / "src" / "a" / "f0"
    rc, err = stage_and_act_mid_copy(procs, argv, landed, lambda: swap_top(src, vault))
    assert rc in (0, 1), err
    assert "Traceback" not in err, err
    assert b"TOP-SECRET" not in everything_under(dest)
    if rc == 0:
        assert VICTIM not in owners_under(dest / "src"), err
        assert (dest / "src" / "secret").read_bytes() == DECOY


@pytest.mark.timeout(300)
def test_cluster_top_swapped_mid_exchange_never_reads_the_other_tree(
    open_tmpfs, shmstage_bin, procs
):
    """Finding 1: two nodes (root) stage mallory's src; mid-exchange she swaps the top for a
    symlink to the victim's vault.  Every read and owner comes through the top the walk
    listed: no node publishes the vault's bytes or owners."""
    pytest.importorskip("torch.distributed", reason="cluster staging needs torch")
    world = open_tmpfs("256M")
    src, vault = top_swap_world(world, big=20 << 20)  # 10 pieces a node: secret comes last
    nodes = start_two_nodes(world, src, shmstage_bin, procs)
    stop_when_exchanging(world, nodes)
    try:
        swap_top(src, vault)
    finally:
        for n in nodes:
            os.killpg(n.pid, signal.SIGCONT)
    results = [(n.communicate(timeout=200), n.returncode) for n in nodes]
    for rank, ((_out, err), rc) in enumerate(results):
        assert rc in (0, 1), (rank, err)
        assert b"Traceback" not in err, err
        shm = world / f"shm{rank}"
        assert b"TOP-SECRET" not in everything_under(shm), (rank, rc, err)
        if rc == 0:
            assert VICTIM not in owners_under(shm / "data")
            assert (shm / "data" / "secret").read_bytes() == DECOY


def test_a_link_flipped_after_another_link_was_checked_is_refused(tmp_path):
    """Finding 3: t -> z/s/../(x9)/etc/passwd stays inside while z/s -> d1/.../d8; the tree's
    owner flips z/s to '.' after t was judged and before z/ is listed.  Links are judged on
    what the walk recorded, once it ended: the flipped tree is refused (the copy would hold
    z/s -> . and a t leading to the real /etc/passwd)."""
    from shmstage.errors import RefusedError
    from shmstage.stage.sources.walk import Walker

    src = tmp_path / "src"
    deep = src / "z" / "d1" / "d2" / "d3" / "d4" / "d5" / "d6" / "d7" / "d8"
    deep.mkdir(parents=True)
    (src / "z" / "s").symlink_to("d1/d2/d3/d4/d5/d6/d7/d8")
    (src / "z" / ".s-dot").symlink_to(".")
    (src / "t").symlink_to("z/s/" + "../" * 9 + "etc/passwd")
    walker = Walker(str(src), threads=1)
    found = iter(walker)
    assert next(found)[0][0] == "."
    top = next(found)  # the top's entries: t among them, z/ not listed yet
    assert [e[0] for e in top] == ["t", "z"]
    os.rename(src / "z" / ".s-dot", src / "z" / "s")
    with pytest.raises(RefusedError, match="climbs out"):
        for _ in found:
            pass


# --- a file turned into a FIFO once the copy started (findings 6 and 4) ---------------


def test_a_file_turned_into_a_fifo_mid_copy_fails_clearly_instead_of_hanging(
    open_tmpfs, shmstage_bin, procs
):
    """Finding 6: a/f7 becomes a named pipe once a/ is landing: the worker's open never
    blocks on it; exit 1 with one line saying it is not a regular file any more."""
    world = open_tmpfs("64M")
    src, _vault = top_swap_world(world)
    dest = world / "dest"
    argv = [*shmstage_bin, "stage", str(src), "--dest", str(dest)]
    landed = dest / ".shmstage" / "partial" / "src" / "a" / "f0"

    def fifo_for_f7() -> None:  # a/ is copied one file every 0.3 s: f7 comes last
        (src / "a" / "f7").unlink()
        os.mkfifo(src / "a" / "f7")

    rc, err = stage_and_act_mid_copy(procs, argv, landed, fifo_for_f7, slow="0.3")
    assert rc == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "a/f7" in lines[0], err
    assert "not a regular file any more" in lines[0], err
    assert not (dest / "src").exists()


@pytest.mark.timeout(300)
def test_cluster_file_turned_into_a_fifo_mid_exchange_fails_instead_of_hanging(
    open_tmpfs, shmstage_bin, procs
):
    """Finding 4: mid-exchange secret becomes a named pipe: the reader's open never blocks
    on it; both nodes exit 1 (the reading node naming the file) and publish nothing."""
    pytest.importorskip("torch.distributed", reason="cluster staging needs torch")
    world = open_tmpfs("256M")
    src, _vault = top_swap_world(world, big=20 << 20)
    nodes = start_two_nodes(world, src, shmstage_bin, procs)
    stop_when_exchanging(world, nodes)
    try:
        (src / "secret").unlink()
        os.mkfifo(src / "secret")
    finally:
        for n in nodes:
            os.killpg(n.pid, signal.SIGCONT)
    results = [(n.communicate(timeout=120), n.returncode) for n in nodes]
    errs = [err.decode() for (_out, err), _rc in results]
    assert [rc for _, rc in results] == [1, 1], errs
    assert any("secret is not a regular file any more" in e for e in errs), errs
    for rank in (0, 1):
        assert not (world / f"shm{rank}" / "data").exists()


def as_node(world: Path, rank: int, owner: int = 0) -> list[str]:
    """Run the rest as node ``rank``: in a mount namespace of its own where world/shm (the
    one --dest path every node of a job names) is world/shm<rank> (made ``owner``'s), seen
    from outside."""
    (world / f"shm{rank}").mkdir(exist_ok=True)
    os.chown(world / f"shm{rank}", owner, -1)
    (world / "shm").mkdir(exist_ok=True)
    script = 'mount --bind "$1" "$2" || exit 90; shift 2; exec "$@"'
    return [
        "unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh",
        str(world / f"shm{rank}"), str(world / "shm"),
    ]  # fmt: skip


def start_two_nodes(world: Path, src: Path, shmstage_bin, procs) -> list[subprocess.Popen]:
    """Two nodes (root) staging ``src`` as data into world/shm0 and world/shm1, slowly."""
    sock = __import__("socket").socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    env = {**os.environ, copier.SLOW_ENV: "0.4"}
    nodes = []
    for rank in (0, 1):
        argv = [
            *as_node(world, rank), *shmstage_bin, "stage", str(src), "--name", "data",
            "--dest", str(world / "shm"),
            "--reserve", "0", "--quiet", "--nodes", "2", "--node-rank", str(rank),
            "--rendezvous", f"127.0.0.1:{port}", "--inflight", "8M", "--timeout", "60",
        ]  # fmt: skip
        nodes.append(
            procs.start(
                argv,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )  # fmt: skip
        )
    return nodes


def stop_when_exchanging(world: Path, nodes: list[subprocess.Popen]) -> None:
    """SIGSTOP both nodes once node 0 wrote bytes of a_big (the secret is read last)."""
    partial = world / "shm0" / ".shmstage" / "partial" / "data"
    deadline = time.monotonic() + 120
    while not (partial / "a_big").exists() or (partial / "a_big").stat().st_blocks == 0:
        assert all(n.poll() is None for n in nodes), [n.communicate() for n in nodes]
        assert time.monotonic() < deadline
        time.sleep(0.02)
    for n in nodes:
        os.killpg(n.pid, signal.SIGSTOP)


@pytest.mark.timeout(300)
def test_a_user_in_the_source_group_keeps_it_on_every_node_of_a_cluster_stage(
    open_tmpfs, shmstage_bin, procs
):
    """Finding 2: the cluster path gives copies the group by the single-node rule: a stager
    in the data's group stages with --nodes 2; every node's copy keeps that group."""
    pytest.importorskip("torch.distributed", reason="cluster staging needs torch")
    world = open_tmpfs("64M")
    src = group_world(world)
    (src / "sub" / "empty").write_bytes(b"")  # written by the exchange's own path for empties
    own(src, STAGER, PROJECT)
    (src / "sub" / "empty").chmod(0o640)
    sock = __import__("socket").socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    nodes = []
    for rank in (0, 1):
        argv = [
            *as_node(world, rank, STAGER), *as_user(STAGER, PRIMARY, str(PROJECT)), *shmstage_bin,
            "stage", str(src), "--name", "data", "--dest", str(world / "shm"), "--reserve", "0",
            "--quiet",
            "--nodes", "2", "--node-rank", str(rank), "--rendezvous", f"127.0.0.1:{port}",
            "--timeout", "60",
        ]  # fmt: skip
        nodes.append(procs.start(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for rank, n in enumerate(nodes):
        _out, err = n.communicate(timeout=200)
        assert n.returncode == 0, (rank, err)
    for rank in (0, 1):
        for rel, mode in (("f", 0o640), ("sub", 0o750), ("sub/g", 0o640), ("sub/empty", 0o640)):
            st = (world / f"shm{rank}" / "data" / rel).lstat()
            got = (st.st_uid, st.st_gid, st.st_mode & 0o777)
            assert got == (STAGER, PROJECT, mode), (rank, rel, got)


def test_verify_checksum_refuses_a_swapped_top_instead_of_reading_through_it(
    open_tmpfs, shmstage_bin
):
    """Finding 7: after the stage, mallory swaps her top for a symlink to the victim's vault
    (whose secret equals her guess): verify --checksum refuses (exit 1, one line), never
    answers OK or 'bytes differ' about the vault's files."""
    world = open_tmpfs("64M")
    src, vault = top_swap_world(world)
    (vault / "secret").write_bytes(DECOY)  # the right guess: an oracle would answer OK
    st = (src / "secret").stat()
    os.utime(vault / "secret", ns=(st.st_atime_ns, st.st_mtime_ns))
    dest = world / "dest"
    done = subprocess.run(
        [*shmstage_bin, "stage", str(src), "--dest", str(dest)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    swap_top(src, vault)
    check = subprocess.run(
        [*shmstage_bin, "verify", "src", "--dest", str(dest), "--checksum"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert check.returncode == 1, check.stdout + check.stderr
    lines = check.stderr.strip().splitlines()
    assert len(lines) == 1 and "not the directory that was staged" in lines[0], check.stderr


def set_acl(path: Path, user: int, group: int, other: int, mask: int, named: dict[int, int]):
    """An access ACL as the kernel stores it (system.posix_acl_access, version 2)."""
    import struct

    ents = [(0x01, user, 0xFFFFFFFF), (0x04, group, 0xFFFFFFFF), (0x10, mask, 0xFFFFFFFF)]
    ents += [(0x20, other, 0xFFFFFFFF)] + [(0x02, perm, uid) for uid, perm in named.items()]
    raw = struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in sorted(ents))
    try:
        os.setxattr(path, "system.posix_acl_access", raw)
    except OSError as e:
        pytest.skip(f"no POSIX ACLs here: {e.strerror}")


@pytest.mark.parametrize("crowded", [False, True], ids=["acl", "acl-behind-64k-of-xattr-names"])
def test_an_acl_that_denies_the_owning_group_is_not_widened_by_the_copy(
    open_tmpfs, shmstage_bin, crowded
):
    """Finding 5: alice's file with group::--- and user:bob:r-- shows as 0640 (the mode's group
    bits are the ACL's mask).  Root's copy keeps the ACL (acls.py), so carol, in alice's
    group and denied the source, is denied the copy too.
    Crowded: so many user xattrs that listxattr fails (E2BIG): the ACL is still read."""
    alice, bob, carol = MALLORY, VICTIM, COLLEAGUE
    world = open_tmpfs("64M")
    src = world / "asrc"
    (src / "d").mkdir(parents=True)
    (src / "d" / "f").write_bytes(b"alice private, bob may read\n")
    own(src, alice)
    (src / "d" / "f").chmod(0o640)
    (src / "d").chmod(0o750)
    set_acl(src / "d" / "f", 6, 0, 0, 4, {bob: 4})
    set_acl(src / "d", 7, 0, 0, 5, {bob: 5})
    for path in (src / "d" / "f", src / "d") if crowded else ():
        for i in range(300):  # names past XATTR_LIST_MAX (64 KiB) in all
            os.setxattr(path, f"user.{i:04d}" + "x" * 240, b"1")
        with pytest.raises(OSError) as listing:
            os.listxattr(path)
        assert listing.value.errno == errno.E2BIG
    assert (src / "d" / "f").stat().st_mode & 0o777 == 0o640
    as_carol = as_user(carol, carol, str(alice))
    assert subprocess.run([*as_carol, "cat", str(src / "d" / "f")]).returncode != 0
    dest = world / "dest"
    done = subprocess.run(
        [*shmstage_bin, "stage", str(src), "--dest", str(dest)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    # root's copy keeps the ACL verbatim (its mode shows the mask, as at the source)
    for rel in ("d/f", "d"):
        acl = "system.posix_acl_access"
        assert os.getxattr(dest / "asrc" / rel, acl) == os.getxattr(src / rel, acl), rel
    assert (dest / "asrc" / "d" / "f").stat().st_mode & 0o777 == 0o640
    assert subprocess.run([*as_carol, "cat", str(dest / "asrc" / "d" / "f")]).returncode != 0
    check = subprocess.run(
        [*shmstage_bin, "verify", "asrc", "--dest", str(dest)], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr
