"""`selfopd sft`: supervised fine-tuning that makes a stronger teacher sharing the student's tokenizer.

The off-policy warm-up the OPD literature recommends, and a way to get an `external`
teacher offline: fine-tune the student model on correct answers, then hand the result to
`selfopd train --set teacher.kind=external --set teacher.model=OUT_DIR/NAME/model`.

Targets (what the model is trained to write after the *student* prompt):
- "solution": the data's worked solution (`Example.solution`: gsm8k, MATH, CHAMP), with
  "The final answer is X." appended when the verifier does not already find X in it;
- "sampled": rejection sampling with privileged context. The model answers while it sees
  the teacher prompt (`sample_template`, which shows the reference answer); the verifier
  keeps correct, finished completions, and SFT trains on (student prompt -> those exact
  completion ids). The model learns to produce without the hint what it produced with it:
  off-policy distillation of the privileged teacher (STaR, rejection-sampling fine-tuning).
- "auto": "solution" when every training example has one, else "sampled".

The held-out split is `selfopd train`'s (`split_examples` with the same eval_size and
split_seed), so held-out items are never trained on, and greedy held-out accuracy is
measured before and after on the same items (paired difference with a 95% interval).

OUT_DIR/NAME/ holds config.toml, targets.jsonl, eval/{base,tuned}/, summary.json,
README.md and model/ (HF weights + tokenizer), written under a staging name and renamed
into place with its `selfopd_sft.json` marker inside: a folder with the marker is
finished, and `run_sft` returns it again without retraining.
"""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, Sequence

from selfopd.config import DEMO_DATA, ConfigError, Section, check_key, fail, field_types, parse_value, read_toml, section_toml, setting
from selfopd.example import Example

Targets = Literal["auto", "solution", "sampled"]
MARKER = "selfopd_sft.json"  # inside the model folder: written before the rename, so present = finished
# Fields that do not change the result: a finished folder is reused whatever they say.
NOT_COMPARED = ("threads",)
NLL_PROBE_SIZE = 64  # training targets whose NLL is reported before and after training


@dataclass(frozen=True)
class SftConfig(Section):
    """Everything `selfopd sft` reads: the `[sft]` table of a TOML file."""

    SECTION: ClassVar[str] = "sft"
    name: str = setting("sft-teacher", "Name of the run: its folder is OUT_DIR/NAME, the model OUT_DIR/NAME/model.")
    out_dir: str = setting("runs", "Folder that holds run folders.")
    student: str = setting(
        "smollm2-135m-instruct", "The model to fine-tune: a packaged model name, a local folder or a hub id.")
    data: str = setting(
        DEMO_DATA, "Data spec (see selfopd.data); the same spec as the OPD run keeps the same held-out split.")
    eval_size: int = setting(200, "Held-out distinct prompts, never trained on (as data.eval_size of `selfopd train`).")
    split_seed: int = setting(0, "Seed of the train / eval split (as data.split_seed of `selfopd train`).")
    student_template: str = setting("student/plain", "Prompt template the model is trained and evaluated with.")
    targets: Targets = setting(
        "auto", "What to train on: 'solution' (the data's worked solutions), 'sampled' (the model's own verified "
        "answers given the privileged sample_template), 'auto' (solution if every training item has one).")
    sample_template: str = setting(
        "teacher/answer_note", "sampled: the privileged prompt the model answers from (it may show the reference answer).")
    samples_per_prompt: int = setting(1, "sampled: completions drawn per training item (> 1 needs temperature > 0).")
    temperature: float = setting(
        0.0, "sampled: sampling temperature (0: greedy; with the answer in view it is mostly right).")
    max_tokens: int = setting(32, "sampled: most tokens per completion; unfinished completions are dropped.")
    max_target_tokens: int = setting(512, "solution: worked solutions longer than this many tokens are dropped.")
    train_examples: int = setting(512, "Training items used: a seeded sample of at most this many from the train split (0: all).")
    epochs: int = setting(1, "Passes over the kept targets.")
    lr: float = setting(3e-5, "AdamW learning rate (constant).")
    weight_decay: float = setting(0.0, "AdamW decoupled weight decay.")
    grad_clip: float = setting(1.0, "Max global gradient norm (0: no clipping).")
    batch_size: int = setting(16, "Targets per optimizer step (cross-entropy averaged over their completion tokens).")
    seed: int = setting(0, "Seeds the choice of training items, sampling and data order.")
    eval_max_tokens: int = setting(32, "Most tokens per greedy held-out answer (as eval.max_tokens of `selfopd train`).")
    eval_batch_size: int = setting(64, "Prompts per generation batch (held-out eval and sampling).")
    threads: int = setting(0, "Torch CPU threads (0: torch's default).")

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("name", "out_dir", "student", "data", "student_template", "sample_template"):
            self._non_empty(name)
        if any(c in self.name for c in "/\\") or self.name in (".", ".."):
            fail(self._key("name"), f"must be a plain folder name (no '/', '\\', '.' or '..'), got {self.name!r}")
        for name in ("eval_size", "samples_per_prompt", "max_tokens", "max_target_tokens", "epochs", "batch_size",
                     "eval_max_tokens", "eval_batch_size"):
            self._at_least(name, 1)
        for name in ("split_seed", "train_examples", "seed", "threads", "temperature", "weight_decay", "grad_clip"):
            self._at_least(name, 0)
        if not self.lr > 0:
            fail(self._key("lr"), f"must be > 0, got {self.lr!r}")
        if self.samples_per_prompt > 1 and self.temperature == 0:
            fail(self._key("samples_per_prompt"),
                  f"is {self.samples_per_prompt} but sft.temperature is 0: greedy samples are identical")

    @property
    def run_dir(self) -> Path:
        return Path(self.out_dir) / self.name

    @property
    def model_dir(self) -> Path:
        return self.run_dir / "model"


