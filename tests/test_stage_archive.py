"""Tar archives as sources: read by content, damage fails cleanly, --strip-components.

Inputs are built with the real `tar`, `gzip`, `bzip2`, `xz` and `zstd` commands (and
Python's tarfile for members tar would not write), and damaged archives are checked
against GNU tar's own verdict where that is cheap.
"""

from __future__ import annotations

import io
import os
import shutil
import stat
import subprocess
import tarfile
from pathlib import Path

import pytest

from shmstage.errors import RefusedError, ShmstageError
from shmstage.stage import stage, verify

pytestmark = pytest.mark.root


def make_tree(root: Path, files: int = 6, size: int = 70_000) -> Path:
    """One top-level folder with sub-folders, several 512-block members, a link and a hard link."""
    (root / "top" / "sub").mkdir(parents=True)
    for i in range(files):
        where = root / "top" / ("sub" if i % 2 else "") / f"f{i}.bin"
        where.write_bytes(os.urandom(size + i))
    (root / "top" / "link").symlink_to("f0.bin")
    os.link(root / "top" / "f0.bin", root / "top" / "hard.bin")
    return root


def tar(src: Path, out: Path, *flags: str) -> Path:
    subprocess.run(["tar", *flags, "-cf", str(out), "-C", str(src), "top"], check=True)
    return out


def member(name: str, data: bytes = b"", **attrs: object) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    for k, v in attrs.items():
        setattr(info, k, v)
    return info, data


def python_tar(arc: Path, *members: tuple[tarfile.TarInfo, bytes]) -> Path:
    """An archive of members GNU tar would not write from a tree (device nodes, odd links)."""
    with tarfile.open(arc, "w") as tf:
        for info, data in members:
            tf.addfile(info, io.BytesIO(data))
    return arc


def gnu_tar_lists(arc: Path) -> subprocess.CompletedProcess:
    """What GNU tar says about the archive (it detects the compression by content too)."""
    return subprocess.run(["tar", "-tf", str(arc)], capture_output=True, text=True)


