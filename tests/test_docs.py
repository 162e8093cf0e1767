"""docs/: the CLI reference is generated and current, covers every command and option, and links resolve."""

from __future__ import annotations

import re
from pathlib import Path

import click
import pytest

from shmstage.cli import cli as shmstage_cli
from shmstage.cli.docgen import generate, main

DOCS = Path(__file__).resolve().parent.parent / "docs"
REGENERATE = "python -m shmstage.cli.docgen > docs/cli.md"


def _commands(
    group: click.Group = shmstage_cli, prefix: str = ""
) -> list[tuple[str, click.Command]]:
    ctx = click.Context(group, info_name="shmstage")
    out = []
    for name in group.list_commands(ctx):
        cmd = group.get_command(ctx, name)
        path = f"{prefix} {name}".strip()
        out.append((path, cmd))
        if isinstance(cmd, click.Group):
            out.extend(_commands(cmd, path))
    return out


def _section(text: str, path: str) -> str:
    """The part of docs/cli.md under the heading for ``shmstage <path>`` (up to the next heading)."""
    m = re.search(rf"^#+ shmstage {re.escape(path)}\n(.*?)(?=^#+ shmstage |\Z)", text, re.S | re.M)
    assert m, f"`shmstage {path}` has no section in docs/cli.md: run `{REGENERATE}`"
    return m.group(1)


def test_cli_reference_is_current() -> None:
    """docs/cli.md is exactly what the generator makes from the Click definitions today."""
    assert (DOCS / "cli.md").read_text() == generate(), f"docs/cli.md is stale: run `{REGENERATE}`"


@pytest.mark.parametrize(
    ("path", "cmd"), _commands(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_every_command_and_option_is_documented(path: str, cmd: click.Command) -> None:
    """Every command has a section in docs/cli.md naming each of its options, and every option has help."""
    section = _section((DOCS / "cli.md").read_text(), path)
    for param in cmd.params:
        if not isinstance(param, click.Option) or param.hidden:
            continue
        assert param.help, f"shmstage {path} {param.opts[0]} has no help text"
        for opt in param.opts + param.secondary_opts:
            assert f"`{opt}`" in section, f"shmstage {path} {opt} is missing from docs/cli.md"


def test_docgen_check_flags_a_stale_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`docgen --check FILE` exits 1 with the fix when FILE differs, 0 when it is current."""
    stale = tmp_path / "cli.md"
    stale.write_text(generate().replace("| `--keep` |", "| `--kept` |"))
    assert main(["--check", str(stale)]) == 1
    assert capsys.readouterr().err == (
        f"{stale} is stale: regenerate it with `python -m shmstage.cli.docgen > {stale}`\n"
    )
    stale.write_text(generate())
    assert main(["--check", str(stale)]) == 0


def test_generated_reference_documents_a_new_option() -> None:
    """An option added to a command shows up in the generated reference (so the staleness test bites)."""

    @click.group()
    def toy() -> None:
        """Toy."""

    @toy.command("hello")
    @click.option("--loud/--quiet", default=False, help="Shout.")
    @click.option("--times", type=int, default=3, show_default=True, help="How often.")
    def hello(loud: bool, times: int) -> None:
        """Say hello."""

    text = generate(toy)
    assert "## shmstage hello" in text
    assert "| `--loud` / `--quiet` | flag | --quiet | `SHMSTAGE_HELLO_LOUD` | Shout. |" in text
    assert "| `--times` | INTEGER | `3` | `SHMSTAGE_HELLO_TIMES` | How often. |" in text


def test_relative_links_in_docs_resolve() -> None:
    """Every relative Markdown link in docs/ and README.md points at a file that exists."""
    pages = sorted(DOCS.glob("*.md")) + [DOCS.parent / "README.md"]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # http:, https:, mailto:
            if not (page.parent / target).exists():
                broken.append(f"{page.name} -> {target}")
    assert not broken, f"broken links: {broken}"


def test_index_links_every_page() -> None:
    """docs/index.md links to every other page in docs/."""
    index = (DOCS / "index.md").read_text()
    missing = [
        p.name for p in DOCS.glob("*.md") if p.name != "index.md" and f"({p.name}" not in index
    ]
    assert not missing, f"docs/index.md does not link: {missing}"
