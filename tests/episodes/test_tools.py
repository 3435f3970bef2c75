"""Tool-calling episodes: the family's format read from its chat template (and a template without
tools refused), calls parsed in both formats (malformed, unknown, mistyped and hostile ones each one
line, the episode going on), the environment's steps on replies written here, the tools'
definitions in the student's and the teacher's prompts, and real episodes on the packaged SmolLM2
whose replies call the calculator (shown how by a few-shot prompt), ids exact across the tool turn."""

from __future__ import annotations

import json

import pytest

from selfopd.config import load_config
from selfopd.config.settings import ConfigError
from selfopd.data.example import Example
from selfopd.engines.base import SamplingParams
from selfopd.engines.local import LocalEngine
from selfopd.episodes.environment import checked_response, Response
from selfopd.episodes.sampling import episode_sampler, run_episodes
from selfopd.episodes.trl_environment import trl_tools
from selfopd.episodes.tools import (TOOLS, ToolCall, ToolEnvironment, ToolError, Toolset, chat_tool_format,
                                    parse_tool_calls, tool_format, tool_schemas)
from selfopd.templating.chat_format import ChatFormat
from selfopd.training.grading import student_format, student_kwargs
from selfopd.verifiers import VerifyResult
from tests.tool_templates import HERMES_TEMPLATE, TEMPLATES, UNKNOWN_FORMAT_TEMPLATE, XML_TEMPLATE, tool_tokenizer
from tests.episodes.test_sampling import Recording

CALL = {"json": '<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>',
        "xml": "<tool_call>\n<function={name}>\n{parameters}</function>\n</tool_call>"}


def _call(fmt: str, name: str, **arguments) -> str:
    """A call as the family's template asks for it."""
    if fmt == "json":
        return CALL["json"].format(name=name, arguments=json.dumps(arguments))
    parameters = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
                         for k, v in arguments.items())
    return CALL["xml"].format(name=name, parameters=parameters)


class Counter:
    """A TRL-style environment class: its public methods are its tools."""

    def reset(self, **row) -> None:
        self.total = 0

    def get_reward(self) -> float:
        return float(self.total)

    def add(self, amount: int, note: str = "") -> int:
        """Adds to the counter and returns the new total.

        Args:
            amount: how much to add
            note: what the amount is for
        """
        self.total += amount
        return self.total

    def explode(self) -> str:
        """Raises, as a broken tool does."""
        raise RuntimeError("the tool broke\nacross two lines")

    def _hidden(self) -> None:
        pass


def _counter_toolset(fmt: str) -> Toolset:
    counter = Counter()
    counter.reset()
    return Toolset(trl_tools(counter), fmt)


# The format, from the template.

def test_the_format_is_read_from_the_chat_template_and_a_template_without_tools_is_refused(smollm2_tokenizer):
    assert tool_format(HERMES_TEMPLATE, "m") == "json" and tool_format(XML_TEMPLATE, "m") == "xml"
    with pytest.raises(ToolError, match=r"^org/m: its chat template never reads `tools`"):
        tool_format(smollm2_tokenizer.get_chat_template(), "org/m")
    with pytest.raises(ToolError, match="a format selfopd does not read"):
        tool_format(UNKNOWN_FORMAT_TEMPLATE, "org/m")
    schemas = tool_schemas(TOOLS)
    assert chat_tool_format(ChatFormat(tool_tokenizer(smollm2_tokenizer.name_or_path, XML_TEMPLATE),
                                       {"tools": schemas})) == "xml"


def test_rollout_environment_tools_refuses_a_student_template_without_tools_in_one_line(smollm2_tokenizer):
    rollout = load_config(None, ["rollout.environment=tools"]).rollout
    with pytest.raises(ConfigError) as raised:
        episode_sampler(rollout, ChatFormat(smollm2_tokenizer))
    message = str(raised.value)
    assert message.startswith("rollout.environment: 'tools': ") and "never reads `tools`" in message
    assert str(smollm2_tokenizer.name_or_path) in message and "\n" not in message


