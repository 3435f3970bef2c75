"""Answer equivalence: what must match, and the tricky near-misses that must not."""

from __future__ import annotations

import pytest

import selfopd.verifiers.equivalence as equivalence
from selfopd.verifiers import Verdict, answers_equivalent, compare_answers

EQUIVALENT = [
    # integers, decimals, signs, separators
    ("42", "42"),
    ("42.0", "42"),
    ("042", "42"),
    ("+5", "5"),
    ("-0", "0"),
    ("- 3", "-3"),
    ("\u22123", "-3"),
    ("1,234", "1234"),
    ("1234", "1,234"),
    (r"\$1,234.50", "1234.5"),
    ("1e3", "1000"),
    # fractions vs decimals vs LaTeX
    ("3/4", "0.75"),
    (r"\frac{3}{4}", "0.75"),
    (r"\dfrac{3}{4}", "3/4"),
    (r"\frac34", "3/4"),
    ("-1/2", r"-\frac{1}{2}"),
    (r"\frac{-1}{2}", "-0.5"),
    ("1/3", "0.333333"),  # math-verify rounds to 6 places
    (r"\frac{6}{8}", "3/4"),
    # percentages (both readings of a percent; see numeric.py)
    (r"50\%", "50"),
    ("50%", r"50\%"),
    ("50%", "50"),
    ("50%", "0.5"),
    ("0.5", r"50\%"),
    # units, degrees, text wrappers, markdown
    ("5 apples", "5"),
    (r"5\text{ cm}", "5"),
    (r"90^\circ", "90"),
    ("90\u00b0", "90"),
    ("**18**", "18"),
    (r"\text{(B)}", "B"),
    ("(b)", "B"),
    ("Yes", "yes"),
    (r"\text{ainomma}", "ainomma"),
    # assignments
    ("x = 3", "3"),
    ("3", "x=3"),
    ("y = 2x+1", "2x+1"),
    # roots and expressions (math-verify, in the worker)
    (r"\frac{1}{\sqrt{2}}", r"\frac{\sqrt{2}}{2}"),
    (r"\sqrt{8}", r"2\sqrt{2}"),
    (r"\sqrt{4}", "2"),
    ("sqrt(2)", r"\sqrt{2}"),
    ("x^2+2x+1", "(x+1)^2"),
    (r"2\pi", r"\pi \cdot 2"),
    (r"3 \times 10^{2}", "300"),
    ("2+3i", "3i+2"),
    (r"\infty", r"\infty"),
    # tuples, intervals, sets, lists
    ("(1,2)", "(1, 2)"),
    (r"\left(1,2\right)", "(1,2)"),
    ("1, 2", "(1,2)"),  # a bare list takes the reference's tuple brackets
    (r"\{1,2\}", r"\{2,1\}"),
    ("3, 4", r"\{4, 3\}"),
    ("[0, 1]", "[0,1]"),
    ("(1,2,3)", "(1,2,3)"),
    (r"\pm 2", "2, -2"),
    # references written as whole solutions
    (r"\frac{1}{2}", r"\boxed{\frac{1}{2}}"),
    ("7", "$7$"),
]

DIFFERENT = [
    ("12", "120"),
    ("120", "12"),
    ("1", "-1"),
    ("-1", "1"),
    ("3", "3.5"),
    ("3.5", "3"),
    ("2", "2.000001"),
    ("0.5", "50"),  # without a percent sign these are different numbers
    ("1,234", "1.234"),
    ("1,2", "12"),
    ("3/4", "4/3"),
    (r"\frac{3}{4}", "0.7"),
    ("1/3", "0.33"),
    ("1/3", "0.3333"),
    ("(1,2)", "(2,1)"),
    ("(1,2,3)", "(3,2,1)"),
    ("2, 1", "(1,2)"),  # the order of a tuple reference counts even for a bare list
    ("1, 2", "[1,2)"),  # a bare list does not say which ends are closed
    ("(1,2)", r"\{1,2\}"),  # math-verify alone says equal
    (r"\{1,2\}", "(1,2)"),
    ("[1,2]", "(1,2)"),
    ("(0,1]", "(0,1)"),
    (r"\sqrt{2}", "1.414"),
    (r"\pi", "3.14159"),
    ("x^2", "y^2"),
    ("x = 3", "x = 4"),
    ("olleh", "hello"),  # anagrams: math-verify reads words as products of letters
    ("ab", "ba"),
    ("A", "B"),
    ("Yes", "No"),
    ("five", "5"),
    ("", "5"),
    ("5", ""),
    (r"\frac{1}{\sqrt{3}}", r"\frac{\sqrt{2}}{2}"),
    ("2x+1", "2x-1"),
]


