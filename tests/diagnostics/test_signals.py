"""Teachability, the contrastive gain and the DOPD split: the array-level functions against
float64 brute force, the engine paths against each other and against direct scores, and
the self-teacher identities on the tiny model and the real SmolLM2."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from selfopd.diagnostics.context import Prompting
from selfopd.diagnostics.measures import Annotated
from selfopd.run.rollouts import DiagnosticsError, RolloutRecord
from selfopd.diagnostics.signals import (
    DopdSplit,
    contrastive_gains,
    dopd_split,
    information_by_class,
    information_share,
    other_item_example,
    prompt_mean,
    teachability,
    teacher_mass_on,
)
from selfopd.diagnostics.tokens import TokenPieces
from selfopd.engines.local import LocalEngine
from selfopd.data.example import Example
from selfopd.templating.templates import load_template

ITEMS = [
    Example("a", "What is 2 + 3?", "5", solution="2 + 3 = 5", hints=("add them",)),
    Example("b", "What is 4 + 4?", "8", solution="4 + 4 = 8", hints=("double four",)),
    Example("c", "What is 1 + 6?", "7", solution="1 + 6 = 7", hints=("count on",)),
]


def brute_mass(candidates_TK, ids_TJ, logprobs_TJ) -> np.ndarray:
    """Loop over positions and candidates; a candidate outside the top-J counts 0."""
    out = np.zeros(len(candidates_TK))
    for t in range(len(candidates_TK)):
        listed = {int(i): math.exp(float(lp)) for i, lp in zip(ids_TJ[t], logprobs_TJ[t])}
        out[t] = sum(listed.get(int(c), 0.0) for c in candidates_TK[t])
    return out


def random_topk(rng, positions: int, vocab: int, j: int):
    logprobs_TV = np.log(rng.dirichlet(np.full(vocab, 0.3), size=positions))
    ids_TJ = np.argsort(-logprobs_TV, axis=-1)[:, :j]
    return logprobs_TV, ids_TJ, np.take_along_axis(logprobs_TV, ids_TJ, -1)


def test_teacher_mass_on_matches_brute_force_inside_and_outside_the_top_j():
    rng = np.random.default_rng(0)
    logprobs_TV, ids_TJ, top_TJ = random_topk(rng, positions=9, vocab=40, j=6)
    inside = ids_TJ[:, [0, 3]]
    outside = np.argsort(-logprobs_TV, axis=-1)[:, [10, 30]]  # never in the top-6
    candidates_TK = np.concatenate([inside, outside], axis=1)
    mass = teacher_mass_on(candidates_TK, ids_TJ, top_TJ)
    assert mass.dtype == np.float64 and mass.shape == (9,)
    np.testing.assert_allclose(mass, brute_mass(candidates_TK, ids_TJ, top_TJ), rtol=1e-12)
    exact = np.exp(np.take_along_axis(logprobs_TV, candidates_TK, -1)).sum(-1)
    assert (mass < exact - 1e-6).all()  # the outside candidates are missed: a lower bound
    _, all_ids, all_lp = random_topk(np.random.default_rng(0), positions=9, vocab=40, j=40)
    np.testing.assert_allclose(teacher_mass_on(candidates_TK, all_ids, all_lp), exact, rtol=1e-12)  # J = V: exact


def test_teacher_mass_on_names_mismatched_shapes():
    with pytest.raises(ValueError, match="share their positions"):
        teacher_mass_on(np.zeros((3, 2), dtype=int), np.zeros((4, 5), dtype=int), np.zeros((4, 5)))


def test_other_item_example_swaps_only_the_privileged_fields():
    item = Example("a", "What is 2 + 3?", "5", solution="2 + 3 = 5", hints=("add",), meta={"reasoning_gym": {}, "k": 1})
    pool = [item, Example("b", "x", "5", solution="same answer"), Example("c", "y", "9", solution="s9", hints=("h9",))]
    other = other_item_example(item, pool, seed=0)
    assert other.prompt == item.prompt and other.id == item.id and other.meta == {"k": 1}
    assert (other.answer, other.solution, other.hints) == ("9", "s9", ("h9",))  # a different answer is preferred
    assert other_item_example(item, list(reversed(pool)), seed=0) == other  # seeded, not by pool order
    pool10 = [Example(str(i), f"q{i}", str(i)) for i in range(10)]
    assert len({other_item_example(pool10[0], pool10, seed=s).answer for s in range(20)}) > 2
    with pytest.raises(DiagnosticsError, match="needs another item"):
        other_item_example(item, [item], seed=0)


def annotated(classes, prompt: int) -> Annotated:
    n = len(classes)
    record = RolloutRecord(1, f"x{prompt}", 0, [prompt], list(range(n)), "", *([[0.0] * n] * 4), 1.0, True, "5")
    return Annotated(record, TokenPieces("", [""] * n, [(0, 0)] * n), list(classes), np.zeros(n), [])


def test_prompt_mean_counts_a_prompt_once():
    rollouts = [annotated(["other"] * 2, 0), annotated(["other"] * 4, 0), annotated(["other"], 1)]
    values = [np.array([1.0, 3.0]), np.array([0.0, 0.0, 0.0, 4.0]), np.array([-2.0])]
    estimate = prompt_mean([r.record for r in rollouts], values)
    assert estimate.n == 2 and estimate.value == pytest.approx(((2.0 + 1.0) / 2 + -2.0) / 2)
    assert estimate.low < estimate.value < estimate.high


def test_information_share_by_class_against_hand_sums():
    rollouts = [annotated(["answer_copy", "other", "other"], 0), annotated(["answer_copy", "structural"], 1)]
    splits = [DopdSplit(np.array([2.0, -1.0, 0.0]), np.array([-2.0, 1.0, 3.0])),
              DopdSplit(np.array([0.0, 0.5]), np.array([4.0, 0.5]))]
    by_class = information_by_class(rollouts, splits)
    assert by_class["all"].value == pytest.approx((2 + 1 + 0.5) / (2 + 1 + 0.5 + 2 + 1 + 3 + 4 + 0.5))
    assert by_class["answer_copy"].value == pytest.approx(2 / (2 + 2 + 4))
    assert by_class["other"].value == pytest.approx(1 / (1 + 1 + 3))
    assert by_class["structural"].value == pytest.approx(0.5)
    assert math.isnan(by_class["epistemic"].value)  # no such tokens
    assert information_share(rollouts, [DopdSplit(s.information, 0 * s.capability) for s in splits]).value == 1.0


def answer_records(prompting: Prompting, examples) -> list[RolloutRecord]:
    """'The answer is X, since ...' with each item's right X, as exact token ids."""
    tokenizer, records = prompting.tokenizer, []
    for group, example in enumerate(examples):
        ids = tokenizer.encode(f"The answer is {example.answer}, since we add.", add_special_tokens=False)
        ids.append(tokenizer.eos_token_id)
        zeros = [0.0] * len(ids)
        records.append(RolloutRecord(0, example.id, group, prompting.student_ids(example), ids, tokenizer.decode(ids),
                                     zeros, zeros, zeros, zeros, 1.0, True, example.answer))
    return records


