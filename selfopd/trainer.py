"""The OPD trainer: sample, teacher-score, advantage, loss, optimizer step, weight sync.

`train_step` is the whole algorithm and reads top to bottom. Everything else here is
set-up (`build_run`), bookkeeping (metrics, checkpoints, eval) and the outer loop.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from tqdm.auto import tqdm

from selfopd.config import ConfigError, TrainConfig, config_to_toml
from selfopd.data import load_examples
from selfopd.diagnostics.records import RolloutRecord, write_records
from selfopd.engines.base import Engine, Rollout, SamplingParams
from selfopd.engines.build import load_model, open_training_engines
from selfopd.engines.local import eval_mode, pad_token_id
from selfopd.evaluate import evaluate
from selfopd.example import Example, prompt_key
from selfopd.losses import (
    combined_advantage,
    full_vocab_divergence,
    masked_mean,
    opd_metrics,
    policy_gradient_loss,
    topk_reverse_kl,
    truncated_is_ratio,
)
from selfopd.models import resolve_model
from selfopd.scoring import completion_hidden, completion_logprobs, logprobs_from_hidden, pad_completions, tempered
from selfopd.split import SplitRecord, split_examples
from selfopd.templates import PromptTemplate, load_template, prompt_token_ids, render_student, render_teacher
from verifiers import verify_example

PROBE_COMPLETION = "Let me think step by step. The answer is 42."


class WeightSyncError(RuntimeError):
    """An engine's logprobs disagree with the trainer's after a weight update."""


@dataclass
class Run:
    """The stateful pieces of one training run; `train_step` reads and advances them."""

    config: TrainConfig
    run_dir: Path
    model: Any  # the student, trained in place
    tokenizer: Any
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    student_engine: Engine
    teacher_engine: Engine
    student_template: PromptTemplate
    teacher_template: PromptTemplate
    train_examples: list[Example]
    eval_examples: list[Example]
    probe: tuple[list[int], list[int]]
    step: int = 0
    resources: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)  # servers, clients

    def close(self) -> None:
        """Close engine clients and stop the servers this run launched."""
        self.resources.close()

    @property
    def pad_id(self) -> int:
        return pad_token_id(self.tokenizer, self.model)

    @property
    def temperature(self) -> float:
        """The policy that is trained: the distribution the student samples from, its logits
        divided by the rollout temperature (as TRL does); greedy rollouts train at 1."""
        return self.config.rollout.temperature or 1.0


@dataclass(frozen=True)
class Scored:
    """One rollout with everything the loss needs."""

    example: Example
    group: int  # index of its prompt in the step: GRPO groups
    rollout: Rollout
    reward: float
    correct: bool
    teacher_logprobs: torch.Tensor  # (T,) over the completion tokens
    teacher_prompt: list[int]
    teacher_topk: tuple[torch.Tensor, torch.Tensor] | None = None  # (T, k) ids and logprobs, when the loss needs them


def train_step(run: Run) -> dict[str, float]:
    """One OPD step; returns its metrics."""
    cfg = run.config
    timer = _PhaseTimer()
    temperature = run.temperature  # student and teacher logprobs are both at the sampling temperature

    # 1. Data and student rollouts (exact ids, sampler logprobs).
    examples = batch_for_step(run.train_examples, run.step, cfg.rollout.prompts_per_step, cfg.run.seed)
    student_messages = [render_student(run.student_template, e) for e in examples]
    prompts = [prompt_token_ids(run.tokenizer, m) for m in student_messages]
    params = SamplingParams(
        max_tokens=cfg.rollout.max_tokens,
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        n=cfg.rollout.samples_per_prompt,
        seed=cfg.run.seed * 1_000_003 + run.step,
    )
    with timer("sample"):
        groups = run.student_engine.sample(prompts, params)

    # 2. Verifier rewards, then the teacher scores the student's exact completion ids,
    #    after its own (privileged) prompt.
    with timer("verify"):
        pending = []
        for group, (example, messages, rollouts) in enumerate(zip(examples, student_messages, groups)):
            for rollout in rollouts:
                verdict = verify_example(rollout.text, example, partial_credit=cfg.loss.partial_credit)
                teacher_messages = render_teacher(run.teacher_template, example, messages, rollout.text, verdict.feedback)
                pending.append((example, group, rollout, verdict, prompt_token_ids(run.tokenizer, teacher_messages)))
    with timer("teacher"):
        # Scored in the trainer's micro-batches: with the empty-context control the teacher
        # then computes exactly what the student does, bit for bit (same batch, same padding).
        per_micro = cfg.optim.micro_batch_prompts * cfg.rollout.samples_per_prompt
        top_k = cfg.loss.top_k if cfg.loss.divergence == "topk_reverse_kl" else 0
        scores = []
        for start in range(0, len(pending), per_micro):
            micro = pending[start : start + per_micro]
            pairs = [(teacher_prompt, rollout.completion_ids) for _, _, rollout, _, teacher_prompt in micro]
            scores.extend(run.teacher_engine.score(pairs, top_k=top_k, temperature=temperature))
    scored = [
        Scored(example, group, rollout, verdict.reward, verdict.correct, score.logprobs, teacher_prompt,
               (score.topk_ids, score.topk_logprobs) if top_k else None)
        for (example, group, rollout, verdict, teacher_prompt), score in zip(pending, scores)
    ]

    # 3. Student forward/backward in micro-batches of whole prompt groups; gradients accumulate.
    run.model.train()
    total_tokens = sum(len(s.rollout.completion_ids) for s in scored)
    collected: dict[str, list[torch.Tensor]] = {"teacher": [], "student": [], "sampler": [], "advantage": [], "divergence": []}
    sampled = cfg.loss.divergence == "sampled"
    loss_total = 0.0
    with timer("train"):
        for start in range(0, len(scored), per_micro):
            micro = scored[start : start + per_micro]
            sequences = [(s.rollout.prompt_ids, s.rollout.completion_ids) for s in micro]
            hidden_BCH, tokens_BC, mask_BC = completion_hidden(run.model, sequences, run.pad_id)  # with grad
            hidden_BCH = tempered(hidden_BCH, temperature)  # the sampling distribution's logits
            student_lp_BC = logprobs_from_hidden(run.model, hidden_BCH, tokens_BC, mask_BC)
            mask_BC = mask_BC.bool()
            length = mask_BC.shape[1]
            teacher_lp_BC = pad_completions([s.teacher_logprobs for s in micro], length)
            sampler_lp_BC = pad_completions([s.rollout.sampler_logprobs for s in micro], length)
            rewards_B = torch.tensor([s.reward for s in micro])
            group_ids_B = torch.tensor([s.group for s in micro])
            # The sampled-token advantage (OPD + GRPO) is always computed: it is saved and
            # measured even when the teacher term of the loss is an exact divergence.
            advantage_BC = combined_advantage(teacher_lp_BC, student_lp_BC, mask_BC, rewards_B, group_ids_B,
                                              lambda_opd=cfg.loss.lambda_opd, lambda_rl=cfg.loss.lambda_rl)
            ratio_BC = truncated_is_ratio(student_lp_BC, sampler_lp_BC, cfg.loss.is_cap) if cfg.loss.is_cap else None
            if sampled:
                loss = policy_gradient_loss(student_lp_BC, advantage_BC, mask_BC, ratio_BC, cfg.loss.normalisation)
            else:  # the teacher term is an exact divergence; only the GRPO term stays a policy gradient
                grpo_BC = combined_advantage(teacher_lp_BC, student_lp_BC, mask_BC, rewards_B, group_ids_B,
                                             lambda_opd=0.0, lambda_rl=cfg.loss.lambda_rl)
                divergence_BC = distribution_divergence(run, micro, hidden_BCH, mask_BC)
                loss = (policy_gradient_loss(student_lp_BC, grpo_BC, mask_BC, ratio_BC, cfg.loss.normalisation)
                        + cfg.loss.lambda_opd * masked_mean(divergence_BC, mask_BC, cfg.loss.normalisation))
                collected["divergence"].append(divergence_BC.detach()[mask_BC])
            # Scale so the accumulated gradient equals one big batch's mean.
            weight = int(mask_BC.sum()) / total_tokens if cfg.loss.normalisation == "token" else len(micro) / len(scored)
            (loss * weight).backward()
            loss_total += loss.item() * weight
            for key, tensor in (("teacher", teacher_lp_BC), ("student", student_lp_BC), ("sampler", sampler_lp_BC), ("advantage", advantage_BC)):
                collected[key].append(tensor.detach()[mask_BC])

    # 4. Optimizer step (AdamW state persists across steps).
    with timer("optim"):
        grad_norm = _clip_gradients(run.model, cfg.optim.grad_clip)
        run.optimizer.step()
        run.scheduler.step()
        run.optimizer.zero_grad(set_to_none=True)
    run.step += 1

    # 5. Weight sync to the engines, then the probe proves they serve the new weights.
    with timer("sync"):
        sync_weights(run)
    with timer("probe"):
        probe_diff = check_probe(run)

    flat = {key: torch.cat(values)[None] for key, values in collected.items() if values}
    metrics = {
        "step": run.step,
        "loss/pg": loss_total,
        "optim/lr": run.scheduler.get_last_lr()[0],
        "optim/grad_norm": grad_norm,
        "probe/max_abs_diff": probe_diff,
        **opd_metrics(
            flat["teacher"], flat["student"], torch.ones_like(flat["teacher"], dtype=torch.bool),
            sampler_lp_BT=flat["sampler"], cap=cfg.loss.is_cap or None, advantage_BT=flat["advantage"],
            rewards_B=torch.tensor([s.reward for s in scored]),
        ),
        **({} if sampled else {f"loss/{cfg.loss.divergence}": flat["divergence"].double().mean().item()}),
        "reward/accuracy": sum(s.correct for s in scored) / len(scored),
        "rollout/length_mean": total_tokens / len(scored),
        "rollout/truncated_share": sum(s.rollout.finish_reason == "length" for s in scored) / len(scored),
        **timer.as_metrics(),
    }
    save_rollouts(run, scored, flat["student"][0], flat["advantage"][0], cfg.run.rollouts_to_save)
    return metrics


def distribution_divergence(run: Run, micro: Sequence[Scored], hidden_BCH: torch.Tensor,
                            mask_BC: torch.Tensor) -> torch.Tensor:
    """Per-token divergence (B, C) of the student's next-token distributions from the
    teacher's (`loss.divergence`), differentiable in the student's (tempered) hidden states;
    the teacher's are tempered alike."""
    cfg = run.config.loss
    head_VH = run.model.get_output_embeddings().weight
    length = mask_BC.shape[1]
    if cfg.divergence == "topk_reverse_kl":
        ids_BCK = torch.zeros(len(micro), length, cfg.top_k, dtype=torch.long)
        logprobs_BCK = torch.zeros(len(micro), length, cfg.top_k)
        for row, s in enumerate(micro):
            ids, logprobs = s.teacher_topk
            ids_BCK[row, : len(ids)], logprobs_BCK[row, : len(ids)] = ids, logprobs
        return topk_reverse_kl(hidden_BCH, head_VH, ids_BCK, logprobs_BCK, mask_BC)
    # In process only: the config refuses full-vocabulary losses with vLLM.
    pairs = [(s.teacher_prompt, s.rollout.completion_ids) for s in micro]
    teacher_hidden_BCH, teacher_head_VH = run.teacher_engine.completion_states(pairs, run.temperature)
    return full_vocab_divergence(hidden_BCH, head_VH, mask_BC, teacher_hidden_BTH=teacher_hidden_BCH,
                                 teacher_weight_VH=teacher_head_VH, divergence=cfg.divergence, beta=cfg.jsd_beta)


