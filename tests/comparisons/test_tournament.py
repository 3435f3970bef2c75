"""`selfopd prompts rank`: the template tournament on a tiny random model (plumbing and the
empty control), its numbers against a float64 reference, and the pre-registered order."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from selfopd.cli import main
from selfopd.data import load_examples
from selfopd.diagnostics.context import ContextGap, Prompting, student_records
from selfopd.diagnostics.measures import IllusionScore, Share
from selfopd.comparisons.tournament import (
    ScoreCache,
    TemplateScore,
    predicted_order,
    score_template,
    tournament_prompts,
)
from selfopd.engines.base import SamplingParams
from selfopd.engines.local import LocalEngine
from selfopd.data.example import Example, prompt_key
from selfopd.core.stats import MeanEstimate, PairedDifference, wilson_interval
from selfopd.templating.templates import load_template
from selfopd.training.trainer import batch_for_step

DATA = "rg:chain_sum?min_terms=2&max_terms=2&min_digits=1&max_digits=1&size=60&seed=5"
TEMPERATURE = 0.7


def _config(tmp_path, model_dir) -> str:
    path = tmp_path / "rank.toml"
    path.write_text(f'[run]\nname = "tiny"\nseed = 3\n[model]\nstudent = "{model_dir}"\nthreads = 1\n'
                    f'[data]\nspec = "{DATA}"\neval_size = 8\n[teacher]\nkind = "self"\n'
                    f'[rollout]\nprompts_per_step = 2\nsamples_per_prompt = 2\nmax_tokens = 8\ntemperature = {TEMPERATURE}\n'
                    '[optim]\nmicro_batch_prompts = 2\n[eval]\nmax_tokens = 8\nbatch_size = 8\n')
    return str(path)


def test_rank_prints_a_table_and_writes_every_number_with_the_empty_control_exactly_zero(tmp_path, tiny_model_dir,
                                                                                         capsys):
    out = tmp_path / "out"
    assert main(["prompts", "rank", _config(tmp_path, tiny_model_dir), "--templates",
                 "teacher/answer_note,teacher/empty", "--prompts", "3", "--samples", "2", "--gap-items", "4",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "6 rollouts (3 distinct prompts x 2 samples" in printed and "teacher/empty" in printed
    ranked = json.loads((out / "rank.json").read_text())
    assert (out / "rank.md").read_text().startswith("# Template tournament")
    assert ranked["distinct_prompts"] == 3 and ranked["rollouts"] == 6 and ranked["gap_distinct_prompts"] == 4
    assert ranked["settings"]["samples"] == 2 and ranked["settings"]["teacher_kind"] == "self"
    rows = {row["template"]: row for row in ranked["ranked"]}
    assert [row["rank"] for row in ranked["ranked"]] == [1, 2]
    empty, note = rows["teacher/empty"], rows["teacher/answer_note"]
    # The empty control renders the student's own prompt: the same logprobs bit for bit.
    assert empty["all_zero"] and empty["rank_value"] == 0.0
    assert empty["mean_advantage_per_token"]["value"] == 0.0 and empty["mean_advantage_per_token"]["n"] == 3
    assert empty["gap"]["gap"]["mean"] == 0.0 and empty["gap"]["with_context"] == empty["gap"]["student"]
    assert empty["contrastive_gain_per_token"]["value"] == 0.0 and note["contrastive_gain_per_token"]["value"] != 0.0
    for row in (empty, note):  # teacher mass on the student's top-k plus the rest is all of it
        assert 0 < row["teachability"]["value"] <= 1
        assert row["teachability"]["value"] + row["tail"]["value"] == pytest.approx(1.0)
    assert not note["all_zero"] and note["mean_advantage_per_token"]["value"] != 0.0


def test_a_bad_template_name_is_one_line_naming_it_before_any_model_loads(tmp_path, capsys):
    config = _config(tmp_path, tmp_path / "no-such-model")
    assert main(["prompts", "rank", config, "--templates", "teacher/empty,teacher/no_such"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "teacher/no_such" in err and "no-such-model" not in err
    assert main(["prompts", "rank", config, "--templates", "student/plain"]) == 1
    assert "student/plain is a student template" in capsys.readouterr().err


def test_scores_equal_a_float64_reference(tiny_model_dir, smollm2_tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    engine = LocalEngine(model, smollm2_tokenizer, batch_size=4)
    examples = load_examples(DATA)
    prompting = Prompting(smollm2_tokenizer, load_template("student/plain"), load_template("teacher/answer_note"),
                          {e.id: e for e in examples})
    params = SamplingParams(max_tokens=6, temperature=TEMPERATURE, n=2, seed=1)
    records = student_records(engine, examples[:3], prompting, params, batch_size=2)
    score, scored = score_template(engine, engine, records, prompting, examples[3:5], 6, TEMPERATURE, 4)
    model64 = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64).eval()

    def logprobs(prompt: list[int], completion: list[int]) -> np.ndarray:
        with torch.no_grad():
            logits = model64(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1] / TEMPERATURE
        return torch.log_softmax(logits, -1).gather(1, torch.tensor(completion)[:, None])[:, 0].numpy()

    advantages = []
    for record in scored:
        example = prompting.example(record.id)
        teacher = logprobs(prompting.teacher_ids(example, record.text), record.completion_ids)
        student = logprobs(record.prompt_ids, record.completion_ids)
        assert record.advantage == pytest.approx(teacher - student, abs=1e-4)
        advantages.append(teacher - student)
    all_tokens = np.concatenate(advantages)
    assert score.mean_advantage.value == pytest.approx(all_tokens.mean(), abs=1e-5)
    assert score.mean_advantage.n == 3 and not score.all_zero


def test_the_score_cache_asks_the_engine_once_per_distinct_request():
    class Counting:
        supports_full_vocabulary = True
        calls = 0

        def score(self, sequences, top_k=0, temperature=1.0):
            Counting.calls += 1
            return [f"{len(p)}/{len(c)}/{top_k}/{temperature}" for p, c in sequences]

    cache = ScoreCache(Counting())
    first = cache.score([([1, 2], [3])], top_k=5, temperature=0.7)
    assert cache.score([([1, 2], [3])], top_k=5, temperature=0.7) is first and Counting.calls == 1
    cache.score([([1, 2], [3])], top_k=0, temperature=0.7)
    cache.score([([1, 2], [4])], top_k=5, temperature=0.7)
    assert Counting.calls == 3 and cache.supports_full_vocabulary


def test_the_prompts_are_the_first_distinct_ones_of_the_runs_step_order():
    examples = [Example(id=str(i), prompt=f"q{i % 5}", answer="1") for i in range(12)]  # 5 distinct prompts
    chosen = tournament_prompts(examples, 4, prompts_per_step=3, seed=7)
    seen = []
    for step in range(20):
        for example in batch_for_step(examples, step, 3, 7):
            if prompt_key(example.prompt) not in [prompt_key(e.prompt) for e in seen]:
                seen.append(example)
    assert chosen == seen[:4]
    assert len(tournament_prompts(examples, 9, 3, 7)) == 5  # all there are


def _score(name: str, preference: float | None, all_zero: bool = False) -> TemplateScore:
    nan = Share(math.nan, math.nan, math.nan, 0)
    gap = ContextGap(wilson_interval(0, 1), wilson_interval(0, 1), wilson_interval(0, 1),
                     PairedDifference(0.0, 0.0, 0.0, 1))
    estimate = None if preference is None else MeanEstimate(preference, preference - 1, preference + 1, 5)
    nothing = MeanEstimate(0.0, 0.0, 0.0, 1)
    return TemplateScore(name, gap, estimate, IllusionScore(nan, math.nan), nothing, nothing, nothing, nan, all_zero)


def test_the_predicted_order_follows_the_preregistered_rule():
    scores = [_score("undefined", None), _score("negative", -0.4), _score("empty", None, all_zero=True),
              _score("best", 0.3), _score("small", 0.05)]
    assert [s.template for s in predicted_order(scores)] == ["best", "small", "empty", "negative", "undefined"]
