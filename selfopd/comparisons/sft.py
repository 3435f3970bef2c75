"""`selfopd sft`: supervised fine-tuning that makes a stronger teacher sharing the student's tokenizer.

The off-policy warm-up the OPD literature recommends, and a way to get an `external`
teacher offline: fine-tune the student model on correct answers, then hand the result to
`selfopd train --set teacher.kind=external --set teacher.model=OUT_DIR/NAME/model`.

An SFT config is a training config (the `[run]`, `[model]`, `[data]`, `[optim]` and `[eval]`
sections, same keys, same defaults) plus an `[sft]` section with only what is SFT's own, so
`selfopd sft experiments/demo/demo.toml` makes a teacher on the demo's data and split. The
held-out split is `selfopd train`'s whenever both name the same data, and the model folder
records the prompts it trained on: `selfopd train` refuses an external teacher that trained
on the run's held-out prompts, and `selfopd sft --student-run RUN` refuses before training.

Targets (what the model learns to write after the *student* prompt): `selfopd.comparisons.sft_targets`.

OUT_DIR/NAME/ holds config.toml, targets.jsonl, eval/{base,tuned}/, summary.json,
README.md and model/ (HF weights + tokenizer), written under a staging name and renamed
into place with its `selfopd_sft.json` marker inside: a folder with the marker is
finished, and `run_sft` returns it again without retraining. While it trains,
OUT_DIR/NAME/checkpoint.pt (every `sft.checkpoint_every` steps, written whole and renamed
into place) holds the weights, AdamW state, position in the epochs and everything computed
before training (base eval, targets): a rerun of the same command after a kill continues
from it and ends with the model and numbers an uninterrupted run would have.
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

from selfopd.core.atomic import write_json_atomic, write_lines_atomic, write_text_atomic
from selfopd.core.models import MARKER
from selfopd.run.verifier_isolation import use_verifier_isolation
from selfopd.config import SECTIONS, TrainConfig, build_config
from selfopd.data.example import Example, prompt_key
from selfopd.config.settings import (MAX_BATCH, MAX_ITEMS, MAX_SAMPLES, MAX_STEPS, MAX_TEMPERATURE, MAX_TOKENS,
                                     ConfigError, Section, build_sections, check_folder_name, fail, flatten,
                                     load_document, section_toml, setting)
from selfopd.comparisons.sft_report import NLL_PROBE_SIZE, dropped_targets, sft_headline, sft_report, sft_summary
from selfopd.comparisons.sft_targets import Target, resolve_targets, sampled_targets, solution_targets
from selfopd.comparisons.sft_training import (Prelude, SftCheckpoint, SftState, completion_nll, read_checkpoint, train_sft,
                                  write_checkpoint)

Targets = Literal["auto", "solution", "sampled"]
CHECKPOINT = "checkpoint.pt"  # in OUT_DIR/NAME while the fine-tuning runs
USED_SECTIONS = ("run", "model", "data", "optim", "eval")  # the training sections an SFT run reads
# Settings that do not change the result: a finished folder is reused whatever they say.
NOT_COMPARED = ("model.threads", "run.progress", "run.name", "run.out_dir", "run.steps", "run.eval_every",
                "run.checkpoint_every", "run.rollouts_to_save", "optim.lr", "optim.beta1", "optim.beta2",
                "optim.warmup_steps", "optim.schedule", "optim.micro_batch_prompts", "sft.name",
                "run.trackers", "run.wandb_project", "run.wandb_mode", "sft.checkpoint_every")


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
    samples_per_prompt: int = setting(1, "sampled: completions drawn per training item (> 1 needs temperature > 0).",
                                      ge=1, most=MAX_SAMPLES)
    temperature: float = setting(
        0.0, "sampled: sampling temperature (0: greedy; with the answer in view it is mostly right).", ge=0,
        most=MAX_TEMPERATURE)
    max_tokens: int = setting(32, "sampled: most tokens per completion; unfinished completions are dropped.", ge=1,
                              most=MAX_TOKENS)
    max_target_tokens: int = setting(512, "solution: worked solutions longer than this many tokens are dropped.", ge=1,
                                     most=MAX_TOKENS)
    train_examples: int = setting(
        512, "Training items used: a seeded sample of at most this many from the train split (0: all).", ge=0,
        most=MAX_ITEMS)
    epochs: int = setting(1, "Passes over the kept targets.", ge=1, most=MAX_STEPS)
    lr: float = setting(3e-5, "AdamW learning rate of the fine-tuning (constant; optim.lr is the OPD run's).", gt=0,
                        most=1)
    batch_size: int = setting(16, "Targets per optimizer step (cross-entropy averaged over their completion tokens).",
                              ge=1, most=MAX_BATCH)
    checkpoint_every: int = setting(
        50, "Optimizer steps between checkpoints of the fine-tuning in progress (0: none); a rerun of the "
        "same command after an interruption continues from the latest.", ge=0, most=MAX_STEPS)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_folder_name(self._key("name"), self.name)
        self._non_empty("sample_template")
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
    experiments/demo/demo.toml works too) with `--set section.key=value` overrides (`sft.lr=3e-5`,
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


# --------------------------------------------------------------------------- the run (training: selfopd.comparisons.sft_training)


def run_sft(config: SftConfig, progress: bool = True, student_run: Path | None = None) -> Path:
    """Fine-tune, evaluate before and after, save; returns the model folder (OUT_DIR/NAME/model).

    A finished folder made with the same config is returned at once, without retraining; one
    made with a different config is refused (FileExistsError) rather than silently reused.
    `student_run`: a training run whose held-out prompts the teacher must never train on
    (refused, before any model loads, if it would).
    """
    use_verifier_isolation(config.train.verifier.isolation)
    finished = _finished_config(config.model_dir)
    if finished is not None:
        _refuse_other_config(config, finished, f"{config.model_dir} holds an SFT model")
        print(f"reusing the finished SFT model at {config.model_dir} (no retraining)")
        return config.model_dir

    started = time.perf_counter()
    train_all, held_out, student_template, sample_template = _load_inputs(config)
    chosen = _choose_training_items(train_all, config)
    if student_run is not None:
        check_teacher_prompts(student_run, {prompt_key(e.prompt) for e in chosen})
    kind = resolve_targets(config.sft.targets, chosen)

    import torch
    from selfopd.core.devices import autocast
    from selfopd.engines.base import SamplingParams
    from selfopd.engines.build import load_model, model_options
    from selfopd.engines.local import LocalEngine
    from selfopd.run.evaluate import evaluate
    from selfopd.templating.chat_format import ChatFormat

    sft, seed, eval_config = config.sft, config.train.run.seed, config.train.eval
    chat_kwargs = config.train.model.chat_template_kwargs
    if config.train.model.threads:
        torch.set_num_threads(config.train.model.threads)
    torch.manual_seed(seed)
    options = model_options(config.train.model)  # model.device, attention kernel; bf16: fp32 master + autocast
    model, tokenizer = load_model(config.train.model.student, config.train.model.dtype,
                                  gradient_checkpointing=config.train.model.gradient_checkpointing, **options)
    model.eval()
    # bf16: the engine opens a region per forward; `compute` is one for the fine-tuning's forwards,
    # which never caches a weight's cast across an optimizer step (selfopd.core.devices.autocast).
    compute = functools.partial(autocast, options["device"], config.train.model.dtype)
    engine = LocalEngine(model, tokenizer, batch_size=eval_config.batch_size, precision=config.train.model.dtype)
    run_dir = config.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(run_dir / "config.toml", sft_config_to_toml(config))
    checkpoint = read_checkpoint(run_dir / CHECKPOINT)
    if checkpoint is not None:
        _refuse_other_config(config, checkpoint.settings, f"{run_dir / CHECKPOINT} holds an unfinished fine-tuning")
    seconds: dict[str, float] = {}

    def evaluated(label: str) -> tuple[Any, list[Any]]:
        began = time.perf_counter()
        result = evaluate(engine, tokenizer, held_out, student_template, eval_config.max_tokens,
                          eval_config.batch_size, out_dir=run_dir / "eval" / label, progress=progress,
                          template_kwargs=chat_kwargs)
        seconds[f"eval_{label}"] = time.perf_counter() - began
        return result

    if checkpoint is None:
        base, base_records = evaluated("base")
        print(f"base held-out accuracy: {base}")

        began = time.perf_counter()
        if kind == "solution":
            targets, stats = solution_targets(ChatFormat(tokenizer, chat_kwargs), chosen, student_template,
                                              _end_id(model, tokenizer), sft.max_target_tokens)
        else:
            params = SamplingParams(max_tokens=sft.max_tokens, temperature=sft.temperature,
                                    n=sft.samples_per_prompt, seed=seed)
            targets, stats = sampled_targets(engine, ChatFormat(tokenizer, chat_kwargs), chosen, student_template,
                                             sample_template, params, eval_config.batch_size, progress,
                                             ChatFormat(tokenizer, config.train.teacher.template_kwargs(chat_kwargs)))
        seconds["targets"] = time.perf_counter() - began
        write_lines_atomic(run_dir / "targets.jsonl", (
            {"id": t.example_id, "text": t.text, "completion_tokens": len(t.completion_ids)} for t in targets))
        print(f"targets ({kind}): {dropped_targets(dataclasses.asdict(stats))}")
        if not targets:
            fail("sft.targets", f"no {kind} target survived the verifier ({stats.drawn} drawn): nothing to train on")
        with compute():
            nll_before = completion_nll(model, _nll_probe(targets, seed), engine.pad_id, eval_config.batch_size)
        before = Prelude(base, base_records, targets, stats, nll_before, dict(seconds))
        state = None
    else:
        model.load_state_dict(checkpoint.model)
        before, state = checkpoint.prelude, checkpoint.state
        base, base_records, targets, stats, nll_before = (before.base, before.base_records, before.targets,
                                                          before.stats, before.nll_before)
        seconds.update(before.seconds)
        print(f"continuing the fine-tuning from {run_dir / CHECKPOINT} (step {state.step}; base eval and "
              f"{len(targets)} targets as computed before it)")

    def save(state: SftState) -> None:
        write_checkpoint(run_dir / CHECKPOINT, SftCheckpoint(_compared(config.flat()), model.state_dict(), before, state))

    began = time.perf_counter()
    probe = _nll_probe(targets, seed)
    with compute():
        losses = train_sft(model, targets, engine.pad_id, config, progress, state, save)
        nll_after = completion_nll(model, probe, engine.pad_id, eval_config.batch_size)
    seconds["train"] = time.perf_counter() - began
    print(f"NLL per token of {len(probe)} training targets: {nll_before:.3f} -> {nll_after:.3f}")

    tuned, tuned_records = evaluated("tuned")
    seconds["total"] = time.perf_counter() - started
    summary = sft_summary(config.train.model.student, config.train.data.spec, sft.batch_size, config.model_dir, kind,
                          stats, targets, losses, nll_before, nll_after, base, base_records, tuned, tuned_records,
                          seconds)
    write_json_atomic(run_dir / "summary.json", summary)
    write_text_atomic(run_dir / "README.md", sft_report(summary))
    _save_model(model, tokenizer, config, summary, sorted({prompt_key(e.prompt) for e in chosen}))
    (run_dir / CHECKPOINT).unlink(missing_ok=True)  # the finished model replaces it
    print(sft_headline(summary))
    print(f"model: {config.model_dir}  (use: selfopd train CONFIG --set teacher.kind=external "
          f"--set teacher.model={config.model_dir})")
    return config.model_dir


def check_teacher_prompts(student_run: Path, trained: set[str]) -> None:
    """Refuse a teacher trained on prompts that `student_run` holds out (its split.json)."""
    from selfopd.data.split import SplitRecord

    try:
        record = SplitRecord.read(student_run)
    except FileNotFoundError as error:
        raise ConfigError("", str(error), source="--student-run") from None
    shared = trained & set(record.eval_prompts)
    if shared:
        raise ConfigError("data.spec", f"the teacher would train on {len(shared)} of the {len(record.eval_prompts)} "
                          f"prompts that {student_run} holds out: give it that run's data.spec, data.eval_size and "
                          "data.split_seed (then those prompts are never training items)", source="--student-run")


def _load_inputs(config: SftConfig) -> tuple[list[Example], list[Example], Any, Any]:
    """Data split and templates, checked before any model loads; errors name the key."""
    from selfopd.data import DataError, load_examples
    from selfopd.data.split import split_examples
    from selfopd.templating.templates import TemplateError, load_template

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


def _refuse_other_config(config: SftConfig, settings: dict[str, Any], what: str) -> None:
    """FileExistsError unless `settings` (a marker's, a checkpoint's) are this config's."""
    then, now = _compared(settings), _compared(config.flat())
    if then != now:
        differ = sorted(k for k, v in now.items() if then.get(k) != v)
        raise FileExistsError(f"{what} made with another config (differs in: {', '.join(differ)}); "
                              "choose another sft.name or delete that folder")


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