# --------------------------------------------------------------------------- config


def sft_config_from_table(table: dict[str, Any], source: str | None = None) -> SftConfig:
    """An SftConfig from the keys of an `[sft]` table; errors name `sft.KEY` and `source`."""
    try:
        if not isinstance(table, dict):
            fail("[sft]", f"expected a table, got {type(table).__name__}")
        for key in table:
            check_key("sft", SftConfig, key)
        return SftConfig(**table)
    except ConfigError as error:
        raise ConfigError(error.key, error.message, source=source or error.source) from None


def parse_sft_overrides(overrides: Sequence[str]) -> dict[str, Any]:
    """`["lr=3e-5", "sft.epochs=3"]` -> `{"lr": 3e-5, "epochs": 3}` (the `sft.` prefix is optional)."""
    parsed: dict[str, Any] = {}
    types = field_types(SftConfig)
    for override in overrides:
        path, eq, text = override.partition("=")
        key = path.strip().removeprefix("sft.")
        try:
            if not eq or not key:
                raise ConfigError("", "expected key=value, e.g. --set lr=3e-5")
            check_key("sft", SftConfig, key)
            parsed[key] = parse_value(f"sft.{key}", types[key], text)
        except ConfigError as error:
            raise ConfigError(error.key, error.message, source=f"--set {override}") from None
    return parsed


def load_sft_config(path: str | Path | None, overrides: Sequence[str] = ()) -> SftConfig:
    """The `[sft]` table of the TOML file at `path` (None: all defaults) with `--set key=value`
    overrides applied; a `--set` wins over the file, and errors name where the bad value came from."""
    table: dict[str, Any] = {}
    if path is not None:
        document = read_toml(path)
        for key in document:
            if key != "sft":
                raise ConfigError(key, "unknown section or top-level key: an SFT config has one [sft] table",
                                  source=str(path))
        table = document.get("sft", {})
        if not isinstance(table, dict):
            raise ConfigError("sft", "expected an [sft] table", source=str(path))
    values = parse_sft_overrides(overrides)
    set_by = {f"sft.{override.partition('=')[0].strip().removeprefix('sft.')}": override for override in overrides}
    table.update(values)
    try:
        return sft_config_from_table(table)
    except ConfigError as error:
        source = f"--set {set_by[error.key]}" if error.key in set_by else None if path is None else str(path)
        raise ConfigError(error.key, error.message, source=source) from None


def sft_config_to_toml(config: SftConfig) -> str:
    """The full `[sft]` table with each field's help as a comment; `load_sft_config` of it gives `config`."""
    return "\n".join(section_toml("sft", config)) + "\n"


def _compared(config: SftConfig | dict[str, Any]) -> dict[str, Any]:
    values = dataclasses.asdict(config) if isinstance(config, SftConfig) else dict(config)
    return {k: v for k, v in values.items() if k not in NOT_COMPARED}


# --------------------------------------------------------------------------- targets


