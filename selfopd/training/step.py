"""One OPD step, as named phases in data-flow order: sample the student, verify and score
the teacher, the student's forward/backward, the optimizer step, the weight sync, the step's
metrics. `train_step` reads top to bottom; each phase is a short function below it. The
rollouts come from `selfopd.training.rollout_pipeline` (sampled ahead with rollout.max_staleness).

Under model.dtype = 'bfloat16' each forward enters its own autocast region (`run.autocast`,
the engines'), never the whole step: see `selfopd.core.devices.autocast`. Under torchrun each
rank holds its share of the step's prompts from sampling to the loss; the optimizer step
and the metrics are the whole step's."""

from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from selfopd.config import FULL_VOCABULARY
from selfopd.templating.context_limits import check_teacher_rows
from selfopd.training.credit import cure_advantage, mean_prompt_weight, opd_rollout_weights, rlsd_lambda
from selfopd.core.distributed import all_gather, all_sum, is_sharded
from selfopd.engines.base import rest_engines
from selfopd.core.faults import fault_point
from selfopd.engines.kernels import full_vocab_divergence, topk_reverse_kl
from selfopd.training.loss_metrics import opd_metrics, preference_metrics
from selfopd.training.objectives import clipped_divergence, clipped_tokens, masked_mean, policy_gradient_loss, truncated_is_ratio
from selfopd.training.outputs import save_rollouts
from selfopd.training.rollout_pipeline import Sampled, batch_for_step  # noqa: F401  (batch_for_step: public here)
from selfopd.training.state import Run, Scored
from selfopd.engines.scoring import completion_hidden, logprobs_from_hidden, pad_completions, tempered
from selfopd.templating.teacher_prompts import teacher_rows
from selfopd.training.teacher_scoring import score_step
from selfopd.run.tracking import PhaseTimer
from selfopd.training.weight_checks import check_probe, sync_weights

SKIPPED = "nonfinite loss"  # the "skipped" value of a step whose loss or gradient was NaN or inf


@dataclass
class Backward:
    """What the student's forward/backward leaves for the optimizer and the metrics."""

    loss_total: float
    total_tokens: int
    opd_weight_N: torch.Tensor
    rlsd_lam: float
    collected: dict[str, list[torch.Tensor]] = field(default_factory=lambda: {
        "teacher": [], "student": [], "sampler": [], "advantage": [], "divergence": [], "clipped": []})


def train_step(run: Run) -> dict[str, float]:
    """One OPD step; returns its metrics (the same on every rank)."""
    timer = PhaseTimer()
    sampled = run.rollouts.take(run, timer)  # this step's rollouts; with k >= 1, step + k's are asked for
    scored, teacher_states = score(run, sampled, timer)
    rest_engines(run.student_engine, run.teacher_engine)  # a colocated vLLM frees the GPU until its next call
    backward = forward_backward(run, scored, teacher_states, timer)
    finite, grad_norm = optimizer_step(run, backward.loss_total, timer)
    if run.config.rollout.max_staleness:
        with timer("sample_wait"):  # the weights change only between sampling requests
            run.rollouts.settle()
    probe_gaps = sync_engines(run, timer) if finite else {}  # a skipped step changed no weight: nothing to sync
    scored = [s for part in all_gather(scored, run.world) for s in part]  # the whole step's, in rank order
    flat = {key: torch.cat([t for part in all_gather(values, run.world) for t in part])[None]
            for key, values in backward.collected.items() if values}
    metrics = step_metrics(run, sampled, scored, flat, backward, finite, grad_norm, probe_gaps, timer)
    if run.world.is_main:
        save_rollouts(run, scored, flat["student"][0], flat["advantage"][0], run.config.run.rollouts_to_save)
    return metrics


