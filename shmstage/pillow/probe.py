"""What provides ``PIL`` in an interpreter: a self-contained probe run in that interpreter
(in-process for the current one), the build record, and the verdict (``check``)."""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import subprocess
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from shmstage import system
from shmstage.errors import RefusedError, ShmstageError
from shmstage.pillow.avx2 import NOT_SCANNED, Avx2Scan, scan_avx2

RECORD_NAME = "shmstage-pillow-simd.json"
"""Build record written next to ``PIL/`` in the target's site-packages (not inside
``PIL/``: pip would leave it behind there and turn ``PIL`` into a namespace package)."""

OUTPUT_TAIL_LINES = 25


@dataclass(frozen=True)
class BuildRecord:
    """How shmstage built the active pillow-simd (read back from RECORD_NAME)."""

    version: str  # pillow-simd version that was built
    avx2: bool  # built with CC="cc -mavx2" (what was asked; the binary is checked by scan_avx2)
    cc: str  # the CC used
    cflags: str  # CFLAGS in the environment during the build
    built_at: str  # ISO 8601 UTC
    imaging_sha256: str  # SHA-256 of PIL/_imaging*.so: the record only vouches for this binary


@dataclass(frozen=True)
class PillowStatus:
    """What provides ``PIL`` in one interpreter, and whether it is the fast build."""

    python: str  # the interpreter checked
    flavor: str  # "Pillow" | "pillow-simd" | "conflict" (both installed) | "none"
    version: str | None  # PIL.__version__ as imported; null when PIL does not import
    pillow_version: str | None  # installed Pillow distribution
    simd_version: str | None  # installed pillow-simd distribution
    libjpeg_turbo: bool | None  # PIL.features libjpeg_turbo; null when PIL does not import
    avx2_build: bool | None  # from the build record; null = unknown (no record for this binary)
    cpu_avx2: bool  # this CPU has AVX2
    ok: bool  # pillow-simd with libjpeg-turbo is active (the --check exit status)
    next_step: str  # one line: what to do next ("nothing to do" when all is right)
    import_error: str | None = None  # why PIL does not import
    record: BuildRecord | None = None  # shmstage's build record, when it matches the binary
    dependents: tuple[str, ...] = ()  # installed packages that require `pillow`
    site_packages: str | None = None  # where PIL/ lives (or would live)
    prefix: str | None = None  # the interpreter's sys.prefix
    python_h: bool = True  # the interpreter's C headers exist (needed to build)
    avx2: str = "unverified"  # verified | absent | unverified: AVX2 code found in PIL/_imaging
    avx2_instructions: int | None = None  # AVX2 instructions objdump found in PIL/_imaging
    avx2_reason: str | None = None  # why the binary could not be checked (avx2 = unverified)

    def avx2_active(self) -> bool | None:
        """Does the active binary use AVX2: the disassembly when it could be read, else the record."""
        return {"verified": True, "absent": False}.get(self.avx2, self.avx2_build)


