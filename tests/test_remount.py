"""remount without root: fstab editing, refusals, the not-root error, bad sizes on the CLI."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from shmstage import shm, system
from shmstage.errors import PermissionDenied, RefusedError

FSTAB = (
    "# /etc/fstab: static file system information.\n"
    "UUID=1234-abcd  /               ext4    errors=remount-ro 0       1\n"
    "\n"
    "#tmpfs /dev/shm tmpfs defaults,size=1G 0 0\n"
    "tmpfs   /dev/shm   tmpfs   rw,nosuid,nodev,size=8G,mode=1777   0  0\n"
    "/dev/sdb1\t/data\txfs\tdefaults,noatime\t0\t2\n"
)


def test_existing_line_gets_new_size_and_keeps_its_other_options():
    """Only the options field of the /dev/shm line changes; spacing and other lines stay."""
    after = shm.edit_fstab(FSTAB, "/dev/shm", "64G")
    assert after == FSTAB.replace("size=8G", "size=64G")


def test_missing_line_is_appended():
    """With no line for the mount point, a standard tmpfs line is added at the end."""
    text = "UUID=1 / ext4 defaults 0 1\n"
    assert (
        shm.edit_fstab(text, "/dev/shm", "32G")
        == text + "tmpfs /dev/shm tmpfs defaults,size=32G 0 0\n"
    )


def test_file_without_final_newline_gets_one_before_the_new_line():
    """The appended line never runs into the last existing line."""
    assert shm.edit_fstab("a / ext4 defaults 0 1", "/dev/shm", "1G") == (
        "a / ext4 defaults 0 1\ntmpfs /dev/shm tmpfs defaults,size=1G 0 0\n"
    )
    assert shm.edit_fstab("", "/dev/shm", "1G") == "tmpfs /dev/shm tmpfs defaults,size=1G 0 0\n"


def test_line_without_size_gets_one_and_nr_blocks_is_replaced():
    """size= is appended to the options; nr_blocks= (the same limit in pages) is swapped for it."""
    assert shm.edit_fstab("none /dev/shm tmpfs defaults 0 0\n", "/dev/shm", "2G") == (
        "none /dev/shm tmpfs defaults,size=2G 0 0\n"
    )
    assert shm.edit_fstab("none /dev/shm/ tmpfs nr_blocks=100,mode=1777\n", "/dev/shm", "2G") == (
        "none /dev/shm/ tmpfs size=2G,mode=1777\n"
    )
    assert shm.edit_fstab("tmpfs /dev/shm tmpfs\n", "/dev/shm", "2G") == (
        "tmpfs /dev/shm tmpfs\tdefaults,size=2G\t0\t0\n"
    )


def test_crlf_lines_and_escaped_mountpoints_survive():
    """CRLF endings are kept and \\040 in fstab matches a mount point with a space."""
    text = "a / ext4 defaults 0 1\r\ntmpfs /mnt/ram\\040disk tmpfs size=1G 0 0\r\n"
    assert shm.edit_fstab(text, "/mnt/ram disk", "4G") == text.replace("size=1G", "size=4G")
    assert shm.edit_fstab("", "/mnt/ram disk", "4G") == (
        "tmpfs /mnt/ram\\040disk tmpfs defaults,size=4G 0 0\n"
    )


def test_non_tmpfs_line_for_the_mount_point_is_refused():
    """A bind mount (or anything but tmpfs) at that path is not edited."""
    with pytest.raises(
        RefusedError, match="line 2 mounts /dev/shm as none, not tmpfs; edit that line"
    ):
        shm.edit_fstab("x / ext4 d 0 1\n/run/shm /dev/shm none bind 0 0\n", "/dev/shm", "1G")


@pytest.mark.parametrize("written", ["64G", "64g", "65536M", "64GiB", "68719476736"])
def test_same_size_means_no_change(written):
    """The size already written, however spelled, leaves fstab identical (nothing to persist)."""
    text = f"tmpfs /dev/shm tmpfs defaults,size={written} 0 0\n"
    assert shm.edit_fstab(text, "/dev/shm", "64G") == text


def test_percent_in_fstab_is_replaced_by_the_resolved_size():
    """tmpfs' own size=50% is of physical RAM; shmstage writes the size it applied."""
    text = "tmpfs /dev/shm tmpfs size=50%,mode=1777 0 0\n"
    assert (
        shm.edit_fstab(text, "/dev/shm", "12G") == "tmpfs /dev/shm tmpfs size=12G,mode=1777 0 0\n"
    )


def test_fstab_diff_is_a_unified_diff():
    """The dry-run diff names the file and shows the one changed line."""
    diff = shm.fstab_diff(FSTAB, FSTAB.replace("size=8G", "size=64G"), "/etc/fstab")
    assert diff.startswith("--- /etc/fstab\n+++ /etc/fstab\n")
    assert "-tmpfs   /dev/shm   tmpfs   rw,nosuid,nodev,size=8G" in diff
    assert "+tmpfs   /dev/shm   tmpfs   rw,nosuid,nodev,size=64G" in diff


