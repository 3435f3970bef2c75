"""The in-run eval as [eval] asks (`selfopd.training.outputs.run_eval`): eval.data instead of the
held-out split, refused in one line when it holds a training prompt; eval.samples answers a
prompt at eval.temperature, logged as avg@k (eval/accuracy) and eval/pass@k."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from selfopd.config import ConfigError, load_config
from selfopd.training.trainer import train

DATA = "rg:chain_sum?min_terms=2&max_terms=2&size=40&seed=2"
SMALL = [
    f"data.spec={DATA}", "data.eval_size=4", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2",
    "rollout.max_tokens=4", "optim.micro_batch_prompts=1", "eval.max_tokens=4", "eval.batch_size=4",
    "run.progress=false", "run.eval_every=0", "model.threads=1", "model.dtype=float32", "run.steps=1",
]


def _config(tmp_path: Path, model: Path, *extra: str):
    return load_config(None, [*SMALL, f"model.student={model}", f"run.out_dir={tmp_path}", *extra])


def test_eval_data_holding_a_training_prompt_is_refused_before_any_step(tmp_path, tiny_model_dir):
    with pytest.raises(ConfigError, match=r"^eval\.data: rg:chain_sum\?min_terms=2&max_terms=2&size=40&seed=2: 36 of "
                                          r"its 40 distinct prompts are training prompts of this run \(e\.g\. '.*'\); "
                                          r"evaluate on prompts the run does not train on$"):
        train(_config(tmp_path, tiny_model_dir, "run.name=overlap", f"eval.data={DATA}"))
    assert not (tmp_path / "overlap").exists()  # refused before the run folder is made


def test_eval_data_answered_k_times_and_logged_as_avg_and_pass_at_k(tmp_path, tiny_model_dir):
    rows = [{"prompt": f"What is {a} + {b}? Reply with the number only.", "answer": str(a + b)}
            for a, b in [(1234, 4321), (5555, 1111), (2020, 7070)]]
    data = tmp_path / "test_set.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    run_dir = train(_config(tmp_path, tiny_model_dir, "run.name=k", f"eval.data={data}", "eval.samples=2",
                            "eval.temperature=1", "eval.top_k=50"))
    evals = [line for line in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
             if "eval/accuracy" in line]
    assert [line["step"] for line in evals] == [0, 1]
    for line in evals:
        assert line["eval/n"] == 3 and {"eval/pass@1", "eval/pass@2"} <= set(line)
        assert line["eval/pass@1"] == pytest.approx(line["eval/accuracy"])  # pass@1 is avg@k
    answered = [json.loads(line) for line in (run_dir / "eval" / "step_00001" / "eval.jsonl").read_text().splitlines()]
    assert sorted((row["prompt"], row["sample"]) for row in answered) == sorted(
        (row["prompt"], sample) for row in rows for sample in (0, 1))
    summary = json.loads((run_dir / "eval" / "step_00001" / "summary.json").read_text())
    assert summary["sampling"]["top_k"] == 50 and summary["k"] == 2


OPSD_EVAL = "\n\nPlease reason step by step, and put your final answer within \\boxed{}."


@pytest.mark.parametrize("eval_sets, template, kwargs, verifier", [
    ([], "student/opsd", {"enable_thinking": False}, {"reasoning_start": "<think>", "reasoning_end": "</think>",
                                                       "truncated": "wrong"}),
    (["eval.student_template=student/opsd_eval", "eval.chat_template_kwargs=enable_thinking=true",
      "eval.truncated=grade", "eval.reasoning=graded"],
     "student/opsd_eval", {"enable_thinking": True}, {"reasoning_start": "", "reasoning_end": "", "truncated": "grade"}),
], ids=["training's", "OPSD's eval"])
def test_the_in_run_eval_renders_and_grades_as_eval_settings_say(tmp_path, tiny_model_dir, monkeypatch, eval_sets,
                                                                   template, kwargs, verifier):
    """A run trained as OPSD trains (student/opsd, thinking off) evaluates on its own prompt by default,
    and on OPSD's eval prompt with thinking on, truncated answers and thinking graded when [eval] says
    so; the run folder keeps the eval's template."""
    import selfopd.run.evaluate as evaluation
    from tests.thinking_template import thinking_model_dir

    rendered = []

    class Recording(evaluation.ChatFormat):  # the eval's chat format, recording what it renders
        def prompt(self, messages):
            rendered.append((messages[-1]["content"], dict(self.template_kwargs)))
            return super().prompt(messages)

    monkeypatch.setattr(evaluation, "ChatFormat", Recording)
    model = thinking_model_dir(tiny_model_dir, tmp_path / "thinking")
    run_dir = train(_config(tmp_path, model, "run.name=opsd", "data.student_template=student/opsd",
                            "model.chat_template_kwargs=enable_thinking=false", *eval_sets))
    prefix = "Problem: " if template == "student/opsd" else ""
    assert rendered and {content.startswith(prefix) and content.endswith(OPSD_EVAL) for content, _ in rendered} == {True}
    assert {tuple(sorted(used.items())) for _, used in rendered} == {tuple(kwargs.items())}
    for step in (0, 1):
        summary = json.loads((run_dir / "eval" / f"step_{step:05d}" / "summary.json").read_text())
        assert (summary["template"], summary["verifier"]) == (template, verifier)
    assert template in json.loads((run_dir / "templates" / "index.json").read_text())


def test_an_eval_template_the_student_cannot_render_is_refused_before_any_step(tmp_path, tiny_model_dir):
    with pytest.raises(ConfigError, match=r"^eval\.student_template: .*teacher/answer_note\.jinja:\d+: variable "
                                          r"'student_prompt' is undefined; available here: id, meta, prompt$"):
        train(_config(tmp_path, tiny_model_dir, "run.name=leaky", "eval.student_template=teacher/answer_note"))
    assert not (tmp_path / "leaky").exists()