def _probe() -> dict:
    """Facts about PIL in *this* interpreter. Self-contained: its source also runs in
    other interpreters through ``python -c``, so it imports everything it uses."""
    import hashlib
    import importlib.metadata as md
    import importlib.util
    import json
    import os
    import re
    import sys
    import sysconfig

    facts: dict = {
        "python": sys.executable,
        "prefix": sys.prefix,
        "purelib": sysconfig.get_paths()["purelib"],
        "python_h": os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")),
        "pip": importlib.util.find_spec("pip") is not None,
        # PEP 668: a distribution's own Python, which pip must not modify
        "externally_managed": sys.prefix == sys.base_prefix
        and os.path.exists(os.path.join(sysconfig.get_paths()["stdlib"], "EXTERNALLY-MANAGED")),
        "dists": {},
        "dependents": [],
        "files": {},
        "roots": {},
    }
    for dist in md.distributions():
        name = re.sub(r"[-_.]+", "-", (dist.metadata["Name"] or "")).lower()
        if name in ("pillow", "pillow-simd"):
            facts["dists"][name] = dist.version
            files = dist.files  # None: no RECORD (installed by a system package manager)
            facts["files"][name] = None if files is None else [str(f) for f in files]
            facts["roots"][name] = str(dist.locate_file(""))
            continue
        for req in dist.requires or []:
            req_name, _, marker = req.partition(";")
            req_name = re.split(r"[\s\[<>=!~;(]", req_name.strip(), maxsplit=1)[0]
            if re.sub(r"[-_.]+", "-", req_name).lower() == "pillow" and "extra" not in marker:
                facts["dependents"].append(dist.metadata["Name"])
                break
    try:
        import PIL
        from PIL import features

        facts["version"] = PIL.__version__
        facts["pil_dir"] = os.path.dirname(PIL.__file__)
        facts["libjpeg_turbo"] = bool(features.check_feature("libjpeg_turbo"))
        from PIL import _imaging

        facts["imaging_path"] = _imaging.__file__
        with open(_imaging.__file__, "rb") as f:
            facts["imaging_sha256"] = hashlib.sha256(f.read()).hexdigest()
        record = os.path.join(os.path.dirname(facts["pil_dir"]), "shmstage-pillow-simd.json")
        if os.path.exists(record):
            with open(record) as f:
                facts["record"] = json.load(f)
    except Exception as e:  # a broken PIL is a fact to report, not a crash
        facts["import_error"] = f"{type(e).__name__}: {e}"
    return facts


# Taken once at import: reading the source later could pick up a newer file on disk
# (shmstage upgraded during a minutes-long install) with different line numbers.
_PROBE_SOURCE = textwrap.dedent(inspect.getsource(_probe))


def probe_source() -> str:
    """The probe as a ``python -c`` script printing one JSON document."""
    return f"{_PROBE_SOURCE}\nimport json as _json\nprint(_json.dumps(_probe()))\n"


def run_probe(python: str) -> dict:
    try:
        proc = subprocess.run(
            [python, "-c", probe_source()], capture_output=True, text=True, timeout=120
        )
    except FileNotFoundError:
        raise RefusedError(f"no such interpreter: {python}") from None
    except PermissionError:
        raise RefusedError(f"not an executable interpreter: {python}") from None
    except subprocess.TimeoutExpired:
        raise ShmstageError(f"{python} did not answer the PIL probe within 120 s") from None
    if proc.returncode != 0:
        # The probe reports PIL problems as facts, so a failure here means the
        # interpreter itself does not work (not Python, too old, broken).
        raise RefusedError(
            f"{python} is not a working Python 3.9+ interpreter "
            f"(exit {proc.returncode}: {clip_line(output_tail(proc.stderr or proc.stdout, 1), 160) or 'no output'})"
        )
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise ShmstageError(
            f"{python} printed no probe result: {output_tail(proc.stdout, 3)}"
        ) from None


def _record_from(facts: Mapping[str, Any]) -> BuildRecord | None:
    raw = facts.get("record")
    if not isinstance(raw, dict):
        return None
    try:
        return BuildRecord(**{f.name: raw[f.name] for f in dataclasses.fields(BuildRecord)})
    except (KeyError, TypeError):
        return None


