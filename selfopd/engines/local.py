"""The in-process transformers engine: the embedded default on a laptop, in CI and tests.

It wraps a model object it does not own. For the student and for a `self` teacher this
is the trainer's live module, so an optimizer step is visible at once and no second copy
exists; `update_weights` then only records the version.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, ContextManager, Iterator, Mapping, Sequence

import torch

from selfopd.core.devices import autocast, model_device
from selfopd.core.distributed import gathered_for_generation, is_sharded
from selfopd.engines.base import Rollout, SamplingParams, TokenScores, WeightSource, as_source
from selfopd.engines.compiled import compiled_decoding, compiled_width
from selfopd.engines.packed import packed_linears
from selfopd.engines.scoring import completion_hidden, left_pad, logprobs_from_hidden, tempered, topk_from_hidden


class LocalEngine:
    """Samples with `model.generate` (KV cache) and scores with `selfopd.engines.scoring`."""

    def __init__(self, model: Any, tokenizer: Any, batch_size: int = 16, chunk_size: int = 256,
                 forward_context: Callable[[], ContextManager[Any]] | None = None,
                 precision: str = "float32", packed: bool = False, compiled: bool = False) -> None:
        self.model = model
        # Sample through MKL's packed products (`selfopd.engines.packed`); scoring is unchanged.
        self.packed = packed
        # Sample with a static KV cache and a compiled decode step (`compiled_decoding`).
        self.compiled = compiled
        # Entered around every forward pass: a `frozen` teacher that is the live LoRA student
        # with its adapters off (selfopd.engines.lora.adapters_off) reads the base weights this way.
        self.forward_context = forward_context or contextlib.nullcontext
        # `model.dtype`: 'bfloat16' runs each forward under its own autocast region (selfopd.core.devices).
        self.precision = precision
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.chunk_size = chunk_size
        self.version = 0
        eos = model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos])
        self.pad_id = pad_token_id(tokenizer, model)

    def sample(self, prompts: Sequence[list[int]], params: SamplingParams) -> list[list[Rollout]]:
        """Each generation batch is seeded by the request's seed and the row it starts at, so
        a rank sampling a share of the rows (batches aligned) draws what one process does."""
        flat = [list(p) for p in prompts for _ in range(params.n)]
        rollouts: list[Rollout] = []
        for start in range(0, len(flat), self.batch_size):
            seed = params.row_seed(params.first_row + start)
            if seed is not None:
                torch.manual_seed(seed)
            rollouts.extend(self._sample_batch(flat[start : start + self.batch_size], params))
        return [rollouts[i * params.n : (i + 1) * params.n] for i in range(len(prompts))]

    @torch.no_grad()
    def score(self, sequences: Sequence[tuple[list[int], list[int]]], top_k: int = 0,
              temperature: float = 1.0) -> list[TokenScores]:
        with eval_mode(self.model), self.forward_context():
            return self._score(sequences, top_k, temperature)

    def _autocast(self, cache: bool = False) -> ContextManager[Any]:
        return autocast(model_device(self.model), self.precision, cache=cache)

    def _score(self, sequences: Sequence[tuple[list[int], list[int]]], top_k: int,
               temperature: float) -> list[TokenScores]:
        scores: list[TokenScores] = []
        for start in range(0, len(sequences), self.batch_size):
            chunk = sequences[start : start + self.batch_size]
            with self._autocast():
                hidden_BCH, targets_BC, mask_BC = completion_hidden(self.model, chunk, self.pad_id)  # one decoder pass
            hidden_BCH = tempered(hidden_BCH, temperature)
            logprobs_BC = logprobs_from_hidden(self.model, hidden_BCH, targets_BC, mask_BC, self.chunk_size)
            topk = topk_from_hidden(self.model, hidden_BCH, top_k, self.chunk_size) if top_k else None
            logprobs_BC = logprobs_BC.float().cpu()  # scores are data: on the CPU, whatever the device
            topk = (topk[0].cpu(), topk[1].float().cpu()) if topk else None
            for row, (_, completion) in enumerate(chunk):
                span = slice(0, len(completion))
                scores.append(
                    TokenScores(
                        logprobs=logprobs_BC[row, span].clone(),
                        topk_ids=topk[0][row, span].clone() if topk else None,
                        topk_logprobs=topk[1][row, span].clone() if topk else None,
                    )
                )
        return scores

    @torch.no_grad()
    def completion_states(self, sequences: Sequence[tuple[list[int], list[int]]],
                          temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """Every next-token distribution over the completion positions, without the (B, C, V)
        logits: the tempered final hidden states (B, C, H) and the output head (V, H), padded
        like `selfopd.engines.scoring.completion_hidden`. What the full-vocabulary losses need from a
        teacher; only an in-process engine has it (`supports_full_vocabulary`)."""
        with eval_mode(self.model), self.forward_context(), self._autocast():
            hidden_BCH, _, _ = completion_hidden(self.model, sequences, self.pad_id)
        return tempered(hidden_BCH, temperature), self.model.get_output_embeddings().weight

    supports_full_vocabulary = True
    samples_in_background = False  # the trainer's own process and module
    batches_itself = False  # the caller's micro-batches are its batches
    pushes_verified = False  # a copy in process: the probe is what checks it

    @property
    def max_scored_tokens(self) -> int | None:
        """The model's positions: past them its rotary positions extrapolate silently."""
        return getattr(self.model.config, "max_position_embeddings", None)

    def score_replicas(self, sequence: tuple[list[int], list[int]]) -> list[tuple[str, TokenScores]]:
        return [("in-process model", self.score([sequence])[0])]

    @torch.no_grad()
    def update_weights(self, weights: Mapping[str, torch.Tensor] | WeightSource, version: int) -> None:
        """Copy weights in by name; tensors that already are this model's storage are skipped."""
        named_tensors = dict(as_source(weights))
        params = dict(self.model.named_parameters())
        unknown = sorted(set(named_tensors) - set(params))
        if unknown:
            raise KeyError(f"update_weights: names not in the engine's model: {unknown[:5]}")
        for name, tensor in named_tensors.items():
            if params[name].data_ptr() != tensor.data_ptr():
                params[name].copy_(tensor)
        self.version = version

    def close(self) -> None:
        self.model = None

    def _sample_batch(self, prompts: list[list[int]], params: SamplingParams) -> list[Rollout]:
        device = model_device(self.model)
        padded = compiled_width(max(map(len, prompts))) if self.compiled else 0
        ids_BT, mask_BT = (t.to(device) for t in left_pad(prompts, self.pad_id, padded))
        width = ids_BT.shape[1]
        options = compiled_decoding(device) if self.compiled else {}
        policy = SampledPolicy(params.temperature, params.top_p, params.top_k, params.min_p)
        sharded = is_sharded(self.model)
        packing = packed_linears(self.model, len(prompts)) if self.packed else contextlib.nullcontext()
        with (torch.no_grad(), eval_mode(self.model), self.forward_context(), gathered_for_generation(self.model),
              neutral_generation_config(self.model), self._autocast(cache=True), packing):
            new_BS = self.model.generate(
                input_ids=ids_BT,
                attention_mask=mask_BT,
                max_new_tokens=params.max_tokens,
                pad_token_id=self.pad_id,
                do_sample=False,  # SampledPolicy draws each token; generate's argmax takes it
                logits_processor=[policy],
                synced_gpus=sharded,  # sharded ranks step together until every rank is done
                **options,
            )[:, width:]
        logprobs_BS = policy.drawn_logprobs(new_BS.shape[1], new_BS.shape[0]).cpu()
        new_BS = new_BS.cpu()
        rollouts = []
        for row, prompt in enumerate(prompts):
            tokens = new_BS[row].tolist()
            stop = next((i for i, t in enumerate(tokens) if t in self.eos_ids), None)
            end = len(tokens) if stop is None else stop + 1  # keep the end-of-sequence token
            completion = tokens[:end]
            rollouts.append(
                Rollout(
                    prompt_ids=prompt,
                    completion_ids=completion,
                    sampler_logprobs=logprobs_BS[row, :end].tolist(),
                    finish_reason="length" if stop is None else "stop",
                    text=self.tokenizer.decode(completion, skip_special_tokens=True),
                )
            )
        return rollouts


