"""Span alignment of two tokenizations and the bridge to a teacher with its own tokenizer,
against independent references: a two-pointer walk over the pieces' texts, and the teacher's
logprob of the whole completion from a float64 forward."""

import random

import pytest
import torch

from experiments.cross_tokenizer.tokenizer import train_tokenizer
from selfopd.templating.token_alignment import SpanAlignment, align_spans, token_ends
from selfopd.templating.token_bridge import ChatBoundaryError, open_bridge, turn_end

TEXTS = ["The capital of Varnoria is Quellbridge, founded in 1622.", "What is 12 + 30? The answer is 42.",
         "Hello world, ¡olé! 中文 and über-naïve café.", "Its flag is blue and gold; its animal, the lynx."] * 40


def ends_of(pieces):
    ends, total = [], 0
    for piece in pieces:
        total += len(piece)
        ends.append(total)
    return ends


def walk_reference(a_pieces, b_pieces):
    """Independent reference: advance whichever side has consumed fewer characters; a span closes
    when both have consumed the same number. Returns the spans as index ranges on each side."""
    a_spans, b_spans, i, j, a_len, b_len, a0, b0 = [], [], 0, 0, 0, 0, 0, 0
    while i < len(a_pieces) or j < len(b_pieces):
        if j >= len(b_pieces) or (i < len(a_pieces) and a_len + len(a_pieces[i]) <= b_len + (len(b_pieces[j]) if j < len(b_pieces) else 0) and a_len <= b_len):
            a_len += len(a_pieces[i])
            i += 1
        else:
            b_len += len(b_pieces[j])
            j += 1
        if a_len == b_len and (i == len(a_pieces) or len(a_pieces[i])) and (j == len(b_pieces) or len(b_pieces[j])):
            a_spans.append((a0, i))
            b_spans.append((b0, j))
            a0, b0 = i, j
    return a_spans, b_spans


def random_pieces(rng, text):
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, len(text) - 1)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def test_hand_made_case():
    student, teacher = ["Hel", "lo", " wor", "ld", "!"], ["Hello", " w", "or", "ld!"]  # shared ends: 5, 9, 12
    alignment = align_spans(ends_of(student), ends_of(teacher))
    assert alignment == SpanAlignment(student=((0, 2), (2, 3), (3, 5)), teacher=((0, 1), (1, 3), (3, 4)))
    values = torch.tensor([-1.0, -2.0, -3.0, -0.5], dtype=torch.float64)
    assert alignment.teacher_per_student_token(values).tolist() == [-0.5, -0.5, -5.0, -0.25, -0.25]


@pytest.mark.parametrize("seed", range(200))
def test_random_segmentations_match_the_reference(seed):
    rng = random.Random(seed)
    text = rng.choice(TEXTS)[: rng.randint(1, 50)]
    a, b = random_pieces(rng, text), random_pieces(rng, text)
    alignment = align_spans(ends_of(a), ends_of(b))
    assert (list(alignment.student), list(alignment.teacher)) == walk_reference(a, b)
    for (s0, s1), (t0, t1) in zip(alignment.student, alignment.teacher):
        assert "".join(a[s0:s1]) == "".join(b[t0:t1])  # each span covers the same characters
    values = torch.randn(len(b), dtype=torch.float64)
    per_student = alignment.teacher_per_student_token(values)
    assert per_student.sum().item() == pytest.approx(values.sum().item(), abs=1e-12)  # the sum identity
    for (s0, s1), (t0, t1) in zip(alignment.student, alignment.teacher):
        assert per_student[s0:s1].sum().item() == pytest.approx(values[t0:t1].sum().item(), abs=1e-12)
    identical = align_spans(ends_of(a), ends_of(a))
    own = torch.randn(len(a), dtype=torch.float64)
    assert identical.one_to_one and torch.equal(identical.teacher_per_student_token(own), own)


def test_a_token_that_ends_mid_character_never_bounds_a_span():
    # Byte pieces of "中" (3 bytes): the first two end mid-character (None), joined to the third.
    alignment = align_spans([1, None, None, 2, 3], [3])
    assert alignment == SpanAlignment(student=((0, 5),), teacher=((0, 1),))
    assert align_spans([1, None, 2], [1, 2]) == SpanAlignment(student=((0, 1), (1, 3)), teacher=((0, 1), (1, 2)))


def test_different_texts_are_refused():
    with pytest.raises(ValueError, match="different characters"):
        align_spans([3, 5], [3, 6])


@pytest.fixture(scope="module")
def bpe():
    return train_tokenizer(TEXTS, vocab_size=400)


def test_token_ends_on_real_tokenizers(smollm2_tokenizer, bpe):
    for tokenizer in (smollm2_tokenizer, bpe):
        for text in TEXTS[:4]:
            ids = tokenizer.encode(text, add_special_tokens=False)
            decoded, ends = token_ends(tokenizer, ids)
            assert decoded == text and ends[-1] == len(text)
            known = [e for e in ends if e is not None]
            assert known == sorted(known)
            for i, end in enumerate(ends):
                if end is not None:  # the text of the first i + 1 tokens is exactly text[:end]
                    assert tokenizer.decode(ids[: i + 1]) == text[:end]
    _, ends = token_ends(smollm2_tokenizer, smollm2_tokenizer.encode("中", add_special_tokens=False))
    assert ends[-1] == 1 and all(e is None for e in ends[:-1])  # byte pieces of one character