def test_the_tools_definitions_render_as_transformers_renders_them(smollm2_tokenizer):
    schemas = tool_schemas(TOOLS)
    messages = [{"role": "user", "content": "Calculate 2 + 3."}, {"role": "assistant", "content": "x"},
                {"role": "tool", "content": "5"}, {"role": "tool", "content": "6"}]
    for template in TEMPLATES.values():
        tokenizer = tool_tokenizer(smollm2_tokenizer.name_or_path, template)
        ours = ChatFormat(tokenizer, {"tools": schemas}).text(messages)
        assert ours == tokenizer.apply_chat_template(messages, tools=schemas, tokenize=False, add_generation_prompt=True)
        assert '"name": "calculator"' in ours and '"name": "python"' in ours


def test_the_student_and_every_teacher_prompt_carry_the_same_tools(smollm2_tokenizer):
    tokenizer = tool_tokenizer(smollm2_tokenizer.name_or_path, HERMES_TEMPLATE)
    config = load_config(None, ["rollout.environment=tools", "rollout.tools=python,calculator",
                                "model.chat_template_kwargs=flag=true", "teacher.chat_template_kwargs=other=1"])
    messages = [{"role": "user", "content": "Calculate 2 + 3."}]
    student = student_format(config, tokenizer).text(messages)
    teacher = ChatFormat(tokenizer, config.teacher.template_kwargs(student_kwargs(config))).text(messages)
    assert student == teacher and student.index('"name": "python"') < student.index('"name": "calculator"')
    assert student_kwargs(config)["flag"] is True
    assert "tools" not in student_kwargs(load_config(None, ["rollout.tools=python"]))  # episodes without tools


# Parsing a reply.

@pytest.mark.parametrize("fmt", ["json", "xml"])
def test_several_calls_in_one_reply_parse_in_order_with_the_text_around_them(fmt):
    program = "print(1)\nprint(2)"
    reply = (f"I will compute it.\n{_call(fmt, 'calculator', expression='37 * 41')}\n\n"
             f"{_call(fmt, 'python', code=program)}")
    calls = parse_tool_calls(reply, fmt)
    assert [c.name for c in calls] == ["calculator", "python"] and not any(c.problem for c in calls)
    assert calls[0].arguments == {"expression": "37 * 41"} and calls[1].arguments == {"code": "print(1)\nprint(2)"}
    toolset = Toolset(TOOLS, fmt)
    assert toolset.run(calls[0]) == ("1517", True)
    assert parse_tool_calls("The answer is 42.", fmt) == []


@pytest.mark.parametrize("fmt, body, says", [
    ("json", '{"name": "calculator", "arguments": {"expression": "1+1"', "not JSON (Expecting ',' delimiter"),
    ("json", "[1, 2]", 'not {"name": ..., "arguments": {...}}'),
    ("json", '{"arguments": {}}', 'not {"name": ..., "arguments": {...}}'),
    ("json", '{"name": "calculator", "arguments": [1]}', "the arguments of 'calculator' are array, not an object"),
    ("json", "[" * 100_000, "not JSON selfopd reads (RecursionError)"),
    ("json", "1" * 5000, "not JSON selfopd reads (ValueError)"),
    ("xml", "calculator(1 + 1)", "not <function=NAME>...</function>"),
    ("xml", "<function=>\n</function>", "no function name"),
    ("xml", "<function=calculator>\n1 + 1\n</function>", "text outside its <parameter> tags: '1 + 1'"),
    ("xml", "<function=calculator>\n<parameter=expression>\n1\n</parameter>\n<parameter=expression>\n2\n</parameter>\n"
            "</function>", "the parameter 'expression' given twice"),
    ("xml", "<function=calculator>\n<parameter=expression>\n1 + 1\n</function>", "text outside its <parameter> tags"),
])
def test_a_malformed_call_gets_one_line_saying_what_is_wrong(fmt, body, says):
    calls = parse_tool_calls(f"Let me see. <tool_call>{body}</tool_call>", fmt)
    content, ran = Toolset(TOOLS, fmt).run(calls[0])
    assert len(calls) == 1 and not ran and says in content and content.startswith("error: ")
    assert "\n" not in content and len(content) < 400


@pytest.mark.parametrize("fmt", ["json", "xml"])
def test_a_call_left_open_is_one_line_and_the_calls_before_it_stand(fmt):
    reply = _call(fmt, "calculator", expression="2 * 3") + "\n<tool_call>\n" + _call(fmt, "calculator", expression="1")[11:-12]
    calls = parse_tool_calls(reply, fmt)
    assert [c.problem for c in calls] == ["", "no closing </tool_call> (the reply ended inside the call)"]


