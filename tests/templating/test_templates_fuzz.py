"""Property and fuzz tests of prompt templates: data is never run, templates cannot escape.

A template is code from a config (maybe a colleague's); its data fields come from a dataset
or from the student's own completion. Neither may run Python, read a file outside
`prompts/`, or fail with anything but a `TemplateError` that names the file and line.
A Python audit hook sees every file the process opens, so "the canary was never read" is
observed, not inferred from the output.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given
from hypothesis import strategies as st

import selfopd.templating.templates
from selfopd.data.example import Example
from selfopd.templating.templates import TemplateError, list_templates, load_template, render_student, render_teacher
from tests.fuzz_settings import examples

CANARY_TEXT = "CANARY-7f3a-not-for-templates"
_opened: list[str] = []


def _record_opens(event: str, args: tuple) -> None:
    if event == "open" and isinstance(args[0], (str, bytes, Path)) and "canary" in str(args[0]):
        _opened.append(str(args[0]))


sys.addaudithook(_record_opens)  # audit hooks cannot be removed; this one only appends names


@pytest.fixture
def sandbox_dir(tmp_path, monkeypatch):
    """A prompts/ folder of our own (PROMPTS_DIR points at it) and canary files that no template
    may read: next to prompts/, and beside the template itself (a text file, and a .jinja link
    leading out of prompts/)."""
    prompts = tmp_path / "prompts"
    (prompts / "teacher").mkdir(parents=True)
    (prompts / "student").mkdir()
    (prompts / "student" / "plain.jinja").write_text("{{ prompt }}")
    (tmp_path / "canary.txt").write_text(CANARY_TEXT)
    (tmp_path / "canary.jinja").write_text(CANARY_TEXT)
    (prompts / "teacher" / "canary_sibling.txt").write_text(CANARY_TEXT)
    (prompts / "teacher" / "canary_link.jinja").symlink_to(tmp_path / "canary.jinja")
    monkeypatch.setattr(selfopd.templating.templates, "PROMPTS_DIR", prompts)
    _opened.clear()
    return tmp_path


def _render_source(folder: Path, source: str) -> str:
    """Load prompts/teacher/evil.jinja with `source` and render it on a full example;
    the rendered text, or a TemplateError (anything else fails the test)."""
    (folder / "prompts" / "teacher" / "evil.jinja").write_text(source)
    example = Example(id="x", prompt="What is 3 + 4?", answer="7", solution="3 + 4 = 7", hints=("add",),
                      meta={"k": [1]})
    student = render_student(load_template("student/plain"), example)
    messages = render_teacher(load_template("teacher/evil"), example, student, attempt="7", feedback="ok")
    return "\n".join(m["content"] for m in messages)


def _assert_no_side_effects(folder: Path, output: str | None, files_before: set[Path]) -> None:
    assert _opened == [], f"a canary file was opened: {_opened}"
    assert set(folder.rglob("*")) == files_before, "rendering created or removed files"
    if output is not None:
        assert CANARY_TEXT not in output
        assert "root:" not in output  # /etc/passwd


def _outcome(folder: Path, source: str) -> str | None:
    """The rendered text, or None after a TemplateError that names the file and line."""
    try:
        return _render_source(folder, source)
    except TemplateError as error:
        message = str(error)
        assert "evil.jinja" in message and "\n" not in message.strip(), message
        return None


# --- data is data --------------------------------------------------------------------------
jinja_in_data = st.sampled_from([
    "{{ 7*7 }}", "{% include 'canary.txt' %}", "{% include '../canary.txt' %}", "{{ ''.__class__.__mro__ }}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}", "{% for i in range(10**9) %}x{% endfor %}",
    "{# comment #}", "{%- raw -%}", "{{", "}}", "{%", "%}", "\x00", "{0.__class__}", "%s%n",
])
SHIPPED = {name: load_template(name) for name in list_templates()}
field = st.one_of(st.text(), jinja_in_data, st.lists(st.one_of(st.text(max_size=10), jinja_in_data)).map("".join))


@examples(60)
@given(prompt=field, answer=field, solution=field.filter(bool),  # an empty solution is an absent one
       hints=st.lists(field, min_size=1, max_size=3), attempt=field, feedback=field, demonstration=field)
@example(prompt="{{ 7*7 }}", answer="{% include '/etc/passwd' %}", solution="{{ ''.__class__ }}",
         hints=["{{ lipsum() }}"], attempt="{{ config }}", feedback="{0.__class__}", demonstration="{{ 7*7 }}")
def test_data_fields_render_verbatim_in_every_shipped_template(prompt, answer, solution, hints, attempt, feedback,
                                                               demonstration):
    """Every field a shipped template shows appears exactly as given: `{{ 7*7 }}` stays
    `{{ 7*7 }}`, never `49`; Jinja syntax in data is never parsed, let alone run."""
    example = Example(id="fuzz", prompt=prompt, answer=answer, solution=solution, hints=tuple(hints),
                      meta={"fact_sheet": solution})  # a document (kb: tasks): the same hostile text
    fields = {"prompt": [prompt], "answer": [answer], "solution": [solution], "hints": hints,
              "attempt": [attempt], "feedback": [feedback], "demonstration": [demonstration], "fact_sheet": [solution]}
    for name, template in SHIPPED.items():
        if name.startswith("student/"):
            messages = render_student(template, example)
        else:
            student = render_student(SHIPPED["student/plain"], example)
            messages = render_teacher(template, example, student, attempt=attempt, feedback=feedback,
                                      demonstration=demonstration)
        text = "\n".join(m["content"] for m in messages)
        shown = template.variables | ({"prompt"} if "student_prompt" in template.variables else set())
        for variable in shown & fields.keys():
            for value in fields[variable]:
                assert value.strip() in text, f"{name}: {variable} {value!r} not rendered verbatim"
        if "49" not in prompt + answer + solution + attempt + feedback + demonstration + "".join(hints):
            assert "49" not in text


# --- hostile template sources --------------------------------------------------------------
ESCAPES = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ ''.__class__.__base__.__subclasses__()[0].__init__.__globals__['__builtins__']['open']('canary.txt').read() }}",
    "{{ cycler.__init__.__globals__.os.popen('touch pwned').read() }}",
    "{{ joiner.__init__.__globals__.__builtins__.__import__('os').system('touch pwned') }}",
    "{{ namespace.__init__.__globals__ }}",
    "{{ lipsum.__globals__['os'].popen('id').read() }}",
    "{{ lipsum(10**9) }}",
    "{{ self._TemplateReference__context }}",
    "{{ self.__dict__ }}",
    "{{ config.items() }}",
    "{{ request.application.__globals__ }}",
    "{{ range.__self__ }}",
    "{{ dict.__base__.__subclasses__() }}",
    "{{ prompt | attr('__class__') | attr('__mro__') }}",
    "{{ prompt | attr('format') }}",
    "{{ '{0.__class__.__mro__}'.format(prompt) }}",
    "{{ '{0.__init__.__globals__}'.format(cycler) }}",
    "{{ '%s' | format(prompt.__class__) }}",
    "{{ prompt.format_map(meta) }}",
    "{{ meta.update({'k': 2}) }}{{ meta }}",
    "{{ meta.k.append(2) }}",
    "{{ hints.pop() }}",
    "{% set x = meta.__setitem__('k', 0) %}",
    "{{ __builtins__ }}",
    "{{ open('canary.txt').read() }}",
    "{% import 'os' as os %}{{ os.system('id') }}",
    "{% from 'subprocess' import call %}",
    "{{ range(10**9) | list }}",
    "{{ prompt * 10**9 }}",
    "{{ [0] * 10**9 }}",
    "{{ 9 ** (9 ** 9) }}",
    "{{ 10 ** 100000 }}",
    "{{ 1 / 0 }}",
    "{% macro m() %}{{ m() }}{% endmacro %}{{ m() }}",
]
INCLUDES = [
    "{% include '../canary.txt' %}",
    "{% include '../../canary.txt' %}",
    "{% include 'teacher/../../canary.txt' %}",
    "{% include '..\\\\canary.txt' %}",
    "{% include '/etc/passwd' %}",
    "{% include '../../../../../../../../etc/passwd' %}",
    "{% include 'canary.jinja' %}",
    "{% include ['../canary.jinja', 'nope'] %}",
    "{% extends '../canary.jinja' %}",
    "{% import '../canary.jinja' as c %}",
    "{% from '../canary.jinja' import x %}",
    "{% include 'canary_sibling.txt' %}",
    "{% include 'teacher/canary_sibling.txt' %}",
    "{% include 'canary_link.jinja' %}",
    "{% extends 'teacher/canary_link.jinja' %}",
]


@pytest.mark.parametrize("source", ESCAPES + INCLUDES, ids=lambda s: s[:40])
def test_hostile_template_raises_template_error_or_renders_harmlessly(sandbox_dir, source, monkeypatch):
    monkeypatch.chdir(sandbox_dir)  # so a relative 'canary.txt' or 'pwned' would land here
    files = set(sandbox_dir.rglob("*")) | {sandbox_dir / "prompts" / "teacher" / "evil.jinja"}
    output = _outcome(sandbox_dir, source)
    _assert_no_side_effects(sandbox_dir, output, files)


@pytest.mark.parametrize("source", INCLUDES)
def test_includes_outside_prompts_are_refused_with_a_clear_message(sandbox_dir, source):
    with pytest.raises(TemplateError, match=r"evil\.jinja:1: (template '.*' refused: |no template .* to include or extend)"):
        _render_source(sandbox_dir, source)


def test_templates_in_prompts_still_include_each_other(sandbox_dir):
    (sandbox_dir / "prompts" / "teacher" / "part.jinja").write_text("[{{ answer }}]")
    assert _render_source(sandbox_dir, "{{ student_prompt }} {% include 'part.jinja' %}") == "What is 3 + 4? [7]"


# Pieces of Jinja and of the known escapes, glued in any order: most results are syntax
# errors, some render, and whatever they do, only a TemplateError may come out.
PIECES = ["{{", "}}", "{%", "%}", "(", ")", "[", "]", "|", ".", ",", "'", "=", " ", "*", "**", "~", "\n",
          "__class__", "__mro__", "__subclasses__()", "__globals__", "__builtins__", "__import__", "__init__",
          "_TemplateReference__context", "self", "cycler", "joiner", "namespace", "lipsum", "range", "dict",
          "config", "request", "prompt", "meta", "hints", "answer", "attr", "format", "join", "map", "select",
          "include", "import", "extends", "from", "set", "for", "in", "if", "endfor", "endif", "macro", "call",
          "'../canary.txt'", "'canary.jinja'", "'canary_sibling.txt'", "'canary_link.jinja'", "'/etc/passwd'", "10**9", "9", "0", "-1", "'{0.__class__}'",
          "open", "os", "popen", "read", "mro", "items", "x"]


@examples(300, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.sampled_from(PIECES), min_size=1, max_size=25).map("".join))
@example("{{ 10 ** 100000 }}")  # a ValueError (int too long to print) escaped as itself
@example("{% include '../canary.txt' %}")  # jinja2.TemplateNotFound escaped as itself
def test_any_template_source_gives_text_or_a_template_error(sandbox_dir, source):
    files = set(sandbox_dir.rglob("*")) | {sandbox_dir / "prompts" / "teacher" / "evil.jinja"}
    output = _outcome(sandbox_dir, source)
    _assert_no_side_effects(sandbox_dir, output, files)
