"""TRL environment_factory classes as episodes (`rollout.environment = 'trl:MODULE:NAME'`), on SmolLM2's
tokenizer with a Hermes tool template (tests/tool_templates.py): the class's public methods are the tools
every prompt shows, its calls run through the tool episode, its get_reward() grades the episode, and each
way a class can misbehave ends its episode (or the config) in one line. The student's replies are scripted
text, so that each test knows which calls were made; the environment, parsing, ids and grading are real."""

from __future__ import annotations

import json

import pytest

from selfopd.config import ConfigError, load_config
from selfopd.data.example import Example
from selfopd.engines.base import Rollout, SamplingParams
from selfopd.episodes.sampling import episode_sampler
from selfopd.episodes.prompt_tools import check_student_tools, tool_template_kwargs
from selfopd.templating.chat_format import ChatFormat
from selfopd.training.grading import grade_groups, student_format, student_kwargs
from tests.tool_templates import HERMES_TEMPLATE, tool_tokenizer

MODULE = "tests.episodes.trl_envs"
EXAMPLES = [Example(id="a", prompt="Game A: find the number.", answer="7"),
            Example(id="b", prompt="Game B: find the number.", answer="7")]


def _call(number: int) -> str:
    return f'<tool_call>\n{json.dumps({"name": "guess", "arguments": {"number": number}})}\n</tool_call>'


class Scripted:
    """Replies each episode (told apart by its prompt's game letter) with its script's next text."""

    def __init__(self, tokenizer, scripts: dict[str, list[str]]) -> None:
        self.tokenizer, self.scripts, self.turn = tokenizer, scripts, {key: 0 for key in scripts}
        self.prompts: list[list[int]] = []

    def sample(self, prompts, params):
        out = []
        for prompt in prompts:
            self.prompts.append(list(prompt))
            key = next(k for k in self.scripts if k in self.tokenizer.decode(prompt))
            reply = self.scripts[key][self.turn[key]]
            self.turn[key] += 1
            ids = self.tokenizer(reply + "<|im_end|>", add_special_tokens=False)["input_ids"]
            out.append([Rollout(list(prompt), ids, [0.0] * len(ids), "stop", reply)])
        return out


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer):
    return tool_tokenizer(smollm2_tokenizer.name_or_path, HERMES_TEMPLATE)


def _run(tokenizer, name: str, scripts: dict[str, list[str]], examples=EXAMPLES):
    config = load_config(None, [f"rollout.environment=trl:{MODULE}:{name}", "rollout.max_turns=3"])
    chat = student_format(config, tokenizer)
    sampler = episode_sampler(config.rollout, chat)
    prompts = [chat.prompt_ids([{"role": "user", "content": e.prompt}]) for e in examples]
    engine = Scripted(tokenizer, scripts)
    groups = sampler.sample(engine, prompts, examples, SamplingParams(max_tokens=64))
    return chat, engine, groups


def test_the_class_s_reward_grades_the_episode_not_the_answer_s_text(tokenizer):
    """Game A finds 7 with its tool and then answers: paid 1, correct. Game B never guesses right but
    writes the reference as its answer: the class pays 0, and its reward is the verdict."""
    chat, engine, groups = _run(tokenizer, "FindNumber", {
        "Game A": [_call(5), _call(7), "Found it: \\boxed{7}"], "Game B": [_call(3), "\\boxed{7}"]})
    graded = grade_groups(chat, EXAMPLES, groups)
    (a,), (b,) = (g.verdicts for g in graded)
    assert (a.reward, a.correct, a.method) == (1.0, True, "environment")
    assert (b.reward, b.correct, b.method) == (0.0, False, "environment")
    (rollout_a,), _ = groups
    turns = tokenizer.decode(rollout_a.completion_ids)
    assert turns.count("<tool_call>") == 2 and "higher" in turns and "right" in turns
    assert sum(rollout_a.loss_mask) < len(rollout_a.loss_mask)  # the tool results are the environment's ids
    assert rollout_a.text == "Found it: \\boxed{7}"