def score(run: Run, sampled: Sampled, timer: PhaseTimer) -> tuple[list[Scored], list | None]:
    """2. Verifier rewards, then the teacher scores the student's exact completion ids after
    its own (privileged) prompt, which must fit its context (`selfopd.templating.teacher_prompts`); in
    the trainer's micro-batches. A full-vocabulary loss keeps the teacher's hidden states."""
    cfg = run.config
    with timer("verify"):
        request = sampled.request
        rows = teacher_rows(run, request.examples, request.student_messages, sampled.groups, request.first_group)
        check_teacher_rows([(r.example.id, ids, r.rollout.completion_ids) for r in rows
                            for ids in (r.prompt_ids, r.wrong_prompt_ids) if ids is not None], run.teacher_engine,
                           run.step + 1)
    top_k = cfg.loss.top_k if cfg.loss.divergence == "topk_reverse_kl" else 0
    baseline = cfg.loss.opd_baseline
    baseline_pairs = ([(r.wrong_prompt_ids, r.rollout.completion_ids) for r in rows] if baseline == "wrong_context"
                      else [(r.rollout.prompt_ids, r.rollout.completion_ids) for r in rows] if baseline == "same_engine"
                      else None)
    with timer("teacher"):
        scores, teacher_states, baseline_scores = score_step(
            run.teacher_engine, [(r.prompt_ids, r.rollout.completion_ids) for r in rows], baseline_pairs,
            run.rollouts_per_micro_batch, top_k, run.temperature, keep_states=cfg.loss.divergence in FULL_VOCABULARY)
    scored = [Scored(r.example, r.group, r.rollout, r.verdict.reward, r.verdict.correct, s.logprobs, r.prompt_ids,
                     (s.topk_ids, s.topk_logprobs) if top_k else None, r.demonstration,
                     base.logprobs if base is not None else None)
              for r, s, base in zip(rows, scores, baseline_scores or [None] * len(rows))]
    return scored, teacher_states


def forward_backward(run: Run, scored: list[Scored], teacher_states: list | None, timer: PhaseTimer) -> Backward:
    """3. The student's forward/backward in micro-batches of whole prompt groups; gradients
    accumulate. The loss is the mean over the whole step (all ranks): each rank weighs its
    micro-batches by the step's totals, and FSDP's mean over ranks is undone by `world.size`."""
    cfg, world = run.config, run.world
    run.model.train()
    total_tokens = all_sum(sum(len(s.rollout.completion_ids) for s in scored), world)
    total_rollouts = len(scored) * world.size
    backward = Backward(0.0, total_tokens, _opd_weights(run, scored),
                        rlsd_lambda(run.step, cfg.loss.rlsd_weight, cfg.loss.rlsd_decay_steps))
    with timer("train"):
        per_micro = run.rollouts_per_micro_batch
        for index, start in enumerate(range(0, len(scored), per_micro)):
            micro = scored[start : start + per_micro]
            loss, tokens, mask_BC = micro_batch_loss(run, micro, backward, start,
                                                     teacher_states[index] if teacher_states else None)
            # Scale so the accumulated gradient equals one big batch's mean.
            weight = tokens / total_tokens if cfg.loss.normalisation == "token" else len(micro) / total_rollouts
            (loss * (weight * world.size)).backward()
            fault_point("train.backward")
            backward.loss_total += loss.item() * weight
    return backward


