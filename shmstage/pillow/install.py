"""Carry out an install plan: run the steps, verify the new PIL, back up and restore the
previous one on any failure or termination signal, and write the build record atomically."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shmstage import system
from shmstage.errors import Interrupted, ShmstageError
from shmstage.pillow.avx2 import scan_avx2
from shmstage.pillow.plan import WORK, InstallPlan, Step, refuse_unmanageable
from shmstage.pillow.probe import (
    RECORD_NAME,
    BuildRecord,
    PillowStatus,
    check,
    clip_line,
    output_tail,
    probe_source,
    run_probe,
    status_from_facts,
)


@dataclass(frozen=True)
class InstallResult:
    changed: bool
    plan: InstallPlan
    after: PillowStatus
    seconds: float


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
            f"{step.what} timed out after {timeout:.0f} s: {step.command()}\n{output_tail(e.output)}"
        ) from None
    if proc.returncode != 0:
        lines = [line for line in proc.stdout.strip().splitlines() if line.strip()]
        last = lines[-1].strip() if lines else "no output"
        raise ShmstageError(
            f"{step.what} failed (exit {proc.returncode}): {clip_line(last)}\n"
            f"  command: {step.command().replace(WORK, work)}\n"
            f"  last lines of its output:\n{output_tail(proc.stdout, indent='    ')}"
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


def verify_pil(python: str, avx2: bool = False) -> dict:
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
        raise ShmstageError(f"verification failed in {python}:\n{output_tail(proc.stderr)}")
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


def backup_pil(facts: Mapping[str, Any], dest: Path) -> list[tuple[Path, Path]]:
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
        facts = run_probe(plan.python)
    except (OSError, ShmstageError) as e:
        return f"restoring the previous PIL FAILED ({e}); the backup is in {work}/backup"
    if facts.get("import_error"):
        return f"restored the previous files but PIL does not import: {facts['import_error']}"
    return f"the previous PIL {facts.get('version')} was restored and imports"


class InstallInterrupted(Interrupted):
    """SIGTERM, SIGHUP or SIGINT arrived during the install; the previous PIL was put back."""

    def __init__(self, signum: int, outcome: str) -> None:
        super().__init__(signum, f"interrupted by {signal.Signals(signum).name}; {outcome}")


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
                    pairs = backup_pil(run_probe(plan.python), Path(work, "backup"))
                elif step.action == "verify":
                    facts = verify_pil(plan.python, plan.avx2)
                elif step.action == "record":
                    write_record(plan, facts)
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


def write_record(plan: InstallPlan, facts: Mapping[str, Any]) -> None:
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
