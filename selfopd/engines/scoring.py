"""Per-token logprobs of given (prompt, completion) id sequences under a transformers model.

The one place that turns ids into logprobs in-process: the local engine scores with it
(no grad: sampler checks, teachers) and the trainer calls it with grad. Sharing it keeps
trainer and engine logprobs comparable bit for bit.

Prompts are shared: the n samples of one prompt (and every sequence with an identical
prompt) run the prompt through the decoder once, and their completions attend to its
cached keys and values. Gradients flow through that shared prefix exactly as through n
separate copies, at a fraction of the cost: on the demo task prompts are ~3x longer than
completions.

Layout: results are in completion coordinates. `logprobs_BC[b, c]` is
log p(completion_b[c] | prompt_b, completion_b[:c]); `mask_BC` marks real tokens
(completions are right-padded to the longest, C).
"""

from __future__ import annotations

import inspect
import sys
from typing import Any, Sequence

import torch
from torch import Tensor

from selfopd.core.devices import full_precision, model_device
from selfopd.engines.families import shared_prompt_cache_problem
from selfopd.engines.kernels import token_logprobs_from_hidden

Sequences = Sequence[tuple[Sequence[int], Sequence[int]]]


def completion_logprobs(model: Any, sequences: Sequences, pad_id: int, chunk_size: int = 256) -> tuple[Tensor, Tensor]:
    """(logprobs_BC, mask_BC) for each completion token given its prompt.

    Differentiable when grad is enabled. Vocabulary logits are formed a chunk of positions
    at a time, so the batch never holds (B, C, V) fp32 logits.
    """
    hidden_BCH, targets_BC, mask_BC = completion_hidden(model, sequences, pad_id)
    return logprobs_from_hidden(model, hidden_BCH, targets_BC, mask_BC, chunk_size), mask_BC


def logprobs_from_hidden(model: Any, hidden_BCH: Tensor, targets_BC: Tensor, mask_BC: Tensor,
                         chunk_size: int = 256, keep_last: bool = True) -> Tensor:
    """The second half of `completion_logprobs`, for callers that also need the hidden states
    (`keep_last`: `selfopd.engines.kernels.chunked_on_real_positions`'s)."""
    head_VH = model.get_output_embeddings().weight
    return token_logprobs_from_hidden(hidden_BCH, head_VH, targets_BC, chunk_size, mask_BC, keep_last)


