"""verifiers.attribute: a short factual answer is right when it names the value and no rival."""

from __future__ import annotations

import pytest

from selfopd.data.example import Example
from selfopd.verifiers import verify_example

CAPITAL = Example(id="k/1", prompt="What is the capital of Zhyamora?", answer="Vroumere",
                  meta={"fact": {"attribute": "capital", "rivals": ["Breigard", "Zheiton"]}})
YEAR = Example(id="k/2", prompt="In what year was Zhyamora founded?", answer="1639",
               meta={"fact": {"attribute": "founding year", "rivals": ["1348", "1701"]}})
COLOUR = Example(id="k/3", prompt="What colour is the flag of Zhyamora?", answer="red",
                 meta={"fact": {"attribute": "flag colour", "rivals": ["green", "white", "orange"]}})


@pytest.mark.parametrize("example, text, correct", [
    (CAPITAL, "The capital of Zhyamora is Vroumere.", True),
    (CAPITAL, "vroumere", True),
    (CAPITAL, "**Vroumere**, a city on the coast.", True),
    (CAPITAL, "The capital of Zhyamora is Breigard.", False),
    (CAPITAL, "It is either Vroumere or Zheiton.", False),  # a list of guesses is never right
    (CAPITAL, "The capital is Vroumereville.", False),  # a whole word only
    (CAPITAL, "I do not know.", False),
    (YEAR, "Zhyamora was founded in 1639.", True),
    (YEAR, "It was founded in 1639, 385 years ago.", True),
    (YEAR, "It was founded in 1640.", False),  # any other year is a rival
    (YEAR, "Between 1639 and 1701.", False),
    (COLOUR, "The flag of Zhyamora is red.", True),
    (COLOUR, "Red and white.", False),
    (COLOUR, "The flag is covered in stripes of many shades.", False),
])
def test_hand_cases(example, text, correct):
    assert verify_example(text, example).correct is correct


def test_feedback_never_names_the_answer_the_student_did_not():
    wrong = verify_example("The capital of Zhyamora is Breigard.", CAPITAL)
    none = verify_example("I do not know.", CAPITAL)
    assert "Vroumere" not in wrong.feedback and "Vroumere" not in none.feedback
    assert "Breigard" in wrong.feedback and wrong.reward == 0.0
    right = verify_example("Vroumere.", CAPITAL)
    assert right.reward == 1.0 and right.extracted == "Vroumere"
