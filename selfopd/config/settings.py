"""The pieces every selfopd config is made of: a section is a frozen dataclass whose fields
carry their default and help text, type-checked on creation, parsed from `--set` strings and
written back as commented TOML; `load_document` reads a TOML file plus `--set` overrides
against a schema (section name -> section class) and names the file or the `--set` a bad
value came from.

`selfopd.config` defines the training sections with these; `selfopd sft` and
`selfopd compare` add their own `[sft]` and `[compare]` sections to the same schema.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import tomllib
import typing
from dataclasses import field
from pathlib import Path
from typing import Any, Callable, ClassVar, Literal, Mapping, Sequence, TypeVar

from selfopd.config.checks import (  # noqa: F401  (public here too: every section imports them from settings)
    INT64,
    MAX_BATCH,
    MAX_ITEMS,
    MAX_SAMPLES,
    MAX_SECONDS,
    MAX_SEED,
    MAX_STEPS,
    MAX_TEMPERATURE,
    MAX_TOKENS,
    MAX_WEIGHT,
    Bounds,
    ConfigError,
    check_folder_name,
    check_printable,
    escaped,
    fail,
    hidden_characters,
    shown,
)

T = TypeVar("T")


# The pieces below build a config section (here and in `selfopd.comparisons.sft`): a dataclass whose
# fields carry their help text, type-checked on creation, parsed from `--set` strings.


def setting(default: Any, help: str, *, ge: float | None = None, gt: float | None = None, le: float | None = None,
            lt: float | None = None, most: float | None = None, guarded: str | None = None) -> Any:
    """A section field with its default and the help line `--show-config` prints; a number also
    declares its range (`Bounds`), checked when the section is built and shown in the reference.
    `guarded`: what the setting does that a run folder from elsewhere may not decide (`load_run_config`)."""
    bounds = Bounds(ge, gt, le, lt, most)
    metadata = {"help": help, **({"bounds": bounds} if bounds != Bounds() else {}),
                **({"guarded": guarded} if guarded else {})}
    if isinstance(default, dict):  # a table: each section gets its own copy
        return field(default_factory=lambda: dict(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def bounds_of(cls: type, name: str) -> Bounds | None:
    """The declared range of field `name` of section class `cls` (None: none declared)."""
    return next(f.metadata.get("bounds") for f in dataclasses.fields(cls) if f.name == name)


class Section:
    """Type and range checks shared by every section (each field declares its range with `setting`);
    each section adds the rules that tie its fields together."""

    SECTION: ClassVar[str]

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value, bounds = getattr(self, f.name), f.metadata.get("bounds")
            if bounds is not None and type(value) is int:  # before a huge int fails as not 64-bit or not a float
                bounds.check(self._key(f.name), value)
            value = _check_type(self._key(f.name), field_types(type(self))[f.name], value)
            object.__setattr__(self, f.name, value)  # ints given for floats become floats
            if bounds is not None:
                bounds.check(self._key(f.name), value)

    def _key(self, name: str) -> str:
        return f"{self.SECTION}.{name}"

    def _non_empty(self, name: str) -> None:
        if not getattr(self, name).strip():
            fail(self._key(name), "must not be empty")


_TYPES: dict[type, dict[str, Any]] = {}


def field_types(cls: type) -> dict[str, Any]:
    if cls not in _TYPES:
        _TYPES[cls] = typing.get_type_hints(cls)
    return _TYPES[cls]


def describe_type(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(v) for v in typing.get_args(tp))
    if typing.get_origin(tp) is tuple and typing.get_origin(typing.get_args(tp)[0]) is Literal:
        return "a list, each one of " + ", ".join(repr(v) for v in typing.get_args(typing.get_args(tp)[0]))
    if typing.get_origin(tp) is tuple:
        return f"a list of {describe_type(typing.get_args(tp)[0]).removeprefix('an ').removeprefix('a ')}s"
    if typing.get_origin(tp) is dict:
        return "a table of names to true/false, numbers or strings"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}[tp]


def _check_type(key: str, tp: Any, value: Any) -> Any:
    """`value` if it has type `tp` (an int given for a float comes back as a float)."""
    if typing.get_origin(tp) is Literal:
        allowed = typing.get_args(tp)
        if not isinstance(value, str) or value not in allowed:
            fail(key, f"must be {describe_type(tp)}, got {value!r}")
        return value
    if typing.get_origin(tp) is tuple:  # tuple[X, ...]: a TOML list of X
        if not isinstance(value, (list, tuple)):
            fail(key, f"expected {describe_type(tp)}, got {value!r}")
        return tuple(_check_type(key, typing.get_args(tp)[0], item) for item in value)
    if typing.get_origin(tp) is dict:  # dict[str, TableValue]: a TOML table of plain values
        if not isinstance(value, dict):
            fail(key, f"expected {describe_type(tp)}, got {value!r}")
        for name, item in value.items():
            check_table_key(key, name)
            if not isinstance(item, TABLE_VALUES) or isinstance(item, float) and not math.isfinite(item):
                fail(f"{key}.{name}", f"expected true/false, a number or a string, got {shown(item)}")
            if isinstance(item, str):
                check_printable(f"{key}.{name}", item)
        return dict(value)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            fail(key, f"expected a number, got {value!r}")
        try:
            value = float(value)
        except OverflowError:  # an integer past 1e308
            fail(key, f"must be finite, got {shown(value)}")
        if not math.isfinite(value):
            fail(key, f"must be finite, got {value!r}")
        return value
    if (tp is int and isinstance(value, bool)) or not isinstance(value, tp):
        fail(key, f"expected {describe_type(tp)}, got {value!r}")
    if tp is int and not INT64[0] <= value <= INT64[1]:
        fail(key, f"must fit in 64 bits (in [-2**63, 2**63 - 1]), got {shown(value)}")
    if tp is str:
        check_printable(key, value)
    return value


TableValue = bool | int | float | str  # the values of a table setting (dict[str, TableValue])
TABLE_VALUES = (bool, int, float, str)


def check_table_key(key: str, name: Any) -> str:
    """A table setting's key: a name (letters, digits, '_'), as a template variable is."""
    if not isinstance(name, str) or not name.isidentifier() or not name.isascii():
        fail(key, f"keys are names (letters, digits, '_'), got {name!r}")
    return name


