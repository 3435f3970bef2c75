"""The diagnostics' numbers against hand computations on constructed rollouts."""

from __future__ import annotations

import numpy as np
import pytest

from selfopd.diagnostics.measures import (
    Annotated,
    collapse_warnings,
    context_contrast,
    correct_preference,
    decompose,
    illusion_score,
    ratio_share,
    step_behaviour,
)
from selfopd.run.rollouts import RolloutRecord
from selfopd.diagnostics.tokens import TokenPieces


def rollout(classes, advantage, text=None, correct=True, leaks=(), prompt=0):
    n = len(classes)
    pieces = [f"w{i} " for i in range(n)]
    record = RolloutRecord(step=1, id=f"x{prompt}", group=prompt, prompt_ids=[prompt], completion_ids=list(range(n)),
                           text="".join(pieces), sampler_logprobs=[0.0] * n, student_logprobs=[0.0] * n,
                           teacher_logprobs=list(advantage), advantage=list(advantage), reward=float(correct),
                           correct=correct, answer="5")
    spans, start = [], 0
    for p in pieces:
        spans.append((start, start + len(p)))
        start += len(p)
    return Annotated(record, TokenPieces(text or "".join(pieces), pieces, spans), list(classes),
                     np.asarray(advantage, dtype=np.float64), list(leaks))


ROLLOUTS = [
    rollout(["answer_copy", "structural", "other", "other"], [2.0, -0.5, 0.25, -0.25]),
    rollout(["answer_slot", "epistemic", "other"], [-3.0, 1.0, 0.0], correct=False, prompt=1),
]


def test_decomposition_matches_hand_sums():
    rows = {row.name: row for row in decompose(ROLLOUTS)}
    total = 2.0 + 0.5 + 0.25 + 0.25 + 3.0 + 1.0
    assert rows["answer_copy"].abs_share.value == pytest.approx(2.0 / total)
    assert rows["answer_slot"].abs_share.value == pytest.approx(3.0 / total)
    assert rows["other"].abs_share.value == pytest.approx(0.5 / total)
    assert rows["other"].tokens == 3 and rows["other"].token_share == pytest.approx(3 / 7)
    assert rows["other"].mean == pytest.approx(0.0)
    assert sum(r.abs_share.value for r in rows.values()) == pytest.approx(1.0)
    assert sum(r.token_share for r in rows.values()) == pytest.approx(1.0)


def test_illusion_score_is_the_answer_tokens_share_of_absolute_advantage():
    score = illusion_score(ROLLOUTS)
    assert score.share.value == pytest.approx(5.0 / 7.0)
    assert score.token_share == pytest.approx(2 / 7)
    assert score.lift == pytest.approx((5 / 7) / (2 / 7))
    assert score.threshold == pytest.approx(1.5 * 2 / 7)
    assert score.warning == (score.share.low > 2 / 7)  # lift 2.5 >= 1.5: the interval decides
    assert not illusion_score(ROLLOUTS, lift_threshold=3.0).warning
    # Six prompts whose answer token holds most of the signal: a clear warning.
    copying = [rollout(["answer_copy", "other", "other", "other"], [2.0 + i / 10, 0.1, -0.1, 0.1], prompt=i)
               for i in range(6)]
    clear = illusion_score(copying)
    assert clear.lift > 3 and clear.share.low > clear.token_share and clear.warning
    # The same shares with the answer on most tokens: no lift, no warning.
    everywhere = [rollout(["answer_copy", "answer_copy", "answer_copy", "other"], [2.0, 0.1, 0.1, 0.1], prompt=i)
                  for i in range(6)]
    assert illusion_score(everywhere).lift < 1.5 and not illusion_score(everywhere).warning
    spread = [rollout(["answer_copy", "other", "other", "other"], [0.1, 1.0, -1.0, 1.0])]
    assert illusion_score(spread).share.value == pytest.approx(0.1 / 3.1) and not illusion_score(spread).warning


def test_ratio_share_bootstrap_brackets_the_value_and_is_seeded():
    rng = np.random.default_rng(1)
    num, den = rng.uniform(0, 1, 200), rng.uniform(1, 2, 200)
    share = ratio_share(num, den)
    assert share.value == pytest.approx(num.sum() / den.sum())
    assert share.low < share.value < share.high and share.high - share.low < 0.1
    assert ratio_share(num, den) == share
    constant = ratio_share([1.0, 2.0, 3.0], [2.0, 4.0, 6.0])
    assert constant.low == pytest.approx(0.5) and constant.high == pytest.approx(0.5)
    assert np.isnan(ratio_share([0.0], [0.0]).value)


def test_context_contrast_follows_and_difference_share():
    gains = [np.array([2.0, 0.0, 0.1, 0.1]), np.array([-3.0, 0.2, 0.0])]
    wrong = [np.array([-2.0, 0.0, 0.1, 0.1]), np.array([-1.0, 0.2, 0.0])]
    contrast = context_contrast(ROLLOUTS, gains, wrong)
    assert contrast.follows_context == 1.0 and contrast.correct_rollouts == 1
    assert contrast.answer_share_of_difference.value == pytest.approx(1.0)  # only answer tokens moved
    assert contrast.mean_gain_correct["answer_copy"] == pytest.approx(2.0)
    assert contrast.mean_gain_wrong["answer_copy"] == pytest.approx(-2.0)


def step(number, length, text="", correct=True, max_tokens=None):
    return step_behaviour(number, [rollout(["other"] * length, [0.0] * length, text=text, correct=correct)], max_tokens)


