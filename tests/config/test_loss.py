"""selfopd.config.loss: the [loss] settings that choose the GRPO term's advantage and reward
(`rl_advantage`, `wrong_reward`) and where `token_clip` caps a divergence (`clip_per`):
their defaults keep the old loss, and each combination that cannot act is refused in one line
naming its key."""

from __future__ import annotations

import pytest

from selfopd.config import ConfigError, LossConfig, load_config


def test_defaults_keep_the_group_normalised_advantage_and_the_per_position_clip():
    loss = LossConfig()
    assert (loss.rl_advantage, loss.wrong_reward, loss.clip_per) == ("group_norm", 0.0, "position")


@pytest.mark.parametrize("overrides", [
    ["loss.lambda_rl=1", "loss.rl_advantage=raw", "loss.wrong_reward=-1"],  # the Modal OPD tutorial's GRPO term
    ["loss.lambda_rl=1", "loss.rl_advantage=group_mean", "loss.wrong_reward=-0.5"],
    ["loss.lambda_rl=1", "loss.partial_credit=true", "loss.wrong_reward=-1"],  # group_norm: partial credit moves it
    ["loss.divergence=forward_kl", "loss.token_clip=0.05", "loss.clip_per=vocabulary_entry"],  # OPSD's clip
    ["loss.divergence=jsd", "loss.jsd_beta=0.5", "loss.token_clip=0.05", "loss.clip_per=vocabulary_entry"],
])
def test_settings_that_act_are_accepted(overrides):
    load_config(None, overrides)


@pytest.mark.parametrize("overrides,key,message", [
    (["loss.rl_advantage=raw"], "loss.rl_advantage", "shapes the GRPO term, which is off (loss.lambda_rl = 0)"),
    (["loss.wrong_reward=-1", "loss.rl_advantage=raw"], "loss.rl_advantage",
     "shapes the GRPO term, which is off (loss.lambda_rl = 0)"),
    (["loss.wrong_reward=-1"], "loss.wrong_reward", "shapes the GRPO term, which is off (loss.lambda_rl = 0)"),
    (["loss.lambda_rl=1", "loss.wrong_reward=-1"], "loss.wrong_reward",
     "-1 changes nothing with loss.rl_advantage = 'group_norm': a group of rewards 1 and wrong_reward is centred and "
     "scaled to the same advantages as one of 1 and 0 (use 'raw' or 'group_mean', as the Modal OPD tutorial's "
     "+1 / -1 needs)"),
    (["loss.lambda_rl=1", "loss.rl_advantage=raw", "loss.wrong_reward=0.5"], "loss.wrong_reward", "must be"),
    (["loss.lambda_rl=1", "loss.rl_advantage=raw", "loss.wrong_reward=-2"], "loss.wrong_reward", "must be"),
    (["loss.rl_advantage=mean"], "loss.rl_advantage", "group_norm"),
    (["loss.token_clip=0.05", "loss.clip_per=vocabulary_entry"], "loss.clip_per",
     "'vocabulary_entry' caps the terms of a full-vocabulary divergence; loss.divergence is 'sampled' (use "
     "'reverse_kl', 'forward_kl' or 'jsd')"),
    (["loss.divergence=topk_reverse_kl", "loss.token_clip=0.05", "loss.clip_per=vocabulary_entry"],
     "loss.clip_per", "loss.divergence is 'topk_reverse_kl'"),
    (["loss.divergence=jsd", "loss.clip_per=vocabulary_entry"], "loss.clip_per",
     "'vocabulary_entry' has nothing to cap: loss.token_clip is 0 (OPSD: 0.05)"),
])
def test_settings_that_cannot_act_are_refused_by_name(overrides, key, message):
    with pytest.raises(ConfigError) as error:
        load_config(None, overrides)
    assert error.value.key == key
    assert message in str(error.value) and "\n" not in str(error.value)
