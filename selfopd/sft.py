"""`selfopd sft`: supervised fine-tuning that makes a stronger teacher sharing the student's tokenizer.

The off-policy warm-up the OPD literature recommends, and a way to get an `external`
teacher offline: fine-tune the student model on correct answers, then hand the result to
`selfopd train --set teacher.kind=external --set teacher.model=OUT_DIR/NAME/model`.

An SFT config is a training config (the `[run]`, `[model]`, `[data]`, `[optim]` and `[eval]`
sections, same keys, same defaults) plus an `[sft]` section with only what is SFT's own, so
`selfopd sft experiments/demo.toml` makes a teacher on the demo's data and split. The
held-out split is `selfopd train`'s whenever both name the same data, and the model folder
records the prompts it trained on: `selfopd train` refuses an external teacher that trained
on the run's held-out prompts, and `selfopd sft --student-run RUN` refuses before training.

Targets (what the model learns to write after the *student* prompt): `selfopd.sft_targets`.

OUT_DIR/NAME/ holds config.toml, targets.jsonl, eval/{base,tuned}/, summary.json,
README.md and model/ (HF weights + tokenizer), written under a staging name and renamed
into place with its `selfopd_sft.json` marker inside: a folder with the marker is
finished, and `run_sft` returns it again without retraining.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import random
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, Sequence

from selfopd.config import SECTIONS, TrainConfig, build_config
from selfopd.example import Example, prompt_key
from selfopd.settings import ConfigError, Section, build_sections, fail, flatten, load_document, section_toml, setting
from selfopd.sft_report import NLL_PROBE_SIZE, dropped_targets, sft_headline, sft_report, sft_summary
from selfopd.sft_targets import Target, resolve_targets, sampled_targets, solution_targets

Targets = Literal["auto", "solution", "sampled"]
MARKER = "selfopd_sft.json"  # inside the model folder: written before the rename, so present = finished
USED_SECTIONS = ("run", "model", "data", "optim", "eval")  # the training sections an SFT run reads
# Settings that do not change the result: a finished folder is reused whatever they say.
NOT_COMPARED = ("model.threads", "run.progress", "run.name", "run.out_dir", "run.steps", "run.eval_every",
                "run.checkpoint_every", "run.rollouts_to_save", "optim.lr", "optim.beta1", "optim.beta2",
                "optim.warmup_steps", "optim.schedule", "optim.micro_batch_prompts", "sft.name",
                "run.trackers", "run.wandb_project", "run.wandb_mode")


@dataclass(frozen=True)
class SftSection(Section):
    """The `[sft]` table: what only fine-tuning has. Model, data and its split, seed, eval
    budget, weight decay and clipping come from the training sections."""

    SECTION: ClassVar[str] = "sft"
    name: str = setting("sft-teacher", "Name of the SFT run: its folder is run.out_dir/NAME, the model NAME/model.")
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
    train_examples: int = setting(
        512, "Training items used: a seeded sample of at most this many from the train split (0: all).")
    epochs: int = setting(1, "Passes over the kept targets.")
    lr: float = setting(3e-5, "AdamW learning rate of the fine-tuning (constant; optim.lr is the OPD run's).")
    batch_size: int = setting(16, "Targets per optimizer step (cross-entropy averaged over their completion tokens).")

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("name", "sample_template"):
            self._non_empty(name)
        if any(c in self.name for c in "/\\") or self.name in (".", ".."):
            fail(self._key("name"), f"must be a plain folder name (no '/', '\\', '.' or '..'), got {self.name!r}")
        for name in ("samples_per_prompt", "max_tokens", "max_target_tokens", "epochs", "batch_size"):
            self._at_least(name, 1)
        for name in ("train_examples", "temperature"):
            self._at_least(name, 0)
        if not self.lr > 0:
            fail(self._key("lr"), f"must be > 0, got {self.lr!r}")
        if self.samples_per_prompt > 1 and self.temperature == 0:
            fail(self._key("samples_per_prompt"),
                 f"is {self.samples_per_prompt} but sft.temperature is 0: greedy samples are identical")


SFT_SECTIONS: dict[str, type[Section]] = {**SECTIONS, "sft": SftSection}


@dataclass(frozen=True)
class SftConfig:
    """Everything `selfopd sft` reads: the training sections it uses, and `[sft]`."""

    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    sft: SftSection = dataclasses.field(default_factory=SftSection)

    @property
    def run_dir(self) -> Path:
        return Path(self.train.run.out_dir) / self.sft.name

    @property
    def model_dir(self) -> Path:
        return self.run_dir / "model"

    def flat(self) -> dict[str, Any]:
        """`{"section.key": value}` of every setting it reads."""
        return flatten({**{name: getattr(self.train, name) for name in USED_SECTIONS}, "sft": self.sft})


# --------------------------------------------------------------------------- config


def build_sft_config(tables: dict[str, Any]) -> SftConfig:
    """An SftConfig from TOML tables: the training sections and `[sft]` (any may be absent)."""
    tables = dict(tables)
    sft = build_sections({"sft": tables.pop("sft")}, SFT_SECTIONS)["sft"] if "sft" in tables else SftSection()
    return SftConfig(build_config(tables), sft)


def load_sft_config(path: str | Path | None, overrides: Sequence[str] = ()) -> SftConfig:
    """The SFT config in the TOML file at `path` (None: all defaults; a training config such as
    experiments/demo.toml works too) with `--set section.key=value` overrides (`sft.lr=3e-5`,
    `data.eval_size=100`); errors name the file or the `--set` the bad value came from."""
    return load_document(path, overrides, SFT_SECTIONS, build_sft_config)


def sft_config_to_toml(config: SftConfig) -> str:
    """The sections an SFT run reads, every field with its help; `load_sft_config` of it gives
    the same settings (sections it does not read keep their defaults)."""
    tables = ["\n".join(section_toml(name, getattr(config.train, name))) for name in USED_SECTIONS]
    return "\n\n".join([*tables, "\n".join(section_toml("sft", config.sft))]) + "\n"


def _compared(flat: dict[str, Any]) -> dict[str, Any]:
    """The settings that decide the model, as the marker stores them (JSON: tuples are lists)."""
    return {k: v for k, v in json.loads(json.dumps(flat)).items() if k not in NOT_COMPARED}


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

    sft, optim, seed = config.sft, config.train.optim, config.train.run.seed
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=sft.lr, weight_decay=optim.weight_decay)
    steps_per_epoch = -(-len(targets) // sft.batch_size)
    losses: list[float] = []
    model.train()
    bar = tqdm(total=steps_per_epoch * sft.epochs, desc="sft", unit="step", disable=not progress)
    for epoch in range(sft.epochs):
        order = list(range(len(targets)))
        random.Random(f"{seed}/sft/{epoch}").shuffle(order)
        for start in range(0, len(order), sft.batch_size):
            batch = [targets[i] for i in order[start : start + sft.batch_size]]
            logprobs, mask = completion_logprobs(model, [(t.prompt_ids, t.completion_ids) for t in batch], pad_id)
            loss = -(logprobs * mask).sum() / mask.sum()
            loss.backward()
            if optim.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), optim.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            bar.set_postfix(epoch=epoch + 1, loss=f"{losses[-1]:.3f}")
            bar.update(1)
    bar.close()
    model.eval()
    return losses


# --------------------------------------------------------------------------- the run


def run_sft(config: SftConfig, progress: bool = True, student_run: Path | None = None) -> Path:
    """Fine-tune, evaluate before and after, save; returns the model folder (OUT_DIR/NAME/model).

    A finished folder made with the same config is returned at once, without retraining; one
    made with a different config is refused (FileExistsError) rather than silently reused.
    `student_run`: a training run whose held-out prompts the teacher must never train on
    (refused, before any model loads, if it would).
    """
    finished = _finished_config(config.model_dir)
    if finished is not None:
        then, now = _compared(finished), _compared(config.flat())
        if then != now:
            differ = sorted(k for k, v in now.items() if then.get(k) != v)
            raise FileExistsError(
                f"{config.model_dir} holds an SFT model made with another config (differs in: "
                f"{', '.join(differ)}); choose another sft.name or delete that folder")
        print(f"reusing the finished SFT model at {config.model_dir} (no retraining)")
        return config.model_dir

    started = time.perf_counter()
    train_all, held_out, student_template, sample_template = _load_inputs(config)
    chosen = _choose_training_items(train_all, config)
    if student_run is not None:
        check_teacher_prompts(student_run, {prompt_key(e.prompt) for e in chosen})
    kind = resolve_targets(config.sft.targets, chosen)

    import torch
    from selfopd.devices import autocast
    from selfopd.engines.base import SamplingParams
    from selfopd.engines.build import load_model, model_options
    from selfopd.engines.local import LocalEngine
    from selfopd.evaluate import evaluate

    sft, seed, eval_config = config.sft, config.train.run.seed, config.train.eval
    if config.train.model.threads:
        torch.set_num_threads(config.train.model.threads)
    torch.manual_seed(seed)
    options = model_options(config.train.model)  # model.device, attention kernel; bf16: fp32 master + autocast
    model, tokenizer = load_model(config.train.model.student, config.train.model.dtype,
                                  gradient_checkpointing=config.train.model.gradient_checkpointing, **options)
    model.eval()
    compute = functools.partial(autocast, options["device"], config.train.model.dtype)
    engine = LocalEngine(model, tokenizer, batch_size=eval_config.batch_size)
    run_dir = config.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(sft_config_to_toml(config))
    seconds: dict[str, float] = {}

    def evaluated(label: str) -> tuple[Any, list[Any]]:
        began = time.perf_counter()
        with compute():
            result = evaluate(engine, tokenizer, held_out, student_template, eval_config.max_tokens,
                              eval_config.batch_size, out_dir=run_dir / "eval" / label, progress=progress)
        seconds[f"eval_{label}"] = time.perf_counter() - began
        return result

    base, base_records = evaluated("base")
    print(f"base held-out accuracy: {base}")

    began = time.perf_counter()
    if kind == "solution":
        targets, stats = solution_targets(tokenizer, chosen, student_template, _end_id(model, tokenizer),
                                          sft.max_target_tokens)
    else:
        params = SamplingParams(max_tokens=sft.max_tokens, temperature=sft.temperature, n=sft.samples_per_prompt,
                                seed=seed)
        with compute():
            targets, stats = sampled_targets(engine, tokenizer, chosen, student_template, sample_template, params,
                                             eval_config.batch_size, progress)
    seconds["targets"] = time.perf_counter() - began
    _write_targets(run_dir / "targets.jsonl", targets)
    print(f"targets ({kind}): {dropped_targets(dataclasses.asdict(stats))}")
    if not targets:
        fail("sft.targets", f"no {kind} target survived the verifier ({stats.drawn} drawn): nothing to train on")

    began = time.perf_counter()
    probe = _nll_probe(targets, seed)
    with compute():
        nll_before = completion_nll(model, probe, engine.pad_id, eval_config.batch_size)
        losses = train_sft(model, targets, engine.pad_id, config, progress)
        nll_after = completion_nll(model, probe, engine.pad_id, eval_config.batch_size)
    seconds["train"] = time.perf_counter() - began
    print(f"NLL per token of {len(probe)} training targets: {nll_before:.3f} -> {nll_after:.3f}")

    tuned, tuned_records = evaluated("tuned")
    seconds["total"] = time.perf_counter() - started
    summary = sft_summary(config.train.model.student, config.train.data.spec, sft.batch_size, config.model_dir, kind,
                          stats, targets, losses, nll_before, nll_after, base, base_records, tuned, tuned_records,
                          seconds)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (run_dir / "README.md").write_text(sft_report(summary))
    _save_model(model, tokenizer, config, summary, sorted({prompt_key(e.prompt) for e in chosen}))
    print(sft_headline(summary))
    print(f"model: {config.model_dir}  (use: selfopd train CONFIG --set teacher.kind=external "
          f"--set teacher.model={config.model_dir})")
    return config.model_dir


def check_teacher_prompts(student_run: Path, trained: set[str]) -> None:
    """Refuse a teacher trained on prompts that `student_run` holds out (its split.json)."""
    from selfopd.split import SplitRecord

    try:
        record = SplitRecord.read(student_run)
    except FileNotFoundError as error:
        raise ConfigError("", str(error), source="--student-run") from None
    shared = trained & set(record.eval_prompts)
    if shared:
        raise ConfigError("data.spec", f"the teacher would train on {len(shared)} of the {len(record.eval_prompts)} "
                          f"prompts that {student_run} holds out: give it that run's data.spec, data.eval_size and "
                          "data.split_seed (then those prompts are never training items)", source="--student-run")


def teacher_trained_prompts(model_dir: str | Path) -> set[str] | None:
    """The prompt keys a model folder made by `selfopd sft` was trained on (None: not made by it)."""
    marker = Path(model_dir) / MARKER
    if not marker.is_file():
        return None
    return set(json.loads(marker.read_text()).get("trained_prompts", []))


def _load_inputs(config: SftConfig) -> tuple[list[Example], list[Example], Any, Any]:
    """Data split and templates, checked before any model loads; errors name the key."""
    from selfopd.data import DataError, load_examples
    from selfopd.split import split_examples
    from selfopd.templates import TemplateError, load_template

    data = config.train.data
    try:
        examples = load_examples(data.spec)
    except DataError as error:
        raise ConfigError("data.spec", str(error)) from None
    try:
        train, held_out = split_examples(examples, eval_size=data.eval_size, seed=data.split_seed)
    except DataError as error:
        raise ConfigError("data.eval_size", str(error)) from None
    if not train:
        fail("data.eval_size", f"leaves no training items ({len(examples)} in data.spec)")
    templates = []
    for key, name in (("data.student_template", data.student_template), ("sft.sample_template", config.sft.sample_template)):
        try:
            templates.append(load_template(name))
        except TemplateError as error:
            raise ConfigError(key, str(error)) from None
    return train, held_out, templates[0], templates[1]


def _choose_training_items(train: list[Example], config: SftConfig) -> list[Example]:
    limit = config.sft.train_examples
    if not limit or limit >= len(train):
        return train
    order = list(range(len(train)))
    random.Random(f"{config.train.run.seed}/sft/items").shuffle(order)
    return [train[i] for i in sorted(order[:limit])]


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
    """The settings a finished model folder was made with (None: not finished)."""
    marker = model_dir / MARKER
    return json.loads(marker.read_text()).get("settings", {}) if marker.is_file() else None


def _save_model(model: Any, tokenizer: Any, config: SftConfig, summary: dict[str, Any], trained: list[str]) -> None:
    """HF folder (weights, tokenizer, marker) under a staging name, then renamed into place."""
    target = config.model_dir
    staging = target.parent / f".model.partial-{uuid.uuid4().hex[:8]}"
    try:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        marker = {"settings": config.flat(), "summary": summary, "trained_prompts": trained}
        (staging / MARKER).write_text(json.dumps(marker, indent=2))
        if target.exists():  # an unfinished leftover (no marker): finished ones never get here
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
