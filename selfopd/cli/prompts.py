"""`selfopd prompts list | render | lint | rank`: author, render, lint and rank prompt templates."""

from __future__ import annotations

import argparse
import shutil
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING

from selfopd.cli.common import DEFAULT_MODEL, DEFAULT_STUDENT, UserError, add_overrides, command
from selfopd.run.verifier_isolation import use_verifier_isolation

if TYPE_CHECKING:
    from selfopd.config import TrainConfig
    from selfopd.templating.templates import PromptTemplate

RANK_PROMPTS, RANK_SAMPLES, RANK_GAP_ITEMS = 24, 8, 64  # `prompts rank` defaults: docs/diagnostics.md


def add_prompts_command(commands: argparse._SubParsersAction) -> None:
    prompts = commands.add_parser("prompts", help="author, render, lint and rank prompt templates")
    sub = prompts.add_subparsers(title="prompts commands", metavar="COMMAND")
    command(sub, "list", _prompts_list, "list the templates shipped in prompts/")

    render = command(sub, "render", _prompts_render, "show the student and a teacher prompt side by side")
    render.add_argument("template", help="teacher template name (e.g. teacher/reference_answer) or file")
    render.add_argument("--data", help="data spec (default: the config's data.spec, else the demo task)")
    render.add_argument("--index", type=int, default=0, help="row of the dataset to render (default: 0)")
    render.add_argument("--student", help=f"student template (default: the config's, else {DEFAULT_STUDENT})")
    render.add_argument("--model", help="model whose chat template and tokenizer count tokens (default: the config's "
                        f"model.student, else {DEFAULT_MODEL})")
    _add_config(render)
    render.add_argument("--attempt", help="a student attempt, for templates that use `attempt`/`feedback`")
    render.add_argument("--demonstration", help="a correct sibling's answer, for templates that use `demonstration` "
                        "(default: a stand-in sentence)")

    lint = command(sub, "lint", _prompts_lint, "check templates render on a data sample and do not leak the answer")
    lint.add_argument("templates", nargs="*", help="template names or files (default: every shipped template)")
    lint.add_argument("--data", help="data spec to render on (default: the config's data.spec, else the demo task)")
    lint.add_argument("--sample", type=int, default=8, help="rows to render each template on (default: 8)")
    lint.add_argument("--student", help=f"student template (default: the config's, else {DEFAULT_STUDENT})")
    lint.add_argument("--model", help="with --config or --set: the model whose chat template shows whether the "
                      "roles' chat_template_kwargs move the teacher's scoring point (default: the config's model.student)")
    _add_config(lint)
    _add_rank(sub)
    prompts.set_defaults(run=lambda _args: prompts.print_help() or 2)


def _add_config(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="training config whose data, student template, model and "
                        "chat_template_kwargs (model.*, teacher.*, teachers.NAME.*) are the defaults")
    add_overrides(parser, "model.chat_template_kwargs=enable_thinking=false")


def _config(args: argparse.Namespace) -> TrainConfig:
    """The config `--config` and `--set` give (the defaults without them); flags win over it."""
    from selfopd.config import load_config

    config = load_config(args.config, args.overrides)
    use_verifier_isolation(config.verifier.isolation)
    args.data = args.data or config.data.spec
    args.student = args.student or config.data.student_template
    args.model = args.model or config.model.student
    return config


def _shown(kwargs: dict) -> str:
    return ", ".join(f"{name}={value!r}" for name, value in kwargs.items()) or "none"


RANK_HELP = """Score teacher templates on ONE fixed set of student rollouts, with no training, and
predict which trains best. The student samples --prompts distinct training prompts (the run's
step order and seed) x --samples once; every template's teacher (the config's teacher.kind)
scores exactly those token ids at the rollout temperature, as the trainer does at step 0.
Columns, each with a 95% interval over distinct prompts: teacher-prefers-correct, the
pre-training gap, the illusion score and its lift, teachability (teacher mass on the
student's top-k tokens) and its tail, the contrastive gain (this item's context against
another's), the mean advantage per token.
Predicted order, pre-registered: {rule}."""


