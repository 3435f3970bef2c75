"""The one small interface every engine (in-process transformers, vLLM servers) speaks.

Token ids are the currency: an engine samples ids, and scores exactly the ids it is
given, so a teacher grades the student's own tokens with no retokenisation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Literal, Mapping, Protocol, Sequence

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How the student samples. temperature 0 is greedy decoding. The filters apply in vLLM's order
    to the tempered distribution: min_p (drop tokens below min_p x the top token's probability),
    then top_k (the k most likely; 0: off), then top_p (the nucleus); with every filter off (the
    defaults, and always in training unless rollout.top_p, top_k or min_p is set) nothing is filtered."""

    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1  # samples per prompt
    seed: int | None = None
    # The row (prompt x sample) of the whole request that this call's first row is: a rank
    # that samples its share of a step's prompts passes its offset, so row r draws the same
    # randomness whichever process samples it.
    first_row: int = 0
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # 0: off

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: off), got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.first_row < 0:
            raise ValueError(f"first_row must be >= 0, got {self.first_row}")

    def row_seed(self, row: int) -> int | None:
        """The seed of the randomness that starts at row `row` of the whole request: the
        request's seed for row 0 (one call, one batch: as always), a mix of both otherwise."""
        if self.seed is None:
            return None
        return self.seed if row == 0 else (self.seed * 6364136223846793005 + row * 1442695040888963407) % 2**63


@dataclass(frozen=True)
class Rollout:
    """One sampled completion with the exact ids, as the sampler produced them.

    sampler_logprobs are the logprobs of each completion token under the distribution it
    was drawn from: the model's logits divided by the temperature, restricted by the min-p,
    top-k and top-p filters that are on (greedy: the raw logits). The trainer's policy is the tempered
    distribution too, so its importance ratio against these is 1 when both agree.
    The end-of-sequence token, when produced, is the last completion id.
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    sampler_logprobs: list[float]
    finish_reason: Literal["stop", "length"]
    text: str
    # The trainer step whose weights sampled it (the engine's weight version when the trainer
    # asked); None when the caller did not say (evals, tools). Set by `selfopd.training.rollout_pipeline`.
    weight_version: int | None = None
    # With requests in flight across weight pushes (rollout.max_staleness >= 2 on vLLM servers): the
    # newest weights that may have sampled a token of it, when newer than weight_version; else None.
    last_weight_version: int | None = None
    # An episode of several turns: per completion id, True where the student wrote it and False for the
    # environment's tokens between its turns (tool results, feedback, observations), which are context
    # for student and teacher alike and get no advantage and no loss. None: every id is the student's.
    loss_mask: tuple[bool, ...] | None = None
    # An episode whose environment is the judge (`Episode.judged`: OpenEnv, a TRL class with get_reward):
    # `environment_judged`, and its reward for the student's last turn, which grades the rollout
    # (`selfopd.episodes.verdicts.grade_rollout`); None when it gave none or never saw that turn.
    environment_judged: bool = False
    environment_reward: float | None = None

    def __post_init__(self) -> None:
        if self.loss_mask is not None and len(self.loss_mask) != len(self.completion_ids):
            raise ValueError(f"loss_mask has {len(self.loss_mask)} entries for {len(self.completion_ids)} completion ids")

    @property
    def student_tokens(self) -> int:
        """How many completion ids the student wrote (all of them outside an episode)."""
        return len(self.completion_ids) if self.loss_mask is None else sum(self.loss_mask)

    def students_part(self, per_token: torch.Tensor) -> torch.Tensor:
        """A per-completion-id tensor at the student's own ids (an episode's environment ids left out)."""
        return per_token if self.loss_mask is None else per_token[torch.tensor(self.loss_mask, dtype=torch.bool)]

    def on_completion(self, students_part: torch.Tensor) -> torch.Tensor:
        """The inverse of `students_part`: values of the student's ids laid over the whole completion, 0 at
        an episode's environment ids."""
        if self.loss_mask is None:
            return students_part
        whole = torch.zeros(len(self.loss_mask), dtype=students_part.dtype)
        whole[torch.tensor(self.loss_mask, dtype=torch.bool)] = students_part
        return whole


