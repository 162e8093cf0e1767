"""pillow-simd check and plan logic with faked interpreters, CPUs, distributions and package managers."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from shmstage import pillow
from shmstage.errors import RefusedError, ShmstageError

SHA = "ab" * 32
DEBIAN = pillow.Host(
    machine="x86_64",
    cpu_avx2=True,
    os_ids=("debian",),
    apt=True,
    debs=frozenset({"libjpeg62-turbo-dev", "zlib1g-dev"}),
    root=True,
)


def facts(**over):
    """Probe facts of a venv with stock Pillow 13.0.0 (libjpeg-turbo), overridable."""
    base = {
        "python": "/venv/bin/python",
        "prefix": "/venv",
        "purelib": "/venv/lib/python3.11/site-packages",
        "python_h": True,
        "pip": True,
        "dists": {"pillow": "13.0.0"},
        "dependents": [],
        "version": "13.0.0",
        "pil_dir": "/venv/lib/python3.11/site-packages/PIL",
        "libjpeg_turbo": True,
        "imaging_sha256": SHA,
    }
    base.update(over)
    return base


def simd_facts(avx2=True, **over):
    record = {
        "version": "12.1.1.post0",
        "avx2": avx2,
        "cc": "cc -mavx2" if avx2 else "cc",
        "cflags": "",
        "built_at": "2026-11-22T03:00:00+00:00",
        "imaging_sha256": SHA,
    }
    over.setdefault("record", record)
    over.setdefault("dists", {"pillow-simd": "12.1.1.post0"})
    return facts(version="12.1.1.post0", **over)


def status(f, cpu_avx2=True, hint=" --python /venv/bin/python", scan=pillow.NOT_SCANNED):
    return pillow.status_from_facts(f, cpu_avx2, hint, scan)


# --- check -------------------------------------------------------------------


def test_stock_pillow_is_not_ok_and_says_how_to_replace_it():
    """Stock Pillow: flavor Pillow, not ok, next step names the exact command for that interpreter."""
    s = status(facts())
    assert (s.flavor, s.ok, s.libjpeg_turbo, s.avx2_build) == ("Pillow", False, True, None)
    assert s.next_step == (
        "stock Pillow is active; replace it with pillow-simd: shmstage pillow-simd --python /venv/bin/python"
    )


def test_both_distributions_installed_is_a_conflict():
    """Pillow and pillow-simd both installed -> "conflict", never ok."""
    s = status(simd_facts(dists={"pillow": "13.0.0", "pillow-simd": "12.1.1.post0"}))
    assert (s.flavor, s.ok, s.pillow_version, s.simd_version) == (
        "conflict",
        False,
        "13.0.0",
        "12.1.1.post0",
    )
    assert "both installed" in s.next_step


def test_no_pil_at_all():
    """No distribution and no importable PIL -> flavor none, versions None."""
    s = status(
        facts(
            dists={},
            version=None,
            pil_dir=None,
            import_error="ModuleNotFoundError: No module named 'PIL'",
        )
    )
    assert (s.flavor, s.version, s.ok, s.libjpeg_turbo) == ("none", None, False, None)
    assert s.next_step.startswith("PIL is not installed")


def test_recorded_avx2_build_with_turbo_is_ok():
    """pillow-simd + libjpeg-turbo + a record matching the binary -> ok, AVX2 build known."""
    s = status(simd_facts())
    assert (s.flavor, s.ok, s.avx2_build, s.next_step) == (
        "pillow-simd",
        True,
        True,
        "nothing to do",
    )
    assert s.record is not None and s.record.cc == "cc -mavx2"


def test_record_for_another_binary_means_unknown():
    """A record whose hash differs from the installed _imaging (pip reinstalled it) is ignored."""
    s = status(simd_facts(imaging_sha256="cd" * 32))
    assert (s.ok, s.avx2_build, s.record) == (True, None, None)
    assert s.next_step.startswith("build flags unknown")


def test_record_for_another_version_means_unknown():
    """A record written for another pillow-simd version does not vouch for this one."""
    f = simd_facts()
    f["record"] = {**f["record"], "version": "9.5.0.post2"}
    assert status(f).avx2_build is None


def test_pillow_simd_without_turbo_is_not_ok():
    """pillow-simd linked against plain libjpeg fails the check."""
    s = status(simd_facts(libjpeg_turbo=False))
    assert (s.ok, s.libjpeg_turbo) == (False, False)
    assert "without libjpeg-turbo" in s.next_step


def test_avx2_build_on_cpu_without_avx2_is_not_ok():
    """An AVX2 build on a CPU without AVX2 would SIGILL: not ok, suggests --no-avx2."""
    s = status(simd_facts(), cpu_avx2=False)
    assert s.ok is False
    assert s.next_step.endswith("--python /venv/bin/python --no-avx2")


def test_sse4_build_on_avx2_cpu_is_ok_but_suggests_rebuild():
    """A recorded SSE4 build works (ok) but the next step says AVX2 is available."""
    s = status(simd_facts(avx2=False))
    assert (s.ok, s.avx2_build) == (True, False)
    assert s.next_step.startswith("built for SSE4 only")


def test_broken_pil_is_reported_not_raised():
    """A PIL that fails to import is a reported fact (import_error), not ok."""
    s = status(
        simd_facts(import_error="ImportError: libjpeg.so.62: cannot open shared object file")
    )
    assert (s.flavor, s.ok, s.version, s.libjpeg_turbo) == ("pillow-simd", False, None, None)
    assert "does not import (ImportError: libjpeg.so.62" in s.next_step


def test_check_in_process_matches_probe_in_subprocess():
    """check() in-process and check(python) through a subprocess agree on the same interpreter."""
    here, there = pillow.check(), pillow.check(sys.executable)
    assert (here.flavor, here.version, here.libjpeg_turbo) == (
        there.flavor,
        there.version,
        there.libjpeg_turbo,
    )
    assert there.python == sys.executable


def test_check_does_not_import_pil_at_import_time():
    """Importing shmstage.pillow must not import PIL (the CLI stays fast)."""
    code = "import sys, shmstage.pillow; print('PIL' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_check_unknown_interpreter_is_refused(tmp_path):
    """A --python path that does not exist is a refusal with a clear message."""
    with pytest.raises(RefusedError, match="^no such interpreter: .*/nope$"):
        pillow.check(tmp_path / "nope")


def test_check_broken_interpreter_is_refused(tmp_path):
    """A --python that runs but is not a working Python is refused with its exit code and error."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'no such thing' >&2\nexit 5\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    with pytest.raises(RefusedError) as e:
        pillow.check(fake)
    assert (
        str(e.value) == f"{fake} is not a working Python 3.9+ interpreter (exit 5: no such thing)"
    )


