"""selfopd.templating.sandbox: rendering one prompt is bounded in size, work and CPU time, and a
template past a bound is one TemplateLimitError naming its file, line and the limit.

Memory is observed with tracemalloc (it sees every str, bytes and list CPython allocates): a
refused expression must be refused before it builds its value, not after."""

from __future__ import annotations

import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor

import pytest

from selfopd.templating import sandbox
from selfopd.templating.templates import TemplateError, TemplateLimitError, load_template

SIZE = r"over 4,000,000 characters, the size limit of a prompt \(docs/templates\.md#limits\)"
# One expression each that asks for gigabytes (or runs for minutes) through another door.
HUGE = [
    ("{{ prompt * 10**9 }}", "'\\*' would make"),
    ("{{ [prompt] * 10**9 }}", "'\\*' would make"),
    ("{{ (['x' * 999999] * 999) | join }}", "'\\*' would make"),
    ("{{ 'x' | center(10**9) }}", "filter 'center' would make"),
    ("{{ 'x'.ljust(10**9) }}", "'ljust' would make"),
    ("{{ 'x'.rjust(10**9, '.') }}", "'rjust' would make"),
    ("{{ 'x'.zfill(10**9) }}", "'zfill' would make"),
    ("{{ ('\t' * 1000).expandtabs(10**7) }}", "'expandtabs' would make"),
    ("{{ '%999999999s' | format('x') }}", "filter 'format' would make"),
    ("{{ '%999999999s' % 'x' }}", "'%' would make"),
    ("{{ '%*s' % (10**9, 'x') }}", "'%' would make"),
    ("{{ '%.999999999f' % 1.5 }}", "'%' would make"),
    ("{{ '{:>999999999}'.format('x') }}", "'format' would make"),
    ("{{ '{:{}}'.format('x', 10**9) }}", "'format' would make"),
    ("{{ '{a:>999999999}'.format_map({'a': 1}) }}", "'format_map' would make"),
    ("{{ ('x' * 999999) | replace('x', 'x' * 999) }}", "filter 'replace' would make"),
    ("{{ ('x' * 999999).replace('', 'y' * 999) }}", "'replace' would make"),
    ("{{ ('a' * 999999).translate(''.maketrans({'a': 'x' * 999})) }}", "'translate' would make"),
    ("{{ 'a' | indent(10**9, true) }}", "filter 'indent' would make"),
    ("{{ ('x\n' * 499999) | indent('y' * 999) }}", "filter 'indent' would make"),
    ("{{ ('x ' * 499999) | wordwrap(1, wrapstring='y' * 999) }}", "filter 'wordwrap' would make"),
    ("{{ ('www.a.com ' * 99999) | urlize(target='y' * 9999) }}", "filter 'urlize' would make"),
    ("{{ range(10) | batch(10**9, 'x') | list }}", "filter 'batch' would make"),
    ("{{ range(10) | slice(10**9, 'x') | list }}", "filter 'slice' would make"),
    ("{{ ([[1]] * 100000) | sum(start=[]) | length }}", "filter 'sum' would make"),
    ("{{ range(100000) | map('center', 3000000) | list }}", "work limit|computed and wrote"),
    ("{{ (1).to_bytes(10**9, 'big') }}", "'to_bytes' would make"),
    ("{{ ('x' * 999999).encode() * 999 }}", "'\\*' would make"),
    ("{% set s = 'x' * 999999 %}{{ [s, s, s, s, s, s, s, s, s] | string }}", "an argument of filter 'string' holds"),
    ("{% set ns = namespace(s='xx') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
     "'~' would make"),
    ("{% set x %}{% for i in range(100000) %}{{ 'x' * 999999 }}{% endfor %}{% endset %}",
     "computed and wrote over 40,000,000 characters"),
    ("{% set s = 'x' * 999999 %}{% for i in range(5) %}{{ s }}{% endfor %}", "renders over 4,000,000 characters"),
    ("{{ 9 ** (9 ** 9) }}", "'\\*\\*' would make an integer of over 100,000 digits"),
]