def test_write_fstab_is_atomic_with_a_backup(tmp_path):
    """The new fstab replaces the old by rename; the old bytes go to fstab.shmstage.bak; mode kept."""
    fstab = tmp_path / "fstab"
    fstab.write_bytes(FSTAB.encode() + b"# caf\xe9 latin-1 comment\n")
    fstab.chmod(0o640)
    old = fstab.read_bytes()
    new_text = shm.edit_fstab(shm.read_fstab(str(fstab)), "/dev/shm", "16G")
    backup = shm.write_fstab(str(fstab), new_text)
    assert backup == str(tmp_path / "fstab.shmstage.bak")
    assert Path(backup).read_bytes() == old
    assert fstab.read_bytes() == old.replace(b"size=8G", b"size=16G")
    assert fstab.stat().st_mode & 0o777 == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fstab", "fstab.shmstage.bak"]


def test_write_fstab_keeps_the_original_once(tmp_path):
    """A second change does not overwrite the backup: it stays the fstab before shmstage."""
    fstab = tmp_path / "fstab"
    fstab.write_text(FSTAB)
    shm.write_fstab(str(fstab), FSTAB.replace("size=8G", "size=16G"))
    backup = shm.write_fstab(str(fstab), FSTAB.replace("size=8G", "size=32G"))
    assert Path(backup).read_text() == FSTAB
    assert "size=32G" in fstab.read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fstab", "fstab.shmstage.bak"]


@pytest.mark.parametrize("line_names", ["target", "link"])
def test_symlinked_mount_point_edits_its_line_instead_of_adding_one(tmp_path, line_names):
    """/dev/shm -> /run/shm: a line for either name is the same mount; no duplicate line."""
    (tmp_path / "run" / "shm").mkdir(parents=True)
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "shm").symlink_to(tmp_path / "run" / "shm")
    written = tmp_path / ("run/shm" if line_names == "target" else "dev/shm")
    text = f"x / ext4 defaults 0 1\ntmpfs {written} tmpfs rw,nosuid,size=1G 0 0\n"
    for mountpoint in (tmp_path / "dev" / "shm", tmp_path / "run" / "shm"):
        assert shm.edit_fstab(text, str(mountpoint), "4G") == text.replace("size=1G", "size=4G")


def test_missing_fstab_is_refused(tmp_path):
    """--persist against a file that does not exist is a refusal, not a new file."""
    with pytest.raises(RefusedError, match=r"fstab .*/nope does not exist; pass an existing file"):
        shm.read_fstab(str(tmp_path / "nope"))


# --- refusals that need no root ----------------------------------------------


def test_missing_path_is_refused(tmp_path):
    """A --path that does not exist is refused with exit code 2."""
    with pytest.raises(RefusedError) as e:
        shm.plan_remount("1G", str(tmp_path / "nope"))
    assert e.value.exit_code == 2
    assert (
        str(e.value)
        == f"{tmp_path}/nope does not exist; give the mount point of a tmpfs with --path"
    )


def test_plain_directory_is_refused(tmp_path):
    """A directory on a disk file system is not a tmpfs mount point."""
    mount = system.mount_of(tmp_path)
    with pytest.raises(RefusedError) as e:
        shm.plan_remount("1G", str(tmp_path))
    assert str(e.value) == (
        f"{tmp_path} is not a tmpfs mount point (it is on {mount.fstype} mounted at "
        f"{mount.mountpoint}); remount only resizes tmpfs mounts such as /dev/shm"
    )


# --- not root -----------------------------------------------------------------


def fake_plan(**overrides) -> shm.RemountPlan:
    fields = dict(
        path="/dev/shm", requested="64G", current_size=1 << 30, new_size=64 << 30,
        size_option="64G", used=0, ceiling=128 << 30, remount_needed=True,
        commands=("mount -o remount,size=64G /dev/shm",), persist=False, fstab=None,
        fstab_changed=False, fstab_diff="", backup=None, warnings=(),
    )  # fmt: skip
    fields.update(overrides)
    return shm.RemountPlan(**fields)


NOT_ROOT = (
    "cannot resize /dev/shm: changing a mount needs root with CAP_SYS_ADMIN, which this process "
    "lacks. On the host run it as root (sudo shmstage remount --size 64G); in a container the size "
    "is set when it starts: `docker run --shm-size=64g`, or on Kubernetes mount an "
    "`emptyDir: {medium: Memory, sizeLimit: 64Gi}` volume at /dev/shm"
)


def test_without_cap_sys_admin_the_error_names_docker_and_kubernetes(monkeypatch):
    """No CAP_SYS_ADMIN: nothing is run, and the error gives the container-level fixes."""
    monkeypatch.setattr(system, "has_cap_sys_admin", lambda proc="/proc": False)
    ran = []
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: ran.append(a))
    with pytest.raises(PermissionDenied) as e:
        shm.apply_remount(fake_plan())
    assert str(e.value) == NOT_ROOT
    assert ran == []