def test_without_get_reward_the_verifier_grades_the_last_answer(tokenizer):
    chat, _, groups = _run(tokenizer, "NoReward", {"Game A": [_call(7), "\\boxed{7}"], "Game B": ["\\boxed{8}"]})
    (a,), (b,) = (g.verdicts for g in grade_groups(chat, EXAMPLES, groups))
    assert (a.correct, b.correct) == (True, False) and a.method != "environment"


def test_reset_gets_the_example_s_row(tokenizer):
    from tests.episodes import trl_envs

    seen = []
    original = trl_envs.FindNumber.reset

    def spy(self, **row):
        seen.append(row)
        return original(self, **row)

    trl_envs.FindNumber.reset = spy
    try:
        example = Example(id="c", prompt="Game C.", answer="7", solution="It is 7.", hints=("odd",), meta={"level": 2})
        _run(tokenizer, "FindNumber", {"Game C": ["\\boxed{7}"]}, [example])
    finally:
        trl_envs.FindNumber.reset = original
    assert seen == [{"level": 2, "prompt": "Game C.", "answer": "7", "solution": "It is 7.", "hints": ["odd"]}]


@pytest.mark.parametrize("name, says", [
    ("Talkative", "reset returned an observation ('You have three guesses.'...), which TRL appends to the prompt"),
    ("BrokenReset", "reset raised KeyError: 'no such column'"),
    ("NanReward", "TrlEpisode: reward 'nan' is not a finite number"),
])
def test_a_class_that_misbehaves_ends_its_episode_in_one_line_after_the_first_reply(tokenizer, name, says, caplog):
    chat, _, groups = _run(tokenizer, name, {"Game A": [_call(7), "\\boxed{7}"], "Game B": [_call(7), "\\boxed{7}"]})
    for (rollout,) in groups:  # the first reply kept, nothing after it
        assert rollout.text == _call(7) and all(rollout.loss_mask)
    lines = [r.getMessage() for r in caplog.records if says in r.getMessage()]
    assert len(lines) == 2 and all("\n" not in line for line in lines)


def test_the_tools_are_the_public_methods_in_every_prompt(tokenizer):
    config = load_config(None, [f"rollout.environment=trl:{MODULE}:FindNumber"])
    (schema,) = tool_template_kwargs(config.rollout)["tools"]
    assert schema["function"]["name"] == "guess"
    assert schema["function"]["parameters"]["properties"]["number"]["type"] == "integer"
    student = student_format(config, tokenizer).text([{"role": "user", "content": "Play."}])
    teacher = ChatFormat(tokenizer, config.teacher.template_kwargs(student_kwargs(config))).text(
        [{"role": "user", "content": "Play."}])
    assert student == teacher and '"name": "guess"' in student and "get_reward" not in student


@pytest.mark.parametrize("environment, says", [
    (f"trl:{MODULE}:Undefined", "tool 'poke'"),
    (f"trl:{MODULE}:Missing", "tests.episodes.trl_envs has no class or function Missing"),
    ("trl:no_such_module_here:Env", "importing no_such_module_here failed: ModuleNotFoundError"),
])
def test_a_class_that_cannot_work_is_refused_in_one_line_before_sampling(tokenizer, environment, says):
    config = load_config(None, [f"rollout.environment={environment}"])
    with pytest.raises(ConfigError) as refused:
        check_student_tools(config.rollout, ChatFormat(tokenizer))
    assert says in str(refused.value) and "\n" not in str(refused.value)


def test_the_config_takes_a_trl_class_on_the_data_s_own_prompts(smollm2_tokenizer):
    with pytest.raises(ConfigError, match="expected trl:MODULE:NAME"):
        load_config(None, ["rollout.environment=trl:not a module"])
    with pytest.raises(ConfigError, match=r"data\.spec names an environment"):
        load_config(None, [f"rollout.environment=trl:{MODULE}:FindNumber",
                           "data.spec=env:python:tests.episodes.openenv_envs:Guess?size=4"])
    config = load_config(None, [f"rollout.environment=trl:{MODULE}:FindNumber"])
    with pytest.raises(ConfigError, match="its chat template never reads `tools`"):  # SmolLM2's own template
        check_student_tools(config.rollout, ChatFormat(smollm2_tokenizer))
