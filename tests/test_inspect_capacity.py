"""The one capacity rule (capacity.check_fit) against real tmpfs mounts, and inspect's fit row."""

from __future__ import annotations

import json

import pytest

from shmstage import capacity, system

MIB = 1 << 20
GIB = 1 << 30


def memory(total: int, limit: int | None = None, usage: int = 0) -> system.Memory:
    return system.Memory(total, total, system.CgroupMemory(2, "/", limit, usage))


def test_reserve_is_ten_percent_capped_at_4g():
    """The default reserve is 10% of the file system, never more than 4 GiB."""
    assert capacity.default_reserve(10 * GIB) == GIB
    assert capacity.default_reserve(100 * GIB) == 4 * GIB


@pytest.mark.root
def test_fits_in_a_tmpfs(tmpfs):
    """Data plus reserve within free space and usable memory fits."""
    mnt = tmpfs("64M")
    fit = capacity.check_fit(10 * MIB, mnt / "dest", memory=memory(64 * GIB))
    assert fit.fits and fit.reason is None and fit.fstype == "tmpfs"
    assert fit.reserve == int(64 * MIB * 0.1)


@pytest.mark.root
def test_too_big_for_the_tmpfs_suggests_a_remount(tmpfs):
    """Short of space on a tmpfs but with RAM to spare: the reason names the remount size."""
    mnt = tmpfs("64M")
    fit = capacity.check_fit(100 * MIB, mnt, reserve=0, memory=memory(64 * GIB))
    assert not fit.fits and fit.suggested_size == "1G"
    assert fit.reason == (
        f"needs 100.0 MiB + 0 B reserve but only 64.0 MiB is free on {mnt}; grow it with "
        f"`shmstage remount --path {mnt} --size 1G` or pass a smaller --reserve"
    )


@pytest.mark.root
def test_too_big_for_ram_recommends_local_disk(tmpfs):
    """When growing the tmpfs would exceed RAM/the cgroup limit, no remount is suggested: use --dest."""
    mnt = tmpfs("64M")
    fit = capacity.check_fit(3 * GIB, mnt, reserve=0, memory=memory(64 * GIB, limit=2 * GIB))
    assert not fit.fits and fit.suggested_size is None
    assert fit.reason.endswith(
        f"growing {mnt} to 3G would exceed the 2.0 GiB of this cgroup's memory limit, "
        "so stage to local disk with --dest"
    )


@pytest.mark.root
def test_room_in_the_tmpfs_but_not_in_the_cgroup(tmpfs):
    """tmpfs pages are charged to the writer's cgroup: free tmpfs space is not enough."""
    mnt = tmpfs("512M")
    fit = capacity.check_fit(
        100 * MIB, mnt, reserve=0, memory=memory(64 * GIB, limit=GIB, usage=960 * MIB)
    )
    assert not fit.fits and fit.memory_usable == 64 * MIB
    assert "tmpfs pages are charged to the writer's memory" in fit.reason


def test_disk_destination_says_free_space_or_dest(tmp_path):
    """On a disk file system the advice is to free space or choose another --dest."""
    free = system.disk_usage(tmp_path).free
    fit = capacity.check_fit(free + GIB, tmp_path, reserve=0)
    assert not fit.fits and fit.suggested_size is None
    assert fit.reason.endswith("; free space there or stage elsewhere with --dest")


@pytest.mark.root
def test_inspect_fit_row_suggests_the_remount(runner, cli, tmpfs, tmp_path, monkeypatch):
    """inspect --path TMPFS --dataset DIR: a FAIL fit row whose next step is the remount command."""
    from shmstage import inspection

    monkeypatch.setattr(
        inspection, "torch_info", lambda: inspection.TorchInfo(False, None, None, False, (), None)
    )
    mnt = tmpfs("16M")
    data = tmp_path / "data"
    data.mkdir()
    (data / "blob").write_bytes(b"\0" * (32 * MIB))
    result = runner.invoke(cli, ["inspect", "--path", str(mnt), "--dataset", str(data), "--json"])
    assert result.exit_code == 1
    doc = json.loads(result.stdout)
    assert doc["dataset"]["dest"] == f"{mnt}/shmstage"
    assert (
        doc["dataset"]["fit"]["fits"] is False and doc["dataset"]["fit"]["suggested_size"] == "1G"
    )
    assert doc["checks"][-1]["verdict"] == "FAIL"
    assert doc["next_step"] == f"shmstage remount --path {mnt} --size 1G, then stage"
