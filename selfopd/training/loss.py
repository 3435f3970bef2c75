"""The training loss, in one place: a pure function of one micro-batch's tensors and the
`[loss]` settings (`opd_loss`), and the reductions it is made of.

The objective is the reverse KL from the student to the teacher, KL(student || teacher) =
E_{y ~ student}[log student(y) - log teacher(y)], mode-seeking: the student is pushed toward
what the teacher likes and away from what it rejects, on the student's own samples.

`loss.divergence = "sampled"` (any engine): a policy gradient on the sampled tokens,
    loss = -mean_t[ ratio_t * A_t * log student(y_t) ],
    A_t = lambda_rl * A_grpo(b) * rlsd_t + lambda_opd * w_b * clip_c(teacher_lp_t - baseline_lp_t),
  whose expected gradient is that of lambda_opd * KL(student || teacher) minus lambda_rl times
  the GRPO objective (`selfopd.training.advantages` has each term and each cure's formula):
    A_grpo(b)     rollout b's GRPO advantage from its reward (`rl_advantage`: (r - mean) / std
                  over its group by default, r - mean, or r alone; a wrong rollout's reward is
                  `wrong_reward`, 0 by default);
    baseline_lp   the student's logprob (plain OPD), the teacher's under a wrong context
                  (RLCSD/CEPO, `opd_baseline = "wrong_context"`), or the teacher engine's logprob
                  after the student's own prompt (`opd_baseline = "same_engine"`);
    rlsd_t        RLSD's per-token factor (`rlsd_weight`), 1 when off;
    w_b           0 for a passed rollout under SRPO routing (`opd_on = "failed"`), times the
                  SC-SDPO pass-rate weight (`pass_rate_weighting`); 1 when both are off;
    clip_c        `token_clip` c clips each token's signal to [-c, c] (0: off);
    ratio_t       min(student / sampler, is_cap), the truncated importance weight of a sampler
                  that is not exactly the trainer (vLLM, stale weights; `is_cap` 0: 1).
Any other divergence: the OPD term is exact per position, over whole distributions
(`selfopd.training.divergences`), and only the GRPO term stays a policy gradient,
    loss = -mean_t[ ratio_t * lambda_rl * A_grpo(b) * rlsd_t * log student(y_t) ]
           + lambda_opd * mean_t[ w_b * min(D_t, c) ],   (w_b only under routing/pass-rate weighting)
  D_t the reverse KL (`reverse_kl`), forward KL (`forward_kl`), generalised JSD (`jsd`) over
  the vocabulary, or the reverse KL over the teacher's top-k plus one tail bucket
  (`topk_reverse_kl`); a position clamped at c gives no gradient. With `clip_per =
  "vocabulary_entry"` (full-vocabulary divergences only; OPSD's clip) min(D_t, c) is instead
  sum_v min(d_tv, c), where D_t = sum_v d_tv: each vocabulary entry's term is capped, a capped
  term gives no gradient, and a KL's sum can be negative.
mean_t is over completion tokens: over all of the batch's ("token") or per sequence first
("sequence", `normalisation`).

Shape convention: a tensor's name ends in its shape letters.
    B  sequences (rollouts) in the batch      T  token positions      V  vocabulary
    H  hidden size                             K  teacher top-k entries
`mask_BT` is 1 (True) on completion tokens, the only tokens that are trained; prompt and
padding positions are 0. A masked position contributes exactly zero to every loss and
metric and gets exactly zero gradient, whatever garbage (inf, nan) its inputs hold.
Logprob tensors are aligned with the tokens they score: `x_lp_BT[b, t]` is
log p(tokens[b, t] | tokens[b, :t]); the caller does the usual one-position shift.
Every function here is pinned against float64 references in tests/training/test_loss.py,
the assembled loss for every combination of settings the config allows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from selfopd.config import LossConfig, Normalisation
from selfopd.training.advantages import check_same_shape, cure_advantage
from selfopd.training.divergences import EntryClipped, entry_clipped_divergence, full_vocab_divergence, topk_reverse_kl

@dataclass(frozen=True)
class LossInputs:
    """One micro-batch's tensors, everything the loss reads. Per rollout (B,) or per completion
    position (B, T); only `student_lp_BT` and `student_hidden_BTH` may carry a gradient."""

    student_lp_BT: Tensor  # the trainer's logprobs of the sampled tokens
    teacher_lp_BT: Tensor  # the teacher's logprobs of the same tokens after its own prompt
    sampler_lp_BT: Tensor  # the sampling engine's logprobs (for the importance ratio)
    mask_BT: Tensor
    rewards_B: Tensor
    group_ids_B: Tensor  # which prompt each rollout answers (GRPO's groups)
    opd_weight_B: Tensor  # w_b, `advantages.opd_rollout_weights` over the whole step
    rlsd_lambda: float = 0.0  # RLSD's mixing weight at this step (`advantages.rlsd_lambda`)
    baseline_lp_BT: Tensor | None = None  # None: the student (plain OPD)
    # Exact divergences only: the student's (tempered) final hidden states and unembedding, and
    # the teacher's distribution as top-k (ids, logprobs) (B, T, K) or as in-process (hidden, head).
    student_hidden_BTH: Tensor | None = None
    student_head_VH: Tensor | None = None
    teacher_topk: tuple[Tensor, Tensor] | None = None
    teacher_states: tuple[Tensor, Tensor] | None = None


@dataclass(frozen=True)
class LossParts:
    """The loss (scalar, with its graph) and what the step's metrics read of it, detached."""

    loss: Tensor
    advantage_BT: Tensor  # the sampled-token advantage A_t (computed under every divergence)
    clipped_BT: Tensor  # bool: the positions `token_clip` clipped (any of whose entries, per vocabulary entry)
    divergence_BT: Tensor | None  # D_t before the clip; None for "sampled"


