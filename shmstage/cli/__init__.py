"""The ``shmstage`` command line: a thin skin over the library.

Commands live one module each in this package and are imported only when
invoked, so ``shmstage --help`` stays fast and never imports torch.
Every ``ShmstageError`` becomes ``Error: ...`` on stderr with its exit code.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import click

from shmstage import __version__
from shmstage.errors import ShmstageError

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
}


class ShmstageClickError(click.ClickException):
    def __init__(self, error: ShmstageError) -> None:
        super().__init__(str(error))
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
        except ShmstageError as e:
            raise ShmstageClickError(e) from None
        except KeyboardInterrupt:
            click.echo("Interrupted.", err=True)
            sys.exit(130)


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
    try:
        cli(auto_envvar_prefix="SHMSTAGE")
    except SystemExit as e:
        # `run`'s job died of a signal: so do we (launch.die_of).  Looked up, not imported:
        # the module is loaded when `run` ran a job, and other commands stay light.
        launch = sys.modules.get("shmstage.launch")
        if launch is not None and isinstance(e, launch.JobKilled):
            launch.die_of(e.signal)
        raise
