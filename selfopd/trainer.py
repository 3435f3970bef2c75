"""The OPD trainer: sample, teacher-score, advantage, loss, optimizer step, weight sync.

`train_step` is the whole algorithm and reads top to bottom; `train` is the outer loop
(evals, checkpoints, metrics). Set-up is `selfopd.run_setup`, the weight checks
`selfopd.weight_checks`, what a run writes `selfopd.run_outputs` and `selfopd.tracking`.
"""

from __future__ import annotations

import contextlib
import math
import random
import warnings
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from tqdm.auto import tqdm

from selfopd import guard
from selfopd.config import FULL_VOCABULARY, TrainConfig, config_to_toml
from selfopd.context_limits import check_teacher_rows
from selfopd.credit import cure_advantage, mean_prompt_weight, opd_rollout_weights, rlsd_lambda
from selfopd.distributed import all_gather, all_sum, barrier, current_world, is_sharded, share
from selfopd.engines.base import SamplingParams, rest_engines
from selfopd.example import Example
from selfopd.faults import fault_point
from selfopd.folder_guard import check_not_in_use, check_writable, claimed_run_folder, refuse_finished, writing
from selfopd.kernels import full_vocab_divergence, topk_reverse_kl
from selfopd.loss_metrics import opd_metrics, preference_metrics
from selfopd.objectives import clipped_divergence, clipped_tokens, masked_mean, policy_gradient_loss, truncated_is_ratio
from selfopd.run_folder import RunFolder
from selfopd.run_outputs import plot_run, prune_checkpoints, reuse_eval, run_eval, save_checkpoint, save_rollouts
from selfopd.run_setup import build_run
from selfopd.run_state import Run, Scored
from selfopd.run_templates import config_template_names, save_run_templates
from selfopd.scoring import completion_hidden, logprobs_from_hidden, pad_completions, tempered
from selfopd.split import SplitRecord
from selfopd.teacher_scoring import score_in_micro_batches
from selfopd.teacher_prompts import teacher_rows
from selfopd.templates import prompt_token_ids, render_student
from selfopd.tracking import MetricsLog, PhaseTimer
from selfopd.weight_checks import WeightSyncError, check_probe, sync_weights  # noqa: F401  (WeightSyncError: public here)

SKIPPED = "nonfinite loss"  # the "skipped" value of a step whose loss or gradient was NaN or inf


class NonFiniteLoss(RuntimeError):
    """optim.max_nonfinite_steps steps in a row had a NaN or inf loss or gradient."""


