"""selfopd.training.advantages (the OPD and GRPO advantages and the cures for the privileged illusion): each advantage against a float64
reference written from its paper's formula, the policy-gradient loss's gradient against its
analytic value, the identities (l = 0 is GRPO, routing with every rollout correct is GRPO, an
empty-context teacher gives no contrastive signal), and each cure through a real train step."""

from __future__ import annotations

import math

import pytest
import torch

from selfopd.config import ConfigError, load_config
from selfopd.training.advantages import (cure_advantage, grpo_advantage, opd_advantage, mean_prompt_weight, opd_rollout_weights, pass_rate_weights, rlsd_factor,
                            rlsd_lambda, rl_advantage, rl_rewards)
from selfopd.data.example import Example
from selfopd.training.loss import policy_gradient_loss
from selfopd.templating.wrong_context import failed_sibling_answers, wrong_example

torch.set_num_threads(1)


def _batch(seed: int = 0):
    """Two prompt groups of three rollouts, ragged completions, rewards mixed in group 0."""
    g = torch.Generator().manual_seed(seed)
    teacher_BT = -torch.rand(6, 5, generator=g, dtype=torch.float64) * 3
    student_BT = -torch.rand(6, 5, generator=g, dtype=torch.float64) * 3
    mask_BT = torch.ones(6, 5, dtype=torch.bool)
    mask_BT[1, 3:] = False
    mask_BT[4, 1:] = False
    rewards_B = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0], dtype=torch.float64)
    groups_B = torch.tensor([0, 0, 0, 1, 1, 1])
    return teacher_BT, student_BT, mask_BT, rewards_B, groups_B


def _grpo_reference(rewards: list[float], groups: list[int], eps: float = 1e-6) -> list[float]:
    out = []
    for b, r in enumerate(rewards):
        members = [rewards[i] for i in range(len(rewards)) if groups[i] == groups[b]]
        mean = sum(members) / len(members)
        std = math.sqrt(sum((x - mean) ** 2 for x in members) / len(members))
        out.append(0.0 if max(members) == min(members) else (r - mean) / (std + eps))
    return out


def _reference(teacher, baseline, mask, rewards, groups, weights, lambda_opd, lambda_rl, lam, clip, token_clip=0.0):
    """The composed advantage, one float64 scalar at a time, straight from the formulas."""
    grpo = _grpo_reference(rewards.tolist(), groups.tolist())
    out = torch.zeros_like(teacher, dtype=torch.float64)
    for b in range(teacher.shape[0]):
        for t in range(teacher.shape[1]):
            if not mask[b, t]:
                continue
            s = float(teacher[b, t]) - float(baseline[b, t])
            sign = (grpo[b] > 0) - (grpo[b] < 0)
            factor = (1 - lam) + lam * min(max(math.exp(sign * s), 1 - clip), 1 + clip)
            opd = max(-token_clip, min(token_clip, s)) if token_clip > 0 else s
            out[b, t] = lambda_rl * grpo[b] * factor + lambda_opd * float(weights[b]) * opd
    return out


def test_rlsd_lambda_falls_linearly_to_zero_at_decay_steps():
    assert [rlsd_lambda(step, 0.5, 50) for step in (0, 25, 49, 50, 80)] == pytest.approx([0.5, 0.25, 0.5 / 50, 0.0, 0.0], abs=1e-15)
    assert rlsd_lambda(1000, 0.3, 0) == 0.3


