"""The teacher's side of a step: every (teacher prompt, student completion) pair scored. In
process, in the trainer's micro-batches: with the empty-context control the teacher then
computes exactly what the student does, bit for bit (same batch, same padding). An engine
that schedules its own batches (vLLM: `Engine.batches_itself`) gets the whole step in one
call, with the pairs of the loss's baseline (`loss.opd_baseline`) in the same call, each distinct
sequence once.

A full-vocabulary loss needs the teacher's whole next-token distributions in the training
phase too: the teacher's final hidden states are computed once per micro-batch here, kept
for the loss, and the sampled tokens' logprobs read off them, instead of a second teacher
forward in the training phase (the same numbers: same weights, same batches)."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from selfopd.engines.base import TokenScores
from selfopd.engines.kernels import token_logprobs_from_hidden
from selfopd.engines.scoring import right_pad

Pairs = Sequence[tuple[list[int], list[int]]]
States = tuple[torch.Tensor, torch.Tensor]  # the teacher's tempered final hidden states (B, C, H) and head (V, H)


def score_step(engine: Any, pairs: Pairs, baseline_pairs: Pairs | None, per_micro: int, top_k: int,
               temperature: float, keep_states: bool) -> tuple[list[TokenScores], list[States], list[TokenScores] | None]:
    """(a TokenScores per pair, the teacher's states per micro-batch when `keep_states`, a TokenScores
    per baseline pair or None). The baseline pairs (a wrong context, the student's own prompt) are
    scored with top_k 0, a sampled-token signal."""
    if getattr(engine, "batches_itself", False) and not keep_states:
        if baseline_pairs and top_k:
            raise ValueError("a baseline pass scores the sampled token only (top_k 0)")
        together = list(pairs) + list(baseline_pairs or [])
        scores = score_distinct(engine, together, top_k if not baseline_pairs else 0, temperature)
        return scores[: len(pairs)], [], (scores[len(pairs):] if baseline_pairs is not None else None)
    scores, states = score_in_micro_batches(engine, pairs, per_micro, top_k, temperature, keep_states)
    baseline = (score_in_micro_batches(engine, baseline_pairs, per_micro, 0, temperature, False)[0]
                if baseline_pairs is not None else None)
    return scores, states, baseline


def score_distinct(engine: Any, pairs: Pairs, top_k: int, temperature: float) -> list[TokenScores]:
    """`engine.score` of each distinct (prompt, completion) once, shared by the rows that repeat it: a
    GRPO group's identical samples, a baseline row identical to its teacher row (the empty-context
    control with `same_engine`). vLLM's batches do not promise equal numbers for equal rows (bf16
    kernels differ with the batch's shape), and a difference there is noise, never signal."""
    first: dict[tuple[tuple[int, ...], tuple[int, ...]], int] = {}
    distinct = []
    for prompt, completion in pairs:
        key = (tuple(prompt), tuple(completion))
        if key not in first:
            first[key] = len(distinct)
            distinct.append((prompt, completion))
    scores = engine.score(distinct, top_k=top_k, temperature=temperature)
    return [scores[first[(tuple(prompt), tuple(completion))]] for prompt, completion in pairs]


def score_in_micro_batches(engine: Any, pairs: Pairs, per_micro: int, top_k: int, temperature: float,
                           keep_states: bool) -> tuple[list[TokenScores], list[States]]:
    """(a TokenScores per pair, and per micro-batch the teacher's states when `keep_states`)."""
    scores: list[TokenScores] = []
    states: list[States] = []
    for start in range(0, len(pairs), per_micro):
        micro = pairs[start : start + per_micro]
        if not keep_states:
            scores.extend(engine.score(micro, top_k=top_k, temperature=temperature))
            continue
        hidden_BCH, head_VH = engine.completion_states(micro, temperature)
        states.append((hidden_BCH, head_VH))
        scores.extend(scores_from_states(hidden_BCH, head_VH, [completion for _, completion in micro]))
    return scores, states


@torch.no_grad()
def scores_from_states(hidden_BCH: torch.Tensor, head_VH: torch.Tensor,
                       completions: Sequence[list[int]]) -> list[TokenScores]:
    """The logprob of each completion token under the distributions `completion_states` gave,
    as an engine's `score` computes it (fp32 head, on the CPU)."""
    ids_BC, mask_BC = right_pad(completions, pad_id=0)
    device = hidden_BCH.device
    logprobs_BC = token_logprobs_from_hidden(hidden_BCH, head_VH, ids_BC.to(device), mask_BT=mask_BC.to(device))
    logprobs_BC = logprobs_BC.float().cpu()
    return [TokenScores(logprobs=logprobs_BC[row, : len(completion)].clone())
            for row, completion in enumerate(completions)]
