"""Prompts that leave no room in a model's context. Past its context an in-process model
silently extrapolates its positions (every logprob after that point is garbage) and a vLLM
server fails mid-run, so selfopd refuses: the student's and the teacher's prompts at start
(the longest prompts of the data, the teacher's rendered with everything it is shown: the
answer, solution, hints and fact sheet of the rows with the most such text, and the worst case
of what a step adds), and every teacher row at each step, before it is scored, naming the data row."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from selfopd.config import ConfigError, TrainConfig
from selfopd.data.example import Example
from selfopd.templating.chat_format import ChatFormat
from selfopd.templating.templates import (SAMPLE_DEMONSTRATION, PromptTemplate, privileged_fields, render_student,
                                         render_teacher, uses_demonstration)

CONTEXT_CHECKED = 64  # prompts per split (and teacher prompts) whose token count is checked at start
# Teacher-template variables that carry a student completion (up to rollout.max_tokens tokens) into the prompt.
COMPLETION_VARIABLES = ("attempt", "demonstration")


def _positions(model_config: Any) -> int | None:
    """A model's max_position_embeddings, from its text config in a vision-language hub layout (Qwen3.5's)."""
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    return getattr(text, "max_position_embeddings", None)


def context_limits(config: TrainConfig, student_config: Any, teacher_config: Any) -> tuple[tuple[int, str],
                                                                                           tuple[int, str]]:
    """((tokens, what) the student's prompt + completion may fill, the same for the teacher's),
    from the models' max_position_embeddings and the vLLM servers selfopd launches (scoring
    on a server needs one position more). A server given by URL is checked when it answers."""
    engine = config.engine
    student = [(_positions(student_config), "the student's max_position_embeddings")]
    teacher = [(_positions(teacher_config), "the teacher's max_position_embeddings")]
    launched = engine.kind == "vllm_colocate" or engine.kind == "vllm"
    if launched and (engine.kind == "vllm_colocate" or not engine.student_urls):
        student.append((engine.max_model_len - 1, "engine.max_model_len - 1"))
    if launched and (engine.kind == "vllm_colocate" or not engine.teacher_url):
        teacher.append((engine.max_model_len - 1, "engine.max_model_len - 1 (a server scores one position more)"))
    return (min((n, name) for n, name in student if n), min((n, name) for n, name in teacher if n))


def check_context(config: TrainConfig, student_config: Any, teacher_config: Any, tokenizer: Any,
                  student: PromptTemplate, teacher: PromptTemplate, fallback: PromptTemplate | None,
                  train_examples: Sequence[Example], eval_examples: Sequence[Example],
                  teacher_tokenizer: Any | None = None, teacher_kwargs: dict[str, Any] | None = None) -> None:
    """Refuse, before any engine starts, a prompt that leaves no room for its completion.
    Only the longest prompts by characters are tokenized (a large dataset costs no start-up
    time): for the teacher, the rows with the most text it is shown (question, answer, solution,
    hints, fact sheet), each rendered as the teacher sees it. A teacher prompt is counted with its
    worst case: every completion the template shows it (`attempt`, `demonstration`) at
    rollout.max_tokens, then the scored completion; through `teacher_tokenizer` when the teacher has
    its own (its tokens of a completion can be more than the student's: each step's rows are checked
    again as they are scored)."""
    (student_limit, student_what), (teacher_limit, teacher_what) = context_limits(config, student_config,
                                                                                  teacher_config)
    student_chat = ChatFormat(tokenizer, config.model.chat_template_kwargs)
    teacher_chat = ChatFormat(teacher_tokenizer or tokenizer, config.teacher.template_kwargs(  # the teacher's arguments
        config.model.chat_template_kwargs) if teacher_kwargs is None else teacher_kwargs)
    for key, completion, examples in (("rollout.max_tokens", config.rollout.max_tokens, train_examples),
                                      ("eval.max_tokens", config.eval.max_tokens, eval_examples)):
        lengths = {e.id: len(student_chat.prompt_ids(render_student(student, e))) for e in _longest(examples)}
        if not lengths:  # no held-out prompts (data.eval_size = 0: eval.data is checked where it is loaded)
            continue
        longest = max(lengths, key=lengths.__getitem__)
        if lengths[longest] + completion > student_limit:
            raise ConfigError(key, f"data row {longest!r} of {config.data.spec}: its prompt ({lengths[longest]} tokens) "
                              f"plus {key} ({completion}) exceeds the context of {student_limit} tokens ({student_what}); "
                              f"shorten that prompt or lower {key}")
    max_tokens = config.rollout.max_tokens
    shown = [name for name in COMPLETION_VARIABLES if name in teacher.variables]
    worst = max_tokens * (1 + len(shown))
    for example in _longest(train_examples, _teacher_chars):
        messages = render_teacher(teacher, example, render_student(student, example), attempt="", feedback="",
                                  demonstration=SAMPLE_DEMONSTRATION if uses_demonstration(teacher) else None,
                                  fallback=fallback)
        tokens = len(teacher_chat.prompt_ids(messages))
        if tokens + worst > teacher_limit:
            shows = f", the {' and '.join(shown)} it shows" if shown else ""
            raise ConfigError("teacher.template", f"data row {example.id!r} of {config.data.spec}: the teacher's prompt "
                              f"({teacher.name}, {tokens} tokens){shows} and the scored completion can reach "
                              f"{tokens + worst} tokens with rollout.max_tokens = {max_tokens}, past the teacher's "
                              f"context of {teacher_limit} ({teacher_what}) by {tokens + worst - teacher_limit} tokens; "
                              "lower rollout.max_tokens, shorten the template or that row's privileged text")


def check_teacher_rows(rows: Sequence[tuple[str, list[int], list[int]]], engine: Any, step: int) -> None:
    """Each (data row id, teacher prompt ids, completion ids) of a step fits the teacher engine's
    context (its `max_scored_tokens`; None: unknown), or a ConfigError naming the row."""
    limit = engine.max_scored_tokens
    if limit is None:
        return
    for row_id, prompt, completion in rows:
        if len(prompt) + len(completion) > limit:
            raise ConfigError("teacher.template", f"step {step}, data row {row_id!r}: the teacher's prompt "
                              f"({len(prompt)} tokens) plus the student's completion ({len(completion)} tokens) exceeds "
                              f"the teacher's context of {limit} tokens; scoring it would read positions the teacher "
                              "has no room for. Lower rollout.max_tokens or shorten the template (the run stops here; "
                              "its checkpoints are kept)")


def _longest(examples: Sequence[Example], chars: Callable[[Example], int] = lambda e: len(e.prompt)) -> list[Example]:
    """The CONTEXT_CHECKED examples with the most `chars`."""
    return sorted(examples, key=chars, reverse=True)[:CONTEXT_CHECKED]


def _teacher_chars(example: Example) -> int:
    """The characters a teacher template may show of `example`: a short question with a long
    reference solution makes a long teacher prompt."""
    shown = privileged_fields(example).values()
    return len(example.prompt) + len(example.answer) + sum(len(str(value)) for value in shown)
