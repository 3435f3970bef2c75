"""`codegen`: a procedural function-writing task. Each item asks for one small Python function (arithmetic,
string and list manipulations) drawn from a grammar of easy specifications, with call tests: N_SHOWN shown
(the first is the prompt's example) and N_HIDDEN hidden (never in feedback), split by the seed.

    codegen?level=1&size=200&seed=0

`level` is the difficulty: 1 one operation (x plus 7, a string reversed), 2 a filter, a map or two
operations (the sum of the elements above 3), 3 a loop with state (running sums, a Caesar shift);
`level=2+3` mixes levels, item i at the (i mod 2)-th (the packaged SmolLM2-135M-Instruct passes about
76%, 58% and 2% of levels 1, 2 and 3 greedily at the start: experiments/code/measure_start.py).
Item i depends only on (level, seed, i), in any process. Each specification is written twice: as the
reference solution's text (Example.answer, shown to nobody but the reader) and as the Python function
that computes the expected values here, in the generator; a test holds them equal. Nothing a model
writes is run here (the sandboxed runner runs programs: selfopd.verifiers.code_runner).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable

from selfopd.data.code_shapes import check_code
from selfopd.data.example import Example, prompt_key
from selfopd.data.spec import DataError, DataSpec

N_SHOWN, N_HIDDEN = 3, 3
MAX_DRAWS_PER_ITEM = 50
WORDS = ("apple", "banana", "cherry", "delta", "echo", "forest", "garden", "harbor", "island", "jungle", "kitten",
         "lemon", "mango", "night", "ocean", "pepper", "quiet", "river", "summer", "tiger", "umbrella", "violet",
         "window", "yellow", "zebra", "level", "noon", "radar", "hello world", "a b c")
INSTRUCTION = "Reply with the whole function in one ```python code block."


@dataclass(frozen=True)
class Spec:
    """One function to write: its name, parameters, what it returns, its reference body, and the same in Python."""

    name: str
    params: str
    does: str  # "returns x plus 7"
    body: str  # the reference's body, indented by four spaces per line
    compute: Callable[..., Any]
    draw_args: Callable[[random.Random], tuple]

    @property
    def reference(self) -> str:
        return f"def {self.name}({self.params}):\n{self.body}\n"


def _int(rng, lo=-50, hi=50):
    return (rng.randint(lo, hi),)


def _word(rng):
    return (rng.choice(WORDS),)


def _word_with(letter: str) -> Callable[[random.Random], tuple]:
    """Words that hold `letter` more often than not, so that its tests tell a right function from a wrong one."""
    holding = [w for w in WORDS if letter in w] or list(WORDS)
    return lambda rng: (rng.choice(holding) if rng.random() < 0.7 else rng.choice(WORDS),)


def _ints(rng, lo=0, hi=6):
    return ([rng.randint(-9, 20) for _ in range(rng.randint(lo, hi))],)


def _num(value: int) -> str:
    """A number as part of a function's name: 7, minus_7."""
    return str(value) if value >= 0 else f"minus_{-value}"


def _one(body: str) -> str:
    return f"    return {body}"


