"""The root command group: help, version, `python -m shmstage`, unknown commands, error translation."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import click
import pytest

from shmstage import __version__
from shmstage.cli import COMMANDS, ShmstageGroup
from shmstage.errors import RefusedError, ShmstageError, VerifyError


def test_help_lists_the_commands(runner, cli):
    """--help exits 0 and lists inspect and remount with their summaries."""
    result = runner.invoke(cli, ["--help"])
    assert result.exit_code == 0
    assert "Usage: shmstage [OPTIONS] COMMAND [ARGS]..." in result.stdout
    lines = {
        ln.split()[0]: ln for ln in result.stdout.splitlines() if ln.startswith("  ") and ln.split()
    }
    assert "Check the node: tmpfs, memory, CPUs, Pillow, torch, fit." in lines["inspect"]
    assert "Resize /dev/shm (or any tmpfs), optionally in fstab too." in lines["remount"]


def test_short_help_option(runner, cli):
    """-h is the same as --help."""
    assert runner.invoke(cli, ["-h"]).stdout == runner.invoke(cli, ["--help"]).stdout


def test_version(runner, cli):
    """--version prints the package version."""
    result = runner.invoke(cli, ["--version"])
    assert (result.exit_code, result.stdout) == (0, f"shmstage, version {__version__}\n")


def test_unknown_command(runner, cli):
    """An unknown command exits 2 with Click's one-line error."""
    result = runner.invoke(cli, ["frobnicate"])
    assert result.exit_code == 2
    assert result.stderr.splitlines()[-1] == "Error: No such command 'frobnicate'."


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_registered_command_loads_and_has_help(runner, cli, name):
    """Each COMMANDS entry imports, is named as registered, and documents every option."""
    command = cli.get_command(click.Context(cli), name)
    assert command is not None and command.name == name
    assert command.help and command.help.strip().splitlines()[0]
    for param in command.params:
        if isinstance(param, click.Option) and param.name not in ("help",):
            assert param.help, f"{name} {param.opts} has no help="


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (ShmstageError("it broke; do X"), 1),
        (RefusedError("refused; do Y"), 2),
        (VerifyError("differs"), 3),
    ],
)
def test_library_errors_become_one_line_with_their_exit_code(runner, error, code):
    """A ShmstageError raised in any command is `Error: <message>` on stderr, no traceback."""

    @click.group(cls=ShmstageGroup)
    def group() -> None:
        pass

    @group.command("boom")
    def boom() -> None:
        raise error

    group.get_command = click.Group.get_command.__get__(group)  # use the commands added above
    group.list_commands = click.Group.list_commands.__get__(group)
    result = runner.invoke(group, ["boom"])
    assert result.exit_code == code
    assert result.stderr == f"Error: {error}\n"
    assert result.stdout == ""


def test_python_dash_m_runs_the_cli():
    """`python -m shmstage --version` works like the console script."""
    done = subprocess.run(
        [sys.executable, "-m", "shmstage", "--version"], capture_output=True, text=True, check=False
    )
    assert (done.returncode, done.stdout) == (0, f"shmstage, version {__version__}\n")


def test_help_and_remount_do_not_import_torch():
    """The CLI stays importable and fast without torch: --help and remount never import it."""
    code = (
        "import sys\n"
        "from click.testing import CliRunner\n"
        "from shmstage.cli import cli\n"
        "r = CliRunner().invoke(cli, ['--help'])\n"
        "assert r.exit_code == 0, r.output\n"
        "r = CliRunner().invoke(cli, ['remount', '--size', '1G', '--dry-run', '--path', '/nonexistent'])\n"
        "assert r.exit_code == 2, r.output\n"
        "print('torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "False\n"


def test_a_stage_without_a_service_loads_no_socket_pickle_or_archive_codec(tmp_path):
    """A stage's start-up is part of every stage's time: with no service socket on the node,
    a directory's stage imports neither the service client (socket, pickle) nor shutil's
    codecs (bz2, lzma); with a socket file there, it asks (the client is loaded)."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_bytes(b"x" * 100)
    code = (  # the console script's main(), what was loaded written at its exit
        "import atexit, pathlib, sys\n"
        "out = pathlib.Path(sys.argv.pop())\n"
        "atexit.register(lambda: out.write_text(str(sorted(m for m in ('socket', 'pickle', "
        "'bz2', 'lzma', 'shutil', 'shmstage.service.client') if m in sys.modules))))\n"
        "sys.argv[0] = 'shmstage'\n"
        "from shmstage.cli import main\n"
        "main()\n"
    )

    def loaded(sock: Path) -> str:
        dest = tmp_path / f"dest-{sock.name}"
        dest.mkdir()
        env = {**os.environ, "SHMSTAGE_SOCKET": str(sock)}
        out = tmp_path / f"modules-{sock.name}"
        argv = ["stage", str(src), "--dest", str(dest), "--quiet", str(out)]
        done = subprocess.run(
            [sys.executable, "-c", code, *argv], capture_output=True, text=True, check=False, env=env
        )
        assert done.returncode == 0, done.stderr
        return out.read_text()

    assert loaded(tmp_path / "none.sock") == "[]"
    (tmp_path / "stale.sock").write_bytes(b"")  # a file there: connect() says nobody answers
    assert "'shmstage.service.client'" in loaded(tmp_path / "stale.sock")


def test_console_script_error_has_no_traceback(shmstage_bin, tmp_path):
    """Through the real entry point a bad size is one Error line and exit 2."""
    done = subprocess.run(
        [*shmstage_bin, "remount", "--size", "12Q", "--path", str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert done.stderr.splitlines()[-1] == (
        "Error: Invalid value for '--size': invalid size '12Q': unknown unit 'Q'; "
        "use K, M, G, T, KiB, GiB, KB, GB or N%"
    )
