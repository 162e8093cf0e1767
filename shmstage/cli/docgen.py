"""Write docs/cli.md from the Click definitions, so the reference cannot drift from the code.

    python -m shmstage.cli.docgen > docs/cli.md        # regenerate
    python -m shmstage.cli.docgen --check docs/cli.md  # exit 1 when it is stale

Every command, option, default and environment variable comes from Click;
the ``--json`` fields come from the result dataclasses in ``JSON_RESULTS``
(types from their annotations, descriptions from the ``# comment`` on each field).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
import sys
from collections.abc import Iterator

import click

from shmstage.cli import option_envvar

# command path -> "module:ResultType" its --json prints ("[]": a JSON array of them).
# Add yours here; a command whose JSON is documented on its own page goes in JSON_ELSEWHERE.
JSON_RESULTS: dict[str, str] = {
    "bench loader": "shmstage.bench.loader:LoaderBenchReport",
    "bench stage": "shmstage.bench.stage:StageBenchResult",
    "demo": "shmstage.demo:DemoReport",
    "evict": "shmstage.stage.engine:EvictReport",
    "gc": "shmstage.stage.store.gc:GcReport",
    "list": "shmstage.stage.cache.tiers:InTier[]",
    "metrics": "shmstage.metrics:Metrics",
    "stage": "shmstage.stage.cache.tiers:Placed",
    "verify": "shmstage.stage.engine:VerifyReport",
    "pillow-simd": "shmstage.pillow:PillowStatus",
}
# command path -> (when, "module:ResultType"): a second --json result the command prints instead.
JSON_ALSO: dict[str, tuple[str, str]] = {
    "bench stage": ("with `--nodes`, on node 0", "shmstage.bench.stage_nodes:NodesBenchResult"),
}
JSON_ELSEWHERE: dict[str, str] = {
    "inspect": "the report described in [inspect.md](inspect.md)",
    "prepare": "the report described in [config.md](config.md)",
    "remount": "the result described in [remount.md](remount.md#json)",
}

HEADER = """\
# CLI reference

<!-- Generated from the Click definitions by `python -m shmstage.cli.docgen > docs/cli.md`.
     Do not edit by hand: tests/test_docs.py fails when this file is stale. -->
