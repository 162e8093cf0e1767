"""Plan a pillow-simd install: the machine facts it depends on, the system packages to add,
and the exact steps (build, backup, swap, verify, record), without changing anything."""

from __future__ import annotations

import functools
import os
import platform
import shlex
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shmstage import system
from shmstage.errors import RefusedError
from shmstage.pillow.probe import RECORD_NAME, PillowStatus, require_phrase

X86_64 = ("x86_64", "amd64")
WORK = "$WORK"  # stands for the install's temporary directory in printed commands


@dataclass(frozen=True)
class Host:
    """The machine facts a plan depends on (faked in tests)."""

    machine: str
    cpu_avx2: bool
    os_ids: tuple[str, ...] = ()  # ID and ID_LIKE from /etc/os-release
    apt: bool = False
    debs: frozenset[str] = frozenset()  # installed Debian packages among the ones we need
    conda: str | None = None  # conda/mamba executable
    root: bool = False
    cc: bool = True  # a C compiler named `cc` is on PATH


@dataclass(frozen=True)
class Step:
    """One thing the install does: an external command, or an internal action (no argv)."""

    what: str
    argv: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    # "run", or "swap" (a command that changes the installed PIL), or an internal action:
    # "backup" | "verify" | "record" | "restore" (the last runs only on failure)
    action: str = "run"

    def command(self) -> str:
        """The step as a copy-pasteable shell line (for --dry-run and error messages)."""
        if not self.argv:
            return f"# {self.what}"
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        cmd = " ".join(_quote(a) for a in self.argv)
        return f"{env} {cmd}" if env else cmd


@dataclass(frozen=True)
class InstallPlan:
    python: str
    requirement: str  # "pillow-simd" or "pillow-simd==V"
    avx2: bool
    cc: str
    system_deps: str  # "apt" | "conda" | "present" | "skipped"
    steps: tuple[Step, ...]
    warnings: tuple[str, ...]
    nothing_to_do: bool
    before: PillowStatus


def host_facts(proc: str = "/proc", os_release: str = "/etc/os-release") -> Host:
    """Read the machine facts (read-only; runs dpkg-query when apt exists)."""
    ids: list[str] = []
    try:
        for line in Path(os_release).read_text().splitlines():
            key, _, value = line.partition("=")
            if key in ("ID", "ID_LIKE"):
                ids += value.strip().strip('"').split()
    except OSError:
        pass
    apt = shutil.which("apt-get") is not None
    debs: frozenset[str] = frozenset()
    if apt and shutil.which("dpkg-query"):
        # dpkg-query exits 1 when some names are unknown but still lists the known ones.
        proc_ = subprocess.run(
            ["dpkg-query", "-W", "-f=${Package} ${db:Status-Abbrev}\n", *_DEB_CANDIDATES],
            capture_output=True,
            text=True,
        )
        debs = frozenset(
            line.split()[0] for line in proc_.stdout.splitlines() if line.split()[1:2] == ["ii"]
        )
    conda = os.environ.get("CONDA_EXE") or shutil.which("mamba") or shutil.which("conda")
    return Host(
        machine=platform.machine().lower(),
        cpu_avx2=system.has_avx2(proc),
        os_ids=tuple(ids),
        apt=apt,
        debs=debs,
        conda=conda,
        root=os.geteuid() == 0,
        cc=shutil.which("cc") is not None,
    )


_DEB_CANDIDATES = (
    "libjpeg62-turbo-dev",
    "libjpeg-turbo8-dev",
    "libjpeg-dev",
    "zlib1g-dev",
    "python3-dev",
    "gcc",
)


def _jpeg_deb(os_ids: Sequence[str]) -> str:
    if "ubuntu" in os_ids:
        return "libjpeg-turbo8-dev"
    if "debian" in os_ids:
        return "libjpeg62-turbo-dev"
    return "libjpeg-dev"  # both distributions point this at their libjpeg-turbo


def _system_steps(host: Host, before: PillowStatus) -> tuple[str, list[Step]]:
    prefix = before.prefix or ""
    if prefix and os.path.isdir(os.path.join(prefix, "conda-meta")):
        if not host.conda:
            raise RefusedError(
                f"{before.python} is in a conda environment but no conda/mamba executable was found; "
                "put conda on PATH, or install libjpeg-turbo and zlib yourself and pass --no-system-deps"
            )
        meta = Path(prefix, "conda-meta")
        wanted = ["libjpeg-turbo", "zlib"]
        missing = [p for p in wanted if not any(meta.glob(f"{p}-[0-9]*.json"))]
        if not missing:
            return "present", []
        argv = (host.conda, "install", "-y", "-p", prefix, "-c", "conda-forge", *missing)
        return "conda", [
            Step(f"installing {', '.join(missing)} from conda-forge into {prefix}", argv)
        ]
    if not host.apt:
        raise RefusedError(
            "no apt-get and not a conda environment: install the libjpeg-turbo and zlib "
            "development headers yourself, then rerun with --no-system-deps"
        )
    wanted = [_jpeg_deb(host.os_ids), "zlib1g-dev"]
    if not before.python_h:
        if not prefix.startswith("/usr"):
            raise RefusedError(
                f"Python.h is missing for {before.python} and apt cannot provide it for a "
                "non-system interpreter; install that Python's development headers"
            )
        wanted.append("python3-dev")
    if not host.cc:
        wanted.append("gcc")
    missing = [p for p in wanted if p not in host.debs]
    if not missing:
        return "present", []
    if not host.root:
        raise RefusedError(
            f"build dependencies missing: {' '.join(missing)}; run as root to apt-get install "
            "them, or install them yourself and pass --no-system-deps"
        )
    env = {"DEBIAN_FRONTEND": "noninteractive"}
    return "apt", [
        Step("refreshing the apt package lists", ("apt-get", "update", "-q"), env),
        Step(
            f"installing {' '.join(missing)}",
            ("apt-get", "install", "-y", "-q", "--no-install-recommends", *missing),
            env,
        ),
    ]


