"""The rendered unit's ExecStart= as systemd parses it: each argument one word, whatever
spaces, quotes, ``%`` (specifiers) or ``$`` (variables) its paths hold."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from shmstage import systemd


def exec_start(text: str) -> str:
    return next(line for line in text.splitlines() if line.startswith("ExecStart="))


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
def test_exec_start_quotes_spaces_and_escapes_specifiers(tmp_path):
    """A venv under a directory with a space, a ``%`` and a ``$`` and a config path with a space,
    a quote and a ``%``: systemd-analyze verify finds the executable (unquoted, it sees
    ``.../my`` and expands ``%y``), and the line is the quoted, escaped argv."""
    bindir = tmp_path / "my %y $HOME venv" / "bin"
    bindir.mkdir(parents=True)
    command = bindir / "shmstage"
    command.write_text("#!/bin/sh\n")
    command.chmod(0o755)
    config = '/etc/shmstage/node "100%" $HOME.yaml'
    units = tmp_path / "units"
    units.mkdir()
    for name in systemd.UNITS:
        (units / name).write_text(systemd.render(name, command=str(command), config=config))
    service = (units / systemd.SERVICE).read_text()
    quoted = str(command).replace("%", "%%")  # systemd expands no $ in the executable's path
    assert exec_start(service) == (
        f'ExecStart="{quoted}" serve --config "/etc/shmstage/node \\"100%%\\" $$HOME.yaml"'
    )
    done = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(units / systemd.SERVICE)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


def test_plain_paths_stay_unquoted_and_python_m_is_three_words():
    """What most nodes render is unchanged; ``python -m shmstage`` (no shmstage installed on
    PATH) is three arguments, not one path with spaces."""
    line = exec_start(
        systemd.render(systemd.SERVICE, command="/opt/venv/bin/shmstage", config="/etc/n.yaml")
    )
    assert line == "ExecStart=/opt/venv/bin/shmstage serve --config /etc/n.yaml"
    line = exec_start(
        systemd.render(systemd.SERVICE, command=("/usr/bin/python3", "-m", "shmstage"), config="/e")
    )
    assert line == "ExecStart=/usr/bin/python3 -m shmstage serve --config /e"
