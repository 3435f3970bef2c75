"""Token classes, leak detection and the saved-rollout format (real tokenizer, no model)."""

from __future__ import annotations

import pytest

from selfopd.run.rollouts import DiagnosticsError, RolloutRecord, read_records, read_run_rollouts, write_records
from selfopd.diagnostics.tokens import (
    answer_occurrences,
    classify_tokens,
    epistemic_count,
    leaked_phrases,
    privileged_only_text,
    shared_ngram_ranges,
    token_pieces,
)


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def test_token_pieces_tile_the_decoded_text_even_with_multibyte_characters(smollm2_tokenizer):
    text = "Résumé: 3 → 4 😀 done.\nThe answer is 17."
    ids = encode(smollm2_tokenizer, text) + [smollm2_tokenizer.eos_token_id]
    pieces = token_pieces(smollm2_tokenizer, ids)
    assert pieces.text == smollm2_tokenizer.decode(ids)
    assert "".join(pieces.pieces) == pieces.text
    assert all(a[1] == b[0] for a, b in zip(pieces.spans, pieces.spans[1:]))
    assert "\ufffd" not in pieces.text
    assert pieces.pieces[-1] == smollm2_tokenizer.eos_token


def classes_by_piece(tokenizer, text, **kwargs):
    pieces = token_pieces(tokenizer, encode(tokenizer, text))
    return list(zip(pieces.pieces, classify_tokens(pieces, special_tokens=frozenset(tokenizer.all_special_tokens), **kwargs)))


def test_classes_of_a_correct_answer(smollm2_tokenizer):
    tagged = classes_by_piece(smollm2_tokenizer, "Wait, let me check: 3 + 14 = 17. Maybe 18? The answer is 17.",
                              answer="17", extracted_answer="17")
    by_class = {}
    for piece, name in tagged:
        by_class.setdefault(name, []).append(piece.strip())
    assert by_class["answer_copy"] == ["1", "7"]  # the final answer 17, digit by digit; the 17 of the working is not
    assert {"Wait", "check", "Maybe"} <= set(by_class["epistemic"])
    assert {",", ":", "+", "=", ".", "?"} <= set(by_class["structural"])
    assert "1" in by_class["other"] and "8" in by_class["other"]  # 18 and 14 are not the answer
    assert "answer_slot" not in by_class


def test_an_operand_equal_to_the_answer_is_not_an_answer_token(smollm2_tokenizer):
    """In "7 - 3 + 3 = 7" the first 7 is the question's operand: only the final answer counts."""
    tagged = classes_by_piece(smollm2_tokenizer, "7 - 3 + 3 = 7", answer="7", extracted_answer="7", correct=True)
    sevens = [name for piece, name in tagged if piece.strip() == "7"]
    assert sevens == ["other", "answer_copy"]
    wrong = classes_by_piece(smollm2_tokenizer, "7 - 3 + 3 = 8", answer="7", extracted_answer="8", correct=False)
    assert [name for piece, name in wrong if piece.strip() in ("7", "8")] == ["other", "answer_slot"]


def test_a_wrong_final_answer_is_the_answer_slot_only_where_it_is_stated_last(smollm2_tokenizer):
    tagged = classes_by_piece(smollm2_tokenizer, "First 5, then 12. So the answer is 12.", answer="9", extracted_answer="12")
    slots = [i for i, (_, name) in enumerate(tagged) if name == "answer_slot"]
    assert [tagged[i][0].strip() for i in slots] == ["1", "2"]
    assert slots[0] > [i for i, (p, _) in enumerate(tagged) if p.strip() == "1"][0]  # the first 12 is "other"


def test_answer_occurrences_respect_number_and_word_boundaries():
    text = "17 170 1.7 -17 x17 17."
    assert answer_occurrences(text, "17") == [(0, 2), (12, 14), (19, 21)]
    assert answer_occurrences("Paris, not paris-like", "Paris") == [(0, 5), (11, 16)]
    assert answer_occurrences("anything", "") == []


def test_shared_ngrams_exclude_what_the_student_prompt_already_says():
    privileged = "A verified reference solution arrives at the final answer 12 after adding the terms."
    prompt = "Please arrive at the final answer for 5 + 7."
    text = "I know a verified reference solution arrives at twelve; adding the terms gives it."
    ranges = shared_ngram_ranges(text, privileged, prompt, n=4)
    assert [text[a:b] for a, b in ranges] == ["a verified reference solution", "verified reference solution arrives",
                                             "reference solution arrives at"]
    assert shared_ngram_ranges("we arrive at the final answer", privileged, prompt, n=4) == []


@pytest.mark.parametrize("text", [
    "According to the hint, the answer is 5.",
    "The correct final answer is 5.",
    "As the reference answer says, 5.",
    "I was told it is 5.",
])
def test_leaked_phrases_found(text):
    assert leaked_phrases(text)


def test_plain_answers_do_not_leak_but_verbatim_privileged_text_does():
    assert leaked_phrases("3 + 2 = 5. The answer is 5.") == []
    privileged = "Note for you only: the correct final answer is 5."
    found = leaked_phrases("note for you only the answer", privileged, n=4)
    assert found == ["note for you only"]


def test_privileged_only_text_removes_the_student_prompt_and_the_attempt():
    teacher = "What is 2 + 3?\n\nAn earlier attempt at this question was:\n\"\"\"\nIt is 6.\n\"\"\"\nVerdict: wrong."
    left = privileged_only_text(teacher, "What is 2 + 3?", "It is 6.")
    assert "What is 2 + 3?" not in left and "It is 6." not in left and "Verdict: wrong." in left


def test_epistemic_count():
    assert epistemic_count("Wait, maybe... let me double-check. Hmm.") == 4  # double-check is one word
    assert epistemic_count("The sum is 5.") == 0


def record(step=1, n=3, **overrides):
    fields = dict(step=step, id="item/0", group=0, prompt_ids=[1, 2], completion_ids=list(range(n)), text="abc",
                  sampler_logprobs=[-1.0] * n, student_logprobs=[-1.0] * n, teacher_logprobs=[-0.5] * n,
                  advantage=[0.5] * n, reward=1.0, correct=True, answer="5")
    fields.update(overrides)
    return RolloutRecord(**fields)


def test_records_round_trip_and_name_bad_lines(tmp_path):
    records = [record(), record(n=2)]
    path = tmp_path / "rollouts" / "step_00001.jsonl"
    write_records(path, records)
    assert read_records(path) == records
    assert records[0].opd_advantage == [0.5, 0.5, 0.5]
    path.write_text(path.read_text() + '{"step": 1}\n')
    with pytest.raises(DiagnosticsError, match="step_00001.jsonl:3"):
        read_records(path)


def test_record_lengths_are_checked():
    with pytest.raises(ValueError, match="advantage has 2 values for 3 completion tokens"):
        record(advantage=[0.1, 0.2])


def test_run_rollouts_by_step(tmp_path):
    for step in (2, 1, 10):
        write_records(tmp_path / "rollouts" / f"step_{step:05d}.jsonl", [record(step=step)])
    assert list(read_run_rollouts(tmp_path)) == [1, 2, 10]
    with pytest.raises(FileNotFoundError, match=r"step\(s\) \[3\]"):
        read_run_rollouts(tmp_path, steps=[3])
    with pytest.raises(FileNotFoundError, match="rollouts_to_save"):
        read_run_rollouts(tmp_path / "nothing")
