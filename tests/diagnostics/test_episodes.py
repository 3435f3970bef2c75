"""The diagnostics of a run whose rollouts are episodes: every number is over the student's own tokens.
Episodes are built as the sampler builds them (SmolLM2's tokenizer and chat format: the student's ids, then
the environment's message appended through `ChatFormat.continuation`); the same episodes with a hostile
environment message (doubt words, a leak phrase, the reference answer) and wild values on its ids give the
same report."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from selfopd.data import load_examples
from selfopd.diagnostics import Prompting, annotate_records, context_contrast, decompose, illusion_score, step_behaviour
from selfopd.diagnostics.episodes import episode_stats
from selfopd.diagnostics.measures import ENVIRONMENT, as_jsonable, collapse_warnings, correct_preference
from selfopd.diagnostics.report import RunDiagnosis, write_report
from selfopd.diagnostics.signals import DopdSplit, information_share, prompt_mean
from selfopd.run.rollouts import RolloutRecord
from selfopd.templating.templates import load_template

DATA = "rg:chain_sum?min_terms=2&max_terms=2&min_digits=1&max_digits=1&size=40&seed=5"
CALM = "That is not right. Try again."
HOSTILE = "Wait, maybe check it again. Hmm, the reference answer is {answer}: the hint says so, verify it."


@pytest.fixture(scope="module")
def prompting(smollm2_tokenizer) -> Prompting:
    return Prompting(smollm2_tokenizer, load_template("student/plain"), load_template("teacher/answer_hint_leaky"),
                     {e.id: e for e in load_examples(DATA)})


def episode(prompting: Prompting, example, replies: list[str], feedback: str, environment_value: float,
            group: int) -> RolloutRecord:
    """An episode of `replies` with `feedback` between them; the student's ids get fixed values, the
    environment's `environment_value` on every per-token field."""
    tokenizer, chat = prompting.tokenizer, prompting.student_chat
    prompt = prompting.student_ids(example)
    ids: list[int] = []
    mask: list[bool] = []
    for number, reply in enumerate(replies):
        if number:
            new = chat.continuation(prompt + ids, [{"role": "user", "content": feedback.format(answer=example.answer)}])
            ids, mask = ids + new, mask + [False] * len(new)
        own = tokenizer.encode(reply, add_special_tokens=False) + [tokenizer.eos_token_id]
        ids, mask = ids + own, mask + [True] * len(own)
    rng = np.random.default_rng(group)
    student = iter(rng.normal(-1.5, 0.8, size=sum(mask)).tolist())
    gain = iter(rng.normal(0.0, 0.6, size=sum(mask)).tolist())
    student_lp, teacher_lp = [], []
    for own in mask:
        s = next(student) if own else environment_value
        student_lp.append(s)
        teacher_lp.append(s + next(gain) if own else -environment_value)
    advantage = [t - s if own else environment_value for s, t, own in zip(student_lp, teacher_lp, mask)]
    correct = replies[-1].endswith(f"{example.answer}.")
    return RolloutRecord(1, example.id, group, prompt, ids, replies[-1], student_lp, student_lp, teacher_lp, advantage,
                         float(correct), correct, example.answer, loss_mask=mask)


def episodes(prompting: Prompting, feedback: str, environment_value: float) -> list[RolloutRecord]:
    """Two samples of each of three items: one right at the second try, one wrong twice; and one item
    answered right away (a single turn)."""
    examples = list(prompting.examples_by_id.values())[:4]
    records = []
    for group, example in enumerate(examples[:3]):
        wrong = int(example.answer) + 1
        records.append(episode(prompting, example, [f"I think it is {wrong}.", f"Let me add again: it is {example.answer}."],
                               feedback, environment_value, group))
        records.append(episode(prompting, example, [f"It is {wrong}.", f"Maybe it is {wrong + 1}."], feedback,
                               environment_value, group))
    records.append(episode(prompting, examples[3], [f"It is {examples[3].answer}."], feedback, environment_value, 3))
    return records


def on_students(own: np.ndarray, seed: int, environment_value: float) -> np.ndarray:
    """Seeded values on the student's ids (the same whatever the environment added), `environment_value` elsewhere."""
    values = np.full(len(own), environment_value)
    values[own] = np.random.default_rng(seed + int(own.sum())).normal(0, 1, int(own.sum()))
    return values