def check_key(section: str, cls: type, key: str) -> None:
    """Fail on a key that is not a field of the section class `cls`, listing the keys."""
    names = [f.name for f in dataclasses.fields(cls)]
    if key not in names:
        fail(f"{section}.{key}", f"unknown key{did_you_mean(key, names)}; keys of [{section}]: {', '.join(names)}")


def did_you_mean(name: str, choices: Any) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def parse_overrides(overrides: Sequence[str], schema: Mapping[str, type],
                    keyed: Mapping[str, type] = {}) -> dict[str, dict[str, Any]]:
    """`["optim.lr=3e-6", "run.progress=false"]` -> `{"optim": {"lr": 3e-6}, "run": {"progress": False}}`.

    The text after `=` is read as the field's type: int, float ("1e-6" and "3" both work),
    bool ("true" / "false"), a Literal's allowed string, or a str taken verbatim (no quotes).
    A key given twice keeps its last value, as on a command line. Range checks happen when
    the config is built, not here. A section of `keyed` takes a name: `teachers.NAME.kind=frozen`
    gives `{"teachers": {"NAME": {"kind": "frozen"}}}`.
    """
    parsed: dict[str, dict[str, Any]] = {}
    for override in overrides:
        path, eq, text = override.partition("=")
        parts = path.strip().split(".")
        named = len(parts) == 3 and parts[0] in keyed
        if not eq or len(parts) != 2 + named or not all(parts):
            raise ConfigError("", "expected section.key=value, e.g. --set optim.lr=3e-6", source=f"--set {override}")
        section, key = parts[0], parts[-1]
        try:
            if named:
                check_key(f"{section}.{parts[1]}", keyed[section], key)
                tp = field_types(keyed[section])[key]
                parsed.setdefault(section, {}).setdefault(parts[1], {})[key] = parse_value(path.strip(), tp, text)
                continue
            tp = field_types(section_class(schema, section, key))[key]
            parsed.setdefault(section, {})[key] = parse_value(f"{section}.{key}", tp, text)
        except ConfigError as error:
            raise ConfigError(error.key, error.message, source=f"--set {redacted(override)}") from None
    return parsed


