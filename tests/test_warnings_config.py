"""The suite's warning filters: errors in __del__ and during GC fail the test that caused them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

BROKEN_DEL = """
import gc


class Broken:
    def __del__(self):
        raise RuntimeError("error inside __del__")


def test_drops_a_broken_object():
    Broken()
    gc.collect()
"""


def test_an_error_in_del_fails_the_test(tmp_path):
    """pyproject's filterwarnings do not ignore PytestUnraisableExceptionWarning."""
    (tmp_path / "test_inner.py").write_text(BROKEN_DEL)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"),
         "--rootdir", str(tmp_path), "-p", "no:cacheprovider", "-q", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    assert "error inside __del__" in result.stdout