def test_dependents_are_found_by_the_probe(tmp_path):
    """The probe lists installed distributions whose Requires-Dist names pillow (not extras)."""
    site = tmp_path / "site"
    for name, req in [
        ("needs_pil", "Pillow>=8"),
        ("optional_pil", "pillow; extra == 'img'"),
        ("other", "numpy"),
    ]:
        info = site / f"{name}-1.0.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\nRequires-Dist: {req}\n"
        )
    import subprocess

    env = {**os.environ, "PYTHONPATH": str(site)}
    out = subprocess.run(
        [sys.executable, "-c", pillow.probe_source()],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    found = json.loads(out.stdout)["dependents"]
    assert "needs_pil" in found and "optional_pil" not in found and "other" not in found


# --- plan --------------------------------------------------------------------


def argv_of(plan, what):
    return next(s.argv for s in plan.steps if s.what.startswith(what))


def test_refuses_non_x86_64():
    """Other architectures are refused with a clear message (nothing runs)."""
    host = dataclasses.replace(DEBIAN, machine="aarch64")
    with pytest.raises(
        RefusedError,
        match="^pillow-simd's SIMD code is x86-64 only and this machine is aarch64; keep stock Pillow$",
    ):
        pillow.build_plan(host, status(facts()))


def test_avx2_cpu_builds_with_mavx2_without_cache_before_removing_anything():
    """AVX2 CPU: CC='cc -mavx2', --no-cache-dir --no-binary; build, then back up, then remove, then install."""
    plan = pillow.build_plan(DEBIAN, status(facts()))
    build = plan.steps[0]
    assert build.env == {"CC": "cc -mavx2"}
    assert build.argv == (
        "/venv/bin/python",
        "-m",
        "pip",
        "wheel",
        "--no-cache-dir",
        "--no-binary",
        "pillow-simd",
        "--no-deps",
        "--disable-pip-version-check",
        "pillow-simd",
        "-w",
        "$WORK/wheel",
    )
    actions = [s.action for s in plan.steps]
    assert actions == ["run", "backup", "swap", "swap", "verify", "record", "restore"]
    assert argv_of(plan, "removing Pillow 13.0.0")[3:] == (
        "uninstall",
        "-y",
        "--disable-pip-version-check",
        "pillow",
        "pillow-simd",
    )
    assert "--no-index" in argv_of(plan, "installing the wheel")
    assert (plan.avx2, plan.system_deps, plan.warnings) == (True, "present", ())


def test_cpu_without_avx2_builds_sse4_with_a_warning():
    """x86-64 without AVX2: plain cc (SSE4) and a warning, not a refusal."""
    plan = pillow.build_plan(
        dataclasses.replace(DEBIAN, cpu_avx2=False), status(facts(), cpu_avx2=False)
    )
    assert plan.steps[0].env == {"CC": "cc"} and plan.avx2 is False
    assert plan.warnings[0].startswith("this CPU has no AVX2: building the SSE4 variant")


def test_no_avx2_flag_builds_sse4_silently():
    """--no-avx2 on an AVX2 CPU: SSE4 build, no warning."""
    plan = pillow.build_plan(DEBIAN, status(facts()), avx2=False)
    assert (plan.cc, plan.warnings) == ("cc", ())


def test_version_pins_the_requirement():
    """--version V builds and installs exactly pillow-simd==V."""
    plan = pillow.build_plan(DEBIAN, status(facts()), version="9.5.0.post2")
    assert "pillow-simd==9.5.0.post2" in plan.steps[0].argv
    assert argv_of(plan, "installing the wheel")[-1] == "pillow-simd==9.5.0.post2"


@pytest.mark.parametrize(
    ("os_ids", "jpeg"),
    [
        (("debian",), "libjpeg62-turbo-dev"),
        (("ubuntu", "debian"), "libjpeg-turbo8-dev"),
        (("pop", "ubuntu"), "libjpeg-turbo8-dev"),
        (("mint",), "libjpeg-dev"),
    ],
)
def test_apt_installs_the_distributions_libjpeg_turbo_package(os_ids, jpeg):
    """Missing build deps on Debian/Ubuntu: apt-get update + install of the right turbo package and zlib."""
    host = dataclasses.replace(DEBIAN, os_ids=os_ids, debs=frozenset())
    plan = pillow.build_plan(host, status(facts()))
    assert plan.system_deps == "apt"
    assert plan.steps[0].argv == ("apt-get", "update", "-q")
    assert plan.steps[1].argv == (
        "apt-get",
        "install",
        "-y",
        "-q",
        "--no-install-recommends",
        jpeg,
        "zlib1g-dev",
    )
    assert plan.steps[1].env == {"DEBIAN_FRONTEND": "noninteractive"}


def test_apt_adds_compiler_and_system_python_headers_when_missing():
    """No cc and no Python.h for /usr/bin/python3 -> gcc and python3-dev are installed too."""
    host = dataclasses.replace(DEBIAN, cc=False)
    before = status(facts(python="/usr/bin/python3", prefix="/usr", python_h=False))
    assert argv_of(pillow.build_plan(host, before), "installing")[-2:] == ("python3-dev", "gcc")


def test_missing_headers_of_a_non_system_python_are_refused():
    """Python.h missing for a pyenv/venv interpreter cannot come from apt: refused."""
    with pytest.raises(RefusedError, match="^Python.h is missing for /venv/bin/python"):
        pillow.build_plan(DEBIAN, status(facts(python_h=False)))


def test_missing_apt_deps_without_root_are_refused():
    """Not root and deps missing: refused, naming the packages and --no-system-deps."""
    host = dataclasses.replace(DEBIAN, root=False, debs=frozenset({"zlib1g-dev"}))
    with pytest.raises(RefusedError) as e:
        pillow.build_plan(host, status(facts()))
    assert str(e.value) == (
        "build dependencies missing: libjpeg62-turbo-dev; run as root to apt-get install them, "
        "or install them yourself and pass --no-system-deps"
    )


def test_no_apt_no_conda_is_refused_unless_no_system_deps():
    """Without apt or conda the plan refuses; --no-system-deps skips the dependency step."""
    host = dataclasses.replace(DEBIAN, apt=False, os_ids=("fedora",))
    with pytest.raises(RefusedError, match="rerun with --no-system-deps$"):
        pillow.build_plan(host, status(facts()))
    plan = pillow.build_plan(host, status(facts()), system_deps=False)
    assert plan.system_deps == "skipped" and plan.steps[0].argv[3] == "wheel"


def test_conda_env_installs_conda_forge_libjpeg_turbo_into_the_target_prefix(tmp_path):
    """A target prefix with conda-meta/ gets `conda install -p PREFIX -c conda-forge libjpeg-turbo zlib`."""
    (tmp_path / "conda-meta").mkdir()
    host = dataclasses.replace(DEBIAN, conda="/opt/conda/bin/conda")
    plan = pillow.build_plan(host, status(facts(prefix=str(tmp_path))))
    assert plan.system_deps == "conda"
    assert plan.steps[0].argv == (
        "/opt/conda/bin/conda",
        "install",
        "-y",
        "-p",
        str(tmp_path),
        "-c",
        "conda-forge",
        "libjpeg-turbo",
        "zlib",
    )


def test_conda_env_with_deps_present_installs_nothing(tmp_path):
    """conda-meta already lists libjpeg-turbo and zlib: no conda step."""
    meta = tmp_path / "conda-meta"
    meta.mkdir()
    (meta / "libjpeg-turbo-3.0.0-hd590300_1.json").write_text("{}")
    (meta / "zlib-1.3.1-h4ab18f5_1.json").write_text("{}")
    plan = pillow.build_plan(
        dataclasses.replace(DEBIAN, conda="/c/conda"), status(facts(prefix=str(tmp_path)))
    )
    assert plan.system_deps == "present" and plan.steps[0].argv[3] == "wheel"


def test_conda_env_without_conda_executable_is_refused(tmp_path):
    """A conda prefix but no conda/mamba on PATH: refused with what to do."""
    (tmp_path / "conda-meta").mkdir()
    with pytest.raises(RefusedError, match="no conda/mamba executable was found"):
        pillow.build_plan(DEBIAN, status(facts(prefix=str(tmp_path))))


def test_right_build_already_active_is_nothing_to_do():
    """Recorded AVX2 pillow-simd with turbo on an AVX2 CPU: nothing to do, no steps."""
    plan = pillow.build_plan(DEBIAN, status(simd_facts()))
    assert (plan.nothing_to_do, plan.steps) == (True, ())
    result = pillow.install(plan)
    assert result.changed is False


@pytest.mark.parametrize(
    ("f", "kwargs"),
    [
        (simd_facts(avx2=False), {}),  # SSE4 build, AVX2 CPU
        (simd_facts(), {"avx2": False}),  # AVX2 build, SSE4 asked for
        (simd_facts(), {"version": "12.0.0.post0"}),  # another version asked for
        (simd_facts(record=None), {}),  # unknown build flags
    ],
)
def test_rebuilds_when_the_active_build_differs_from_the_request(f, kwargs):
    """Any difference between the active build and the request means a rebuild, replacing pillow-simd."""
    plan = pillow.build_plan(DEBIAN, status(f), **kwargs)
    assert plan.nothing_to_do is False
    assert any(s.what == "removing pillow-simd 12.1.1.post0" for s in plan.steps)


def test_dependents_produce_a_warning():
    """Packages that require pillow are named in a warning (they would bring stock Pillow back)."""
    plan = pillow.build_plan(DEBIAN, status(facts(dependents=["torchvision", "matplotlib"])))
    assert plan.warnings == (
        "matplotlib, torchvision require `pillow`: installing or upgrading them later with pip puts "
        "stock Pillow back over pillow-simd (see docs/pillow-simd.md)",
    )


def test_host_facts_reads_os_release(tmp_path):
    """ID and ID_LIKE from os-release decide the distribution family."""
    release = tmp_path / "os-release"
    release.write_text('NAME="Ubuntu"\nID=ubuntu\nID_LIKE=debian\nVERSION_ID="22.04"\n')
    assert pillow.host_facts(os_release=str(release)).os_ids == ("ubuntu", "debian")


# --- running steps -----------------------------------------------------------


def test_failed_command_reports_command_and_output_tail():
    """A failing external command raises with the step, exit code, last line, command and output tail."""
    step = pillow.Step(
        "doing x",
        (sys.executable, "-c", "print('first'); print('the reason'); raise SystemExit(3)"),
    )
    with pytest.raises(ShmstageError) as e:
        pillow.run_step(step, "/tmp/w")
    lines = str(e.value).splitlines()
    assert lines[0] == "doing x failed (exit 3): the reason"
    assert lines[1].startswith(f"  command: {sys.executable} -c ")
    assert lines[-2:] == ["    first", "    the reason"]


def test_missing_executable_is_reported():
    """A step whose program does not exist fails with a one-line error."""
    with pytest.raises(ShmstageError, match="^doing y failed: /no/such/tool not found$"):
        pillow.run_step(pillow.Step("doing y", ("/no/such/tool",)), "/tmp/w")


def test_verify_reports_sigill(tmp_path):
    """An interpreter killed by SIGILL during verification is reported as an instruction-set problem."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nkill -ILL $$\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    with pytest.raises(ShmstageError, match="signal 4 \\(SIGILL: .*--no-avx2\\)$"):
        pillow._verify(str(fake))


@pytest.mark.parametrize(
    ("over", "message"),
    [
        (
            {"externally_managed": True},
            "/venv/bin/python is the system's externally managed Python (PEP 668)",
        ),
        (
            {"pip": False},
            "/venv/bin/python has no pip; add it with `/venv/bin/python -m ensurepip` and rerun",
        ),
        ({"files": {"pillow": None}}, "pillow 13.0.0 in /venv/bin/python has no RECORD"),
    ],
)
def test_unmanageable_targets_are_refused(over, message):
    """PEP 668 system Pythons, no pip, or a Pillow without RECORD (apt's python3-pil) are refused."""
    with pytest.raises(RefusedError) as e:
        pillow.refuse_unmanageable(facts(**over))
    assert str(e.value).startswith(message)


def test_pip_managed_target_is_accepted():
    """A venv with pip and a RECORD for Pillow passes the pre-flight."""
    pillow.refuse_unmanageable(facts(files={"pillow": ["PIL/__init__.py"]}))


def test_backup_copies_installed_files(tmp_path):
    """The backup copies every existing RECORD file of the old distribution (skipping missing .pyc)."""
    root = tmp_path / "site"
    (root / "PIL").mkdir(parents=True)
    (root / "PIL" / "__init__.py").write_text("x")
    f = {
        "pip": True,
        "files": {"pillow": ["PIL/__init__.py", "PIL/__pycache__/gone.pyc"]},
        "roots": {"pillow": str(root)},
    }
    pairs = pillow._backup(f, tmp_path / "backup")
    assert [(src, copy.read_text()) for src, copy in pairs] == [(root / "PIL" / "__init__.py", "x")]


# --- CLI ---------------------------------------------------------------------


def fake_check(monkeypatch, s):
    monkeypatch.setattr(pillow, "check", lambda python=None: s)


def test_cli_check_fails_on_stock_pillow(runner, cli, monkeypatch):
    """--check exits 1 on stock Pillow and prints the next step."""
    fake_check(monkeypatch, status(facts()))
    result = runner.invoke(cli, ["pillow-simd", "--check"])
    assert result.exit_code == 1
    assert "PIL            Pillow 13.0.0" in result.stdout
    assert result.stdout.splitlines()[-1] == (
        "FAIL: stock Pillow is active; replace it with pillow-simd: shmstage pillow-simd --python /venv/bin/python"
    )


def test_cli_check_passes_on_recorded_build_json(runner, cli, monkeypatch):
    """--check --json exits 0 for an ok build and reports turbo + AVX2 build as JSON."""
    fake_check(monkeypatch, status(simd_facts()))
    result = runner.invoke(cli, ["pillow-simd", "--check", "--json"])
    assert result.exit_code == 0
    doc = json.loads(result.stdout)
    assert (doc["flavor"], doc["ok"], doc["libjpeg_turbo"], doc["avx2_build"]) == (
        "pillow-simd",
        True,
        True,
        True,
    )


def test_cli_check_says_unknown_honestly(runner, cli, monkeypatch):
    """Without a matching record the AVX2 build is printed as unknown."""
    fake_check(monkeypatch, status(simd_facts(record=None)))
    result = runner.invoke(cli, ["pillow-simd", "--check"])
    assert result.exit_code == 0
    assert "AVX2 build     unknown (no shmstage build record for this binary)" in result.stdout


def test_cli_check_rejects_install_options(runner, cli):
    """--check with install options is a usage error (exit 2)."""
    result = runner.invoke(cli, ["pillow-simd", "--check", "--dry-run"])
    assert result.exit_code == 2
    assert result.stderr.splitlines()[-1] == "Error: --check takes only --python and --json"


def test_cli_missing_python_is_usage_error(runner, cli, tmp_path):
    """--python pointing nowhere exits 2 before anything runs."""
    result = runner.invoke(cli, ["pillow-simd", "--check", "--python", str(tmp_path / "nope")])
    assert result.exit_code == 2
    assert "does not exist" in result.stderr


def test_cli_dry_run_prints_commands_and_changes_nothing(runner, cli, monkeypatch):
    """--dry-run prints the exact commands (build first) and never calls install()."""
    plan = pillow.build_plan(DEBIAN, status(facts(dependents=["matplotlib"])))
    monkeypatch.setattr(pillow, "plan_install", lambda *a, **k: plan)
    monkeypatch.setattr(pillow, "install", lambda *a, **k: pytest.fail("dry run installed"))
    result = runner.invoke(cli, ["pillow-simd", "--dry-run"])
    assert result.exit_code == 0
    lines = result.stdout.splitlines()
    assert lines[2] == (
        "CC='cc -mavx2' /venv/bin/python -m pip wheel --no-cache-dir --no-binary pillow-simd --no-deps "
        "--disable-pip-version-check pillow-simd -w $WORK/wheel"
    )
    assert (
        "/venv/bin/python -m pip uninstall -y --disable-pip-version-check pillow pillow-simd"
        in lines
    )
    assert result.stderr.startswith("warning: matplotlib requires `pillow`")


def test_cli_dry_run_json(runner, cli, monkeypatch):
    """--dry-run --json prints the plan with argv and env for every step."""
    plan = pillow.build_plan(DEBIAN, status(facts()))
    monkeypatch.setattr(pillow, "plan_install", lambda *a, **k: plan)
    doc = json.loads(runner.invoke(cli, ["pillow-simd", "--dry-run", "--json"]).stdout)
    assert doc["steps"][0]["env"] == {"CC": "cc -mavx2"}
    assert doc["nothing_to_do"] is False and doc["avx2"] is True


def test_cli_nothing_to_do(runner, cli, monkeypatch):
    """An already-right build prints "nothing to do" and exits 0."""
    plan = pillow.build_plan(DEBIAN, status(simd_facts()))
    monkeypatch.setattr(pillow, "plan_install", lambda *a, **k: plan)
    result = runner.invoke(cli, ["pillow-simd"])
    assert result.exit_code == 0
    assert result.stdout == (
        "OK: nothing to do: pillow-simd 12.1.1.post0 (AVX2 build, libjpeg-turbo) is already active in /venv/bin/python\n"
    )


def test_cli_refusal_is_one_line_exit_2(runner, cli, monkeypatch):
    """A refused plan (e.g. aarch64) is `Error: ...` with exit 2."""
    monkeypatch.setattr(
        pillow, "host_facts", lambda: dataclasses.replace(DEBIAN, machine="aarch64")
    )
    result = runner.invoke(cli, ["pillow-simd", "--dry-run"])
    assert result.exit_code == 2
    assert (
        result.stderr
        == "Error: pillow-simd's SIMD code is x86-64 only and this machine is aarch64; keep stock Pillow\n"
    )


def test_record_is_written_next_to_pil(tmp_path):
    """The build record lands in site-packages next to PIL/ (not inside it) and reads back."""
    (tmp_path / "PIL").mkdir()
    plan = pillow.build_plan(DEBIAN, status(facts()))
    pillow._write_record(plan, simd_facts(pil_dir=str(tmp_path / "PIL")))
    raw = json.loads((tmp_path / pillow.RECORD_NAME).read_text())
    assert (raw["version"], raw["avx2"], raw["cc"], raw["imaging_sha256"]) == (
        "12.1.1.post0",
        True,
        "cc -mavx2",
        SHA,
    )
    assert status(simd_facts(record=raw)).avx2_build is True
    assert not list(Path(tmp_path / "PIL").iterdir())


# --- AVX2 in the binary (issue 15 item 5) -------------------------------------

needs_objdump = pytest.mark.skipif(not shutil.which("objdump"), reason="needs objdump (binutils)")


def test_stock_pillow_binary_has_no_avx2_code():
    """The disassembly of stock Pillow's real _imaging shows no AVX2: check() says "absent"."""
    s = pillow.check(sys.executable)
    if s.flavor != "Pillow" or not shutil.which("objdump"):
        pytest.skip("needs stock Pillow in the test interpreter and objdump")
    assert (s.avx2, s.avx2_instructions, s.avx2_reason) == ("absent", 0, None)


@needs_objdump
@pytest.mark.skipif(not shutil.which("cc"), reason="needs a C compiler")
@pytest.mark.parametrize("flags, state", [(["-mavx2"], "verified"), (["-msse4.1"], "absent")])
def test_scan_tells_a_real_avx2_binary_from_an_sse4_one(tmp_path, flags, state):
    """The same C loop compiled with -mavx2 scans "verified" (counted), with -msse4.1 "absent"."""
    src = tmp_path / "loop.c"
    src.write_text(
        "void add(int *restrict a, const int *restrict b, int n)"
        "{ for (int i = 0; i < n; i++) a[i] = a[i] * 3 + b[i]; }\n"
    )
    so = tmp_path / "loop.so"
    subprocess.run(["cc", "-O3", "-shared", "-fPIC", *flags, "-o", so, src], check=True)
    scan = pillow.scan_avx2(str(so))
    assert scan.state == state
    assert (scan.instructions > 0) is (state == "verified")


def test_scan_without_objdump_is_unverified_never_avx2(monkeypatch, tmp_path):
    """No objdump on PATH: "unverified" with the reason, not a guess from the record."""
    monkeypatch.setenv("PATH", str(tmp_path))
    scan = pillow.scan_avx2(sys.executable)
    assert scan == pillow.Avx2Scan("unverified", None, "objdump not found; install binutils")
    s = status(simd_facts(), scan=scan)
    assert (s.avx2, s.avx2_reason, s.avx2_build) == ("unverified", scan.reason, True)


def test_count_avx2_counts_integer_ymm_ops_only():
    """Integer ops on ymm and AVX2-only mnemonics count; xmm/SSE and AVX1 float ymm ops do not."""
    listing = [
        "0000000000001000 <add>:",
        "    1000:\tvpaddd %ymm1,%ymm0,%ymm0",
        "    1004:\tvpbroadcastd %xmm2,%xmm3",
        "    1008:\tvextracti128 $0x1,%ymm0,%xmm1",
        "    100c:\tvaddps %ymm1,%ymm0,%ymm0",
        "    1010:\tvperm2f128 $0x1,%ymm1,%ymm0,%ymm0",
        "    1014:\tpaddd  %xmm1,%xmm0",
        "    1018:\tvpaddd %xmm1,%xmm0,%xmm0",
    ]
    assert pillow.count_avx2(listing) == 3


def test_record_claiming_avx2_is_checked_against_the_binary():
    """A record saying avx2 (because the plan asked) is not believed when the binary has none."""
    absent = pillow.Avx2Scan("absent", 0)
    s = status(simd_facts(), scan=absent)
    assert (s.avx2_build, s.avx2, s.avx2_active()) == (True, "absent", False)
    assert s.next_step.startswith("the build record says AVX2 but PIL/_imaging contains no AVX2")
    plan = pillow.build_plan(DEBIAN, s, system_deps=False)
    assert plan.nothing_to_do is False and plan.avx2 is True


def test_verified_avx2_code_without_record_needs_nothing_and_sigills_without_cpu():
    """AVX2 code in the binary counts without a record; on a CPU without AVX2 it is not ok."""
    verified = pillow.Avx2Scan("verified", 8120)
    s = status(simd_facts(record=None), scan=verified)
    assert (s.ok, s.avx2_build, s.next_step) == (True, None, "nothing to do")
    s = status(simd_facts(record=None), cpu_avx2=False, scan=verified)
    assert s.ok is False and s.next_step.endswith("--no-avx2")


def test_cli_check_reports_avx2_code(runner, cli, monkeypatch):
    """--check shows the AVX2 code verdict in the table and as typed fields in --json."""
    fake_check(monkeypatch, status(simd_facts(), scan=pillow.Avx2Scan("verified", 8120)))
    result = runner.invoke(cli, ["pillow-simd", "--check"])
    assert "AVX2 code      verified (8120 AVX2 instructions in PIL/_imaging)" in result.stdout
    doc = json.loads(runner.invoke(cli, ["pillow-simd", "--check", "--json"]).stdout)
    assert (doc["avx2"], doc["avx2_instructions"], doc["avx2_reason"]) == ("verified", 8120, None)