@pytest.mark.parametrize("fmt", ["json", "xml"])
@pytest.mark.parametrize("name, arguments, says", [
    ("calculate", {"expression": "1"}, "error: there is no tool 'calculate'; the tools: add, explode"),
    ("add", {}, "error: add needs the argument 'amount'"),
    ("add", {"amount": 1, "colour": "red"}, "error: add takes no argument 'colour' (its arguments: amount, note)"),
    ("add", {"amount": "lots"}, "error: add's argument 'amount' is"),
    ("add", {"amount": 1.5}, "not integer"),
    ("explode", {}, "error: explode: RuntimeError: the tool broke across two lines"),
])
def test_unknown_tools_bad_arguments_and_a_tool_that_raises_each_get_one_line(fmt, name, arguments, says):
    toolset = _counter_toolset(fmt)
    (call,) = parse_tool_calls(_call(fmt, name, **arguments), fmt)
    content, ran = toolset.run(call)
    assert says in content and not ran and "\n" not in content


@pytest.mark.parametrize("fmt", ["json", "xml"])
def test_arguments_are_read_as_their_declared_types(fmt):
    toolset = _counter_toolset(fmt)
    (call,) = parse_tool_calls(_call(fmt, "add", amount=40, note="2"), fmt)
    assert toolset.run(call) == ("40", True)  # the xml format's '40' read as the integer its definition declares
    (call,) = parse_tool_calls(_call(fmt, "add", amount=2), fmt)
    assert toolset.run(call) == ("42", True)


@pytest.mark.parametrize("fmt", ["json", "xml"])
@pytest.mark.parametrize("expression, says", [
    ("__import__('os').system('echo pwned')", "is not arithmetic"),
    ("9" * 1_000_000, "the expression has 1,000,000 characters; at most 500"),
    ("2 ** 2 ** 2 ** 2 ** 2", "too large"),
    ("\udcff\ud800 + 1", "not an arithmetic expression"),
])
def test_hostile_arguments_to_the_calculator_get_one_line(fmt, expression, says):
    text = (_call(fmt, "calculator", expression=expression) if fmt == "xml" or "\ud800" not in expression
            else '<tool_call>{"name": "calculator", "arguments": {"expression": "\\udcff\\ud800 + 1"}}</tool_call>')
    (call,) = parse_tool_calls(text, fmt)
    content, ran = Toolset(TOOLS, fmt).run(call)
    assert not ran and says in content and "\n" not in content and len(content) < 400
    content.encode("utf-8")  # a lone surrogate of the call is quoted escaped: a tokenizer takes the line


def test_tool_results_of_any_type_become_utf8_text():
    def odd(kind: str):
        """Returns something odd.

        Args:
            kind: which
        """
        return {"bytes": b"\xff\xfeok", "surrogate": "a\udcffb", "dict": {"n": 1}, "none": None,
                "huge": "x" * 100_000, "object": object.__new__(Example)}[kind]

    toolset = Toolset({"odd": odd}, "json")
    results = {kind: toolset.run(ToolCall("odd", {"kind": kind})) for kind in
               ("bytes", "surrogate", "dict", "none", "huge", "object")}
    assert results["bytes"] == ("\ufffd\ufffdok", True) and results["surrogate"] == ("a?b", True)
    assert results["dict"] == ('{"n": 1}', True) and results["none"] == ("null", True)
    assert results["object"][1] is False and results["object"][0].startswith("error: odd: AttributeError")
    bounded = checked_response(Response(({"role": "tool", "content": results["huge"][0]},)), "here").messages[0]
    assert "more characters cut" in bounded["content"] and len(bounded["content"]) < 4100


def test_an_environment_message_that_utf8_cannot_hold_is_replaced_not_fatal(smollm2_tokenizer):
    message = checked_response(Response(({"role": "user", "content": "bad \udcff text"},)), "here").messages[0]
    assert message["content"] == "bad ? text"
    ChatFormat(smollm2_tokenizer).continuation([2], [message])  # the tokenizer takes it


def test_tools_without_a_docstring_or_type_hints_are_refused_in_one_line():
    def bare(x):
        return x

    with pytest.raises(ToolError, match="^tool 'bare': Cannot generate JSON schema for bare"):
        tool_schemas({"bare": bare})
    with pytest.raises(ToolError, match="tool name '<x>'"):
        tool_schemas({"<x>": TOOLS["calculator"]})


# The environment's steps, on replies written here.