def opd_loss(inputs: LossInputs, settings: LossConfig) -> LossParts:
    """The loss of one micro-batch under `settings` (see the module docstring for the formula)."""
    x, s = inputs, settings
    mask_BT = x.mask_BT.bool()
    baseline_BT = x.student_lp_BT if x.baseline_lp_BT is None else x.baseline_lp_BT
    # The sampled-token advantage (trained under "sampled", logged otherwise) is clipped per token: a
    # cap of each vocabulary entry's term is not a bound on it.
    advantage_BT, grpo_BT = cure_advantage(x.teacher_lp_BT, baseline_BT, mask_BT, x.rewards_B, x.group_ids_B,
                                           x.opd_weight_B, s.lambda_opd, s.lambda_rl, x.rlsd_lambda, s.rlsd_clip,
                                           s.token_clip if s.clip_per == "position" else 0.0,
                                           rl_kind=s.rl_advantage, wrong_reward=s.wrong_reward)
    ratio_BT = truncated_is_ratio(x.student_lp_BT, x.sampler_lp_BT, s.is_cap) if s.is_cap else None
    if s.divergence == "sampled":
        loss = policy_gradient_loss(x.student_lp_BT, advantage_BT, mask_BT, ratio_BT, s.normalisation)
        clipped_BT = clipped_tokens(x.teacher_lp_BT - baseline_BT, mask_BT, s.token_clip, two_sided=True)
        return LossParts(loss, advantage_BT.detach(), clipped_BT, None)
    if s.clip_per == "vocabulary_entry":
        entry = entry_clipped(x, s, mask_BT)
        trained_BT, divergence_BT, clipped_BT = entry.values_BT, entry.unclipped_BT, entry.clipped_BT
    else:
        divergence_BT = teacher_divergence(x, s, mask_BT)
        trained_BT = clipped_divergence(divergence_BT, s.token_clip)
        clipped_BT = clipped_tokens(divergence_BT, mask_BT, s.token_clip, two_sided=False)
    if s.opd_on != "all" or s.pass_rate_weighting:
        trained_BT = trained_BT * x.opd_weight_B[:, None].to(trained_BT.dtype)
    loss = (policy_gradient_loss(x.student_lp_BT, grpo_BT, mask_BT, ratio_BT, s.normalisation)
            + s.lambda_opd * masked_mean(trained_BT, mask_BT, s.normalisation))
    return LossParts(loss, advantage_BT.detach(), clipped_BT, divergence_BT.detach())