def _level1(rng: random.Random) -> Spec:
    k, m = rng.randint(2, 99), rng.randint(-40, 40)
    d = rng.randint(2, 20)
    w = rng.choice(WORDS[:25])
    n = rng.randint(1, 5)
    options = [
        lambda: Spec(rng.choice([f"add_{k}", f"plus_{k}"]), "x", f"returns x plus {k}", _one(f"x + {k}"),
                     lambda x: x + k, _int),
        lambda: Spec(rng.choice([f"minus_{k}", f"subtract_{k}"]), "x", f"returns x minus {k}", _one(f"x - {k}"),
                     lambda x: x - k, _int),
        lambda: Spec(rng.choice([f"times_{d}", f"multiply_by_{d}"]), "x", f"returns x multiplied by {d}",
                     _one(f"x * {d}"), lambda x: x * d, _int),
        lambda: Spec(rng.choice([f"div_{d}", f"floor_div_{d}"]), "x",
                     f"returns x divided by {d}, rounded down to a whole number", _one(f"x // {d}"), lambda x: x // d,
                     _int),
        lambda: Spec(rng.choice([f"mod_{d}", f"remainder_{d}"]), "x", f"returns the remainder of x divided by {d}",
                     _one(f"x % {d}"), lambda x: x % d, lambda r: _int(r, 0, 200)),
        lambda: Spec(rng.choice([f"above_{_num(m)}", f"is_above_{_num(m)}"]), "x",
                     f"returns True if x is greater than {m}, else False", _one(f"x > {m}"), lambda x: x > m,
                     lambda r: _int(r, m - 10, m + 10)),
        lambda: Spec(rng.choice([f"below_{_num(m)}", f"is_below_{_num(m)}"]), "x",
                     f"returns True if x is less than {m}, else False", _one(f"x < {m}"), lambda x: x < m,
                     lambda r: _int(r, m - 10, m + 10)),
        lambda: Spec(rng.choice(["square", "squared"]), "x", "returns x squared", _one("x * x"), lambda x: x * x, _int),
        lambda: Spec(rng.choice(["reverse", "reversed_text", "backwards"]), "s", "returns the string s reversed",
                     _one("s[::-1]"), lambda s: s[::-1], _word),
        lambda: Spec(rng.choice(["shout", "to_upper", "upper_case"]), "s", "returns the string s in upper case",
                     _one("s.upper()"), lambda s: s.upper(), _word),
        lambda: Spec(rng.choice([f"add_suffix_{w}", f"append_{w}"]), "s", f"returns s followed by '{w}'",
                     _one(f"s + {w!r}"), lambda s: s + w, _word),
        lambda: Spec(rng.choice([f"add_prefix_{w}", f"prepend_{w}"]), "s", f"returns '{w}' followed by s",
                     _one(f"{w!r} + s"), lambda s: w + s, _word),
        lambda: Spec(rng.choice([f"first_{n}", f"head_{n}"]), "s", f"returns the first {n} characters of s",
                     _one(f"s[:{n}]"), lambda s: s[:n], _word),
        lambda: Spec(rng.choice([f"last_{n}", f"tail_{n}"]), "s", f"returns the last {n} characters of s",
                     _one(f"s[-{n}:]"), lambda s: s[-n:], _word),
        lambda: Spec(rng.choice([f"repeat_{n + 1}", f"copies_{n + 1}"]), "s",
                     f"returns the string s repeated {n + 1} times", _one(f"s * {n + 1}"), lambda s: s * (n + 1), _word),
        lambda: Spec(rng.choice([f"append_{_num(m)}", f"with_{_num(m)}"]), "xs",
                     f"returns a new list: the list xs with {m} added at the end", _one(f"xs + [{m}]"),
                     lambda xs: xs + [m], _ints),
        lambda: Spec(rng.choice(["total", "list_sum", "add_all"]), "xs", "returns the sum of the numbers in the list xs",
                     _one("sum(xs)"), lambda xs: sum(xs), _ints),
        lambda: Spec(rng.choice(["largest", "biggest", "list_max"]), "xs",
                     "returns the largest number in the non-empty list xs", _one("max(xs)"), lambda xs: max(xs),
                     lambda r: _ints(r, 1)),
        lambda: Spec(rng.choice(["smallest", "list_min"]), "xs", "returns the smallest number in the non-empty list xs",
                     _one("min(xs)"), lambda xs: min(xs), lambda r: _ints(r, 1)),
        lambda: Spec(rng.choice(["count_items", "size", "how_many"]), "xs", "returns the number of items in the list xs",
                     _one("len(xs)"), lambda xs: len(xs), _ints),
        lambda: Spec(rng.choice(["is_even", "even"]), "x", "returns True if the integer x is even, else False",
                     _one("x % 2 == 0"), lambda x: x % 2 == 0, _int),
    ]
    return rng.choice(options)()