def batch_for_step(examples: Sequence[Example], step: int, size: int, seed: int) -> list[Example]:
    """The prompts of step `step`: epochs of seeded permutations, so the order depends only
    on (seed, step) and a resumed run sees the same data."""
    chosen = []
    for index in range(step * size, (step + 1) * size):
        epoch, offset = divmod(index, len(examples))
        order = list(range(len(examples)))
        random.Random(f"{seed}/{epoch}").shuffle(order)
        chosen.append(examples[order[offset]])
    return chosen


def engines_serving_student_weights(run: Run) -> list[tuple[str, Engine]]:
    """The student engine, and a `self` teacher's engine when it is a separate one."""
    engines: list[tuple[str, Engine]] = [("student", run.student_engine)]
    if run.config.teacher.kind == "self" and run.teacher_engine is not run.student_engine:
        engines.append(("teacher", run.teacher_engine))
    return engines


def sync_weights(run: Run) -> None:
    """Push the trainer's weights to every engine that serves the student's weights."""
    named = {name: param.detach() for name, param in run.model.named_parameters()}
    for _, engine in engines_serving_student_weights(run):
        engine.update_weights(named, version=run.step)


@torch.no_grad()
def probe_logprobs(model: Any, probe: tuple[list[int], list[int]], pad_id: int) -> torch.Tensor:
    """The trainer-side logprobs of the probe sequence (eval mode, no dropout)."""
    with eval_mode(model):
        return completion_logprobs(model, [probe], pad_id)[0][0]