@pytest.mark.parametrize("lam,clip", [(0.5, 0.2), (1.0, 0.5), (0.25, 0.0)])
def test_teacher_weighted_grpo_matches_the_float64_formula(lam, clip):
    teacher, student, mask, rewards, groups = _batch()
    weights = torch.ones(6, dtype=torch.float64)
    advantage, grpo_part = cure_advantage(teacher, student, mask, rewards, groups, weights, 0.0, 1.0, lam, clip)
    expected = _reference(teacher, student, mask, rewards, groups, weights, 0.0, 1.0, lam, clip)
    assert torch.allclose(advantage, expected, rtol=1e-12, atol=1e-12)
    assert torch.equal(advantage, grpo_part)  # no teacher term: everything is the GRPO part
    # The verifier decides the sign; the teacher only scales it, within [(1-l) + l(1-e), (1-l) + l(1+e)].
    plain, _ = cure_advantage(teacher, student, mask, rewards, groups, weights, 0.0, 1.0, 0.0, clip)
    nonzero = plain != 0
    assert torch.equal(torch.sign(advantage), torch.sign(plain))
    ratio = advantage[nonzero] / plain[nonzero]
    assert ratio.min() >= (1 - lam) + lam * (1 - clip) - 1e-12 and ratio.max() <= (1 - lam) + lam * (1 + clip) + 1e-12


def test_rlsd_factor_favours_the_tokens_the_teacher_likes_in_a_rewarded_rollout():
    grpo = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    signal = torch.tensor([[0.1, -0.1], [0.1, -0.1]])
    factor = rlsd_factor(grpo, signal, lam=1.0, clip=0.2)
    assert factor[0, 0] > 1 > factor[0, 1]  # rewarded: push up more where the teacher agrees
    assert factor[1, 1] > 1 > factor[1, 0]  # penalised: push down more where the teacher disagrees


def test_lambda_zero_is_grpo_exactly_and_plain_settings_are_the_old_advantage_exactly():
    teacher, student, mask, rewards, groups = (t.float() if t.is_floating_point() else t for t in _batch(1))
    ones = torch.ones(6, dtype=torch.float64)
    grpo_only, _ = cure_advantage(teacher, student, mask, rewards, groups, ones, 0.0, 1.0, rlsd_lam=0.0)
    grpo_BT = torch.where(mask, grpo_advantage(rewards, groups)[:, None], 0.0)
    assert torch.equal(grpo_only, grpo_BT)
    for lambda_opd, lambda_rl, clip in ((0.3, 1.0, 0.0), (1.0, 0.0, 0.0), (0.7, 0.5, 0.2)):
        mixed, _ = cure_advantage(teacher, student, mask, rewards, groups, ones, lambda_opd, lambda_rl, token_clip=clip)
        assert torch.equal(mixed, lambda_rl * grpo_BT + lambda_opd * opd_advantage(teacher, student, mask, clip))


# ---- the GRPO term's baseline and the reward of a wrong rollout (loss.rl_advantage, loss.wrong_reward) ----


def _rl_reference(rewards: list[float], groups: list[int], kind: str, wrong_reward: float) -> list[float]:
    """float64, one rollout at a time: a wrong rollout (reward 0) paid wrong_reward, then the baseline."""
    paid = [wrong_reward if r == 0 else r for r in rewards]
    if kind == "group_norm":
        return _grpo_reference(paid, groups)
    if kind == "raw":
        return paid
    out = []
    for b, r in enumerate(paid):
        members = [paid[i] for i in range(len(paid)) if groups[i] == groups[b]]
        out.append(0.0 if max(members) == min(members) else r - sum(members) / len(members))
    return out


def test_raw_advantage_gives_an_all_wrong_group_the_wrong_reward_on_every_token():
    """The Modal OPD tutorial's GRPO term (slime with a custom reward post-process): +1 / -1 rewards,
    no group mean, no std. A uniform all-wrong group (group 1 here) gets -1 on every completion
    token, where the group-normalised default gives it exactly 0."""
    teacher, student, mask, _, groups = _batch()
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    ones = torch.ones(6, dtype=torch.float64)
    advantage, grpo_part = cure_advantage(teacher, student, mask, rewards, groups, ones, 0.0, 1.0,
                                          rl_kind="raw", wrong_reward=-1.0)
    assert torch.equal(advantage, grpo_part)
    assert torch.equal(advantage[3:][mask[3:]], torch.full((int(mask[3:].sum()),), -1.0, dtype=torch.float64))
    assert advantage[0][mask[0]].eq(1.0).all() and advantage[1:3][mask[1:3]].eq(-1.0).all()
    assert advantage[~mask].eq(0).all()
    default, _ = cure_advantage(teacher, student, mask, rewards, groups, ones, 0.0, 1.0)
    assert default[3:].eq(0).all()  # the default: a uniform group carries no signal
    # With lambda_rl and the teacher term: lambda_rl * r + lambda_opd * (teacher - student), token by token.
    mixed, _ = cure_advantage(teacher, student, mask, rewards, groups, ones, 0.7, 0.5, rl_kind="raw", wrong_reward=-1.0)
    paid = torch.tensor([1.0, -1, -1, -1, -1, -1], dtype=torch.float64)
    assert torch.allclose(mixed, torch.where(mask, 0.5 * paid[:, None] + 0.7 * (teacher - student), 0.0),
                          rtol=0, atol=1e-15)