def _level2(rng: random.Random) -> Spec:
    a, b = rng.randint(2, 9), rng.randint(1, 20)
    k = rng.randint(0, 10)
    c, d = rng.sample("aeiourstln", 2)
    w = rng.choice(WORDS[:25])[:2]
    options = [
        lambda: Spec(f"line_{a}_{b}", "x", f"returns {a} times x plus {b}", _one(f"{a} * x + {b}"),
                     lambda x: a * x + b, _int),
        lambda: Spec(rng.choice([f"sum_above_{k}", f"total_over_{k}"]), "xs",
                     f"returns the sum of the numbers in the list xs that are greater than {k}",
                     _one(f"sum(x for x in xs if x > {k})"), lambda xs: sum(x for x in xs if x > k), _ints),
        lambda: Spec(rng.choice([f"count_above_{k}", f"how_many_over_{k}"]), "xs",
                     f"returns how many numbers in the list xs are greater than {k}",
                     _one(f"sum(1 for x in xs if x > {k})"), lambda xs: sum(1 for x in xs if x > k), _ints),
        lambda: Spec(rng.choice([f"scale_{a}", f"multiply_all_{a}"]), "xs",
                     f"returns a new list with every number of the list xs multiplied by {a}",
                     _one(f"[x * {a} for x in xs]"), lambda xs: [x * a for x in xs], _ints),
        lambda: Spec(rng.choice([f"shift_all_{b}", f"add_to_all_{b}"]), "xs",
                     f"returns a new list with {b} added to every number of the list xs",
                     _one(f"[x + {b} for x in xs]"), lambda xs: [x + b for x in xs], _ints),
        lambda: Spec(rng.choice(["evens", "keep_even"]), "xs", "returns the even numbers of the list xs, in order",
                     _one("[x for x in xs if x % 2 == 0]"), lambda xs: [x for x in xs if x % 2 == 0], _ints),
        lambda: Spec(rng.choice(["odds", "keep_odd"]), "xs", "returns the odd numbers of the list xs, in order",
                     _one("[x for x in xs if x % 2 == 1]"), lambda xs: [x for x in xs if x % 2 == 1], _ints),
        lambda: Spec(rng.choice([f"replace_{c}_{d}", f"swap_{c}_for_{d}"]), "s",
                     f"returns s with every '{c}' replaced by '{d}'", _one(f"s.replace({c!r}, {d!r})"),
                     lambda s: s.replace(c, d), _word_with(c)),
        lambda: Spec(rng.choice([f"count_{c}", f"number_of_{c}"]), "s",
                     f"returns how many times the letter '{c}' appears in s", _one(f"s.count({c!r})"),
                     lambda s: s.count(c), _word_with(c)),
        lambda: Spec(rng.choice([f"starts_with_{w}", f"begins_{w}"]), "s",
                     f"returns True if s starts with '{w}', else False", _one(f"s.startswith({w!r})"),
                     lambda s: s.startswith(w), lambda r: (w * (r.random() < 0.5) + r.choice(WORDS),)),
        lambda: Spec(f"clip_{k}_{k + b}", "x", f"returns x limited to the range {k} to {k + b}: {k} if x is "
                     f"smaller, {k + b} if x is larger, else x", _one(f"min(max(x, {k}), {k + b})"),
                     lambda x: min(max(x, k), k + b), lambda r: _int(r, k - 10, k + b + 10)),
        lambda: Spec(rng.choice(["sum_of_squares", "squares_total"]), "xs",
                     "returns the sum of the squares of the numbers in the list xs", _one("sum(x * x for x in xs)"),
                     lambda xs: sum(x * x for x in xs), _ints),
    ]
    return rng.choice(options)()


def _running(xs, pick=None):
    out = []
    for x in xs:
        out.append(x if not out else (out[-1] + x if pick is None else pick(out[-1], x)))
    return out


