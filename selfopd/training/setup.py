"""From a config to a ready `Run`: data, split, templates, the student and its optimizer
(restored from a checkpoint when resuming), the engines, every teacher (opened once:
`selfopd.training.teachers`), and the checks that must pass before the first step. Data and templates load first, so a mistake in them fails before
any model loads or server starts."""

from __future__ import annotations

import contextlib
import math
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from selfopd.config import VLLM_KINDS, ConfigError, TrainConfig
from selfopd.data import load_examples
from selfopd.core.devices import use_device
from selfopd.core.distributed import World, current_world, init_process_group, load_optimizer_state, shard_model
from selfopd.training.ema import EmaWeights
from selfopd.engines.build import load_model, model_options
from selfopd.training.engines import open_training_engines
from selfopd.data.routing import open_router
from selfopd.data.example import Example
from selfopd.engines.compiled import compile_decoder_layers
from selfopd.engines.lora import adapters_off, prepare_student, trainable_parameters
from selfopd.core.file_checks import checkpoint_problem
from selfopd.core.run_folder import CheckpointError, RunFolder
from selfopd.core.torch_files import load_data
from selfopd.training.sharded_checkpoint import ShardedWriter, is_sharded_checkpoint, load_sharded
from selfopd.training.state import Run
from selfopd.training.teachers import check_teacher_tokens, open_teachers, plan_teachers
from selfopd.engines.scoring import check_plain_head
from selfopd.data.mixture import by_task
from selfopd.data.split import split_examples
from selfopd.run.templates import load_run_template
from selfopd.templating.templates import (
    PromptTemplate,
    TemplateError,
    check_student_template,
    render_student,
)
from selfopd.episodes.prompt_tools import check_student_tools
from selfopd.training.grading import student_format
from selfopd.run.evaluate import checked_eval_data
from selfopd.training.rollout_pipeline import open_pipeline
from selfopd.training.weight_checks import (check_frozen_teacher, check_probe, check_sampler, check_teacher_replicas,
                                            probe_logprobs, sync_weights)

PROBE_COMPLETION = "Let me think step by step. The answer is 42."


