"""summary.json of an eval (`selfopd.run.evaluate.write_eval`): avg@k and the unbiased pass@k over
distinct prompts, checked against a brute-force count of k-subsets, and the sampling recorded."""

from __future__ import annotations

import itertools
import json

import pytest

from selfopd.core.stats import Proportion
from selfopd.run.evaluate import EvalRecord, write_eval


def _record(prompt: str, sample: int, correct: bool) -> EvalRecord:
    return EvalRecord(id=prompt, sample=sample, prompt=prompt, completion="", extracted=None, reference="1",
                      correct=correct, finish_reason="stop", completion_tokens=3)


def test_summary_reports_avg_and_pass_at_k_over_distinct_prompts(tmp_path):
    outcomes = {"p": [1, 0, 0, 0, 1, 0], "q": [0] * 6, "r": [1, 1, 1, 0, 1, 1]}
    records = [_record(prompt, i, bool(v)) for prompt, values in outcomes.items() for i, v in enumerate(values)]
    sampling = {"temperature": 1.0, "top_p": 0.9, "top_k": 0, "min_p": 0.0, "max_tokens": 8, "seed": 0}
    write_eval(tmp_path, Proportion(0, 3, 0.0, 0.0), records, "student/plain", samples=6, temperature=1.0,
               sampling=sampling)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["sampling"] == sampling and summary["k"] == 6
    assert [key for key in summary if key.startswith("pass@")] == ["pass@1", "pass@2", "pass@4", "pass@6"]
    for k in (1, 2, 4, 6):
        brute = [sum(any(s) for s in itertools.combinations(v, k)) / len(list(itertools.combinations(v, k)))
                 for v in outcomes.values()]
        assert abs(summary[f"pass@{k}"]["value"] - sum(brute) / 3) < 1e-12 and summary[f"pass@{k}"]["n"] == 3
        low, high = summary[f"pass@{k}"]["ci95"]
        assert 0 <= low <= summary[f"pass@{k}"]["value"] <= high <= 1
    assert summary["avg@6"]["value"] == pytest.approx(summary["pass@1"]["value"]) == pytest.approx((2 / 6 + 5 / 6) / 3)


def test_code_tasks_report_hidden_tests_beside_shown_ones_and_others_write_no_hidden_field(tmp_path):
    """Code tasks: `hidden_accuracy` is the share of distinct prompts whose program passed every hidden
    test; records of tasks without hidden tests keep their old lines."""
    import dataclasses

    hidden = {"p": [1.0, 1.0], "q": [0.5, 1.0], "r": [0.0, 0.0]}
    records = [dataclasses.replace(_record(prompt, i, True), hidden_reward=v)
               for prompt, values in hidden.items() for i, v in enumerate(values)]
    write_eval(tmp_path / "code", Proportion(3, 3, 0.0, 1.0), records, "student/plain", samples=2)
    summary = json.loads((tmp_path / "code" / "summary.json").read_text())
    assert summary["hidden_accuracy"]["value"] == pytest.approx((1 + 0.5 + 0) / 3) and summary["hidden_accuracy"]["n"] == 3
    lines = [json.loads(line) for line in (tmp_path / "code" / "eval.jsonl").read_text().splitlines()]
    assert [line["hidden_reward"] for line in lines] == [1.0, 1.0, 0.5, 1.0, 0.0, 0.0]
    write_eval(tmp_path / "math", Proportion(1, 1, 0.0, 1.0), [_record("p", 0, True)], "student/plain")
    assert "hidden_reward" not in (tmp_path / "math" / "eval.jsonl").read_text()
    assert "hidden_accuracy" not in json.loads((tmp_path / "math" / "summary.json").read_text())


