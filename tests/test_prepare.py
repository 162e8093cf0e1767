"""`shmstage prepare`: converge a node from its YAML config, idempotently, and fail cleanly.

Root tests run for real in the session's private mount namespace: a small tmpfs stands in
for /dev/shm and a temporary file for /etc/fstab.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from shmstage.stage import find


def make_dataset(root: Path, name: str, files: int = 5, size: int = 64 << 10) -> Path:
    path = root / "src" / name
    path.mkdir(parents=True)
    for i in range(files):
        (path / f"{i:03}.bin").write_bytes(os.urandom(size))
    return path


def write_config(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def run_json(runner, cli, config: Path, *extra: str):
    result = runner.invoke(cli, ["prepare", "--config", str(config), "--json", *extra])
    report = json.loads(result.stdout) if result.stdout else None
    return result, report


def statuses(report) -> list[tuple[str, str]]:
    return [(s["step"], s["status"]) for s in report["steps"]]


def tmpfs_size(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_blocks * st.f_frsize


@pytest.fixture(autouse=True)
def private_prepare_lock(monkeypatch, tmp_path):
    """Every test takes its own prepare lock, never the node's /run/lock one."""
    lock = tmp_path / "prepare.lock"
    monkeypatch.setenv("SHMSTAGE_PREPARE_LOCK", str(lock))
    return lock


@pytest.fixture
def node(tmpfs, tmp_path):
    """An 8 MiB tmpfs as /dev/shm, an fstab with one unrelated line, and a 320 KiB dataset."""
    shm = tmpfs("8M")
    fstab = tmp_path / "fstab"
    fstab.write_text("proc /proc proc defaults 0 0\n")
    data = make_dataset(tmp_path, "images")
    return shm, fstab, data


@pytest.mark.root
def test_converge_then_second_run_changes_nothing(runner, cli, node, tmp_path):
    """First run resizes, persists and stages; the second reports every step ok and changed=false."""
    shm, fstab, data = node
    config = write_config(
        tmp_path / "node.yaml",
        f"shm: {{path: {shm}, size: 16M, persist: true, fstab: {fstab}}}\ndatasets: [{data}]\n",
    )
    result, report = run_json(runner, cli, config)
    assert result.exit_code == 0, result.output
    assert report["changed"] is True and report["failed"] is False
    assert statuses(report) == [
        ("inspect", "ok"),
        ("shm-size", "changed"),
        ("stage images", "changed"),
        ("pillow-simd", "skipped"),
    ]
    assert tmpfs_size(shm) == 16 << 20
    assert (
        fstab.read_text()
        == f"proc /proc proc defaults 0 0\ntmpfs {shm} tmpfs defaults,size=16M 0 0\n"
    )
    staged = find("images", dest=shm / "shmstage")
    assert staged is not None and staged.source == str(data)
    assert sorted(os.listdir(staged.path)) == sorted(os.listdir(data))

    result, report = run_json(runner, cli, config)
    assert result.exit_code == 0, result.output
    assert report["changed"] is False
    assert [s for _, s in statuses(report)] == ["ok", "ok", "ok", "skipped"]

    result = runner.invoke(cli, ["prepare", "--config", str(config)])
    assert result.exit_code == 0
    assert result.stdout.splitlines()[-1] == "nothing changed"


@pytest.mark.root
def test_dry_run_reports_would_change_and_changes_nothing(runner, cli, node, tmp_path):
    """--dry-run marks the remount and the copy as would-change and leaves tmpfs, fstab and dest alone."""
    shm, fstab, data = node
    config = write_config(
        tmp_path / "node.yaml",
        f"shm: {{path: {shm}, size: 16M, persist: true, fstab: {fstab}}}\ndatasets: [{data}]\n",
    )
    result, report = run_json(runner, cli, config, "--dry-run")
    assert result.exit_code == 0, result.output
    assert statuses(report) == [
        ("inspect", "ok"),
        ("shm-size", "would-change"),
        ("stage images", "would-change"),
        ("pillow-simd", "skipped"),
    ]
    assert report["dry_run"] is True
    assert report["would_change"] is True and report["changed"] is False
    assert tmpfs_size(shm) == 8 << 20
    assert fstab.read_text() == "proc /proc proc defaults 0 0\n"
    assert not (shm / "shmstage").exists()
    result = runner.invoke(cli, ["prepare", "--config", str(config), "--dry-run"])
    assert result.stdout.splitlines()[-1] == "dry run: these changes would be made"