@pytest.mark.parametrize("kind", ["group_norm", "group_mean", "raw"])
@pytest.mark.parametrize("wrong_reward", [0.0, -1.0, -0.3])
def test_rl_advantage_matches_its_float64_formula(kind, wrong_reward):
    """Ragged groups named in any order, partial credit (0.5, 0.25), groups all wrong, all right
    and of one: each kind against its formula written rollout by rollout."""
    rewards = [1.0, 0.0, 0.5, 0.0, 0.0, 1.0, 1.0, 0.25, 0.0, 1.0]
    groups = [7, 7, 7, 3, 3, 9, 9, 5, 5, 2]
    got = rl_advantage(torch.tensor(rewards, dtype=torch.float64), torch.tensor(groups), kind, wrong_reward)
    want = _rl_reference(rewards, groups, kind, wrong_reward)
    assert got.dtype == torch.float64
    assert torch.allclose(got, torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=1e-12), (got, want)
    flat = torch.tensor([False, False, False, True, True, True, True, False, False, True])
    if kind != "raw":
        assert got[flat].eq(0).all()  # a group of equal rewards (or of one): exactly 0, no rounding residue
    if kind == "group_mean":  # r - mean, exactly: the centred rewards of each group sum to 0
        assert [round(float(got[[i for i, g in enumerate(groups) if g == group]].sum()), 12) for group in set(groups)] == [0.0] * 5


def test_the_default_advantage_is_grpo_bit_for_bit():
    """group_norm with wrong_reward 0 is the old GRPO advantage exactly (the behaviour digest's
    defaults), in float32 and float64, and through cure_advantage's defaults."""
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.float64):
        rewards = (torch.rand(24, generator=g) > 0.6).to(dtype) * torch.rand(24, generator=g).to(dtype).round()
        groups = torch.arange(6).repeat_interleave(4)
        assert torch.equal(rl_advantage(rewards, groups), grpo_advantage(rewards, groups))
        assert torch.equal(rl_advantage(rewards, groups, "group_norm", 0.0), grpo_advantage(rewards, groups))
    teacher, student, mask, rewards, groups = _batch(4)
    ones = torch.ones(6, dtype=torch.float64)
    explicit = cure_advantage(teacher, student, mask, rewards, groups, ones, 0.4, 1.0, 0.5, 0.2, 0.3,
                              rl_kind="group_norm", wrong_reward=0.0)
    default = cure_advantage(teacher, student, mask, rewards, groups, ones, 0.4, 1.0, 0.5, 0.2, 0.3)
    assert all(torch.equal(a, b) for a, b in zip(explicit, default))


def test_rl_rewards_pay_a_wrong_rollout_the_wrong_reward_and_keep_the_rest():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0])
    assert rl_rewards(rewards, -1.0).tolist() == [1.0, -1.0, 0.5, -1.0]
    assert torch.equal(rl_rewards(rewards), rewards)
    assert rl_rewards(torch.tensor([1, 0]), -1.0).tolist() == [1.0, -1.0]  # integer rewards become floats
    with pytest.raises(ValueError, match="rl_advantage"):
        rl_advantage(rewards, torch.zeros(4), "mean")
    with pytest.raises(ValueError, match="1-D"):
        rl_advantage(rewards, torch.zeros(3), "raw")