class _Answers:
    """An engine that answers each prompt with the next of `answers` ((text, finish_reason)), and keeps
    the prompt ids it was asked."""

    def __init__(self, answers):
        self.answers, self.prompts = list(answers), []

    def sample(self, prompts, params):
        from selfopd.engines.base import Rollout

        self.prompts += prompts
        return [[Rollout(prompt, [1, 2], [0.0, 0.0], reason, text)] for prompt, (text, reason)
                in zip(prompts, [self.answers.pop(0) for _ in prompts])]


# (completion, finish_reason) -> graded by default / eval.truncated=grade / eval.reasoning=graded / both
ANSWERS = {
    ("<think>3 + 4 = 7, so \\boxed{7}. Let me check", "length"): (None, None, None, "7"),  # cut inside its thinking
    ("<think>I get \\boxed{7}.</think>", "stop"): (None, None, "7", "7"),  # the answer only in its thinking
    ("<think>\\boxed{5}?</think> It is \\boxed{7}.", "stop"): ("7", "7", "7", "7"),  # the last answer either way
    ("<think>no</think> It is \\boxed{7}. And", "length"): (None, "7", None, "7"),  # cut after its thinking
}


@pytest.mark.parametrize("column, sets", [
    (0, []), (1, ["eval.truncated=grade"]), (2, ["eval.reasoning=graded"]),
    (3, ["eval.truncated=grade", "eval.reasoning=graded"]),
])
def test_eval_truncated_and_reasoning_grade_what_they_say(column, sets, smollm2_tokenizer):
    """OPSD's eval: the last \\boxed{} of the whole output, thinking included, a truncated output too
    (eval.truncated = 'grade', eval.reasoning = 'graded'); each setting alone changes its part only,
    and neither changes training's [verifier]."""
    from selfopd.config import load_config
    from selfopd.data.example import Example
    from selfopd.run.evaluate import eval_prompting, evaluate
    from selfopd.templating.templates import load_template

    config = load_config(None, sets)
    prompting = eval_prompting(config)
    examples = [Example(id=f"q{i}", prompt=f"Question {i}: what is 3 + 4?", answer="7") for i in range(len(ANSWERS))]
    _, records = evaluate(_Answers(ANSWERS), smollm2_tokenizer, examples, load_template(prompting.template),
                          progress=False, grading=prompting.grading, template_kwargs=prompting.template_kwargs)
    assert [record.extracted for record in records] == [expected[column] for expected in ANSWERS.values()]
    assert [record.correct for record in records] == [expected[column] == "7" for expected in ANSWERS.values()]
    assert (config.verifier.truncated, config.verifier.reasoning_start) == ("wrong", "<think>")


def test_eval_template_and_chat_arguments_are_what_the_eval_renders(smollm2_dir, smollm2_tokenizer):
    """eval.student_template and eval.chat_template_kwargs (merged over model.chat_template_kwargs) make the
    prompt ids the eval samples from; unset, they are training's."""
    from selfopd.config import load_config
    from selfopd.data.example import Example
    from selfopd.run.evaluate import eval_prompting, evaluate
    from selfopd.templating.templates import load_template, prompt_token_ids
    from tests.thinking_template import EMPTY_THINK, thinking_tokenizer

    tokenizer = thinking_tokenizer(smollm2_dir)
    example = Example(id="q", prompt="What is 3 + 4?", answer="7")
    trained = ["data.student_template=student/opsd", "model.chat_template_kwargs=enable_thinking=false"]
    opsd_eval = (f"{example.prompt}\n\nPlease reason step by step, and put your final answer within \\boxed{{}}.")
    for sets, content, kwargs in (
            (trained, f"Problem: {opsd_eval}", {"enable_thinking": False}),
            ([*trained, "eval.student_template=student/opsd_eval", "eval.chat_template_kwargs=enable_thinking=true"],
             opsd_eval, {"enable_thinking": True})):
        prompting = eval_prompting(load_config(None, sets))
        engine = _Answers([("\\boxed{7}", "stop")])
        evaluate(engine, tokenizer, [example], load_template(prompting.template), progress=False,
                 grading=prompting.grading, template_kwargs=prompting.template_kwargs)
        assert engine.prompts == [prompt_token_ids(tokenizer, [{"role": "user", "content": content}], kwargs)]
        assert tokenizer.decode(engine.prompts[0]).endswith(EMPTY_THINK) == (kwargs == {"enable_thinking": False})