@torch.no_grad()
def check_probe(run: Run) -> float:
    """Max |engine - trainer| logprob on a fixed sequence, over every replica of every engine
    that serves the student's weights (each student server, a `self` teacher's server);
    raises past the tolerance, naming the replica."""
    trainer_lp = probe_logprobs(run.model, run.probe, run.pad_id)
    worst = 0.0
    for name, engine in engines_serving_student_weights(run):
        for replica, score in engine.score_replicas(run.probe):
            diff = (score.logprobs - trainer_lp).abs().max().item()
            if not diff <= run.config.probe.tolerance:
                raise WeightSyncError(
                    f"after step {run.step} the {name} engine's logprobs ({replica}) differ from the trainer's by "
                    f"{diff:.3g} (tolerance probe.tolerance = {run.config.probe.tolerance}): the weight update did "
                    "not arrive")
            worst = max(worst, diff)
    return worst


@torch.no_grad()
def check_frozen_teacher(run: Run, initial_lp: torch.Tensor) -> None:
    """A `frozen` teacher must serve the initial student weights; a server given by URL may
    hold anything, so every replica is probed once at start (and on resume)."""
    for replica, score in run.teacher_engine.score_replicas(run.probe):
        diff = (score.logprobs - initial_lp).abs().max().item()
        if not diff <= run.config.probe.tolerance:
            raise WeightSyncError(
                f"the frozen teacher ({replica}) does not serve the initial student weights "
                f"({run.config.model.student}): its probe logprobs differ by {diff:.3g} (tolerance "
                f"probe.tolerance = {run.config.probe.tolerance}); give it a server of the student's initial model")