EXAMPLE = Example("arith/0", "Calculate 37 * 41.", "1517")


def _grade(reply: str, example: Example, finish: str) -> VerifyResult:
    correct = example.answer in reply
    return VerifyResult(float(correct), correct, None, None, "right" if correct else "wrong")


def _environment(fmt: str, max_calls: int = 4, opened: bool = False) -> ToolEnvironment:
    chat = ChatFormat(None)  # reads and grades text only: no tokenizer needed
    environment = ToolEnvironment(Toolset(TOOLS, fmt), _grade, max_calls,
                                  lambda reply, finish: chat.read(reply, finish, opened).final)
    environment.reset(EXAMPLE)
    return environment


@pytest.mark.parametrize("fmt", ["json", "xml"])
def test_a_reply_with_calls_gets_their_results_and_a_reply_without_is_graded(fmt):
    environment = _environment(fmt)
    response = environment.step(f"Let me compute.\n{_call(fmt, 'calculator', expression='37 * 41')}\n"
                                f"{_call(fmt, 'calculator', expression='37 *')}", "stop")
    assert not response.done and response.reward is None
    assert [m["role"] for m in response.messages] == ["tool", "tool"] and response.messages[0]["content"] == "1517"
    assert response.messages[1]["content"].startswith("error: calculator: ValueError: '37 *' is not an arithmetic")
    assert response.info == {"tool_calls": 2, "tool_errors": 1}
    final = environment.step("37 * 41 = 1517", "stop")
    assert final.done and final.reward == 1.0 and final.messages == ()
    assert final.info == {"tool_calls": 2, "tool_errors": 1, "correct": True, "feedback": "right"}


@pytest.mark.parametrize("fmt", ["json", "xml"])
def test_a_malformed_call_is_answered_and_the_episode_goes_on(fmt):
    environment = _environment(fmt)
    response = environment.step('<tool_call>{"name": calculator}</tool_call> and <tool_call>oops', "length")
    assert not response.done and len(response.messages) == 2
    assert all(m["content"].startswith("error: tool call not run: ") for m in response.messages)
    assert environment.step("I give up: 1517", "stop").reward == 1.0


def test_a_call_inside_a_reasoning_block_is_thinking_not_a_call():
    environment = _environment("xml", opened=True)  # Qwen3.5's prompt opens <think>
    thought = _call("xml", "calculator", expression="37 * 41")
    response = environment.step(f"Maybe {thought}? No, I know it.\n</think>\n\nThe answer is 1517.", "stop")
    assert response.done and response.reward == 1.0 and response.info["tool_calls"] == 0
    response = _environment("xml", opened=True).step(f"I will use the tool.\n</think>\n\n{thought}", "stop")
    assert not response.done and response.messages[0]["content"] == "1517"
    unclosed = _environment("xml", opened=True).step(f"Still thinking {thought}", "length")
    assert unclosed.done and unclosed.reward == 0.0  # no answer: it ended inside its reasoning


def test_calls_past_the_episode_cap_are_not_run_and_say_so():
    environment = _environment("json", max_calls=3)
    calls = "".join(_call("json", "calculator", expression=f"{n} + 1") for n in range(4))
    response = environment.step(calls, "stop")
    assert [m["content"] for m in response.messages] == [
        "1", "2", "3", "error: 1 tool call not run: an episode makes at most 3; answer without tools"]
    again = environment.step(_call("json", "calculator", expression="1"), "stop")
    assert [m["content"] for m in again.messages] == [
        "error: 1 tool call not run: an episode makes at most 3; answer without tools"]
    assert again.info["tool_calls"] == 3 and not again.done


# Real episodes: the packaged SmolLM2, shown by a few-shot prompt how to call the calculator.

SHOTS = [("Calculate 12 + 30.", "12 + 30", "42"), ("Calculate 7 * 8.", "7 * 8", "56")]
QUESTION = Example("arith/0", "Calculate 81 - 17.", "64")


def _few_shot(fmt: str, question: str) -> list[dict]:
    think = "<think>\n\n</think>\n\n" if fmt == "xml" else ""  # Qwen3.5's turn without thinking
    messages = []
    for prompt, expression, value in SHOTS:
        messages += [{"role": "user", "content": prompt},
                     {"role": "assistant", "content": think + _call(fmt, "calculator", expression=expression)},
                     {"role": "tool", "content": value},
                     {"role": "assistant", "content": think + f"The answer is {value}."}]
    return [*messages, {"role": "user", "content": question}]


