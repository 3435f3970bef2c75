"""The sandbox templates render in: Jinja's immutable sandbox, bounded in size and time.

Jinja's sandbox stops a template from calling into Python, and bounds `range()`; it does not
stop a template from building a value of gigabytes in one expression (`'x' * 10**9`,
`'x' | center(10**9)`, `'%999999999s' % x`, `s | replace('x', s)`) or from looping for hours
(nested loops, a macro that calls itself twice). A template is code from a config, a colleague
or a run folder, and its data is a dataset's or the policy's own text, so rendering one prompt is
bounded, and a template past a bound is an error naming it and the limit (docs/templates.md):

- size: no value a template computes, and no rendered prompt, holds more than
  MAX_RENDER_CHARS characters (items, for a list): about a million tokens, past any model's
  context. Operations that can make much more than they are given (`*`, `**`, `%`, `format`,
  `center`, `indent`, `replace`, `join`, ...) are checked before they run, every other result
  after;
- work: all values computed and text written while rendering one prompt hold at most
  MAX_RENDER_WORK characters together, so no loop of small steps adds up to gigabytes;
- time: MAX_RENDER_SECONDS of the rendering thread's CPU time, checked at every loop
  iteration, call, filter and output; a single filter runs to its end, bounded by the size limit.

The code Jinja generates is changed in three places only (`_Guard`): each `{% for %}` iterates
through `ticking`, each output through `written` and each `~` through `tilde`, all three called
through the sandbox's `call`, which counts the time and sizes of every call a template makes.
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
import string
import threading
import time
from collections.abc import Iterator
from typing import Any, Callable

from jinja2 import nodes
from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError
from jinja2.utils import Namespace
from jinja2.visitor import NodeTransformer

MAX_RENDER_CHARS = 4_000_000  # characters of one prompt or value: ~1M tokens, past any model's context
MAX_RENDER_WORK = 10 * MAX_RENDER_CHARS  # characters computed and written while rendering one prompt
MAX_RENDER_SECONDS = 2.0  # CPU seconds to render one prompt; a shipped template takes under 0.1 ms
MAX_POWER_DIGITS = 100_000  # `a ** b` of integers: 9 ** (9 ** 9) would run for hours
LIMITS_DOC = "docs/templates.md#limits"
TICKS_PER_CLOCK = 256  # operations between two reads of the CPU clock


class RenderLimit(SecurityError):
    """A template went past a size, work or time limit; the message names the limit."""


class _Budget:
    """What one render has spent: CPU time (by its deadline), characters computed, and a cache
    of the sizes of the containers it has measured (immutable in the sandbox)."""

    def __init__(self) -> None:
        self.deadline = time.thread_time() + MAX_RENDER_SECONDS
        self.work = 0
        self.ticks = 0
        self.sizes: dict[int, tuple[Any, int]] = {}


_local = threading.local()  # each thread renders with its own budget (the sampler renders in a pool)


@contextlib.contextmanager
def render_budget() -> Iterator[None]:
    """Bound the rendering done inside the block (one prompt)."""
    previous = getattr(_local, "budget", None)
    _local.budget = _Budget()
    try:
        yield
    finally:
        _local.budget = previous


def tick() -> None:
    """Count one operation; past the time limit, raise RenderLimit."""
    budget = getattr(_local, "budget", None)
    if budget is None:
        return
    budget.ticks += 1
    if budget.ticks % TICKS_PER_CLOCK == 0 and time.thread_time() > budget.deadline:
        raise RenderLimit(f"rendering took over {MAX_RENDER_SECONDS:g} s of CPU time, the time limit of a prompt "
                          f"({LIMITS_DOC})")


def size(value: Any) -> int:
    """Characters (items, digits) `value` holds, counting every reference: about what printing
    or joining it would make. Stops counting past MAX_RENDER_CHARS."""
    if isinstance(value, (str, bytes, bytearray)):
        return len(value)
    if isinstance(value, int):
        return int(value.bit_length() * 0.302) + 1
    if not isinstance(value, (list, tuple, dict, set, frozenset, Namespace)):
        return 1
    budget = getattr(_local, "budget", None)
    if budget is not None and id(value) in budget.sizes:
        return budget.sizes[id(value)][1]
    total, stack, fixed = 0, [value], True
    while stack and total <= MAX_RENDER_CHARS:
        item = stack.pop()
        total += 1
        if isinstance(item, (str, bytes, bytearray)):
            total += len(item)
        elif isinstance(item, (list, tuple, set, frozenset)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, Namespace):  # changed by `{% set ns.x = ... %}`: never cached
            fixed = False
            stack.extend(object.__getattribute__(item, "_Namespace__attrs").values())
        elif isinstance(item, int):
            total += size(item)
    if budget is not None and fixed and total <= MAX_RENDER_CHARS:
        budget.sizes[id(value)] = (value, total)  # the value is kept, so its id is not reused
    return total


def check_size(estimate: int, phrase: str) -> None:
    """Past the size limit, a RenderLimit: '{phrase} over N characters, the size limit ...'."""
    if estimate > MAX_RENDER_CHARS:
        raise RenderLimit(f"{phrase} over {MAX_RENDER_CHARS:,} characters, the size limit of a prompt ({LIMITS_DOC})")


def account(result: Any, what: str) -> None:
    """Check a computed value's size and count it against the render's work."""
    produced = size(result)
    check_size(produced, f"{what} made")
    budget = getattr(_local, "budget", None)
    if budget is not None:
        budget.work += produced
        if budget.work > MAX_RENDER_WORK:
            raise RenderLimit(f"computed and wrote over {MAX_RENDER_WORK:,} characters while rendering one prompt, "
                              f"the work limit of a prompt ({LIMITS_DOC})")


# --- what an operation can make, before it runs --------------------------------------------
def _arg(args: tuple, kwargs: dict, index: int, name: str, default: Any) -> Any:
    return args[index] if len(args) > index else kwargs.get(name, default)


def _number(value: Any) -> int:
    """A width or count argument as a number of characters (a string width: its length)."""
    return abs(value) if isinstance(value, int) else size(value)


def _lines(text: Any) -> int:
    return str(text).count("\n") + 1 if isinstance(text, str) else size(text)


def _count(text: Any, part: Any) -> int:
    """Occurrences of `part` in `text`; an empty part, or text that is not a str or bytes (a
    filter turns it into one), counts as matching everywhere."""
    if isinstance(text, (str, bytes)) and type(part) is type(text) and part:
        return text.count(part)
    return size(text) + 1


def _replaced(text: Any, old: Any, new: Any, count: Any = None) -> int:
    occurrences = _count(text, old)
    if isinstance(count, int) and count >= 0:
        occurrences = min(occurrences, count)
    return size(text) + occurrences * max(size(new) - (size(old) if old else 0), 0)


def _translated(text: Any, table: Any) -> int:
    longest = max((size(v) for v in table.values()), default=1) if isinstance(table, dict) else size(table)
    return size(text) * max(longest, 1)


def _percent(template: Any, values: Any) -> int:
    """`template % values`: its text, each spec's width and precision, and the values (a mapping's
    largest value once per spec, as specs may name it again and again)."""
    specs = re.findall(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?", str(template))
    items = values if isinstance(values, tuple) else (values,)
    stars = sum(_number(v) for v in items if isinstance(v, int))  # `*` widths come from the values
    shown = len(specs) * size(values) if isinstance(values, dict) else sum(size(v) for v in items)
    return size(template) + shown + sum(stars if g == "*" else int(g) for spec in specs for g in spec if g)


def _braces(template: str, args: tuple, kwargs: dict) -> int:
    """`template.format(...)`: its text, the numbers in each field's spec (and the integers given,
    for a width taken from them), and the largest value once per field."""
    values = [*args, *kwargs.values()]
    largest = max((size(v) for v in values), default=0)
    total = 0
    for literal, field, spec, _ in string.Formatter().parse(template):
        total += len(literal)
        if field is not None:
            nested = sum(_number(v) for v in values if isinstance(v, int)) if "{" in (spec or "") else 0
            total += largest + nested + sum(int(n) for n in re.findall(r"\d+", spec or ""))
    return total


def _summed(values: Any, args: tuple, kwargs: dict) -> int:
    """`sum` of lists or tuples copies the running total at every item."""
    sequences = isinstance(values, (list, tuple)) and isinstance(_arg(args, kwargs, 1, "start", 0), (list, tuple))
    return size(values) * (len(values) if sequences else 1)


Estimate = Callable[[Any, tuple, dict], int]
# Filters and str/bytes methods whose result can be much larger than what they are given.
WIDENING: dict[str, Estimate] = {
    "center": lambda v, a, k: size(v) + _number(_arg(a, k, 0, "width", 80)),
    "ljust": lambda v, a, k: size(v) + _number(_arg(a, k, 0, "width", 0)),
    "rjust": lambda v, a, k: size(v) + _number(_arg(a, k, 0, "width", 0)),
    "zfill": lambda v, a, k: size(v) + _number(_arg(a, k, 0, "width", 0)),
    "expandtabs": lambda v, a, k: size(v) + _count(v, "\t" if isinstance(v, str) else b"\t")
    * _number(_arg(a, k, 0, "tabsize", 8)),
    "indent": lambda v, a, k: size(v) + _lines(v) * _number(_arg(a, k, 0, "width", 4)),
    "replace": lambda v, a, k: _replaced(v, _arg(a, k, 0, "old", ""), _arg(a, k, 1, "new", ""),
                                         _arg(a, k, 2, "count", None)),
    "translate": lambda v, a, k: _translated(v, _arg(a, k, 0, "table", None)),
    "wordwrap": lambda v, a, k: size(v) + (size(v) // max(1, _number(_arg(a, k, 0, "width", 79))) + _lines(v))
    * size(_arg(a, k, 2, "wrapstring", None) or "\n"),
    "urlize": lambda v, a, k: 3 * size(v) + (size(v) // 2 + 1) * (
        size(_arg(a, k, 2, "target", None) or "") + size(_arg(a, k, 3, "rel", None) or "") + 64),
    "tojson": lambda v, a, k: 6 * size(v) * (1 + _number(_arg(a, k, 0, "indent", None) or 0)),
    "batch": lambda v, a, k: size(v) + _number(_arg(a, k, 0, "linecount", 1)) * (1 + size(_arg(a, k, 1, "fill_with", None))),
    "slice": lambda v, a, k: size(v) + _number(_arg(a, k, 0, "slices", 1)) * (1 + size(_arg(a, k, 1, "fill_with", None))),
    "format": lambda v, a, k: _percent(v, a or k),
    "to_bytes": lambda v, a, k: _number(_arg(a, k, 0, "length", 1)),
}
FILTER_JOIN: Estimate = lambda v, a, k: size(v) * (1 + size(_arg(a, k, 0, "d", "")))  # noqa: E731
METHOD_JOIN: Estimate = lambda v, a, k: size(_arg(a, k, 0, "iterable", ())) * (1 + size(v))  # noqa: E731
FILTERS = {**WIDENING, "join": FILTER_JOIN, "sum": _summed}
METHODS = {**WIDENING, "join": METHOD_JOIN}


def _binop_estimate(operator: str, left: Any, right: Any) -> int:
    if operator == "+":
        return size(left) + size(right)
    if operator == "%" and isinstance(left, (str, bytes)):
        return _percent(left, right)
    if operator == "*":
        for sequence, count in ((left, right), (right, left)):
            if isinstance(sequence, (str, bytes, list, tuple)) and isinstance(count, int):
                return size(sequence) * max(count, 0)
    if operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
        if right * math.log10(abs(left)) > MAX_POWER_DIGITS:
            raise RenderLimit(f"'**' would make an integer of over {MAX_POWER_DIGITS:,} digits, the limit of a "
                              f"template ({LIMITS_DOC})")
    return 0


def _guarded(what: str, estimate: Estimate | None, value: Any, args: tuple, kwargs: dict) -> None:
    """Before an operation: count it, check the size of what it is given and what it can make."""
    tick()
    for given in (value, *args, *kwargs.values()):
        check_size(size(given), f"an argument of {what} holds")
    if estimate is not None:
        check_size(estimate(value, args, kwargs), f"{what} would make")


# --- the three points of the generated code that the sandbox does not otherwise see -----------
def ticking(iterable: Any) -> Iterator[Any]:
    """A `{% for %}` loop's items, counting each against the time limit."""
    for item in iterable:
        tick()
        yield item


