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

from selfopd.config import LossConfig
from selfopd.training.advantages import mean_prompt_weight, opd_rollout_weights, rlsd_lambda
from selfopd.core.distributed import all_gather, all_sum, is_sharded
from selfopd.engines.base import rest_engines
from selfopd.core.faults import fault_point
from selfopd.training.loss_metrics import opd_metrics, preference_metrics
from selfopd.training.loss import LossInputs, opd_loss
from selfopd.training.outputs import save_rollouts
from selfopd.training.rollout_pipeline import Sampled, batch_for_step  # noqa: F401  (batch_for_step: public here)
from selfopd.training.state import Run
from selfopd.training.teacher import Scored
from selfopd.engines.scoring import completion_hidden, logprobs_from_hidden, pad_completions, tempered
from selfopd.training.grading import Graded, grade_groups
from selfopd.training.teacher import States, routed_rows, score_routed
from selfopd.training.teacher_metrics import teacher_metrics
from selfopd.run.throughput import (StepTokens, model_flops_per_token, peak_flops, peak_memory_gb, run_gpus,
                                    throughput_metrics)
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
    padding: list[bool] = field(default_factory=list)  # per rollout: it only fills the rank's share up
    collected: dict[str, list[torch.Tensor]] = field(default_factory=lambda: {
        "teacher": [], "student": [], "sampler": [], "advantage": [], "divergence": [], "clipped": []})


def train_step(run: Run) -> dict[str, float]:
    """One OPD step; returns its metrics (the same on every rank)."""
    timer = PhaseTimer()
    sampled = run.rollouts.take(run.student_side, run.step, timer)  # this step's rollouts; with k >= 1, step + k's are asked for
    graded = grade(run, sampled, timer)  # the rewards: each rollout graded as the user sees it
    scored, teacher_states = score(run, sampled, graded, timer)
    rest_engines(run.student_engine, run.teacher.engine)  # a colocated vLLM frees the GPU until its next call
    padding = [sampled.request.is_padding(s.group) for s in scored]  # a rank's share filled up: weighs nothing
    backward = forward_backward(run, scored, teacher_states, timer, padding)
    finite, grad_norm = optimizer_step(run, backward.loss_total, timer)
    if run.config.rollout.max_staleness and finite:
        with timer("sample_wait"):  # k = 1: the weights change only between sampling requests
            run.rollouts.before_weight_change(run.step)
    probe_gaps = sync_engines(run, timer) if finite else {}  # a skipped step changed no weight: nothing to sync
    scored = [s for s, pad in zip(scored, padding) if not pad]
    scored = [s for part in all_gather(scored, run.world) for s in part]  # the whole step's, in rank order
    flat = {key: torch.cat([t for part in all_gather(values, run.world) for t in part])[None]
            for key, values in backward.collected.items() if values}
    metrics = step_metrics(run, sampled, scored, flat, backward, finite, grad_norm, probe_gaps, timer)
    if run.world.is_main:
        save_rollouts(run, scored, flat["student"][0], flat["advantage"][0], run.config.run.rollouts_to_save)
    return metrics


def grade(run: Run, sampled: Sampled, timer: PhaseTimer) -> list[Graded]:
    """2. Verifier rewards: each rollout graded under the student's chat format, with the flag its
    prompt carries (`selfopd.training.grading`), teacher or not."""
    request = sampled.request
    with timer("verify"):
        return grade_groups(run.student_chat, request.examples, sampled.groups, request.opened,
                            run.config.loss.partial_credit)


def score(run: Run, sampled: Sampled, graded: list[Graded], timer: PhaseTimer) -> tuple[list[Scored], list[States]]:
    """3. The teacher's prompts (with the verdicts' feedback), then the teacher scores the student's exact
    completion ids after them (`selfopd.training.teacher`). A full-vocabulary loss keeps the
    teacher's hidden states."""
    sides, request = run.teachers, sampled.request
    with timer("verify"):
        rows = routed_rows(sides, run.route, run.step, request.examples, request.student_messages, sampled.groups,
                           request.first_group, graded)
    with timer("teacher"):
        return score_routed(sides, rows, run.step)


