"""The `[loss]` section of a training config: the objective, its divergence, and the cures
for the privileged illusion (the formulas: `selfopd.training.loss`). Re-exported by `selfopd.config`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from selfopd.config.settings import MAX_STEPS, MAX_WEIGHT, Section, fail, setting

Normalisation = Literal["token", "sequence"]
Divergence = Literal["sampled", "topk_reverse_kl", "reverse_kl", "forward_kl", "jsd"]
FULL_VOCABULARY = ("reverse_kl", "forward_kl", "jsd")  # divergences that need the teacher in process
OpdBaseline = Literal["student", "wrong_context", "same_engine"]
OpdOn = Literal["all", "failed"]
RlAdvantage = Literal["group_norm", "group_mean", "raw"]
ClipPer = Literal["position", "vocabulary_entry"]


@dataclass(frozen=True)
class LossConfig(Section):
    SECTION: ClassVar[str] = "loss"
    lambda_opd: float = setting(1.0, "Weight of the OPD advantage teacher_lp - student_lp (minus the reverse KL per token).",
                                ge=0.0, most=MAX_WEIGHT)
    lambda_rl: float = setting(0.0, "Weight of the GRPO advantage of the verifier reward.", ge=0.0, most=MAX_WEIGHT)
    rl_advantage: RlAdvantage = setting(
        "group_norm", "The GRPO term's advantage of a rollout, on every token of it, from its reward r. 'group_norm': "
        "(r - mean) / (std + 1e-6) over the prompt's group (a group whose rewards are all equal gets 0); "
        "'group_mean': r - mean (Dr. GRPO's, no std); 'raw': r itself, no baseline (REINFORCE; what slime runs "
        "with a custom reward post-process, as the Modal OPD tutorial does: an all-wrong group gets loss.wrong_reward "
        "on every token). Needs loss.lambda_rl > 0.")
    wrong_reward: float = setting(
        0.0, "The GRPO term's reward of a wrong rollout: a wrong or unchecked answer, no answer, one cut off at "
        "rollout.max_tokens (verifier.truncated = 'wrong'), or one that ends inside its reasoning. A correct answer "
        "pays 1; partial credit (loss.partial_credit) is paid as the scorer gives it. The logged reward/mean and "
        "saved rollouts keep the verifier's reward (0 for wrong). -1: the Modal OPD tutorial's +1 / -1. Needs "
        "loss.lambda_rl > 0, and with rl_advantage = 'group_norm' partial credit (else it changes nothing).",
        ge=-1.0, le=0.0)
    normalisation: Normalisation = setting("token", "Loss average: over all completion tokens ('token') or per sequence first ('sequence').")
    is_cap: float = setting(2.0, "Cap of the truncated importance-sampling ratio trainer/engine (0: no ratio).", ge=0,
                            most=MAX_WEIGHT)
    divergence: Divergence = setting(
        "sampled",
        "What the OPD term minimises at each completion position. 'sampled': policy gradient on teacher_lp - "
        "student_lp of the sampled token (reverse KL, one-sample estimate; any engine). 'topk_reverse_kl': exact "
        "reverse KL over the teacher's top-k tokens plus one tail bucket (any engine that returns top-k). "
        "'reverse_kl', 'forward_kl', 'jsd': full vocabulary, needs the teacher in process (engine.kind = 'local', or engine.teacher_engine = 'local').")
    top_k: int = setting(20, "Teacher top-k for divergence = 'topk_reverse_kl'.", ge=1, most=2**20)
    jsd_beta: float = setting(0.5, "beta of the generalised JSD (0: forward KL, 1: reverse KL), for divergence = 'jsd'.",
                              ge=0, le=1)
    token_clip: float = setting(
        0.0, "Per-token clip c of the teacher term (0: off). 'sampled': each token's teacher_lp - student_lp is "
        "clipped to [-c, c] before lambda_opd weighs it and the GRPO term is added; other divergences: each "
        "position's divergence is clamped at c, a clamped position giving no gradient (loss.clip_per = "
        "'position'). Logged: opd/clipped_share.", ge=0.0, most=MAX_WEIGHT)
    clip_per: ClipPer = setting(
        "position", "What loss.token_clip caps under a full-vocabulary divergence. 'position': each position's "
        "divergence. 'vocabulary_entry': each vocabulary entry's term of it before the sum over the vocabulary, as "
        "OPSD's jsd_token_clip does (jsd.clamp(max=c) on the (B, T, V) terms): a capped entry gives no gradient, "
        "and a KL's clipped sum can be negative (a JSD's terms are >= 0). opd/clipped_share then counts positions "
        "with any entry capped. 'vocabulary_entry' needs loss.divergence 'reverse_kl', 'forward_kl' or 'jsd' and "
        "loss.token_clip > 0.")
    partial_credit: bool = setting(
        False, "Reward = the task scorer's partial credit (reasoning-gym pays 0.5 for '17' or '-7' when the answer "
        "is 7); off: 1 for a correct final answer, 0 otherwise.")
    # Cures for the privileged illusion (selfopd.training.advantages; measured in
    # experiments/cures/results/cures_report.md).
    rlsd_weight: float = setting(
        0.0, "Teacher-weighted GRPO (RLSD, arXiv 2604.03128) at step 0: the GRPO advantage of each token becomes "
        "A * ((1 - l) + l * clip(exp(sign(A) * s_t), 1 - e, 1 + e)), s_t the teacher signal; the verifier decides the "
        "sign, the teacher only the size per token (0: off; the paper: 0.5). Needs lambda_rl > 0.", ge=0, le=1)
    rlsd_decay_steps: int = setting(
        50, "RLSD: l falls linearly from rlsd_weight to 0 over this many steps, then GRPO alone (the paper: 50; "
        "0: l stays constant).", ge=0, most=MAX_STEPS)
    rlsd_clip: float = setting(0.2, "RLSD: e, the clip of the teacher's per-token factor to [1 - e, 1 + e] (the paper: 0.2).",
                               ge=0, lt=1)
    opd_on: OpdOn = setting(
        "all", "Which rollouts get the teacher term: 'all', or 'failed' (SRPO-style routing, arXiv 2604.02288: a "
        "rollout the verifier passed trains on the GRPO term only). SRPO also drops the GRPO term of failed rollouts "
        "and weighs the teacher by its entropy; here failed rollouts keep their GRPO term, so the verifier's "
        "penalty still applies.")
    opd_baseline: OpdBaseline = setting(
        "student", "What the teacher's logprob is compared with. 'student': teacher_lp - student_lp (OPD). "
        "'wrong_context': teacher_lp under the true context minus teacher_lp under a wrong one, a failed sibling's "
        "final answer, else a nearby wrong number, with another prompt's solution and hints (the contrastive signal "
        "of RLCSD, arXiv 2606.11709, and CEPO, arXiv 2605.19436, used as-is: no tanh squashing; bound it with "
        "token_clip). Costs a second teacher pass; divergence = 'sampled' only. 'same_engine' (teacher.kind = "
        "'self'): teacher_lp minus the teacher engine's logprob of the same tokens after the student's own prompt, "
        "both from one engine, one batch: with vLLM the trainer's kernels and precision (fp32 head) then never "
        "enter the signal, and an empty teacher context gives zero; 'student' compares the server's kernels with "
        "the trainer's (measured in docs/distributed-and-vllm.md). Costs a second teacher pass; 'sampled' only.")
    pass_rate_weighting: bool = setting(
        False, "Weight each prompt's teacher term by sqrt(p (1 - p)), p its group's pass rate, over the step's mean "
        "weight (SC-SDPO, arXiv 2605.27765): the teacher speaks where the group is mixed, not on prompts all right "
        "or all wrong.")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.lambda_opd == 0 and self.lambda_rl == 0:
            fail(self._key("lambda_opd"), "loss.lambda_opd and loss.lambda_rl are both 0: nothing to train on")
        if self.is_cap != 0 and self.is_cap < 1:
            fail(self._key("is_cap"), f"must be 0 (off) or >= 1, got {self.is_cap!r}")
        if self.rlsd_weight > 0 and self.lambda_rl == 0:
            fail(self._key("rlsd_weight"), "weighs the GRPO term, which is off (loss.lambda_rl = 0)")
        for name, active in (("rl_advantage", self.rl_advantage != "group_norm"), ("wrong_reward", self.wrong_reward != 0)):
            if active and self.lambda_rl == 0:
                fail(self._key(name), "shapes the GRPO term, which is off (loss.lambda_rl = 0)")
        if self.wrong_reward != 0 and self.rl_advantage == "group_norm" and not self.partial_credit:
            fail(self._key("wrong_reward"), f"{self.wrong_reward:g} changes nothing with loss.rl_advantage = "
                 "'group_norm': a group of rewards 1 and wrong_reward is centred and scaled to the same advantages as "
                 "one of 1 and 0 (use 'raw' or 'group_mean', as the Modal OPD tutorial's +1 / -1 needs)")
        if self.clip_per == "vocabulary_entry":
            if self.divergence not in FULL_VOCABULARY:
                fail(self._key("clip_per"), f"'vocabulary_entry' caps the terms of a full-vocabulary divergence; "
                     f"loss.divergence is {self.divergence!r} (use 'reverse_kl', 'forward_kl' or 'jsd')")
            if self.token_clip == 0:
                fail(self._key("clip_per"), "'vocabulary_entry' has nothing to cap: loss.token_clip is 0 "
                     "(OPSD: 0.05)")
        for name, active in (("opd_on", self.opd_on != "all"), ("pass_rate_weighting", self.pass_rate_weighting),
                             ("opd_baseline", self.opd_baseline != "student")):
            if active and self.lambda_opd == 0 and not (name == "opd_baseline" and self.rlsd_weight > 0):
                fail(self._key(name), "shapes the teacher term, which is off (loss.lambda_opd = 0)")
        if self.opd_baseline != "student" and self.divergence != "sampled":
            fail(self._key("opd_baseline"), f"{self.opd_baseline!r} is a sampled-token signal; loss.divergence is "
                 f"{self.divergence!r} (use 'sampled')")
