"""pillow-simd for a training interpreter: check what owns ``PIL``, plan and run a safe
AVX2 + libjpeg-turbo source build, and record how it was built.

The target interpreter is often not the one shmstage runs in, so facts about it come
from a small probe run in that interpreter (in-process for the current one). Layers:
``probe`` (facts and verdict), ``avx2`` (the binary's AVX2 code), ``plan`` (the steps),
``install`` (running them, restore on failure or signal).
"""

from __future__ import annotations

import os
import sys

from shmstage import system
from shmstage.pillow.avx2 import NOT_SCANNED, Avx2Scan, count_avx2, scan_avx2
from shmstage.pillow.install import (
    PAUSE_ENV,
    InstallInterrupted,
    InstallResult,
    backup_pil,
    install,
    run_step,
    verify_pil,
    write_record,
)
from shmstage.pillow.plan import (
    WORK,
    X86_64,
    Host,
    InstallPlan,
    Step,
    build_plan,
    host_facts,
    refuse_unmanageable,
)
from shmstage.pillow.probe import (
    RECORD_NAME,
    BuildRecord,
    PillowStatus,
    check,
    probe_source,
    run_probe,
    status_from_facts,
)

# The names the install steps had when they were private: tests reach them through the package.
_backup, _verify, _write_record = backup_pil, verify_pil, write_record

__all__ = [
    "NOT_SCANNED",
    "PAUSE_ENV",
    "RECORD_NAME",
    "WORK",
    "X86_64",
    "Avx2Scan",
    "BuildRecord",
    "Host",
    "InstallInterrupted",
    "InstallPlan",
    "InstallResult",
    "PillowStatus",
    "Step",
    "build_plan",
    "check",
    "count_avx2",
    "host_facts",
    "install",
    "plan_install",
    "probe_source",
    "refuse_unmanageable",
    "run_step",
    "scan_avx2",
    "status_from_facts",
]


def plan_install(
    python: str | os.PathLike[str] | None = None,
    *,
    version: str | None = None,
    avx2: bool = True,
    system_deps: bool = True,
) -> InstallPlan:
    """Look at this machine and the target interpreter and plan the install (changes nothing)."""
    target = os.path.abspath(os.fspath(python)) if python is not None else sys.executable
    facts = run_probe(target)
    refuse_unmanageable(facts)
    before = status_from_facts(
        facts,
        system.has_avx2(),
        "" if python is None else f" --python {python}",
        scan_avx2(facts.get("imaging_path")),
    )
    return build_plan(host_facts(), before, version=version, avx2=avx2, system_deps=system_deps)
