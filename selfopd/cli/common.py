"""What every `selfopd` sub-command shares: the one-line user error, the parser that refuses a bad
flag in one line, sub-command, `--set` and number helpers, and defaults taken from the training
config (so `selfopd eval` and `selfopd prompts` look at what `selfopd train` would use)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Callable, NoReturn

from selfopd.config import DataConfig, ModelConfig
from selfopd.config.settings import Bounds, ConfigError, bounds_of, escaped, field_types, parse_value

DEFAULT_MODEL = ModelConfig().student
DEFAULT_DATA = DataConfig().spec
DEFAULT_STUDENT = DataConfig().student_template


class UserError(Exception):
    """A mistake in what the user asked for; printed as one line, no traceback."""


class UsageError(SystemExit):
    """A flag the parser refused; its one line is printed already (exit code 1, as for every bad input)."""


class Parser(argparse.ArgumentParser):
    """argparse with one error line, `selfopd: error: ...`, and exit code 1, like every other bad
    input (argparse's own: the usage block, then the message, and exit code 2). Sub-commands
    inherit it."""

    def error(self, message: str) -> NoReturn:
        print(f"selfopd: error: {escaped(message)} (see `{self.prog} --help`)", file=sys.stderr)
        raise UsageError(1)


def number(kind: type, limits: Bounds) -> Callable[[str], Any]:
    """An argparse `type`: a `kind` (int, or a finite float) within `limits`."""

    def parse(text: str) -> Any:
        try:
            value = parse_value("", kind, text)
            limits.check("", value)
        except ConfigError as error:
            raise argparse.ArgumentTypeError(error.message) from None
        return value

    return parse


def like_setting(section: type, name: str) -> Callable[[str], Any]:
    """An argparse `type` that takes what the config setting `section.name` takes (its type and range)."""
    return number(field_types(section)[name], bounds_of(section, name) or Bounds())


def check_output_folder(path: Path, flag: str) -> None:
    """Refuse, before any work, an output folder that cannot be made: `path` or a folder above it is a file."""
    for folder in (path, *path.parents):
        if folder.exists():
            if not folder.is_dir():
                raise UserError(f"{flag} {path}: {folder} is a file, not a folder")
            if not os.access(folder, os.W_OK | os.X_OK):
                raise UserError(f"{flag} {path}: cannot write in {folder}")
            return


def command(
    sub: argparse._SubParsersAction, name: str, run: Callable[[argparse.Namespace], int | None], help_text: str
) -> argparse.ArgumentParser:
    parser = sub.add_parser(name, help=help_text, description=help_text)
    parser.set_defaults(run=run)
    return parser


def add_overrides(parser: argparse.ArgumentParser, example: str) -> None:
    """`--set SECTION.KEY=VALUE`, repeatable, as every config-reading command takes it."""
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help=f"override a config value, e.g. --set {example} (repeatable)")
