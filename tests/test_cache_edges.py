"""The node cache at its edges (issue 20): a renumbered block device, tiers listed in
another order, make-room under a memory cgroup, restages under make-room and max_size,
concurrent stagers against max_size, and non-root jobs' use of root-staged datasets.

Real loop devices, tmpfs tiers in the test's private mount namespace, real cgroups, real
concurrent stagers and real users (setpriv)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.test_cache import make_ds, names_in, sh

pytestmark = pytest.mark.root

MIB = 1 << 20


@pytest.fixture
def tmp_path(open_tmp_path):
    """Sources every user can reach (see tests/test_stage.py)."""
    return open_tmp_path


def _losetup(*args: str) -> str:
    return subprocess.run(
        ["losetup", *args], capture_output=True, text=True, check=True, timeout=60
    ).stdout.strip()


def test_gc_keeps_every_dataset_after_the_block_device_is_renumbered(tmp_path, shmstage_bin):
    """A tier on an ext4 file system whose loop device is re-attached under another number
    (as NVMe disks are renumbered at boot): the datasets are still listed, a restage is a
    no-op, and gc removes nothing."""
    img = tmp_path / "tier.img"
    with open(img, "wb") as f:
        f.truncate(64 * MIB)
    subprocess.run(["mkfs.ext4", "-q", str(img)], check=True, timeout=120)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    tier = mnt / "shmstage"
    attached: list[str] = []
    mounted = False
    try:
        attached.append(_losetup("--find", "--show", str(img)))
        subprocess.run(["mount", attached[0], str(mnt)], check=True, timeout=60)
        mounted = True
        srcs = [make_ds(tmp_path / n, 2, files=3) for n in ("a", "b")]
        for src in srcs:
            r = sh(shmstage_bin, "stage", str(src), "--dest", str(tier), "--reserve", "1M", "-q")
            assert r.returncode == 0, r.stderr
        before = os.stat(mnt).st_dev
        subprocess.run(["umount", str(mnt)], check=True, timeout=60)
        mounted = False
        # The image is attached again while the first device still holds it: another number.
        attached.append(_losetup("--find", "--show", str(img)))
        _losetup("-d", attached.pop(0))
        subprocess.run(["mount", attached[0], str(mnt)], check=True, timeout=60)
        mounted = True
        assert os.stat(mnt).st_dev != before
        r = sh(shmstage_bin, "gc", "--dest", str(tier), "--json")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["removed"] == []
        assert names_in(tier) == ["a", "b"]
        listed = json.loads(sh(shmstage_bin, "list", "--dest", str(tier), "--json").stdout)
        assert [x["name"] for x in listed] == ["a", "b"]
        r = sh(shmstage_bin, "stage", str(srcs[0]), "--dest", str(tier), "--reserve", "1M")
        assert r.returncode == 0 and r.stderr.startswith("a is up to date"), r.stderr
        r = sh(shmstage_bin, "verify", "b", "--dest", str(tier))
        assert r.returncode == 0, r.stdout + r.stderr
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(mnt)], check=False, timeout=60)
        for dev in attached:
            subprocess.run(["losetup", "-d", dev], check=False, timeout=60)