@pytest.mark.root
def test_dry_run_sees_a_changed_source_and_the_next_run_refreshes_it(runner, cli, node, tmp_path):
    """After converging, a changed source file shows as would-change in --dry-run; prepare re-stages it."""
    shm, _fstab, data = node
    config = write_config(tmp_path / "node.yaml", f"shm: {{path: {shm}}}\ndatasets: [{data}]\n")
    assert run_json(runner, cli, config)[0].exit_code == 0
    assert statuses(run_json(runner, cli, config, "--dry-run")[1])[2] == ("stage images", "ok")
    (data / "000.bin").write_bytes(b"new content")
    _, report = run_json(runner, cli, config, "--dry-run")
    assert statuses(report)[2] == ("stage images", "would-change")
    staged = find("images", dest=shm / "shmstage")
    assert (Path(staged.path) / "000.bin").read_bytes() != b"new content"
    _, report = run_json(runner, cli, config)
    assert statuses(report)[2] == ("stage images", "changed")
    assert (Path(staged.path) / "000.bin").read_bytes() == b"new content"


@pytest.mark.root
def test_a_dataset_added_to_the_config_gets_staged(runner, cli, node, tmp_path):
    """After converging, adding a dataset stages only that one (the first stays ok)."""
    shm, _fstab, data = node
    config = write_config(tmp_path / "node.yaml", f"shm: {{path: {shm}}}\ndatasets: [{data}]\n")
    assert run_json(runner, cli, config)[0].exit_code == 0
    more = make_dataset(tmp_path, "labels", files=3)
    write_config(
        config, f"shm: {{path: {shm}}}\ndatasets: [{data}, {{source: {more}, name: lbl}}]\n"
    )
    result, report = run_json(runner, cli, config)
    assert result.exit_code == 0, result.output
    assert statuses(report) == [
        ("inspect", "ok"),
        ("shm-size", "skipped"),
        ("stage images", "ok"),
        ("stage lbl", "changed"),
        ("pillow-simd", "skipped"),
    ]
    assert find("lbl", dest=shm / "shmstage") is not None


@pytest.mark.root
def test_vanished_source_fails_cleanly_and_keeps_earlier_steps(runner, cli, node, tmp_path):
    """A missing source stops the run with exit 1 and one error line; the resize and earlier copies stay."""
    shm, fstab, data = node
    gone = tmp_path / "src" / "gone"
    config = write_config(
        tmp_path / "node.yaml",
        f"shm: {{path: {shm}, size: 16M, persist: true, fstab: {fstab}}}\n"
        f"datasets: [{data}, {gone}, {tmp_path}/never-reached]\n",
    )
    result, report = run_json(runner, cli, config)
    assert result.exit_code == 1
    message = f"source {gone} does not exist; mount it or remove it from the config"
    assert result.stderr == f"Error: stage gone failed: {message}\n"
    assert report["failed"] is True and report["changed"] is True
    assert report["error"] == f"stage gone failed: {message}"
    assert statuses(report) == [
        ("inspect", "ok"),
        ("shm-size", "changed"),
        ("stage images", "changed"),
        ("stage gone", "failed"),
    ]
    assert report["steps"][-1]["detail"] == message
    assert tmpfs_size(shm) == 16 << 20
    assert find("images", dest=shm / "shmstage") is not None

    result = runner.invoke(cli, ["prepare", "--config", str(config)])
    assert result.exit_code == 1
    assert re.search(r"^stage gone +failed +source .*/gone does not exist", result.stdout, re.M)
    assert result.stderr == f"Error: stage gone failed: {message}\n"