def prompting_with(tokenizer, teacher: str) -> Prompting:
    return Prompting(tokenizer, load_template("student/plain"), load_template(teacher), {e.id: e for e in ITEMS})


class ServerLike:
    """An engine seen as a server sees it: scores and top-J, no full distributions."""

    supports_full_vocabulary = False

    def __init__(self, engine: LocalEngine) -> None:
        self.engine = engine

    def score(self, sequences, top_k: int = 0, temperature: float = 1.0):
        return self.engine.score(sequences, top_k=top_k, temperature=temperature)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir, smollm2_tokenizer) -> LocalEngine:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return LocalEngine(model, smollm2_tokenizer, batch_size=2)


def test_exact_and_top_j_teachability_agree_when_j_is_the_vocabulary(tiny, smollm2_tokenizer):
    prompting = prompting_with(smollm2_tokenizer, "teacher/reference_answer")
    records = answer_records(prompting, ITEMS[:2])
    vocab = tiny.model.get_output_embeddings().weight.shape[0]
    exact = teachability(tiny, tiny, records, prompting, k=3, temperature=0.7)
    listed = teachability(tiny, ServerLike(tiny), records, prompting, k=3, teacher_k=vocab, temperature=0.7)
    assert all(e.exact and not s.exact for e, s in zip(exact, listed))
    for e, s, record in zip(exact, listed, records):
        assert e.mass.shape == (len(record.completion_ids),) and e.mass.dtype == np.float64
        np.testing.assert_allclose(s.mass, e.mass, atol=2e-6)
        np.testing.assert_allclose(e.tail, 1 - e.mass)
    short = teachability(tiny, ServerLike(tiny), records, prompting, k=3, teacher_k=3, temperature=0.7)
    assert all((s.mass <= e.mass + 1e-6).all() for s, e in zip(short, exact))  # top-J: a lower bound


def test_self_teacher_with_the_empty_template(tiny, smollm2_tokenizer):
    """Against itself with no context: teachability is the student's own top-k mass, the
    contrastive gain and the capability are zero, and so is the information."""
    prompting = prompting_with(smollm2_tokenizer, "teacher/empty")
    records = answer_records(prompting, ITEMS)
    masses = teachability(tiny, tiny, records, prompting, k=4, temperature=0.8)
    for record, found in zip(records, masses):
        own = tiny.score([(record.prompt_ids, record.completion_ids)], top_k=4, temperature=0.8)[0]
        np.testing.assert_allclose(found.mass, own.topk_logprobs.double().logsumexp(-1).exp().numpy(), atol=2e-6)
        assert 0 < found.mass.min() and found.mass.max() < 1
    assert all((g == 0).all() for g in contrastive_gains(tiny, records, prompting, temperature=0.8))
    twin = LocalEngine(tiny.model, tiny.tokenizer, batch_size=2)
    for split in dopd_split(tiny, twin, records, prompting, temperature=0.8):
        assert (split.capability == 0).all() and (split.information == 0).all()