@pytest.mark.parametrize("predicted, reference", EQUIVALENT)
def test_equivalent(predicted, reference):
    assert answers_equivalent(predicted, reference)


@pytest.mark.parametrize("predicted, reference", DIFFERENT)
def test_different(predicted, reference):
    assert not answers_equivalent(predicted, reference)
    assert compare_answers(predicted, reference) is Verdict.DIFFERENT


@pytest.mark.parametrize(
    "predicted, reference",
    [("42", "42.0"), ("-7", "7"), ("1,234", "1234"), ("50%", "0.5"), ("x = 3", "3"), ("3/4", "0.75"),
     ("olleh", "hello"), ("5 apples", "5"), ("12", "120")],
)
def test_plain_answers_never_start_a_worker(monkeypatch, predicted, reference):
    def no_worker(*args, **kwargs):
        raise AssertionError("a plain answer reached the worker")

    monkeypatch.setattr(equivalence, "run_in_worker", no_worker)
    compare_answers(predicted, reference)


def test_pathological_answers_are_unchecked_without_a_worker(monkeypatch):
    monkeypatch.setattr(equivalence, "run_in_worker", lambda *a, **k: pytest.fail("worker was called"))
    for answer in ["10^{10^{10}}", "9^{9^{9^{9}}}", "100000!", "(10^{5})!"]:
        assert compare_answers(answer, "5") is Verdict.UNCHECKED
        assert not answers_equivalent(answer, "5")


# Model text that math-verify's plain-expression reader would hand to sympy's parse_expr (which
# evaluates Python); each carries the marker 918273645 so a compile of model text shows.
MARKED = ["918273645 + 1", "$918273645^{2}$", r"\frac{918273645}{7}", "2*918273645-1",
          "__import__('os').system('echo 918273645')", "x_{918273645}", r"\operatorname{zq918273645}(x)",
          r"\text{918273645}", "9182^{73645}", "f(918273645)=2", r"\{918273645, 1\}", "(918273645, 2]"]
AUDIT = """
import json, sys
from selfopd.verifiers.equivalence import math_verify_equivalent
compiled = []
sys.addaudithook(lambda event, args: compiled.append(str(args[0])) if event in ("compile", "exec") else None)
verdicts = [math_verify_equivalent(text, "918273645") for text in json.loads(sys.argv[1])]
print(json.dumps({"verdicts": verdicts, "compiled": [c for c in compiled if "918273645" in c]}))
"""


def test_math_verify_never_compiles_model_text():
    """math-verify is asked for its LaTeX reader only: no answer text reaches Python's compiler
    (an audit hook sees every compile and exec of the check, in a process of its own)."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", AUDIT, json.dumps(MARKED)], capture_output=True, text=True,
                         check=True, timeout=120).stdout
    report = json.loads(out.splitlines()[-1])
    assert report["compiled"] == []
    assert report["verdicts"][:2] == [False, False] and len(report["verdicts"]) == len(MARKED)


ABSENT = """
import json, sys
import reasoning_gym
from selfopd.verifiers import compare_answers, verify_reasoning_gym
entry = reasoning_gym.create_dataset("chain_sum", seed=0, size=1)[0]
print(json.dumps({"latex": [compare_answers(a, b).value for a, b in [(r"\\sqrt{2}", r"2^{1/2}"), ("x^2", "x^{2}+0")]],
                  "numbers": compare_answers(r"\\frac{1}{2}", "0.5").value,
                  "reasoning_gym": verify_reasoning_gym("Answer: " + entry["answer"], "chain_sum", entry).correct}))
"""


def test_a_missing_math_verify_is_one_warning_and_unchecked_answers(tmp_path):
    """Without math-verify (absent in the caller and in its verifier workers: a sitecustomize on the
    path they share makes its import fail), LaTeX answers are unchecked with one warning line, no
    worker dies, plain numbers are still compared and reasoning-gym still scores."""
    import json
    import os
    import subprocess
    import sys

    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['math_verify'] = None\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", ABSENT], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.splitlines()[-1]) == {"latex": ["unchecked", "unchecked"], "numbers": "equivalent",
                                                        "reasoning_gym": True}
    warnings = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(warnings) == 1 and warnings[0].startswith("math_verify is not installed: "), done.stderr[-2000:]
