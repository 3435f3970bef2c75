"""The one place that turns a config into models and in-process engines.

Every command that needs a model asks here: `selfopd train` (the trainable student and the
in-process engines that sample and score for it), `selfopd eval`, `selfopd diagnose` and `selfopd sft`
(a frozen model behind an in-process engine). Which teacher (`teacher.kind`: the live student, a
frozen copy of it, an external model) is decided here and nowhere else. vLLM's engines open from
`selfopd.serving`, and a training run's engines by engine.kind in `selfopd.training.engines`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from selfopd.config import DEFAULT_TEACHER, ConfigError, ModelConfig, TeacherConfig, TrainConfig, teacher_key, teacher_tables
from selfopd.config.teachers import pinned_revision
from selfopd.core.devices import DTYPES, attn_implementation, resolve_device
from selfopd.core.distributed import World, current_world, shard_model
from selfopd.engines.base import Engine
from selfopd.engines.local import LocalEngine
from selfopd.engines.packed import packing_problem
from selfopd.engines.lora import adapter_base, adapters_off, is_adapter_folder, load_adapted
from selfopd.core.models import from_pretrained, resolve_model
from selfopd.engines.scoring import check_plain_head
from selfopd.templating.token_bridge import ChatBoundaryError, TokenBridge, open_bridge
from selfopd.templating.tokenizer_check import check_tokenizers_compatible

def load_model(spec: str | Path, dtype: str = "float32", *, weights: Path | None = None, frozen: bool = False,
               device: torch.device | None = None, attn: str = "sdpa", gradient_checkpointing: bool = False,
               master_weights: bool = True, trust_remote_code: bool = False, revision: str = "") -> tuple[Any, Any]:
    """(model, tokenizer) of a packaged name, folder or hub id, on `device` (default CPU);
    `weights`: load the weights from that folder instead (a checkpoint of this model).
    `frozen`: eval mode, no gradients, weights in `dtype`. A trained model keeps fp32 master
    weights whatever `dtype` (which is then its autocast compute dtype, `selfopd.core.devices`),
    unless `master_weights` is False: a LoRA base, which never updates, is held in `dtype`.

    A LoRA adapter folder (a LoRA run's checkpoint), as `spec` or `weights`, loads onto its
    base: trainable adapters, or merged into a plain model when `frozen`. `trust_remote_code`
    (model.trust_remote_code) lets a folder run its own model code."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = device or torch.device("cpu")
    adapters = None
    if is_adapter_folder(weights):  # a LoRA run's checkpoint of `spec`
        folder, adapters, weights = resolve_model(spec, revision), Path(weights), None
    elif is_adapter_folder(spec):  # a LoRA checkpoint by itself (selfopd eval --model RUN/checkpoints/step_N)
        folder, adapters = adapter_base(Path(spec)), Path(spec)
    else:
        folder = resolve_model(spec, revision)
    tokenizer = from_pretrained(AutoTokenizer, folder, trust_remote_code=trust_remote_code)
    model = from_pretrained(
        AutoModelForCausalLM, weights or folder, trust_remote_code=trust_remote_code,
        dtype=torch.float32 if master_weights and not frozen else DTYPES[dtype], attn_implementation=attn,
        **({"device_map": device} if device.type == "cuda" else {}))
    if adapters is not None:
        model = load_adapted(model, adapters, trainable=not frozen)
    if frozen:
        model.eval().requires_grad_(False)
    elif gradient_checkpointing:
        # Non-reentrant: correct when the layer inputs need no grad (frozen embeddings, LoRA).
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model, tokenizer


def model_options(model: ModelConfig, world: World | None = None) -> dict[str, Any]:
    """`load_model`'s keywords from the config: device, attention kernel, trust_remote_code, the student's
    hub revision (`revision`, for model.student; a resolved folder ignores it)."""
    device = resolve_device(model.device, (world or current_world()).local_rank)
    return {"device": device, "attn": attn_implementation(model.attn_implementation, device, model.dtype),
            "trust_remote_code": model.trust_remote_code, "revision": model.revision}


def frozen_engine(spec: str | Path, config: TrainConfig, revision: str | None = None) -> LocalEngine:
    """An in-process engine over a frozen model (evaluation, diagnostics, SFT sampling); `revision`: its hub
    revision (None: the one `config` pins for `spec`)."""
    options = {**model_options(config.model), "revision": pinned_revision(config, spec) if revision is None else revision}
    model, tokenizer = load_model(spec, config.model.dtype, frozen=True, **options)
    return LocalEngine(model, tokenizer, batch_size=config.eval.batch_size)


def engines_at_start(config: TrainConfig, name: str = DEFAULT_TEACHER) -> tuple[Engine, Engine]:
    """In-process (student, teacher) engines with a run's starting weights; one engine twice
    when the teacher is the student's weights (`self`, `frozen`). These engines score the student's
    token ids, so a teacher with its own tokenizer is refused here (only `selfopd train` bridges one).
    `name`: the teacher's ('default': [teacher], else a [teachers.NAME] table)."""
    table = teacher_tables(config)[name]
    if table.tokenizer == "own":
        raise ConfigError(f"{teacher_key(name)}.tokenizer", "'own' is read by `selfopd train` only; this command "
                          "scores the student's token ids with the teacher (set teacher.tokenizer = 'student', with a "
                          "teacher that shares the student's tokenizer)")
    student = frozen_engine(config.model.student, config)
    teacher = table.weights(config.model.student)
    return student, (student if teacher == config.model.student
                     else frozen_engine(teacher, config, table.weights_revision(config.model.revision)))


def external_teacher_bridge(config: TrainConfig, tokenizer: Any, name: str = DEFAULT_TEACHER) -> TokenBridge | None:
    """An external teacher's tokenizer, checked once by `build_run` before any engine opens or
    teacher weights load. `teacher.tokenizer = 'student'`: refuse (TokenizerMismatch) a teacher
    that does not map every token to the student's ids; None. `'own'`: the bridge between the two
    tokenizers, once both chat templates pass its boundary check (`selfopd.templating.token_bridge`).
    `name`: the teacher's ('default': [teacher], else a [teachers.NAME] table)."""
    from transformers import AutoConfig, AutoTokenizer

    teacher = teacher_tables(config)[name]
    teacher_dir = resolve_model(teacher.model, teacher.revision)
    trust = config.model.trust_remote_code
    teacher_tokenizer = from_pretrained(AutoTokenizer, teacher_dir, trust_remote_code=trust)
    teacher_config = from_pretrained(AutoConfig, teacher_dir, trust_remote_code=trust)
    vocab_size = teacher_config.get_text_config().vocab_size  # a vision-language hub layout keeps it in its text config
    kwargs = teacher.template_kwargs(config.model.chat_template_kwargs)
    if teacher.tokenizer == "own":
        try:
            return open_bridge(tokenizer, teacher_tokenizer, vocab_size, config.model.student, teacher.model,
                               config.model.chat_template_kwargs, kwargs)
        except ChatBoundaryError as error:
            raise ConfigError(f"{teacher_key(name)}.tokenizer", f"'own': {error}") from None
    check_tokenizers_compatible(tokenizer, teacher_tokenizer, vocab_size, config.model.student, teacher.model, kwargs)
    return None


def open_local_engines(config: TrainConfig, model: Any, tokenizer: Any,
                       world: World = World()) -> tuple[LocalEngine, LocalEngine]:
    """(student engine, teacher engine) in process for a training run whose trainable student is `model`
    (engine.kind = 'local'): the student engine wraps `model` itself (a `self` teacher is the same engine
    with another prompt); a frozen, ema or external teacher is `open_local_teacher`'s."""
    if config.engine.compiled_sampling and world.distributed:
        raise ConfigError("engine.compiled_sampling", "is not supported under torchrun (each rank samples with the "
                          "sharded model gathered); set it to false")
    student = local_engine(config, model, tokenizer, packed=packed_sampling(config, model),
                           compiled=config.engine.compiled_sampling)
    return student, open_local_teacher(config.teacher, config, model, tokenizer, student, world)


def packed_sampling(config: TrainConfig, model: Any) -> bool:
    """engine.packed_sampling, refused (naming why) where MKL's packed products cannot run."""
    if not config.engine.packed_sampling:
        return False
    problem = packing_problem(model, config.model.dtype)
    if problem is not None:
        raise ConfigError("engine.packed_sampling", f"needs fp32 sampling on a CPU: {problem}")
    return True


def local_engine(config: TrainConfig, model: Any, tokenizer: Any, **options: Any) -> LocalEngine:
    """An in-process engine of a training run: in the run's precision (bf16: an autocast region per forward)."""
    return LocalEngine(model, tokenizer, batch_size=config.engine.batch_size, precision=config.model.dtype, **options)


def open_local_teacher(teacher: TeacherConfig, config: TrainConfig, model: Any, tokenizer: Any, student: LocalEngine,
                       world: World = World()) -> LocalEngine:
    """The in-process engine of one teacher (`[teacher]` or a `[teachers.NAME]` table): the student's own
    for `self`; a frozen copy of the initial weights for `frozen` and `ema` (whose copy
    `selfopd.training.ema` then averages in place); the external model, on the student's device and,
    under torchrun, sharded like it."""
    if teacher.kind in ("self", "none"):  # 'none': never asked to score
        return student
    options = model_options(config.model, world)
    if teacher.kind in ("frozen", "ema"):  # an `ema` teacher starts from the initial weights too
        if config.model.lora:  # the initial weights are the live student's with its adapters off: no second copy
            return local_engine(config, model, tokenizer, forward_context=lambda: adapters_off(model))
        # The student's own precision (fp32 weights, `model.dtype` autocast): the two then
        # compute alike, bit for bit at step 0. bf16 weights would differ from the student's
        # autocast by up to 0.75 nats a token (SmolLM2, measured), a teacher-student gap of noise.
        frozen, _ = load_model(config.model.student, "float32", frozen=True, **options)
        shard_model(frozen, world)
        return local_engine(config, frozen, tokenizer)
    teacher_dir = resolve_model(teacher.model, teacher.revision)
    external, teacher_tokenizer = load_model(teacher_dir, config.model.dtype, frozen=True, **options)
    check_plain_head(external, f"teacher.model {teacher.model}")
    shard_model(external, world)
    return local_engine(config, external, teacher_tokenizer)


def open_named_teachers(config: TrainConfig, model: Any, tokenizer: Any, student: Engine, default: Engine,
                        world: World = World()) -> dict[str, LocalEngine]:
    """The engines of the `[teachers.NAME]` tables, in process: teachers of the same weights share
    one engine (every `self` teacher one over the trainer's module: the student's own in process, every
    `frozen` one a single frozen copy, one per external model), and `[teacher]`'s engine is reused where
    its weights are the same."""
    def weights(teacher: TeacherConfig) -> tuple[str, str]:
        return teacher.kind, teacher.model

    live = student if getattr(student, "model", None) is model else local_engine(config, model, tokenizer)
    opened: dict[tuple[str, str], Any] = {("self", ""): live}
    if config.teacher.kind != "ema":  # an average is not the initial weights after the first step
        opened[weights(config.teacher)] = default
    engines = {}
    for name, teacher in config.teachers.items():
        if weights(teacher) not in opened:
            opened[weights(teacher)] = open_local_teacher(teacher, config, model, tokenizer, live, world)
        engines[name] = opened[weights(teacher)]
    return engines