def test_collapse_warnings_fire_on_falling_length_and_epistemic_words():
    falling = [step(1, 40, "wait maybe check"), step(2, 30, "wait maybe"), step(3, 15, "no"), step(4, 12, "no")]
    warnings = collapse_warnings(falling)
    assert len(warnings) == 2 and "epistemic" in warnings[0] and "length" in warnings[1]
    flat = [step(s, 20, "wait maybe") for s in range(1, 5)]
    assert collapse_warnings(flat) == []
    leaking = [step(1, 20, "x"), step_behaviour(2, [rollout(["other"], [0.0], leaks=["the hint"])])]
    assert any("privileged context" in w for w in collapse_warnings(leaking))


def test_collapse_warnings_fire_on_the_cap_and_on_accuracy_falling_while_kl_falls():
    growing = [step(1, 10, correct=True, max_tokens=24), step(2, 12, correct=True, max_tokens=24),
               step(3, 24, correct=False, max_tokens=24), step(4, 24, correct=False, max_tokens=24)]
    assert growing[0].at_cap == 0.0 and growing[3].at_cap == 1.0
    metrics = [{"step": s, "opd/reverse_kl": kl} for s, kl in ((1, 0.16), (2, 0.1), (3, 0.03), (4, 0.01))]
    warnings = collapse_warnings(growing, metrics)
    assert any("token cap" in w for w in warnings)
    assert any("accuracy of the training rollouts fell from 1.00 to 0.00" in w for w in warnings)
    assert any("reverse KL to the teacher fell (0.160 -> 0.010)" in w for w in warnings)
    rising_kl = [{"step": s, "opd/reverse_kl": kl} for s, kl in ((1, 0.01), (2, 0.1), (3, 0.2), (4, 0.3))]
    assert not any("reverse KL" in w for w in collapse_warnings(growing, rising_kl))


def test_step_behaviour_numbers():
    b = step_behaviour(3, [rollout(["other"] * 10, [0.0] * 10, text="wait hmm ok"),
                           rollout(["other"] * 30, [0.0] * 30, text="fine", correct=False, leaks=["the note"])])
    assert b.length.value == pytest.approx(20.0) and b.length.low < 20 < b.length.high
    assert b.epistemic_per_100 == pytest.approx(100 * 2 / 40)
    assert b.leak_rate == 0.5 and b.accuracy == 0.5


def _record(step, group, teacher, student, correct, prompt=None):
    n = len(teacher)
    prompt_ids = [step * 100 + group] if prompt is None else [prompt]
    return RolloutRecord(step=step, id=f"{step}/{group}", group=group, prompt_ids=prompt_ids, completion_ids=list(range(n)),
                         text="x", sampler_logprobs=list(student), student_logprobs=list(student),
                         teacher_logprobs=list(teacher), advantage=[0.0] * n, reward=float(correct),
                         correct=correct, answer="5")


def test_correct_preference_contrasts_correct_and_wrong_within_each_prompt():
    records = [
        # step 1, prompt 0: correct signals mean(1, 3) = 2 and 0.5; wrong: mean(-1, 0, -2) = -1 -> 1.25 - (-1) = 2.25
        _record(1, 0, [0.0, 2.0], [-1.0, -1.0], True),
        _record(1, 0, [0.5], [0.0], True),
        _record(1, 0, [-1.0, 0.0, -2.0], [0.0, 0.0, 0.0], False),
        # step 2, prompt 0 (same group index, another step: another prompt): 0 - 1 = -1
        _record(2, 0, [0.0], [0.0], True),
        _record(2, 0, [1.0], [0.0], False),
        # all wrong, all correct: no contrast, ignored
        _record(1, 1, [5.0], [0.0], False),
        _record(2, 1, [-5.0], [0.0], True),
    ]
    estimate = correct_preference(records)
    contrasts = np.array([2.25, -1.0])
    half = 1.959963984540054 * contrasts.std(ddof=1) / np.sqrt(2)
    assert estimate.n == 2
    assert estimate.value == pytest.approx(contrasts.mean())
    assert (estimate.low, estimate.high) == pytest.approx((contrasts.mean() - half, contrasts.mean() + half))
    assert correct_preference(records[5:]) is None


def test_correct_preference_counts_a_prompt_met_at_several_steps_once():
    """The unit is the prompt: its groups at two steps are averaged into one contrast."""
    records = [
        _record(1, 0, [1.0], [0.0], True, prompt=7), _record(1, 0, [0.0], [0.0], False, prompt=7),  # +1
        _record(3, 2, [3.0], [0.0], True, prompt=7), _record(3, 2, [0.0], [0.0], False, prompt=7),  # +3
        _record(2, 0, [0.0], [0.0], True, prompt=8), _record(2, 0, [2.0], [0.0], False, prompt=8),  # -2
    ]
    estimate = correct_preference(records)
    assert estimate.n == 2 and estimate.value == pytest.approx((2.0 + -2.0) / 2)


def test_ratio_share_resamples_prompts_not_rollouts():
    """Four prompts, ten alike samples each: the interval is over 4 observations, not 40."""
    numerators = [0.9] * 10 + [0.1] * 10 + [0.8] * 10 + [0.2] * 10
    clusters = [prompt for prompt in "abcd" for _ in range(10)]
    by_rollout = ratio_share(numerators, [1.0] * 40)
    by_prompt = ratio_share(numerators, [1.0] * 40, clusters)
    assert (by_prompt.n, by_rollout.n) == (4, 40) and by_prompt.value == pytest.approx(by_rollout.value)
    assert by_prompt.high - by_prompt.low > 2 * (by_rollout.high - by_rollout.low)
