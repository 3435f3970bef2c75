"""Generator options are checked against the type of the generator's own field before any item is drawn:
a text that reaches a generator becomes its items' questions, references and (for sympy) variable names."""

from __future__ import annotations

import dataclasses
import enum
import re
from pathlib import Path

import pytest
from reasoning_gym.factory import DATASETS

from selfopd.data import DataError, load_examples, parse_data_spec

ROOT = Path(__file__).resolve().parents[2]
REWIRE = "vars(__import__('sympy')).update(parse_expr=callable),"


def test_a_variable_name_that_is_code_is_refused_before_any_item():
    """Finding 1: sympy's symbols() keeps the text, and the reference answer holds it word for word."""
    spec = (f"rg:polynomial_multiplication?size=2&variables={REWIRE}&allow_cross_variable_product=true"
            "&allow_multivariate_polynomials=true")
    with pytest.raises(DataError) as caught:
        load_examples(spec)
    assert str(caught.value) == (
        f"rg:polynomial_multiplication: option variables={REWIRE}: must be a comma-separated list of plain names "
        "(a letter, then up to 15 letters or digits) (the generator's field is tuple[str])")


@pytest.mark.parametrize("spec, message", [
    ("rg:basic_arithmetic?allow_negation=no", "option allow_negation=no: must be true or false (the generator's "
                                              "field is bool)"),
    ("rg:chain_sum?min_terms=two", "option min_terms=two: must be a whole number (the generator's field is int)"),
    ("rg:chain_sum?min_terms=2.5", "option min_terms=2.5: must be a whole number (the generator's field is int)"),
    ("rg:binary_matrix?p_zero=true", "option p_zero=true: must be a number (the generator's field is float)"),
    ("rg:countdown?operators=+-", "option operators=+-: must be a comma-separated list of words (letters, digits, _) "
                                  "or single operators (+ - * /) (the generator's field is tuple)"),
    ("rg:basic_arithmetic?format_style=fancy", "option format_style=fancy: must be one of simple, natural "
                                               "(the generator's field is Literal['simple', 'natural'])"),
    ("rg:time_intervals?min_date=2000-01-01", "option min_date=2000-01-01: must be set in Python: a data spec "
                                              "cannot write it (the generator's field is date)"),
])
def test_an_option_of_the_wrong_type_is_one_line_naming_it(spec, message):
    with pytest.raises(DataError) as caught:
        load_examples(spec + "&size=2")
    assert str(caught.value) == f"{spec.split('?')[0]}: {message}"


def test_lists_are_comma_separated_and_reach_the_generator_as_its_type():
    examples = load_examples("rg:basic_arithmetic?operators=+,-&min_terms=2&max_terms=2&size=20&seed=1")
    config = examples[0].meta["reasoning_gym"]["config"]
    assert config["operators"] == ["+", "-"]
    assert {c for ex in examples for c in ex.prompt if c in "+-*/"} <= {"+", "-"}
    poly = load_examples("rg:polynomial_multiplication?variables=a,b&size=20&seed=1")
    assert {v for ex in poly for v in ex.meta["reasoning_gym"]["entry"]["metadata"]["variables"]} <= {"a", "b"}
    assert poly[0].meta["reasoning_gym"]["config"]["variables"] == ("a", "b")


def test_an_option_given_in_python_keeps_its_type():
    from selfopd.data import DataSpec

    spec = DataSpec(source="rg", name="polynomial_multiplication", size=2, task_config={"variables": ("t",)})
    assert load_examples(spec)[0].meta["reasoning_gym"]["entry"]["metadata"]["variables"] == ["t"]


def _as_spec_text(value) -> str | None:
    """How a data spec writes a default value, None where it cannot."""
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (int, float, str)):
        return str(value)
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, (str, int, float)) for v in value):
        return ",".join(str(getattr(v, "value", v)) for v in value)  # an enum item by its value
    return None


def test_every_installed_generators_defaults_pass_as_spec_text():
    """Every field of every installed task's config whose default a spec can write takes that default,
    written as a spec writes it: the check refuses nothing the generators ship with."""
    from selfopd.data.rg_options import checked_options

    written = 0
    for task, (_dataset, config_class) in sorted(DATASETS.items()):
        for field in dataclasses.fields(config_class):
            default = field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
            text = _as_spec_text(default)
            if field.name in ("seed", "size") or text is None:
                continue
            options = parse_data_spec(f"rg:{task}?{field.name}={text}").task_config
            assert checked_options(task, config_class, options), (task, field.name, text)
            written += 1
    assert written > 400


_SPEC = re.compile(r"rg:[a-z0-9_]+(?:\?[^\s\"'`)\]|<>{}]*+)?(?![{])")  # not one completed by a {placeholder}


def _shipped_specs() -> set[str]:
    """Every rg: spec written in the recipes, docs and tests (the ones that are data, not placeholders)."""
    found = set()
    for folder in ("experiments", "docs", "tests", "notebooks", "README.md"):
        paths = [ROOT / folder] if folder.endswith(".md") else (ROOT / folder).rglob("*")
        for path in paths:
            if path == Path(__file__):
                continue  # the wrong options above are wrong on purpose
            if path.suffix in (".py", ".toml", ".md", ".json", ".ipynb", ".yaml") and path.is_file():
                found |= {m.rstrip(".,;:") for m in _SPEC.findall(path.read_text(errors="replace"))}
    return found


def test_the_specs_of_recipes_docs_and_tests_still_pass_the_type_check():
    from selfopd.data.rg_options import OptionTypeError, checked_options

    checked = 0
    for text in sorted(_shipped_specs()):
        try:
            spec = parse_data_spec(text)
        except DataError:
            continue  # a deliberately broken spec of a test, or a truncated quote
        if spec.name not in DATASETS:
            continue
        try:
            checked_options(spec.name, DATASETS[spec.name][1], spec.task_config)
        except OptionTypeError as error:
            pytest.fail(f"{text}: {error}")
        except DataError:
            continue  # unknown option or a size past the limit: what a test of those errors writes
        checked += 1
    assert checked >= 10
