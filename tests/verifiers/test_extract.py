"""Extraction: which answer is found in a completion, and by which rule."""

from __future__ import annotations

import pytest

from selfopd.verifiers import METHODS, Extraction, extract_answer
from selfopd.verifiers.extract import extract_boxed, extract_last_number
from selfopd.verifiers.latex import matching_brace, top_level_commas, unwrap_commands


@pytest.mark.parametrize(
    "text, answer, method",
    [
        # boxed: nesting, last one wins, \fbox, spaces, set braces
        (r"The answer is \boxed{42}.", "42", "boxed"),
        (r"\boxed{\frac{1}{\sqrt{2}}}", r"\frac{1}{\sqrt{2}}", "boxed"),
        (r"First \boxed{3}, then corrected: \boxed{4}", "4", "boxed"),
        (r"\fbox{7} is it", "7", "boxed"),
        (r"\boxed{1} and finally \fbox{2}", "2", "boxed"),
        (r"\boxed {  5 }", "5", "boxed"),
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}", "boxed"),
        (r"\boxed{\left( \frac{a}{b}, c \right)}", r"\left( \frac{a}{b}, c \right)", "boxed"),
        (r"$\boxed{x^{2^{3}}}$", "x^{2^{3}}", "boxed"),
        (r"\boxed{\boxed{9}}", "9", "boxed"),
        (r"\boxed{\text{yes}}", r"\text{yes}", "boxed"),
        # unbalanced / empty boxes are ignored and extraction falls through
        (r"so \boxed{\frac{1}{2}", "2", "last_number"),
        (r"Answer: 12. Then \boxed{3", "12", "answer_line"),
        (r"\boxed{5} then a cut-off \boxed{\frac{1", "5", "boxed"),
        (r"\boxed{} so the answer is 6", "6", "answer_line"),
        (r"\boxed{ } 8", "8", "last_number"),
        (r"\boxed{4} \boxed{}", "4", "boxed"),
        (r"\boxedx{3} 5", "5", "last_number"),
        # boxed beats every other marker
        ("Answer: 3\n\\boxed{4}", "4", "boxed"),
        ("\\boxed{4}\n#### 5", "4", "boxed"),
        # <answer> tags (reasoning-gym format)
        ("<answer>17</answer>", "17", "answer_tag"),
        ("<answer> ainomma </answer>", "ainomma", "answer_tag"),
        ("<answer>1</answer> oops <answer>2</answer>", "2", "answer_tag"),
        ("<answer></answer> 9", "9", "last_number"),
        # answer lines: case-insensitive, last wins, markdown and prose trimmed
        ("Answer: 42", "42", "answer_line"),
        ("answer: 42", "42", "answer_line"),
        ("FINAL ANSWER: -7", "-7", "answer_line"),
        ("Final answer: 3/4\nsome trailing text", "3/4", "answer_line"),
        ("Answer: 1\nWait.\nAnswer: 2", "2", "answer_line"),
        ("**Final Answer:** 12", "12", "answer_line"),
        ("**Answer**: 12", "12", "answer_line"),
        ("So the final answer is 5.", "5", "answer_line"),
        ("The answer is 3.5. It follows from above.", "3.5", "answer_line"),
        ("The answer is $x = 3$.", "$x = 3$", "answer_line"),
        ("Answer: The total is 42 dollars.", "42 dollars", "answer_line"),
        ("Answer: olleh", "olleh", "answer_line"),
        ("Answer:\nFinal answer: 8", "8", "answer_line"),
        ("Answer: 3. Wait, the final answer is 4.", "4", "answer_line"),
        ("The answer is B.", "B", "answer_line"),
        # a worked equation of numbers is its result; an equation with a variable stays whole
        ("The answer is 3 + 4 = 7", "7", "answer_line"),
        ("The answer is 3 + 4 = 7.", "7", "answer_line"),
        ("Answer: 2 * 3 = 5 + 1 = 6", "6", "answer_line"),
        ("Answer: -3 - -4 = 1", "1", "answer_line"),
        (r"\boxed{8 - 1 = 7}", "7", "boxed"),
        (r"\boxed{a = 1, b = 2}", "a = 1, b = 2", "boxed"),
        # "the answer is" followed by prose is not an answer: fall through
        ("Finding the answer is not easy. Still, 6 * 7 = 42", "42", "last_number"),
        ("answer is the same as before", None, None),
        # GSM8K
        ("Janet sells 16 - 3 - 4 = 9 eggs.\n#### 18", "18", "gsm8k"),
        ("#### 1,234", "1,234", "gsm8k"),
        ("#### 5\n#### 6", "6", "gsm8k"),
        ("####   -3", "-3", "gsm8k"),
        # last-number fallback
        ("12 + 7 = 19", "19", "last_number"),
        ("It costs $1,234,567 in total", "1,234,567", "last_number"),
        ("The temperature fell to -5 degrees", "-5", "last_number"),
        ("The temperature fell to \u22125 degrees", "-5", "last_number"),
        ("5-3 leaves 2", "2", "last_number"),
        ("roughly 3.14 or so", "3.14", "last_number"),
        ("about .5 of it", ".5", "last_number"),
        ("pour 3/4 cup", "3/4", "last_number"),
        ("the values 1,2,3", "3", "last_number"),
        ("120 apples and then 12", "12", "last_number"),
        ("it is 3.", "3", "last_number"),
        ("x2 is a name, the value is 10km", "10", "last_number"),
    ],
)
def test_extract_answer(text, answer, method):
    expected = None if answer is None else Extraction(text=answer, method=method)
    assert extract_answer(text) == expected


@pytest.mark.parametrize("text", ["", "no numbers here", r"\boxed{", r"\boxed{}", "Answer:", "####", "<answer> </answer>"])
def test_extract_answer_none(text):
    assert extract_answer(text) is None


def test_methods_restrict_rules():
    text = "12 apples, so Answer: 13"
    assert extract_answer(text, methods=("boxed",)) is None
    assert extract_answer(text, methods=("last_number",)) == Extraction("13", "last_number")
    assert extract_answer(text, methods=("boxed", "answer_line")).method == "answer_line"
    assert set(METHODS) == {"boxed", "answer_tag", "answer_line", "gsm8k", "last_number"}
    with pytest.raises(ValueError, match="unknown extraction methods"):
        extract_answer(text, methods=("regex",))


def test_deeply_unbalanced_text_is_fast_and_safe():
    text = r"\boxed{" * 5000 + "1"
    assert extract_boxed(text) is None
    assert extract_answer(text) == Extraction("1", "last_number")


def test_last_number_ignores_digits_glued_to_words():
    assert extract_last_number("x_1 and y2") is None
    assert extract_last_number("version 3.5.1") == "3.5"


@pytest.mark.parametrize(
    "text, index, expected",
    [("{a{b}c}", 0, 6), ("{a\\}b}", 0, 5), ("{a{b}", 0, None), ("x{}", 1, 2), ("abc", 0, None)],
)
def test_matching_brace(text, index, expected):
    assert matching_brace(text, index) == expected


def test_unwrap_and_commas():
    assert unwrap_commands(r"\text{a \textbf{b}} c", ("text", "textbf")) == "a b c"
    assert unwrap_commands(r"\text{open", ("text",)) == r"\text{open"
    assert top_level_commas(r"(1,2), \{3,4\}, f(5,6)") == 2
    assert top_level_commas("1,2") == 1
