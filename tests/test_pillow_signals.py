"""The install survives termination: a real SIGTERM/SIGHUP/SIGINT after `pip uninstall` puts the
previous PIL back, and the build record is written atomically.

The target is a throwaway venv holding a tiny stand-in "Pillow" wheel; "pillow-simd" is a tiny
sdist with an in-tree build backend, found offline through PIP_FIND_LINKS (no compile, no index).
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import select
import signal
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import pytest

from shmstage import pillow

STOCK = "13.0.0"

# The stand-in Pillow: enough of PIL for shmstage's probe (version, features, _imaging).
FAKE_PIL = {
    "PIL/__init__.py": f"__version__ = {STOCK!r}\n",
    "PIL/features.py": "def check_feature(name):\n    return True\n",
    "PIL/_imaging.py": "",
}

BACKEND = """
import base64, hashlib, os, zipfile

NAME, VERSION = "pillow_simd", "9.9.9"
DIST = NAME + "-" + VERSION + ".dist-info"
META = "Metadata-Version: 2.1\\nName: pillow-simd\\nVersion: " + VERSION + "\\n"


def get_requires_for_build_wheel(config_settings=None):
    return []


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    os.makedirs(os.path.join(metadata_directory, DIST))
    with open(os.path.join(metadata_directory, DIST, "METADATA"), "w") as f:
        f.write(META)
    return DIST


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    files = {"PIL/__init__.py": "__version__ = " + repr(VERSION) + "\\n", DIST + "/METADATA": META}
    files[DIST + "/WHEEL"] = "Wheel-Version: 1.0\\nRoot-Is-Purelib: true\\nTag: py3-none-any\\n"
    rows = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        rows.append(path + ",sha256=" + digest.decode() + "," + str(len(text.encode())))
    files[DIST + "/RECORD"] = "\\n".join(rows + [DIST + "/RECORD,,"]) + "\\n"
    name = NAME + "-" + VERSION + "-py3-none-any.whl"
    with zipfile.ZipFile(os.path.join(wheel_directory, name), "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
    return name
"""


def write_wheel(path: Path, name: str, version: str, files: dict[str, str]) -> Path:
    """A minimal valid wheel (purelib) with ``files`` and its RECORD."""
    dist = f"{name}-{version}.dist-info"
    files = {
        **files,
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    rows = []
    for rel, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        rows.append(f"{rel},sha256={digest.decode()},{len(text.encode())}")
    files[f"{dist}/RECORD"] = "\n".join([*rows, f"{dist}/RECORD,,"]) + "\n"
    wheel = path / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for rel, text in files.items():
            z.writestr(rel, text)
    return wheel


def write_sdist(path: Path) -> Path:
    """pillow_simd-9.9.9.tar.gz whose in-tree backend builds a wheel without any compiler."""
    sdist = path / "pillow_simd-9.9.9.tar.gz"
    members = {
        "pyproject.toml": '[build-system]\nrequires = []\nbuild-backend = "backend"\n'
        'backend-path = ["."]\n',
        "backend.py": BACKEND,
        "PKG-INFO": "Metadata-Version: 2.1\nName: pillow-simd\nVersion: 9.9.9\n",
    }
    with tarfile.open(sdist, "w:gz") as tar:
        for rel, text in members.items():
            data = text.encode()
            info = tarfile.TarInfo(f"pillow_simd-9.9.9/{rel}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return sdist


@pytest.fixture(scope="module")
def links(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A find-links directory: the stand-in Pillow wheel and the pillow-simd sdist."""
    d = tmp_path_factory.mktemp("links")
    write_wheel(d, "pillow", STOCK, FAKE_PIL)
    write_sdist(d)
    return d


@pytest.fixture(scope="module")
def venv_template(tmp_path_factory: pytest.TempPathFactory, links: Path) -> Path:
    """A venv with the stand-in Pillow installed offline, made once (ensurepip takes ~5 s)."""
    root = tmp_path_factory.mktemp("venv-template") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True)
    pip = [str(root / "bin" / "python"), "-m", "pip", "install", "-q", "--no-index"]
    subprocess.run([*pip, "--disable-pip-version-check", "--find-links", str(links), "pillow"],
                   check=True)  # fmt: skip
    return root


