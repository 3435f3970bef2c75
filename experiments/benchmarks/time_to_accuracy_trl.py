"""TRL's GRPOTrainer on the demo task, matched to selfopd's GRPO-only arm, for time_to_accuracy.py.

Runs in the benchmark's own virtual environment (`make bench-trl` makes .venv-trl with a pinned
TRL), as `python -m experiments.benchmarks.time_to_accuracy_trl` from the repository's root. Of
this project it imports only the `verifiers` package, so that both trainers are rewarded by the
same verifier (it needs reasoning-gym and math-verify, which .venv-trl gets too).

Reads the training rows in the order to train on them (a JSON list of {"messages", "answer",
"meta"}, `--prompts-per-step` rows per step), trains `--steps` optimizer steps of
prompts_per_step x `--samples` completions, saves the weights every `--save-every` steps
(OUT_DIR/checkpoint-N, model only), and writes one JSON line per step to --out:
{"step", "wall_s", "phases", "reward_mean", "others_cores", "prompts"}. `wall_s` runs from the
step's start to its end: the checkpoint writes after a step are not in it.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from experiments.benchmarks.cpu_load import prompt_digest
from experiments.benchmarks.vs_trl_trl import Phases, step_timer, train_timed


@dataclass(frozen=True)
class Row:
    """What the verifier reads of an example: its answer and its metadata."""

    answer: str
    meta: dict


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--rows", type=Path, required=True)
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4, help="completions per prompt (the GRPO group)")
    parser.add_argument("--micro-batch-prompts", type=int, default=4, help="prompts per forward/backward")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--save-every", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--vllm", action="store_true",
                        help="generate with vLLM in the trainer's process (TRL's colocate mode; needs vllm in this "
                             "environment): each line then carries TRL's sampler-vs-trainer logprob metrics")
    args = parser.parse_args()
    if args.vllm:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache for vLLM on a CPU

    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from verifiers import verify_example

    rows = json.loads(args.rows.read_text())[: args.steps * args.prompts_per_step]
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    dataset = Dataset.from_list([{"prompt": r["messages"], "answer": r["answer"], "meta": json.dumps(r["meta"])}
                                 for r in rows])
    per_step = args.prompts_per_step * args.samples
    accumulation = args.prompts_per_step // args.micro_batch_prompts
    config = GRPOConfig(
        output_dir=str(args.out_dir), max_steps=args.steps, per_device_train_batch_size=per_step // accumulation,
        gradient_accumulation_steps=accumulation, num_generations=args.samples, num_iterations=1,
        max_completion_length=args.max_tokens, temperature=args.temperature, top_p=1.0, top_k=0,
        repetition_penalty=1.0, learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, max_grad_norm=1.0, beta=0.0, loss_type="dapo",
        scale_rewards="group", mask_truncated_completions=False, shuffle_dataset=False, seed=args.seed,
        save_strategy="steps", save_steps=args.save_every, save_only_model=True, report_to="none",
        logging_steps=1, use_cpu=True, bf16=False, disable_tqdm=True, remove_unused_columns=False,
        dataloader_num_workers=0, log_completions=False, gradient_checkpointing=False,
        **({"use_vllm": True, "vllm_mode": "colocate", "vllm_max_model_length": 512} if args.vllm else {}))
    phases = Phases()
    rewards: list[float] = []
    prompt_ids: list[str] = []  # a digest of each step's prompt token ids, to check both trainers saw the same

    def reward(prompts: list, completions: list, answer: list[str], meta: list[str], **_: Any) -> list[float]:
        with phases("verify"):
            texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
            scores = [verify_example(text, Row(a, json.loads(m))).reward for text, a, m in zip(texts, answer, meta)]
        rewards.extend(scores)
        return scores

    def step_fields() -> dict:
        logged = trainer.state.log_history[-1] if trainer.state.log_history else {}  # the step before's
        return {"reward_mean": sum(rewards) / max(1, len(rewards)), "prompts": prompt_ids[-1] if prompt_ids else None,
                "sampling": {k: v for k, v in logged.items() if k.startswith("sampling/")}}

    timer = step_timer(phases, args.out, rewards.clear, step_fields)
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[timer])
    trainer._generate_single_turn = phases.timed("generate", trainer._generate_single_turn)
    tokenize = trainer._tokenize_prompts

    def recorded_tokenization(prompts: list, *a: Any, **k: Any) -> Any:
        result = tokenize(prompts, *a, **k)
        distinct = list(dict.fromkeys(tuple(ids) for ids in result[0]))  # each prompt once, not once per sample
        prompt_ids.append(prompt_digest([list(ids) for ids in distinct]))
        return result

    trainer._tokenize_prompts = recorded_tokenization
    train_timed(trainer, phases)


if __name__ == "__main__":
    main()