@pytest.mark.parametrize("fmt", ["json", "xml"])
def test_the_ids_after_a_tool_turn_are_a_one_shot_render_of_the_conversation_with_the_tools(smollm2_dir, fmt):
    """Written replies, the real chat formats: the student's ids, then what the environment's tool
    messages append, equal the ids of the whole conversation rendered at once with the tools."""
    tokenizer = tool_tokenizer(smollm2_dir, TEMPLATES[fmt])
    config = load_config(None, ["rollout.environment=tools"])
    sampler = episode_sampler(config.rollout, student_format(config, tokenizer))
    chat, environment = sampler.chat, sampler.make_environment(QUESTION)
    environment.reset(QUESTION)
    first = [{"role": "user", "content": QUESTION.prompt}]
    opened = "<think>\n" if fmt == "xml" else ""  # Qwen3.5's generation prompt opens the reasoning block
    thought = "\n</think>\n\n" if fmt == "xml" else ""
    replies = [f"{thought}Two calls.\n{_call(fmt, 'calculator', expression='81 - 17')}\n"
               f"{_call(fmt, 'calculator', expression='81 -')}", f"{thought}The answer is 64."]
    ids, conversation = chat.prompt_ids(first), list(first)
    stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for reply in replies:
        ids += [*tokenizer.encode(reply, add_special_tokens=False), stop]  # what a sampler returns, stop id last
        conversation.append({"role": "assistant", "content": opened + reply})
        response = environment.step(reply, "stop")
        if response.done:
            break
        ids = chat.append(ids, response.messages)
        conversation += [{"role": "tool", "content": m["content"]} for m in response.messages]
    assert response.done and response.reward == 1.0 and len(conversation) == 5
    assert conversation[2]["content"] == "64" and conversation[3]["content"].startswith("error: calculator: ")
    assert ids == chat.ids(conversation, add_generation_prompt=False)[: len(ids)]
    assert '"name": "calculator"' in tokenizer.decode(ids)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["json", "xml"])
def test_a_real_episode_runs_the_call_the_model_writes_with_ids_exact_across_the_tool_turn(smollm2_model, smollm2_dir, fmt):
    tokenizer = tool_tokenizer(smollm2_dir, TEMPLATES[fmt])
    config = load_config(None, ["rollout.environment=tools", "rollout.max_turns=3", "rollout.max_episode_tokens=160"])
    sampler = episode_sampler(config.rollout, student_format(config, tokenizer))  # the run's path, tools and all
    chat, first = sampler.chat, _few_shot(fmt, QUESTION.prompt)
    prompt = chat.prompt_ids(first)
    assert '"name": "calculator"' in tokenizer.decode(prompt)  # the prompt shows the tool
    engine = Recording(LocalEngine(smollm2_model, tokenizer, batch_size=1))
    (episode,) = run_episodes(engine, chat, [prompt], [QUESTION], sampler.make_environment,
                              SamplingParams(max_tokens=56, temperature=0.0), sampler.limits)
    students = [t for t in episode.turns if t.role == "student"]
    assert episode.info["tool_calls"] == 1 and episode.info["tool_errors"] == 0, [t.text for t in students]
    assert [t.role for t in episode.turns] == ["student", "environment", "student"] and episode.ending == "done"
    assert "<tool_response>\n64\n</tool_response>" in episode.turns[1].text  # the calculator's result, shown
    offset = len(prompt)
    for turn in episode.turns:  # each student turn was sampled after exactly the ids so far
        if turn.role == "student":
            assert episode.ids[:offset] in engine.prompts
        offset += len(turn.ids)
    # The ids are a one-shot render of the conversation with the tools' definitions, where the
    # replies are the tokenizer's own tokenization of their text (greedy replies here are).
    special = set(tokenizer.all_special_ids)
    assert all(t.ids[-1] in special and list(t.ids[:-1]) == tokenizer.encode(t.text, add_special_tokens=False)
               for t in students)
    opened = "<think>\n" if fmt == "xml" else ""  # what the generation prompt opened, the reply's start
    conversation = [*first, {"role": "assistant", "content": opened + students[0].text}, {"role": "tool", "content": "64"},
                    {"role": "assistant", "content": opened + students[1].text}]
    assert episode.ids == chat.ids(conversation, add_generation_prompt=False)[: len(episode.ids)]
