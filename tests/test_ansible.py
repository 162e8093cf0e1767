"""The Ansible role: lint-clean, documented variable by variable, and idempotent in a real run."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
ANSIBLE = REPO / "ansible"
ROLE = ANSIBLE / "roles" / "shmstage"
BIN = Path(sys.executable).parent


def tool(name: str) -> str:
    path = shutil.which(name, path=str(BIN)) or shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed (pip install ansible ansible-lint)")
    return path


def ansible_env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
        ANSIBLE_HOME=str(tmp_path / "ansible-home"),
        ANSIBLE_LOCAL_TEMP=str(tmp_path / "ansible-home" / "tmp"),
        ANSIBLE_NOCOLOR="1",
        ANSIBLE_FORCE_COLOR="0",
        ANSIBLE_ROLES_PATH=str(ANSIBLE / "roles"),
        ANSIBLE_PYTHON_INTERPRETER=sys.executable,
    )
    return env


def defaults() -> dict:
    return yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())


def test_every_default_is_typed_in_argument_specs_with_the_same_default():
    """defaults/main.yml and meta/argument_specs.yml list the same variables and defaults."""
    specs = yaml.safe_load((ROLE / "meta" / "argument_specs.yml").read_text())
    options = specs["argument_specs"]["main"]["options"]
    assert set(options) == set(defaults())
    for name, value in defaults().items():
        assert name.startswith("shmstage_")
        assert options[name]["description"], name
        assert options[name].get("default") == value, name


def test_readme_mirrors_defaults_block_by_block():
    """The README's variable tables list every default in the same blocks and order."""
    text = (ROLE / "defaults" / "main.yml").read_text()
    blocks = re.findall(r"^# --- (.+?) -+$", text, flags=re.M)
    readme = (ROLE / "README.md").read_text()
    headings = re.findall(r"^### (.+)$", readme, flags=re.M)
    assert [b.strip() for b in blocks] == headings
    documented = re.findall(r"^\| `(shmstage_\w+)` \|", readme, flags=re.M)
    assert documented == list(defaults())