def build_run(config: TrainConfig, resume_from: Path | None = None) -> Run:
    """Load data, templates and models, then start the engines; restore a checkpoint when resuming.

    Data and templates load first, so a mistake in them fails before any server starts."""
    if config.model.threads:
        torch.set_num_threads(config.model.threads)
    torch.manual_seed(config.run.seed)

    run_dir = Path(config.run.out_dir) / config.run.name
    examples = load_examples(config.data.spec)
    train_examples, eval_examples = split_examples(examples, eval_size=config.data.eval_size, seed=config.data.split_seed)
    student_template = load_template(config.data.student_template)
    teacher_template = load_template(config.teacher.template)
    if config.teacher.kind == "external":
        check_external_teacher_split(config.teacher.model, eval_examples)

    model, tokenizer = load_model(config.model.student, config.model.dtype, weights=resume_from)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.optim.lr, betas=(config.optim.beta1, config.optim.beta2),
        weight_decay=config.optim.weight_decay,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(config))
    step = 0
    if resume_from is not None:
        state = torch.load(resume_from / "trainer_state.pt", weights_only=False)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        step = state["step"]
    probe_prompt = prompt_token_ids(tokenizer, render_student(student_template, eval_examples[0]))
    probe = (probe_prompt, tokenizer.encode(PROBE_COMPLETION, add_special_tokens=False))

    resources = contextlib.ExitStack()
    try:
        student_engine, teacher_engine = open_training_engines(config, model, tokenizer, run_dir, resources)
        run = Run(config, run_dir, model, tokenizer, optimizer, scheduler, student_engine, teacher_engine,
                  student_template, teacher_template, train_examples, eval_examples, probe, step, resources)
        if config.engine.kind == "vllm":
            # Servers start from the model folder (or were running already): give them the
            # trainer's weights (a resumed checkpoint's, say) before the first rollout.
            sync_weights(run)
            check_probe(run)
        if config.teacher.kind == "frozen":
            initial = model if resume_from is None else load_model(config.model.student, config.model.dtype)[0]
            check_frozen_teacher(run, probe_logprobs(initial, probe, run.pad_id))
    except BaseException:
        resources.close()
        raise
    return run


