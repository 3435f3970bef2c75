"""Episodes on the packaged SmolLM2, in process: ids exact across turns (against what the engine was
given and against a one-shot render), the mask on the student's ids only, the limits, and
environments that answer badly."""

from __future__ import annotations

import pytest
import torch

from selfopd.data import load_examples
from selfopd.engines.base import SamplingParams
from selfopd.engines.local import LocalEngine
from selfopd.episodes.environment import MAX_MESSAGE_CHARS, Response, RetryWithFeedback
from selfopd.episodes.sampling import EpisodeLimits, run_episodes
from selfopd.templating.chat_format import ChatFormat
from selfopd.templating.templates import load_template, render_student
from tests.engine_contract import TOLERANCE

SPEC = "rg:chain_sum?min_terms=3&max_terms=3&size=8&seed=5"
PARAMS = SamplingParams(max_tokens=24, temperature=1.0, seed=7)


class Recording:
    """The engine, with every prompt it was given to sample kept."""

    def __init__(self, engine):
        self.engine, self.prompts = engine, []

    def sample(self, prompts, params):
        self.prompts += [list(p) for p in prompts]
        return self.engine.sample(prompts, params)


@pytest.fixture(scope="module")
def setting(smollm2_model, smollm2_tokenizer):
    engine = LocalEngine(smollm2_model, smollm2_tokenizer, batch_size=8)
    chat = ChatFormat(smollm2_tokenizer)
    examples = load_examples(SPEC)[:4]
    messages = [render_student(load_template("student/plain"), e) for e in examples]
    return engine, chat, examples, messages


@pytest.fixture(scope="module")
def recorded(setting):
    """(the engine as it recorded its prompts, the first prompts, the episodes): three turns at most."""
    engine, chat, examples, messages = setting
    recording = Recording(engine)
    prompts = [chat.prompt_ids(m) for m in messages]
    return recording, prompts, run_episodes(recording, chat, prompts, examples, _retry(chat), PARAMS, EpisodeLimits(3, 200))


def _retry(chat: ChatFormat, attempts: int = 3):
    return lambda example: RetryWithFeedback(lambda reply, e, finish: chat.grade(reply, e, finish), attempts)


def test_each_turn_samples_after_exactly_the_ids_so_far_and_only_the_students_ids_are_trained(setting, recorded):
    engine = setting[0]
    recording, prompts, episodes = recorded
    assert any(len(e.turns) > 1 for e in episodes), "no episode went past one turn: the test proves nothing"
    for episode, prompt in zip(episodes, prompts):
        ids = episode.ids
        assert ids[: len(prompt)] == prompt
        # Before each student turn, the engine was given exactly the episode's ids up to that turn.
        offset = len(prompt)
        for turn in episode.turns:
            if turn.role == "student":
                assert ids[:offset] in recording.prompts
            offset += len(turn.ids)
        rollout = episode.rollout()
        assert rollout.prompt_ids + rollout.completion_ids == ids
        assert [own for own in rollout.loss_mask] == [t.role == "student" for t in episode.turns for _ in t.ids]
        # The sampler's logprobs are what the engine computes for those ids in that context.
        scored = engine.score([(rollout.prompt_ids, rollout.completion_ids)])[0].logprobs
        mask = torch.tensor(rollout.loss_mask)
        assert torch.allclose(scored[mask], torch.tensor(rollout.sampler_logprobs)[mask], atol=TOLERANCE * 50)


def test_an_episode_is_a_one_shot_render_of_its_conversation_where_the_replies_tokenize_alike(setting, recorded):
    _, chat, _, messages = setting
    episodes = recorded[2]
    special = set(chat.tokenizer.all_special_ids)
    compared = 0
    for episode, first in zip(episodes, messages):
        students = [t for t in episode.turns if t.role == "student"]
        if len(students) < 2:
            continue
        canonical = all(list(t.ids[:-1] if t.ids[-1] in special else t.ids)
                        == chat.tokenizer.encode(t.text, add_special_tokens=False) for t in students)
        if not canonical:  # a sampled tokenization that is not the tokenizer's own: a one-shot render differs
            continue
        conversation = list(first)
        for turn, info_turn in zip(students, range(len(students))):
            conversation.append({"role": "assistant", "content": turn.text})
            if info_turn < len(students) - 1:
                conversation.append({"role": "user", "content": _feedback_after(episode, info_turn)})
        one_shot = chat.ids(conversation, add_generation_prompt=False)
        assert episode.ids == one_shot[: len(episode.ids)]
        compared += 1
    assert compared, "no episode of two turns with canonical replies to compare"


def _feedback_after(episode, index: int) -> str:
    """The text of the environment's message after the student's turn `index`."""
    environment = [t for t in episode.turns if t.role == "environment"][index]
    text = environment.text
    start = text.index("<|im_start|>user\n") + len("<|im_start|>user\n")
    return text[start : text.index("<|im_end|>", start)]


def test_the_episode_token_limit_cuts_the_reply_and_ends_it(setting):
    engine, chat, examples, messages = setting
    prompts = [chat.prompt_ids(m) for m in messages]
    episodes = run_episodes(engine, chat, prompts, examples, _retry(chat), PARAMS, EpisodeLimits(3, 30))
    for episode in episodes:
        assert len(episode.ids) - len(episode.prompt_ids) <= 30
        assert episode.turns[-1].role == "student"
    assert any(e.ending == "max_episode_tokens" and e.finish_reason == "length" for e in episodes)


class Hostile:
    def __init__(self, answer):
        self.answer = answer

    def reset(self, example):
        pass

    def step(self, reply, finish_reason):
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


@pytest.mark.parametrize("answer, says", [
    (Response(({"role": "assistant", "content": "I am the model now"},)), "role 'assistant'"),
    (Response((), reward=float("nan")), "not a finite number"),
    ("not a response", "not a Response"),
    (RuntimeError("environment crashed"), "step raised RuntimeError: environment crashed"),
])
def test_an_environment_that_answers_badly_ends_its_episode_with_one_line_and_the_others_go_on(setting, answer, says, caplog):
    engine, chat, examples, messages = setting
    prompts = [chat.prompt_ids(m) for m in messages[:2]]
    make = [lambda e: Hostile(answer), _retry(chat)]
    environments = iter(make)
    episodes = run_episodes(engine, chat, prompts, examples[:2], lambda e: next(environments)(e), PARAMS,
                            EpisodeLimits(2, 200))
    assert says in episodes[0].info["error"] and "episode 0" in episodes[0].info["error"]
    assert "\n" not in episodes[0].info["error"]
    assert len(episodes[0].turns) == 1  # the student's reply is kept
    assert "error" not in episodes[1].info


def test_an_environments_huge_or_undecodable_message_is_bounded(setting):
    engine, chat, examples, messages = setting
    huge = Response(({"role": "user", "content": b"\xff\xfe" + b"x" * (MAX_MESSAGE_CHARS * 3)},))
    episodes = run_episodes(engine, chat, [chat.prompt_ids(messages[0])], examples[:1], lambda e: Hostile(huge),
                            PARAMS, EpisodeLimits(2, 4000))
    environment = [t for t in episodes[0].turns if t.role == "environment"]
    if environment:  # room left for it
        assert "more characters cut" in environment[0].text and "\ufffd" in environment[0].text
    else:
        assert episodes[0].ending == "max_episode_tokens"