class GuardStop(RuntimeError):
    """The illusion guard fired with guard.action = 'stop' (the step is checkpointed and evaluated)."""

    def __init__(self, message: str, step: int) -> None:
        super().__init__(message)
        self.step = step


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of a run folder (None: none yet)."""
    return RunFolder(run_dir).latest_checkpoint()


def train_step(run: Run) -> dict[str, float]:
    """One OPD step; returns its metrics (the same on every rank). Under model.dtype =
    'bfloat16' each forward enters its own autocast region (`run.autocast`, the engines'),
    never the whole step: see `selfopd.devices.autocast`."""
    cfg = run.config
    timer = PhaseTimer()
    temperature = run.temperature  # student and teacher logprobs are both at the sampling temperature
    world, device = run.world, run.device

    # 1. Data and student rollouts (exact ids, sampler logprobs); under torchrun this rank's
    #    share of the step's prompts, from here to the loss.
    examples = share(batch_for_step(run.train_examples, run.step, cfg.rollout.prompts_per_step, cfg.run.seed), world)
    first_group = world.rank * len(examples)
    student_messages = [render_student(run.student_template, e) for e in examples]
    prompts = [prompt_token_ids(run.tokenizer, m) for m in student_messages]
    params = SamplingParams(
        max_tokens=cfg.rollout.max_tokens,
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        n=cfg.rollout.samples_per_prompt,
        seed=cfg.run.seed * 1_000_003 + run.step,
        first_row=first_group * cfg.rollout.samples_per_prompt,
    )
    with timer("sample"):
        groups = run.student_engine.sample(prompts, params)
    fault_point("train.sampled")

    # 2. Verifier rewards, then the teacher scores the student's exact completion ids after its
    #    own (privileged) prompt, which must fit its context (`selfopd.teacher_prompts`).
    with timer("verify"):
        rows = teacher_rows(run, examples, student_messages, groups, first_group)
        check_teacher_rows([(r.example.id, ids, r.rollout.completion_ids) for r in rows
                            for ids in (r.prompt_ids, r.wrong_prompt_ids) if ids is not None], run.teacher_engine,
                           run.step + 1)
    per_micro = cfg.optim.micro_batch_prompts * cfg.rollout.samples_per_prompt
    top_k = cfg.loss.top_k if cfg.loss.divergence == "topk_reverse_kl" else 0
    with timer("teacher"):  # in the trainer's micro-batches; a full-vocabulary loss keeps the teacher's states
        scores, teacher_states = score_in_micro_batches(
            run.teacher_engine, [(r.prompt_ids, r.rollout.completion_ids) for r in rows], per_micro, top_k,
            temperature, keep_states=cfg.loss.divergence in FULL_VOCABULARY)
        wrong_scores = (score_in_micro_batches(run.teacher_engine, [(r.wrong_prompt_ids, r.rollout.completion_ids)
                                                                    for r in rows], per_micro, 0, temperature, False)[0]
                        if cfg.loss.opd_baseline == "wrong_context" else [None] * len(rows))
    scored = [
        Scored(r.example, r.group, r.rollout, r.verdict.reward, r.verdict.correct, score.logprobs, r.prompt_ids,
               (score.topk_ids, score.topk_logprobs) if top_k else None, r.demonstration,
               wrong.logprobs if wrong is not None else None)
        for r, score, wrong in zip(rows, scores, wrong_scores)
    ]

    rest_engines(run.student_engine, run.teacher_engine)  # a colocated vLLM frees the GPU until its next call

    # 3. Student forward/backward in micro-batches of whole prompt groups; gradients accumulate.
    run.model.train()
    # The loss is the mean over the whole step (all ranks): each rank weighs its micro-batches
    # by the step's totals, and FSDP's mean over ranks is undone by `world.size`.
    total_tokens = all_sum(sum(len(s.rollout.completion_ids) for s in scored), world)
    total_rollouts = len(scored) * world.size
    collected: dict[str, list[torch.Tensor]] = {"teacher": [], "student": [], "sampler": [], "advantage": [],
                                                "divergence": [], "clipped": []}
    sampled = cfg.loss.divergence == "sampled"
    opd_weight_N = _opd_weights(run, scored)
    rlsd_lam = rlsd_lambda(run.step, cfg.loss.rlsd_weight, cfg.loss.rlsd_decay_steps)
    loss_total = 0.0
    with timer("train"):
        for index, start in enumerate(range(0, len(scored), per_micro)):
            micro = scored[start : start + per_micro]
            sequences = [(s.rollout.prompt_ids, s.rollout.completion_ids) for s in micro]
            with run.autocast():  # the decoder only: the head and log-softmax run in fp32 (selfopd.kernels)
                hidden_BCH, tokens_BC, mask_BC = completion_hidden(run.model, sequences, run.pad_id)  # with grad
            hidden_BCH = tempered(hidden_BCH, temperature)  # the sampling distribution's logits
            # Differentiated only by a policy-gradient term; else read for the advantage and metrics.
            with contextlib.nullcontext() if sampled or cfg.loss.lambda_rl else torch.no_grad():
                student_lp_BC = logprobs_from_hidden(run.model, hidden_BCH, tokens_BC, mask_BC)
            mask_BC = mask_BC.bool()
            length = mask_BC.shape[1]
            teacher_lp_BC = pad_completions([s.teacher_logprobs for s in micro], length, device)
            sampler_lp_BC = pad_completions([s.rollout.sampler_logprobs for s in micro], length, device)
            rewards_B = torch.tensor([s.reward for s in micro], device=device)
            group_ids_B = torch.tensor([s.group for s in micro], device=device)
            baseline_lp_BC = (pad_completions([s.wrong_context_logprobs for s in micro], length, device)
                              if cfg.loss.opd_baseline == "wrong_context" else student_lp_BC)
            weight_B = opd_weight_N[start : start + per_micro].to(device)
            # The sampled-token advantage (OPD + GRPO, and the cures of selfopd.credit) is always
            # computed: it is saved and measured even when the teacher term is an exact divergence.
            advantage_BC, grpo_BC = cure_advantage(teacher_lp_BC, baseline_lp_BC, mask_BC, rewards_B, group_ids_B,
                                                   weight_B, cfg.loss.lambda_opd, cfg.loss.lambda_rl, rlsd_lam,
                                                   cfg.loss.rlsd_clip, cfg.loss.token_clip)
            ratio_BC = truncated_is_ratio(student_lp_BC, sampler_lp_BC, cfg.loss.is_cap) if cfg.loss.is_cap else None
            if sampled:
                loss = policy_gradient_loss(student_lp_BC, advantage_BC, mask_BC, ratio_BC, cfg.loss.normalisation)
                clipped_BC = clipped_tokens(teacher_lp_BC - baseline_lp_BC, mask_BC, cfg.loss.token_clip, two_sided=True)
            else:  # the teacher term is an exact divergence; only the GRPO term stays a policy gradient
                divergence_BC = distribution_divergence(run, micro, hidden_BCH, mask_BC,
                                                        teacher_states[index] if teacher_states else None)
                clipped_BC = clipped_tokens(divergence_BC, mask_BC, cfg.loss.token_clip, two_sided=False)
                trained_BC = clipped_divergence(divergence_BC, cfg.loss.token_clip)
                if cfg.loss.opd_on != "all" or cfg.loss.pass_rate_weighting:
                    trained_BC = trained_BC * weight_B[:, None].to(trained_BC.dtype)
                loss = (policy_gradient_loss(student_lp_BC, grpo_BC, mask_BC, ratio_BC, cfg.loss.normalisation)
                        + cfg.loss.lambda_opd * masked_mean(trained_BC, mask_BC, cfg.loss.normalisation))
                collected["divergence"].append(divergence_BC.detach()[mask_BC].float().cpu())  # before the clip
            # Scale so the accumulated gradient equals one big batch's mean.
            weight = int(mask_BC.sum()) / total_tokens if cfg.loss.normalisation == "token" else len(micro) / total_rollouts
            (loss * (weight * world.size)).backward()
            fault_point("train.backward")
            loss_total += loss.item() * weight
            for key, tensor in (("teacher", teacher_lp_BC), ("student", student_lp_BC), ("sampler", sampler_lp_BC),
                                ("advantage", advantage_BC), ("clipped", clipped_BC)):
                collected[key].append(tensor.detach()[mask_BC].float().cpu())

    # 4. Optimizer step (AdamW state persists across steps), skipped when the loss or the
    #    gradient is NaN or inf on any rank: one bad batch must not poison the weights.
    with timer("optim"):
        grad_norm = _clip_gradients(run.model, cfg.optim.grad_clip)
        finite = all_sum(float(not math.isfinite(loss_total + grad_norm)), world) == 0
        if finite:
            run.optimizer.step()
            if run.ema is not None:  # the `ema` teacher follows only the steps taken
                run.ema.update(run.model)
        with warnings.catch_warnings():  # a skipped first step: the lr still follows run.step
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
            run.scheduler.step()
        run.optimizer.zero_grad(set_to_none=True)
    run.step += 1

    # 5. Weight sync to the engines, then the probe proves they serve the new weights
    #    (a skipped step changed no weight: nothing to sync).
    probe_gaps = {}
    if finite:
        with timer("sync"):
            sync_weights(run)
        with timer("probe"):
            probe_gaps = check_probe(run)

    # Metrics of the whole step: every rank's rollouts and tokens, in rank order.
    scored = [s for part in all_gather(scored, world) for s in part]
    flat = {key: torch.cat([t for part in all_gather(values, world) for t in part])[None]
            for key, values in collected.items() if values}
    lengths = [len(s.rollout.completion_ids) for s in scored]
    signal_N = (flat["teacher"][0] - flat["student"][0]).double()  # the OPD signal per completion token, all rollouts
    metrics = {
        "step": run.step,
        **({} if finite else {"skipped": SKIPPED}),
        "loss/pg": all_sum(loss_total, world),
        "optim/lr": run.scheduler.get_last_lr()[0],
        "optim/grad_norm": grad_norm,
        **probe_gaps,
        **({"teacher/ema_distance": run.ema.distance(run.model)} if run.ema is not None else {}),
        **opd_metrics(
            flat["teacher"], flat["student"], torch.ones_like(flat["teacher"], dtype=torch.bool),
            sampler_lp_BT=flat["sampler"], cap=cfg.loss.is_cap or None, advantage_BT=flat["advantage"],
            rewards_B=torch.tensor([s.reward for s in scored]),
        ),
        **({} if sampled else {f"loss/{cfg.loss.divergence}": flat["divergence"].double().mean().item()}),
        **({"opd/clipped_share": flat["clipped"].double().mean().item()} if cfg.loss.token_clip else {}),
        **_cure_metrics(cfg.loss, rlsd_lam, opd_weight_N, scored),
        **preference_metrics((s.group, s.correct, signal.mean().item())
                             for s, signal in zip(scored, signal_N.split(lengths)) if len(signal)),
        "reward/accuracy": sum(s.correct for s in scored) / len(scored),
        **({"teacher/demonstration_share": sum(s.demonstration is not None for s in scored) / len(scored)}
           if run.demonstration_fallback is not None else {}),
        "rollout/length_mean": total_tokens / len(scored),
        "rollout/truncated_share": sum(s.rollout.finish_reason == "length" for s in scored) / len(scored),
        **timer.as_metrics(),
    }
    if world.is_main:
        save_rollouts(run, scored, flat["student"][0], flat["advantage"][0], cfg.run.rollouts_to_save)
    return metrics


def distribution_divergence(run: Run, micro: Sequence[Scored], hidden_BCH: torch.Tensor, mask_BC: torch.Tensor,
                            teacher_states: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """Per-token divergence (B, C) of the student's next-token distributions from the
    teacher's (`loss.divergence`), differentiable in the student's (tempered) hidden states;
    the teacher's are tempered alike (full vocabulary: its states from the teacher phase)."""
    cfg = run.config.loss
    head_VH = run.model.get_output_embeddings().weight
    length = mask_BC.shape[1]
    if cfg.divergence == "topk_reverse_kl":
        ids_BCK = torch.zeros(len(micro), length, cfg.top_k, dtype=torch.long)
        logprobs_BCK = torch.zeros(len(micro), length, cfg.top_k)
        for row, s in enumerate(micro):
            ids, logprobs = s.teacher_topk
            ids_BCK[row, : len(ids)], logprobs_BCK[row, : len(ids)] = ids, logprobs
        return topk_reverse_kl(hidden_BCH, head_VH, ids_BCK.to(run.device), logprobs_BCK.to(run.device), mask_BC)
    # In process only: the config refuses full-vocabulary losses with vLLM.
    teacher_hidden_BCH, teacher_head_VH = teacher_states
    return full_vocab_divergence(hidden_BCH, head_VH, mask_BC, teacher_hidden_BTH=teacher_hidden_BCH,
                                 teacher_weight_VH=teacher_head_VH, divergence=cfg.divergence, beta=cfg.jsd_beta)


def _opd_weights(run: Run, scored: Sequence[Scored]) -> torch.Tensor:
    """Each rollout's weight on the teacher term (routing, pass-rate weighting; float64),
    the pass-rate weights normalised by their mean over the whole step's prompts, all ranks."""
    loss = run.config.loss
    correct_N = torch.tensor([s.correct for s in scored])
    group_N = torch.tensor([s.group for s in scored])
    mean = None
    if loss.pass_rate_weighting:
        total, prompts = mean_prompt_weight(correct_N, group_N)
        mean = all_sum(total, run.world) / max(all_sum(prompts, run.world), 1.0)
    return opd_rollout_weights(correct_N, group_N, loss.opd_on, loss.pass_rate_weighting, mean)


def _cure_metrics(loss: Any, rlsd_lam: float, opd_weight_N: torch.Tensor, scored: Sequence[Scored]) -> dict[str, float]:
    """This rank's view of the cures' settings at this step (the weights are a step's, all ranks alike
    only in their mean)."""
    metrics = {"loss/rlsd_lambda": rlsd_lam} if loss.rlsd_weight else {}
    if loss.opd_on != "all" or loss.pass_rate_weighting:
        metrics["opd/weighted_share"] = float((opd_weight_N > 0).double().mean())
    if loss.opd_baseline == "wrong_context":
        gaps = [(s.teacher_logprobs - s.wrong_context_logprobs).double() for s in scored]
        metrics["opd/context_contrast"] = float(torch.cat(gaps).mean()) if gaps else 0.0
    return metrics


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


def train(config: TrainConfig, resume: bool = False, initial_eval: Path | None = None) -> Path:
    """Run (or continue) training; returns the run folder.

    `initial_eval`: an eval folder (eval.jsonl + summary.json) of these very starting weights
    on this eval split, used as the step-0 eval instead of evaluating again. `selfopd
    compare` evaluates the shared base model once for all its arms. Under torchrun every
    rank runs this; rank 0 alone writes the run folder."""
    main = current_world().is_main
    folder = RunFolder.of(config.run.out_dir, config.run.name)
    if main:  # refused before any model loads; the folder itself is made once the inputs pass their checks
        check_writable(folder.root)
        check_not_in_use(folder.root)
    checkpoint = folder.latest_checkpoint() if resume else None
    if resume and checkpoint is None:
        raise FileNotFoundError(f"{folder.root}: no checkpoint to resume from (the run stopped before its first "
                                "checkpoint: delete the folder and start the run again)")
    if not resume:
        refuse_finished(folder)
    claim = (lambda: _claimed(folder, config, resume, checkpoint)) if main else None
    run = build_run(config, checkpoint, claim)
    with contextlib.closing(run):  # stops launched servers on any exit, Ctrl-C included
        split = SplitRecord.of(config.data.spec, config.data.split_seed, run.train_examples, run.eval_examples)
        if resume:
            SplitRecord.read(folder.root).check_same(split, str(folder.root))
        elif main:
            split.write(folder.root)
        log = MetricsLog(folder, config) if main else None
        try:
            with contextlib.closing(log) if log else contextlib.nullcontext():
                _train_loop(run, log, resume, initial_eval)
        except GuardStop:  # every rank stops at the same step, its checkpoint written: plot what ran
            if main:
                plot_run(folder)
            raise
        barrier(run.world)  # the last checkpoint is written before any rank returns
    if main:
        plot_run(folder)
    return folder.root


@contextlib.contextmanager
def _claimed(folder: RunFolder, config: TrainConfig, resume: bool, checkpoint: Path | None) -> Iterator[None]:
    """Hold the run folder's lock (a fresh run: create the folder, write its config; keep its templates'
    texts); a resumed run then drops what a kill between a checkpoint and its clean-up left behind."""
    with claimed_run_folder(folder, None if resume else config_to_toml(config)):
        save_run_templates(folder.templates, config_template_names(config))
        if checkpoint is not None:
            prune_checkpoints(folder, checkpoint)
        yield


def _train_loop(run: Run, log: MetricsLog | None, resume: bool, initial_eval: Path | None) -> None:
    """Every rank runs every step, eval and checkpoint (collectives); `log` is rank 0's."""
    config = run.config

    def record(metrics: dict[str, float] | None) -> None:
        if log is not None and metrics is not None:
            log.log(metrics)

    history: list[dict] = []  # the training-step lines so far (rank 0), what the guard decides on
    if resume:
        if log is not None:
            history = guard.training_lines(log.truncate_after(run.step))
    elif initial_eval is not None:
        record(reuse_eval(run, initial_eval) if run.world.is_main else None)
    else:
        record(run_eval(run))
    bar = tqdm(total=config.run.steps, initial=run.step, desc=config.run.name, unit="step",
               disable=not (config.run.progress and run.world.is_main))
    skipped_in_row = 0
    while run.step < config.run.steps:
        metrics = train_step(run)
        fired = guard.watch(run.folder, config, history, metrics) if run.world.is_main else []  # marks `metrics`
        record(metrics)
        skipped_in_row = skipped_in_row + 1 if metrics.get("skipped") else 0
        if skipped_in_row >= config.optim.max_nonfinite_steps:
            raise NonFiniteLoss(_nonfinite_message(run, skipped_in_row))
        bar.set_postfix(kl=f"{metrics['opd/reverse_kl']:.3f}", acc=f"{metrics['reward/accuracy']:.2f}")
        bar.update(1)
        fired_any = all_sum(float(bool(fired)), run.world) > 0  # rank 0 decided; every rank checkpoints
        stop = fired_any and config.guard.action == "stop"
        last = run.step == config.run.steps or stop
        if (config.run.eval_every and run.step % config.run.eval_every == 0) or last:
            record(run_eval(run))
        if (config.run.checkpoint_every and run.step % config.run.checkpoint_every == 0) or last or fired_any:
            with writing(run.folder.checkpoint(run.step)):
                save_checkpoint(run)
        if stop:
            raise GuardStop(guard.stop_message(run.folder, run.step, fired), run.step)
    bar.close()


def _nonfinite_message(run: Run, count: int) -> str:
    checkpoint = run.folder.latest_checkpoint()
    return (f"steps {run.step - count + 1} to {run.step}: {count} steps in a row had a NaN or inf loss or gradient "
            f"(optim.max_nonfinite_steps = {run.config.optim.max_nonfinite_steps}); they were skipped, the weights "
            f"are those of step {run.step - count}; last checkpoint: {checkpoint or 'none'}. Check the teacher's "
            f"logprobs and the learning rate in {run.folder.metrics}")


def _clip_gradients(model: Any, max_norm: float) -> float:
    """The global gradient norm (over every rank's shards), clipped to `max_norm` when > 0."""
    params = [p for p in model.parameters() if p.grad is not None]
    if max_norm > 0 or is_sharded(model):
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else math.inf)
        return (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).item()
    return torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])).item()
