"""`shmstage prepare`: converge a node from its YAML config, idempotently, and fail cleanly.

Root tests run for real in the session's private mount namespace: a small tmpfs stands in
for /dev/shm and a temporary file for /etc/fstab.
"""

from __future__ import annotations

import json
import os
import re
import shutil
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


# -- the node service's steps: its systemd units, the store's own tmpfs (issue 22) ---------

# systemctl where no systemd runs: keeps each unit's enabled/active state in a JSON file and
# logs every call but `show`, one line each; `show` answers NeedDaemonReload and LoadState
# (not-found until the first daemon-reload) from the state.
FAKE_SYSTEMCTL = """#!{python}
import json, os, sys
state_path, log_path = os.environ["FAKE_SYSTEMCTL_STATE"], os.environ["FAKE_SYSTEMCTL_LOG"]
args = [a for a in sys.argv[1:] if not a.startswith("--")]
state = json.load(open(state_path)) if os.path.exists(state_path) else {{}}
verb, unit = args[0], (args[1] if len(args) > 1 else None)
u = state.setdefault(unit, {{"enabled": False, "active": False}}) if unit else None
if verb == "show":
    print("NeedDaemonReload=" + ("yes" if state.get("stale") else "no"))
    print("LoadState=" + ("loaded" if state.get("loaded") else "not-found"))
    sys.exit(0)
with open(log_path, "a") as f:
    f.write(" ".join(args) + "\\n")
if verb == "is-enabled":
    sys.exit(0 if u["enabled"] else 1)
if verb == "is-active":
    sys.exit(0 if u["active"] else 3)
if verb == "enable":
    u["enabled"] = True
elif verb in ("start", "restart"):
    u["active"] = True
elif verb == "daemon-reload":
    state["stale"], state["loaded"] = False, True
json.dump(state, open(state_path, "w"))
"""


@pytest.fixture
def systemctl(tmp_path, monkeypatch):
    """A fake systemctl first on PATH; returns a function giving (and clearing) its call log."""
    bindir = tmp_path / "fakebin"
    bindir.mkdir()
    (bindir / "systemctl").write_text(FAKE_SYSTEMCTL.format(python=sys.executable))
    (bindir / "systemctl").chmod(0o755)
    log, state = tmp_path / "systemctl.log", tmp_path / "systemctl.json"
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SYSTEMCTL_LOG", str(log))
    monkeypatch.setenv("FAKE_SYSTEMCTL_STATE", str(state))

    def calls(stale: bool = False) -> list[str]:
        lines = log.read_text().splitlines() if log.exists() else []
        log.write_text("")
        if stale:  # systemd would say the unit files changed under it
            doc = json.loads(state.read_text()) if state.exists() else {}
            state.write_text(json.dumps({**doc, "stale": True}))
        return [ln for ln in lines if not ln.startswith(("is-enabled", "is-active"))]

    return calls


def service_config(tmp_path: Path, extra: str = "") -> Path:
    return write_config(
        tmp_path / "node.yaml",
        f"shm: {{path: {tmp_path}}}\ndest: {tmp_path / 'dest'}\nservice: {{enabled: true}}\n{extra}",
    )


def step(report, name: str) -> tuple[str, str]:
    found = next(s for s in report["steps"] if s["step"] == name)
    return found["status"], found["detail"]


