"""Every teacher of a run, opened once by `build_run`: `[teacher]` (named 'default') and each
`[teachers.NAME]` table become one `TeacherSide` each, carrying its own name, table, templates
(and demonstration fallback), token bridge, merged chat-template arguments and engine. Which
teacher scores an example is the data's rule (`selfopd.data.routing`).

A teacher opens in three stages, because each must fail before the next costly thing starts:
`plan_teachers` loads and renders its templates before any model loads; `check_teacher_tokens`
refuses (or bridges) another tokenizer and checks its prompts fit, before the run folder is claimed;
`open_teachers` opens the engines (one per distinct weights) and returns the sides by name."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from selfopd.config import DEFAULT_TEACHER, ConfigError, TeacherConfig, TrainConfig, teacher_key, teacher_tables
from selfopd.core.distributed import World
from selfopd.core.models import resolve_model
from selfopd.data.example import Example
from selfopd.data.mixture import by_task
from selfopd.data.routing import Router, routed_examples
from selfopd.data.split import trained_on
from selfopd.engines.base import Engine
from selfopd.engines.build import external_teacher_bridge, open_named_teachers
from selfopd.run.templates import load_run_template
from selfopd.templating.context_limits import check_context
from selfopd.templating.templates import (SAMPLE_DEMONSTRATION, PromptTemplate, check_student_template, load_template,
                                          render_student, render_teacher, uses_demonstration)
from selfopd.templating.token_bridge import TokenBridge
from selfopd.training.grading import student_kwargs
from selfopd.training.teacher import TeacherSide


@dataclass(frozen=True)
class TeacherPlan:
    """One teacher before its engine opens: what `open_teachers` makes its side of."""

    name: str  # 'default' ([teacher]) or a [teachers.NAME] table's NAME
    table: TeacherConfig
    template: PromptTemplate
    demonstration_fallback: PromptTemplate | None  # set iff the template uses `demonstration`
    examples: list[Example]  # the training examples routed to it
    chat_kwargs: Mapping[str, Any]  # its chat-template arguments, merged over the student's, once
    bridge: TokenBridge | None = None  # set by `check_teacher_tokens` (teacher.tokenizer = 'own')


def plan_teachers(config: TrainConfig, run_dir: Path, student_template: PromptTemplate, route: Router,
                  train_examples: Sequence[Example], eval_examples: Sequence[Example]) -> dict[str, TeacherPlan]:
    """Every teacher's table and templates ('default' first), rendered once on the first item of each task
    routed to it; an external teacher that `selfopd sft` trained on a held-out prompt is refused."""
    routed = routed_examples(train_examples, route)
    plans = {}
    for name, table in teacher_tables(config).items():
        template = load_run_template(run_dir, table.template)
        plan = TeacherPlan(name, table, template, demonstration_fallback(name, table, template, run_dir), routed[name],
                           table.template_kwargs(student_kwargs(config)))
        for first in by_task(plan.examples).values():  # each task's first item: a mixture's template branches
            check_templates_render(student_template, plan.template, first[0], plan.demonstration_fallback)
        if table.kind == "external":
            check_external_teacher_split(name, table, eval_examples)
        plans[name] = plan
    return plans


def check_teacher_tokens(config: TrainConfig, plans: Mapping[str, TeacherPlan], model: Any, tokenizer: Any,
                         student_template: PromptTemplate, eval_items: Sequence[Example]) -> dict[str, TeacherPlan]:
    """The plans with their token bridges: an external teacher's other tokenizer refused (or, with
    teacher.tokenizer = 'own', bridged); then each teacher's prompts, of the examples routed to it,
    checked against the context limits."""
    plans = {name: dataclasses.replace(plan, bridge=external_teacher_bridge(config, tokenizer, name))
             if plan.table.kind == "external" else plan for name, plan in plans.items()}
    for plan in plans.values():
        if plan.examples:  # each teacher's prompts, of the examples routed to it (all of them: [teacher] alone)
            check_context(config, model.config, teacher_model_config(config, model.config, plan.table), tokenizer,
                          student_template, plan.template, plan.demonstration_fallback, plan.examples, eval_items,
                          teacher_tokenizer=plan.bridge.teacher if plan.bridge is not None else None,
                          teacher_kwargs=plan.chat_kwargs)
    return plans


def open_teachers(config: TrainConfig, plans: Mapping[str, TeacherPlan], model: Any, tokenizer: Any,
                  student: Engine, default: Engine, world: World) -> dict[str, TeacherSide]:
    """Every teacher's side by name, 'default' first: `default` ([teacher]'s engine, from
    `open_training_engines`) and the [teachers.NAME] engines (`open_named_teachers`: one per weights)."""
    engines = {DEFAULT_TEACHER: default,
               **(open_named_teachers(config, model, tokenizer, student, default, world) if config.teachers else {})}
    per_micro = config.optim.micro_batch_prompts * config.rollout.samples_per_prompt
    temperature = config.rollout.temperature or 1.0  # the trained policy's (`Run.temperature`)
    return {name: TeacherSide(config, tokenizer, engines[name], plan.template, plan.demonstration_fallback, per_micro,
                              temperature, name, plan.table, plan.chat_kwargs, plan.bridge)
            for name, plan in plans.items()}


def demonstration_fallback(name: str, table: TeacherConfig, teacher: PromptTemplate,
                           run_dir: Path | None = None) -> PromptTemplate | None:
    """The template for rollouts without a sibling demonstration, when teacher `name`'s template uses one
    (its `table`'s demonstration_fallback); it must not use `demonstration` itself."""
    if not uses_demonstration(teacher):
        return None
    fallback = (load_run_template(run_dir, table.demonstration_fallback) if run_dir is not None
                else load_template(table.demonstration_fallback))
    if uses_demonstration(fallback):
        raise ConfigError(f"{teacher_key(name)}.demonstration_fallback", f"{fallback.name!r} uses 'demonstration' "
                          "itself; the fallback scores rollouts that have none (e.g. teacher/empty)")
    return fallback


def check_templates_render(student: PromptTemplate, teacher: PromptTemplate, example: Example,
                           fallback: PromptTemplate | None = None) -> None:
    """Render the templates once, as a step does (a teacher that uses `demonstration` with a
    sample one, and its fallback), so that an undefined variable or a refused operation
    fails before any model loads rather than at the first step."""
    check_student_template(student)
    student_messages = render_student(student, example)
    render_teacher(teacher, example, student_messages, attempt="", feedback="",
                   demonstration=SAMPLE_DEMONSTRATION if uses_demonstration(teacher) else None)
    if fallback is not None:
        render_teacher(fallback, example, student_messages, attempt="", feedback="")


def teacher_model_config(config: TrainConfig, student_config: Any, table: TeacherConfig) -> Any:
    """A teacher's transformers config (`table`: its settings): the student's, or an external teacher's own."""
    if table.kind != "external":
        return student_config
    from transformers import AutoConfig

    from selfopd.core.models import from_pretrained

    return from_pretrained(AutoConfig, resolve_model(table.model, table.revision),
                           trust_remote_code=config.model.trust_remote_code)


def check_external_teacher_split(name: str, table: TeacherConfig, eval_examples: Sequence[Example]) -> None:
    """An external teacher (`name`, of settings `table`) made by `selfopd sft` must not have trained on this
    run's held-out prompts (it records what it trained on); other teachers cannot be checked."""
    from selfopd.core.models import teacher_trained_prompts

    trained = teacher_trained_prompts(resolve_model(table.model, table.revision))
    shared = trained_on(eval_examples, trained or ())
    if shared:
        raise ConfigError(f"{teacher_key(name)}.model", f"{table.model} was fine-tuned (selfopd sft) on {len(shared)} of this run's "
                          f"{len(eval_examples)} held-out prompts (e.g. {shared[0].prompt!r}): train the teacher with "
                          "this run's data, data.eval_size and data.split_seed")