def test_role_is_ansible_lint_clean():
    """ansible-lint (production profile, offline) passes on the role and the example playbook."""
    lint = tool("ansible-lint")
    env = ansible_env(Path("/tmp"))
    env.pop("ANSIBLE_HOME")
    env.pop("ANSIBLE_LOCAL_TEMP")
    result = subprocess.run(
        [lint, "--nocolor"], cwd=ANSIBLE, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Profile 'production' was required, and it passed" in result.stdout + result.stderr


def test_example_playbook_passes_syntax_check(tmp_path):
    """`ansible-playbook --syntax-check` accepts the example playbook and inventory."""
    result = subprocess.run(
        [tool("ansible-playbook"), "--syntax-check", "-i", "inventory.ini", "playbook.yml"],
        cwd=ANSIBLE,
        env=ansible_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "playbook: playbook.yml" in result.stdout


def recap(output: str) -> dict[str, int]:
    m = re.search(r"^localhost\s*:\s*(.+)$", output, flags=re.M)
    assert m, output
    return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", m.group(1))}


def source_copy(dest: Path) -> Path:
    """The package sources (no .venv, build or caches) so pip builds outside the shared tree."""
    dest.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, dest / name)
    shutil.copytree(
        REPO / "shmstage", dest / "shmstage", ignore=shutil.ignore_patterns("__pycache__")
    )
    return dest


@pytest.mark.root
@pytest.mark.slow
def test_role_converges_for_real_and_second_run_changes_nothing(tmpfs, tmp_path):
    """Run the role twice against localhost, with ansible-core's builtin collection only:
    tmpfs grown by shmstage prepare, the admin's fstab options kept, config, the store's own
    tmpfs mounted and persisted, the node service's units installed and the service started
    (a stand-in systemctl), dataset staged on the store; then changed=0 (and in --check); a
    size above the ceiling fails the play with shmstage's error."""
    shm = tmpfs("32M")
    fstab = tmp_path / "fstab"
    fstab.write_text(
        f"# test fstab\nproc /proc proc defaults 0 0\ntmpfs {shm} tmpfs rw,nosuid,nodev,noexec,size=16M 0 0\n"
    )
    (tmp_path / "no-collections").mkdir()
    env = dict(
        ansible_env(tmp_path),
        ANSIBLE_COLLECTIONS_PATH=str(tmp_path / "no-collections"),
        ANSIBLE_COLLECTIONS_SCAN_SYS_PATH="false",
        SHMSTAGE_PREPARE_LOCK=str(tmp_path / "prepare.lock"),
        FAKE_SYSTEMCTL_STATE=str(tmp_path / "systemd.json"),
        FAKE_SYSTEMCTL_LOG=str(tmp_path / "systemctl.log"),
    )
    fake = tmp_path / "fakebin"
    fake.mkdir()
    (fake / "systemctl").write_text(FAKE_SYSTEMCTL.format(python=sys.executable))
    (fake / "systemctl").chmod(0o755)
    env["PATH"] = f"{fake}{os.pathsep}{env['PATH']}"
    store, units = tmp_path / "store", tmp_path / "units"
    units.mkdir()
    data = tmp_path / "src" / "images"
    data.mkdir(parents=True)
    for i in range(20):
        (data / f"{i:03}.bin").write_bytes(os.urandom(16 << 10) * 4)
    config = tmp_path / "etc" / "shmstage.yaml"
    venv = tmp_path / "venv"
    playbook = tmp_path / "converge.yml"
    role_vars = {
        "shmstage_venv": str(venv),
        "shmstage_package": str(source_copy(tmp_path / "pkg")),
        "shmstage_bin_link": "",
        "shmstage_shm_path": str(shm),
        "shmstage_shm_size": "48M",
        "shmstage_fstab": str(fstab),
        "shmstage_config_path": str(config),
        "shmstage_datasets": [{"source": str(data), "name": "images"}],
        "shmstage_loader_num_workers": 2,
        "shmstage_service_enabled": True,
        "shmstage_systemd_dir": str(units),
        "shmstage_store_tmpfs_path": str(store),
        "shmstage_store_tmpfs_size": "8M",
        "shmstage_shares": [
            {"source": "s3://bkt/pub", "everyone": True},
            {"source": "s3://bkt/team", "group": "root"},
        ],
    }

    def write_play(**overrides) -> None:
        play = [{"name": "Converge", "hosts": "localhost", "gather_facts": False,
                 "roles": [{"role": "shmstage", "vars": {**role_vars, **overrides}}]}]  # fmt: skip
        playbook.write_text(yaml.safe_dump(play))

    write_play()
    cmd = [tool("ansible-playbook"), "-c", "local", "-i", "localhost,", str(playbook)]

    def converge(*extra: str, rc: int = 0) -> str:
        result = subprocess.run(
            [*cmd, *extra], env=env, capture_output=True, text=True, timeout=600
        )
        assert result.returncode == rc, result.stdout[-4000:] + result.stderr[-2000:]
        return result.stdout

    try:
        check_converged(
            converge, write_play, shm, fstab, store, units, config, data, venv, tmp_path
        )
    finally:
        subprocess.run(["umount", "-l", str(store)], check=False)


def check_converged(
    converge, write_play, shm, fstab, store, units, config, data, venv, tmp_path
) -> None:
    first = recap(converge())
    assert first["failed"] == 0
    assert first["changed"] >= 3  # venv, config, prepare (remount + fstab)
    second_out = converge()
    second = recap(second_out)
    assert second["changed"] == 0, second_out[-4000:]
    assert second["failed"] == 0
    # --check on a converged node: prepare runs with --dry-run and finds nothing to do.
    check_out = converge("--check")
    assert recap(check_out)["changed"] == 0, check_out[-4000:]

    # The tmpfs now has the size the role asked for, persisted in the (temporary) fstab.
    st = os.statvfs(shm)
    assert st.f_blocks * st.f_frsize == 48 << 20
    # shmstage rewrote only size= in the admin's line: nosuid,nodev,noexec stay; the store's
    # own tmpfs has its line (mpol=interleave only where the node has several NUMA nodes).
    from shmstage.store_tmpfs import mpol_for
    from shmstage.system import numa

    mpol = mpol_for(numa())
    assert fstab.read_text() == (
        f"# test fstab\nproc /proc proc defaults 0 0\ntmpfs {shm} tmpfs rw,nosuid,nodev,noexec,size=48M 0 0\n"
        f"tmpfs {store} tmpfs nosuid,nodev,size=8M,mode=0755{f',mpol={mpol}' if mpol else ''} 0 0\n"
    )
    st = os.statvfs(store)
    assert st.f_blocks * st.f_frsize == 8 << 20
    # The service's units were rendered by the installed package; the service was started.
    service = (units / "shmstage.service").read_text()
    assert f"\nExecStart={venv}/bin/shmstage serve --config {config}\n" in service
    assert (units / "shmstage.slice").exists()
    assert json.loads((tmp_path / "systemd.json").read_text())["shmstage.service"] == {
        "enabled": True,
        "active": True,
    }
    # The node config is valid and says what the role variables say.
    from shmstage.config import load_config

    cfg = load_config(config)
    assert [(d.source, d.name) for d in cfg.datasets] == [(str(data), "images")]
    assert cfg.shm.path == str(shm)
    assert cfg.loader.num_workers == 2
    assert cfg.service.enabled is True and cfg.store_tmpfs.path == str(store)
    assert [(x.source, x.gid, x.everyone) for x in cfg.shares] == [
        ("s3://bkt/pub", None, True),
        ("s3://bkt/team", 0, False),
    ]
    # The dataset is staged, byte for byte, on the tmpfs.
    from shmstage.stage import find

    staged = find("images", dest=store / "shmstage")  # dest defaults to the store's tmpfs
    assert staged is not None and staged.source == str(data)
    assert sorted(os.listdir(staged.path)) == sorted(os.listdir(data))
    for f in data.iterdir():
        assert (Path(staged.path) / f.name).read_bytes() == f.read_bytes()
    assert (venv / "bin" / "shmstage").exists()

    # A size above the RAM/cgroup ceiling is refused by shmstage; the play fails with its error
    # and neither the tmpfs nor fstab changes.
    before = fstab.read_text()
    write_play(shmstage_shm_size="1000T")
    out = converge(rc=2)
    assert recap(out)["failed"] == 1
    assert re.search(
        r'"msg": "Error: shm-size failed: refusing to size .* to 1000T: more than', out
    ), out[-4000:]
    assert fstab.read_text() == before
    st = os.statvfs(shm)
    assert st.f_blocks * st.f_frsize == 48 << 20


def test_metrics_timer_is_off_by_default_and_its_units_verify(tmp_path):
    """The metrics timer is opt-in (shmstage_metrics_enabled: false guards its tasks); its
    units, rendered by ansible's template module, pass `systemd-analyze verify` and run
    `shmstage metrics --textfile DIR --config PATH` every shmstage_metrics_interval."""
    assert defaults()["shmstage_metrics_enabled"] is False
    main = yaml.safe_load((ROLE / "tasks" / "main.yml").read_text())
    step = next(t for t in main if t.get("ansible.builtin.import_tasks") == "metrics.yml")
    assert step["when"] == "shmstage_metrics_enabled | bool"
    venv = Path(sys.executable).parent.parent  # its bin/shmstage exists: verify checks it
    out = tmp_path / "units"
    out.mkdir()
    for unit in ("shmstage-metrics.service", "shmstage-metrics.timer"):
        result = subprocess.run(
            [
                tool("ansible"), "localhost", "-c", "local", "-i", "localhost,",
                "-m", "ansible.builtin.template",
                "-a", f"src={ROLE / 'templates' / (unit + '.j2')} dest={out / unit} mode=0644",
                "-e", f"__shmstage_bin={venv}/bin/shmstage shmstage_config_path=/etc/shmstage.yaml",
                "-e", "shmstage_metrics_textfile_dir=/var/lib/node-exporter shmstage_metrics_interval=2min",
            ],
            env=ansible_env(tmp_path), capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert result.returncode == 0, result.stdout + result.stderr
    service = (out / "shmstage-metrics.service").read_text()
    assert (
        f"ExecStart={venv}/bin/shmstage metrics --textfile /var/lib/node-exporter "
        "--config /etc/shmstage.yaml\n"
    ) in service
    assert "OnUnitActiveSec=2min\n" in (out / "shmstage-metrics.timer").read_text()
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    result = subprocess.run(
        [analyze, "verify", *(str(p) for p in sorted(out.iterdir()))],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0 and result.stderr == "", result.stderr


# A stand-in for systemctl where no systemd runs (containers, this suite): it keeps each
# unit's enabled/active state in a JSON file and logs every call, one line each.
FAKE_SYSTEMCTL = """#!{python}
import json, os, sys
state_path, log_path = os.environ["FAKE_SYSTEMCTL_STATE"], os.environ["FAKE_SYSTEMCTL_LOG"]
args = [a for a in sys.argv[1:] if not a.startswith("--")]
with open(log_path, "a") as f:
    f.write(" ".join(args) + "\\n")
state = json.load(open(state_path)) if os.path.exists(state_path) else {{}}
verb, unit = args[0], (args[1] if len(args) > 1 else None)
u = state.setdefault(unit, {{"enabled": False, "active": False}}) if unit else None
if verb == "show":
    active = "active" if u["active"] else "inactive"
    print(f"Id={{unit}}\\nLoadState=loaded\\nActiveState={{active}}\\nSubState=waiting")
elif verb == "is-enabled":
    print("enabled" if u["enabled"] else "disabled")
    sys.exit(0 if u["enabled"] else 1)
elif verb in ("enable", "disable"):
    u["enabled"] = verb == "enable"
elif verb in ("start", "restart"):
    u["active"] = unit != "shmstage-metrics.service"  # a oneshot: done at once
elif verb == "stop":
    u["active"] = False
json.dump(state, open(state_path, "w"))
"""


def test_changed_metrics_units_are_reloaded_and_restarted(tmp_path):
    """ansible-playbook (real) with the role's metrics tasks: a changed unit file is followed by
    a daemon-reload and a restart of that unit (handlers); an unchanged one restarts nothing."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "systemctl").write_text(FAKE_SYSTEMCTL.format(python=sys.executable))
    (bindir / "systemctl").chmod(0o755)
    log = tmp_path / "systemctl.log"
    units = tmp_path / "units"
    units.mkdir()
    playbook = tmp_path / "metrics.yml"

    def converge(interval: str) -> list[str]:
        play = [{
            "name": "Metrics units", "hosts": "localhost", "gather_facts": False,
            "tasks": [{
                "name": "Install the metrics timer",
                "ansible.builtin.include_role": {"name": "shmstage", "tasks_from": "metrics.yml"},
                "vars": {
                    "shmstage_venv": str(tmp_path / "venv"),
                    "shmstage_config_path": str(tmp_path / "shmstage.yaml"),
                    "shmstage_metrics_textfile_dir": str(tmp_path / "textfile"),
                    "shmstage_metrics_systemd_dir": str(units),
                    "shmstage_metrics_interval": interval,
                },
            }],
        }]  # fmt: skip
        playbook.write_text(yaml.safe_dump(play))
        log.write_text("")
        env = dict(
            ansible_env(tmp_path),
            PATH=f"{bindir}{os.pathsep}{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
            FAKE_SYSTEMCTL_STATE=str(tmp_path / "systemd.json"),
            FAKE_SYSTEMCTL_LOG=str(log),
        )
        result = subprocess.run(
            [tool("ansible-playbook"), "-c", "local", "-i", "localhost,", str(playbook)],
            env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
        return [line for line in log.read_text().splitlines() if not line.startswith("show ")]

    first = converge("1min")
    # Both units written: systemd rereads them, the timer restarts, the oneshot service runs.
    assert first[-3:] == [
        "daemon-reload",
        "restart shmstage-metrics.timer",
        "start shmstage-metrics.service",
    ], first
    # Converged: nothing written, so nothing restarted or run.
    second = converge("1min")
    assert not [c for c in second if c.startswith(("restart", "start"))], second
    # A new interval rewrites the timer unit only: systemd rereads it, then the timer restarts.
    third = converge("5min")
    assert "OnUnitActiveSec=5min\n" in (units / "shmstage-metrics.timer").read_text()
    assert third[-2:] == ["daemon-reload", "restart shmstage-metrics.timer"], third
    assert not [c for c in third if "shmstage-metrics.service" in c], third


def test_service_units_come_from_the_package_and_restart_only_on_change(tmp_path):
    """ansible-playbook (real) with the role's service tasks: the unit and slice are the bytes
    the installed shmstage renders (what `prepare` writes); a first run enables and starts the
    service, then the handlers reload systemd and restart it; a converged run restarts nothing;
    a new config path rewrites the unit, so systemd rereads it and the service restarts."""
    from shmstage import systemd

    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "systemctl").write_text(FAKE_SYSTEMCTL.format(python=sys.executable))
    (bindir / "systemctl").chmod(0o755)
    log = tmp_path / "systemctl.log"
    units = tmp_path / "units"
    units.mkdir()
    venv = Path(sys.executable).parent.parent
    playbook = tmp_path / "service.yml"

    def converge(config: str) -> list[str]:
        role_vars = {
            "shmstage_venv": str(venv),
            "shmstage_config_path": config,
            "shmstage_systemd_dir": str(units),
            "shmstage_service_enabled": True,
        }
        play = [{
            "name": "Service units", "hosts": "localhost", "gather_facts": False,
            "tasks": [
                {"name": "Install the units", "vars": role_vars, "ansible.builtin.include_role":
                    {"name": "shmstage", "tasks_from": "service-units.yml"}},
                {"name": "Start the service", "vars": role_vars, "ansible.builtin.include_role":
                    {"name": "shmstage", "tasks_from": "service.yml"}},
            ],
        }]  # fmt: skip
        playbook.write_text(yaml.safe_dump(play))
        log.write_text("")
        env = dict(
            ansible_env(tmp_path),
            PATH=f"{bindir}{os.pathsep}{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
            FAKE_SYSTEMCTL_STATE=str(tmp_path / "systemd.json"),
            FAKE_SYSTEMCTL_LOG=str(log),
        )
        result = subprocess.run(
            [tool("ansible-playbook"), "-c", "local", "-i", "localhost,", str(playbook)],
            env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
        calls = log.read_text().splitlines()
        return [c for c in calls if not c.startswith(("show ", "is-enabled", "is-active"))]

    first = converge("/etc/shmstage.yaml")
    for name in systemd.UNITS:
        assert (units / name).read_text() == systemd.render(
            name, command=f"{venv}/bin/shmstage", config="/etc/shmstage.yaml"
        )
    assert "enable shmstage.service" in first and "start shmstage.service" in first, first
    assert first[-2:] == ["daemon-reload", "restart shmstage.service"], first

    second = converge("/etc/shmstage.yaml")
    assert not [c for c in second if c.startswith(("restart", "start", "enable"))], second

    third = converge("/srv/node.yaml")
    assert "--config /srv/node.yaml\n" in (units / "shmstage.service").read_text()
    assert third[-2:] == ["daemon-reload", "restart shmstage.service"], third
    assert not [c for c in third if c.startswith(("start", "enable"))], third