def test_dopd_parts_are_the_scores_they_name(tiny, smollm2_model, smollm2_tokenizer):
    """An external teacher (SmolLM2) over a tiny student: information and capability are the
    differences of direct scores, and they sum to teacher - student."""
    prompting = prompting_with(smollm2_tokenizer, "teacher/worked_solution")
    records = answer_records(prompting, ITEMS)
    teacher = LocalEngine(smollm2_model, smollm2_tokenizer, batch_size=2)
    splits = dopd_split(tiny, teacher, records, prompting, temperature=0.9, batch_size=2)

    def direct(engine, prompt, record):
        return engine.score([(prompt, record.completion_ids)], temperature=0.9)[0].logprobs.double().numpy()

    for record, split in zip(records, splits):
        privileged = prompting.teacher_ids(prompting.example(record.id), record.text)
        plain, informed = direct(tiny, record.prompt_ids, record), direct(tiny, privileged, record)
        taught = direct(teacher, privileged, record)
        np.testing.assert_allclose(split.information, informed - plain, atol=1e-4)  # float32 scores, batched differently
        np.testing.assert_allclose(split.capability, taught - informed, atol=1e-4)
        np.testing.assert_allclose(split.advantage, taught - plain, atol=1e-4)
        assert np.abs(split.capability).max() > 0.1 and np.abs(split.information).max() > 1e-3


@pytest.mark.slow
def test_smollm2_self_teacher_is_all_information_and_follows_its_own_context(smollm2_model, smollm2_tokenizer):
    prompting = prompting_with(smollm2_tokenizer, "teacher/answer_hint_leaky")
    records = answer_records(prompting, ITEMS)
    student = LocalEngine(smollm2_model, smollm2_tokenizer, batch_size=4)
    twin = LocalEngine(smollm2_model, smollm2_tokenizer, batch_size=4)  # same weights, scored separately
    splits = dopd_split(student, twin, records, prompting)
    assert all((s.capability == 0).all() for s in splits)
    assert max(float(np.abs(s.information).max()) for s in splits) > 0.5  # the hint moves the student itself
    gains = contrastive_gains(student, records, prompting)
    for record, gain in zip(records, gains):
        pieces = [prompting.tokenizer.decode([i]) for i in record.completion_ids]
        answer = pieces.index(record.answer)
        # The answer token gains a lot with this item's hint over another item's (a different
        # answer); the rest of the sentence, which no hint states, moves far less.
        assert gain[answer] > 2.0 and np.abs(np.delete(gain, answer)).max() < 1.0


def test_the_diagnose_section_of_an_external_teacher(tiny, smollm2_model, smollm2_tokenizer, tmp_path):
    """measure_signals -> jsonl, heatmaps and the DOPD table, with a tiny student and SmolLM2 as an external teacher."""
    from selfopd.diagnostics.signals_report import measure_signals, render_signals, signals_json, write_signal_outputs

    prompting = prompting_with(smollm2_tokenizer, "teacher/answer_hint_leaky")
    records = answer_records(prompting, ITEMS)
    teacher = LocalEngine(smollm2_model, smollm2_tokenizer, batch_size=4)
    signals = measure_signals(tiny, teacher, records, prompting, "external", temperature=0.7, batch_size=4)
    figures = write_signal_outputs(signals, tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "signals.jsonl").read_text().splitlines()]
    assert [row["id"] for row in rows] == ["a", "b", "c"]
    for row, record in zip(rows, records):
        assert len(row["tokens"]) == len(row["tail_mass"]) == len(record.completion_ids)
        np.testing.assert_allclose(np.add(row["information"], row["capability"]), row["advantage"], atol=1e-9)
    assert (tmp_path / figures["signals"]).stat().st_size > 10_000 and "<span" in (tmp_path / "signals.html").read_text()
    text = render_signals(signals, figures)
    assert "| all |" in text and "capability share" in text and "self teacher" not in text
    summary = signals_json(signals)
    assert summary["exact"] and 0 <= summary["dopd_information_share"]["all"]["value"] <= 1
    mass = summary["teacher_mass_on_student_top_k"]
    assert 0 <= mass["value"] <= 1 and summary["tail_mass"]["value"] == pytest.approx(1 - mass["value"])
    assert "all information (capability 0)" in render_signals(dataclasses.replace(signals, teacher_kind="self",
                                                                                  information=None), figures)