def micro_batch_loss(run: Run, micro: Sequence[Scored], backward: Backward, start: int,
                     teacher_states: Any) -> tuple[torch.Tensor, int, torch.Tensor]:
    """One micro-batch's loss (with its graph), its completion-token count and mask; what the
    metrics need of it is appended to `backward.collected`."""
    cfg, device = run.config, run.device
    loss_cfg = cfg.loss
    sampled = loss_cfg.divergence == "sampled"
    sequences = [(s.rollout.prompt_ids, s.rollout.completion_ids) for s in micro]
    with run.autocast():  # the decoder only: the head and log-softmax run in fp32 (selfopd.engines.kernels)
        hidden_BCH, tokens_BC, mask_BC = completion_hidden(run.model, sequences, run.pad_id)  # with grad
    hidden_BCH = tempered(hidden_BCH, run.temperature)  # the sampling distribution's logits
    # Differentiated only by a policy-gradient term; else read for the advantage and metrics.
    with contextlib.nullcontext() if sampled or loss_cfg.lambda_rl else torch.no_grad():
        student_lp_BC = logprobs_from_hidden(run.model, hidden_BCH, tokens_BC, mask_BC)
    mask_BC = mask_BC.bool()
    length = mask_BC.shape[1]
    teacher_lp_BC = pad_completions([s.teacher_logprobs for s in micro], length, device)
    sampler_lp_BC = pad_completions([s.rollout.sampler_logprobs for s in micro], length, device)
    rewards_B = torch.tensor([s.reward for s in micro], device=device)
    group_ids_B = torch.tensor([s.group for s in micro], device=device)
    baseline_lp_BC = (pad_completions([s.baseline_logprobs for s in micro], length, device)
                      if loss_cfg.opd_baseline != "student" else student_lp_BC)
    weight_B = backward.opd_weight_N[start : start + len(micro)].to(device)
    # The sampled-token advantage (OPD + GRPO, and the cures of selfopd.training.credit) is always
    # computed: it is saved and measured even when the teacher term is an exact divergence.
    advantage_BC, grpo_BC = cure_advantage(teacher_lp_BC, baseline_lp_BC, mask_BC, rewards_B, group_ids_B, weight_B,
                                           loss_cfg.lambda_opd, loss_cfg.lambda_rl, backward.rlsd_lam,
                                           loss_cfg.rlsd_clip, loss_cfg.token_clip)
    ratio_BC = truncated_is_ratio(student_lp_BC, sampler_lp_BC, loss_cfg.is_cap) if loss_cfg.is_cap else None
    if sampled:
        loss = policy_gradient_loss(student_lp_BC, advantage_BC, mask_BC, ratio_BC, loss_cfg.normalisation)
        clipped_BC = clipped_tokens(teacher_lp_BC - baseline_lp_BC, mask_BC, loss_cfg.token_clip, two_sided=True)
    else:  # the teacher term is an exact divergence; only the GRPO term stays a policy gradient
        divergence_BC = distribution_divergence(run, micro, hidden_BCH, mask_BC, teacher_states)
        clipped_BC = clipped_tokens(divergence_BC, mask_BC, loss_cfg.token_clip, two_sided=False)
        trained_BC = clipped_divergence(divergence_BC, loss_cfg.token_clip)
        if loss_cfg.opd_on != "all" or loss_cfg.pass_rate_weighting:
            trained_BC = trained_BC * weight_B[:, None].to(trained_BC.dtype)
        loss = (policy_gradient_loss(student_lp_BC, grpo_BC, mask_BC, ratio_BC, loss_cfg.normalisation)
                + loss_cfg.lambda_opd * masked_mean(trained_BC, mask_BC, loss_cfg.normalisation))
        backward.collected["divergence"].append(divergence_BC.detach()[mask_BC].float().cpu())  # before the clip
    for key, tensor in (("teacher", teacher_lp_BC), ("student", student_lp_BC), ("sampler", sampler_lp_BC),
                        ("advantage", advantage_BC), ("clipped", clipped_BC)):
        backward.collected[key].append(tensor.detach()[mask_BC].float().cpu())
    return loss, int(mask_BC.sum()), mask_BC


def optimizer_step(run: Run, loss_total: float, timer: PhaseTimer) -> tuple[bool, float]:
    """4. The optimizer step (AdamW state persists across steps), skipped when the loss or
    the gradient is NaN or inf on any rank: one bad batch must not poison the weights.
    Returns (taken, gradient norm)."""
    with timer("optim"):
        grad_norm = clip_gradients(run.model, run.config.optim.grad_clip)
        finite = all_sum(float(not math.isfinite(loss_total + grad_norm)), run.world) == 0
        if finite:
            run.optimizer.step()
            if run.ema is not None:  # the `ema` teacher follows only the steps taken
                run.ema.update(run.model)
        with warnings.catch_warnings():  # a skipped first step: the lr still follows run.step
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
            run.scheduler.step()
        run.optimizer.zero_grad(set_to_none=True)
    run.step += 1
    return finite, grad_norm


