"""TRL's DistillationTrainer on the shared config of vs_trl.py, timed per step and per phase.

Runs in the benchmark's own virtual environment (`make bench-trl` makes .venv-trl with a
pinned TRL), as `python -m experiments.benchmarks.vs_trl_trl` from the repository's root; it
imports nothing of selfopd. Reads the prompts in the order to train on them
(a JSON list, prompts_per_step per step) and writes one JSON line per step:
{"step", "wall_s", "generated_tokens", "phases": {...}, "others_cores", "prompts"} (a digest
of the step's prompt token ids).

Phases: generate (`model.generate`), student_forward and teacher_forward (the decoder's
final hidden states, with and without grad), head_divergence (TRL's chunked head + JSD
forward), backward, optimizer (the gradient clipping and the optimizer step, as selfopd's optim phase).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from experiments.benchmarks.cpu_load import others_cores, prompt_digest, snapshot


class Phases:
    """Seconds per phase within the current step."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def timed(self, name: str | Callable[[], str], function: Callable) -> Callable:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with self(name() if callable(name) else name):
                return function(*args, **kwargs)
        return wrapper


def step_timer(phases: Phases, out: Path, reset: Callable[[], None], fields: Callable[[], dict]) -> Any:
    """A TrainerCallback that times each optimizer step from its start to its end (a checkpoint write
    after it is not in it) and its optimizer phase, and appends one JSON line per step to `out`:
    {"step", "wall_s", "phases", "others_cores", **fields()}. `reset` clears a step's own records."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *_: Any, **__: Any) -> None:
            phases.seconds.clear()
            reset()
            self.start = snapshot()

        def on_pre_optimizer_step(self, *_: Any, **__: Any) -> None:
            self.optimizer_start = time.perf_counter()

        def on_optimizer_step(self, *_: Any, **__: Any) -> None:
            phases.seconds["optimizer"] = phases.seconds.get("optimizer", 0.0) + time.perf_counter() - self.optimizer_start

        def on_step_end(self, state_args: Any, state: Any, control: Any, **__: Any) -> None:
            end = snapshot()
            record = {"step": state.global_step, "wall_s": end.wall - self.start.wall, "phases": dict(phases.seconds),
                      "others_cores": others_cores(self.start, end), **fields()}
            with out.open("a") as file:
                file.write(json.dumps(record) + "\n")

    return StepTimer()


def train_timed(trainer: Any, phases: Phases) -> None:
    """Time the trainer's backward and its optimizer phase (gradient clipping too, as in selfopd's
    optim phase), print the versions that run, and train."""
    import transformers
    import trl

    trainer.accelerator.backward = phases.timed("backward", trainer.accelerator.backward)
    trainer._clip_grad_norm = phases.timed("optimizer", trainer._clip_grad_norm)
    print(json.dumps({"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__,
                      "optim": str(trainer.args.optim), "threads": torch.get_num_threads()}), flush=True)
    trainer.train()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", type=Path, required=True)
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DistillationConfig, DistillationTrainer
    from trl.trainer import distillation_trainer

    prompts = json.loads(args.prompts.read_text())
    steps = len(prompts) // args.prompts_per_step
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.padding_side = "left"
    student = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)  # frozen, the same weights
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": text}]} for text in prompts])
    scratch = tempfile.mkdtemp(prefix="vs_trl-")
    config = DistillationConfig(
        output_dir=scratch, per_device_train_batch_size=args.prompts_per_step, gradient_accumulation_steps=1,
        max_steps=steps, learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0,
        max_completion_length=args.max_tokens, temperature=1.0, top_p=1.0, top_k=0, beta=1.0,
        shuffle_dataset=False, report_to="none", logging_steps=1, save_strategy="no", use_cpu=True, bf16=False,
        seed=args.seed, max_grad_norm=1.0, dataloader_num_workers=0, disable_tqdm=True,
        gradient_checkpointing=False)  # TRL's default is on; selfopd's, and the shared config's, off
    phases = Phases()
    generated: list[int] = []
    prompt_ids: list[str] = []  # a digest of each step's prompt token ids, to check both trainers saw the same

    def step_fields() -> dict:
        return {"generated_tokens": sum(generated), "prompts": prompt_ids[-1]}

    timer = step_timer(phases, args.out, generated.clear, step_fields)
    trainer = DistillationTrainer(model=student, teacher_model=teacher, args=config, train_dataset=dataset,
                                  processing_class=tokenizer, callbacks=[timer])
    generate_one_turn = trainer._generate_single_turn

    def counted_generation(*a: Any, **k: Any) -> Any:
        with phases("generate"):
            completions = generate_one_turn(*a, **k)
        generated.extend(len(c) for c in completions)
        return completions

    trainer._generate_single_turn = counted_generation
    tokenize = trainer._tokenize_prompts

    def recorded_tokenization(*a: Any, **k: Any) -> Any:
        result = tokenize(*a, **k)
        prompt_ids.append(prompt_digest(result[0]))
        return result

    trainer._tokenize_prompts = recorded_tokenization
    trainer._get_last_hidden_state = phases.timed(
        lambda: "student_forward" if torch.is_grad_enabled() else "teacher_forward", trainer._get_last_hidden_state)
    distillation_trainer._chunked_divergence_loss = phases.timed("head_divergence",
                                                                 distillation_trainer._chunked_divergence_loss)
    train_timed(trainer, phases)


if __name__ == "__main__":
    main()