def entry_clipped(inputs: LossInputs, settings: LossConfig, mask_BT: Tensor) -> EntryClipped:
    """The full-vocabulary divergence with each vocabulary entry's term capped at `token_clip`
    (`clip_per = "vocabulary_entry"`): its clipped sum, differentiable, the divergence and
    the positions clipped (`divergences.EntryClipped`)."""
    x, s = inputs, settings
    hidden_BTH, head_VH = _student_states(x, s)
    teacher_hidden_BTH, teacher_head_VH = _teacher_states(x, s)
    return entry_clipped_divergence(hidden_BTH, head_VH, mask_BT, s.token_clip, teacher_hidden_BTH=teacher_hidden_BTH,
                                    teacher_weight_VH=teacher_head_VH, divergence=s.divergence, beta=s.jsd_beta)


def _student_states(x: LossInputs, s: LossConfig) -> tuple[Tensor, Tensor]:
    if x.student_hidden_BTH is None or x.student_head_VH is None:
        raise ValueError(f"loss.divergence = {s.divergence!r} needs the student's hidden states and head")
    return x.student_hidden_BTH, x.student_head_VH


def _teacher_states(x: LossInputs, s: LossConfig) -> tuple[Tensor, Tensor]:
    if x.teacher_states is None:
        raise ValueError(f"loss.divergence = {s.divergence!r} needs the teacher's hidden states and head "
                         "(a teacher in process)")
    return x.teacher_states


def teacher_divergence(inputs: LossInputs, settings: LossConfig, mask_BT: Tensor) -> Tensor:
    """D_t (B, T) of the student's next-token distributions from the teacher's, differentiable
    in the student's hidden states and head."""
    x = inputs
    hidden_BTH, head_VH = _student_states(x, settings)
    if settings.divergence == "topk_reverse_kl":
        if x.teacher_topk is None:
            raise ValueError("loss.divergence = 'topk_reverse_kl' needs the teacher's top-k ids and logprobs")
        ids_BTK, logprobs_BTK = x.teacher_topk
        return topk_reverse_kl(hidden_BTH, head_VH, ids_BTK, logprobs_BTK, mask_BT)
    teacher_hidden_BTH, teacher_head_VH = _teacher_states(x, settings)
    return full_vocab_divergence(hidden_BTH, head_VH, mask_BT, teacher_hidden_BTH=teacher_hidden_BTH,
                                 teacher_weight_VH=teacher_head_VH, divergence=settings.divergence,
                                 beta=settings.jsd_beta)


def truncated_is_ratio(trainer_lp_BT: Tensor, sampler_lp_BT: Tensor, cap: float | None) -> Tensor:
    """Truncated importance weight min(pi_trainer / pi_sampler, cap) per token, detached.

    The sampler (vLLM, or stale weights) is not exactly the trainer's policy; reweighting by
    pi/mu makes the sampled-token gradient unbiased for the trainer's policy, and the cap
    bounds its variance (truncated IS). cap=None disables truncation. Detached: it is a
    weight on the gradient, not something to differentiate (unlike PPO's ratio).
    """
    check_same_shape(trainer_lp_BT=trainer_lp_BT, sampler_lp_BT=sampler_lp_BT)
    ratio_BT = torch.exp(trainer_lp_BT.detach() - sampler_lp_BT.detach())
    return ratio_BT if cap is None else ratio_BT.clamp(max=cap)