def stage_cli(shmstage_bin, arc: Path, dest: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*shmstage_bin, "stage", str(arc), "--dest", str(dest), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def invoke(runner, cli, src: Path, dest: Path, *args: str):
    """`shmstage stage SRC --dest DEST ARGS` in-process (exact stderr lines)."""
    return runner.invoke(cli, ["stage", str(src), "--dest", str(dest), *args])


def damage(arc: Path, offset: int, new: bytes) -> None:
    """Overwrite bytes of the archive in place."""
    data = bytearray(arc.read_bytes())
    data[offset : offset + len(new)] = new
    arc.write_bytes(bytes(data))


def files_of(root: Path) -> dict[str, bytes | str]:
    out: dict[str, bytes | str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            p = Path(dirpath) / n
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = "-> " + os.readlink(p)
            elif p.is_dir():
                out[rel] = "dir"
            else:
                out[rel] = p.read_bytes()
    return out


def assert_nothing_left(dest: Path, name: str) -> None:
    """Nothing published, no partial tree, no marker, record or manifest: only the store skeleton."""
    if not dest.exists():
        return
    assert sorted(os.listdir(dest)) == [".shmstage"]
    book = dest / ".shmstage"
    for sub in ("meta", "manifests", "partial", "trash"):
        assert os.listdir(book / sub) == [], sub
    assert set(os.listdir(book / "locks")) <= {f"{name}.lock"}


def member_offsets(arc: Path) -> list[tuple[str, int, int]]:
    with tarfile.open(arc) as tf:
        return [(m.name, m.offset, m.offset_data + m.size) for m in tf]


# --- recognised by content -------------------------------------------------------------


@pytest.mark.parametrize("flag", ["-z", "-j", "-J"])
def test_compressed_archive_named_tar_is_read_by_content(tmpfs, tmp_path, shmstage_bin, flag):
    """A gzip/bzip2/xz stream named .tar stages every file byte for byte; verify --checksum agrees."""
    src = make_tree(tmp_path / "src")
    arc = tar(src, tmp_path / "data.tar", flag)
    dest = tmpfs("64M") / "s"
    r = stage_cli(shmstage_bin, arc, dest, "--quiet")
    assert r.returncode == 0, r.stderr
    assert files_of(dest / "data") == files_of(src)
    v = subprocess.run(
        [*shmstage_bin, "verify", "data", "--checksum", "--dest", str(dest)],
        capture_output=True,
        text=True,
    )
    assert v.returncode == 0, v.stdout + v.stderr


@pytest.mark.parametrize("flags", [(), ("--format=v7",)])
def test_plain_tar_named_tar_gz_is_read_by_content(tmpfs, tmp_path, flags):
    """An uncompressed tar (ustar, or v7 without magic) named .tar.gz is staged by content."""
    src = make_tree(tmp_path / "src")
    arc = tar(src, tmp_path / "data.tar.gz", *flags)
    ds = stage(arc, dest=tmpfs("64M") / "s")
    assert ds.name == "data" and files_of(Path(ds.path)) == files_of(src)


def zstd_file(tmp_path: Path) -> Path:
    plain = tar(make_tree(tmp_path / "src", files=1, size=10), tmp_path / "d.tar")
    arc = tmp_path / "d.tar.gz"
    if shutil.which("zstd"):
        subprocess.run(["zstd", "-q", "-o", str(arc), str(plain)], check=True)
    else:
        arc.write_bytes(b"\x28\xb5\x2f\xfd" + os.urandom(100))
    return arc


def random_file(tmp_path: Path) -> Path:
    arc = tmp_path / "junk.tar"
    arc.write_bytes(os.urandom(4096).replace(b"ustar", b"xxxxx"))
    return arc


def gzipped_text(tmp_path: Path) -> Path:
    arc = tmp_path / "notes.tar.gz"
    text = subprocess.run(["gzip", "-c"], input=b"hello\n" * 200, capture_output=True, check=True)
    arc.write_bytes(text.stdout)
    return arc


def fifo(tmp_path: Path) -> Path:
    os.mkfifo(tmp_path / "pipe.tar")  # opening it must not block
    return tmp_path / "pipe.tar"


TODO = "stage a directory or a tar archive (plain, gzip, bzip2 or xz)"


@pytest.mark.parametrize(
    "make,line",
    [
        (
            zstd_file,
            "is a zstd-compressed file, which shmstage cannot read; decompress it first "
            "(`zstd -d FILE`)",
        ),
        (random_file, f"is not a tar archive (unknown data); {TODO}"),
        (gzipped_text, f"holds gzip data that is not a tar archive; {TODO}"),
        (fifo, f"is a FIFO, not a directory or a tar archive; {TODO}"),
    ],
    ids=["zstd", "random-bytes", "gzipped-text", "fifo"],
)
def test_what_is_not_a_readable_tar_is_refused_saying_what_it_is(tmp_path, runner, cli, make, line):
    """zstd, random bytes, gzip of no tar, a FIFO (whatever the name): exit 2, one line, nothing created."""
    arc = make(tmp_path)
    if make is random_file:
        assert gnu_tar_lists(arc).returncode != 0
    r = invoke(runner, cli, arc, tmp_path / "dest")
    assert r.exit_code == 2
    assert r.stderr == f"Error: source {arc} {line}\n"
    assert not (tmp_path / "dest").exists()


# --- damage ----------------------------------------------------------------------------


def test_header_damaged_in_the_middle_fails_naming_offset(tmpfs, tmp_path, shmstage_bin):
    """A bad checksum in the 3rd header (GNU tar: "Skipping to next header") fails, nothing published."""
    src = make_tree(tmp_path / "src")
    arc = tar(src, tmp_path / "data.tar")
    members = member_offsets(arc)
    name, offset, _ = members[2]
    damage(arc, offset + 10, b"XXXX")  # in the name field: the checksum no longer matches
    gnu = gnu_tar_lists(arc)
    assert gnu.returncode == 2 and "Skipping to next header" in gnu.stderr
    dest = tmpfs("64M") / "s"
    r = stage_cli(shmstage_bin, arc, dest)
    assert r.returncode == 1, r.stderr
    assert r.stdout == ""
    assert r.stderr == (
        f"Error: cannot read tar archive {arc}: damaged at offset {offset} (after member "
        f"{members[1][0]!r}): invalid header (bad checksum); GNU tar reports this as "
        "'Skipping to next header'; re-download or re-create it\n"
    )
    assert_nothing_left(dest, "data")


def test_first_header_with_bad_checksum_is_damage_not_unknown_data(tmp_path, runner, cli):
    """A ustar header whose checksum is wrong is a damaged archive (exit 1), said at offset 0."""
    src = make_tree(tmp_path / "src", files=1, size=10)
    arc = tar(src, tmp_path / "data.tar")
    damage(arc, 0, bytes([arc.read_bytes()[0] ^ 0x01]))
    assert gnu_tar_lists(arc).returncode != 0
    r = invoke(runner, cli, arc, tmp_path / "dest")
    assert r.exit_code == 1
    assert r.stderr == (
        f"Error: cannot read tar archive {arc}: damaged at offset 0 (the first member's header "
        "checksum is wrong); re-download or re-create it\n"
    )


def test_truncated_plain_tar_fails_naming_the_member(tmpfs, tmp_path, shmstage_bin):
    """A plain tar cut in the middle of a member's data fails (GNU tar: Unexpected EOF)."""
    src = make_tree(tmp_path / "src")
    arc = tar(src, tmp_path / "data.tar")
    name, offset, end = member_offsets(arc)[3]
    cut = end - 1000
    os.truncate(arc, cut)
    assert gnu_tar_lists(arc).returncode == 2
    dest = tmpfs("64M") / "s"
    r = stage_cli(shmstage_bin, arc, dest)
    assert r.returncode == 1
    assert r.stderr == (
        f"Error: cannot read tar archive {arc}: damaged at offset {cut} (in member {name!r}, "
        f"whose data runs to offset {end}): the file ends early (truncated); "
        "re-download or re-create it\n"
    )
    assert_nothing_left(dest, "data")


@pytest.mark.parametrize("flag,label", [("-z", "gzip"), ("-j", "bzip2"), ("-J", "xz")])
def test_truncated_compressed_archive_fails_cleanly(tmpfs, tmp_path, shmstage_bin, flag, label):
    """A .tar.gz/.bz2/.xz cut short fails with one Error line (no "Aborted!"), nothing published."""
    src = make_tree(tmp_path / "src")
    arc = tar(src, tmp_path / "data.tar.x", flag)
    os.truncate(arc, arc.stat().st_size * 2 // 3)
    assert gnu_tar_lists(arc).returncode == 2
    dest = tmpfs("64M") / "s"
    r = stage_cli(shmstage_bin, arc, dest)
    assert r.returncode == 1, r.stderr
    assert "Aborted" not in r.stderr and "Traceback" not in r.stderr
    assert r.stderr.startswith(f"Error: cannot read tar archive {arc}: damaged ")
    assert f": the {label} stream ends early (truncated); re-download or re-create it\n" in r.stderr
    assert r.stderr.count("\n") == 1
    assert_nothing_left(dest, "data.tar.x")


def test_corrupt_gzip_data_fails_cleanly(tmpfs, tmp_path, shmstage_bin):
    """Flipped bytes inside a gzip stream (CRC or inflate error) fail cleanly, nothing published."""
    src = make_tree(tmp_path / "src")
    arc = tar(src, tmp_path / "data.tgz", "-z")
    data = bytearray(arc.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 64] = bytes(b ^ 0xFF for b in data[mid : mid + 64])
    arc.write_bytes(bytes(data))
    assert gnu_tar_lists(arc).returncode != 0
    dest = tmpfs("64M") / "s"
    r = stage_cli(shmstage_bin, arc, dest)
    assert r.returncode == 1, r.stderr
    assert r.stderr.startswith(f"Error: cannot read tar archive {arc}: damaged ")
    # zlib finds the damage, or it inflates to garbage that fails as a header: either way, one line
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert_nothing_left(dest, "data")


def test_archive_cut_inside_a_header_fails(tmp_path):
    """A file that ends inside a header lost a member: it fails (GNU tar pads the block, exit 0)."""
    src = make_tree(tmp_path / "src")
    arc = tar(src, tmp_path / "data.tar")
    members = member_offsets(arc)
    offset = members[2][1]
    os.truncate(arc, offset + 100)
    assert gnu_tar_lists(arc).returncode == 0
    with pytest.raises(ShmstageError) as e:
        stage(arc, dest=tmp_path / "dest")
    assert e.value.exit_code == 1
    assert str(e.value) == (
        f"cannot read tar archive {arc}: damaged at offset {offset} (after member "
        f"{members[1][0]!r}): the archive ends inside a header "
        "(truncated); re-download or re-create it"
    )
    assert_nothing_left(tmp_path / "dest", "data")


def test_damaged_new_version_keeps_the_published_one(tmpfs, tmp_path):
    """Re-staging a damaged archive fails and leaves the published version as it was."""
    src = make_tree(tmp_path / "src")
    arc = tar(src, tmp_path / "data.tar", "-z")
    dest = tmpfs("64M") / "s"
    first = stage(arc, dest=dest)
    os.truncate(arc, arc.stat().st_size // 2)
    with pytest.raises(ShmstageError, match="stream ends early"):
        stage(arc, dest=dest)
    assert files_of(Path(first.path)) == files_of(src)
    assert os.listdir(dest / ".shmstage" / "partial") == []
    report = verify("data", dest=dest)
    assert report.ok


def test_archive_without_end_blocks_is_accepted_like_gnu_tar(tmpfs, tmp_path):
    """An archive that ends right after a member's data (no zero blocks) is complete to GNU tar too."""
    src = make_tree(tmp_path / "src")
    arc = tar(src, tmp_path / "data.tar")
    _, _, end = member_offsets(arc)[-1]
    os.truncate(arc, (end + 511) // 512 * 512)
    assert gnu_tar_lists(arc).returncode == 0
    ds = stage(arc, dest=tmpfs("64M") / "s")
    assert files_of(Path(ds.path)) == files_of(src)


@pytest.mark.parametrize(
    "kind,what", [(tarfile.CHRTYPE, "character device"), (tarfile.FIFOTYPE, "FIFO")]
)
def test_device_nodes_and_fifos_in_an_archive_are_refused(tmp_path, kind, what):
    """Device nodes and FIFOs are refused before anything is extracted (docs/staging.md)."""
    node = member("node", type=kind, devmajor=1, devminor=3)
    arc = python_tar(tmp_path / "dev.tar", member("ok.txt", b"ok"), node)
    with pytest.raises(RefusedError, match="'node' is a device file, FIFO or other special file"):
        stage(arc, dest=tmp_path / "dest")
    assert_nothing_left(tmp_path / "dest", "dev")


# --- --strip-components ----------------------------------------------------------------


def test_strip_components_one_stages_the_top_folders_contents(open_tmpfs, tmp_path, shmstage_bin):
    """--strip-components 1 gives the folder's contents, links and hard links intact, like GNU tar."""
    src = make_tree(tmp_path / "src")
    (src / "top").chmod(0o750)
    shm = open_tmpfs("64M")  # under a 0700 tmp_path the copy's root would lose its group bits
    arc = tar(src, shm / "data.tar.gz", "-z")
    dest = shm / "s"
    r = stage_cli(shmstage_bin, arc, dest, "--strip-components", "1", "--quiet")
    assert r.returncode == 0, r.stderr
    staged = dest / "data"
    gnu = tmp_path / "gnu"
    gnu.mkdir()
    subprocess.run(["tar", "-xf", str(arc), "-C", str(gnu), "--strip-components", "1"], check=True)
    assert files_of(staged) == files_of(gnu) == files_of(src / "top")
    assert stat.S_IMODE(staged.stat().st_mode) == 0o750  # the stripped folder's mode is the root's
    assert os.path.samefile(staged / "f0.bin", staged / "hard.bin")
    assert verify("data", dest=dest, checksum=True).ok


def test_strip_components_collision_is_refused(tmp_path, runner, cli):
    """Two members that become the same path after stripping are refused (exit 2), nothing created."""
    (tmp_path / "src" / "a").mkdir(parents=True)
    (tmp_path / "src" / "b").mkdir()
    (tmp_path / "src" / "a" / "x").write_text("a")
    (tmp_path / "src" / "b" / "x").write_text("b")
    arc = tmp_path / "two.tar"
    subprocess.run(["tar", "-cf", str(arc), "-C", str(tmp_path / "src"), "a/x", "b/x"], check=True)
    dest = tmp_path / "dest"
    r = runner.invoke(cli, ["stage", str(arc), "--dest", str(dest), "--strip-components", "1"])
    assert r.exit_code == 2
    assert r.stderr == (
        f"Error: --strip-components 1 makes members 'a/x' and 'b/x' of {arc} both 'x'; "
        "nothing was extracted: use a smaller --strip-components\n"
    )
    assert_nothing_left(dest, "two")


def test_restage_with_another_strip_count_recopies(tmpfs, tmp_path):
    """N is part of the change key: the same archive with another N is staged again, same N is a no-op."""
    src = make_tree(tmp_path / "src")
    arc = tar(src, tmp_path / "data.tar")
    dest = tmpfs("64M") / "s"
    first = stage(arc, dest=dest)
    assert sorted(os.listdir(first.path)) == ["top"]
    second = stage(arc, dest=dest, strip_components=1)
    assert second.changed and files_of(Path(second.path)) == files_of(src / "top")
    assert not stage(arc, dest=dest, strip_components=1).changed
    again = stage(arc, dest=dest)
    assert again.changed and sorted(os.listdir(again.path)) == ["top"]


def test_strip_components_on_a_directory_is_refused(tmp_path, runner, cli):
    """--strip-components on a directory source is refused with one clear line."""
    src = make_tree(tmp_path / "src", files=1, size=10)
    r = invoke(runner, cli, src, tmp_path / "d", "--strip-components", "1")
    assert r.exit_code == 2
    assert r.stderr == (
        f"Error: --strip-components applies to tar archives, and {src} is a directory; "
        "stage the subdirectory you want instead\n"
    )
    assert not (tmp_path / "d").exists()


def test_stripped_away_hard_link_target_is_refused(tmp_path):
    """A hard link whose target --strip-components drops cannot be made: refused, not dangling."""
    link = member("top/readme", type=tarfile.LNKTYPE, linkname="README")
    arc = python_tar(tmp_path / "h.tar", member("README", b"hi"), link)
    with pytest.raises(ShmstageError, match="not an earlier file in the archive .after --strip"):
        stage(arc, dest=tmp_path / "dest", strip_components=1)


@pytest.mark.parametrize("flag", ["-z", "-J", None])
def test_archive_cut_between_check_and_extraction_fails_cleanly(tmpfs, tmp_path, monkeypatch, flag):
    """Damage met while extracting (the archive was cut after the check) discards the partial tree."""
    from shmstage.stage.sources import tar as tarsrc

    src = make_tree(tmp_path / "src", files=8, size=200_000)
    arc = tar(src, tmp_path / "data.tar", *([flag] if flag else []))
    real_scan = tarsrc.scan

    def scan_then_cut(path, *args):
        archive = real_scan(path, *args)
        with open(path, "r+b") as f:  # a concurrent writer truncates it in place
            f.truncate(os.path.getsize(path) // 2)
        return archive

    monkeypatch.setattr(tarsrc, "scan", scan_then_cut)
    dest = tmpfs("64M") / "s"
    with pytest.raises(ShmstageError) as e:
        stage(arc, dest=dest)
    assert str(e.value).startswith(f"cannot read tar archive {arc}")
    assert "re-" in str(e.value) and "\n" not in str(e.value)
    assert_nothing_left(dest, "data")


def test_symlink_member_naming_the_root_is_refused(tmp_path):
    """A member "./" that is a symlink cannot replace the staged root: refused, nothing created."""
    arc = python_tar(
        tmp_path / "root.tar", member("./", type=tarfile.SYMTYPE, linkname="x"), member("x", b"x")
    )
    with pytest.raises(RefusedError, match="'./' is not a directory but names the root"):
        stage(arc, dest=tmp_path / "dest")
    assert_nothing_left(tmp_path / "dest", "root")
