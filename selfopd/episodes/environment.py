"""What an environment answers a student's turn, and the environments selfopd ships.

The loop (`selfopd.episodes.sampling`) speaks to an environment through two calls, the shape of
OpenEnv's `reset`/`step` and of TRL's environment classes: `reset(example)` once per episode, then
`step(reply, finish_reason)` after each student turn, answered with a `Response` (the messages the
student reads next, done, a reward, metadata). Whatever an environment returns is untrusted text:
`checked_response` bounds it (size, UTF-8, roles) and turns a malformed answer into one line, the
episode ending there with nothing already sampled lost.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol, Sequence

from selfopd.data.example import Example
from selfopd.verifiers import VerifyResult

Message = Mapping[str, Any]
MAX_MESSAGE_CHARS = 4000  # an environment's message past this is cut, and says so
MESSAGE_ROLES = ("user", "tool", "system")  # an environment never speaks as the assistant


@dataclass(frozen=True)
class Response:
    """An environment's answer to one student turn."""

    messages: Sequence[Message] = ()
    done: bool = False
    reward: float | None = None
    info: Mapping[str, Any] = field(default_factory=dict)


class Environment(Protocol):
    """One episode's environment (a new one per episode: `make_environment(example)`)."""

    def reset(self, example: Example) -> None: ...

    def step(self, reply: str, finish_reason: str) -> Response: ...


class BadEnvironmentAnswer(ValueError):
    """An environment's answer that cannot be used: one line saying which part and why."""


def checked_response(response: Any, where: str) -> Response:
    """`response` as a `Response` whose messages are bounded UTF-8 text in an environment's roles;
    anything else raises `BadEnvironmentAnswer` naming `where` (the environment and the episode)."""
    if not isinstance(response, Response):
        raise BadEnvironmentAnswer(f"{where}: step returned {type(response).__name__}, not a Response")
    messages = []
    for index, message in enumerate(response.messages):
        if not isinstance(message, Mapping) or message.get("role") not in MESSAGE_ROLES:
            role = message.get("role") if isinstance(message, Mapping) else type(message).__name__
            raise BadEnvironmentAnswer(f"{where}: message {index} has role {str(role)[:40]!r}; an environment "
                                    f"speaks as one of {', '.join(MESSAGE_ROLES)}")
        messages.append({**message, "content": bounded_text(message.get("content", ""))})
    reward = response.reward
    if reward is not None and not (isinstance(reward, (int, float)) and reward == reward and abs(reward) < float("inf")):
        raise BadEnvironmentAnswer(f"{where}: reward {str(reward)[:40]!r} is not a finite number")
    return Response(messages, bool(response.done), None if reward is None else float(reward), dict(response.info))


def bounded_text(content: Any) -> str:
    """An environment's message content as text: bytes decoded (undecodable bytes replaced), cut at
    `MAX_MESSAGE_CHARS` with a note of how much was cut, what UTF-8 cannot hold (a lone surrogate,
    which no tokenizer takes) replaced."""
    if isinstance(content, bytes):
        content = content.decode("utf-8", errors="replace")
    text = str(content)
    if len(text) > MAX_MESSAGE_CHARS:
        text = f"{text[:MAX_MESSAGE_CHARS]}\n[... {len(text) - MAX_MESSAGE_CHARS:,} more characters cut]"
    return text.encode("utf-8", errors="replace").decode("utf-8")


class RetryWithFeedback:
    """A task's verifier as an environment: a wrong answer gets the verifier's one-sentence feedback
    (which quotes the student's answer, never the reference) and another try, up to `attempts`
    student turns; the episode's reward is the last answer's."""

    def __init__(self, grade: Callable[[str, Example, str], VerifyResult], attempts: int = 2,
                 retry_text: str = "{feedback} Please try again.") -> None:
        self.grade, self.attempts, self.retry_text = grade, attempts, retry_text
        self.example: Example | None = None
        self.turns = 0

    def reset(self, example: Example) -> None:
        self.example, self.turns = example, 0

    def step(self, reply: str, finish_reason: str) -> Response:
        assert self.example is not None, "reset before step"
        self.turns += 1
        verdict = self.grade(reply, self.example, finish_reason)
        info = {"correct": verdict.correct, "attempt": self.turns, "feedback": verdict.feedback}
        if verdict.correct or self.turns >= self.attempts:
            return Response((), True, verdict.reward, info)
        message = {"role": "user", "content": self.retry_text.format(feedback=verdict.feedback)}
        return Response((message,), False, verdict.reward, info)