def _add_rank(sub: argparse._SubParsersAction) -> None:
    from selfopd.comparisons.tournament import RULE

    rank = sub.add_parser("rank", help="score teacher templates on one fixed set of student rollouts and rank them",
                          description=RANK_HELP.format(rule=RULE))
    rank.set_defaults(run=_prompts_rank)
    rank.add_argument("config", type=Path, help="training config (e.g. experiments/demo/demo.toml)")
    add_overrides(rank, "teacher.kind=self")
    rank.add_argument("--templates", default="",
                      help="comma-separated teacher templates (default: every shipped teacher template the data fits)")
    rank.add_argument("--prompts", type=int, default=RANK_PROMPTS,
                      help=f"distinct training prompts to sample (default: {RANK_PROMPTS})")
    rank.add_argument("--samples", type=int, default=RANK_SAMPLES,
                      help=f"samples per prompt (default: {RANK_SAMPLES}; more make mixed right/wrong groups likelier)")
    rank.add_argument("--gap-items", type=int, default=RANK_GAP_ITEMS,
                      help=f"held-out items for the pre-training gap (default: {RANK_GAP_ITEMS})")
    rank.add_argument("--top-k", type=int, default=5,
                      help="the student's top-k tokens teachability puts the teacher's mass on (default: 5)")
    rank.add_argument("--out", type=Path, help="output folder (default: runs/prompts-rank-<run.name>)")


def _prompts_list(_args: argparse.Namespace) -> None:
    from selfopd.templating.templates import list_templates

    print("\n".join(list_templates()))