SECRET_WORDS = ("key", "token", "secret", "password")


def redacted(override: str) -> str:
    """`section.key=value` as an error may quote it: the value of a key whose name suggests a
    secret (api_key_env holds a variable's NAME, but a key may be pasted there) is hidden."""
    path, eq, text = override.partition("=")
    words = path.strip().rpartition(".")[2].lower().split("_")  # api_key_env, hf_token: not max_tokens
    return f"{path}=***" if eq and any(word in words for word in SECRET_WORDS) else override


def section_class(schema: Mapping[str, type], section: str, key: str | None = None) -> type:
    """The section's class, failing on an unknown section or key with the allowed names."""
    if section not in schema:
        fail(f"[{section}]", f"unknown section{did_you_mean(section, schema)}; sections: {', '.join(schema)}")
    cls = schema[section]
    if key is not None:
        check_key(section, cls, key)
    return cls


def build_keyed(tables: Any, section: str, cls: type) -> dict[str, Any]:
    """`{name: cls(**table)}` of the `[section.NAME]` tables; an error names `section.NAME.key`."""
    if not isinstance(tables, dict) or not all(isinstance(table, dict) for table in tables.values()):
        fail(f"[{section}]", f"expected [{section}.NAME] tables, each a section of its own")
    built = {}
    for name, table in tables.items():
        for key in table:
            check_key(f"{section}.{name}", cls, key)
        try:
            built[name] = cls(**table)
        except ConfigError as error:  # the class names its key `SECTION.key`
            raise ConfigError(f"{section}.{name}.{error.key.partition('.')[2]}", error.message) from None
    return built


def build_sections(tables: Mapping[str, Any], schema: Mapping[str, type]) -> dict[str, Any]:
    """One section object per table (keys checked against the schema); missing tables are absent."""
    sections = {}
    for section, table in tables.items():
        if not isinstance(table, dict):
            hints = [f"{s}.{section}" for s, cls in schema.items() if section in {f.name for f in dataclasses.fields(cls)}]
            hint = f" (did you mean {hints[0]!r}?)" if hints else ""
            fail(section, f"a top-level key; every key belongs in a [section]{hint}")
        cls = section_class(schema, section)
        for key in table:
            section_class(schema, section, key)
        sections[section] = cls(**table)
    return sections


def parse_value(key: str, tp: Any, text: str) -> Any:
    """A `--set` value as the field's type; a list is comma-separated ("0,1,2"), a table is
    comma-separated name=value pairs ("enable_thinking=false,depth=2"), each value read as
    true/false, an integer, a number, else a string."""
    if typing.get_origin(tp) is dict:
        table = {}
        for item in (item.strip() for item in text.split(",") if item.strip()):
            name, eq, value = item.partition("=")
            if not eq:
                fail(key, f"expected name=value pairs separated by commas, got {item!r}")
            table[check_table_key(key, name.strip())] = _table_value(value.strip())
        return _check_type(key, tp, table)
    if typing.get_origin(tp) is tuple:
        return tuple(parse_value(key, typing.get_args(tp)[0], item.strip()) for item in text.split(",") if item.strip())
    if tp is bool:
        if text.strip().lower() not in ("true", "false"):
            fail(key, f"expected true or false, got {text!r}")
        return text.strip().lower() == "true"
    if tp is int:
        try:
            return int(text)
        except ValueError:
            fail(key, f"expected an integer, got {text!r}")
    if tp is float:
        try:
            number = float(text)
        except ValueError:
            fail(key, f"expected a number, got {text!r}")
        return _check_type(key, float, number)  # rejects nan and inf
    return _check_type(key, tp, text)  # str, or a Literal checked against its values