def forward_backward(run: Run, scored: list[Scored], teacher_states: list[States], timer: PhaseTimer,
                     padding: Sequence[bool] | None = None) -> Backward:
    """4. The student's forward/backward in micro-batches of whole prompt groups; gradients
    accumulate. The loss is the mean over the whole step (all ranks): each rank weighs its
    micro-batches by the step's totals, and FSDP's mean over ranks is undone by `world.size`.
    `padding`: per rollout, whether it only fills the rank's share up (`padded_share`): it runs, so every
    rank makes the same forward and backward calls, with every token masked and out of the totals."""
    cfg, world = run.config, run.world
    padding = list(padding) if padding is not None else [False] * len(scored)
    run.model.train()
    real = [s for s, pad in zip(scored, padding) if not pad]
    total_tokens = all_sum(sum(s.rollout.student_tokens for s in real), world)  # an episode's own tokens
    total_rollouts = all_sum(len(real), world)
    backward = Backward(0.0, total_tokens, _opd_weights(run, scored, padding),
                        rlsd_lambda(run.step, cfg.loss.rlsd_weight, cfg.loss.rlsd_decay_steps), padding)
    with timer("train"):
        per_micro = run.rollouts_per_micro_batch
        for index, start in enumerate(range(0, len(scored), per_micro)):
            micro, pads = scored[start : start + per_micro], padding[start : start + per_micro]
            loss, tokens, mask_BC = micro_batch_loss(run, micro, backward, start,
                                                     teacher_states[index] if teacher_states else None, pads)
            # Scale so the accumulated gradient equals one big batch's mean.
            kept = len(micro) - sum(pads)
            weight = (tokens / max(total_tokens, 1) if cfg.loss.normalisation == "token"
                      else kept / max(total_rollouts, 1))
            (loss * (weight * world.size)).backward()
            fault_point("train.backward")
            backward.loss_total += loss.item() * weight
    return backward


def micro_batch_loss(run: Run, micro: Sequence[Scored], backward: Backward, start: int,
                     teacher_states: tuple[torch.Tensor, torch.Tensor] | None,
                     padding: Sequence[bool] = ()) -> tuple[torch.Tensor, int, torch.Tensor]:
    """The student's forward on one micro-batch, then its loss (`selfopd.training.loss`, with its
    graph), its completion-token count and mask; what the metrics need of it is appended to
    `backward.collected`."""
    loss_cfg, device = run.config.loss, run.device
    exact = loss_cfg.divergence != "sampled"
    sequences = [(s.rollout.prompt_ids, s.rollout.completion_ids) for s in micro]
    with run.autocast():  # the decoder only: the head and log-softmax run in fp32 (selfopd.engines.kernels)
        hidden_BCH, tokens_BC, mask_BC = completion_hidden(run.model, sequences, run.pad_id)  # with grad
    hidden_BCH = tempered(hidden_BCH, run.temperature)  # the sampling distribution's logits
    # Differentiated only by a policy-gradient term; else read for the advantage and metrics. Its loss
    # window is kept for backward only when no divergence's window is formed after it.
    with contextlib.nullcontext() if not exact or loss_cfg.lambda_rl else torch.no_grad():
        student_lp_BC = logprobs_from_hidden(run.model, hidden_BCH, tokens_BC, mask_BC, keep_last=not exact)
    mask_BC = mask_BC.bool() & student_mask(micro, mask_BC.shape[1], mask_BC.device)  # episodes: the student's turns
    if any(padding):  # a share's padding: run, never weighed
        mask_BC[torch.tensor(list(padding), dtype=torch.bool, device=mask_BC.device)] = False
    length = mask_BC.shape[1]
    inputs = LossInputs(
        student_lp_BT=student_lp_BC,
        teacher_lp_BT=pad_completions([s.teacher_logprobs for s in micro], length, device),
        sampler_lp_BT=pad_completions([s.rollout.sampler_logprobs for s in micro], length, device),
        mask_BT=mask_BC,
        rewards_B=torch.tensor([s.reward for s in micro], device=device),
        group_ids_B=torch.tensor([s.group for s in micro], device=device),
        opd_weight_B=backward.opd_weight_N[start : start + len(micro)].to(device),
        rlsd_lambda=backward.rlsd_lam,
        baseline_lp_BT=(pad_completions([s.baseline_logprobs for s in micro], length, device)
                        if loss_cfg.opd_baseline != "student" else None),
        student_hidden_BTH=hidden_BCH if exact else None,
        student_head_VH=run.model.get_output_embeddings().weight if exact else None,
        teacher_topk=_teacher_topk(micro, length, loss_cfg.top_k, device) if loss_cfg.divergence == "topk_reverse_kl" else None,
        teacher_states=teacher_states,
    )
    parts = opd_loss(inputs, loss_cfg)
    if parts.divergence_BT is not None:
        backward.collected["divergence"].append(parts.divergence_BT[mask_BC].float().cpu())  # before the clip
    for key, tensor in (("teacher", inputs.teacher_lp_BT), ("student", student_lp_BC), ("sampler", inputs.sampler_lp_BT),
                        ("advantage", parts.advantage_BT), ("clipped", parts.clipped_BT)):
        backward.collected[key].append(tensor.detach()[mask_BC].float().cpu())
    return parts.loss, int(mask_BC.sum()), mask_BC