def test_rlsd_keeps_the_verifiers_sign_under_the_raw_advantage():
    """RLSD's factor reads the sign of the GRPO advantage: under 'raw' with -1 for a wrong rollout,
    every wrong rollout is pushed down (a factor within the clip), every right one up."""
    teacher, student, mask, rewards, groups = _batch(5)
    ones = torch.ones(6, dtype=torch.float64)
    advantage, _ = cure_advantage(teacher, student, mask, rewards, groups, ones, 0.0, 1.0, 0.5, 0.2,
                                  rl_kind="raw", wrong_reward=-1.0)
    sign = torch.where(rewards > 0, 1.0, -1.0).double()[:, None].expand_as(advantage)
    assert torch.equal(torch.sign(advantage[mask]), sign[mask])
    assert advantage[mask].abs().min() >= 0.5 + 0.5 * 0.8 - 1e-12 and advantage[mask].abs().max() <= 0.5 + 0.5 * 1.2 + 1e-12


def test_routing_trains_the_teacher_term_on_failed_rollouts_only():
    teacher, student, mask, rewards, groups = _batch(2)
    weights = opd_rollout_weights(rewards.bool(), groups, "failed", pass_rate=False)
    assert weights.tolist() == [0.0, 1.0, 1.0, 0.0, 0.0, 1.0]
    advantage, grpo_part = cure_advantage(teacher, student, mask, rewards, groups, weights, 1.0, 1.0, token_clip=0.5)
    expected = _reference(teacher, student, mask, rewards, groups, weights, 1.0, 1.0, 0.0, 0.2, token_clip=0.5)
    assert torch.allclose(advantage, expected, rtol=1e-12, atol=1e-12)
    correct = rewards.bool()
    assert torch.equal(advantage[correct], grpo_part[correct])  # a passed rollout: GRPO only, exactly


def test_routing_with_every_rollout_correct_is_grpo_exactly():
    """Partial-credit rewards differ while every rollout is correct: GRPO still has a signal,
    and routing leaves exactly that signal."""
    teacher, student, mask, _, groups = _batch(3)
    rewards = torch.tensor([1.0, 0.9, 0.8, 1.0, 0.7, 0.95], dtype=torch.float64)
    weights = opd_rollout_weights(torch.ones(6, dtype=torch.bool), groups, "failed", pass_rate=False)
    routed, _ = cure_advantage(teacher, student, mask, rewards, groups, weights, 1.0, 1.0)
    grpo, _ = cure_advantage(teacher, student, mask, rewards, groups, weights, 0.0, 1.0)
    assert routed.abs().max() > 0 and torch.equal(routed, grpo)


def test_pass_rate_weights_match_sqrt_p_one_minus_p_and_average_one_over_prompts():
    correct = torch.tensor([1, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0], dtype=torch.bool)
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2])
    raw = pass_rate_weights(correct, groups)
    expected = [math.sqrt(0.25 * 0.75)] * 4 + [0.0] * 8  # p = 1/4, 1 and 0
    assert torch.allclose(raw, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-15)
    total, prompts = mean_prompt_weight(correct, groups)
    assert prompts == 3 and total == pytest.approx(math.sqrt(0.1875), abs=1e-15)
    weights = opd_rollout_weights(correct, groups, "all", pass_rate=True, pass_rate_mean=total / prompts)
    per_prompt = [float(weights[groups == g][0]) for g in range(3)]
    assert sum(per_prompt) / 3 == pytest.approx(1.0, abs=1e-12) and per_prompt[1:] == [0.0, 0.0]
    # Every group all right or all wrong: no teacher term at all this step (never nan).
    flat = opd_rollout_weights(correct[4:], groups[4:], "all", pass_rate=True, pass_rate_mean=0.0)
    assert torch.equal(flat, torch.zeros(8, dtype=torch.float64))
    # Routing and pass rate compose: failed rollouts of mixed groups only.
    both = opd_rollout_weights(correct, groups, "failed", pass_rate=True, pass_rate_mean=total / prompts)
    assert torch.equal(both > 0, torch.tensor([0, 1, 1, 1] + [0] * 8, dtype=torch.bool))