@dataclass(frozen=True)
class TokenScores:
    """An engine's judgement of given completion tokens.

    logprobs: (T,) logprob of each given completion token.
    topk_ids, topk_logprobs: (T, k) the k most likely tokens at each position, when asked.
    """

    logprobs: torch.Tensor
    topk_ids: torch.Tensor | None = None
    topk_logprobs: torch.Tensor | None = None
    extra: dict[str, float] = field(default_factory=dict)


class WeightSource(Protocol):
    """What a push sends: names, dtypes and shapes first (nothing materialised), then the tensors in
    that order. Re-iterable: each push iterates it once (a sharded model gathers each tensor then)."""

    def metadata(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]: ...

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]: ...


class TensorsSource:
    """A `WeightSource` over a mapping of whole tensors (HF names)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def metadata(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        return [(name, tensor.dtype, tuple(tensor.shape)) for name, tensor in self.tensors.items()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.tensors.items())


def as_source(weights: Mapping[str, torch.Tensor] | WeightSource) -> WeightSource:
    return weights if hasattr(weights, "metadata") else TensorsSource(weights)  # type: ignore[arg-type]


class Engine(Protocol):
    """What the trainer needs from a model server, local or remote."""

    # True when `completion_states` gives the full next-token distributions (in process);
    # a server returns only the top-k logprobs it is asked for.
    supports_full_vocabulary: bool
    # The most tokens (prompt + completion) `score` can take; None when no limit is known.
    max_scored_tokens: int | None
    # True when sampling runs in other processes (vLLM servers), so a request may run while
    # the trainer computes: what `rollout.max_staleness` overlaps. False in the trainer's process.
    samples_in_background: bool
    # True when every weight update is proven exactly (per-tensor digests, `selfopd.serving.weight_digest`):
    # the probe is then a numeric monitor of the engine's kernels, not the proof that weights arrived.
    pushes_verified: bool
    # True when the engine schedules its own batches (vLLM, served or colocated): the trainer sends a
    # step's scoring at once. False in process, where the caller's micro-batches are the batches
    # (the empty-context control is then bit-exact: same batch, same padding).
    batches_itself: bool

    def sample(self, prompts: Sequence[list[int]], params: SamplingParams) -> list[list[Rollout]]:
        """`params.n` rollouts per prompt, in prompt order."""
        ...

    def score(self, sequences: Sequence[tuple[list[int], list[int]]], top_k: int = 0,
              temperature: float = 1.0) -> list[TokenScores]:
        """Logprobs of each completion token given its prompt, for (prompt_ids, completion_ids)
        pairs, under the model's logits divided by `temperature` (1: the raw model)."""
        ...

    def score_replicas(self, sequence: tuple[list[int], list[int]]) -> list[tuple[str, TokenScores]]:
        """One sequence scored by every replica behind this engine (each server of a vLLM
        engine; the one model in process), named: a weight sync or a frozen teacher is
        checked on every copy that serves, not on whichever one `score` picks."""
        ...

    def completion_states(self, sequences: Sequence[tuple[list[int], list[int]]],
                          temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """(tempered final hidden states (B, C, H), output head (V, H)) at the completion
        positions: every next-token distribution, for the full-vocabulary losses. Only
        engines with `supports_full_vocabulary`."""
        ...

    def update_weights(self, weights: Mapping[str, torch.Tensor] | WeightSource, version: int) -> None:
        """Load new weights (HF checkpoint names); later calls see them."""
        ...

    def close(self) -> None: ...


def rest_engines(*engines: Any) -> None:
    """Let engines that hold accelerator memory between calls free it while the trainer
    computes: an engine with a `sleep` method (the colocated vLLM) sleeps until its next
    call; the others are left alone. Each engine once, however often it is passed."""
    for engine in {id(engine): engine for engine in engines}.values():
        sleep = getattr(engine, "sleep", None)
        if callable(sleep):
            sleep()