def _level3(rng: random.Random) -> Spec:
    k, step = rng.randint(1, 25), rng.randint(2, 4)
    start = rng.randint(0, step - 1)
    (a, b), words = rng.sample(range(2, 10), 2), rng.choice([("Fizz", "Buzz"), ("Foo", "Bar"), ("Ping", "Pong")])
    c = rng.choice("abcdeghilmnoprstuy")
    loop = "    out = []\n    for x in xs:\n        out.append(x if not out else {})\n    return out"
    options = [
        lambda: Spec(rng.choice(["running_sums", "prefix_sums"]), "xs",
                     "returns the list of running totals of xs (the i-th is the sum of the first i + 1 numbers)",
                     loop.format("out[-1] + x"), _running, _ints),
        lambda: Spec(rng.choice(["running_max", "max_so_far"]), "xs",
                     "returns the list whose i-th number is the largest of the first i + 1 numbers of xs",
                     loop.format("max(out[-1], x)"), lambda xs: _running(xs, max), _ints),
        lambda: Spec(rng.choice(["dedupe", "unique_in_order"]), "xs",
                     "returns the numbers of xs without repeats, each at its first position",
                     _one("list(dict.fromkeys(xs))"), lambda xs: list(dict.fromkeys(xs)),
                     lambda r: ([r.randint(0, 4) for _ in range(r.randint(0, 8))],)),
        lambda: Spec(f"every_{step}th_from_{start}", "xs", f"returns every {step}th element of xs, starting at "
                     f"index {start}", _one(f"xs[{start}::{step}]"), lambda xs: xs[start::step],
                     lambda r: _ints(r, 0, 9)),
        lambda: Spec(f"shift_{k}", "s", f"returns s with each lowercase letter moved {k} places forward in the "
                     "alphabet (wrapping from z to a); other characters stay",
                     _one(f"''.join(chr((ord(ch) - 97 + {k}) % 26 + 97) if 'a' <= ch <= 'z' else ch for ch in s)"),
                     lambda s: "".join(chr((ord(ch) - 97 + k) % 26 + 97) if "a" <= ch <= "z" else ch for ch in s),
                     _word),
        lambda: Spec(f"unshift_{k}", "s", f"returns s with each lowercase letter moved {k} places back in the "
                     "alphabet (wrapping from a to z); other characters stay",
                     _one(f"''.join(chr((ord(ch) - 97 - {k}) % 26 + 97) if 'a' <= ch <= 'z' else ch for ch in s)"),
                     lambda s: "".join(chr((ord(ch) - 97 - k) % 26 + 97) if "a" <= ch <= "z" else ch for ch in s),
                     _word),
        lambda: Spec(rng.choice(["digit_sum", "sum_digits"]), "x", "returns the sum of the decimal digits of the "
                     "non-negative integer x", _one("sum(int(d) for d in str(x))"),
                     lambda x: sum(int(d) for d in str(x)), lambda r: _int(r, 0, 99999)),
        lambda: Spec(rng.choice(["drop_vowels", "no_vowels"]), "s", "returns s with the vowels a, e, i, o, u removed",
                     _one("''.join(ch for ch in s if ch not in 'aeiou')"),
                     lambda s: "".join(ch for ch in s if ch not in "aeiou"), _word),
        lambda: Spec(f"find_{c}", "s", f"returns the index of the first '{c}' in s, or -1 if s has none",
                     "    for i, ch in enumerate(s):\n" f"        if ch == {c!r}:\n" "            return i\n    return -1",
                     lambda s: s.find(c), _word_with(c)),
        lambda: Spec(f"first_above_{k % 16}", "xs", f"returns the index of the first number in xs greater than {k % 16}, "
                     "or -1 if there is none",
                     "    for i, x in enumerate(xs):\n" f"        if x > {k % 16}:\n" "            return i\n    return -1",
                     lambda xs: next((i for i, x in enumerate(xs) if x > k % 16), -1), _ints),
        lambda: Spec(f"{words[0].lower()}_{a}_{words[1].lower()}_{b}", "x",
                     f"returns '{words[0]}{words[1]}' if x is divisible by both {a} and {b}, '{words[0]}' if only by "
                     f"{a}, '{words[1]}' if only by {b}, else x as a string",
                     f"    if x % {a} == 0 and x % {b} == 0:\n        return {words[0] + words[1]!r}\n"
                     f"    if x % {a} == 0:\n        return {words[0]!r}\n    if x % {b} == 0:\n        return {words[1]!r}\n"
                     "    return str(x)",
                     lambda x: words[0] + words[1] if x % a == 0 and x % b == 0 else words[0] if x % a == 0
                     else words[1] if x % b == 0 else str(x), lambda r: _int(r, 1, 100)),
        lambda: Spec(rng.choice(["is_palindrome", "reads_same_backwards"]), "s",
                     "returns True if s reads the same backwards, else False", _one("s == s[::-1]"),
                     lambda s: s == s[::-1], lambda r: (r.choice(["level", "noon", "radar", "abba", "x"])
                                                        if r.random() < 0.5 else r.choice(WORDS),)),
        lambda: Spec(rng.choice(["product", "multiply_all"]), "xs", "returns the product of the numbers in xs (1 for "
                     "an empty list)", "    out = 1\n    for x in xs:\n        out *= x\n    return out",
                     lambda xs: _product(xs), lambda r: ([r.randint(-5, 9) for _ in range(r.randint(0, 5))],)),
        lambda: Spec(rng.choice(["running_min", "min_so_far"]), "xs",
                     "returns the list whose i-th number is the smallest of the first i + 1 numbers of xs",
                     loop.format("min(out[-1], x)"), lambda xs: _running(xs, min), _ints),
        lambda: Spec(f"rotate_left_{step - 1}", "xs", f"returns xs rotated left by {step - 1} places (the first "
                     f"{step - 1} numbers move to the end, one place at a time; an empty list stays empty)",
                     f"    for _ in range({step - 1}):\n        xs = xs[1:] + xs[:1]\n    return xs",
                     lambda xs: _rotated(xs, step - 1), _ints),
        lambda: Spec(f"repeat_each_{step}", "xs", f"returns a new list with every number of xs repeated {step} times "
                     "in a row", _one(f"[x for x in xs for _ in range({step})]"),
                     lambda xs: [x for x in xs for _ in range(step)], lambda r: _ints(r, 0, 4)),
        lambda: Spec(f"sum_every_{step}th_from_{start}", "xs", f"returns the sum of every {step}th element of xs, "
                     f"starting at index {start}", _one(f"sum(xs[{start}::{step}])"), lambda xs: sum(xs[start::step]),
                     lambda r: _ints(r, 0, 9)),
        lambda: Spec(rng.choice(["differences", "steps_between"]), "xs", "returns the list of differences between "
                     "neighbours of xs (each number minus the one before it)",
                     _one("[b - a for a, b in zip(xs, xs[1:])]"), lambda xs: [y - x for x, y in zip(xs, xs[1:])],
                     _ints),
    ]
    return rng.choice(options)()