def status_from_facts(
    facts: Mapping[str, Any], cpu_avx2: bool, hint: str = "", scan: Avx2Scan = NOT_SCANNED
) -> PillowStatus:
    """Turn probe facts into a verdict. ``hint`` is appended to suggested commands; ``scan``
    is what the disassembly of the probed ``_imaging`` says (scan_avx2)."""
    dists = facts.get("dists", {})
    pillow, simd = dists.get("pillow"), dists.get("pillow-simd")
    flavor = (
        "conflict" if pillow and simd else "pillow-simd" if simd else "Pillow" if pillow else "none"
    )
    error = facts.get("import_error")
    turbo = None if error else facts.get("libjpeg_turbo")
    record = _record_from(facts)
    # A record only speaks for the exact binary it was written for: pip may since have
    # reinstalled pillow-simd from a cached SSE4 wheel.
    valid = (
        record is not None
        and flavor == "pillow-simd"
        and record.version == simd
        and record.imaging_sha256 == facts.get("imaging_sha256")
    )
    avx2_build = record.avx2 if valid and record else None
    # The binary outranks the record: the record only says what the build asked for.
    avx2_code = {"verified": True, "absent": False}.get(scan.state, avx2_build)
    cmd = f"shmstage pillow-simd{hint}"

    ok = False
    if flavor == "none":
        step = f"PIL is not installed; install pillow-simd: {cmd}"
    elif flavor == "conflict":
        step = f"Pillow and pillow-simd are both installed and overwrite each other's PIL/; reinstall cleanly: {cmd}"
    elif error:
        step = f"PIL does not import ({error}); reinstall: {cmd}"
    elif flavor == "Pillow":
        step = f"stock Pillow is active; replace it with pillow-simd: {cmd}"
    elif not turbo:
        step = f"pillow-simd is built without libjpeg-turbo; rebuild: {cmd}"
    elif avx2_code and not cpu_avx2:
        step = f"this pillow-simd was built for AVX2, which this CPU lacks (SIGILL); rebuild: {cmd} --no-avx2"
    else:
        ok = True
        if avx2_build and scan.state == "absent":
            step = (
                "the build record says AVX2 but PIL/_imaging contains no AVX2 instructions; "
                f"rebuild: {cmd}"
            )
        elif avx2_code is None and cpu_avx2:
            step = f"build flags unknown (not built by shmstage); to make sure it uses AVX2: {cmd}"
        elif avx2_code is False and cpu_avx2:
            step = f"built for SSE4 only; this CPU has AVX2, rebuild for it: {cmd}"
        else:
            step = "nothing to do"
    if ok and facts.get("dependents"):
        step += f" (note: {require_phrase(facts['dependents'])} `pillow`; see docs/pillow-simd.md)"

    return PillowStatus(
        python=facts.get("python", ""),
        flavor=flavor,
        version=None if error else facts.get("version"),
        pillow_version=pillow,
        simd_version=simd,
        libjpeg_turbo=turbo,
        avx2_build=avx2_build,
        cpu_avx2=cpu_avx2,
        ok=ok,
        next_step=step,
        import_error=error,
        record=record if valid else None,
        dependents=tuple(sorted(facts.get("dependents", []))),
        site_packages=os.path.dirname(facts["pil_dir"])
        if facts.get("pil_dir")
        else facts.get("purelib"),
        prefix=facts.get("prefix"),
        python_h=bool(facts.get("python_h", True)),
        avx2=scan.state,
        avx2_instructions=scan.instructions,
        avx2_reason=scan.reason,
    )


def require_phrase(names: Sequence[str]) -> str:
    return f"{', '.join(sorted(names))} {'requires' if len(names) == 1 else 'require'}"


def check(python: str | os.PathLike[str] | None = None) -> PillowStatus:
    """Which PIL the interpreter ``python`` (default: this one) gets, and is it the fast one."""
    if python is None:
        facts = _probe()
        hint = ""
    else:
        facts = run_probe(os.fspath(python))
        hint = f" --python {python}"
    return status_from_facts(facts, system.has_avx2(), hint, scan_avx2(facts.get("imaging_path")))


def clip_line(line: str, width: int = 300) -> str:
    return line if len(line) <= width else line[: width - 3] + "..."


def output_tail(text: str | bytes | None, lines: int = OUTPUT_TAIL_LINES, indent: str = "") -> str:
    """The last ``lines`` lines of a command's output (joined with " | " when 3 or fewer)."""
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    kept = [clip_line(line) for line in (text or "").strip().splitlines()[-lines:]]
    return " | ".join(kept) if lines <= 3 else "\n".join(indent + line for line in kept)