def test_service_units_are_written_once_and_not_started_without_systemd(runner, cli, tmp_path):
    """service.enabled: the unit and slice are rendered into --systemd-dir (ExecStart runs this
    shmstage on this config); where systemd does not run, the report says so in one line, and a
    second run changes nothing; --dry-run writes nothing; without service.enabled no step."""
    from shmstage.systemd import shmstage_command

    config = service_config(tmp_path)
    units = tmp_path / "units"
    argv = ["--systemd-dir", str(units)]
    _, report = run_json(runner, cli, config, "--dry-run", *argv)
    assert step(report, "service")[0] == "would-change"
    assert not units.exists()

    result, report = run_json(runner, cli, config, *argv)
    assert result.exit_code == 0, result.output
    assert [s for s, _ in statuses(report)] == ["inspect", "shm-size", "service", "pillow-simd"]
    assert step(report, "service") == (
        "changed",
        f"wrote shmstage.slice, shmstage.service in {units}; systemd is not running here: "
        "no service started (run `shmstage serve` yourself)",
    )
    service = (units / "shmstage.service").read_text()
    assert f"\nExecStart={shmstage_command()} serve --config {config}\n" in service
    assert "\nSlice=shmstage.slice\n" in service and "\nKillMode=mixed\n" in service
    assert "\nMemoryAccounting=yes\n" in (units / "shmstage.slice").read_text()
    assert oct((units / "shmstage.service").stat().st_mode & 0o777) == "0o644"
    analyze = shutil.which("systemd-analyze")
    if analyze is not None:  # systemd's own parser accepts both files as rendered
        done = subprocess.run(
            [analyze, "verify", str(units / "shmstage.service"), str(units / "shmstage.slice")],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0 and done.stderr == "", done.stderr

    result, report = run_json(runner, cli, config, *argv)
    assert report["changed"] is False
    assert step(report, "service") == (
        "ok",
        f"units up to date in {units}; systemd is not running here: no service started "
        "(run `shmstage serve` yourself)",
    )
    write_config(config, f"shm: {{path: {tmp_path}}}\ndest: {tmp_path / 'dest'}\n")
    assert "service" not in [s for s, _ in statuses(run_json(runner, cli, config, *argv)[1])]


def test_service_is_reloaded_enabled_and_started_only_when_needed(tmp_path, systemctl):
    """With systemd: the first run writes the units, reloads, enables and starts; a converged
    node gets no systemctl call that changes anything; a changed unit (another config path) is
    reloaded and the running service restarted; a stale systemd (NeedDaemonReload) is reloaded."""
    from shmstage.config import load_config
    from shmstage.prepare import prepare

    config = service_config(tmp_path)
    units, running = tmp_path / "units", tmp_path / "run-systemd-system"
    running.mkdir()

    def converge(path: Path = config):
        report = prepare(load_config(path), systemd_dir=str(units), systemd_running=str(running))
        assert not report.failed, report.error
        return next(s for s in report.steps if s.step == "service")

    first = converge()
    assert first.status == "changed"
    assert first.detail == (
        f"wrote shmstage.slice, shmstage.service in {units}; ran systemctl daemon-reload, "
        "enable shmstage.service, start shmstage.service"
    )
    assert systemctl() == ["daemon-reload", "enable shmstage.service", "start shmstage.service"]

    second = converge()
    assert (second.status, second.detail) == (
        "ok",
        "shmstage.service up to date, enabled and active",
    )
    assert systemctl(stale=True) == []

    third = converge()  # systemd says a unit file changed behind its back
    assert third.status == "changed"
    assert systemctl() == ["daemon-reload"]

    moved = tmp_path / "elsewhere.yaml"
    moved.write_text(config.read_text())
    fourth = converge(moved)
    assert fourth.detail == (
        f"wrote shmstage.service in {units}; ran systemctl daemon-reload, restart shmstage.service"
    )
    assert systemctl() == ["daemon-reload", "restart shmstage.service"]
    assert f"--config {moved}\n" in (units / "shmstage.service").read_text()


def shm_dir(tmp_path: Path) -> Path:
    """A directory standing in for shm.path, beside (not above) the store."""
    path = tmp_path / "shm"
    path.mkdir(exist_ok=True)
    return path


def mountinfo_options(path: Path) -> dict[str, str]:
    """The superblock options /proc/self/mountinfo shows for the mount at ``path``."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[4] == str(path):
            opts = fields[fields.index("-") + 3]
            return dict((o.split("=", 1) + [""])[:2] for o in opts.split(","))
    raise AssertionError(f"{path} is not mounted")


def fake_sysfs(root: Path, cpus: str, memory: str) -> Path:
    node = root / "devices" / "system" / "node"
    node.mkdir(parents=True)
    (node / "has_cpu").write_text(cpus + "\n")
    (node / "has_memory").write_text(memory + "\n")
    (node / "has_normal_memory").write_text(cpus + "\n")
    return root


@pytest.mark.root
def test_store_tmpfs_is_mounted_persisted_and_holds_dest(tmp_path):
    """store_tmpfs: prepare mounts a tmpfs of that size and mode (no mpol on one NUMA node),
    persists it in fstab, stages into <path>/shmstage; the second run changes nothing; a new
    size and mode are applied by a remount and a chmod, and fstab follows."""
    from shmstage.config import load_config
    from shmstage.prepare import prepare
    from shmstage.stage import find

    store, fstab = tmp_path / "store", tmp_path / "fstab"
    fstab.write_text("proc /proc proc defaults 0 0\n")
    data = make_dataset(tmp_path, "images", files=2)
    sysfs = fake_sysfs(tmp_path / "sys", "0", "0")

    def converge(size: str, mode: str, dry_run: bool = False):
        config = write_config(
            tmp_path / "node.yaml",
            f"shm: {{path: {shm_dir(tmp_path)}}}\ndatasets: [{data}]\n"
            f"store_tmpfs: {{path: {store}, size: {size}, mode: '{mode}', fstab: {fstab}}}\n",
        )
        report = prepare(load_config(config), sys_root=str(sysfs), dry_run=dry_run)
        assert not report.failed, report.error
        return report

    try:
        report = converge("8M", "1777", dry_run=True)
        assert [(s.step, s.status) for s in report.steps][2] == ("store-tmpfs", "would-change")
        assert not store.exists() and fstab.read_text() == "proc /proc proc defaults 0 0\n"

        report = converge("8M", "1777")
        assert [(s.step, s.status) for s in report.steps] == [
            ("inspect", "ok"),
            ("shm-size", "skipped"),
            ("store-tmpfs", "changed"),
            ("stage images", "changed"),
            ("pillow-simd", "skipped"),
        ]
        opts = mountinfo_options(store)
        # tmpfs shows mode= only when it is not its default, 1777
        assert opts["size"] == "8192k" and "mode" not in opts and "mpol" not in opts
        assert store.stat().st_mode & 0o7777 == 0o1777
        assert (
            fstab.read_text() == "proc /proc proc defaults 0 0\n"
            f"tmpfs {store} tmpfs nosuid,nodev,size=8M,mode=1777 0 0\n"
        )
        staged = find("images", dest=store / "shmstage")
        assert staged is not None and staged.source == str(data)

        report = converge("8M", "1777")
        assert report.changed is False
        assert (
            report.steps[2].detail == f"tmpfs at {store} (size=8M,mode=1777), persisted in {fstab}"
        )

        report = converge("16M", "0755")
        assert report.steps[2].detail == (
            f"mount -o remount,size=16M {store}; chmod 0755 {store}; persist it in {fstab}"
        )
        assert mountinfo_options(store)["size"] == "16384k"
        assert store.stat().st_mode & 0o7777 == 0o755
        assert fstab.read_text().endswith(
            f"tmpfs {store} tmpfs nosuid,nodev,size=16M,mode=0755 0 0\n"
        )
        assert converge("16M", "0755").changed is False
    finally:
        subprocess.run(["umount", "-l", str(store)], check=False)


@pytest.mark.root
def test_store_tmpfs_interleaves_over_the_cpu_numa_nodes(tmp_path):
    """Two NUMA nodes with CPUs (a faked sysfs): the store is mounted with mpol=interleave and
    fstab says so; a memory-only node (a GPU's HBM) is left out of the interleave."""
    from shmstage.config import load_config
    from shmstage.prepare import prepare
    from shmstage.store_tmpfs import mpol_for
    from shmstage.system import numa

    store, fstab = tmp_path / "store", tmp_path / "fstab"
    fstab.write_text("")
    sysfs = fake_sysfs(tmp_path / "sys", "0-1", "0-1")
    config = write_config(
        tmp_path / "node.yaml",
        f"shm: {{path: {shm_dir(tmp_path)}}}\nstore_tmpfs: {{path: {store}, size: 4M, fstab: {fstab}}}\n",
    )
    try:
        report = prepare(load_config(config), sys_root=str(sysfs))
        assert not report.failed, report.error
        # The kernel shows the policy with the nodes it may use (node 0 alone on this machine).
        opts = mountinfo_options(store)
        assert opts["mpol"].startswith("interleave") and opts["mode"] == "755"
        assert fstab.read_text() == (
            f"tmpfs {store} tmpfs nosuid,nodev,size=4M,mode=0755,mpol=interleave 0 0\n"
        )
        assert prepare(load_config(config), sys_root=str(sysfs)).changed is False
    finally:
        subprocess.run(["umount", "-l", str(store)], check=False)
    gh = fake_sysfs(tmp_path / "gh", "0-1", "0-3")
    assert mpol_for(numa(str(gh))) == "interleave:0-1"
    assert mpol_for(numa(str(fake_sysfs(tmp_path / "one", "0", "0-1")))) is None


@pytest.mark.root
def test_store_tmpfs_refuses_to_hide_files_or_replace_another_mount(tmp_path, tmpfs):
    """A non-empty directory (a mount would hide it) or a non-tmpfs mount there: the step fails
    with what to do, and nothing is mounted or written."""
    from shmstage.config import load_config
    from shmstage.prepare import prepare

    fstab = tmp_path / "fstab"
    fstab.write_text("")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("x")
    config = write_config(
        tmp_path / "node.yaml",
        f"shm: {{path: {shm_dir(tmp_path)}}}\nstore_tmpfs: {{path: {busy}, size: 4M, fstab: {fstab}}}\n",
    )
    report = prepare(load_config(config))
    assert report.error == (
        f"store-tmpfs failed: {busy} is a directory with files in it; a tmpfs mounted there "
        "would hide them: empty it or choose another store_tmpfs.path"
    )
    assert (busy / "keep.txt").exists() and fstab.read_text() == ""


def test_units_written_behind_systemds_back_are_loaded_before_the_start(tmp_path, systemctl):
    """Units already in place (the Ansible role writes them first) but never loaded: prepare
    writes nothing, and reloads systemd before enabling and starting the service."""
    from shmstage import systemd
    from shmstage.config import load_config
    from shmstage.prepare import prepare

    config = service_config(tmp_path)
    units, running = tmp_path / "units", tmp_path / "run-systemd-system"
    units.mkdir()
    running.mkdir()
    for name in systemd.UNITS:
        text = systemd.render(name, command=systemd.shmstage_command(), config=str(config))
        (units / name).write_text(text)
    report = prepare(load_config(config), systemd_dir=str(units), systemd_running=str(running))
    service = next(s for s in report.steps if s.step == "service")
    assert (service.status, service.detail) == (
        "changed",
        "ran systemctl daemon-reload, enable shmstage.service, start shmstage.service",
    )
    assert systemctl() == ["daemon-reload", "enable shmstage.service", "start shmstage.service"]


@pytest.mark.root
def test_store_tmpfs_shrinks_to_the_config_but_never_below_what_it_holds(tmp_path):
    """A smaller store_tmpfs.size is applied by a remount; one below the bytes in use is
    refused with what to do, and the mount and fstab stay as they were."""
    from shmstage.config import load_config
    from shmstage.prepare import prepare

    store, fstab = tmp_path / "store", tmp_path / "fstab"
    fstab.write_text("")

    def converge(size: str):
        config = write_config(
            tmp_path / "node.yaml",
            f"shm: {{path: {shm_dir(tmp_path)}}}\n"
            f"store_tmpfs: {{path: {store}, size: {size}, fstab: {fstab}}}\n",
        )
        return prepare(load_config(config))

    try:
        assert not converge("16M").failed
        assert converge("8M").steps[-2].detail.startswith(f"mount -o remount,size=8M {store}")
        assert mountinfo_options(store)["size"] == "8192k"
        (store / "fill").write_bytes(os.urandom(6 << 20))
        report = converge("4M")
        assert report.failed and "refusing to shrink" in report.error, report.error
        assert mountinfo_options(store)["size"] == "8192k" and "size=8M" in fstab.read_text()
    finally:
        subprocess.run(["umount", "-l", str(store)], check=False)