def _render(tmp_path, source: str, **variables) -> str:
    path = tmp_path / "t.jinja"
    path.write_text(source)
    return load_template(path).render({"prompt": "What is 2 + 2?", **variables})[-1]["content"]


@pytest.mark.parametrize("source, refused", HUGE, ids=[case[0][:48] for case in HUGE])
def test_a_value_or_prompt_past_the_size_limit_is_refused_before_it_is_built(tmp_path, source, refused):
    tracemalloc.start()
    started = time.process_time()
    try:
        with pytest.raises(TemplateLimitError) as error:
            _render(tmp_path, source)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    message = str(error.value)
    assert message.startswith(str(tmp_path / "t.jinja")) and "\n" not in message
    assert __import__("re").search(refused, message), message
    assert peak < 200 * 2**20, f"{peak / 2**20:.0f} MiB allocated before the refusal"
    assert time.process_time() - started < 10


@pytest.mark.parametrize("source", [
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{% for i in range(100000) %}{% for c in 'x' * 100000 %}{% endfor %}{% endfor %}",
    "{% macro m(n) %}{% if n %}{{ m(n - 1) }}{{ m(n - 1) }}{% endif %}{% endmacro %}{{ m(60) }}",
    "{% for i in range(100000) %}{{ range(100000) | sum }}{% endfor %}",
])
def test_rendering_past_the_time_limit_is_stopped(tmp_path, monkeypatch, source):
    monkeypatch.setattr(sandbox, "MAX_RENDER_SECONDS", 0.3)
    started = time.process_time()
    with pytest.raises(TemplateLimitError, match=r"t\.jinja:1: rendering took over 0\.3 s of CPU time, the time limit"):
        _render(tmp_path, source)
    assert time.process_time() - started < 3


def test_the_time_limit_holds_in_a_worker_thread(tmp_path, monkeypatch):
    """The sampler renders teacher prompts in a thread pool: each thread has its own budget."""
    monkeypatch.setattr(sandbox, "MAX_RENDER_SECONDS", 0.3)
    path = tmp_path / "slow.jinja"
    path.write_text("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
    template = load_template(path)
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(template.render, {}) for _ in range(2)]
        for future in futures:
            with pytest.raises(TemplateLimitError, match="time limit"):
                future.result(timeout=30)


def test_prompts_up_to_the_limits_render(tmp_path):
    """The limits leave room: a prompt of nearly 4M characters, a filter over 1M characters, and
    100,000 loop iterations render as before."""
    long = "word " * 790_000  # 3.95M characters
    assert len(_render(tmp_path, "{{ prompt }}", prompt=long)) == len(long.strip())
    assert _render(tmp_path, "{{ prompt | indent(2) | length }}", prompt="line\n" * 200_000) == "1399998"
    assert _render(tmp_path, "{{ prompt | replace('o', '0') | length }}", prompt=long) == str(len(long))
    assert _render(tmp_path, "{% for i in range(100000) %}{{ i % 10 }}{% endfor %}")[:12] == "012345678901"
    assert _render(tmp_path, "{{ '%5.2f' | format(3.14159) }} {{ '{:>6}'.format('ab') }} {{ [1, 2] | join(', ') }}"
                   " {{ prompt ~ '!' }} {{ 2 ** 10 }} {{ 'ab' * 3 }}") == "3.14     ab 1, 2 What is 2 + 2?! 1024 ababab"


def test_a_prompt_past_the_limit_from_the_data_is_refused(tmp_path):
    with pytest.raises(TemplateLimitError, match=rf"t\.jinja:1: the text written holds {SIZE}"):
        _render(tmp_path, "{{ prompt }}", prompt="x" * 4_000_001)


def test_other_template_errors_are_not_limit_errors(tmp_path):
    with pytest.raises(TemplateError) as error:
        _render(tmp_path, "{{ 1 / 0 }}")
    assert not isinstance(error.value, TemplateLimitError)
