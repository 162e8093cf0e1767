"""prepare's store_tmpfs never takes over a tmpfs it did not make: a system mount (/dev/shm,
/run, /tmp) or the shm tmpfs, spelled so or reached through a symlink (Debian's /run/shm),
or any tmpfs already mounted that the fstab prepare edits does not list."""

from __future__ import annotations

import os
import subprocess

import pytest
from click.testing import CliRunner

from shmstage.cli import cli
from shmstage.config import ConfigError, load_config
from shmstage.errors import RefusedError
from shmstage.prepare import prepare
from shmstage.store_tmpfs import plan_store_mount
from tests.test_prepare import mountinfo_options, shm_dir, write_config


def store_config(tmp_path, store, fstab, shm=None):
    shm = shm or shm_dir(tmp_path)
    return write_config(
        tmp_path / "node.yaml",
        f"shm: {{path: {shm}}}\nstore_tmpfs: {{path: {store}, size: 4M, mode: '0755', fstab: {fstab}}}\n",
    )


@pytest.mark.parametrize("target", ["/dev/shm", "/run", "/tmp", "/run/user/0", "/run/shm"])
def test_a_path_leading_to_a_system_mount_is_refused(tmp_path, target):
    """A symlink to /dev/shm (or /run, /tmp, ...): the config refuses it by where it leads,
    and so does the plan (a link made after the config was read), before looking at mounts."""
    store, fstab = tmp_path / "store", tmp_path / "fstab"
    fstab.write_text("")
    store.symlink_to(target)
    real = os.path.realpath(target)
    with pytest.raises(ConfigError) as e:
        load_config(store_config(tmp_path, store, fstab))
    assert f"store_tmpfs.path: {store} (that is {real}) cannot hold the store's own tmpfs" in str(
        e.value
    )
    with pytest.raises(RefusedError, match="cannot hold the store's own tmpfs"):
        plan_store_mount("4M", str(store), fstab=str(fstab))
    for spelled in ("/dev/shm/store", "/run", "/tmp", "/sys/fs/x", "/proc/1"):
        with pytest.raises(RefusedError, match=f"^{spelled} cannot hold the store's own tmpfs"):
            plan_store_mount("4M", spelled, fstab=str(fstab))
    assert fstab.read_text() == ""


def test_a_path_leading_into_the_shm_tmpfs_is_refused(tmp_path):
    """store_tmpfs.path reaching shm.path through a symlink: refused as if spelled so."""
    shm = shm_dir(tmp_path)
    store, fstab = tmp_path / "store", tmp_path / "fstab"
    fstab.write_text("")
    store.symlink_to(shm / "inner")
    with pytest.raises(ConfigError, match=f"{store} is on the shm tmpfs"):
        load_config(store_config(tmp_path, store, fstab, shm))
    with pytest.raises(RefusedError, match="cannot hold the store's own tmpfs"):
        plan_store_mount("4M", str(store), fstab=str(fstab), shm=str(shm))


@pytest.mark.root
def test_a_tmpfs_prepare_did_not_make_is_left_alone(tmp_path, tmpfs):
    """A tmpfs someone else mounted at store_tmpfs.path (fstab does not list it): prepare
    fails the step in one line and changes nothing (size, mode, files, fstab).  Once the
    fstab lists it as a tmpfs (prepare's own, or the admin's), it is adopted."""
    other = tmpfs("16M", name="other", mode="1777")
    (other / "some-users-segment").write_text("x")
    fstab = tmp_path / "fstab"
    fstab.write_text("proc /proc proc defaults 0 0\n")
    report = prepare(load_config(store_config(tmp_path, other, fstab)))
    assert report.error == (
        f"store-tmpfs failed: {other} is already a tmpfs mount prepare did not make; pick "
        "another store_tmpfs.path"
    )
    assert mountinfo_options(other)["size"] == "16384k"
    assert other.stat().st_mode & 0o7777 == 0o1777
    assert (other / "some-users-segment").read_text() == "x"
    assert fstab.read_text() == "proc /proc proc defaults 0 0\n"

    fstab.write_text(f"tmpfs {other} tmpfs size=16M,mode=1777 0 0\n")
    report = prepare(load_config(store_config(tmp_path, other, fstab)))
    assert not report.failed, report.error
    assert other.stat().st_mode & 0o7777 == 0o755


@pytest.mark.root
def test_the_shipped_repro_leaves_dev_shm_alone(tmp_path, tmpfs):
    """hostile review r5: store_tmpfs.path a symlink to /dev/shm (a stand-in tmpfs in this
    test's own mount namespace: the tmpfs fixture skips without one): prepare exits non-zero
    in one line; /dev/shm keeps its size and mode 1777; fstab is as it was."""
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,mode=1777", "tmpfs", "/dev/shm"],
                   check=True)  # fmt: skip
    try:
        store, fstab = tmp_path / "store", tmp_path / "fstab"
        fstab.write_text("proc /proc proc defaults 0 0\n")
        store.symlink_to("/dev/shm")
        config = store_config(tmp_path, store, fstab, shm="/dev/shm")
        r = CliRunner().invoke(cli, ["prepare", "--config", str(config)])
        assert r.exit_code != 0 and "cannot hold the store's own tmpfs" in r.output, r.output
        assert len([ln for ln in r.output.splitlines() if ln.startswith("Error")]) == 1
        assert os.stat("/dev/shm").st_mode & 0o7777 == 0o1777
        vfs = os.statvfs("/dev/shm")  # the stand-in: the last mount there
        assert vfs.f_blocks * vfs.f_frsize == 64 << 20
        assert fstab.read_text() == "proc /proc proc defaults 0 0\n"
    finally:
        subprocess.run(["umount", "-l", "/dev/shm"], check=False)