def written(value: Any) -> str:
    """A piece of output (the call that brings it here checks and counts its size)."""
    return value if isinstance(value, str) else str(value)


def tilde(*parts: Any) -> str:
    """`a ~ b`: the joined text, its size checked before it is made."""
    check_size(sum(size(part) for part in parts), "'~' would make")
    return "".join(part if isinstance(part, str) else str(part) for part in parts)


_LABELS = {id(ticking): "a for loop", id(tilde): "'~'"}


class _Guard(NodeTransformer):
    """Routes each loop, output and `~` of a template through `ticking`, `written` and `tilde`."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        node = self.generic_visit(node)
        node.iter = _call("ticking", node.iter)
        return node

    def visit_Output(self, node: nodes.Output) -> nodes.Node:
        node = self.generic_visit(node)
        node.nodes = [_call("written", child) for child in node.nodes]
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        return _call("tilde", *self.generic_visit(node).nodes)


def _call(name: str, *args: nodes.Expr) -> nodes.Call:
    return nodes.Call(nodes.EnvironmentAttribute(name, lineno=args[0].lineno), list(args), [], None, None,
                      lineno=args[0].lineno)


class _GuardedCodeGenerator(CodeGenerator):
    def visit_Template(self, node: nodes.Template, frame: Any = None) -> None:
        node = _Guard().visit(node)
        node.set_environment(self.environment)
        super().visit_Template(node, frame)


class Sandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox with every call, filter, `+`, `*`, `**` and `%` bounded in size
    and counted against the render's time and work."""

    code_generator_class = _GuardedCodeGenerator
    intercepted_binops = frozenset({"+", "*", "**", "%"})
    ticking, written, tilde = staticmethod(ticking), staticmethod(written), staticmethod(tilde)

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        del self.globals["lipsum"]  # lorem ipsum of any length: no use in a prompt
        self.filters = {name: guarded_filter(name, f) for name, f in self.filters.items()}

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        what = f"{operator!r}"
        _guarded(what, None, left, (right,), {})
        check_size(_binop_estimate(operator, left, right), f"{what} would make")
        result = super().call_binop(context, operator, left, right)
        account(result, what)
        return result

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        if __obj is written:  # each piece of output, the most frequent call: the same checks, made short
            tick()
            check_size(size(args[0]), "the text written holds")
            text = written(args[0])
            account(text, "the text written")
            return text
        owner = getattr(__obj, "__self__", None)
        name = getattr(__obj, "__name__", "")
        what = _LABELS.get(id(__obj)) or f"{name or type(__obj).__name__!r}"
        method = isinstance(owner, (str, bytes, int)) and not isinstance(owner, bool)
        if method and name == "join" and args and isinstance(args[0], Iterator):
            args = (list(args[0]), *args[1:])  # measure a lazy sequence before joining it
        _guarded(what, METHODS.get(name) if method else None, owner if method else None, args, kwargs)
        result = super().call(__context, __obj, *args, **kwargs)
        account(result, what)
        return result

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        wrapper = super().wrap_str_format(value)
        if wrapper is None:
            return None
        template, as_map = value.__self__, value.__name__ == "format_map"

        def checked(*args: Any, **kwargs: Any) -> str:
            fields = (args[0] if as_map and args and isinstance(args[0], dict) else kwargs)
            check_size(_braces(template, () if as_map else args, fields), f"{value.__name__!r} would make")
            return wrapper(*args, **kwargs)

        return functools.update_wrapper(checked, value)


def guarded_filter(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    """`function` (a filter), its input and result bounded like a call's."""
    lead = 1 if getattr(function, "jinja_pass_arg", None) is not None else 0  # context, eval context or environment
    what = f"filter {name!r}"

    @functools.wraps(function)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        head, value, rest = args[:lead], args[lead] if len(args) > lead else None, args[lead + 1:]
        if name in ("join", "sum") and isinstance(value, Iterator):
            value = list(value)  # measure a lazy sequence before joining it
        _guarded(what, FILTERS.get(name), value, rest, kwargs)
        result = function(*head, value, *rest, **kwargs)
        account(result, what)
        return result

    return guarded
