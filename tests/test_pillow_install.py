"""Real installs into a throwaway venv: failures leave stock Pillow working, then one real
AVX2 pillow-simd build that --check accepts and a second run leaves alone.

The tests share one venv and run in file order: the two failure tests first (on stock
Pillow), the real build last.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from shmstage import pillow, system
from shmstage.errors import ShmstageError

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not shutil.which("cc"), reason="needs a C compiler"),
    pytest.mark.skipif(
        system.cpu_flags() and "sse4_1" not in system.cpu_flags(), reason="needs an x86-64 CPU"
    ),
]


def pil_version(python: Path) -> str:
    out = subprocess.run(
        [str(python), "-c", "import PIL; print(PIL.__version__)"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A throwaway venv with stock Pillow from PyPI; returns its python."""
    root = tmp_path_factory.mktemp("pillow-venv")
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True)
    python = root / "bin" / "python"
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", "pillow"],
        check=True,
    )
    yield python
    shutil.rmtree(root, ignore_errors=True)


def test_bogus_version_fails_clearly_and_keeps_pillow(venv, shmstage_bin):
    """--version 0.0.0 fails with a clear error (exit 1) and stock Pillow still imports."""
    before = pil_version(venv)
    cmd = [*shmstage_bin, "pillow-simd", "--python", str(venv), "--version", "0.0.0"]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 1
    error = [line for line in result.stderr.splitlines() if line.startswith("Error: ")]
    assert error == [
        "Error: building the AVX2 pillow-simd wheel from source, without pip's cache failed "
        "(exit 1): ERROR: No matching distribution found for pillow-simd==0.0.0"
    ]
    assert result.stderr.rstrip().endswith(f"nothing was changed in {venv}")
    assert pil_version(venv) == before


def test_failure_after_removal_restores_previous_pillow(venv):
    """If installing fails after Pillow was removed, the backed-up Pillow is put back and imports."""
    before = pil_version(venv)
    plan = pillow.build_plan(pillow.host_facts(), pillow.check(venv), system_deps=False)
    # Replace the compile with an empty wheel directory: the install step then fails
    # after the removal, which is the failure this test is about.
    empty = pillow.Step(
        "making an empty wheel dir",
        (sys.executable, "-c", "import os, sys; os.makedirs(sys.argv[1])", f"{pillow.WORK}/wheel"),
    )
    plan = dataclasses.replace(plan, steps=(empty, *plan.steps[1:]))
    with pytest.raises(ShmstageError) as e:
        pillow.install(plan)
    message = str(e.value)
    assert message.startswith("installing the wheel just built failed (exit 1): ")
    assert message.endswith(f"the previous PIL {before} was restored and imports")
    assert pil_version(venv) == before
    status = pillow.check(venv)
    assert (status.flavor, status.pillow_version) == ("Pillow", before)


def test_install_then_check_then_noop(venv, shmstage_bin):
    """The real CLI builds AVX2 pillow-simd; --check passes with turbo + AVX2; a rerun does nothing."""
    cpu_avx2 = system.has_avx2()
    result = subprocess.run(
        [*shmstage_bin, "pillow-simd", "--python", str(venv), "--json"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["changed"] is True
    assert doc["plan"]["steps"][0]["env"] == {"CC": "cc -mavx2" if cpu_avx2 else "cc"}

    check = subprocess.run(
        [*shmstage_bin, "pillow-simd", "--check", "--json", "--python", str(venv)],
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stdout
    status = json.loads(check.stdout)
    assert (status["flavor"], status["ok"], status["libjpeg_turbo"]) == ("pillow-simd", True, True)
    assert status["avx2_build"] is cpu_avx2
    if shutil.which("objdump"):  # the binary itself, not the record's word
        assert status["avx2"] == ("verified" if cpu_avx2 else "absent")
    assert status["pillow_version"] is None
    assert pil_version(venv) == status["simd_version"]

    again = subprocess.run(
        [*shmstage_bin, "pillow-simd", "--python", str(venv)], capture_output=True, text=True
    )
    assert again.returncode == 0
    assert again.stdout.startswith("OK: nothing to do: pillow-simd ")
    assert "building" not in again.stderr