def check_external_teacher_split(teacher: str, eval_examples: Sequence[Example]) -> None:
    """An external teacher made by `selfopd sft` must not have trained on this run's held-out
    prompts (it records what it trained on); other teachers cannot be checked."""
    from selfopd.sft import teacher_trained_prompts

    trained = teacher_trained_prompts(resolve_model(teacher))
    shared = [e for e in eval_examples if trained and prompt_key(e.prompt) in trained]
    if shared:
        raise ConfigError("teacher.model", f"{teacher} was fine-tuned (selfopd sft) on {len(shared)} of this run's "
                          f"{len(eval_examples)} held-out prompts (e.g. {shared[0].prompt!r}): train the teacher with "
                          "this run's data, data.eval_size and data.split_seed")


def train(config: TrainConfig, resume: bool = False, initial_eval: Path | None = None) -> Path:
    """Run (or continue) training; returns the run folder.

    `initial_eval`: an eval folder (eval.jsonl + summary.json) of these very starting weights
    on this eval split, used as the step-0 eval instead of evaluating again. `selfopd
    compare` evaluates the shared base model once for all its arms."""
    run_dir = Path(config.run.out_dir) / config.run.name
    checkpoint = latest_checkpoint(run_dir) if resume else None
    if resume and checkpoint is None:
        raise FileNotFoundError(f"{run_dir}: no checkpoint to resume from")
    if not resume:
        if (run_dir / "metrics.jsonl").exists():
            raise FileExistsError(f"{run_dir} already holds a run: choose another run.name or resume it")
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.toml").write_text(config_to_toml(config))
    run = build_run(config, checkpoint)
    with contextlib.closing(run):  # stops launched servers on any exit, Ctrl-C included
        split = SplitRecord.of(config.data.spec, config.data.split_seed, run.train_examples, run.eval_examples)
        if resume:
            SplitRecord.read(run_dir).check_same(split, str(run_dir))
        else:
            split.write(run_dir)
        _train_loop(run, run_dir / "metrics.jsonl", resume, initial_eval)
    _plot(run_dir)
    return run_dir


def _train_loop(run: Run, metrics_path: Path, resume: bool, initial_eval: Path | None) -> None:
    config = run.config
    if resume:
        _truncate_metrics(metrics_path, run.step)
    elif initial_eval is not None:
        _log(metrics_path, reuse_eval(run, initial_eval))
    else:
        _log(metrics_path, run_eval(run))
    bar = tqdm(total=config.run.steps, initial=run.step, desc=config.run.name, unit="step", disable=not config.run.progress)
    while run.step < config.run.steps:
        metrics = train_step(run)
        _log(metrics_path, metrics)
        bar.set_postfix(kl=f"{metrics['opd/reverse_kl']:.3f}", acc=f"{metrics['reward/accuracy']:.2f}")
        bar.update(1)
        last = run.step == config.run.steps
        if (config.run.eval_every and run.step % config.run.eval_every == 0) or last:
            _log(metrics_path, run_eval(run))
        if (config.run.checkpoint_every and run.step % config.run.checkpoint_every == 0) or last:
            save_checkpoint(run)
    bar.close()


def run_eval(run: Run) -> dict[str, float]:
    """Greedy held-out accuracy of the current student, with its 95% interval."""
    cfg = run.config
    out_dir = run.run_dir / "eval" / f"step_{run.step:05d}"
    evaluate(run.student_engine, run.tokenizer, run.eval_examples, run.student_template,
             cfg.eval.max_tokens, cfg.eval.batch_size, out_dir=out_dir, progress=cfg.run.progress)
    return eval_metrics(run.step, out_dir)


def eval_metrics(step: int, eval_dir: Path) -> dict[str, float]:
    """The metrics.jsonl row of one eval folder, read from its summary.json, so that a
    fresh eval and a reused one log exactly the same fields."""
    summary = json.loads((eval_dir / "summary.json").read_text())
    return {
        "step": step,
        "eval/accuracy": summary["accuracy"],
        "eval/ci_low": summary["ci95"][0],
        "eval/ci_high": summary["ci95"][1],
        "eval/n": summary["n"],
        "eval/length_mean": summary["mean_completion_tokens"],
    }


