"""How far training moved a model away from where it started, on prompts unrelated to what it
was trained on: the forgetting a narrow run can cause while its own metrics look fine.

The measure is the per-token KL(trained || start), exact over the vocabulary at each position
of the trained model's own samples (at temperature 1): the expectation, under the trained
model, of how much less likely the start model finds each next token. 0 for an unchanged
model; it grows as the trained model's behaviour on these prompts leaves the start model's.
Each prompt's KL is the mean over the tokens of its samples; the interval is over prompts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Sequence

import torch
from tqdm.auto import tqdm

from selfopd.core.atomic import write_json_atomic
from selfopd.core.stats import MeanEstimate, mean_interval
from selfopd.engines.base import SamplingParams
from selfopd.engines.local import LocalEngine
from selfopd.templating.chat_format import ChatFormat


def general_prompts(path: str | Path | None = None) -> list[str]:
    """One prompt per non-empty line of `path`; by default the 48 everyday requests shipped
    with selfopd (explanations, short writing, advice; no arithmetic, no fictional facts)."""
    if path is None:
        text = resources.files("selfopd.data").joinpath("general_prompts.txt").read_text(encoding="utf-8")
        where = "selfopd/data/general_prompts.txt"
    else:
        text, where = Path(path).read_text(encoding="utf-8"), str(path)
    prompts = [line.strip() for line in text.splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"{where}: no prompts (one per line)")
    return prompts


@torch.no_grad()
def position_kl(model: Any, reference: Any, prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> torch.Tensor:
    """KL(model || reference) over the vocabulary at each completion position (float64, one
    value per completion token): the next-token distributions after the prompt and each prefix
    of the completion."""
    ids = torch.tensor([list(prompt_ids) + list(completion_ids)], device=model.device)
    first = len(prompt_ids) - 1
    last = ids.shape[1] - 1
    p = torch.log_softmax(model(ids).logits[0, first:last].double(), dim=-1)
    q = torch.log_softmax(reference(ids.to(reference.device)).logits[0, first:last].double().to(p.device), dim=-1)
    return (p.exp() * (p - q)).sum(-1)


@dataclass(frozen=True)
class Drift:
    """KL(trained || start) per token: mean over prompts with a 95% interval over prompts."""

    kl: MeanEstimate
    tokens: int  # completion tokens the KL was taken over
    samples_per_prompt: int
    max_tokens: int
    per_prompt: dict[str, float]  # prompt -> its mean per-token KL

    def __str__(self) -> str:
        return f"KL(trained || start) per token {self.kl} over {self.tokens} sampled tokens"


def drift(model: Any, reference: Any, chat: ChatFormat, prompts: Sequence[str], samples: int = 2,
          max_tokens: int = 48, seed: int = 0, progress: bool = True) -> Drift:
    """The trained `model`'s per-token KL to `reference` (its start) along `samples` of its own
    completions of each prompt (in the student's chat format `chat`: its tokenizer and chat-template
    arguments)."""
    engine = LocalEngine(model, chat.tokenizer, batch_size=len(prompts) * samples)
    ids = [chat.prompt_ids([{"role": "user", "content": p}]) for p in prompts]
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, n=samples, seed=seed)
    per_prompt, tokens = {}, 0
    for prompt, prompt_ids, rollouts in tqdm(list(zip(prompts, ids, engine.sample(ids, params))),
                                             desc="drift", unit="prompt", disable=not progress):
        values = [position_kl(model, reference, prompt_ids, r.completion_ids) for r in rollouts if r.completion_ids]
        flat = torch.cat(values) if values else torch.zeros(0, dtype=torch.float64)
        tokens += flat.numel()
        per_prompt[prompt] = float(flat.mean()) if flat.numel() else 0.0
    estimate = mean_interval(list(per_prompt.values()), unit_range=False, unit="prompts")
    return Drift(estimate, tokens, samples, max_tokens, per_prompt)


def write_drift(result: Drift, out_dir: Path, model: str, reference: str) -> Path:
    """summary.json in `out_dir`: the estimate, its settings and each prompt's KL."""
    path = Path(out_dir) / "summary.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, {"model": model, "reference": reference, "kl": asdict(result.kl), "tokens": result.tokens,
                             "samples_per_prompt": result.samples_per_prompt, "max_tokens": result.max_tokens,
                             "per_prompt": result.per_prompt})
    return path