@pytest.mark.root
def test_auto_size_grows_the_tmpfs_to_fit_and_is_stable(runner, cli, tmpfs, tmp_path):
    """shm.size auto grows a too-small tmpfs to datasets + reserve, then leaves it alone."""
    shm = tmpfs("4M")
    fstab = tmp_path / "fstab"
    fstab.write_text("")
    data = make_dataset(tmp_path, "big", files=10, size=1 << 20)  # 10 MiB: does not fit 4 MiB
    small = data / "small"  # many small files: each takes a whole page on tmpfs
    small.mkdir()
    for i in range(400):
        (small / f"{i}.txt").write_bytes(b"x" * 100)
    config = write_config(
        tmp_path / "node.yaml",
        f"shm: {{path: {shm}, size: auto, persist: true, fstab: {fstab}}}\ndatasets: [{data}]\n",
    )
    result, report = run_json(runner, cli, config)
    assert result.exit_code == 0, result.output
    assert statuses(report)[1:3] == [("shm-size", "changed"), ("stage big", "changed")]
    size = tmpfs_size(shm)
    assert (10 << 20) + 400 * 4096 < size <= 16 << 20
    assert f"size={size >> 20}M" in fstab.read_text()
    result, report = run_json(runner, cli, config)
    assert report["changed"] is False, report
    assert tmpfs_size(shm) == size


@pytest.mark.root
def test_resizing_a_path_that_is_not_a_mount_point_fails_at_inspect(runner, cli, tmp_path):
    """shm.size on a plain directory stops at the inspect step with what to fix."""
    plain = tmp_path / "plain"
    plain.mkdir()
    config = write_config(tmp_path / "node.yaml", f"shm: {{path: {plain}, size: 16M}}\n")
    result, report = run_json(runner, cli, config)
    assert result.exit_code == 1
    assert statuses(report) == [("inspect", "failed")]
    assert result.stderr == (
        f"Error: inspect failed: shm.path {plain} is not a mount point, so it cannot be resized; "
        "point shm.path at the tmpfs mount (e.g. /dev/shm) or drop shm.size\n"
    )


def test_without_shm_size_the_tmpfs_is_left_alone_and_data_staged(runner, cli, tmp_path):
    """No shm.size: the size step is skipped; datasets are staged to `dest` (any user, any fs)."""
    data = make_dataset(tmp_path, "images", files=2)
    dest = tmp_path / "dest"
    config = write_config(
        tmp_path / "node.yaml", f"shm: {{path: {tmp_path}}}\ndest: {dest}\ndatasets: [{data}]\n"
    )
    result, report = run_json(runner, cli, config)
    assert result.exit_code == 0, result.output
    assert statuses(report)[1:3] == [("shm-size", "skipped"), ("stage images", "changed")]
    assert report["steps"][1]["detail"] == "shm.size not set; the tmpfs size is left alone"
    assert find("images", dest=dest) is not None
    assert run_json(runner, cli, config)[1]["changed"] is False


def test_validate_checks_the_file_and_runs_nothing(runner, cli, tmp_path):
    """--validate prints that the file is valid and stages nothing."""
    data = make_dataset(tmp_path, "images", files=1)
    dest = tmp_path / "dest"
    config = write_config(tmp_path / "node.yaml", f"dest: {dest}\ndatasets: [{data}]\n")
    result = runner.invoke(cli, ["prepare", "--config", str(config), "--validate"])
    assert result.exit_code == 0
    assert result.stdout == f"{config}: valid (1 dataset)\n"
    assert not dest.exists()


def test_missing_default_config_says_to_pass_config(runner, cli, monkeypatch, tmp_path):
    """Without --config and no /etc/shmstage.yaml: exit 2 naming --config."""
    monkeypatch.delenv("SHMSTAGE_CONFIG", raising=False)
    monkeypatch.setattr("shmstage.config.DEFAULT_PATH", str(tmp_path / "shmstage.yaml"))
    result = runner.invoke(cli, ["prepare"])
    assert result.exit_code == 2
    assert result.stderr == (
        f"Error: no node config at {tmp_path / 'shmstage.yaml'}; write one (see docs/config.md) "
        "or pass --config PATH\n"
    )