def _prompts_render(args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    from selfopd.config.teachers import chat_kwargs, pinned_revision
    from selfopd.data import load_examples
    from selfopd.core.models import from_pretrained, resolve_model
    from selfopd.templating.lint import generation_prompt
    from selfopd.templating.chat_format import ChatFormat
    from selfopd.templating.templates import (SAMPLE_DEMONSTRATION, load_template, render_student, render_teacher,
                                              uses_demonstration)
    from selfopd.verifiers import verify_example

    config = _config(args)
    examples = load_examples(args.data)
    if not 0 <= args.index < len(examples):
        raise UserError(f"--index {args.index} is outside the data spec's {len(examples)} rows")
    example = examples[args.index]
    student_template, teacher_template = load_template(args.student), load_template(args.template)
    student = render_student(student_template, example)
    feedback = verify_example(args.attempt, example).feedback if args.attempt is not None else None
    demonstration = (args.demonstration or SAMPLE_DEMONSTRATION) if uses_demonstration(teacher_template) else None
    teacher = render_teacher(teacher_template, example, student, args.attempt, feedback, demonstration)
    tokenizer = from_pretrained(AutoTokenizer, resolve_model(args.model, pinned_revision(config, args.model)),
                                trust_remote_code=config.model.trust_remote_code)
    roles = [(f"STUDENT {student_template.name}", student), (f"TEACHER {teacher_template.name}", teacher)]
    print(f"example {example.id} (answer: {example.answer})")
    chats = [ChatFormat(tokenizer, kwargs) for kwargs in chat_kwargs(config)]  # the student's, the teacher's
    print(_side_by_side([(f"{title} [{len(chat.prompt_ids(messages))} tokens]", _format_messages(messages))
                         for (title, messages), chat in zip(roles, chats)]))
    for (title, messages), kwargs in zip(roles, chat_kwargs(config)):
        print(f"{title.split()[0].lower()} chat_template_kwargs: {_shown(kwargs)}; the generation prompt adds "
              f"{generation_prompt(tokenizer, messages, kwargs)!r}")


def _prompts_lint(args: argparse.Namespace) -> int:
    from selfopd.data import load_examples
    from selfopd.templating.lint import lint_template, missing_fields
    from selfopd.templating.templates import list_templates, load_template

    config = _config(args)
    if args.sample < 1:
        raise UserError(f"--sample must be >= 1, got {args.sample}: linting on no rows would check nothing")
    sample = load_examples(args.data)[: args.sample]
    student = load_template(args.student)
    names = args.templates or list_templates()
    errors = warnings = 0
    for name in names:
        template = load_template(name)
        missing = missing_fields(template, sample)
        if missing and not args.templates:  # a shipped template meant for richer data
            print(f"skip: {name}: not applicable to {args.data}: {missing[0]}")
            continue
        findings = lint_template(template, student, sample)
        for finding in findings:
            print(finding)
        errors += sum(f.level == "error" for f in findings)
        warnings += sum(f.level == "warning" for f in findings)
        if not findings:
            print(f"ok: {name}")
    for finding in _boundary_findings(config, args.model):
        print(finding)
        warnings += 1
    print(f"{len(names)} templates, {errors} errors, {warnings} warnings")
    return 1 if errors else 0


def _boundary_findings(config: TrainConfig, model: str) -> list:
    """Each teacher ([teacher], [teachers.NAME]) whose chat-template arguments move the point it
    scores from, rendered with `model`'s chat template (loaded only when some arguments differ)."""
    from selfopd.config.teachers import chat_kwargs, pinned_revision, teacher_key, teacher_tables
    from selfopd.templating.lint import boundary_findings

    roles = [(teacher_key(name), *chat_kwargs(config, table)) for name, table in teacher_tables(config).items()]
    if all(student == teacher for _, student, teacher in roles):
        return []
    from transformers import AutoTokenizer

    from selfopd.core.models import from_pretrained, resolve_model

    tokenizer = from_pretrained(AutoTokenizer, resolve_model(model, pinned_revision(config, model)),
                                trust_remote_code=config.model.trust_remote_code)
    return [finding for key, student, teacher in roles for finding in boundary_findings(tokenizer, student, teacher, key)]


def _prompts_rank(args: argparse.Namespace) -> None:
    from selfopd.config import load_config
    from selfopd.comparisons.tournament import run_tournament
    from selfopd.comparisons.tournament_report import render_table, summary_line, write_tournament

    for flag, value in (("--prompts", args.prompts), ("--samples", args.samples), ("--gap-items", args.gap_items),
                        ("--top-k", args.top_k)):
        if value < 1:
            raise UserError(f"{flag} must be >= 1, got {value}")
    config = load_config(args.config, args.overrides)
    use_verifier_isolation(config.verifier.isolation)
    templates = _rank_templates(args.templates, config.data.spec)  # every name checked before any model loads
    out = args.out or Path("runs") / f"prompts-rank-{config.run.name}"
    tournament = run_tournament(config, templates, args.prompts, args.samples, args.gap_items, args.top_k)
    print(f"\n{summary_line(tournament)}\n")
    print(render_table(tournament))
    json_path, md_path = write_tournament(tournament, out)
    print(f"\nwrote {json_path} and {md_path}")


def _rank_templates(names: str, spec: str) -> list[PromptTemplate]:
    """The named teacher templates (a bad name, or one the data cannot fill, is an error), or
    every shipped teacher template the data can fill (the others skipped with a note)."""
    from selfopd.data import load_examples
    from selfopd.templating.lint import missing_fields, template_role
    from selfopd.templating.templates import list_templates, load_template

    sample = load_examples(spec)[:8]
    asked = [name.strip() for name in names.split(",") if name.strip()]
    templates = []
    for name in asked or [n for n in list_templates() if n.startswith("teacher/")]:
        template = load_template(name)
        if template_role(template) != "teacher":
            raise UserError(f"--templates: {name} is a student template, not a teacher template")
        missing = missing_fields(template, sample)
        if missing and asked:
            raise UserError(f"--templates: {name} is not applicable to {spec}: {missing[0]}")
        if missing:
            print(f"skip: {name}: not applicable to {spec}: {missing[0]}")
            continue
        templates.append(template)
    return templates


def _format_messages(messages: list[dict[str, str]]) -> str:
    return "\n\n".join(f"[{m['role']}]\n{m['content']}" for m in messages)


def _side_by_side(columns: list[tuple[str, str]]) -> str:
    width = max(30, (shutil.get_terminal_size((160, 40)).columns - 3) // len(columns))
    wrapped = []
    for title, text in columns:
        lines = [title, "=" * min(width, len(title))]
        for paragraph in text.splitlines():
            lines.extend(textwrap.wrap(paragraph, width) or [""])
        wrapped.append(lines)
    height = max(len(lines) for lines in wrapped)
    rows = []
    for i in range(height):
        cells = [(lines[i] if i < len(lines) else "").ljust(width) for lines in wrapped]
        rows.append(" | ".join(cells).rstrip())
    return "\n".join(rows)
