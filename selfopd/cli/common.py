"""What every `selfopd` sub-command shares: the one-line user error, sub-command and `--set`
helpers, and defaults taken from the training config (so `selfopd eval` and `selfopd prompts`
look at what `selfopd train` would use)."""

from __future__ import annotations

import argparse
from typing import Callable

from selfopd.config import DataConfig, ModelConfig

DEFAULT_MODEL = ModelConfig().student
DEFAULT_DATA = DataConfig().spec
DEFAULT_STUDENT = DataConfig().student_template


class UserError(Exception):
    """A mistake in what the user asked for; printed as one line, no traceback."""


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