def reuse_eval(run: Run, source: Path) -> dict[str, float]:
    """Copy an existing eval of the current weights in as this step's eval; its metrics.

    Refused unless it covers exactly this run's held-out ids: a stale or foreign eval
    would silently shift every paired comparison against it."""
    ids = {json.loads(line)["id"] for line in (source / "eval.jsonl").read_text().splitlines()}
    expected = {example.id for example in run.eval_examples}
    if ids != expected:
        raise ValueError(f"{source}: its eval items are not this run's held-out split "
                         f"({len(ids ^ expected)} ids differ); evaluate again")
    target = run.run_dir / "eval" / f"step_{run.step:05d}"
    shutil.copytree(source, target, dirs_exist_ok=True)
    return eval_metrics(run.step, target)


def save_checkpoint(run: Run) -> Path:
    """HF-format weights (loadable by transformers and vLLM) plus the trainer state; only
    the latest checkpoint is kept."""
    root = run.run_dir / "checkpoints"
    target = root / f"step_{run.step:05d}"
    staging = root / f".step_{run.step:05d}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    run.model.save_pretrained(staging)
    run.tokenizer.save_pretrained(staging)
    torch.save({"optimizer": run.optimizer.state_dict(), "scheduler": run.scheduler.state_dict(), "step": run.step},
               staging / "trainer_state.pt")
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    for old in root.glob("step_*"):
        if old != target:
            shutil.rmtree(old)
    return target


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = sorted((run_dir / "checkpoints").glob("step_*"))
    return found[-1] if found else None


def save_rollouts(run: Run, scored: Sequence[Scored], student_lp_N: torch.Tensor, advantage_N: torch.Tensor,
                  limit: int) -> None:
    """A bounded sample of this step's rollouts (the first `limit`, whole prompt groups
    first), for diagnostics and notebooks after the run. `student_lp_N` and `advantage_N`
    are the step's completion tokens, rollout after rollout, as the loss saw them."""
    if limit <= 0:
        return
    lengths = [len(s.rollout.completion_ids) for s in scored]
    per_rollout = zip(student_lp_N.split(lengths), advantage_N.split(lengths))
    records = [
        RolloutRecord(
            step=run.step, id=s.example.id, group=s.group, prompt_ids=s.rollout.prompt_ids,
            completion_ids=s.rollout.completion_ids, text=s.rollout.text,
            sampler_logprobs=list(s.rollout.sampler_logprobs), student_logprobs=student.tolist(),
            teacher_logprobs=s.teacher_logprobs.tolist(), advantage=advantage.tolist(), reward=s.reward,
            correct=s.correct, answer=s.example.answer,
        )
        for s, (student, advantage) in zip(scored[:limit], per_rollout)
    ]
    write_records(run.run_dir / "rollouts" / f"step_{run.step:05d}.jsonl", records)


def _clip_gradients(model: Any, max_norm: float) -> float:
    params = [p for p in model.parameters() if p.grad is not None]
    if max_norm > 0:
        return torch.nn.utils.clip_grad_norm_(params, max_norm).item()
    return torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])).item()


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


class _PhaseTimer:
    """Wall seconds per named phase of a step, and what the phases do not account for."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.started = time.perf_counter()

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def as_metrics(self) -> dict[str, float]:
        total = time.perf_counter() - self.started
        metrics = {f"time/{name}": seconds for name, seconds in self.seconds.items()}
        metrics["time/step"] = total
        metrics["time/overhead"] = total - sum(self.seconds.values())
        return metrics


def _log(path: Path, metrics: dict[str, float]) -> None:
    with path.open("a") as handle:
        handle.write(json.dumps(metrics) + "\n")


def _truncate_metrics(path: Path, step: int) -> None:
    """On resume, drop what was logged after the checkpoint: those steps run again."""
    if path.exists():
        lines = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= step]
        path.write_text("".join(line + "\n" for line in lines))


def _plot(run_dir: Path) -> None:
    from selfopd.plots import plot_training_curves, read_metrics

    plot_training_curves(read_metrics(run_dir / "metrics.jsonl"), run_dir / "plots", title=run_dir.name)