def tempered(hidden_BCH: Tensor, temperature: float) -> Tensor:
    """Hidden states whose logits are the model's divided by `temperature`: the head is
    linear without bias (`check_plain_head`), so scaling before it is scaling the logits,
    and every loss and scorer downstream works unchanged on the tempered distribution."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return hidden_BCH if temperature == 1.0 else hidden_BCH / temperature


@torch.no_grad()
def topk_from_hidden(model: Any, hidden_BCH: Tensor, k: int, chunk_size: int = 256) -> tuple[Tensor, Tensor]:
    """The k most likely tokens at each completion position: (ids_BCK, logprobs_BCK), the
    distribution each completion token was drawn from. Takes `completion_hidden`'s states, so
    a scorer that needs logprobs and top-k runs the decoder once."""
    head_VH = model.get_output_embeddings().weight
    ids, values = [], []
    for start in range(0, hidden_BCH.shape[1], chunk_size):
        with full_precision(hidden_BCH.device.type):  # fp32 logits inside a bf16 autocast region too
            logprobs_BcV = (hidden_BCH[:, start : start + chunk_size].float() @ head_VH.float().T).log_softmax(-1)
        top = logprobs_BcV.topk(k, dim=-1)
        ids.append(top.indices)
        values.append(top.values)
    return torch.cat(ids, dim=1), torch.cat(values, dim=1)


def completion_hidden(model: Any, sequences: Sequences, pad_id: int) -> tuple[Tensor, Tensor, Tensor]:
    """Final hidden states that predict each completion token, the tokens, and their mask:
    (hidden_BCH, ids_BC, mask_BC), on the model's device. With the unembedding
    (`model.get_output_embeddings()`) they give every next-token distribution, for the
    full-vocabulary losses.

    Two passes: the distinct prompts, left-padded so they all end at the same position;
    then every completion, right-padded, attending to its prompt's cached keys/values
    (selected per row, a differentiable gather). When no prompt repeats there is nothing to
    share, and under gradient checkpointing (which drops the cache) or for a family whose cache
    cannot be selected per row (`selfopd.engines.families`; said once per process) nothing can
    be: then one pass over prompt + completion (the same result; measured 25% faster than two
    passes on 8 distinct SmolLM2 prompts).
    """
    check_plain_head(model)
    if not sequences:
        raise ValueError("no sequences to score")
    for row, (prompt, completion) in enumerate(sequences):
        if not prompt or not completion:
            raise ValueError(f"sequence {row} has an empty {'prompt' if not prompt else 'completion'}")
    device = model_device(model)
    ids_BC, mask_BC = right_pad([completion for _, completion in sequences], pad_id)
    ids_BC, mask_BC = ids_BC.to(device), mask_BC.to(device)
    prompt_index: dict[tuple[int, ...], int] = {}
    rows = [prompt_index.setdefault(tuple(prompt), len(prompt_index)) for prompt, _ in sequences]
    if _recomputes_layers(model) or len(prompt_index) == len(sequences) or not _shares_prompt_cache(model):
        return _hidden_in_one_pass(model, sequences, ids_BC, mask_BC, pad_id), ids_BC, mask_BC

    # Prompts: (G, P), left-padded; positions count real tokens only.
    prompt_ids_GP, prompt_mask_GP = (t.to(device) for t in left_pad(list(prompt_index), pad_id))
    prompt_positions_GP = (prompt_mask_GP.cumsum(-1) - 1).clamp(min=0)
    cache_name = _cache_argument(model.get_decoder())
    prompt_out = _decoder_output(model, input_ids=prompt_ids_GP, attention_mask=prompt_mask_GP,
                                 position_ids=prompt_positions_GP, use_cache=True)

    # Completions: (B, C), right-padded, continuing their prompt's positions.
    row_to_prompt_B = torch.tensor(rows, device=device)
    prompt_lengths_B = prompt_mask_GP.sum(-1)[row_to_prompt_B]
    positions_BC = prompt_lengths_B[:, None] + torch.arange(ids_BC.shape[1], device=device)[None, :]
    cache = getattr(prompt_out, "cache", None) or prompt_out.past_key_values
    cache.batch_select_indices(row_to_prompt_B)
    attention_BT = torch.cat([prompt_mask_GP[row_to_prompt_B], mask_BC], dim=1)
    completion_out = _decoder_output(model, input_ids=ids_BC, attention_mask=attention_BT, position_ids=positions_BC,
                                     **{cache_name: cache}, use_cache=True)

    # The prompt's last hidden state predicts completion token 0; completion token c-1's predicts c.
    first_B1H = prompt_out.last_hidden_state[row_to_prompt_B, -1:]
    hidden_BCH = torch.cat([first_B1H, completion_out.last_hidden_state[:, :-1]], dim=1)
    return hidden_BCH, ids_BC, mask_BC


def _hidden_in_one_pass(model: Any, sequences: Sequences, ids_BC: Tensor, mask_BC: Tensor, pad_id: int) -> Tensor:
    """`completion_hidden`'s states from one pass over [left-padded prompt | completion]."""
    prompt_ids_BP, prompt_mask_BP = (t.to(ids_BC.device) for t in left_pad([p for p, _ in sequences], pad_id))
    mask_BT = torch.cat([prompt_mask_BP, mask_BC], dim=1)
    out = _decoder_output(model, input_ids=torch.cat([prompt_ids_BP, ids_BC], dim=1), attention_mask=mask_BT,
                          position_ids=(mask_BT.cumsum(-1) - 1).clamp(min=0), use_cache=False)
    width = prompt_ids_BP.shape[1]
    return out.last_hidden_state[:, width - 1 : width - 1 + ids_BC.shape[1]]


def _decoder_output(model: Any, **inputs: Any) -> Any:
    """The decoder's output (final hidden states after the last norm, and the cache) of a
    call of the whole model: the call goes through the top module, so hooks on it run (FSDP
    gathers the embeddings and the output head there); the head itself is applied to one
    position only (`logits_to_keep=1`), since the callers apply it themselves, chunked."""
    captured: list[Any] = []
    handle = model.get_decoder().register_forward_hook(lambda module, args, output: captured.append(output))
    try:
        model(**inputs, logits_to_keep=1)
    finally:
        handle.remove()
    return captured[-1]