def policy_gradient_loss(
    logpi_BT: Tensor,
    advantage_BT: Tensor,
    mask_BT: Tensor,
    ratio_BT: Tensor | None = None,
    normalisation: Normalisation = "token",
) -> Tensor:
    """loss = -mean(ratio * A * logpi) over completion tokens; scalar, differentiable in logpi.

    `logpi_BT` are the trainer's current logprobs of the sampled tokens (with grad); A and
    ratio are treated as constants. With A = teacher_lp - student_lp (and ratio 1 on
    policy), the expected gradient is the gradient of reverse KL(student || teacher):
    minimising this loss moves the student toward the teacher in the mode-seeking direction.
    normalisation:
      "token"    sum over all completion tokens in the batch / their number (every token
                 weighs the same; long sequences weigh more);
      "sequence" mean over each sequence's completion tokens, then mean over the sequences
                 that have at least one (every sequence weighs the same).
    """
    check_same_shape(logpi_BT=logpi_BT, advantage_BT=advantage_BT, mask_BT=mask_BT)
    mask_BT = mask_BT.bool()
    zeros_BT = torch.zeros_like(logpi_BT)
    # Mask each factor, not only the product: inf * 0 in an unselected branch would still
    # put nan into the gradient.
    weight_BT = torch.where(mask_BT, advantage_BT.detach().to(logpi_BT.dtype), zeros_BT)
    if ratio_BT is not None:
        check_same_shape(logpi_BT=logpi_BT, ratio_BT=ratio_BT)
        weight_BT = weight_BT * torch.where(mask_BT, ratio_BT.detach().to(logpi_BT.dtype), zeros_BT)
    term_BT = weight_BT * torch.where(mask_BT, logpi_BT, zeros_BT)
    return -masked_mean(term_BT, mask_BT, normalisation)


def clipped_divergence(divergence_BT: Tensor, token_clip: float) -> Tensor:
    """A per-token divergence clamped at `token_clip` (0: unchanged): a clamped position is
    constant, so it gives no gradient, and the others are untouched."""
    if token_clip <= 0:
        return divergence_BT
    return torch.where(divergence_BT > token_clip, divergence_BT.detach().clamp(max=token_clip), divergence_BT)


def clipped_tokens(values_BT: Tensor, mask_BT: Tensor, token_clip: float, two_sided: bool) -> Tensor:
    """(B, T) bool: the completion tokens that `token_clip` clips (none when it is 0):
    |value| > c for the sampled advantage (`two_sided`), value > c for a divergence."""
    if token_clip <= 0:
        return torch.zeros_like(mask_BT, dtype=torch.bool)
    outside_BT = (values_BT.abs() if two_sided else values_BT).detach() > token_clip
    return outside_BT & mask_BT.bool()


def masked_mean(values_BT: Tensor, mask_BT: Tensor, normalisation: Normalisation = "token") -> Tensor:
    """Mean of per-token values over completion tokens; scalar, 0 when there are none.

    The one reduction every loss here shares, so they all weigh tokens alike (see
    `policy_gradient_loss` for "token" vs "sequence"). Masked values are dropped, not
    multiplied by 0, so inf or nan there cannot leak into the result or its gradient.
    """
    check_same_shape(values_BT=values_BT, mask_BT=mask_BT)
    mask_BT = mask_BT.bool()
    values_BT = torch.where(mask_BT, values_BT, torch.zeros_like(values_BT))
    count_B = mask_BT.sum(dim=1).to(values_BT.dtype)
    if normalisation == "token":
        return values_BT.sum() / count_B.sum().clamp(min=1)
    if normalisation == "sequence":
        per_sequence_B = values_BT.sum(dim=1) / count_B.clamp(min=1)
        return per_sequence_B.sum() / (count_B > 0).sum().clamp(min=1)
    raise ValueError(f"normalisation must be 'token' or 'sequence', got {normalisation!r}")
