"""The generated references in docs/reference/: every config key (from the typed schema)
and every command line (from the CLI's own parser), so the docs cannot drift from the code.

    python -m selfopd.cli.reference          # rewrite docs/reference/config.md and cli.md (`make docs`)
    python -m selfopd.cli.reference --check  # exit 1 when either is stale (a test runs this)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

from selfopd.config.settings import Section, describe_type, field_types, toml_value

DOCS = Path(__file__).resolve().parents[2] / "docs" / "reference"
DEMO = Path(__file__).resolve().parents[2] / "experiments" / "demo" / "demo.toml"
WIDTH = "100"  # the help text's line width, fixed so the output does not depend on a terminal


def config_reference() -> str:
    """Markdown: one table per section, each key with its type, default and meaning."""
    from selfopd.comparisons.compare import ArmTable, CompareSection
    from selfopd.config import SECTIONS, flat_config, load_config
    from selfopd.comparisons.sft import SftSection

    parts = ["# Config reference", "",
             "Generated from the schema (`python -m selfopd.cli.reference`, or `make docs`); a test fails when it is stale.",
             "", "A training config (`selfopd train`, `selfopd eval`, `selfopd prompts rank`) has the sections below, "
             "each optional; a missing key takes its default. `selfopd train CONFIG --show-config` prints the whole "
             "resolved config with these comments, the best start for a new one:", "", "```bash",
             "selfopd train experiments/demo/demo.toml --show-config > my.toml", "```", "",
             "Any key can be set on the command line: `--set section.key=value` (repeatable).", ""]
    parts += ["The last column shows where `experiments/demo/demo.toml` (what `make demo` runs) differs from the "
              "defaults: a config that leaves those keys out is not the demo.", ""]
    demo = flat_config(load_config(DEMO, resolve=False))  # the file's values, on any machine
    for name, section in SECTIONS.items():
        parts += _section_table(f"[{name}]", section, {k.partition(".")[2]: v for k, v in demo.items()
                                                        if k.startswith(name + ".")})
    parts += ["## [teachers.NAME]", "",
              "More teachers beside `[teacher]` (which is named `default`), one table each, with the keys of "
              "`[teacher]`; `tasks` routes a mixed `data.spec`'s tasks to it, and a data file's `teacher` column names "
              "each row's teacher. On the command line: `--set teachers.NAME.key=value`. See "
              "[teachers](../teachers.md#several-teachers-in-one-run).", ""]
    parts += ["## Comparisons and fine-tuning", "",
              "`selfopd compare FILE` reads `[compare]`, `[arms.NAME]` (one per arm) and an optional `[sft]`; "
              "`selfopd sft FILE` reads a training config plus `[sft]`. `selfopd compare FILE --show-config` prints "
              "the resolved comparison.", ""]
    for title, section in (("[compare]", CompareSection), ("[arms.NAME]", ArmTable), ("[sft]", SftSection)):
        parts += _section_table(title, section, None)
    return "\n".join(parts).rstrip() + "\n"


def _section_table(title: str, section: type[Section], demo: dict[str, Any] | None) -> list[str]:
    doc = (section.__doc__ or "").strip()
    about = [" ".join(doc.split()), ""] if doc and not doc.startswith(f"{section.__name__}(") else []
    header = ["key", "type", "default", "meaning", *(["the demo"] if demo is not None else [])]
    rows = ["## " + title, "", *about, "| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    types = field_types(section)
    for f in dataclasses.fields(section):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        kind = describe_type(types[f.name]) + (f" in {f.metadata['bounds']}" if "bounds" in f.metadata else "")
        guarded = (f" Guarded: {f.metadata['guarded']}, so a run folder from elsewhere cannot set it "
                   "([security](../security.md#run-folders-from-elsewhere)).") if "guarded" in f.metadata else ""
        cells = [f"`{f.name}`", kind, f"`{toml_value(default)}`", f.metadata["help"] + guarded]
        if demo is not None:
            cells.append(f"`{toml_value(demo[f.name])}`" if demo[f.name] != default else "")
        rows.append("| " + " | ".join(cell.replace("|", "\\|").replace("\n", " ") for cell in cells) + " |")
    return rows + [""]


def cli_reference() -> str:
    """Markdown: the `--help` of `selfopd` and of every sub-command, in the parser's order."""
    from selfopd.cli import build_parser

    parts = ["# Command-line reference", "",
             "Generated from the CLI's parser (`python -m selfopd.cli.reference`, or `make docs`); a test fails when it is "
             "stale. Every command also answers `--help`.", ""]
    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = WIDTH
    try:
        for path, parser in _commands(build_parser()):
            parts += [f"## `{' '.join(['selfopd', *path])}`", "", "```text", parser.format_help().rstrip(), "```", ""]
    finally:
        if previous is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = previous
    return "\n".join(parts).rstrip() + "\n"


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, (*path, name))


def generated() -> dict[Path, str]:
    return {DOCS / "config.md": config_reference(), DOCS / "cli.md": cli_reference()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m selfopd.cli.reference", description="write or check docs/reference/")
    parser.add_argument("--check", action="store_true", help="only report stale files (exit 1), write nothing")
    args = parser.parse_args(argv)
    pages = generated()
    if args.check:
        stale = [path for path, text in pages.items() if not path.is_file() or path.read_text() != text]
        for path in stale:
            print(f"{path.relative_to(DOCS.parents[1])} is stale: run `make docs`", file=sys.stderr)
        return 1 if stale else 0
    DOCS.mkdir(parents=True, exist_ok=True)
    for path, text in pages.items():
        path.write_text(text)
        print(f"wrote {path.relative_to(DOCS.parents[1])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
