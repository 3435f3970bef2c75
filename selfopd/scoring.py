"""Per-token logprobs of given (prompt, completion) id sequences under a transformers model.

The one place that turns ids into logprobs in-process: the local engine scores with it
(no grad, for the student's sampler check and for teachers) and the trainer calls it with
grad. Sharing it keeps trainer and engine logprobs bit-for-bit comparable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor

from selfopd.losses import token_logprobs_from_hidden


@dataclass(frozen=True)
class PackedBatch:
    """Right-padded sequences. `completion_mask_BT[b, t]` is 1 where ids_BT[b, t] is a
    completion token (the ones a teacher scores and the trainer trains)."""

    ids_BT: Tensor
    attention_mask_BT: Tensor
    completion_mask_BT: Tensor
    prompt_lengths: list[int]
    completion_lengths: list[int]


def pack_sequences(sequences: Sequence[tuple[Sequence[int], Sequence[int]]], pad_id: int) -> PackedBatch:
    """Prompt + completion ids per row, right-padded to the longest row."""
    if not sequences:
        raise ValueError("no sequences to pack")
    width = max(len(p) + len(c) for p, c in sequences)
    ids_BT = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attention_mask_BT = torch.zeros_like(ids_BT)
    completion_mask_BT = torch.zeros_like(ids_BT)
    for row, (prompt, completion) in enumerate(sequences):
        if not prompt:
            raise ValueError(f"sequence {row} has an empty prompt: the first token has no context to be scored in")
        end = len(prompt) + len(completion)
        ids_BT[row, :end] = torch.tensor([*prompt, *completion], dtype=torch.long)
        attention_mask_BT[row, :end] = 1
        completion_mask_BT[row, len(prompt) : end] = 1
    return PackedBatch(
        ids_BT=ids_BT,
        attention_mask_BT=attention_mask_BT,
        completion_mask_BT=completion_mask_BT,
        prompt_lengths=[len(p) for p, _ in sequences],
        completion_lengths=[len(c) for _, c in sequences],
    )


def sequence_logprobs(model: Any, batch: PackedBatch, chunk_size: int = 256) -> Tensor:
    """logprobs_BT[b, t] = log p(ids[b, t] | ids[b, :t]); 0 at t = 0 and on padding.

    Runs the decoder once and forms vocabulary logits a chunk of positions at a time, so
    a long batch never holds (B, T, V) fp32 logits. Differentiable when grad is enabled.
    """
    hidden_BTH = _final_hidden(model, batch)
    head_VH = model.get_output_embeddings().weight
    shifted_BT = token_logprobs_from_hidden(hidden_BTH[:, :-1], head_VH, batch.ids_BT[:, 1:], chunk_size)
    logprobs_BT = torch.cat([shifted_BT.new_zeros(shifted_BT.shape[0], 1), shifted_BT], dim=1)
    return logprobs_BT * batch.attention_mask_BT


@torch.no_grad()
def sequence_topk(model: Any, batch: PackedBatch, k: int, chunk_size: int = 256) -> tuple[Tensor, Tensor]:
    """The k most likely next tokens at each position: (ids_BTK, logprobs_BTK), aligned like
    `sequence_logprobs` (row t holds the distribution that position t's token was drawn from)."""
    hidden_BTH = _final_hidden(model, batch)
    head_VH = model.get_output_embeddings().weight
    B, T, _ = hidden_BTH.shape
    ids_BTK = torch.zeros(B, T, k, dtype=torch.long)
    logprobs_BTK = torch.full((B, T, k), float("-inf"))
    for start in range(0, T - 1, chunk_size):
        stop = min(start + chunk_size, T - 1)
        logprobs_BCV = (hidden_BTH[:, start:stop].float() @ head_VH.float().T).log_softmax(-1)
        top = logprobs_BCV.topk(k, dim=-1)
        ids_BTK[:, start + 1 : stop + 1] = top.indices
        logprobs_BTK[:, start + 1 : stop + 1] = top.values
    return ids_BTK, logprobs_BTK


def _final_hidden(model: Any, batch: PackedBatch) -> Tensor:
    config = model.config
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None):
        raise NotImplementedError(f"{type(model).__name__} scales its logits; selfopd scores plain linear heads only")
    output = model.get_decoder()(input_ids=batch.ids_BT, attention_mask=batch.attention_mask_BT, use_cache=False)
    return output.last_hidden_state
