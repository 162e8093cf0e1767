"""The node service's systemd unit and slice (shipped in ``shmstage/service/units/``): rendered
for this node, written atomically, then reloaded, enabled and started with systemctl where
systemd runs.  ``prepare`` calls it; the Ansible role renders the same bytes.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from shmstage.errors import PermissionDenied, ShmstageError

SERVICE = "shmstage.service"
SLICE = "shmstage.slice"
UNITS = (SLICE, SERVICE)  # the slice first: the service names it
UNITS_DIR = Path(__file__).resolve().parent / "service" / "units"  # package data, not a module
SYSTEMD_DIR = "/etc/systemd/system"
# sd_booted(3): systemd is PID 1 when this directory exists.
SYSTEMD_RUNNING = "/run/systemd/system"


def shmstage_command() -> str | tuple[str, ...]:
    """The installed CLI: the ``shmstage`` beside this interpreter (a virtualenv's bin/), else
    the one on PATH (each one path), else ``python -m shmstage`` (three arguments)."""
    beside = os.path.join(os.path.dirname(sys.executable), "shmstage")
    if os.access(beside, os.X_OK):
        return beside
    from shutil import which

    found = which("shmstage")
    return os.path.abspath(found) if found else (sys.executable, "-m", "shmstage")


# Characters systemd reads literally in an unquoted ExecStart= word; anything else is quoted.
_PLAIN = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_./:=@+,-")


def exec_word(arg: str, *, executable: bool = False) -> str:
    """``arg`` as one ExecStart= word (systemd.service(5), "Command lines"): ``%`` doubled (a
    specifier otherwise), ``$`` doubled in an argument (a variable otherwise; systemd does not
    expand the executable's path), and, unless plain, double-quoted with backslash escapes (a
    space would split it)."""
    text = arg.replace("%", "%%")
    if not executable:
        text = text.replace("$", "$$")
    if text and all(c in _PLAIN for c in text):
        return text
    out = []
    for c in text:
        if c in '"\\':
            out.append("\\" + c)
        elif c == "\n":
            out.append("\\n")
        elif ord(c) < 0x20 or ord(c) == 0x7F:
            out.append(f"\\x{ord(c):02x}")
        else:
            out.append(c)
    return '"' + "".join(out) + '"'


def render(name: str, *, command: str | tuple[str, ...], config: str) -> str:
    """The shipped unit ``name`` with ``ExecStart=`` running ``command serve --config config``;
    ``command`` is one executable path, or the argv that runs shmstage."""
    argv = (command,) if isinstance(command, str) else command
    words = [exec_word(argv[0], executable=True)]
    words += [exec_word(a) for a in (*argv[1:], "serve", "--config", config)]
    exec_start = "ExecStart=" + " ".join(words)
    text = (UNITS_DIR / name).read_text(encoding="utf-8")
    lines = [exec_start if line.startswith("ExecStart=") else line for line in text.splitlines()]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class UnitsPlan:
    """What installing the units takes; nothing has changed yet."""

    directory: str
    to_write: tuple[tuple[str, str], ...]  # (path, text) of each unit that is missing or differs
    systemd: bool  # systemd runs here: systemctl can reload, enable and start
    actions: tuple[str, ...]  # the systemctl commands to run, in order ("daemon-reload", ...)

    @property
    def changed(self) -> bool:
        return bool(self.to_write or self.actions)


def _systemctl(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(
            ["systemctl", *args], capture_output=True, text=True, check=False, timeout=120
        )
    except FileNotFoundError:
        raise ShmstageError("systemctl is not installed, though systemd runs here") from None
    except subprocess.TimeoutExpired:
        raise ShmstageError(f"`systemctl {' '.join(args)}` did not finish in 120 s") from None
    if check and done.returncode != 0:
        reason = (done.stderr or done.stdout).strip().splitlines()
        raise ShmstageError(
            f"`systemctl {' '.join(args)}` failed: {reason[-1] if reason else done.returncode}"
        )
    return done


def plan_units(
    config: str,
    *,
    directory: str = SYSTEMD_DIR,
    running: str = SYSTEMD_RUNNING,
    command: str | tuple[str, ...] | None = None,
) -> UnitsPlan:
    """Compare the rendered units with ``directory``'s and ask systemd (read-only) what else
    it takes: a daemon-reload when a file changes or systemd says it needs one, ``enable``
    when the service is not enabled, ``start`` when it is not active, ``restart`` when it is
    but its unit changed."""
    command = command or shmstage_command()
    to_write = []
    for name in UNITS:
        path = os.path.join(directory, name)
        text = render(name, command=command, config=config)
        try:
            current = Path(path).read_text(encoding="utf-8")
        except FileNotFoundError:
            current = None
        except OSError as e:
            raise ShmstageError(f"cannot read {path}: {e.strerror}") from None
        if current != text:
            to_write.append((path, text))
    systemd = os.path.isdir(running)
    actions: list[str] = []
    if systemd:
        shown = _systemctl(
            "show", "--property=NeedDaemonReload,LoadState", SERVICE, check=False
        ).stdout.splitlines()
        state = dict(line.partition("=")[::2] for line in shown)
        # A unit file written behind systemd's back (by the Ansible role, say) is not loaded
        # yet, or loaded stale: reload before enabling and starting it.
        stale = state.get("NeedDaemonReload") == "yes" or state.get("LoadState") == "not-found"
        if to_write or stale:
            actions.append("daemon-reload")
        if _systemctl("is-enabled", "--quiet", SERVICE, check=False).returncode != 0:
            actions.append(f"enable {SERVICE}")
        if _systemctl("is-active", "--quiet", SERVICE, check=False).returncode != 0:
            actions.append(f"start {SERVICE}")
        elif any(p.endswith(SERVICE) for p, _ in to_write):
            actions.append(f"restart {SERVICE}")
    return UnitsPlan(directory, tuple(to_write), systemd, tuple(actions))


def apply_units(plan: UnitsPlan) -> None:
    """Write the changed units (atomically, 0644), then run the plan's systemctl commands."""
    for path, text in plan.to_write:
        _write(path, text)
    for action in plan.actions:
        _systemctl(*action.split())


def _write(path: str, text: str) -> None:
    directory = os.path.dirname(path)
    try:
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.")
    except PermissionError:
        raise PermissionDenied(f"cannot write {path}: permission denied; run as root") from None
    except OSError as e:
        raise ShmstageError(f"cannot write {path}: {e.strerror}") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)  # systemd never reads half a unit
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