def sync_engines(run: Run, timer: PhaseTimer) -> dict[str, float]:
    """5. The new weights to the engines (a push to vLLM servers proves itself by digests), then the
    probe compares every replica's logprobs with the trainer's. Returns the push's and the probe's metrics."""
    with timer("sync"):
        pushed = sync_weights(run)
    with timer("probe"):
        return {**pushed, **check_probe(run)}


def step_metrics(run: Run, batch: Sampled, scored: list[Scored], flat: dict[str, torch.Tensor], backward: Backward,
                 finite: bool, grad_norm: float, probe_gaps: dict[str, float], timer: PhaseTimer) -> dict[str, float]:
    """6. The whole step's metrics: every rank's rollouts and tokens, in rank order."""
    cfg, world = run.config, run.world
    sampled = cfg.loss.divergence == "sampled"
    lengths = [len(s.rollout.completion_ids) for s in scored]
    signal_N = (flat["teacher"][0] - flat["student"][0]).double()  # the OPD signal per completion token, all rollouts
    return {
        "step": run.step,
        **({} if finite else {"skipped": SKIPPED}),
        "loss/pg": all_sum(backward.loss_total, world),
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
        **_cure_metrics(cfg.loss, backward.rlsd_lam, backward.opd_weight_N, scored),
        **_engine_gap(cfg.loss, scored, flat["student"][0]),
        **preference_metrics((s.group, s.correct, signal.mean().item())
                             for s, signal in zip(scored, signal_N.split(lengths)) if len(signal)),
        "reward/accuracy": sum(s.correct for s in scored) / len(scored),
        **({"teacher/demonstration_share": sum(s.demonstration is not None for s in scored) / len(scored)}
           if run.demonstration_fallback is not None else {}),
        "rollout/length_mean": backward.total_tokens / len(scored),
        "rollout/truncated_share": sum(s.rollout.finish_reason == "length" for s in scored) / len(scored),
        **_staleness_metrics(run, batch),
        **timer.as_metrics(),
    }


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


def _staleness_metrics(run: Run, sampled: Sampled) -> dict[str, float]:
    """With rollout.max_staleness >= 1: the steps between the sampling weights and the trained ones,
    and the engine's own time on the rollouts (overlapped with training, with servers)."""
    if not run.config.rollout.max_staleness:
        return {}
    return {"rollout/weight_version": sampled.version, "rollout/staleness": run.step - 1 - sampled.version,
            "time/sample_engine": sampled.sample_seconds}


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
        gaps = [(s.teacher_logprobs - s.baseline_logprobs).double() for s in scored]
        metrics["opd/context_contrast"] = float(torch.cat(gaps).mean()) if gaps else 0.0
    return metrics


def _engine_gap(loss: Any, scored: Sequence[Scored], trainer_lp_N: torch.Tensor) -> dict[str, float]:
    """With loss.opd_baseline = 'same_engine': how far the teacher engine's logprobs of the student's
    tokens (its kernels, its precision) are from the trainer's, mean |difference| per token: the bias
    that baseline keeps out of the signal."""
    if loss.opd_baseline != "same_engine" or not scored:
        return {}
    engine_lp_N = torch.cat([s.baseline_logprobs for s in scored]).double()
    return {"opd/engine_student_gap": (engine_lp_N - trainer_lp_N.double()).abs().mean().item()}


def clip_gradients(model: Any, max_norm: float) -> float:
    """The global gradient norm (over every rank's shards), clipped to `max_norm` when > 0."""
    params = [p for p in model.parameters() if p.grad is not None]
    if max_norm > 0 or is_sharded(model):
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else math.inf)
        return (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).item()
    return torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])).item()