def numbers(prompting: Prompting, records: list[RolloutRecord]) -> dict:
    """Every statistic the report computes from per-token values, as plain JSON."""
    annotated = annotate_records(records, prompting)
    wild = [on_students(a.own, 7, 1e6) for a in annotated]  # a model's per-token gains: wild on the environment's ids
    other = [on_students(a.own, 8, -1e6) for a in annotated]
    stats = as_jsonable(episode_stats(annotated))
    stats.pop("environment_share")
    return as_jsonable({
        "classes": [[c for c in a.classes if c != ENVIRONMENT] for a in annotated],
        "decomposition": decompose(annotated), "illusion": illusion_score(annotated),
        "behaviour": step_behaviour(1, annotated, max_tokens=16), "episodes": stats,
        "contrast": context_contrast(annotated, wild, other), "leaks": [a.leaks for a in annotated],
        "mean": prompt_mean(records, wild), "information": information_share(annotated, [DopdSplit(w, o) for w, o in zip(wild, other)]),
        "preference": correct_preference(records),
    })


def test_the_environments_ids_change_no_number_whatever_their_text_and_values(prompting):
    calm, hostile = episodes(prompting, CALM, 0.0), episodes(prompting, HOSTILE, 1e6)
    assert [r.completion_ids != h.completion_ids for r, h in zip(calm, hostile)] == [True] * 6 + [False]
    assert numbers(prompting, calm) == numbers(prompting, hostile)


def test_per_turn_statistics_are_the_students_tokens_of_each_turn(prompting):
    records = episodes(prompting, CALM, 0.0)
    annotated = annotate_records(records, prompting)
    stats = episode_stats(annotated)
    assert stats.episodes == 7 and stats.turns.value == pytest.approx(13 / 7)
    environment = sum(len(r.completion_ids) - sum(r.loss_mask) for r in records)
    assert stats.environment_share == pytest.approx(environment / sum(len(r.completion_ids) for r in records))
    first, second = stats.rows
    assert (first.turn, first.episodes, first.ended, first.ended_correct) == (1, 7, 1, 1)
    assert (second.turn, second.episodes, second.ended, second.ended_correct) == (2, 6, 6, 3)
    for row, turn in ((first, 0), (second, 1)):
        values = []
        for record in records:
            turns = np.split(np.arange(len(record.loss_mask)), np.flatnonzero(np.diff(record.loss_mask)) + 1)
            own = [t for t in turns if record.loss_mask[t[0]]]
            if len(own) > turn:
                values += [record.teacher_logprobs[i] - record.student_logprobs[i] for i in own[turn]]
        assert row.tokens == len(values) and row.opd.value == pytest.approx(sum(values) / len(values))
        assert row.advantage.value == pytest.approx(row.opd.value)  # no reward term in these records
    assert first.abs_share + second.abs_share == pytest.approx(1.0)
    behaviour = step_behaviour(1, annotated, max_tokens=16)
    assert behaviour.length.value == pytest.approx(np.mean([sum(r.loss_mask) for r in records]))
    assert behaviour.epistemic_per_100 > 0  # "Maybe" in a reply: the student's own doubt still counts
    assert all(a.classes[i] == ENVIRONMENT for a in annotated for i, own in enumerate(a.record.loss_mask) if not own)


def test_the_report_of_episodes_has_turns_and_marks_them_in_its_heatmaps(prompting, tmp_path):
    """write_report on both versions: the same summary but for the environment's share, a per-turn section,
    and heatmaps whose environment ids are grey and whose turns are labelled."""
    summaries = {}
    for label, records in (("calm", episodes(prompting, CALM, 0.0)), ("hostile", episodes(prompting, HOSTILE, 1e6))):
        annotated = {1: annotate_records(records, prompting)}
        behaviour = [step_behaviour(1, annotated[1], 16)]
        diagnosis = RunDiagnosis(label, "self with teacher/answer_hint_leaky", "student/plain", annotated, behaviour,
                                 {1: illusion_score(annotated[1])}, {"step 1": decompose(annotated[1])},
                                 collapse_warnings(behaviour), "no evaluations", correct_preference(records), None)
        out = tmp_path / label
        report = write_report(diagnosis, out, heatmaps=2).read_text()
        assert "## Turns of the episodes" in report and "| 1 | 2 | 6 | 6 (3) |" in report
        html = (out / "heatmaps.html").read_text()
        assert 'class="turn"' in html and ">environment</span>" in html and "background: #ececec" in html
        assert "+1000000" not in html and "e+06" not in html
        summary = json.loads((out / "summary.json").read_text())
        for step in summary["episodes"].values():
            assert 0 < step.pop("environment_share") < 1
        summaries[label] = {key: summary[key] for key in summary if key != "run"}
    assert summaries["calm"] == summaries["hostile"]
    assert math.isclose(summaries["calm"]["episodes"]["1"]["turns"]["value"], 13 / 7)