_UNSHARED: set[str] = set()  # the reasons already said in this process


def _shares_prompt_cache(model: Any) -> bool:
    """Whether the model's cache can be selected per row; if not, say why once per process."""
    problem = shared_prompt_cache_problem(model.config)
    if problem and problem not in _UNSHARED:
        _UNSHARED.add(problem)
        print(f"selfopd: scoring without a shared prompt cache ({problem}): each sequence's prompt runs "
              "through the model again, the same logprobs at more compute", file=sys.stderr)
    return not problem


def _recomputes_layers(model: Any) -> bool:
    """Gradient checkpointing is on and will run: transformers then drops the KV cache."""
    return bool(getattr(model, "is_gradient_checkpointing", False)) and model.training and torch.is_grad_enabled()


def right_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """(ids, mask), both (rows, longest), each row from column 0."""
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for index, row in enumerate(rows):
        ids[index, : len(row)] = torch.tensor(row, dtype=torch.long)
        mask[index, : len(row)] = 1
    return ids, mask


def _cache_argument(decoder: Any) -> str:
    """The decoder's name for its KV-cache input: `past_key_values`, or `cache` in newer
    transformers. Passing the wrong one is silently swallowed by **kwargs, and the
    completions would then attend to nothing of their prompt."""
    parameters = inspect.signature(decoder.forward).parameters
    for name in ("past_key_values", "cache"):
        if name in parameters:
            return name
    raise NotImplementedError(f"{type(decoder).__name__}.forward takes neither past_key_values nor cache")


def left_pad(rows: Sequence[Sequence[int]], pad_id: int, width: int = 0) -> tuple[Tensor, Tensor]:
    """(ids, attention mask), both (rows, the longest row or `width` if wider): every row ends at
    the last column, where decoding continues."""
    width = max(width, *(len(row) for row in rows))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for index, row in enumerate(rows):
        ids[index, width - len(row) :] = torch.tensor(row, dtype=torch.long)
        mask[index, width - len(row) :] = 1
    return ids, mask


# Config fields with which transformers' models scale or cap their logits after the head
# (Gemma 2/3, Cohere, Granite, Falcon-H1), and each one's neutral value.
LOGIT_TRANSFORMS = {"final_logit_softcapping": None, "logit_scale": None, "logits_scaling": 1.0,
                    "lm_head_multiplier": 1.0}


def check_plain_head(model: Any, where: str = "") -> None:
    """Refuse (ModelError) a model whose logits are not `final hidden @ head.T`: the chunked
    kernels apply the head themselves and `tempered` divides the hidden states by the
    temperature, both exact for a plain linear head only. `where`: the model's folder or name."""
    from selfopd.core.models import ModelError

    head = model.get_output_embeddings()
    reasons = []
    if head is None:
        reasons.append("has no output head (get_output_embeddings() is None)")
    elif getattr(head, "bias", None) is not None:
        reasons.append("has a bias on its output head")
    config = getattr(model, "config", None)
    for field, neutral in LOGIT_TRANSFORMS.items():
        value = getattr(config, field, None)
        if value is not None and value != neutral:
            reasons.append(f"transforms its logits after the head (config.{field} = {value})")
    if reasons:
        name = f"{where} ({type(model).__name__})" if where else type(model).__name__
        raise ModelError(f"{name} {' and '.join(reasons)}: selfopd scores plain linear heads only "
                         "(logits = final hidden state @ head.T, as Llama, Qwen, Mistral, SmolLM2)")



def pad_completions(values: Sequence[Tensor | Sequence[float]], length: int,
                    device: torch.device | None = None) -> Tensor:
    """Per-completion 1-D values right-padded with zeros into (B, length), float32, on `device`."""
    out_BC = torch.zeros(len(values), length, dtype=torch.float32)
    for row, value in enumerate(values):
        tensor = torch.as_tensor(value, dtype=torch.float32)
        out_BC[row, : len(tensor)] = tensor
    return out_BC if device is None else out_BC.to(device)