def test_contrastive_signal_is_teacher_minus_wrong_context_teacher():
    teacher, student, mask, rewards, groups = _batch(4)
    wrong = teacher - torch.linspace(-1, 1, 30, dtype=torch.float64).reshape(6, 5)
    weights = torch.ones(6, dtype=torch.float64)
    advantage, _ = cure_advantage(teacher, wrong, mask, rewards, groups, weights, 1.0, 1.0, rlsd_lam=0.5)
    expected = _reference(teacher, wrong, mask, rewards, groups, weights, 1.0, 1.0, 0.5, 0.2)
    assert torch.allclose(advantage, expected, rtol=1e-12, atol=1e-12)
    same, _ = cure_advantage(teacher, teacher.clone(), mask, rewards, groups, weights, 1.0, 0.0)
    assert torch.equal(same, torch.zeros_like(same))  # identical contexts: no signal, exactly


@pytest.mark.parametrize("cure", ["rlsd", "routing", "pass_rate", "contrastive"])
def test_policy_gradient_of_each_cure_is_minus_its_advantage_over_the_token_count(cure):
    """d loss / d logpi_t = -A_t / N (token normalisation), checked analytically and by central
    finite differences in float64 on the composed advantage."""
    teacher, student, mask, rewards, groups = _batch(5)
    correct = rewards.bool()
    weights = {"routing": opd_rollout_weights(correct, groups, "failed", False),
               "pass_rate": opd_rollout_weights(correct, groups, "all", True, 0.3)}.get(cure, torch.ones(6, dtype=torch.float64))
    baseline = teacher - 0.2 if cure == "contrastive" else student
    advantage, _ = cure_advantage(teacher, baseline, mask, rewards, groups, weights, 0.5, 1.0,
                                  rlsd_lam=0.5 if cure == "rlsd" else 0.0)
    logpi = student.clone().requires_grad_(True)
    loss = policy_gradient_loss(logpi, advantage, mask)
    loss.backward()
    count = int(mask.sum())
    expected = torch.where(mask, -advantage / count, torch.zeros_like(advantage))
    assert torch.allclose(logpi.grad, expected, rtol=1e-12, atol=1e-15)
    h = 1e-6
    for b, t in ((0, 0), (1, 2), (5, 4)):
        up, down = student.clone(), student.clone()
        up[b, t] += h
        down[b, t] -= h
        numeric = (policy_gradient_loss(up, advantage, mask) - policy_gradient_loss(down, advantage, mask)) / (2 * h)
        assert float(numeric) == pytest.approx(float(logpi.grad[b, t]), rel=1e-6, abs=1e-10)


def test_failed_sibling_answers_never_pick_the_rollout_itself_or_a_correct_one():
    extracted = ["12", "13", None, "12", "15"]
    correct = [True, False, False, False, False]
    picks = failed_sibling_answers(extracted, correct, seed=0, step=3, group=1)
    for row, pick in enumerate(picks):
        candidates = {extracted[i] for i in range(5) if not correct[i] and i != row and extracted[i]}
        assert pick in candidates
    assert picks == failed_sibling_answers(extracted, correct, seed=0, step=3, group=1)  # seeded
    assert failed_sibling_answers(["7", "8"], [True, False], seed=0, step=0, group=0) == ["8", None]  # a lone failure: none


def test_wrong_example_takes_the_failed_siblings_answer_else_a_nearby_number():
    item = Example("a", "Calculate 40 + 2.", "42", solution="40 + 2 = 42.")
    other = Example("b", "Calculate 1 + 1.", "2", solution="1 + 1 = 2.")
    assert wrong_example(item, other, answer="41").answer == "41"
    assert wrong_example(item, other, answer="41").solution == "1 + 1 = 2."
    nearby = wrong_example(item, other, answer="42").answer  # a "wrong" answer equal to the reference is not used
    assert nearby != "42" and abs(int(nearby) - 42) <= 3


