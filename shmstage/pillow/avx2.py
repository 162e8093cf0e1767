"""Does a built ``PIL/_imaging`` really contain AVX2 code: count AVX2 instructions in its
``objdump -d`` disassembly (the build record only says what the build asked for)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Avx2Scan:
    """What the disassembly of PIL/_imaging says about AVX2 (objdump on this machine)."""

    state: str  # verified | absent | unverified
    instructions: int | None = None  # AVX2 instructions found; null when not scanned
    reason: str | None = None  # why unverified


NOT_SCANNED = Avx2Scan("unverified", reason="not scanned")

# AVX2 is AVX's 256-bit integer half: integer (vp*) ops on ymm registers, plus a few
# instructions that exist only from AVX2 on. AVX1's ymm float ops (and vpermilps,
# vperm2f128) do not count: an AVX1-only CPU runs them.
_INSN = re.compile(r"^\s*[0-9a-f]+:\s+([a-z][a-z0-9.]*)\s+(.*)$")
_AVX2_ONLY = ("vextracti128", "vinserti128", "vperm2i128", "vbroadcasti128", "vpbroadcast")
_AVX2_ONLY += ("vpgather", "vgather", "vpmaskmov", "vpsllv", "vpsrlv", "vpsrav", "vpblendd")


def count_avx2(disassembly: Iterable[str]) -> int:
    """How many AVX2 instructions an ``objdump -d`` listing contains."""
    count = 0
    for line in disassembly:
        if ":\tv" not in line:  # every AVX instruction is a v... mnemonic (cheap pre-filter)
            continue
        m = _INSN.match(line)
        if not m:
            continue
        op, args = m.groups()
        if op.startswith(_AVX2_ONLY) or (
            "%ymm" in args and op.startswith("vp") and not op.startswith(("vpermil", "vperm2f"))
        ):
            count += 1
    return count


def scan_avx2(path: str | None) -> Avx2Scan:
    """Disassemble the ``_imaging`` extension at ``path`` and count its AVX2 instructions.
    Stock Pillow's ``_imaging`` has none; pillow-simd built with -mavx2 has thousands. Without
    objdump (binutils) the answer is "unverified", never a guess."""
    if not path or not os.path.isfile(path):
        return Avx2Scan("unverified", reason="PIL/_imaging not found")
    objdump = shutil.which("objdump")
    if objdump is None:
        return Avx2Scan("unverified", reason="objdump not found; install binutils")
    try:
        proc = subprocess.Popen(
            [objdump, "-d", "--no-show-raw-insn", path],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            errors="replace",
        )
    except OSError as e:
        return Avx2Scan("unverified", reason=f"objdump did not run: {e}")
    with proc:
        assert proc.stdout is not None
        count = count_avx2(proc.stdout)
    if proc.returncode != 0:
        return Avx2Scan("unverified", reason=f"objdump failed on {path} (exit {proc.returncode})")
    return Avx2Scan("verified" if count else "absent", count)