def build_plan(
    host: Host,
    before: PillowStatus,
    *,
    version: str | None = None,
    avx2: bool = True,
    system_deps: bool = True,
) -> InstallPlan:
    """The exact steps that turn ``before`` into an AVX2 (or SSE4) pillow-simd build."""
    if host.machine not in X86_64:
        raise RefusedError(
            f"pillow-simd's SIMD code is x86-64 only and this machine is {host.machine}; "
            "keep stock Pillow"
        )
    if version is not None and not version.strip():
        raise RefusedError("--version must not be empty")
    warnings: list[str] = []
    use_avx2 = avx2 and host.cpu_avx2
    if avx2 and not host.cpu_avx2:
        warnings.append(
            "this CPU has no AVX2: building the SSE4 variant (resize gains are smaller); "
            "an AVX2 build would crash here with SIGILL"
        )
    if before.dependents:
        warnings.append(
            f"{require_phrase(before.dependents)} `pillow`: installing or upgrading them "
            "later with pip puts stock Pillow back over pillow-simd (see docs/pillow-simd.md)"
        )
    cc = "cc -mavx2" if use_avx2 else "cc"
    requirement = f"pillow-simd=={version}" if version else "pillow-simd"
    python = before.python
    same = (
        before.ok
        and before.avx2_active() is use_avx2
        and (version is None or before.simd_version == version)
    )
    plan = functools.partial(
        InstallPlan,
        python=python,
        requirement=requirement,
        avx2=use_avx2,
        cc=cc,
        before=before,
    )
    if same:
        return plan(system_deps="skipped", steps=(), nothing_to_do=True, warnings=tuple(warnings))

    if not before.python_h and not system_deps:
        warnings.append(f"Python.h is missing for {python}: the build will likely fail")
    pip = (python, "-m", "pip")
    if not before.site_packages or not os.path.isabs(python):
        raise RefusedError(
            f"cannot tell where {python} installs packages; pass --python with an absolute path"
        )
    kind, steps = _system_steps(host, before) if system_deps else ("skipped", [])
    old = [
        f"{name} {v}"
        for name, v in (("Pillow", before.pillow_version), ("pillow-simd", before.simd_version))
        if v
    ]
    steps += [
        Step(
            f"building the {'AVX2' if use_avx2 else 'SSE4'} pillow-simd wheel from source, "
            "without pip's cache",
            (
                *pip,
                "wheel",
                "--no-cache-dir",
                "--no-binary",
                "pillow-simd",
                "--no-deps",
                "--disable-pip-version-check",
                requirement,
                "-w",
                f"{WORK}/wheel",
            ),
            {"CC": cc},
        ),
    ]
    if old:
        steps.append(
            Step(
                f"backing up the installed {' and '.join(old)} files to {WORK}/backup",
                action="backup",
            )
        )
        steps.append(
            Step(
                f"removing {' and '.join(old)}",
                (*pip, "uninstall", "-y", "--disable-pip-version-check", "pillow", "pillow-simd"),
                action="swap",
            )
        )
    steps += [
        Step(
            "installing the wheel just built",
            (
                *pip,
                "install",
                "--no-deps",
                "--no-index",
                "--disable-pip-version-check",
                "--find-links",
                f"{WORK}/wheel",
                requirement,
            ),
            action="swap",
        ),
        Step(f"verifying in {python}: import PIL, libjpeg-turbo, a small resize", action="verify"),
        Step(f"recording the build in {before.site_packages}/{RECORD_NAME}", action="record"),
    ]
    if old:
        steps.append(
            Step(
                f"on any failure after the removal: put the backed-up {' and '.join(old)} back",
                action="restore",
            )
        )
    return plan(system_deps=kind, steps=tuple(steps), nothing_to_do=False, warnings=tuple(warnings))


def refuse_unmanageable(facts: Mapping[str, Any]) -> None:
    """Refuse targets whose PIL pip cannot safely replace (and so cannot be backed up)."""
    python = facts.get("python")
    if facts.get("externally_managed"):
        raise RefusedError(
            f"{python} is the system's externally managed Python (PEP 668); install into a "
            f"venv instead: {python} -m venv DIR, then --python DIR/bin/python"
        )
    if not facts.get("pip"):
        raise RefusedError(f"{python} has no pip; add it with `{python} -m ensurepip` and rerun")
    for name, files in facts.get("files", {}).items():
        if files is None:
            raise RefusedError(
                f"{name} {facts['dists'][name]} in {python} has no RECORD (installed by a system "
                "package manager), so pip can neither back it up nor remove it; use a venv"
            )


def _quote(arg: str) -> str:
    if "\n" in arg:
        return "<script>"
    return arg if arg.startswith(WORK) and " " not in arg else shlex.quote(arg)