@dataclass(frozen=True)
class Target:
    """One SFT pair: the student prompt's ids and the exact completion ids to learn."""

    example_id: str
    prompt_ids: list[int]
    completion_ids: list[int]
    text: str


@dataclass
class TargetStats:
    """What happened to the candidate targets (for the summary)."""

    kind: str
    items: int = 0
    drawn: int = 0
    kept: int = 0
    wrong: int = 0
    unfinished: int = 0  # sampled: hit max_tokens; solution: longer than max_target_tokens
    duplicate: int = 0
    fixed: int = 0  # solution: "The final answer is X." appended


def resolve_targets(config: SftConfig, examples: Sequence[Example]) -> str:
    """'solution' or 'sampled': what config.targets means for these training examples."""
    if config.targets != "auto":
        if config.targets == "solution":
            missing = [e.id for e in examples if not e.solution]
            if missing:
                fail("sft.targets", f"'solution' but {len(missing)} of {len(examples)} training items have no worked "
                      f"solution (e.g. {missing[0]}); use 'sampled' or 'auto'")
        return config.targets
    return "solution" if examples and all(e.solution for e in examples) else "sampled"


def solution_targets(tokenizer: Any, examples: Sequence[Example], student_template: Any, end_id: int,
                     max_target_tokens: int) -> tuple[list[Target], TargetStats]:
    """Worked solutions as completions, each verified to end in the reference answer."""
    from selfopd.templates import prompt_token_ids, render_student
    from verifiers import verify_example

    stats = TargetStats("solution", items=len(examples), drawn=len(examples))
    targets = []
    for example in examples:
        text = (example.solution or "").strip()
        if not verify_example(text, example).correct:
            text = f"{text}\n\nThe final answer is {example.answer}."
            stats.fixed += 1
            if not verify_example(text, example).correct:
                stats.wrong += 1
                continue
        completion = tokenizer.encode(text, add_special_tokens=False) + [end_id]
        if len(completion) > max_target_tokens:
            stats.unfinished += 1
            continue
        prompt = prompt_token_ids(tokenizer, render_student(student_template, example))
        targets.append(Target(example.id, prompt, completion, text))
    stats.kept = len(targets)
    return targets, stats


def sampled_targets(engine: Any, tokenizer: Any, examples: Sequence[Example], student_template: Any,
                    sample_template: Any, config: SftConfig, progress: bool = True) -> tuple[list[Target], TargetStats]:
    """Rejection sampling with privileged context: sample from the teacher prompt, keep the
    verified-correct, finished, distinct completions, paired with the *student* prompt."""
    from tqdm.auto import tqdm

    from selfopd.engines.base import SamplingParams
    from selfopd.templates import prompt_token_ids, render_student, render_teacher

    stats = TargetStats("sampled", items=len(examples))
    targets: list[Target] = []
    step = config.eval_batch_size
    for number, start in enumerate(tqdm(range(0, len(examples), step), desc="sample", unit="batch", disable=not progress)):
        batch = examples[start : start + step]
        student = [render_student(student_template, e) for e in batch]
        teacher = [prompt_token_ids(tokenizer, render_teacher(sample_template, e, m)) for e, m in zip(batch, student)]
        params = SamplingParams(max_tokens=config.max_tokens, temperature=config.temperature,
                                n=config.samples_per_prompt, seed=config.seed * 1_000_003 + number)
        for example, messages, rollouts in zip(batch, student, engine.sample(teacher, params)):
            keep, counts = select_rollouts(example, rollouts)
            for key, value in counts.items():
                setattr(stats, key, getattr(stats, key) + value)
            prompt = prompt_token_ids(tokenizer, messages)
            targets.extend(Target(example.id, prompt, list(r.completion_ids), r.text) for r in keep)
    stats.kept = len(targets)
    return targets, stats


def select_rollouts(example: Example, rollouts: Sequence[Any]) -> tuple[list[Any], dict[str, int]]:
    """The rollouts worth learning: correct by the verifier, finished (not cut at max_tokens),
    and not a repeat of one already kept; with counts of each reason to drop."""
    from verifiers import verify_example

    counts = {"drawn": len(rollouts), "wrong": 0, "unfinished": 0, "duplicate": 0}
    kept, seen = [], set()
    for rollout in rollouts:
        if rollout.finish_reason != "stop":
            counts["unfinished"] += 1
        elif not verify_example(rollout.text, example).correct:
            counts["wrong"] += 1
        elif tuple(rollout.completion_ids) in seen:
            counts["duplicate"] += 1
        else:
            seen.add(tuple(rollout.completion_ids))
            kept.append(rollout)
    return kept, counts


