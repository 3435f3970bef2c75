"""Refuses a teacher that cannot score the student's exact token ids.

The teacher scores the ids the student sampled, never a retokenization of its text, so
the two must agree on what every id means. A mismatch does not crash anything: it
silently biases every token's advantage (tinker-cookbook #796: +0.287 nats/token), so
the trainer calls `check_tokenizers_compatible` at start-up and stops on any difference:

- a student token whose id differs in the teacher's vocab, or that the teacher lacks;
- different special tokens (bos/eos/pad/unk, and every added token marked special, which
  includes the chat-template control tokens such as `<|im_start|>`);
- a teacher model with fewer embedding rows than the student's largest id + 1;
- chat templates that render different prompt ids for the same conversation.

Allowed on purpose: a teacher vocab with extra tokens the student lacks, and a teacher
embedding padded beyond its tokenizer. Both only add ids the student never samples.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from selfopd.templating.chat_format import ChatFormat
from selfopd.templating.errors import TemplateLimitError
from selfopd.templating.templates import Message

MAX_EXAMPLES = 5
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")

# The chat-template check renders these and compares ids, not template source: templates
# that differ only textually (whitespace control, `~` vs `+`) are harmless, while any
# change to the ids the teacher is prompted with shifts its scores. The user-only probe
# covers templates' default-system-prompt branch, which selfopd hits when a prompt
# template has no system block. The text mixes digits, spaces and non-ASCII so that
# differing pre-tokenizers or normalizers also show up.
CHAT_PROBES: tuple[tuple[str, tuple[Message, ...]], ...] = (
    (
        "system + user",
        (
            {"role": "system", "content": "You are a careful math tutor."},
            {"role": "user", "content": "What is 12 + 30?  Answer in \\boxed{}, then say ¡olé! 中文"},
        ),
    ),
    ("user-only", ({"role": "user", "content": "Compute 7 * 6."},)),
)


class TokenizerMismatch(ValueError):
    """The teacher's tokenizer or model would read the student's token ids differently."""


def check_tokenizers_compatible(
    student_tokenizer: Any,
    teacher_tokenizer: Any,
    teacher_vocab_size: int,
    student_name: str = "student",
    teacher_name: str = "teacher",
    template_kwargs: Mapping[str, Any] | None = None,
) -> None:
    """Raise TokenizerMismatch listing every difference; return None when compatible.

    `teacher_vocab_size` is the teacher model's output-embedding rows (`config.vocab_size`),
    which may exceed its tokenizer's length. `template_kwargs`: the teacher's chat-template
    arguments; both templates render with them, since the teacher's prompts are made with
    them whichever tokenizer renders them (a difference between the roles' arguments is
    `selfopd prompts lint`'s to report, not a tokenizer mismatch).
    """
    student_vocab = student_tokenizer.get_vocab()  # token -> id
    teacher_vocab = teacher_tokenizer.get_vocab()
    names = (student_name, teacher_name)
    problems = _vocab_problems(student_vocab, teacher_vocab, names)
    problems += _special_token_problems(student_tokenizer, teacher_tokenizer, names)
    # A larger teacher size is fine: padded rows (Qwen2.5: 152064 rows for a 151665-token
    # tokenizer, 151936 in the small models) are never sampled by the student.
    needed = max(student_vocab.values()) + 1
    if teacher_vocab_size < needed:
        problems.append(
            f"{teacher_name} model vocab size {teacher_vocab_size} is smaller than {needed}, the size the "
            f"{student_name} tokenizer needs (largest id {needed - 1}): its ids would index past the embedding"
        )
    problems += _chat_template_problems(student_tokenizer, teacher_tokenizer, names, dict(template_kwargs or {}))
    if problems:
        lines = "\n".join(f"- {problem}" for problem in problems)
        raise TokenizerMismatch(f"{teacher_name} cannot score {student_name}'s token ids:\n{lines}")


def _vocab_problems(student_vocab: dict[str, int], teacher_vocab: dict[str, int], names: tuple[str, str]) -> list[str]:
    """Student tokens the teacher maps to another id or lacks; teacher-only tokens are allowed."""
    if student_vocab == teacher_vocab:  # the common case, at C speed
        return []
    student_name, teacher_name = names
    differing = sorted(student_vocab.items() - teacher_vocab.items(), key=lambda item: item[1])  # by student id
    moved = [(token, sid, teacher_vocab[token]) for token, sid in differing if token in teacher_vocab]
    missing = [(token, sid) for token, sid in differing if token not in teacher_vocab]
    problems = []
    if moved:
        examples = ", ".join(
            f"{token!r}: {student_name} id {sid}, {teacher_name} id {tid}" for token, sid, tid in moved[:MAX_EXAMPLES]
        )
        problems.append(f"{len(moved)} tokens have different ids, e.g. {examples}")
    if missing:
        examples = ", ".join(f"{token!r} ({student_name} id {sid})" for token, sid in missing[:MAX_EXAMPLES])
        where = f"missing from the {teacher_name} vocab"
        problems.append(f"{len(missing)} {student_name} tokens are {where}, e.g. {examples}")
    return problems


def _special_token_problems(student_tokenizer: Any, teacher_tokenizer: Any, names: tuple[str, str]) -> list[str]:
    student_name, teacher_name = names
    problems = []
    for attribute in NAMED_SPECIAL_TOKENS:
        student_token = getattr(student_tokenizer, attribute, None)
        teacher_token = getattr(teacher_tokenizer, attribute, None)
        if student_token != teacher_token:
            problems.append(f"{attribute} differs: {student_name} {student_token!r}, {teacher_name} {teacher_token!r}")
    student_special, teacher_special = _special_tokens(student_tokenizer), _special_tokens(teacher_tokenizer)
    only_student, only_teacher = student_special - teacher_special, teacher_special - student_special
    for owner, only in ((student_name, only_student), (teacher_name, only_teacher)):
        if only:
            listed = ", ".join(repr(token) for token in sorted(only)[:MAX_EXAMPLES])
            problems.append(f"{len(only)} special tokens only the {owner} has, e.g. {listed}")
    return problems


def _special_tokens(tokenizer: Any) -> set[str]:
    """Named special tokens plus every added token marked special (the chat-template controls)."""
    added = getattr(tokenizer, "added_tokens_decoder", {})
    return {token.content for token in added.values() if token.special} | set(tokenizer.all_special_tokens)


def _chat_template_problems(student_tokenizer: Any, teacher_tokenizer: Any, names: tuple[str, str],
                            kwargs: Mapping[str, Any]) -> list[str]:
    problems = []
    for label, messages in CHAT_PROBES:
        rendered = [_render(tokenizer, messages, kwargs) for tokenizer in (student_tokenizer, teacher_tokenizer)]
        errors = [(name, result) for name, result in zip(names, rendered) if isinstance(result, Exception)]
        if len(errors) == 2:  # neither has a usable template: nothing to disagree on
            continue
        if errors:
            name, error = errors[0]
            problems.append(f"only one chat template renders the {label} probe; {name}: {error}")
            continue
        (student_ids, student_text), (teacher_ids, teacher_text) = rendered
        if student_ids != teacher_ids:
            shorter = min(len(student_ids), len(teacher_ids))
            at = next((i for i in range(shorter) if student_ids[i] != teacher_ids[i]), shorter)
            if student_text == teacher_text:
                how = "the same text tokenizes differently"
            else:
                how = f"{names[0]} renders {student_text!r}, {names[1]} renders {teacher_text!r}"
            problems.append(f"chat templates give different prompt ids for the {label} probe from position {at}: {how}")
    return problems


def _render(tokenizer: Any, messages: Sequence[Message], kwargs: Mapping[str, Any]) -> tuple[list[int], str] | Exception:
    """Generation-prompt ids and text, or the error of a tokenizer without a usable template."""
    try:
        chat = ChatFormat(tokenizer, kwargs)
        return chat.prompt_ids(messages), chat.text(messages)
    except TemplateLimitError:  # a template past a bound stops here: the next render would too
        raise
    except Exception as error:  # a missing or broken template: reported by the caller
        return error