def student_mask(micro: Sequence[Scored], length: int, device: torch.device) -> torch.Tensor:
    """(B, C) True where a completion id is the student's own: every id of a single-turn rollout, and
    an episode's student turns only (`Rollout.loss_mask`); the environment's ids between them are
    context, with no advantage and no loss. Padding is the caller's to mask."""
    mask_BC = torch.ones(len(micro), length, dtype=torch.bool)
    for row, s in enumerate(micro):
        if s.rollout.loss_mask is not None:
            mask_BC[row, : len(s.rollout.loss_mask)] = torch.tensor(s.rollout.loss_mask, dtype=torch.bool)
    return mask_BC.to(device)


def _teacher_topk(micro: Sequence[Scored], length: int, top_k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's top-k ids and logprobs of each completion position, padded to (B, C, K)."""
    ids_BCK = torch.zeros(len(micro), length, top_k, dtype=torch.long)
    logprobs_BCK = torch.zeros(len(micro), length, top_k)
    for row, s in enumerate(micro):
        ids, logprobs = s.teacher_topk
        ids_BCK[row, : len(ids)], logprobs_BCK[row, : len(ids)] = ids, logprobs
    return ids_BCK.to(device), logprobs_BCK.to(device)


def optimizer_step(run: Run, loss_total: float, timer: PhaseTimer) -> tuple[bool, float]:
    """5. The optimizer step (AdamW state persists across steps), skipped when the loss or
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
    """6. The new weights to the engines (a push to vLLM servers proves itself by digests), then the
    probe compares every replica's logprobs with the trainer's. Returns the push's and the probe's metrics."""
    with timer("sync"):
        pushed = sync_weights(run)
    with timer("probe"):
        return {**pushed, **check_probe(run)}


def step_metrics(run: Run, batch: Sampled, scored: list[Scored], flat: dict[str, torch.Tensor], backward: Backward,
                 finite: bool, grad_norm: float, probe_gaps: dict[str, float], timer: PhaseTimer) -> dict[str, float]:
    """7. The whole step's metrics: every rank's rollouts and tokens, in rank order."""
    cfg, world = run.config, run.world
    sampled = cfg.loss.divergence == "sampled"
    lengths = [s.rollout.student_tokens for s in scored]  # the flat tensors hold the student's own tokens
    signal_N = (flat["teacher"][0] - flat["student"][0]).double()  # the OPD signal per completion token, all rollouts
    return {
        "step": run.step,
        **({} if finite else {"skipped": SKIPPED}),
        "loss/pg": all_sum(backward.loss_total, world),
        "optim/lr": run.scheduler.get_last_lr()[0],
        "optim/grad_norm": grad_norm,
        **probe_gaps,
        **({"teacher/ema_distance": run.ema.distance(run.model)} if run.ema is not None else {}),
        **without_teacher(run, opd_metrics(
            flat["teacher"], flat["student"], _aligned_tokens(scored)[None],
            sampler_lp_BT=flat["sampler"], cap=cfg.loss.is_cap or None, advantage_BT=flat["advantage"],
            rewards_B=torch.tensor([s.reward for s in scored]),
        )),
        **({} if sampled else {f"loss/{cfg.loss.divergence}": flat["divergence"].double().mean().item()}),
        **({"opd/clipped_share": flat["clipped"].double().mean().item()} if cfg.loss.token_clip else {}),
        **_cure_metrics(cfg.loss, backward.rlsd_lam,
                        backward.opd_weight_N[~torch.tensor(backward.padding, dtype=torch.bool)], scored),
        **_engine_gap(cfg.loss, scored, flat["student"][0]),
        **without_teacher(run, preference_metrics((s.group, s.correct, signal.mean().item())
                             for s, signal in zip(scored, signal_N.split(lengths)) if len(signal) and s.aligned)),
        "reward/accuracy": sum(s.correct for s in scored) / len(scored),
        "verify/rejected_share": sum(s.rejected for s in scored) / len(scored),
        "verify/no_answer_share": sum(s.no_answer for s in scored) / len(scored),
        **({"teacher/demonstration_share": sum(s.demonstration is not None for s in scored) / len(scored)}
           if run.teacher.demonstration_fallback is not None else {}),
        **({"teacher/unaligned_share": sum(not s.aligned for s in scored) / len(scored)}
           if any(side.table.tokenizer == "own" for side in run.teachers.values()) else {}),
        **(teacher_metrics(run.teachers, [s.teacher for s in scored], lengths, signal_N,
                           [s.aligned for s in scored], [(s.group, s.correct) for s in scored])
           if run.several_teachers else {}),
        "rollout/length_mean": backward.total_tokens / len(scored),
        "rollout/truncated_share": sum(s.rollout.finish_reason == "length" for s in scored) / len(scored),
        **_staleness_metrics(run, batch),
        **_episode_metrics(scored),
        **_hidden_test_metrics(scored),
        **(seconds := timer.as_metrics()),
        **_throughput(run, scored, seconds),
    }


def _throughput(run: Run, scored: Sequence[Scored], seconds: dict[str, float]) -> dict[str, float]:
    """Tokens per second of each phase, and on GPUs the MFU estimate (bf16 or fp16 weights), peak memory and
    the GPUs the run holds (`selfopd.run.throughput`)."""
    trained = sum(len(s.rollout.prompt_ids) + len(s.rollout.completion_ids) for s in scored)
    teacher = run.config.teacher.kind != "none"
    tokens = StepTokens(sampled=sum(s.rollout.student_tokens for s in scored),
                        scored=sum(len(s.rollout.completion_ids) for s in scored if s.aligned) if teacher else 0,
                        trained=trained)
    on_gpu = run.device.type == "cuda"
    flops = peak = None
    if on_gpu and run.config.model.dtype in ("bfloat16", "float16"):
        flops = model_flops_per_token(run.model, trained / max(len(scored), 1))
        peak = peak_flops(torch.cuda.get_device_name(run.device))
    return {**throughput_metrics(tokens, seconds, flops, peak, run.world.size,
                                 run_gpus(run.config.engine, run.world.size, on_gpu)),
            **peak_memory_gb(run.device)}


def without_teacher(run: Run, metrics: dict[str, float]) -> dict[str, float]:
    """`metrics` less the teacher's (opd/) when the run has none (teacher.kind = 'none')."""
    if run.config.teacher.kind != "none":
        return metrics
    return {key: value for key, value in metrics.items() if not key.startswith("opd/")}


def _aligned_tokens(scored: Sequence[Scored]) -> torch.Tensor:
    """(N,) over the step's completion tokens: False on a completion the teacher could not read
    (its own tokenizer), whose teacher logprobs are a placeholder kept out of the metrics."""
    return torch.cat([torch.full((s.rollout.student_tokens,), s.aligned) for s in scored])


def _hidden_test_metrics(scored: Sequence[Scored]) -> dict[str, float]:
    """Code tasks with hidden tests: the reward on the tests the feedback may show beside the reward on
    tests no feedback ever shows. A student that learns the outputs the teacher saw opens a gap."""
    pairs = [(s.reward, s.hidden_reward) for s in scored if s.hidden_reward is not None]
    if not pairs:
        return {}
    shown, hidden = (sum(values) / len(pairs) for values in zip(*pairs))
    return {"reward/shown_tests": shown, "reward/hidden_tests": hidden, "reward/hidden_gap": shown - hidden}


def _episode_metrics(scored: Sequence[Scored]) -> dict[str, float]:
    """With episodes (`rollout.environment`): student turns per episode and the environment's share of
    the completion ids (context, never trained)."""
    masks = [s.rollout.loss_mask for s in scored if s.rollout.loss_mask is not None]
    if not masks:
        return {}
    turns = [sum(1 for i, own in enumerate(mask) if own and (i == 0 or not mask[i - 1])) for mask in masks]
    ids = sum(len(mask) for mask in masks)
    return {"episode/turns_mean": sum(turns) / len(turns),
            "episode/environment_share": sum(not own for mask in masks for own in mask) / max(ids, 1)}


def _staleness_metrics(run: Run, sampled: Sampled) -> dict[str, float]:
    """With rollout.max_staleness >= 1: the steps between the sampling weights and the trained ones,
    and the engine's own time on the rollouts (overlapped with training, with servers)."""
    if not run.config.rollout.max_staleness:
        return {}
    newest = {} if sampled.last_version is None else {"rollout/last_weight_version": sampled.last_version}
    return {"rollout/weight_version": sampled.version, "rollout/staleness": run.step - 1 - sampled.version,
            **newest, "time/sample_engine": sampled.sample_seconds}


def _opd_weights(run: Run, scored: Sequence[Scored], padding: Sequence[bool]) -> torch.Tensor:
    """Each rollout's weight on the teacher term (routing, pass-rate weighting; float64),
    the pass-rate weights normalised by their mean over the whole step's prompts, all ranks (padding
    left out of the mean)."""
    loss = run.config.loss
    correct_N = torch.tensor([s.correct for s in scored])
    group_N = torch.tensor([s.group for s in scored])
    mean = None
    if loss.pass_rate_weighting:
        real_N = ~torch.tensor(list(padding), dtype=torch.bool)
        total, prompts = mean_prompt_weight(correct_N[real_N], group_N[real_N])
        mean = all_sum(total, run.world) / max(all_sum(prompts, run.world), 1.0)
    weights_N = opd_rollout_weights(correct_N, group_N, loss.opd_on, loss.pass_rate_weighting, mean)
    # A completion a teacher with its own tokenizer could not read gets no teacher signal.
    return weights_N * torch.tensor([s.aligned for s in scored], dtype=weights_N.dtype)


def _cure_metrics(loss: LossConfig, rlsd_lam: float, opd_weight_N: torch.Tensor, scored: Sequence[Scored]) -> dict[str, float]:
    """This rank's view of the cures' settings at this step (the weights are a step's, all ranks alike
    only in their mean)."""
    metrics = {"loss/rlsd_lambda": rlsd_lam} if loss.rlsd_weight else {}
    if loss.opd_on != "all" or loss.pass_rate_weighting:
        metrics["opd/weighted_share"] = float((opd_weight_N > 0).double().mean())
    if loss.opd_baseline == "wrong_context":
        gaps = [(s.teacher_logprobs - s.baseline_logprobs).double() for s in scored]
        metrics["opd/context_contrast"] = float(torch.cat(gaps).mean()) if gaps else 0.0
    return metrics


def _engine_gap(loss: LossConfig, scored: Sequence[Scored], trainer_lp_N: torch.Tensor) -> dict[str, float]:
    """With loss.opd_baseline = 'same_engine': how far the teacher engine's logprobs of the student's
    tokens (its kernels, its precision) are from the trainer's, mean |difference| per token: the bias
    that baseline keeps out of the signal."""
    if loss.opd_baseline != "same_engine" or not scored:
        return {}
    engine_lp_N = torch.cat([s.rollout.students_part(s.baseline_logprobs) for s in scored]).double()
    return {"opd/engine_student_gap": (engine_lp_N - trainer_lp_N.double()).abs().mean().item()}


def clip_gradients(model: Any, max_norm: float) -> float:
    """The global gradient norm (over every rank's shards), clipped to `max_norm` when > 0."""
    params = [p for p in model.parameters() if p.grad is not None]
    if max_norm > 0 or is_sharded(model):
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else math.inf)
        return (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).item()
    return torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])).item()
