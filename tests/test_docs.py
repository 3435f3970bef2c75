"""The docs cannot rot: the generated references match the code, and every `selfopd ...`
command line in README.md and docs/ is accepted by the CLI's own parser; a train or
compare command on a shipped config also resolves its whole config (`--show-config`)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from selfopd.cli import build_parser, main
from selfopd.cli.reference import generated

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SHELL_OPERATORS = {">", ">>", "|", "&&", "||", ";", "2>&1", "&"}
FENCE = re.compile(r"^```[a-z]*\n(.*?)^```", re.S | re.M)


def test_the_generated_references_are_up_to_date():
    stale = [str(path.relative_to(ROOT)) for path, text in generated().items()
             if not path.is_file() or path.read_text() != text]
    assert not stale, f"{stale}: run `make docs`"


def documented_commands() -> list[tuple[str, list[str]]]:
    """(`page:line`, argv) of every line starting `selfopd ` in a fenced block; a trailing
    backslash continues it, a `# comment` after it is dropped."""
    commands = []
    for page in PAGES:
        text = page.read_text()
        for block in FENCE.finditer(text):
            first_line = text[: block.start(1)].count("\n") + 1
            lines = block.group(1).splitlines()
            index = 0
            while index < len(lines):
                line, where = lines[index].strip(), index
                while line.endswith("\\") and index + 1 < len(lines):
                    index += 1
                    line = line[:-1] + " " + lines[index].strip()
                index += 1
                if line.startswith("selfopd "):
                    argv = shlex.split(line, comments=True)[1:]
                    cut = [i for i, arg in enumerate(argv) if arg in SHELL_OPERATORS]  # `> my.toml`, `| head`
                    argv = argv[: cut[0]] if cut else argv
                    commands.append((f"{page.relative_to(ROOT)}:{first_line + where}", argv))
    return commands


def test_the_docs_show_commands():
    commands = documented_commands()
    assert len(commands) >= 20 and any(argv[0] == "compare" for _, argv in commands)


@pytest.mark.parametrize("where,argv", documented_commands(), ids=lambda value: value if isinstance(value, str) else "")
def test_a_documented_command_is_accepted(where, argv, capsys):
    parser = build_parser()
    try:
        parsed = parser.parse_args(argv)
    except SystemExit as exit_info:
        if exit_info.code != 0:  # --help exits 0
            pytest.fail(f"{where}: `selfopd {shlex.join(argv)}` is refused: {capsys.readouterr().err.strip()}")
        return
    config = getattr(parsed, "config", None)
    if argv[0] in ("train", "compare") and config is not None and (ROOT / config).is_file() and "--help" not in argv:
        shown = [arg for arg in argv if arg not in ("--show-config", "--report-only")]
        assert main([*shown, "--show-config"]) == 0, f"{where}: {capsys.readouterr().err.strip()}"
