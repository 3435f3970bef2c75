"""The checks a setting's value passes, whatever its section: `ConfigError`, ranges (`Bounds` and
the sane maxima of numbers), text a reader can see as it is (no control or bidi characters), and
names that become folders. `selfopd.config.settings` builds sections on them and re-exports them."""

from __future__ import annotations

import typing
import unicodedata
from dataclasses import dataclass
from typing import Any


class ConfigError(ValueError):
    """A bad config file, key, value or `--set`; the message names the key as `section.key`.

    `key` is that `section.key` (`[section]` for a whole section, "" when no key applies, as
    for a TOML syntax error), `source` the file or `--set` the bad value came from, if known.
    """

    def __init__(self, key: str, message: str, source: str | None = None):
        source = None if source is None else escaped(source)  # a --set that quotes a control character
        super().__init__(": ".join(part for part in (source, key, message) if part))
        self.key, self.message, self.source = key, message, source


def fail(key: str, message: str) -> typing.NoReturn:
    """Raise the ConfigError that names `key`."""
    raise ConfigError(key, message)


# Sane maxima of numeric settings (`setting(..., most=)`): far past any real run, short of values
# that hang, overflow a socket timeout or a seed, or are a typo (docs/reference/config.md shows each range).
MAX_SEED = 2**32 - 1  # seeds: derived seeds (seed * 1_000_003 + step, as vLLM and torch take them) stay in int64
MAX_STEPS = 10**7  # optimizer steps and step counts
MAX_ITEMS = 10**8  # examples, rollouts kept
MAX_BATCH = 10**6  # prompts per step or batch
MAX_SAMPLES = 10**4  # samples per prompt
MAX_TOKENS = 2**20  # tokens of a completion or a context
MAX_TEMPERATURE = 100.0  # sampling temperatures (past ~10 a sample is close to uniform noise)
MAX_WEIGHT = 10**6  # loss weights, clips, caps and tolerances
MAX_SECONDS = 7 * 24 * 3600.0  # timeouts: a week
INT64 = (-(2**63), 2**63 - 1)  # any integer setting, declared range or not: what torch, numpy and vLLM take


@dataclass(frozen=True)
class Bounds:
    """The values a numeric setting takes: an interval (`ge` or `gt` below, `le` or `lt` above)
    and `most`, a sane maximum past which a value is a typo or an attack rather than a choice
    (a temperature of 1e300, a run of 10^18 steps, a timeout no socket takes)."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    most: float | None = None

    def check(self, key: str, value: float) -> None:
        """Fail, naming `key` and the bound broken, when `value` is outside."""
        if (self.ge, self.gt) != (None, None) and (self.le, self.lt) != (None, None) and not self._inside(value):
            fail(key, f"must be in {self}, got {shown(value)}")
        broken = [f"{sign} {bound!r}" for sign, bound, ok in (
            (">=", self.ge, lambda b: value >= b), (">", self.gt, lambda b: value > b),
            ("<=", self.le, lambda b: value <= b), ("<", self.lt, lambda b: value < b),
            ("<=", self.most, lambda b: value <= b)) if bound is not None and not ok(bound)]
        if broken:
            sane = " (a sane maximum)" if self.most is not None and not value <= self.most else ""
            fail(key, f"must be {broken[0]}{sane}, got {shown(value)}")

    def _inside(self, value: float) -> bool:
        return ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                and (self.le is None or value <= self.le) and (self.lt is None or value < self.lt))

    def __str__(self) -> str:
        """The interval, as the reference and messages write it: '[0, 1)', '(0, 1]'."""
        low = f"[{self.ge!r}" if self.ge is not None else f"({self.gt!r}" if self.gt is not None else "(-inf"
        high = self.le if self.le is not None else self.lt if self.lt is not None else self.most
        closed = self.lt is None and high is not None
        return f"{low}, {'inf' if high is None else repr(high)}{']' if closed else ')'}"


def shown(value: Any) -> str:
    """A value as a message shows it: an integer of hundreds of digits by its length."""
    if type(value) is int and abs(value) >= 10**30:
        return f"an integer of {len(str(abs(value)))} digits"
    return repr(value)


# Characters no setting holds: controls other than tab and newlines, and the invisible format
# characters (bidi overrides such as U+202E, zero-width ones) that make text read other than it is.
_HIDDEN = ("Cc", "Cf", "Co", "Cs", "Cn", "Zl", "Zp")


def hidden_characters(text: str, allow: str = "\t\n\r") -> list[str]:
    """The characters of `text` a reader cannot see as they are (`_HIDDEN`), but those in `allow`."""
    return [char for char in text if char not in allow and unicodedata.category(char) in _HIDDEN]


def escaped(text: str) -> str:
    """`text` with every hidden character (and tab, newline) written as an escape: safe on one line
    of a terminal, and shows the reader what is there."""
    return "".join(char.encode("unicode_escape").decode() if char in "\t\n\r" or hidden_characters(char, "")
                   else char for char in text)


def check_printable(key: str, text: str, allow: str = "\t\n\r") -> None:
    """Fail on a hidden character in a string setting, naming it and showing the value escaped."""
    hidden = hidden_characters(text, allow)
    if hidden:
        char = hidden[0]
        name = unicodedata.name(char, f"U+{ord(char):04X}")
        fail(key, f"holds the invisible or control character U+{ord(char):04X} ({name}) at position "
             f"{text.index(char)}: got '{escaped(text)}'")


def check_folder_name(key: str, name: str) -> None:
    """A name that becomes a folder (run.name, sft.name): one plain, visible path component."""
    if not name.strip():
        fail(key, "must not be empty")
    check_printable(key, name, allow="")
    if any(c in name for c in "/\\") or name in (".", ".."):
        fail(key, f"must be a plain folder name (no '/', '\\', '.' or '..'), got {name!r}")
    if len(name.encode()) > 200:
        fail(key, f"must be at most 200 bytes long (a folder name; the file system's limit is 255), got "
             f"{len(name.encode())}")
