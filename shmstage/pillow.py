"""pillow-simd for a training interpreter: check what owns ``PIL``, plan and run a safe
AVX2 + libjpeg-turbo source build, and record how it was built.

The target interpreter is often not the one shmstage runs in, so facts about it come
from a small probe run in that interpreter (in-process for the current one).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import inspect
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shmstage import system
from shmstage.errors import RefusedError, ShmstageError

RECORD_NAME = "shmstage-pillow-simd.json"
"""Build record written next to ``PIL/`` in the target's site-packages (not inside
``PIL/``: pip would leave it behind there and turn ``PIL`` into a namespace package)."""

OUTPUT_TAIL_LINES = 25


# --- check -------------------------------------------------------------------


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


def _run_probe(python: str) -> dict:
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
            f"(exit {proc.returncode}: {_clip(_tail(proc.stderr or proc.stdout, 1), 160) or 'no output'})"
        )
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise ShmstageError(f"{python} printed no probe result: {_tail(proc.stdout, 3)}") from None


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
        step += f" (note: {_require(facts['dependents'])} `pillow`; see docs/pillow-simd.md)"

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


def _require(names: Sequence[str]) -> str:
    return f"{', '.join(sorted(names))} {'requires' if len(names) == 1 else 'require'}"


def check(python: str | os.PathLike[str] | None = None) -> PillowStatus:
    """Which PIL the interpreter ``python`` (default: this one) gets, and is it the fast one."""
    if python is None:
        facts = _probe()
        hint = ""
    else:
        facts = _run_probe(os.fspath(python))
        hint = f" --python {python}"
    return status_from_facts(facts, system.has_avx2(), hint, scan_avx2(facts.get("imaging_path")))


# --- plan --------------------------------------------------------------------

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
            f"{_require(before.dependents)} `pillow`: installing or upgrading them "
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


def plan_install(
    python: str | os.PathLike[str] | None = None,
    *,
    version: str | None = None,
    avx2: bool = True,
    system_deps: bool = True,
) -> InstallPlan:
    """Look at this machine and the target interpreter and plan the install (changes nothing)."""
    target = os.path.abspath(os.fspath(python)) if python is not None else sys.executable
    facts = _run_probe(target)
    refuse_unmanageable(facts)
    before = status_from_facts(
        facts,
        system.has_avx2(),
        "" if python is None else f" --python {python}",
        scan_avx2(facts.get("imaging_path")),
    )
    return build_plan(host_facts(), before, version=version, avx2=avx2, system_deps=system_deps)


# --- install -----------------------------------------------------------------


@dataclass(frozen=True)
class InstallResult:
    changed: bool
    plan: InstallPlan
    after: PillowStatus
    seconds: float


def _quote(arg: str) -> str:
    if "\n" in arg:
        return "<script>"
    return arg if arg.startswith(WORK) and " " not in arg else shlex.quote(arg)


def run_step(step: Step, work: str, *, timeout: float | None = None) -> str:
    """Run one external step without a shell; on failure raise with the command and its output tail."""
    argv = [a.replace(WORK, work) for a in step.argv]
    env = {**os.environ, **step.env}
    try:
        proc = subprocess.run(
            argv,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
        )
    except FileNotFoundError:
        raise ShmstageError(f"{step.what} failed: {argv[0]} not found") from None
    except subprocess.TimeoutExpired as e:
        raise ShmstageError(
            f"{step.what} timed out after {timeout:.0f} s: {step.command()}\n{_tail(e.output)}"
        ) from None
    if proc.returncode != 0:
        lines = [line for line in proc.stdout.strip().splitlines() if line.strip()]
        last = lines[-1].strip() if lines else "no output"
        raise ShmstageError(
            f"{step.what} failed (exit {proc.returncode}): {_clip(last)}\n"
            f"  command: {step.command().replace(WORK, work)}\n"
            f"  last lines of its output:\n{_tail(proc.stdout, indent='    ')}"
        )
    return proc.stdout


_VERIFY_SNIPPET = """
from PIL import Image as _Image
_im = _Image.linear_gradient("L").convert("RGB").resize((97, 61), _Image.BICUBIC)
_im = _im.resize((224, 224), _Image.BILINEAR).transpose(_Image.FLIP_LEFT_RIGHT)
import io as _io
_buf = _io.BytesIO(); _im.save(_buf, "JPEG"); _buf.seek(0)
assert _Image.open(_buf).convert("RGB").size == (224, 224)
"""


def _verify(python: str, avx2: bool = False) -> dict:
    """Probe the new PIL in ``python`` after a real resize/JPEG round trip; raise unless it is
    pillow-simd with libjpeg-turbo (and, for an AVX2 build, AVX2 code in its ``_imaging``)."""
    source = probe_source().replace(
        "\nimport json as _json", _VERIFY_SNIPPET + "\nimport json as _json"
    )
    proc = subprocess.run([python, "-c", source], capture_output=True, text=True, timeout=300)
    if proc.returncode < 0:
        sig = -proc.returncode
        raise ShmstageError(
            f"verification crashed {python} with signal {sig}"
            + (
                " (SIGILL: built for instructions this CPU lacks; retry with --no-avx2)"
                if sig == 4
                else ""
            )
        )
    if proc.returncode != 0:
        raise ShmstageError(f"verification failed in {python}:\n{_tail(proc.stderr)}")
    facts = json.loads(proc.stdout.strip().splitlines()[-1])
    scan = scan_avx2(facts.get("imaging_path"))
    after = status_from_facts(facts, system.has_avx2(), scan=scan)
    if after.flavor != "pillow-simd" or after.import_error:
        raise ShmstageError(f"after the install {python} has {after.flavor}, not pillow-simd")
    if not after.libjpeg_turbo:
        raise ShmstageError(
            "the new pillow-simd was built without libjpeg-turbo; "
            "install the libjpeg-turbo development package and rerun"
        )
    if avx2 and scan.state == "absent":
        raise ShmstageError(
            f'the new pillow-simd was built with CC="cc -mavx2" but its {facts["imaging_path"]} '
            "contains no AVX2 instructions (a cached or SSE4 wheel?); rerun"
        )
    return facts


def _backup(facts: Mapping[str, Any], dest: Path) -> list[tuple[Path, Path]]:
    """Copy the installed Pillow/pillow-simd files aside; returns (original, copy) pairs."""
    refuse_unmanageable(facts)
    pairs: list[tuple[Path, Path]] = []
    for name, files in facts.get("files", {}).items():
        root = Path(facts["roots"][name])
        for rel in files:
            src = Path(os.path.normpath(root / rel))
            if not src.is_file():
                continue  # RECORD lists .pyc files that were never written
            copy = dest / name / str(len(pairs))
            copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, copy)
            pairs.append((src, copy))
    return pairs


def _restore(plan: InstallPlan, pairs: list[tuple[Path, Path]], work: str) -> str:
    """Put the backed-up distribution back; returns a sentence for the error message."""
    pip = (plan.python, "-m", "pip")
    with contextlib.suppress(ShmstageError):
        run_step(
            Step("removing the failed install", (*pip, "uninstall", "-y", "pillow-simd", "pillow")),
            work,
        )
    if not pairs:
        return "PIL was not installed before; the failed pillow-simd was removed again"
    try:
        for src, copy in pairs:
            src.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(copy, src)
        facts = _run_probe(plan.python)
    except (OSError, ShmstageError) as e:
        return f"restoring the previous PIL FAILED ({e}); the backup is in {work}/backup"
    if facts.get("import_error"):
        return f"restored the previous files but PIL does not import: {facts['import_error']}"
    return f"the previous PIL {facts.get('version')} was restored and imports"


class InstallInterrupted(ShmstageError):
    """SIGTERM, SIGHUP or SIGINT arrived during the install; the previous PIL was put back."""

    def __init__(self, signum: int, outcome: str) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name}; {outcome}")
        self.signum = signum
        self.exit_code = 128 + signum


class _Stop(BaseException):
    """Raised by the signal handler inside install(); becomes InstallInterrupted."""

    def __init__(self, signum: int) -> None:
        self.signum = signum


class _Guard:
    """Signal handling for install(): a signal raises _Stop (so the except clause restores),
    except while ``hold()`` is active, when it is only noted: a restore is never cut short."""

    def __init__(self) -> None:
        self.holding = False
        self.pending: int | None = None

    def handler(self, signum: int, frame: Any) -> None:
        if self.holding:
            self.pending = self.pending or signum
            return
        raise _Stop(signum)

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        self.holding = True
        try:
            yield
        finally:
            self.holding = False


@contextlib.contextmanager
def _signals_guarded() -> Iterator[_Guard]:
    """Route SIGTERM/SIGHUP/SIGINT through a _Guard while installing (main thread only; a
    signal the caller ignores, as under nohup, or handles itself stays theirs)."""
    guard = _Guard()
    if threading.current_thread() is not threading.main_thread():
        yield guard
        return
    defaults = {signal.SIGTERM: signal.SIG_DFL, signal.SIGHUP: signal.SIG_DFL}
    defaults[signal.SIGINT] = signal.default_int_handler
    old = {
        s: signal.signal(s, guard.handler)
        for s, default in defaults.items()
        if signal.getsignal(s) == default
    }
    try:
        yield guard
    finally:
        for s, h in old.items():
            signal.signal(s, h)


PAUSE_ENV = "SHMSTAGE_TEST_PAUSE_AFTER"


def _step_name(step: Step) -> str:
    """build | uninstall | install | apt-get | conda | backup | verify | record (for PAUSE_ENV)."""
    if step.argv[1:3] == ("-m", "pip"):
        return {"wheel": "build"}.get(step.argv[3], step.argv[3])
    return os.path.basename(step.argv[0]) if step.argv else step.action


def _pause_for_tests(name: str, log: Callable[[str], None]) -> None:
    """Test hook: with SHMSTAGE_TEST_PAUSE_AFTER=<step name>, wait here (up to 60 s) so a
    test can deliver a signal right after that step."""
    if os.environ.get(PAUSE_ENV) != name:
        return
    log(f"paused after {name} ({PAUSE_ENV})")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(0.1)


def install(plan: InstallPlan, log: Callable[[str], None] = lambda _: None) -> InstallResult:
    """Carry out ``plan``. Until the new wheel exists nothing is removed; after that any
    failure, and SIGTERM/SIGHUP/SIGINT at any step, puts the backed-up previous distribution
    back (never leaves PIL missing). A signal ends it with InstallInterrupted (exit 128+N)."""
    start = time.monotonic()
    if plan.nothing_to_do:
        return InstallResult(False, plan, plan.before, 0.0)
    with (
        tempfile.TemporaryDirectory(prefix="shmstage-pillow-") as work,
        _signals_guarded() as guard,
    ):
        pairs: list[tuple[Path, Path]] = []
        touched = False  # PIL in the target changed: from here on, failures restore
        try:
            for step in plan.steps:
                if step.action == "restore":
                    continue
                line = f"{step.what}: {step.command()}" if step.argv else step.what
                log(line.replace(WORK, work))
                if step.action in ("run", "swap"):
                    touched = touched or step.action == "swap"
                    run_step(step, work)
                elif step.action == "backup":
                    pairs = _backup(_run_probe(plan.python), Path(work, "backup"))
                elif step.action == "verify":
                    facts = _verify(plan.python, plan.avx2)
                elif step.action == "record":
                    _write_record(plan, facts)
                _pause_for_tests(_step_name(step), log)
        except (ShmstageError, OSError) as e:
            message = str(e) if isinstance(e, ShmstageError) else f"install failed: {e}"
            if not touched:
                raise ShmstageError(f"{message}\nnothing was changed in {plan.python}") from None
            with guard.hold():
                outcome = _restore(plan, pairs, work)
            raise ShmstageError(f"{message}\n{outcome}") from None
        except (_Stop, KeyboardInterrupt) as e:
            signum = e.signum if isinstance(e, _Stop) else signal.SIGINT
            outcome = f"nothing was changed in {plan.python}"
            if touched:
                log(f"{signal.Signals(signum).name}: putting the previous PIL back")
                with guard.hold():
                    outcome = _restore(plan, pairs, work)
            raise InstallInterrupted(signum, outcome) from None
    after = check(plan.python)
    return InstallResult(True, plan, after, round(time.monotonic() - start, 1))


def _write_record(plan: InstallPlan, facts: Mapping[str, Any]) -> None:
    record = BuildRecord(
        version=facts["dists"]["pillow-simd"],
        avx2=plan.avx2,
        cc=plan.cc,
        cflags=os.environ.get("CFLAGS", ""),
        built_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        imaging_sha256=facts["imaging_sha256"],
    )
    path = Path(os.path.dirname(facts["pil_dir"]), RECORD_NAME)
    _write_atomic(path, json.dumps(dataclasses.asdict(record), indent=2) + "\n")


def _write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and rename: a crash or a full disk
    mid-write leaves the old file (or none), never half of the new one."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _clip(line: str, width: int = 300) -> str:
    return line if len(line) <= width else line[: width - 3] + "..."


def _tail(text: str | bytes | None, lines: int = OUTPUT_TAIL_LINES, indent: str = "") -> str:
    """The last ``lines`` lines of a command's output (joined with " | " when 3 or fewer)."""
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    kept = [_clip(line) for line in (text or "").strip().splitlines()[-lines:]]
    return " | ".join(kept) if lines <= 3 else "\n".join(indent + line for line in kept)