def _table_value(text: str) -> TableValue:
    """A `--set` table value: true/false, an integer, a number, else the text itself."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


MAX_CONFIG_BYTES = 16 * 2**20  # a config, comparison or run folder's TOML; the largest shipped is a few KB


def read_toml(path: str | Path, what: str = "config file") -> dict[str, Any]:
    """The tables of a TOML file; a missing, unreadable or non-UTF-8 file, a folder or bad syntax is
    a ConfigError naming it."""
    file = Path(path)
    try:
        if file.is_dir():
            raise ConfigError("", f"is a folder, not a {what}", source=str(path))
        if file.exists() and not file.is_file():  # a device (/dev/zero never ends), a pipe
            raise ConfigError("", f"is not a regular file, so not a {what}", source=str(path))
        if file.is_file() and file.stat().st_size > MAX_CONFIG_BYTES:
            raise ConfigError("", f"is {file.stat().st_size} bytes; a {what} is at most {MAX_CONFIG_BYTES}",
                              source=str(path))
        data = file.read_bytes()
    except FileNotFoundError:
        raise ConfigError("", f"no such {what}", source=str(path)) from None
    except OSError as error:  # permissions, a name too long
        raise ConfigError("", f"cannot read the {what}: {error.strerror or error}", source=str(path)) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data[: error.start].count(b"\n") + 1
        raise ConfigError("", f"line {line}: not UTF-8 text (byte 0x{data[error.start]:02x}); TOML files are UTF-8",
                          source=str(path)) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:  # its message ends "(at line L, column C)"
        raise ConfigError("", f"invalid TOML: {error}", source=str(path)) from None
    except RecursionError:  # arrays or tables nested thousands deep
        raise ConfigError("", "invalid TOML: nested too deep to read", source=str(path)) from None


def load_document(path: str | Path | None, overrides: Sequence[str], schema: Mapping[str, type],
                  build: Callable[[dict[str, Any]], T], what: str = "config file",
                  keyed: Mapping[str, type] = {}) -> T:
    """`build(tables)` of the TOML file at `path` (None: no file) with `--set` overrides merged in.

    A `--set` wins over the file. A ConfigError raised while building names the `--set` the
    bad value came from, else the file.
    """
    tables: dict[str, Any] = {} if path is None else read_toml(path, what)
    for section, values in parse_overrides(overrides, schema, keyed).items():
        table = tables.setdefault(section, {})
        if not isinstance(table, dict):  # build reports the file's top-level key
            continue
        if section in keyed:  # {NAME: {key: value}}: merged table by table
            for name, named in values.items():
                if isinstance(table.setdefault(name, {}), dict):
                    table[name].update(named)
        else:
            table.update(values)
    set_by = {override.partition("=")[0].strip(): override for override in overrides}  # last wins
    try:
        return build(tables)
    except ConfigError as error:
        given = next((set_by[key] for key in (error.key, error.key.rpartition(".")[0]) if key in set_by), None)
        source = f"--set {redacted(given)}" if given else None if path is None else str(path)  # a table's key: its --set
        raise ConfigError(error.key, error.message, source=source) from None


def flatten(sections: Mapping[str, Any]) -> dict[str, Any]:
    """`{"section.key": value}` of section objects (e.g. to compare two configs key by key)."""
    return {f"{name}.{f.name}": getattr(section, f.name) for name, section in sections.items()
            for f in dataclasses.fields(section)}


def section_toml(name: str, values: Section) -> list[str]:
    """The lines of one `[name]` table: every field, its help as a comment above it."""
    lines = [f"[{name}]"]
    for f in dataclasses.fields(values):
        lines.append(f"# {f.metadata['help']}")
        lines.append(f"{f.name} = {toml_value(getattr(values, f.name))}")
    return lines


def toml_value(value: Any) -> str:
    if isinstance(value, dict):  # keys are names (check_table_key): bare TOML keys
        return "{" + ", ".join(f"{name} = {toml_value(item)}" for name, item in value.items()) + "}"
    if isinstance(value, tuple):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)  # repr round-trips floats exactly; validated floats are finite
    escapes = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r"}
    out = []
    for char in value:
        if char in escapes:
            out.append(escapes[char])
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            out.append(f"\\u{ord(char):04x}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'
