"""Run a job to completion as ``shmstage run``'s child: in its own session, every signal
forwarded to it once, its orphans reaped, its leftovers terminated when it exits, and its exit
status (or the signal that killed it) handed back.  See NOTE [run: signals and the child].
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Collection, Mapping, Sequence
from typing import Any, Callable

import psutil

from shmstage.errors import ShmstageError
from shmstage.libc import load_libc

# Signals a launcher must pass on: torchrun shuts its workers down on INT/TERM, jobs
# checkpoint on USR1/USR2 (Slurm's --signal), HUP/QUIT for the rest.
FORWARDED_SIGNALS = (
    signal.SIGINT,
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)
LEFTOVER_GRACE = 5.0  # seconds a leftover descendant gets between SIGTERM and SIGKILL

_SI_USER = 0  # si_code of a signal sent with kill()
_SI_KERNEL = 0x80  # si_code of a signal the kernel sent, e.g. a terminal's ^C
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37


class CommandNotFound(ShmstageError):
    """The command to run does not exist (exit 127, like a shell)."""

    exit_code = 127


class CannotExecute(ShmstageError):
    """The command exists but cannot be executed (exit 126, like a shell)."""

    exit_code = 126


# NOTE [run: signals and the child]
#
#   shmstage (blocks FORWARDED + TSTP + CHLD) ── Popen ──▶ child: setsid() (own session and
#        │  sigtimedwait loop                              group), mask restored, PDEATHSIG
#        ├─ SIGCHLD / timeout ─▶ poll(): exited? ─▶ terminate leftovers ─▶ return status
#        ├─ SIGTSTP (^Z) ──────▶ SIGSTOP the job's group, stop ourselves; on resume SIGCONT it
#        ├─ FORWARDED, from the terminal (si_code SI_KERNEL) ──▶ killpg(job, sig)
#        └─ FORWARDED, sent by kill() ──▶ kill(job, sig), unless slurmstepd sent it to the
#                                whole step (then the job got it from Slurm directly)
#
# - Each signal must reach the job exactly once: a second SIGINT/SIGTERM cuts torchrun's own
#   shutdown short.  Because the job has its own session, nothing aimed at shmstage reaches
#   it directly: not a terminal's ^C/^\/hangup (the tty signals its foreground group, which
#   the job is not in), not `kill -- -PGID` of our group, not a kill of every process in our
#   session.  shmstage forwards each of those once: to the job's process group when the
#   terminal sent it, as the terminal would have (`sh -c "python train.py"`: both get ^C),
#   else to the job's process alone, like `kill PID`.  torchrun starts its workers in
#   sessions of their own, so torchrun alone gets the signal and stops them itself.
# - A signal that reaches the job without passing through us is not ours to forward:
#   under proctrack/linuxproc Slurm's scancel / `--signal=USR1@T` signal every process of a
#   step from slurmstepd.  So a signal whose sender is slurmstepd is not forwarded, except
#   when shmstage is the batch shell itself (`exec shmstage run ...` in an sbatch script, no
#   SLURM_STEP_ID): `--signal=B:USR1` and `scancel -b` reach only that process; and except
#   under proctrack/cgroup, which signals only a step's tasks (slurmstepd's children: us),
#   SIGKILL excepted, so the job gets Slurm's signals only from us.
# - The signals are blocked before the fork, so none is lost between spawn and wait; the
#   child unblocks them in preexec_fn.  Python handlers stay installed as a fallback for a
#   signal delivered to another thread (which does not block it).
# - PR_SET_PDEATHSIG: if shmstage itself is SIGKILLed, the kernel sends the child SIGTERM.
# - PR_SET_CHILD_SUBREAPER: descendants the job orphans are re-parented to us, not init,
#   so after the job exits we find them, SIGTERM them, and SIGKILL after LEFTOVER_GRACE.
# - Teardown (SignalHold): from the job's start to the end of run()'s cleanup the forwarded
#   signals stay blocked, so once the job has exited a second ^C cannot unwind the leftovers'
#   grace (they would be orphaned to init, still running) or --cleanup's evict (its trash
#   left behind).  It is picked up with sigtimedwait: it ends the grace early (SIGKILL now)
#   and, after the cleanup, shmstage dies of the first signal (the job's, else that one).


def _libc() -> Any:
    try:
        return load_libc()
    except OSError:  # not Linux / no libc: prctl features are skipped
        return None


def _child_setup(mask: set[signal.Signals], parent: int) -> Callable[[], None]:
    libc = _libc() if sys.platform.startswith("linux") else None

    def setup() -> None:  # runs in the child between fork and exec
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        if libc is not None:
            libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
            if os.getppid() != parent:  # parent died before prctl took effect
                os.kill(os.getpid(), signal.SIGTERM)

    return setup


def _set_subreaper(libc: Any, on: bool) -> bool:
    """Set PR_SET_CHILD_SUBREAPER; return the previous value."""
    if libc is None:
        return False
    old = ctypes.c_int(0)
    libc.prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(old), 0, 0, 0)
    libc.prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0)
    return bool(old.value)


# Of FORWARDED_SIGNALS, those that stop shmstage; USR1/USR2 (a checkpoint request) mean nothing
# once the job has ended.
_STOPPING_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT})


class SignalHold:
    """FORWARDED_SIGNALS held back (blocked) while shmstage tears down after its job: the
    leftovers' SIGTERM grace and SIGKILL, the lease release, ``--cleanup``'s evict.

    An impatient second ^C there must not unwind half-way (leftovers never SIGKILLed, an
    evict's trash left behind): it is remembered instead (:meth:`poll`), cuts the leftovers'
    grace short, and once the teardown is done shmstage dies of the first signal: the job's,
    else this one (:meth:`release`).  Only the main thread can hold signals; elsewhere
    nothing is held.  See NOTE [run: signals and the child].
    """

    def __init__(self) -> None:
        self.signal: int | None = None  # the first stopping signal that arrived while held
        self.unheld_mask: set[signal.Signals] | None = None  # the mask before hold()

    @property
    def holding(self) -> bool:
        return self.unheld_mask is not None

    def hold(self) -> None:
        """Start holding (idempotent)."""
        if self.unheld_mask is None and threading.current_thread() is threading.main_thread():
            self.unheld_mask = signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED_SIGNALS)

    def poll(self) -> int | None:
        """Take the signals that arrived meanwhile; the first stopping one, or None."""
        if self.holding:
            while (info := signal.sigtimedwait(FORWARDED_SIGNALS, 0)) is not None:
                if self.signal is None and info.si_signo in _STOPPING_SIGNALS:
                    self.signal = info.si_signo
        return self.signal

    def release(self, redeliver: bool) -> None:
        """Stop holding; with ``redeliver``, act on a signal that arrived meanwhile as if it
        came now (so shmstage dies of it); without, it is dropped (the first one wins)."""
        if not self.holding:
            return
        self.poll()
        assert self.unheld_mask is not None
        signal.pthread_sigmask(signal.SIG_SETMASK, self.unheld_mask)
        self.unheld_mask = None
        if redeliver and self.signal is not None:
            signal.raise_signal(self.signal)


def _terminate(procs: list[psutil.Process], grace: float, held: SignalHold | None = None) -> None:
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.terminate()
    alive = procs
    deadline = time.monotonic() + grace
    while alive and time.monotonic() < deadline:
        if held is not None and held.poll() is not None:
            break  # told to stop again: no more waiting, SIGKILL now
        _, alive = psutil.wait_procs(alive, timeout=min(0.1, max(0.0, deadline - time.monotonic())))
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(alive, timeout=grace)


def exit_status(returncode: int) -> int:
    """A shell's view of a child's status: 128+N when signal N killed it."""
    return 128 - returncode if returncode < 0 else returncode


def spawn(
    command: Sequence[str],
    env: Mapping[str, str] | None = None,
    *,
    executable: str | None = None,
    grace: float = LEFTOVER_GRACE,
    log: Callable[[str], None] | None = None,
    held: SignalHold | None = None,
    spare: Collection[int] = (),
) -> tuple[int, int, int | None]:
    """Run ``command`` to completion forwarding signals; return (exit status, leftovers
    killed, the signal that killed the job or None).

    ``spare``: our own children started before the job (``run --no-wait``'s stagers), whose
    descendants (copy workers forked while the job runs) are not the job's leftovers.

    ``held``: the caller's :class:`SignalHold`, which it releases after its own teardown;
    without, spawn holds signals until the job's leftovers are gone.
    See NOTE [run: signals and the child].
    """
    own = held is None
    hold = SignalHold() if held is None else held
    hold.hold()
    libc = _libc() if sys.platform.startswith("linux") else None
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    old_subreaper = _set_subreaper(libc, True)
    returncode: int | None = None
    try:
        returncode = _run_child(command, env, executable, before, hold.unheld_mask)
        leftovers = [
            p
            for p in me.children(recursive=True)
            if p.pid not in before and not _descends(p, spare)
        ]
        if leftovers:
            if log is not None:
                log(f"terminating {len(leftovers)} process(es) the job left running")
            _terminate(leftovers, grace, hold)
    finally:
        _set_subreaper(libc, old_subreaper)
        if own:  # the job's own signal wins; an error in flight too
            hold.release(redeliver=returncode is not None and returncode >= 0)
    return exit_status(returncode), len(leftovers), (-returncode if returncode < 0 else None)


def _run_child(
    command: Sequence[str],
    env: Mapping[str, str] | None,
    executable: str | None,
    not_ours: set[int],
    unheld_mask: set[signal.Signals] | None = None,
) -> int:
    main_thread = threading.current_thread() is threading.main_thread()
    watched = {*FORWARDED_SIGNALS, signal.SIGTSTP, signal.SIGCHLD}
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, watched) if main_thread else set()
    # the job starts with the mask shmstage had before it held signals for its teardown
    child_mask = old_mask if unheld_mask is None else unheld_mask
    old_handlers: dict[int, Any] = {}
    child: subprocess.Popen[Any] | None = None
    try:
        try:
            child = subprocess.Popen(
                list(command),
                executable=executable,
                env=None if env is None else dict(env),
                preexec_fn=_child_setup(child_mask, os.getpid()),
                start_new_session=True,  # see NOTE [run: signals and the child]
            )
        except FileNotFoundError:
            if executable is not None and os.path.exists(executable):  # a #! line's interpreter
                raise CommandNotFound(f"cannot run {command[0]}: bad interpreter") from None
            raise CommandNotFound(f"command not found: {command[0]}") from None
        except OSError as e:
            raise CannotExecute(f"cannot run {command[0]}: {e.strerror or e}") from None
        if main_thread:

            def fallback(signum: int, _frame: Any) -> None:
                child.send_signal(signum)

            for sig in FORWARDED_SIGNALS:
                old_handlers[sig] = signal.signal(sig, fallback)
            _wait_forwarding(child, watched, not_ours)
        else:
            child.wait()
    finally:
        if child is not None and child.poll() is None:  # we are failing: take the job with us
            child.terminate()
            try:
                child.wait(LEFTOVER_GRACE)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        if main_thread:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        for sig, handler in old_handlers.items():
            signal.signal(sig, handler)
    return child.returncode


def _wait_forwarding(
    child: subprocess.Popen[Any], watched: set[signal.Signals], not_ours: set[int]
) -> None:
    while child.poll() is None:
        info = signal.sigtimedwait(watched, 0.5)
        if info is None:
            continue
        if info.si_signo == signal.SIGCHLD:
            _reap_orphans(child.pid, not_ours)
        elif info.si_signo == signal.SIGTSTP:
            _suspend_with(child)
        elif info.si_code == _SI_KERNEL:  # from our terminal: deliver it as the tty would
            _signal_job(child, info.si_signo)
        elif not sent_to_whole_slurm_step(info.si_code, info.si_pid, info.si_uid):
            child.send_signal(info.si_signo)


def _signal_job(child: subprocess.Popen[Any], sig: int) -> None:
    """Send ``sig`` to the job's process group (its own, from setsid), or the job alone."""
    if child.returncode is not None:
        return
    try:
        os.killpg(child.pid, sig)  # the job leads its own group (setsid)
    except (ProcessLookupError, PermissionError):
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, sig)


def _suspend_with(child: subprocess.Popen[Any]) -> None:
    """^Z: stop the job's group, then ourselves; resume it when we are continued.

    SIGSTOP, not SIGTSTP: the job's group has no terminal (its own session), and the kernel
    drops SIGTSTP sent to such an orphaned group.
    """
    _signal_job(child, signal.SIGSTOP)
    os.kill(os.getpid(), signal.SIGSTOP)  # returns when our shell sends SIGCONT (fg / bg)
    _signal_job(child, signal.SIGCONT)


def sent_to_whole_slurm_step(
    si_code: int, si_pid: int, si_uid: int, environ: Mapping[str, str] | None = None
) -> bool:
    """Whether a signal came from slurmstepd signalling every process of the step.

    Then the job received it from Slurm too, and forwarding it would deliver it twice.  Not
    so when shmstage is the batch shell (the batch step, without SLURM_STEP_ID, and
    slurmstepd our parent): ``--signal=B:SIG`` and ``scancel -b`` signal only that process;
    nor under proctrack/cgroup, which signals only the step's tasks (``slurm_signals_tasks_only``).
    See NOTE [run: signals and the child].
    """
    if si_code != _SI_USER or si_pid <= 0 or si_uid != 0:  # slurmstepd runs as root
        return False
    try:
        with open(f"/proc/{si_pid}/comm", encoding="utf-8", errors="replace") as f:
            sender = f.read().strip()
    except OSError:
        return False
    if sender != "slurmstepd":
        return False
    environ = os.environ if environ is None else environ
    batch_shell = not environ.get("SLURM_STEP_ID", "").isdigit() and os.getppid() == si_pid
    return not batch_shell and not slurm_signals_tasks_only(environ)


def slurm_signals_tasks_only(environ: Mapping[str, str], cgroups: str | None = None) -> bool:
    """Whether Slurm signals only its step's tasks (the processes slurmstepd started), not
    their children: proctrack/cgroup does, for every signal but SIGKILL (its
    proctrack_p_signal: "only signal slurm tasks unless signal is SIGKILL"); linuxproc
    signals every descendant.  Known from our cgroups (``cgroups``: /proc/self/cgroup), which
    proctrack/cgroup names after the job and step: .../job_<id>/step_<id> in the freezer
    hierarchy (cgroup v1) or the unified one (v2)."""
    job = environ.get("SLURM_JOB_ID", "")
    if not job.isdigit():
        return False
    if cgroups is None:
        try:
            with open("/proc/self/cgroup", encoding="utf-8") as f:
                cgroups = f.read()
        except OSError:  # no cgroups: no proctrack/cgroup either
            return False
    for line in cgroups.splitlines():
        _, controllers, path = line.split(":", 2)
        proctrack = controllers == "" or "freezer" in controllers.split(",")  # v2, or v1's
        if proctrack and f"/job_{job}/step_" in path:
            return True
    return False


def _descends(p: psutil.Process, ancestors: Collection[int]) -> bool:
    if not ancestors:
        return False
    try:
        return any(a.pid in ancestors for a in p.parents())
    except psutil.Error:
        return False


def _reap_orphans(job: int, not_ours: set[int]) -> None:
    """Reap exited descendants the job orphaned onto us (subreaper), so no zombies pile up."""
    try:
        children = psutil.Process().children()
    except psutil.Error:
        return
    for p in children:
        if p.pid == job or p.pid in not_ours:
            continue  # the job is Popen's to reap; the caller's own children are not ours
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                os.waitpid(p.pid, os.WNOHANG)
        except (psutil.Error, ChildProcessError):
            pass