@pytest.mark.parametrize("overrides,key", [
    (["loss.rlsd_weight=0.5", "loss.lambda_rl=0"], "loss.rlsd_weight"),
    (["loss.rlsd_weight=1.5"], "loss.rlsd_weight"),
    (["loss.rlsd_clip=1"], "loss.rlsd_clip"),
    (["loss.opd_on=failed", "loss.lambda_opd=0", "loss.lambda_rl=1"], "loss.opd_on"),
    (["loss.pass_rate_weighting=true", "loss.lambda_opd=0", "loss.lambda_rl=1"], "loss.pass_rate_weighting"),
    (["loss.opd_baseline=wrong_context", "loss.divergence=reverse_kl"], "loss.opd_baseline"),
])
def test_cure_settings_that_cannot_act_are_refused_by_name(overrides, key):
    with pytest.raises(ConfigError) as error:
        load_config(None, overrides)
    assert error.value.key == key


SMALL = ["data.spec=rg:chain_sum?min_terms=2&max_terms=2&size=60&seed=2", "data.eval_size=4",
         "rollout.prompts_per_step=2", "rollout.samples_per_prompt=3", "rollout.max_tokens=6",
         "optim.micro_batch_prompts=1", "optim.lr=1e-3", "eval.max_tokens=6", "eval.batch_size=4",
         "run.progress=false", "run.eval_every=0"]


@pytest.mark.parametrize("cure,extra,metric", [
    ("rlsd", ["loss.rlsd_weight=0.5", "loss.lambda_opd=0", "loss.lambda_rl=1"], "loss/rlsd_lambda"),
    ("routing", ["loss.opd_on=failed", "loss.lambda_rl=1"], "opd/weighted_share"),
    ("pass_rate", ["loss.pass_rate_weighting=true", "loss.lambda_rl=1"], "opd/weighted_share"),
    ("contrastive", ["loss.opd_baseline=wrong_context", "loss.lambda_rl=1"], "opd/context_contrast"),
])
def test_each_cure_trains_a_step_and_logs_its_setting(tmp_path, tiny_model_dir, cure, extra, metric):
    from selfopd.training.trainer import build_run, train_step

    config = load_config(None, [*SMALL, f"model.student={tiny_model_dir}", f"run.out_dir={tmp_path}",
                                f"run.name={cure}", *extra])
    run = build_run(config)
    before = {n: p.detach().clone() for n, p in run.model.named_parameters()}
    metrics = train_step(run)
    assert metric in metrics and math.isfinite(metrics[metric]) and math.isfinite(metrics["loss/pg"])
    if cure == "rlsd":
        assert metrics[metric] == 0.5
    moved = any(not torch.equal(p, before[n]) for n, p in run.model.named_parameters())
    assert moved == (metrics["loss/advantage_std"] > 0)  # a step with no signal (every group flat) does not move
    run.close()


def test_an_empty_context_teacher_gives_exactly_zero_contrastive_signal(tmp_path, tiny_model_dir):
    """teacher/empty renders the same prompt under the true and the wrong context: the two
    scores are the same numbers, so the contrastive advantage and the update are exactly zero."""
    from selfopd.training.trainer import build_run, train_step

    config = load_config(None, [*SMALL, f"model.student={tiny_model_dir}", f"run.out_dir={tmp_path}", "run.name=zero",
                                "teacher.template=teacher/empty", "loss.opd_baseline=wrong_context",
                                "loss.lambda_opd=1", "loss.lambda_rl=0"])
    run = build_run(config)
    before = {n: p.detach().clone() for n, p in run.model.named_parameters()}
    metrics = train_step(run)
    assert metrics["opd/context_contrast"] == 0.0
    assert metrics["loss/advantage_mean"] == 0.0 and metrics["loss/advantage_std"] == 0.0
    for name, param in run.model.named_parameters():
        assert torch.equal(param, before[name]), name
    run.close()
