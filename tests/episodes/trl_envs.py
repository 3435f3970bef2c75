"""TRL `environment_factory` classes written to TRL's documented contract (reset(**row), tools as public
methods with docstrings, an optional get_reward), for tests/episodes/test_trl_environment.py."""

from __future__ import annotations

from typing import Any


class FindNumber:
    """The number is the row's answer; `guess` says higher, lower or right; a win pays 1."""

    def __init__(self) -> None:
        self.number, self.won, self.rows = 0, False, []

    def reset(self, **row: Any) -> None:
        self.rows.append(row)
        self.number, self.won = int(row["answer"]), False

    def guess(self, number: int) -> str:
        """Guess the hidden number.

        Args:
            number: The guess.
        """
        self.won = self.won or number == self.number
        return "right" if number == self.number else "higher" if number < self.number else "lower"

    def get_reward(self) -> float:
        return 1.0 if self.won else 0.0

    @property
    def board(self) -> str:  # a property is not a tool, and is never evaluated to find the tools
        raise AssertionError("a property was evaluated")

    def _secret(self) -> int:
        return self.number


class NoReward(FindNumber):
    """The same tool, no get_reward: the verifier grades the last answer."""

    get_reward = None  # type: ignore[assignment]


class Talkative(FindNumber):
    """reset returns an observation, which TRL appends to the prompt."""

    def reset(self, **row: Any) -> str:
        super().reset(**row)
        return "You have three guesses."


class BrokenReset(FindNumber):
    def reset(self, **row: Any) -> None:
        raise KeyError("no such column")


class NanReward(FindNumber):
    def get_reward(self) -> float:
        return float("nan")


class Undefined:
    """A tool without a docstring: TRL cannot define it either."""

    def reset(self, **row: Any) -> None:
        pass

    def poke(self, where: str) -> str:
        return where
