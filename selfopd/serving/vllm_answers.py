"""What a vLLM server answers, read into selfopd's types: a sampling answer's rollouts, a scoring
answer's prompt logprobs, and the length checks made before a request is sent. Anything that is not
what vLLM sends (a missing field, fewer or more logprobs than tokens, NaN) becomes a `ServerError`
naming where it came from: never a silently shorter tensor. The in-process colocated engine reads
its own outputs with the same functions.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Sequence

import torch

from selfopd.engines.base import Rollout, TokenScores
from selfopd.serving.server import ServerError

CLAMPED_LOGPROB = -9999.0  # vLLM's JSON stand-in for -inf


def malformed(url: str, error: Exception) -> ServerError:
    """The error for an answer that is not the JSON a vLLM server sends."""
    return ServerError(f"{url}: malformed answer from the server ({type(error).__name__}: "
                       f"{' '.join(str(error).split())[:300]})")


def check_sample_lengths(prompts: Sequence[list[int]], max_tokens: int, max_model_len: int,
                         where: Callable[[int], str]) -> None:
    """Refuse, before sending, a prompt that cannot take `max_tokens` more tokens;
    `where(index)` names the server (or instance) it would go to."""
    for index, prompt in enumerate(prompts):
        if len(prompt) + max_tokens > max_model_len:
            raise ServerError(f"{where(index)}: prompt {index} has {len(prompt)} tokens; with max_tokens={max_tokens} "
                              f"it exceeds the server's max_model_len {max_model_len}")


def check_score_lengths(sequences: Sequence[tuple[list[int], list[int]]], max_model_len: int,
                        where: Callable[[int], str]) -> None:
    """Refuse, before sending, a sequence too long to score (scoring generates one token more)."""
    for index, (prompt, completion) in enumerate(sequences):
        if len(prompt) + len(completion) + 1 > max_model_len:
            raise ServerError(
                f"{where(index)}: sequence {index} has {len(prompt)} prompt + {len(completion)} completion tokens; "
                f"scoring needs max_model_len >= prompt + completion + 1, the server has {max_model_len}")


def parse_prompt_logprobs(entries: Sequence[Mapping[str, Any] | None] | None, ids: Sequence[int], start: int,
                          top_k: int, url: str = "") -> TokenScores:
    """vLLM's prompt_logprobs (one dict per prompt position, keyed by token-id strings,
    holding the top k and the actual token) -> logprobs of ids[start:], and the top k.

    vLLM writes -inf as -9999. A top-k alternative at -9999 becomes -inf; the actual token
    at -9999 means the server gives it probability 0 (an id outside its vocabulary, say),
    and raises rather than enter the loss as a huge finite number. Anything else broken (a
    position too many or too few, a missing actual token, NaN, fewer than k ranked
    alternatives, a key or value that is not a number) raises a ServerError naming the URL
    and the position: never a shorter or silently padded tensor.
    """
    if entries is None or len(entries) != len(ids):
        raise ServerError(f"{url}: expected prompt_logprobs for {len(ids)} tokens, got "
                          f"{None if entries is None else len(entries)}")
    length = len(ids) - start
    logprobs = torch.empty(length, dtype=torch.float32)
    topk_ids = torch.zeros(length, top_k, dtype=torch.long) if top_k else None
    topk_logprobs = torch.full((length, top_k), -math.inf) if top_k else None
    for row, position in enumerate(range(start, len(ids))):
        entry = entries[position]
        token = ids[position]
        if not isinstance(entry, Mapping) or str(token) not in entry:
            raise ServerError(f"{url}: prompt_logprobs at position {position} lack the actual token {token}")
        try:
            value = _logprob(entry[str(token)])
            ranked = _top_k(entry, top_k)
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise ServerError(f"{url}: malformed prompt_logprobs at position {position}: {error!r}") from None
        if value == -math.inf:
            raise ServerError(f"{url}: the server gives token {token} at position {position} probability 0 "
                              "(logprob -inf, sent as -9999): is it outside the served model's vocabulary?")
        logprobs[row] = value
        for column, (token_id, token_logprob) in enumerate(ranked):
            topk_ids[row, column] = token_id
            topk_logprobs[row, column] = token_logprob
    return TokenScores(logprobs=logprobs, topk_ids=topk_ids, topk_logprobs=topk_logprobs)


def _logprob(item: Mapping[str, Any]) -> float:
    """The value of one {"logprob": x, "rank": r} item; -9999 and below mean -inf."""
    value = float(item["logprob"])
    if math.isnan(value) or value == math.inf:
        raise ValueError(f"logprob {value}")
    return -math.inf if value <= CLAMPED_LOGPROB else value


def _top_k(entry: Mapping[str, Any], top_k: int) -> list[tuple[int, float]]:
    """(id, logprob) of the alternatives ranked 1..k at one position, best first."""
    if not top_k:
        return []
    ranked = sorted((item["rank"], int(key), _logprob(item)) for key, item in entry.items()
                    if item.get("rank") is not None and item["rank"] <= top_k)
    if len(ranked) < top_k:
        raise ValueError(f"{len(ranked)} alternatives ranked within the top {top_k}")
    return [(token_id, token_logprob) for _, token_id, token_logprob in ranked[:top_k]]


def rollouts(prompt: list[int], response: Any, n: int, url: str) -> list[Rollout]:
    """The n rollouts of one sampling answer, in the order of their choice index; any other
    number of choices is refused (a missing one would silently shrink the group)."""
    choices = sorted(response.choices, key=lambda choice: choice.index)
    if [choice.index for choice in choices] != list(range(n)):
        raise ServerError(f"{url}: expected {n} completions (choice index 0..{n - 1}), got indices "
                          f"{[choice.index for choice in choices]}")
    return [_rollout(prompt, choice, url) for choice in choices]


def _rollout(prompt: list[int], choice: Any, url: str) -> Rollout:
    extra = choice.model_extra or {}
    ids = extra.get("token_ids")
    if ids is None:
        raise ServerError(f"{url}: the completion carries no token_ids: the server does not support "
                          "return_token_ids (vLLM >= 0.10.2 does)")
    logprobs = choice.logprobs.token_logprobs if choice.logprobs is not None else None
    return make_rollout(prompt, ids, logprobs, choice.finish_reason, choice.text, url)


def make_rollout(prompt: list[int], ids: Sequence[int], logprobs: Sequence[float] | None, finish_reason: str | None,
                 text: str, where: str) -> Rollout:
    """A `Rollout` from one vLLM completion (a server's JSON or an in-process `CompletionOutput`):
    one sampled logprob per token is required; any finish but "stop" (an end-of-sequence or stop
    token, which vLLM keeps in the ids) counts as "length"."""
    if logprobs is None or len(logprobs) != len(ids):
        raise ServerError(f"{where}: expected one logprob per completion token ({len(ids)}), got "
                          f"{None if logprobs is None else len(logprobs)}")
    finish = "stop" if finish_reason == "stop" else "length"
    return Rollout(prompt_ids=prompt, completion_ids=list(ids), sampler_logprobs=_sampled_logprobs(logprobs, where),
                   finish_reason=finish, text=text)


def _sampled_logprobs(logprobs: Sequence[Any], where: str) -> list[float]:
    """The sampled tokens' logprobs as floats. A sampled token had probability > 0, so a
    missing, NaN or infinite value (-9999 is vLLM's -inf) is a broken reply, refused here
    rather than turned into an infinite importance ratio in the loss."""
    values = []
    for position, value in enumerate(logprobs):
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = math.nan
        if not math.isfinite(number) or number <= CLAMPED_LOGPROB:
            raise ServerError(f"{where}: completion token {position} has logprob {value!r}; a sampled token "
                              "needs a finite one")
        values.append(number)
    return values