"""

_UNSET = getattr(click.core, "UNSET", None)  # Click >= 8.3 marks "no default" with a sentinel
_FIELD_RE = re.compile(r"^\s+(\w+):\s*([^=#]+?)\s*(?:=[^#]*)?(?:#\s*(.*))?$")


def _cell(text: object) -> str:
    return str(text).replace("|", r"\|").replace("\n", " ")


def _help_markdown(text: str) -> str:
    """Click help text as Markdown: ``\\b`` paragraphs (kept as typed) become code blocks."""
    out = []
    for para in inspect.cleandoc(text).split("\n\n"):
        if para.startswith("\b"):
            body = para.lstrip("\b").strip("\n")
            out.append(f"```text\n{body}\n```")
        else:
            out.append(" ".join(line.strip() for line in para.splitlines()))
    return "\n\n".join(out)


def _walk(cmd: click.Command, ctx: click.Context) -> Iterator[tuple[click.Command, click.Context]]:
    yield cmd, ctx
    if isinstance(cmd, click.Group):
        for name in cmd.list_commands(ctx):
            sub = cmd.get_command(ctx, name)
            if sub is not None and not sub.hidden:
                yield from _walk(sub, click.Context(sub, info_name=name, parent=ctx))


def _path(ctx: click.Context) -> str:
    return ctx.command_path.removeprefix("shmstage").strip()


def _default(opt: click.Option, ctx: click.Context) -> str:
    if opt.is_flag and not opt.secondary_opts:
        return ""
    if callable(opt.default):
        return "(computed)"
    if opt.default is None or opt.default == () or opt.default is _UNSET:
        return ""
    if opt.is_flag:  # --pin/--no-pin style
        return opt.opts[0] if opt.default else opt.secondary_opts[0]
    return f"`{opt.default}`"


def _option_rows(cmd: click.Command, ctx: click.Context) -> list[str]:
    rows = []
    for param in cmd.get_params(ctx):
        if not isinstance(param, click.Option) or param.hidden or "--help" in param.opts:
            continue
        names = " / ".join(
            ", ".join(f"`{o}`" for o in opts) for opts in (param.opts, param.secondary_opts) if opts
        )
        kind = "flag" if param.is_flag else param.make_metavar(ctx)
        if param.multiple:
            kind += " (repeatable)"
        if param.required:
            kind += ", required"
        env = option_envvar(param, ctx.auto_envvar_prefix)
        env = f"`{env}`" if env else "—"
        rows.append(
            f"| {names} | {_cell(kind)} | {_cell(_default(param, ctx))} | {env} | {_cell(param.help or '')} |"
        )
    return rows


def _json_fields(cls: type, seen: set[type]) -> list[str]:
    """Markdown tables of a result dataclass and the dataclasses nested in it."""
    module = sys.modules[cls.__module__]
    comments: dict[str, str] = {}
    for base in cls.__mro__:  # a subclass's fields, then those it inherits
        if not dataclasses.is_dataclass(base):
            continue
        for line in inspect.getsource(base).splitlines():
            m = _FIELD_RE.match(line)
            if m and m.group(3):
                comments.setdefault(m.group(1), m.group(3))
    lines = [f"`{cls.__name__}`:", "", "| field | type | meaning |", "|---|---|---|"]
    nested: list[type] = []
    for f in dataclasses.fields(cls):
        # the annotation as written (a string under `from __future__ import annotations`)
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        lines.append(f"| `{f.name}` | `{_cell(kind)}` | {_cell(comments.get(f.name, ''))} |")
        for token in re.findall(r"[A-Za-z_]\w*", kind):
            ref = getattr(module, token, None)
            if dataclasses.is_dataclass(ref) and isinstance(ref, type) and ref not in seen:
                seen.add(ref)
                nested.append(ref)
    for ref in nested:
        lines += ["", *_json_fields(ref, seen)]
    return lines


def _json_section(path: str) -> list[str]:
    if path in JSON_ELSEWHERE:
        return ["", f"**`--json` output**: {JSON_ELSEWHERE[path]}."]
    target = JSON_RESULTS.get(path)
    if target is None:
        return []
    lines = _json_result(target, "")
    if path in JSON_ALSO:
        when, other = JSON_ALSO[path]
        lines += _json_result(other, f"{when}, ")
    return lines


def _json_result(target: str, when: str) -> list[str]:
    module_name, attr = target.split(":")
    many = attr.endswith("[]")
    cls = getattr(importlib.import_module(module_name), attr.removesuffix("[]"))
    shape = f"an array of `{cls.__name__}`" if many else "one object"
    return ["", f"**`--json` output** ({when}{shape}):", "", *_json_fields(cls, {cls})]


def generate(group: click.Group | None = None) -> str:
    """The whole reference as Markdown (deterministic: no machine facts in it)."""
    if group is None:
        from shmstage.cli import cli as group
    # the group's context_settings too: Click caches the help option (-h) from the first context
    root = click.Context(
        group, info_name="shmstage", auto_envvar_prefix="SHMSTAGE", **group.context_settings
    )
    out = [HEADER]
    out.append(f"```text\nUsage: shmstage {' '.join(group.collect_usage_pieces(root))}\n```\n")
    out.append(_help_markdown(group.help or "") + "\n")
    out.append("| command | summary |\n|---|---|")
    commands = list(_walk(group, root))[1:]
    for cmd, ctx in commands:
        path = _path(ctx)
        anchor = "shmstage-" + path.replace(" ", "-")
        out.append(
            f"| [`shmstage {path}`](#{anchor}) | {_cell(cmd.get_short_help_str(limit=200))} |"
        )
    out.append("")
    for cmd, ctx in commands:
        path = _path(ctx)
        level = "#" * (1 + len(path.split()))
        out.append(f"{level} shmstage {path}\n")
        out.append(
            f"```text\nUsage: shmstage {path} {' '.join(cmd.collect_usage_pieces(ctx))}\n```\n"
        )
        if cmd.help:
            out.append(_help_markdown(cmd.help) + "\n")
        rows = _option_rows(cmd, ctx)
        if rows:
            out.append("| option | value | default | environment | description |")
            out.append("|---|---|---|---|---|")
            out.extend(rows)
        section = _json_section(path)
        if section:
            out.extend(section)
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    text = generate()
    if args[:1] == ["--check"] and len(args) == 2:
        try:
            with open(args[1]) as f:
                current = f.read()
        except OSError as e:
            print(f"Error: cannot read {args[1]}: {e.strerror}", file=sys.stderr)
            return 1
        if current != text:
            print(
                f"{args[1]} is stale: regenerate it with `python -m shmstage.cli.docgen > {args[1]}`",
                file=sys.stderr,
            )
            return 1
        return 0
    if args:
        print("usage: python -m shmstage.cli.docgen [--check docs/cli.md]", file=sys.stderr)
        return 2
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
