"""The generator options of an rg: data spec, checked against the generator's own config fields.

A spec reads each option as a bool, int, float or text (`spec._parse_value`); a generator takes what it
is given, and some copy text into their items word for word: polynomial_multiplication's `variables`
become sympy symbols whose text its reference answers hold, and its scorer parses those with sympy
(`variables=__import__('os').system(...),` ran in the verifier worker). So every option must fit the
type hint of the generator's field (`typing.get_type_hints` of its config class): numbers are numbers,
booleans booleans, a tuple or list of text is a comma-separated list of words or single operators (plain
names where the field names variables), a Literal one of its values, an enum one of its values. What a
spec cannot write (dates, nested records) is refused; from Python it passes when it is of the field's
class. Sizes are bounded too: a numeric option past MAX_OPTION makes one item take minutes.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import enum
import re
import types
import typing
from collections.abc import Mapping
from typing import Any

from selfopd.data.spec import DataError
from selfopd.verifiers.task_grammars import PLAIN_NAME

MAX_OPTION = 10**5  # the largest number a generator option may be, unless its default is larger
NAME_FIELDS = frozenset({"variables", "variable", "symbols"})  # fields whose text becomes sympy symbol names
_WORD = re.compile(r"[A-Za-z0-9_]{1,64}|[-+*/]")  # an item of a list of text: a word or a single operator
_SEQUENCES = (tuple, list, collections.abc.Sequence)
_PLAIN_RULE = "(a letter, then up to 15 letters or digits)"  # PLAIN_NAME, in words


class OptionTypeError(DataError):
    """A generator option that does not fit the type of the generator's field."""


class _Misfit(Exception):
    """What the value must be instead (the end of a sentence "must be ...")."""


def _type_name(hint: Any) -> str:
    return hint.__name__ if isinstance(hint, type) and not typing.get_args(hint) else str(hint).replace("typing.", "")


def _shown(value: Any) -> str:
    text = str(value).lower() if isinstance(value, bool) else str(value)
    return text if len(text) <= 80 and text.isprintable() else repr(text[:77] + "..." if len(text) > 80 else text)


def _default(field: dataclasses.Field) -> Any:
    return field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default


def _text(value: Any, names: bool) -> str:
    """One item of text: a spec read "90" as 90, so a whole number is its digits again."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):
        raise _Misfit("text")
    if names and not PLAIN_NAME.fullmatch(value):
        raise _Misfit(f"a plain name {_PLAIN_RULE}")
    return value


def _scalar(text: str) -> Any:
    """One item of a comma-separated list read as a spec reads a value: a number, a boolean, else text."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def _is_sequence(hint: Any) -> bool:
    return (typing.get_origin(hint) or hint) in _SEQUENCES


def _items(value: Any, hint: Any, default: Any, names: bool) -> tuple | list:
    """A comma-separated list (or a list given in Python) as the sequence type of the field."""
    args = [a for a in typing.get_args(hint) if a is not Ellipsis]
    sample = default if isinstance(default, (tuple, list)) else [default]
    item_type = args[0] if args else (str if all(isinstance(d, str) for d in sample) else None)
    if isinstance(value, str) and _is_sequence(item_type):
        raise _Misfit("set in Python: a data spec cannot write a list of lists")
    items = [v.strip() for v in value.split(",")] if isinstance(value, str) else \
        list(value) if isinstance(value, (tuple, list)) else [value]
    try:
        if item_type is str:
            converted = [_word(item, names) for item in items]
        else:
            converted = [_as_field(_scalar(item) if isinstance(item, str) else item, item_type, None, names)
                         for item in items]
    except _Misfit as misfit:
        if item_type is not str:
            raise _Misfit(f"a comma-separated list, each {misfit}") from None
        what = f"plain names {_PLAIN_RULE}" if names else "words (letters, digits, _) or single operators (+ - * /)"
        raise _Misfit(f"a comma-separated list of {what}") from None
    return list(converted) if (typing.get_origin(hint) or hint) is list else tuple(converted)


def _word(item: Any, names: bool) -> str:
    text = _text(item, names)
    if not _WORD.fullmatch(text):
        raise _Misfit("a word")
    return text


def _as_field(value: Any, hint: Any, default: Any, names: bool) -> Any:
    """`value` as the field typed `hint` takes it; _Misfit saying what it must be instead."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType) and type(None) in args and len(args) == 2:  # Optional[X]: X
        hint = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is bool:
        if not isinstance(value, bool):
            raise _Misfit("true or false")
        return value
    if hint is int and not isinstance(default, float):  # rearc's diff_ub is an int field whose default is 0.2
        if isinstance(value, bool) or not isinstance(value, int):
            raise _Misfit("a whole number")
        return value
    if hint in (int, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _Misfit("a number")
        return value  # a whole number stays one: 1 and 1.0 print differently in a prompt
    if hint is str:
        return _text(value, names)
    if origin is typing.Literal:
        if value not in args:
            raise _Misfit(f"one of {', '.join(map(str, args))}")
        return value
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        found = next((m for m in hint if value in (m.value, m.name)), None)
        if found is None:
            raise _Misfit(f"one of {', '.join(str(m.value) for m in hint)}")
        return found
    if _is_sequence(hint):
        return _items(value, hint, default, names)
    if isinstance(hint, type) and isinstance(value, hint):
        return value  # given in Python, of the field's own class
    raise _Misfit("set in Python: a data spec cannot write it")


def check_option_size(task: str, key: str, value: Any, default: Any) -> None:
    """A numeric generator option at most MAX_OPTION (or its default, when larger): past it one item can
    take minutes (chain_sum's max_terms=10^5 takes 1 s an item and a 700 KB prompt) or never end."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    limit = max(MAX_OPTION, abs(default) if isinstance(default, (int, float)) else 0)
    if not abs(value) <= limit:  # also NaN
        raise DataError(f"rg:{task}: option {key}={value} must be within [-{limit}, {limit}] (a larger one makes one "
                        "item take minutes, or never end)")


def checked_options(task: str, config_class: type, options: Mapping[str, Any]) -> dict[str, Any]:
    """`options` as the fields of the generator's `config_class` take them; a DataError naming the first
    unknown option, one too large, or one that does not fit its field's type (OptionTypeError)."""
    fields = {f.name: f for f in dataclasses.fields(config_class)}
    hints = typing.get_type_hints(config_class)
    checked = {}
    for key, value in options.items():
        if key not in fields:
            raise DataError(f"rg:{task}: unknown option {key!r}; allowed: {', '.join(fields)}")
        default = _default(fields[key])
        check_option_size(task, key, value, default)
        hint = hints.get(key, Any)
        try:
            checked[key] = _as_field(value, hint, default, key in NAME_FIELDS)
        except _Misfit as misfit:
            raise OptionTypeError(f"rg:{task}: option {key}={_shown(value)}: must be {misfit} (the generator's field "
                                  f"is {_type_name(hint)})") from None
    return checked