class SampledPolicy:
    """The one logits processor of a greedy `generate`, which draws each token itself from the
    policy selfopd samples (logits / temperature, then the min-p, top-k and top-p filters in
    vLLM's order, each only when on; the raw argmax when greedy), keeps the drawn token's logprob
    under it, and hands generate scores whose argmax is that token.

    The draw is an exponential race, argmax_v (log p_v - log E_v) with E_v ~ Exp(1) i.i.d.,
    an exact sample of p (vLLM samples this way): 2 ms a step for 8 rows of SmolLM2's 49152
    tokens on the CPU, where generate's `torch.multinomial` took 10 ms. Only the (B,) logprobs of each step are kept, not generate's S x (B, V) scores.
    Steps generate runs and then drops (a deferred stop check) are dropped by the output's length."""

    def __init__(self, temperature: float, top_p: float, top_k: int = 0, min_p: float = 0.0) -> None:
        from transformers import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

        self.temperature = temperature
        self.filters: list[Any] = []  # greedy decoding ignores them, as vLLM does
        if temperature > 0:
            self.filters += [MinPLogitsWarper(min_p)] if min_p > 0 else []
            self.filters += [TopKLogitsWarper(top_k)] if top_k > 0 else []
            self.filters += [TopPLogitsWarper(top_p)] if top_p < 1.0 else []
        self.drawn: list[torch.Tensor] = []  # (B,) logprob of each step's drawn token

    def logprobs(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """(B, V) logprobs of the policy the next token is drawn from (-inf outside the filters)."""
        if self.temperature > 0:
            if self.temperature != 1.0:
                scores = scores / self.temperature
            for warper in self.filters:
                scores = warper(input_ids, scores)
        return scores.float().log_softmax(-1)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        logprobs_BV = self.logprobs(input_ids, scores)
        if self.temperature > 0:
            race_BV = torch.rand_like(logprobs_BV).log_().neg_()  # Exp(1) as -log U: 4x faster than exponential_
            tokens_B1 = (logprobs_BV - race_BV.log_()).argmax(-1, keepdim=True)
        else:
            tokens_B1 = logprobs_BV.argmax(-1, keepdim=True)
        self.drawn.append(logprobs_BV.gather(-1, tokens_B1).squeeze(-1))
        return torch.full_like(scores, -math.inf).scatter_(-1, tokens_B1, 0.0)

    def drawn_logprobs(self, steps: int, rows: int) -> torch.Tensor:
        """(B, S) logprobs of the first `steps` drawn tokens (what generate kept)."""
        if len(self.drawn) < steps:
            raise RuntimeError(f"generate returned {steps} new tokens but ran the policy {len(self.drawn)} times")
        return torch.stack(self.drawn[:steps], dim=1) if steps else torch.zeros(rows, 0)


@contextlib.contextmanager
def neutral_generation_config(model: Any) -> Iterator[None]:
    """`generate` fills every setting it is not given from the checkpoint's generation_config
    (repetition_penalty, min_p, no_repeat_ngram_size, suppress_tokens, ...), each of which
    would make the samples, and their logprobs, another policy than the trained one. For the
    call, every generating module's config is a default one that keeps only the token ids."""
    from transformers import GenerationConfig
    from transformers.generation import GenerationMixin

    modules = [m for m in model.modules() if isinstance(m, GenerationMixin) and getattr(m, "generation_config", None)]
    saved = [m.generation_config for m in modules]
    try:
        for module, original in zip(modules, saved):
            module.generation_config = GenerationConfig(
                bos_token_id=original.bos_token_id, eos_token_id=original.eos_token_id,
                pad_token_id=original.pad_token_id, decoder_start_token_id=original.decoder_start_token_id)
        yield
    finally:
        for module, original in zip(modules, saved):
            module.generation_config = original


def pad_token_id(tokenizer: Any, model: Any) -> int:
    """The id that pads batches: the tokenizer's pad token, else the model's end-of-sequence
    token (the Llama 3 family has no pad token). Padded positions are masked everywhere,
    so which id fills them does not change a result."""
    if tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError(f"{type(model).__name__}: the tokenizer has no pad token and the model no "
                         "end-of-sequence token to pad batches with")
    return min(eos) if isinstance(eos, list) else eos


@contextlib.contextmanager
def eval_mode(model: Any) -> Iterator[None]:
    """Sample and score without dropout, then give the trainer its module back as it was."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)
