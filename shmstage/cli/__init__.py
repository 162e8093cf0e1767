"""The ``shmstage`` command line: a thin skin over the library.

Commands live one module each in this package and are imported only when
invoked, so ``shmstage --help`` stays fast and never imports torch.
Every ``ShmstageError`` becomes ``Error: ...`` on stderr with its exit code.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import resource
import signal
import sys
from typing import Any, NoReturn

import click

from shmstage import __version__
from shmstage.errors import Interrupted, KilledBy, ShmstageError
from shmstage.libc import load_libc
from shmstage.terminal import printable

# command name -> "module:attribute" (relative to shmstage.cli)
COMMANDS: dict[str, str] = {
    "inspect": "inspect_cmd:inspect_cmd",
    "remount": "remount_cmd:remount_cmd",
    "stage": "stage_cmd:stage_cmd",
    "list": "staged_cmd:list_cmd",
    "verify": "staged_cmd:verify_cmd",
    "evict": "staged_cmd:evict_cmd",
    "gc": "staged_cmd:gc_cmd",
    "metrics": "metrics_cmd:metrics_cmd",
    "prepare": "prepare_cmd:prepare_cmd",
    "bench": "bench_cmd:bench_cmd",
    "demo": "demo_cmd:demo_cmd",
    "pillow-simd": "pillow_cmd:pillow_cmd",
    "run": "run_cmd:run_cmd",
    "serve": "serve_cmd:serve_cmd",
}


class ShmstageClickError(click.ClickException):
    def __init__(self, error: ShmstageError) -> None:
        # a path in the message may be another user's choice: no raw escapes (lines kept)
        super().__init__(printable(str(error), keep="\n"))
        self.exit_code = error.exit_code


def option_envvar(param: click.Parameter, prefix: str | None) -> str | None:
    """The one rule for an option's environment variable: ``<prefix>_<OPTION>``, OPTION the
    long option upper-cased with ``-`` as ``_`` (``--json`` -> ``SHMSTAGE_STAGE_JSON``).

    Click's own rule uses the Python parameter name (``as_json``), which users never see
    (it is still read as a fallback); an explicit ``envvar=`` (``SHMSTAGE_DEST``) wins."""
    if isinstance(param.envvar, str):
        return param.envvar
    if not isinstance(param, click.Option) or not param.allow_from_autoenv or prefix is None:
        return None
    longs = [o for o in param.opts if o.startswith("--")]
    return f"{prefix}_{longs[0][2:].replace('-', '_').upper()}" if longs else None


def name_envvars(cmd: click.Command, prefix: str) -> None:
    """Give every option of ``cmd`` (and of its subcommands) its variable by :func:`option_envvar`."""
    for p in cmd.params:
        if p.envvar is None:
            p.envvar = option_envvar(p, prefix)
    if isinstance(cmd, click.Group):
        for name, sub in cmd.commands.items():
            name_envvars(sub, f"{prefix}_{name.replace('-', '_').upper()}")


class ShmstageGroup(click.Group):
    """Lazily-loaded commands; library errors become one-line Click errors."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = COMMANDS.get(cmd_name)
        if target is None:
            return None
        module_name, attr = target.split(":")
        module = importlib.import_module(f"{__name__}.{module_name}")
        cmd = getattr(module, attr)
        # always (not only under main()'s auto_envvar_prefix): the same variables in tests
        name_envvars(cmd, f"SHMSTAGE_{cmd_name.replace('-', '_').upper()}")
        return cmd

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except Interrupted as e:  # cleaned up: say so, then die of the signal (main)
            ShmstageClickError(e).show()
            raise KilledBy(e.signum) from None
        except ShmstageError as e:
            raise ShmstageClickError(e) from None
        except KeyboardInterrupt:
            click.echo("Interrupted.", err=True)
            raise KilledBy(signal.SIGINT) from None


@click.group(
    "shmstage", cls=ShmstageGroup, context_settings={"help_option_names": ["-h", "--help"]}
)
@click.version_option(__version__, prog_name="shmstage")
def cli() -> None:
    """Stage datasets into RAM-backed tmpfs and keep GPUs fed.

    \b
    Typical flow on a training node:
      shmstage inspect --dataset /nfs/imagenet     # does it fit?
      shmstage remount --size 75% --persist        # grow /dev/shm if not
      shmstage run --stage /nfs/imagenet -- torchrun ... train.py --data {staged}

    Exit codes: 0 success, 1 operation failed, 2 bad usage or refused
    (nothing changed), 3 verification found a difference, 10-17 an object-store
    source failed (docs/s3.md), 128+N killed by signal N.
    Every option can also be set as SHMSTAGE_<COMMAND>_<OPTION>: the long
    option upper-cased, - as _ (--json -> SHMSTAGE_LIST_JSON, --dry-run ->
    SHMSTAGE_EVICT_DRY_RUN; bench stage --runs -> SHMSTAGE_BENCH_STAGE_RUNS).
    """


def main() -> None:
    # A command is one short process that may build lists of millions of entries (a walk):
    # the collector would rescan them again and again for cycles it rarely finds (a stage of
    # 50k files spent ~5% of its CPU there).  Collect young objects less often instead.
    gc.set_threshold(50_000, 20, 20)
    try:
        cli(auto_envvar_prefix="SHMSTAGE")
    except KilledBy as e:  # a signal stopped us, or `run`'s job: die of it
        die_of(e.signal)
    except SystemExit as e:
        waits = sys.modules.get("shmstage.cluster.waits")  # imported: a cluster stage ran
        if waits is not None and waits.left_behind():  # gloo still waits: no normal exit
            _flush_stdio()
            os._exit(e.code if isinstance(e.code, int) else 1)
        raise


def _flush_stdio() -> None:
    """Flush what was printed: before a way out that skips the interpreter's own exit."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


_PR_SET_DUMPABLE = 4


def die_of(signum: int) -> NoReturn:
    """Die of ``signum``, so the caller sees death by a signal, not exit 128+N.

    A shell tells the two apart: bash ends a ``for`` loop on ^C only when the command it ran
    was killed by SIGINT (an exit status of 130 means "the command handled ^C", and the loop
    goes on).  Core dumps are turned off first, as GNU timeout does: a SIGQUIT or SIGSEGV
    core would be ours, not the job's.
    """
    _flush_stdio()
    with contextlib.suppress(OSError, AttributeError):  # no libc/prctl: the rlimit still applies
        load_libc().prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
    with contextlib.suppress(ValueError, OSError):  # SIGKILL/SIGSTOP cannot be caught anyway
        signal.signal(signum, signal.SIG_DFL)
    with contextlib.suppress(ValueError, OSError):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})
    os.kill(os.getpid(), signum)
    # A signal whose default action does not terminate (a stop, an ignored one): exit instead.
    raise SystemExit(128 + signum)