def build_run(config: TrainConfig, resume_from: Path | None = None,
              claim: Callable[[], contextlib.AbstractContextManager] | None = None) -> Run:
    """Load data, templates and models, then start the engines; restore a checkpoint when resuming.

    Data and templates load first, so a mistake in them fails before any server starts.
    `claim` (the trainer's: create and lock the run folder) is entered once every input
    has passed its checks, before any engine starts, and held until the run closes: a bad
    input leaves no run folder behind."""
    if config.model.threads:
        torch.set_num_threads(config.model.threads)
    torch.manual_seed(config.run.seed)
    world = current_world()
    check_world(config, world)
    options = model_options(config.model, world)
    use_device(options["device"])  # before any NCCL endpoint or CUDA tensor is made
    # Collectives wait at most as long as rank 0 may take to start vLLM servers, plus 30 minutes.
    init_process_group(world, options["device"], timeout_s=config.engine.startup_timeout_s + 1800)

    folder = RunFolder.of(config.run.out_dir, config.run.name)
    examples = load_examples(config.data.spec)
    train_examples, eval_examples = split_examples(examples, eval_size=config.data.eval_size, seed=config.data.split_seed)
    check_mixture(config, train_examples)
    eval_data = checked_eval_data(config, train_examples)  # eval.data: refused before the run folder is made
    # A resumed run renders from its own copies of the templates (RUN/templates/), a fresh one from the files.
    student_template = load_run_template(folder.root, config.data.student_template)
    eval_template = load_eval_template(config, folder.root, eval_data or eval_examples)
    route = open_router(config, train_examples, eval_examples)
    teachers = plan_teachers(config, folder.root, student_template, route, train_examples, eval_examples)

    if config.engine.kind == "vllm":  # a refused GPU layout stops the run before the model loads
        from selfopd.serving.launch import node_trainer_gpus
        from selfopd.training.engines import run_layout

        run_layout(config, node_trainer_gpus(world))
    sharded_from = resume_from if resume_from is not None and is_sharded_checkpoint(resume_from) else None
    # A sharded checkpoint's weights load once the model is sharded (onto the base weights, replaced whole).
    model, tokenizer = load_model(config.model.student, config.model.dtype,
                                  weights=None if sharded_from else resume_from,
                                  gradient_checkpointing=config.model.gradient_checkpointing,
                                  master_weights=not config.model.lora, **options)
    check_plain_head(model, f"model.student {config.model.student}")
    # Another tokenizer is refused (or, with teacher.tokenizer = 'own', bridged) before the run folder is claimed.
    teachers = check_teacher_tokens(config, teachers, model, tokenizer, student_template, eval_data or eval_examples)
    model = prepare_student(model, config.model, resume_from)  # LoRA adapters, when model.lora_rank > 0
    if config.model.compile_layers and not compile_decoder_layers(model):
        raise ConfigError("model.compile_layers", f"{type(model).__name__} has no decoder layers that transformers "
                          "marks (GradientCheckpointingLayer) to compile; set it to false")
    shard_model(model, world)  # before the optimizer: it must hold the sharded parameters
    optimizer = adamw(trainable_parameters(model), config)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(config))
    step, state = 0, {}
    if resume_from is not None:
        state = load_trainer_state(resume_from)
        if sharded_from is not None:
            load_sharded(model, optimizer, sharded_from, world)  # weights and optimizer, on any number of ranks
        elif not state["optimizer"]:  # a sharded checkpoint's trainer state, its shards gone
            raise CheckpointError(f"{resume_from}: its trainer state holds no optimizer state, which a sharded "
                                  "checkpoint keeps under dcp/, and there is no dcp/ folder; resume from a whole copy")
        else:
            load_optimizer_state(model, optimizer, state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        step = state["step"]
    probe_prompt = student_format(config, tokenizer).prompt_ids(render_student(student_template,
                                                                               (eval_examples or eval_data)[0]))
    probe = (probe_prompt, tokenizer.encode(PROBE_COMPLETION, add_special_tokens=False))
    check_student_tools(config.rollout, student_format(config, tokenizer))  # before the run folder is claimed

    resources = contextlib.ExitStack()
    try:
        if claim is not None:
            resources.enter_context(claim())
        student_engine, teacher_engine = open_training_engines(config, model, tokenizer, folder.logs, resources, world)
        run = Run(config, folder, model, tokenizer, optimizer, scheduler, student_engine, student_template,
                  open_teachers(config, teachers, model, tokenizer, student_engine, teacher_engine, world),
                  train_examples, eval_examples, probe, step, resources, device=options["device"], world=world,
                  eval_data=eval_data, eval_template=eval_template, route=route,
                  ema=open_ema(config, teacher_engine, resume_from, state.get("ema"), options))
        if config.run.checkpoint_format == "sharded":
            run.checkpoint_writer = ShardedWriter(world, background=config.run.checkpoint_async)
        run.rollouts = open_pipeline(run.student_side, resume_from, run.step)  # with the rollouts a checkpoint had sampled ahead
        resources.callback(run.rollouts.close)  # before the servers stop: no request outlives them
        if config.engine.kind in VLLM_KINDS:
            # vLLM starts from the model folder (or was running already): give it the
            # trainer's weights (a resumed checkpoint's, say) before the first rollout.
            sync_weights(run)
            check_probe(run)
            check_sampler(run)
            if config.loss.divergence == "topk_reverse_kl":
                check_teacher_top_k(run.teacher.engine, config.loss.top_k, probe)
        if config.teacher.kind == "frozen":
            check_frozen_teacher(run, initial_probe_logprobs(run, resume_from, options))
        check_teacher_replicas(run)  # several teacher servers serve one teacher, or the run stops here
    except BaseException:
        resources.close()
        raise
    return run


def resume_checkpoint(folder: RunFolder) -> Path:
    """The checkpoint a resumed run continues from: the newest complete one. A newer one that is
    not complete (a write cut short, a damaged copy) is named in a warning line and skipped; the
    steps after the chosen one run again."""
    skipped = []
    for checkpoint in reversed(folder.checkpoint_folders()):
        problem = checkpoint_problem(checkpoint, RunFolder.trainer_state(checkpoint))
        if problem is None:
            for why in skipped if current_world().is_main else ():
                print(f"selfopd: warning: skipping an incomplete checkpoint: {why}; resuming from {checkpoint}, "
                      "the newest complete one (the steps after it run again)", file=sys.stderr)
            return checkpoint
        skipped.append(problem)
    if skipped:
        raise CheckpointError(f"{folder.root}: no complete checkpoint to resume from ({'; '.join(skipped)}); "
                              "delete the folder and start the run again")
    raise FileNotFoundError(f"{folder.root}: no checkpoint to resume from (the run stopped before its first "
                            "checkpoint: delete the folder and start the run again)")


def load_trainer_state(checkpoint: Path) -> dict[str, Any]:
    """A checkpoint's trainer state (optimizer, scheduler, step, an `ema` teacher's average), read
    as data only (`weights_only`: tensors, numbers, strings, lists, dicts): a file that asks
    for anything else (a pickle made elsewhere, which could run code) is refused, never run."""
    path = RunFolder.trainer_state(checkpoint)
    state = load_data(path, "a trainer state", "resume from a checkpoint selfopd wrote, or start the run again")
    if not (isinstance(state, dict) and isinstance(state.get("optimizer"), dict)
            and isinstance(state.get("scheduler"), dict) and type(state.get("step")) is int and state["step"] >= 0):
        raise CheckpointError(f"{path}: not a trainer state (expected optimizer, scheduler and step)")
    return state


def check_teacher_top_k(engine: Any, top_k: int, probe: tuple[list[int], list[int]]) -> None:
    """A vLLM teacher asked for more top-k logprobs than its --max-logprobs refuses the first scoring
    request of the first step; ask once at start instead (launched servers get enough)."""
    from selfopd.serving.server import ServerError

    try:
        engine.score([probe], top_k=top_k)
    except ServerError as error:
        raise ConfigError("loss.top_k", f"is {top_k}, which the teacher engine refuses ({error}); start the teacher "
                          f"server with --max-logprobs {top_k} or more, or lower loss.top_k") from None


def open_ema(config: TrainConfig, teacher_engine: Any, resume_from: Path | None, saved: dict | None,
             options: dict) -> EmaWeights | None:
    """teacher.kind = 'ema': the average, from the initial weights or a checkpoint's average. In
    process it is the teacher engine's own copy; a vLLM teacher is sent it (a float32 copy here)."""
    if config.teacher.kind != "ema":
        return None
    if resume_from is not None and saved is None:
        raise ConfigError("teacher.kind", f"{resume_from} holds no EMA weights: the run was not started with "
                          "teacher.kind = 'ema'")
    if config.engine.teacher_in_process:
        model = teacher_engine.model
    else:
        model = load_model(config.model.student, "float32", frozen=True, **options)[0]
    ema = EmaWeights(model, config.teacher.ema_rate)
    if saved is not None:
        ema.load_state_dict(saved)
    return ema


def load_eval_template(config: TrainConfig, run_dir: Path, examples: Sequence[Example]) -> PromptTemplate | None:
    """eval.student_template's template (None when the eval renders the student's), checked as a student
    template and rendered once on the first eval item, so that a bad one fails before any model loads
    (one line naming the key)."""
    name = config.eval.template(config.data.student_template)
    if name == config.data.student_template:
        return None
    try:
        template = load_run_template(run_dir, name)
        check_student_template(template)
        render_student(template, examples[0])
    except TemplateError as error:
        raise ConfigError("eval.student_template", str(error)) from None
    return template


def initial_probe_logprobs(run: Run, resume_from: Path | None, options: dict) -> torch.Tensor:
    """The probe's logprobs under the run's initial weights, which a frozen teacher must serve:
    the student itself at the start, the base model (adapters off) with LoRA, else a fresh load."""
    config, model, precision = run.config, run.model, run.config.model.dtype
    if config.model.lora:  # the initial weights are the base ones: the adapters off, no second load
        with adapters_off(model):
            return probe_logprobs(model, run.probe, run.pad_id, precision)
    if resume_from is None:
        return probe_logprobs(model, run.probe, run.pad_id, precision)
    initial = load_model(config.model.student, config.model.dtype, **options)[0]
    shard_model(initial, run.world)
    return probe_logprobs(initial, run.probe, run.pad_id, precision)


def check_world(config: TrainConfig, world: World) -> None:
    """What torchrun cannot run. Any rollout.prompts_per_step is shared by any number of ranks: each takes
    ceil(prompts / ranks), the last ones filled up with padding that weighs nothing (`padded_share`)."""
    if not world.distributed:
        return
    if config.engine.kind == "vllm_colocate":
        raise ConfigError("engine.kind", f"'vllm_colocate' is the one-GPU mode; under torchrun ({world.size} "
                          "processes) use engine.kind = 'vllm' (servers on their own GPUs) or 'local'")
    if config.model.device.startswith("cuda:"):
        raise ConfigError("model.device", f"{config.model.device!r} would put every rank on one GPU; under torchrun "
                          "use 'auto' or 'cuda': each rank takes the GPU of its LOCAL_RANK")
    if config.teacher.kind == "ema":
        raise ConfigError("teacher.kind", f"'ema' under torchrun ({world.size} processes) is not supported: the "
                          "average is kept on one process; train an 'ema' teacher on one process")
    if config.engine.kind == "vllm" and config.model.lora:
        raise ConfigError("model.lora_rank", "LoRA with vLLM servers under torchrun is not supported: the merged "
                          "weights are built on one process; train LoRA on one process or with engine.kind = 'local'")


def check_mixture(config: TrainConfig, train_examples: list) -> None:
    """A mixture's steps take an equal share of prompts from each task: a whole number each."""
    tasks = by_task(train_examples)
    if len(tasks) > 1 and config.rollout.prompts_per_step % len(tasks):
        raise ConfigError("rollout.prompts_per_step", f"must be a multiple of the {len(tasks)} tasks of data.spec "
                          f"({', '.join(tasks)}), got {config.rollout.prompts_per_step}: each step takes an equal "
                          "share of prompts from each task")


def adamw(params: Any, config: TrainConfig) -> torch.optim.AdamW:
    """AdamW with torch's fused kernel: one pass over every parameter (CPU and CUDA), where the
    default for-loop implementation took about 10x TRL's optimizer time on the CPU. It rounds
    differently from the for-loop one (measured and bounded in tests/training/test_speedups.py)."""
    return torch.optim.AdamW(params, lr=config.optim.lr, betas=(config.optim.beta1, config.optim.beta2),
                             weight_decay=config.optim.weight_decay, fused=True)


def _lr_lambda(config: TrainConfig):
    warmup, steps, schedule = config.optim.warmup_steps, config.run.steps, config.optim.schedule

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        if schedule == "cosine":
            return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        if schedule == "linear":
            return max(0.0, 1 - progress)
        return 1.0

    return factor