def test_bridge_between_two_tokenizers_covers_the_same_text(smollm2_tokenizer, bpe):
    bridge = open_bridge(smollm2_tokenizer, bpe, len(bpe))
    assert not bridge.shared_ids
    rng = random.Random(0)
    for _ in range(50):
        text = rng.choice(TEXTS)[: rng.randint(1, 60)]
        ids = smollm2_tokenizer.encode(text, add_special_tokens=False) + [bridge.student_end]
        bridged = bridge.completion(ids)
        assert bridged.problem is None
        assert bridged.teacher_ids[-1] == bridge.teacher_end
        for (s0, s1), (t0, t1) in zip(bridged.alignment.student, bridged.alignment.teacher):
            assert smollm2_tokenizer.decode(ids[s0:s1]) == bpe.decode(bridged.teacher_ids[t0:t1]) or s1 == len(ids)


def test_sum_identity_against_the_teachers_whole_completion_logprob(smollm2_tokenizer, bpe, tmp_path):
    """The student's per-token teacher logprobs add up to the teacher's logprob of the whole
    completion (text and end of turn), computed by a float64 forward of the teacher model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from selfopd.engines.local import LocalEngine

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(bpe), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=16)).eval()
    engine = LocalEngine(model, bpe, batch_size=4)
    bridge = open_bridge(smollm2_tokenizer, bpe, len(bpe))
    prompt = bridge.prompt_ids([{"role": "user", "content": "Tell me about Varnoria."}])
    ids = smollm2_tokenizer.encode("The capital of Varnoria is Quellbridge ¡olé!", add_special_tokens=False) + [2]
    bridged = bridge.completion(ids)
    [scores] = engine.score([(prompt, bridged.teacher_ids)])
    per_student = bridged.alignment.teacher_per_student_token(scores.logprobs)
    assert per_student.shape == (len(ids),)
    with torch.no_grad():
        sequence = torch.tensor([prompt + bridged.teacher_ids])
        logits = model.double()(sequence).logits[0, len(prompt) - 1 : -1]
        whole = logits.log_softmax(-1).gather(1, torch.tensor(bridged.teacher_ids)[:, None]).sum().item()
    assert per_student.sum().item() == pytest.approx(whole, abs=1e-4)  # fp32 engine vs float64 forward
    assert per_student.sum().item() == pytest.approx(scores.logprobs.double().sum().item(), abs=1e-12)


def test_same_tokenizer_passes_the_students_ids_through(smollm2_tokenizer):
    bridge = open_bridge(smollm2_tokenizer, smollm2_tokenizer, 49152)
    assert bridge.shared_ids
    ids = smollm2_tokenizer.encode("Hel", add_special_tokens=False) + smollm2_tokenizer.encode(
        "lo there", add_special_tokens=False) + [2]  # a non-canonical tokenization stays as sampled
    bridged = bridge.completion(ids)
    assert bridged.teacher_ids == ids and bridged.alignment.one_to_one
    values = torch.randn(len(ids))
    assert torch.equal(bridged.student_logprobs(values), values)  # bit for bit


def test_a_text_that_does_not_round_trip_is_masked_and_said(smollm2_tokenizer):
    lower = train_tokenizer(TEXTS, vocab_size=400, lowercase=True)
    bridge = open_bridge(smollm2_tokenizer, lower, len(lower))
    bridged = bridge.completion(smollm2_tokenizer.encode("the Capital", add_special_tokens=False))
    assert bridged.alignment is None and "character 4" in bridged.problem and "'Capital'" in bridged.problem
    inner = bridge.completion(smollm2_tokenizer.encode("a", add_special_tokens=False) + [1] +
                              smollm2_tokenizer.encode("b", add_special_tokens=False))
    assert inner.alignment is None and "special token '<|im_start|>'" in inner.problem


def test_chat_template_boundaries_are_checked(bpe):
    assert bpe.convert_ids_to_tokens(turn_end(bpe, "bpe")) == "<|end|>"
    broken = train_tokenizer(TEXTS, vocab_size=400)
    broken.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
                            "{% if add_generation_prompt %}<|assistant|>\n<|system|>{% endif %}")  # a header finished turns lack
    with pytest.raises(ChatBoundaryError, match="generation prompt is not how a finished conversation begins"):
        turn_end(broken, "broken")
    broken.chat_template = broken.chat_template.replace("<|assistant|>\n<|system|>", "<|assistant|>")  # no newline
    with pytest.raises(ChatBoundaryError, match="does not follow the generation prompt"):
        turn_end(broken, "broken")
    prefixed = train_tokenizer(TEXTS, vocab_size=400)
    prefixed.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>\n{% if m['role'] == 'assistant' %}Answer: "
                              "{% endif %}{{ m['content'] }}<|end|>\n{% endfor %}"
                              "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    with pytest.raises(ChatBoundaryError, match="does not follow the generation prompt"):
        turn_end(prefixed, "prefixed")