# --------------------------------------------------------------------------- training


def completion_nll(model: Any, targets: Sequence[Target], pad_id: int, batch_size: int = 64) -> float:
    """Mean negative log-likelihood per completion token of `targets` (no grad, eval mode)."""
    import torch

    from selfopd.scoring import completion_logprobs

    was_training = model.training
    model.eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(targets), batch_size):
            chunk = targets[start : start + batch_size]
            logprobs, mask = completion_logprobs(model, [(t.prompt_ids, t.completion_ids) for t in chunk], pad_id)
            total -= float((logprobs * mask).sum())
            tokens += int(mask.sum())
    model.train(was_training)
    return total / max(tokens, 1)


def train_sft(model: Any, targets: Sequence[Target], pad_id: int, config: SftConfig,
              progress: bool = True) -> list[float]:
    """Cross-entropy on completion tokens only (the prompt is context, never a target), AdamW,
    seeded shuffles per epoch; returns the loss of every step."""
    import torch
    from tqdm.auto import tqdm

    from selfopd.scoring import completion_logprobs

    torch.manual_seed(config.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    steps_per_epoch = -(-len(targets) // config.batch_size)
    losses: list[float] = []
    model.train()
    bar = tqdm(total=steps_per_epoch * config.epochs, desc="sft", unit="step", disable=not progress)
    for epoch in range(config.epochs):
        order = list(range(len(targets)))
        random.Random(f"{config.seed}/sft/{epoch}").shuffle(order)
        for start in range(0, len(order), config.batch_size):
            batch = [targets[i] for i in order[start : start + config.batch_size]]
            logprobs, mask = completion_logprobs(model, [(t.prompt_ids, t.completion_ids) for t in batch], pad_id)
            loss = -(logprobs * mask).sum() / mask.sum()
            loss.backward()
            if config.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            bar.set_postfix(epoch=epoch + 1, loss=f"{losses[-1]:.3f}")
            bar.update(1)
    bar.close()
    model.eval()
    return losses


# --------------------------------------------------------------------------- the run


def run_sft(config: SftConfig, progress: bool = True) -> Path:
    """Fine-tune, evaluate before and after, save; returns the model folder (OUT_DIR/NAME/model).

    A finished folder made with the same config is returned at once, without retraining; one
    made with a different config is refused (FileExistsError) rather than silently reused.
    """
    finished = _finished_config(config.model_dir)
    if finished is not None:
        if _compared(finished) != _compared(config):
            differ = sorted(k for k, v in _compared(config).items() if finished.get(k) != v)
            raise FileExistsError(
                f"{config.model_dir} holds an SFT model made with another config (differs in: "
                f"{', '.join('sft.' + k for k in differ)}); choose another sft.name or delete that folder")
        print(f"reusing the finished SFT model at {config.model_dir} (no retraining)")
        return config.model_dir

    started = time.perf_counter()
    train_all, held_out, student_template, sample_template = _load_inputs(config)
    chosen = _choose_training_items(train_all, config)
    kind = resolve_targets(config, chosen)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from selfopd.engines.local import LocalEngine
    from selfopd.evaluate import evaluate
    from selfopd.models import ModelError, resolve_model

    if config.threads:
        torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    try:
        source_dir = resolve_model(config.student)
    except ModelError as error:
        raise ConfigError("sft.student", str(error)) from None
    tokenizer = AutoTokenizer.from_pretrained(source_dir)
    model = AutoModelForCausalLM.from_pretrained(source_dir, dtype=torch.float32).eval()
    engine = LocalEngine(model, tokenizer, batch_size=config.eval_batch_size)
    run_dir = config.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(sft_config_to_toml(config))
    seconds: dict[str, float] = {}

    def evaluated(label: str) -> tuple[Any, list[Any]]:
        began = time.perf_counter()
        result = evaluate(engine, tokenizer, held_out, student_template, config.eval_max_tokens,
                          config.eval_batch_size, out_dir=run_dir / "eval" / label, progress=progress)
        seconds[f"eval_{label}"] = time.perf_counter() - began
        return result

    base, base_records = evaluated("base")
    print(f"base held-out accuracy: {base}")

    began = time.perf_counter()
    if kind == "solution":
        targets, stats = solution_targets(tokenizer, chosen, student_template, _end_id(model, tokenizer),
                                          config.max_target_tokens)
    else:
        targets, stats = sampled_targets(engine, tokenizer, chosen, student_template, sample_template, config, progress)
    seconds["targets"] = time.perf_counter() - began
    _write_targets(run_dir / "targets.jsonl", targets)
    print(f"targets ({kind}): {_dropped(dataclasses.asdict(stats))}")
    if not targets:
        fail("sft.targets", f"no {kind} target survived the verifier ({stats.drawn} drawn): nothing to train on")

    began = time.perf_counter()
    probe = _nll_probe(targets, config.seed)
    nll_before = completion_nll(model, probe, engine.pad_id, config.eval_batch_size)
    losses = train_sft(model, targets, engine.pad_id, config, progress)
    nll_after = completion_nll(model, probe, engine.pad_id, config.eval_batch_size)
    seconds["train"] = time.perf_counter() - began
    print(f"NLL per token of {len(probe)} training targets: {nll_before:.3f} -> {nll_after:.3f}")

    tuned, tuned_records = evaluated("tuned")
    seconds["total"] = time.perf_counter() - started
    summary = _summary(config, kind, stats, targets, losses, nll_before, nll_after, base, base_records, tuned,
                       tuned_records, seconds)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (run_dir / "README.md").write_text(_report(summary))
    _save_model(model, tokenizer, config, summary)
    print(_headline(summary))
    print(f"model: {config.model_dir}  (use: selfopd train CONFIG --set teacher.kind=external "
          f"--set teacher.model={config.model_dir})")
    return config.model_dir


def _load_inputs(config: SftConfig) -> tuple[list[Example], list[Example], Any, Any]:
    """Data split and templates, checked before any model loads; errors name the sft key."""
    from selfopd.data import DataError, load_examples
    from selfopd.split import split_examples
    from selfopd.templates import TemplateError, load_template

    try:
        examples = load_examples(config.data)
    except DataError as error:
        raise ConfigError("sft.data", str(error)) from None
    try:
        train, held_out = split_examples(examples, eval_size=config.eval_size, seed=config.split_seed)
    except DataError as error:
        raise ConfigError("sft.eval_size", str(error)) from None
    if not train:
        fail("sft.eval_size", f"leaves no training items ({len(examples)} in sft.data)")
    templates = []
    for key in ("student_template", "sample_template"):
        try:
            templates.append(load_template(getattr(config, key)))
        except TemplateError as error:
            raise ConfigError(f"sft.{key}", str(error)) from None
    return train, held_out, templates[0], templates[1]


def _choose_training_items(train: list[Example], config: SftConfig) -> list[Example]:
    if not config.train_examples or config.train_examples >= len(train):
        return train
    order = list(range(len(train)))
    random.Random(f"{config.seed}/sft/items").shuffle(order)
    return [train[i] for i in sorted(order[: config.train_examples])]


def _nll_probe(targets: Sequence[Target], seed: int, size: int = NLL_PROBE_SIZE) -> list[Target]:
    """A seeded sample of the training targets whose NLL is measured before and after
    training: proof that the fit happened, at a fraction of a pass over all targets."""
    if len(targets) <= size:
        return list(targets)
    return random.Random(f"{seed}/sft/probe").sample(list(targets), size)


def _end_id(model: Any, tokenizer: Any) -> int:
    """The id that ends an assistant turn (what generation stops on)."""
    eos = model.generation_config.eos_token_id
    ids = eos if isinstance(eos, list) else [eos]
    return tokenizer.eos_token_id if tokenizer.eos_token_id in ids else ids[0]


def _write_targets(path: Path, targets: Sequence[Target]) -> None:
    with path.open("w") as handle:
        for t in targets:
            handle.write(json.dumps({"id": t.example_id, "text": t.text, "completion_tokens": len(t.completion_ids)}) + "\n")


def _finished_config(model_dir: Path) -> dict[str, Any] | None:
    marker = model_dir / MARKER
    return json.loads(marker.read_text())["config"] if marker.is_file() else None


def _save_model(model: Any, tokenizer: Any, config: SftConfig, summary: dict[str, Any]) -> None:
    """HF folder (weights, tokenizer, marker) under a staging name, then renamed into place."""
    target = config.model_dir
    staging = target.parent / f".model.partial-{uuid.uuid4().hex[:8]}"
    try:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        (staging / MARKER).write_text(json.dumps({"config": dataclasses.asdict(config), "summary": summary}, indent=2))
        if target.exists():  # an unfinished leftover (no marker): finished ones never get here
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _summary(config: SftConfig, kind: str, stats: TargetStats, targets: Sequence[Target], losses: list[float],
             nll_before: float, nll_after: float, base: Any, base_records: Sequence[Any], tuned: Any,
             tuned_records: Sequence[Any], seconds: dict[str, float]) -> dict[str, Any]:
    from selfopd.evaluate import outcomes_by_prompt
    from selfopd.stats import paired_change

    difference = paired_change(outcomes_by_prompt(base_records), outcomes_by_prompt(tuned_records))
    steps_per_epoch = -(-len(targets) // config.batch_size)
    return {
        "student": config.student,
        "data": config.data,
        "targets": kind,
        "target_counts": dataclasses.asdict(stats),
        "train_pairs": len(targets),
        "train_tokens": sum(len(t.completion_ids) for t in targets),
        "steps": len(losses),
        "loss_first_epoch": sum(losses[:steps_per_epoch]) / max(len(losses[:steps_per_epoch]), 1),
        "loss_last_epoch": sum(losses[-steps_per_epoch:]) / max(len(losses[-steps_per_epoch:]), 1),
        "train_nll_targets": min(len(targets), NLL_PROBE_SIZE),
        "train_nll_before": nll_before,
        "train_nll_after": nll_after,
        "eval_n": base.n,
        "base": {"accuracy": base.value, "ci95": [base.low, base.high]},
        "tuned": {"accuracy": tuned.value, "ci95": [tuned.low, tuned.high]},
        "paired_difference": {"mean": difference.mean, "ci95": [difference.low, difference.high]},
        "seconds": seconds,
        "model": str(config.model_dir),
    }


def _verdict(summary: dict[str, Any]) -> str:
    low, high = summary["paired_difference"]["ci95"]
    if low > 0:
        return "a gain (95% interval above zero)"
    if high < 0:
        return "a LOSS (95% interval below zero)"
    return "no significant change (95% interval contains zero)"


def _headline(summary: dict[str, Any]) -> str:
    base, tuned, diff = summary["base"], summary["tuned"], summary["paired_difference"]
    return "\n".join([
        f"held-out greedy accuracy over {summary['eval_n']} distinct prompts, none trained on:",
        f"  base   {base['accuracy']:.3f} [{base['ci95'][0]:.3f}, {base['ci95'][1]:.3f}]",
        f"  tuned  {tuned['accuracy']:.3f} [{tuned['ci95'][0]:.3f}, {tuned['ci95'][1]:.3f}]",
        f"  change {diff['mean']:+.3f} [{diff['ci95'][0]:+.3f}, {diff['ci95'][1]:+.3f}] (paired): {_verdict(summary)}",
        f"  {summary['train_pairs']} {summary['targets']} targets, {summary['steps']} steps, "
        f"{summary['seconds']['total'] / 60:.1f} min",
    ])


def _dropped(counts: dict[str, Any]) -> str:
    """What became of the candidate targets, in words."""
    if counts["kind"] == "solution":
        return (f"{counts['kept']} of {counts['items']} worked solutions kept (final answer appended to "
                f"{counts['fixed']}; {counts['wrong']} still unverified, {counts['unfinished']} too long)")
    return (f"{counts['kept']} kept of {counts['drawn']} answers drawn for {counts['items']} training items "
            f"(wrong {counts['wrong']}, unfinished {counts['unfinished']}, duplicate {counts['duplicate']})")


def _report(summary: dict[str, Any]) -> str:
    counts = summary["target_counts"]
    return f"""# SFT teacher: {summary['student']} fine-tuned on {summary['targets']} targets

Data: `{summary['data']}`

```
{_headline(summary)}
```

Targets: {_dropped(counts)}; {summary['train_tokens']} completion tokens.
NLL per token of {summary['train_nll_targets']} training targets: {summary['train_nll_before']:.3f} -> \
{summary['train_nll_after']:.3f}.

Files: `config.toml` (the config), `targets.jsonl` (what was trained on), `eval/base/` and
`eval/tuned/` (per-item held-out answers), `summary.json`, `model/` (HF weights + tokenizer).

Use it as the external teacher of an OPD run (it shares the student's tokenizer):

    selfopd train experiments/demo.toml --set teacher.kind=external --set teacher.model={summary['model']} \\
        --set teacher.template=teacher/empty

(`teacher/empty`: the tuned model scores the student's tokens after the student's own prompt;
a privileged template works as well.)
"""
