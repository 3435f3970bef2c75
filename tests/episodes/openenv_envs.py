"""Environments written against OpenEnv's own base classes, for the tests of `selfopd.episodes.openenv`,
and a server of them:

    python -m tests.episodes.openenv_envs PORT      (from the repository root)

`Guess` is a number-guessing game: seed s hides Random(s)'s number in 1..50 and the opening observation
names the game. A few seeds misbehave on purpose (HOSTILE), in process and on the server alike.
"""

from __future__ import annotations

import random
import re
import sys
import time
from typing import Any, Optional

from openenv.core.env_server import Action, Environment, Observation, State

RAISES, HUGE, UNDECODABLE, HANGS, NAN_REWARD, WANDERS = 901, 902, 903, 904, 905, 906
HOSTILE = (RAISES, HUGE, UNDECODABLE, HANGS, NAN_REWARD, WANDERS)
HUGE_CHARS = 200_000


class GuessAction(Action):
    guess: str


class GuessObservation(Observation):
    message: str
    game: int = 0


def secret(seed: int) -> int:
    return random.Random(seed).randint(1, 50)


def first_number(text: str) -> int | None:
    found = re.search(r"-?\d+", text)
    return int(found.group()) if found else None


def expected_reward(seed: int, reply: str) -> float:
    """What `Guess` rewards a reply with, computed here apart from it."""
    guess = first_number(reply)
    return -1.0 if guess is None else 1.0 if guess == secret(seed) else -abs(guess - secret(seed)) / 50


class Guess(Environment[GuessAction, GuessObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self.seed, self.number, self._state = 0, 0, State()

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kwargs: Any) -> GuessObservation:
        self.seed = seed or 0
        self.number, self._state = secret(self.seed), State(episode_id=episode_id, step_count=0)
        where = f" ({random.random()})" if self.seed == WANDERS else ""
        return GuessObservation(message=f"Game {self.seed}{where}: guess my number from 1 to 50. Reply with one number.",
                                game=self.seed)

    def step(self, action: GuessAction, timeout_s: Optional[float] = None, **kwargs: Any) -> GuessObservation:
        self._state.step_count += 1
        if self.seed == RAISES:
            raise RuntimeError("the game board caught fire")
        if self.seed == HANGS:
            time.sleep(120)
        if self.seed == HUGE:
            return GuessObservation(message="x" * HUGE_CHARS, game=self.seed)
        if self.seed == UNDECODABLE:
            return GuessObservation(message="bad \udcff bytes \ud800 here", game=self.seed)
        guess = first_number(action.guess)
        reward = expected_reward(self.seed, action.guess)
        if self.seed == NAN_REWARD:
            reward = float("nan")
        text = ("No number found." if guess is None else "Correct!" if guess == self.number
                else "Higher." if guess < self.number else "Lower.")
        return GuessObservation(message=text, game=self.seed, done=guess == self.number, reward=reward,
                                metadata={"turn": self._state.step_count, "guess": guess, "shape": object()})

    @property
    def state(self) -> State:
        return self._state


def make_guess() -> Guess:
    """A factory, as `python:MODULE:NAME` may name one instead of a class."""
    return Guess()


class TwoTextsAction(Action):
    guess: str
    note: str


class TwoTexts(Guess):
    """An action model with two string fields: which one takes the reply cannot be told."""

    def step(self, action: TwoTextsAction, timeout_s: Optional[float] = None, **kwargs: Any) -> GuessObservation:
        return super().step(GuessAction(guess=action.guess))


class TrlGuess:
    """TRL's environment_factory shape: reset(**row), tools as public methods, get_reward()."""

    def __init__(self) -> None:
        self.reward = 0.0

    def reset(self, **row: Any) -> str | None:
        return "Guess a number."

    def guess(self, number: int) -> str:
        """Guess the number.

        Args:
            number: the guess.
        """
        self.reward = float(number == 7)
        return "right" if number == 7 else "wrong"

    def get_reward(self) -> float:
        return self.reward


def serve(port: int) -> None:
    import uvicorn
    from openenv.core.env_server import create_app

    app = create_app(Guess, GuessAction, GuessObservation, max_concurrent_envs=16)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="error")


if __name__ == "__main__":
    serve(int(sys.argv[1]))