def test_what_selfopd_eval_answers_is_chosen_in_one_place(tmp_path):
    """`eval_set`: a part of the config's split, else eval.data; of a run, its held-out prompts, a data
    spec refused when the run trained on one of its prompts, or drawn past every prompt it held (fresh)."""
    from selfopd.config import load_config
    from selfopd.data import DataError
    from selfopd.data.example import prompt_key
    from selfopd.data.split import SplitRecord, load_split
    from selfopd.run.evaluate import eval_set

    spec = "rg:chain_sum?min_terms=2&max_terms=2&size=20&seed=3"
    config = load_config(None, [f"data.spec={spec}", "data.eval_size=4"])
    train, held_out = load_split(spec, 4, 0)
    assert [list(eval_set(config, split=part).examples) for part in ("train", "eval", "all")] == [
        list(train), list(held_out), list(train) + list(held_out)]
    assert eval_set(config).what == f"{spec} [eval]"
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"What is {i} + {i}?", "answer": str(2 * i)}) + "\n" for i in range(2)))
    assert [e.id for e in eval_set(load_config(None, [f"data.spec={spec}", f"eval.data={rows}"])).examples] == [
        "rows/0", "rows/1"]
    record = SplitRecord.of(spec, 0, train, held_out)
    record.write(tmp_path)
    assert list(eval_set(config, run_dir=tmp_path).examples) == list(held_out)
    with pytest.raises(DataError, match=rf"^\d+ of the \d+ distinct prompts of .* were trained on by {tmp_path} "):
        eval_set(config, data=spec, run_dir=tmp_path)
    fresh = eval_set(config, data=spec.replace("size=20", "size=10"), run_dir=tmp_path, fresh=True).examples
    assert fresh and not {prompt_key(e.prompt) for e in fresh} & {*record.train_prompts, *record.eval_prompts}


def test_a_tool_run_evaluates_tool_calling_episodes_with_the_tools_in_its_prompts(smollm2_tokenizer):
    """rollout.environment = 'tools': the eval's prompts show the tools and a call is run and answered, as in
    training; eval.environment = 'none' asks for one answer without tools (a call is then just text)."""
    from selfopd.config import load_config
    from selfopd.data.example import Example
    from selfopd.run.evaluate import eval_prompting, evaluate
    from selfopd.templating.templates import load_template
    from tests.tool_templates import HERMES_TEMPLATE, tool_tokenizer

    tokenizer = tool_tokenizer(smollm2_tokenizer.name_or_path, HERMES_TEMPLATE)
    example = Example(id="q", prompt="What is 37 * 41?", answer="1517")
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "37 * 41"}}\n</tool_call>'
    tools = ["rollout.environment=tools", "rollout.tools=calculator"]
    for sets, answers, correct in (([*tools], [(call, "stop"), ("\\boxed{1517}", "stop")], True),
                                   ([*tools, "eval.environment=none"], [(call, "stop")], False)):
        prompting = eval_prompting(load_config(None, sets))
        engine = _Answers(answers)
        _, (record,) = evaluate(engine, tokenizer, [example], load_template(prompting.template), progress=False,
                                grading=prompting.grading, template_kwargs=prompting.template_kwargs,
                                rollout=prompting.rollout)
        episode = len(answers) == 2
        assert len(engine.prompts) == len(answers) and record.correct is correct
        assert ('"name": "calculator"' in tokenizer.decode(engine.prompts[0])) is episode
        if episode:  # the second turn was sampled after the call and the calculator's answer
            assert "1517" in tokenizer.decode(engine.prompts[1][len(engine.prompts[0]):])
            assert record.completion == "\\boxed{1517}" and record.completion_tokens == 4  # the student's ids only
