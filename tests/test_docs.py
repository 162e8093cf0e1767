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
    ctx = click.Context(group, info_name="shmstage", **group.context_settings)
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


ROOT = DOCS.parent
_ENV_NAME = re.compile(r"SHMSTAGE_[A-Z0-9_]*[A-Z0-9]")


def _option_envvars() -> dict[str, str]:
    """Environment variable -> `shmstage <command> <option>`, as the CLI really reads them."""
    out: dict[str, str] = {}

    def walk(group: click.Group, ctx: click.Context, path: str) -> None:
        for name in group.list_commands(ctx):
            cmd = group.get_command(ctx, name)
            sub = click.Context(cmd, parent=ctx, info_name=name)
            for p in cmd.params:
                if isinstance(p, click.Option) and isinstance(p.envvar, str):
                    out[p.envvar] = f"shmstage {path} {name} {p.opts[0]}".replace("  ", " ")
            if isinstance(cmd, click.Group):
                walk(cmd, sub, f"{path} {name}")

    root = click.Context(
        shmstage_cli, auto_envvar_prefix="SHMSTAGE", **shmstage_cli.context_settings
    )
    walk(shmstage_cli, root, "")
    return out


def _code_names() -> set[str]:
    """SHMSTAGE_* names the package itself reads or sets (loader settings, test hooks, ...)."""
    names: set[str] = set()
    for f in (ROOT / "shmstage").rglob("*.py"):
        names.update(_ENV_NAME.findall(f.read_text()))
    return names


def _known(name: str, known: set[str]) -> bool:
    # SHMSTAGE_DATA_IMAGENET_1K: an instance of SHMSTAGE_DATA_<NAME> (launch.data_env_name)
    return name in known or name.startswith("SHMSTAGE_DATA_")


def test_every_documented_env_var_exists() -> None:
    """Each SHMSTAGE_* name in README.md and docs/*.md is an option's variable or one the code uses."""
    known = set(_option_envvars()) | _code_names()
    unknown = []
    for page in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        for n, line in enumerate(page.read_text().splitlines(), 1):
            # SHMSTAGE_<COMMAND>_<OPTION> and SHMSTAGE_DATA_<NAME> are templates, not names
            for name in _ENV_NAME.findall(re.sub(r"SHMSTAGE_[A-Z_]*<", "", line)):
                if not _known(name, known):
                    unknown.append(f"{page.name}:{n}: {name}")
    assert not unknown, "documented but not read by shmstage:\n" + "\n".join(unknown)


def test_option_envvars_follow_one_rule(monkeypatch) -> None:
    """Setting SHMSTAGE_<COMMAND>_<OPTION> (OPTION: the long option, --json -> JSON) reaches
    every option that has a variable, and docs/cli.md names that variable."""
    reference = (DOCS / "cli.md").read_text()

    def walk(group: click.Group, ctx: click.Context) -> None:
        for name in group.list_commands(ctx):
            cmd = group.get_command(ctx, name)
            sub = click.Context(cmd, parent=ctx, info_name=name)
            for p in cmd.params:
                if not isinstance(p, click.Option) or not p.allow_from_autoenv:
                    continue
                if p.envvar in ("SHMSTAGE_DEST", "SHMSTAGE_CONFIG"):
                    continue  # shared by several commands (README says which)
                env = f"{sub.auto_envvar_prefix}_{p.opts[0][2:].replace('-', '_').upper()}"
                monkeypatch.setenv(env, "x")
                assert p.resolve_envvar_value(sub) == "x", f"{env} does not set {p.opts[0]}"
                monkeypatch.delenv(env)
                assert f"`{env}`" in reference, f"docs/cli.md does not name {env}"
            if isinstance(cmd, click.Group):
                walk(cmd, sub)

    ctx = click.Context(
        shmstage_cli, auto_envvar_prefix="SHMSTAGE", **shmstage_cli.context_settings
    )
    walk(shmstage_cli, ctx)


def test_json_env_var_is_the_documented_one(runner, cli, tmp_path) -> None:
    """SHMSTAGE_LIST_JSON=1 gives JSON, as README/docs say (the old ..._AS_JSON still works)."""
    args = ["list", "--dest", str(tmp_path)]
    new = runner.invoke(cli, args, env={"SHMSTAGE_LIST_JSON": "1"}, auto_envvar_prefix="SHMSTAGE")
    assert new.exit_code == 0 and new.stdout == "[]\n", new.output
    old = runner.invoke(
        cli, args, env={"SHMSTAGE_LIST_AS_JSON": "1"}, auto_envvar_prefix="SHMSTAGE"
    )
    assert old.exit_code == 0 and old.stdout == "[]\n", old.output
    off = runner.invoke(cli, args, auto_envvar_prefix="SHMSTAGE")
    assert off.exit_code == 0 and not off.stdout.startswith("["), off.output