def test_eperm_from_mount_gets_the_same_hint(monkeypatch):
    """Root whose mount(2) is blocked (seccomp/AppArmor) gets the docker/Kubernetes hint too."""
    monkeypatch.setattr(system, "has_cap_sys_admin", lambda proc="/proc": True)

    def fake_run(argv, **kwargs):
        assert argv == ["mount", "-o", "remount,size=64G", "/dev/shm"]
        return subprocess.CompletedProcess(argv, 32, "", "mount: /dev/shm: permission denied.\n")

    monkeypatch.setattr(subprocess, "run", fake_run)
    with pytest.raises(PermissionDenied) as e:
        shm.apply_remount(fake_plan())
    assert str(e.value) == NOT_ROOT


def test_other_mount_failures_quote_the_command(monkeypatch):
    """Any other mount(8) failure is one line naming the exact command and its message."""
    monkeypatch.setattr(system, "has_cap_sys_admin", lambda proc="/proc": True)
    monkeypatch.setattr(
        subprocess,
        "run",
        lambda argv, **k: subprocess.CompletedProcess(
            argv,
            32,
            "",
            "mount: /dev/shm: bad option.\n       dmesg(1) may have more information after failed mount system call.\n",
        ),
    )
    with pytest.raises(shm.ShmstageError) as e:
        shm.apply_remount(fake_plan())
    assert (
        str(e.value) == "`mount -o remount,size=64G /dev/shm` failed: mount: /dev/shm: bad option."
    )


@pytest.mark.parametrize(
    ("option", "k8s"),
    [("64G", "64Gi"), ("512M", "512Mi"), ("2T", "2Ti"), ("4k", "4Ki"), ("4097", "4097")],
)
def test_kubernetes_quantity(option, k8s):
    """Mount sizes map to Kubernetes binary quantities in the hint."""
    assert shm._k8s(option) == k8s


def test_nothing_to_do_needs_no_root(monkeypatch):
    """An unchanged plan is reported without checking privileges or running anything."""
    monkeypatch.setattr(system, "has_cap_sys_admin", lambda proc="/proc": False)
    plan = fake_plan(new_size=1 << 30, size_option="1G", remount_needed=False, commands=())
    result = shm.apply_remount(plan)
    assert (result.changed, result.message) == (False, "/dev/shm: already 1G, nothing to do")


# --- CLI: bad input ------------------------------------------------------------


@pytest.mark.parametrize(
    ("size", "message"),
    [
        ("12Q", "invalid size '12Q': unknown unit 'Q'; use K, M, G, T, KiB, GiB, KB, GB or N%"),
        ("-5G", "invalid size '-5G' (sizes must not be negative): use bytes or a number with K, M, G, T "
                "(powers of 1024; KiB/GiB too, KB/GB are powers of 1000) or N%"),
        ("abc%", "invalid size 'abc%': use bytes or a number with K, M, G, T "
                 "(powers of 1024; KiB/GiB too, KB/GB are powers of 1000) or N%"),
        ("150%", "invalid size '150%': a percentage must be in (0, 100]"),
    ],
)  # fmt: skip
def test_bad_sizes_are_one_line_usage_errors(runner, cli, size, message):
    """Mistyped sizes exit 2 with the reason and no traceback."""
    result = runner.invoke(cli, ["remount", "--size", size, "--dry-run"])
    assert result.exit_code == 2
    assert result.stderr.splitlines()[-1] == f"Error: Invalid value for '--size': {message}"
    assert "Traceback" not in result.output


def test_zero_size_is_refused(runner, cli):
    """size 0 would make the tmpfs unlimited: refused before looking at the mount."""
    result = runner.invoke(cli, ["remount", "--size", "0", "--dry-run"])
    assert result.exit_code == 2
    assert result.stderr == (
        "Error: invalid size '0': it must be more than 0 (size=0 would make the tmpfs unlimited)\n"
    )


def test_missing_path_on_the_cli(runner, cli, tmp_path):
    """A --path that does not exist: exit 2 and one Error line."""
    result = runner.invoke(cli, ["remount", "--size", "1G", "--path", str(tmp_path / "x")])
    assert result.exit_code == 2
    assert result.stderr == (
        f"Error: {tmp_path}/x does not exist; give the mount point of a tmpfs with --path\n"
    )


def test_fstab_without_persist_is_a_usage_error(runner, cli, tmp_path):
    """--fstab alone would silently do nothing, so it is rejected."""
    result = runner.invoke(cli, ["remount", "--size", "1G", "--fstab", str(tmp_path / "f")])
    assert result.exit_code == 2
    assert result.stderr.splitlines()[-1] == "Error: --fstab only applies with --persist"


def test_size_is_required(runner, cli):
    """remount without --size says which option is missing."""
    result = runner.invoke(cli, ["remount"])
    assert result.exit_code == 2
    assert result.stderr.splitlines()[-1] == "Error: Missing option '--size'."