@pytest.fixture
def venv(tmp_path: Path, venv_template: Path) -> Path:
    """A fresh copy of that venv (each test changes its Pillow); returns its python.  Every
    step runs `python -m pip`, which finds the copy's own site-packages wherever it is."""
    subprocess.run(["cp", "-a", str(venv_template), str(tmp_path / "venv")], check=True)
    return tmp_path / "venv" / "bin" / "python"


def pil_version(python: Path) -> str | None:
    out = subprocess.run(
        [str(python), "-c", "import PIL; print(PIL.__version__)"], capture_output=True, text=True
    )
    return out.stdout.strip() if out.returncode == 0 else None


def wait_for_line(proc: subprocess.Popen, text: str, timeout: float = 120) -> list[str]:
    """Read proc's stderr until a line contains ``text``; returns the lines read."""
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stderr], [], [], 1)
        if not ready:
            continue
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        if text in line:
            return lines
    raise AssertionError(f"no line with {text!r} in:\n{''.join(lines)}")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_signal_after_uninstall_restores_previous_pil(venv, links, shmstage_bin, sig):
    """A real signal right after `pip uninstall` puts Pillow back; exit 128+N with one clear line."""
    env = {
        **os.environ,
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": str(links),
        pillow.PAUSE_ENV: "uninstall",
    }
    cmd = [*shmstage_bin, "pillow-simd", "--python", str(venv), "--no-system-deps"]
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_line(proc, "paused after uninstall")
        assert pil_version(venv) is None  # the window this is about: no PIL at all
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -sig  # died of it, once the old PIL was back
    assert err.splitlines()[-1] == (
        f"Error: interrupted by {sig.name}; the previous PIL {STOCK} was restored and imports"
    )
    assert pil_version(venv) == STOCK
    status = pillow.check(venv)
    assert (status.flavor, status.pillow_version, status.simd_version) == ("Pillow", STOCK, None)


def test_sigterm_during_build_changes_nothing(venv, links, shmstage_bin):
    """SIGTERM before anything was removed exits 143 and says nothing was changed."""
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(links)}
    env[pillow.PAUSE_ENV] = "build"
    cmd = [*shmstage_bin, "pillow-simd", "--python", str(venv), "--no-system-deps"]
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_line(proc, "paused after build")
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGTERM
    assert err.splitlines()[-1] == f"Error: interrupted by SIGTERM; nothing was changed in {venv}"
    assert pil_version(venv) == STOCK


def record_plan() -> pillow.InstallPlan:
    host = pillow.Host(machine="x86_64", cpu_avx2=True)
    before = pillow.status_from_facts(
        {"python": "/venv/bin/python", "dists": {"pillow": STOCK}, "purelib": "/venv/site"}, True
    )
    return pillow.build_plan(host, before, system_deps=False)


@pytest.mark.root
def test_record_write_that_fails_midway_keeps_the_old_record(tmpfs, monkeypatch):
    """A full disk in the middle of writing the record leaves the previous record whole."""
    site = tmpfs("1M")
    (site / "PIL").mkdir()
    facts = {"dists": {"pillow-simd": "9.9.9"}, "pil_dir": str(site / "PIL"), "imaging_sha256": "a"}
    pillow._write_record(record_plan(), facts)
    old = (site / pillow.RECORD_NAME).read_text()
    # Fill the tmpfs, then ask for a record bigger than what is left (CFLAGS is recorded).
    with open(site / "filler", "wb", buffering=0) as f, pytest.raises(OSError):
        while True:
            f.write(b"\0" * 4096)
    monkeypatch.setenv("CFLAGS", "-O2 " * 50_000)
    with pytest.raises(OSError):
        pillow._write_record(record_plan(), {**facts, "imaging_sha256": "b"})
    assert (site / pillow.RECORD_NAME).read_text() == old
    assert json.loads(old)["imaging_sha256"] == "a"
    assert sorted(p.name for p in site.iterdir()) == ["PIL", "filler", pillow.RECORD_NAME]