def test_pillow_simd_step_installs_once_then_reports_ok(runner, cli, monkeypatch, tmp_path):
    """With pillow_simd enabled, prepare plans and installs (changed), then finds nothing to do (ok)."""
    from types import SimpleNamespace

    from shmstage import pillow

    installed: list[str] = []

    def plan_install(python=None, *, version=None, **_kw):
        done = bool(installed)
        flavor, ver = ("pillow-simd", version) if done else ("Pillow", "10.4.0")
        before = SimpleNamespace(flavor=flavor, version=ver)
        return SimpleNamespace(
            nothing_to_do=done, before=before, requirement=f"pillow-simd=={version}", python=python
        )

    def install(plan, log=None):
        installed.append(plan.python)
        after = SimpleNamespace(flavor="pillow-simd", version="9.5.0.post1")
        return SimpleNamespace(changed=True, after=after)

    monkeypatch.setattr(pillow, "plan_install", plan_install)
    monkeypatch.setattr(pillow, "install", install)
    config = write_config(
        tmp_path / "node.yaml",
        f"shm: {{path: {tmp_path}}}\n"
        "pillow_simd: {enabled: true, python: /opt/train/bin/python, version: 9.5.0.post1}\n",
    )
    result, report = run_json(runner, cli, config, "--dry-run")
    assert report["steps"][-1] == {
        "step": "pillow-simd",
        "status": "would-change",
        "detail": "would build and install pillow-simd==9.5.0.post1 into /opt/train/bin/python "
        "(now: Pillow 10.4.0)",
    }
    assert installed == []
    result, report = run_json(runner, cli, config)
    assert result.exit_code == 0, result.output
    assert report["steps"][-1]["status"] == "changed"
    assert installed == ["/opt/train/bin/python"]
    result, report = run_json(runner, cli, config)
    assert report["steps"][-1] == {
        "step": "pillow-simd",
        "status": "ok",
        "detail": "pillow-simd 9.5.0.post1 in /opt/train/bin/python",
    }
    assert report["changed"] is False


HOLD_LOCK = """
import sys
from shmstage.prepare import prepare_lock
with prepare_lock():
    print("held", flush=True)
    sys.stdin.read()  # until the test closes our stdin
"""


def test_two_prepares_on_one_node_take_turns(tmp_path, private_prepare_lock):
    """A second prepare waits for the one holding the lock (saying which pid), fails after the
    timeout with one line, and runs once the first is done."""
    data = make_dataset(tmp_path, "images", files=2)
    config = write_config(
        tmp_path / "node.yaml",
        f"shm: {{path: {tmp_path}}}\ndest: {tmp_path / 'dest'}\ndatasets: [{data}]\n",
    )
    shmstage = [sys.executable, "-m", "shmstage", "prepare", "--config", str(config), "--json"]
    env = dict(os.environ, SHMSTAGE_PREPARE_LOCK=str(private_prepare_lock))
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
    )
    waiter = None
    try:
        assert holder.stdout.readline() == b"held\n"
        timed_out = subprocess.run(
            shmstage, env=dict(env, SHMSTAGE_PREPARE_LOCK_TIMEOUT="0.5"), capture_output=True
        )
        assert timed_out.returncode == 1
        assert timed_out.stdout == b""
        assert timed_out.stderr.decode().splitlines()[-1] == (
            f"Error: another shmstage prepare (pid {holder.pid}) still holds "
            f"{private_prepare_lock} after 0.5 s; wait for it to finish, or stop it"
        )
        assert find("images", dest=tmp_path / "dest") is None  # nothing ran
        waiter = subprocess.Popen(shmstage, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        line = waiter.stderr.readline().decode()
        assert line == (
            f"prepare: waiting for another shmstage prepare (pid {holder.pid}) "
            f"holding {private_prepare_lock}...\n"
        )
        assert waiter.poll() is None
        holder.stdin.close()
        assert holder.wait(timeout=30) == 0
        out, _ = waiter.communicate(timeout=60)
        assert waiter.returncode == 0
        assert json.loads(out)["changed"] is True
        assert find("images", dest=tmp_path / "dest") is not None
    finally:
        for proc in (holder, waiter):
            if proc is None:
                continue
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            for pipe in (proc.stdin, proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()