def _rotated(xs, n):
    for _ in range(n):
        xs = xs[1:] + xs[:1]
    return xs


def _product(xs):
    out = 1
    for x in xs:
        out *= x
    return out


LEVELS = {1: _level1, 2: _level2, 3: _level3}


def make_item(level: int, seed: int, i: int) -> tuple[Spec, dict, str]:
    """Item i of (level, seed): its specification, its tests (meta["code"]) and its prompt."""
    rng = random.Random(f"selfopd-codegen/{level}/{seed}/{i}")
    spec = LEVELS[level](rng)
    tests: dict[str, dict] = {}
    for _ in range(MAX_DRAWS_PER_ITEM):
        if len(tests) == N_SHOWN + N_HIDDEN:
            break
        args = spec.draw_args(rng)
        call = f"{spec.name}({', '.join(map(repr, args))})"
        tests.setdefault(call, {"call": call, "expected": repr(spec.compute(*args))})
    tests_in_order = list(tests.values())
    rng.shuffle(tests_in_order)
    code = {"entry_point": spec.name, "tests": tests_in_order[:N_SHOWN], "hidden": tests_in_order[N_SHOWN:]}
    first = code["tests"][0]
    prompt = (f"Write a Python function `{spec.name}({spec.params})` that {spec.does}.\n"
              f"For example, `{first['call']}` returns `{first['expected']}`.\n{INSTRUCTION}")
    return spec, code, prompt


def load_codegen(spec: DataSpec, exclude: frozenset[str] = frozenset()) -> list[Example]:
    """`spec.size` items (distinct functions unless distinct=false; none whose prompt key is in `exclude`)."""
    examples, seen = [], set()
    draws = MAX_DRAWS_PER_ITEM * (spec.size + len(exclude)) if spec.dedup else spec.size + len(exclude)
    for i in range(draws):
        if len(examples) == spec.size:
            break
        level = spec.levels[i % len(spec.levels)]
        function, code, prompt = make_item(level, spec.seed, i)
        key = function.does  # two names for one function are one task
        if (spec.dedup and key in seen) or prompt_key(prompt) in exclude:
            continue
        seen.add(key)
        where = f"{spec.label} row {i}"
        if len(code["tests"]) + len(code["hidden"]) < N_SHOWN + N_HIDDEN:
            raise DataError(f"{where}: {function.name} drew fewer than {N_SHOWN + N_HIDDEN} distinct tests")
        examples.append(Example(
            id=f"codegen/level{spec.level}/seed{spec.seed}/{i}", prompt=prompt, answer=function.reference,
            meta={"source": spec.label, "row": i, "code": check_code(code, where),
                  "codegen": {"level": level, "seed": spec.seed, "function": function.name}}))
    if len(examples) < spec.size:
        raise DataError(f"{spec.label}: asked for {spec.size} distinct functions at level {spec.level}, but "
                        f"{i + 1} draws gave only {len(examples)}: about all the level holds. Ask for fewer "
                        f"(size={len(examples)}) or allow repeats with distinct=false")
    return examples
