"""The teachers of a training run: `[teacher]` (named 'default') and any `[teachers.NAME]` tables,
each a `TeacherConfig`, and the rules several teachers must keep with each other and with the
rest of the config (`check_named_teachers`). Routing itself is `selfopd.data.routing`."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal, Mapping

from selfopd.config.compute import check_template_kwargs
from selfopd.config.loss import FULL_VOCABULARY
from selfopd.config.settings import Section, TableValue, fail, setting
from selfopd.config.revisions import revision_problem

if TYPE_CHECKING:
    from selfopd.config import TrainConfig

TeacherKind = Literal["self", "frozen", "ema", "external", "none"]
TeacherTokenizer = Literal["student", "own"]
DEFAULT_TEACHER = "default"  # the name of [teacher] among [teachers.NAME]
TEACHER_NAME = re.compile(r"[A-Za-z0-9_-]+")


@dataclass(frozen=True)
class TeacherConfig(Section):
    SECTION: ClassVar[str] = "teacher"
    kind: TeacherKind = setting(
        "self",
        "Who scores the rollouts: 'self' is the current student given privileged information, "
        "'frozen' a copy of the initial student, 'ema' an exponential moving average of the student's weights "
        "(teacher.ema_rate), 'external' the model named by teacher.model, 'none' nobody: GRPO alone on the verifier "
        "reward (loss.lambda_opd = 0), with no teacher forward and no opd/ metrics (saved rollouts' teacher_logprobs "
        "are then the sampler's).",
    )
    model: str = setting("", "The external teacher (packaged name, folder or hub id); set iff kind = 'external'.")
    revision: str = setting(
        "", "Hub revision of teacher.model when it is a hub id (a branch, tag or commit hash; '' = the hub's default "
        "branch): its one download fetches that revision and every load of the teacher reads that snapshot. A "
        "teacher of the student's weights follows model.revision.")
    tokenizer: TeacherTokenizer = setting(
        "student", "kind = 'external': 'student' scores the student's exact token ids, and refuses a teacher whose "
        "tokenizer reads them differently; 'own' prompts the teacher through its own chat template and scores the "
        "completion's text as its own tokens. Each teacher token's logprob goes back to the student's tokens over "
        "aligned spans (the smallest stretches of text where both tokenizations have a boundary at the same "
        "character): a span's logprob is exactly the sum of its teacher tokens', and when a span holds several student "
        "tokens each gets an equal share, so that every span's, and the completion's, total is exact and no position "
        "is favoured. A completion whose text does not re-encode to itself under the teacher's tokenizer gets no "
        "teacher signal and is counted (teacher/unaligned_share). Sampled-token loss only (loss.divergence = "
        "'sampled'). docs/teachers.md")
    template: str = setting("teacher/reference_answer", "Prompt template that shows the teacher the privileged information.")
    chat_template_kwargs: dict[str, TableValue] = setting(
        {}, "Extra arguments of the teacher's chat template, merged over model.chat_template_kwargs: empty (the "
        "default) prompts the teacher exactly as the student's settings do; a name set here overrides the student's "
        "value for the teacher's prompts only (e.g. {enable_thinking = true}). A difference that changes where the "
        "assistant's text starts moves the point the teacher scores from: `selfopd prompts lint --config` warns. "
        "docs/templates.md")
    ema_rate: float = setting(
        0.05, "kind = 'ema': after every optimizer step taken, ema <- (1 - rate) * ema + rate * student, from the "
        "initial weights; 1 is the 'self' teacher, 0 the 'frozen' one. 0.05 (a half-life of ~14 steps) is SDPO's "
        "per-step rate; TRL's SDFT/SDPO teacher_update_rate defaults to 0.6 but is applied only every "
        "teacher_sync_steps = 512 steps, far longer than a selfopd run.", ge=0, le=1)
    skip_self_success: bool = setting(
        True, "Templates that use `demonstration` (teacher/sibling): a correct rollout is never its own "
        "demonstration; one whose group has no other correct sample gets none.")
    strip_reasoning: bool = setting(
        False, "Templates that use `demonstration`: show the sibling's answer without its reasoning blocks "
        "(verifier.reasoning_start ... reasoning_end), the text a user reads; SDPO's "
        "remove_thinking_from_demonstration. Off: the sibling's whole completion, reasoning included.")
    tasks: tuple[str, ...] = setting(
        (), "[teachers.NAME] only: the tasks of a mixed data.spec (kb:countries, rg:basic_arithmetic) routed to this "
        "teacher. An example goes to the teacher its data row names (a `teacher` column of a file), else to the teacher "
        "whose tasks hold its task, else to [teacher]. docs/teachers.md")
    demonstration_fallback: str = setting(
        "teacher/empty", "Templates that use `demonstration`: the template that scores a rollout with no correct "
        "sibling. 'teacher/empty' is the student's own prompt, so with a 'self' teacher such a rollout gets zero "
        "self-distillation signal (exactly, but for the rounding of a micro-batch padded to longer teacher prompts).")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kind == "external" and not self.model.strip():
            fail(self._key("model"), "required when teacher.kind = 'external'")
        if self.kind != "external" and self.model:
            fail(self._key("model"), f"only used when teacher.kind = 'external' (kind is {self.kind!r}); leave it empty")
        if self.revision and self.kind != "external":
            fail(self._key("revision"), f"only used when teacher.kind = 'external' (kind is {self.kind!r}): a teacher of "
                 "the student's weights follows model.revision")
        if (problem := revision_problem(self.model, self.revision)) is not None:
            fail(self._key("revision"), problem)
        if self.kind != "external" and self.tokenizer != "student":
            fail(self._key("tokenizer"), f"{self.tokenizer!r} needs teacher.kind = 'external' (kind is {self.kind!r}): "
                 "the student's own weights read its own tokens")
        self._non_empty("template")
        self._non_empty("demonstration_fallback")
        check_template_kwargs(self._key("chat_template_kwargs"), self.chat_template_kwargs)
        if len(set(self.tasks)) != len(self.tasks):
            fail(self._key("tasks"), f"names a task twice: {list(self.tasks)}")

    @property
    def follows_student(self) -> bool:
        """The teacher serves the student's current weights (`self`): synced after every step."""
        return self.kind == "self"

    @property
    def receives_weights(self) -> bool:
        """The teacher is sent weights after every step: the student's (`self`) or their average (`ema`)."""
        return self.kind in ("self", "ema")

    def weights(self, student: str) -> str:
        """The model whose weights the teacher runs: `teacher.model`, or the (initial) student."""
        return self.model if self.kind == "external" else student

    def weights_revision(self, student_revision: str) -> str:
        """The hub revision of `weights(...)`: `teacher.revision`, or model.revision for the student's."""
        return self.revision if self.kind == "external" else student_revision

    def template_kwargs(self, student: Mapping[str, TableValue]) -> dict[str, TableValue]:
        """The teacher's chat-template arguments: its own over the student's (`student`:
        model.chat_template_kwargs). The one place a teacher's arguments are made."""
        return {**student, **self.chat_template_kwargs}


def chat_kwargs(config: TrainConfig, table: TeacherConfig | None = None) -> tuple[dict[str, TableValue],
                                                                              dict[str, TableValue]]:
    """A run's (student's, teacher's) chat-template arguments: model.chat_template_kwargs, and the
    teacher's (`table`, default [teacher]) merged over them."""
    student = config.model.chat_template_kwargs
    return dict(student), (table or config.teacher).template_kwargs(student)


def teacher_key(name: str) -> str:
    """Where the settings of teacher `name` live, as errors name them: 'teacher' (for 'default'), or 'teachers.NAME'."""
    return "teacher" if name == DEFAULT_TEACHER else f"teachers.{name}"


def teacher_tables(config: TrainConfig) -> dict[str, TeacherConfig]:
    """Every teacher's settings by name: [teacher] as 'default' first, then the [teachers.NAME] tables."""
    return {DEFAULT_TEACHER: config.teacher, **config.teachers}


def check_named_teachers(config: TrainConfig) -> None:
    """What several teachers need of each other and of the rest of the config."""
    if config.teacher.tasks:
        fail("teacher.tasks", "[teacher] takes every example no other teacher is routed; name tasks in a "
             "[teachers.NAME] table")
    routed: dict[str, str] = {}
    for name, teacher in config.teachers.items():
        if not isinstance(teacher, TeacherConfig):
            fail(f"[teachers.{name}]", f"expected a TeacherConfig, got {type(teacher).__name__}")
        if name == DEFAULT_TEACHER or not TEACHER_NAME.fullmatch(name):
            fail(f"[teachers.{name}]", f"a teacher's name is letters, digits, '_' and '-', and not {DEFAULT_TEACHER!r} "
                 "(the name of [teacher])")
        for task in teacher.tasks:
            if task in routed:
                fail(f"teachers.{name}.tasks", f"task {task!r} is routed to teachers {routed[task]!r} and {name!r}")
            routed[task] = name
        if teacher.kind in ("ema", "none"):
            fail(f"teachers.{name}.kind", f"{teacher.kind!r} is for the [teacher] table (one per run)")
        if teacher.tokenizer == "own" and config.loss.divergence != "sampled":
            fail(f"teachers.{name}.tokenizer", f"'own' needs loss.divergence = 'sampled', got {config.loss.divergence!r}")
    if not config.teachers:
        return
    if not config.engine.teacher_in_process:
        fail("engine.kind", f"[teachers.*] score in process (engine.kind = 'local', or 'vllm' with "
             f"engine.teacher_engine = 'local'), got {config.engine.kind!r}")
    if config.loss.divergence in FULL_VOCABULARY:
        fail("loss.divergence", f"{config.loss.divergence!r} keeps one teacher's states per micro-batch; with "
             "[teachers.*] use 'sampled' or 'topk_reverse_kl'")
    if config.loss.opd_baseline == "same_engine":
        fail("loss.opd_baseline", "'same_engine' with [teachers.*] is not supported: each teacher would need the "
             "student's weights")


def pinned_revision(config: TrainConfig, spec: str | os.PathLike[str]) -> str:
    """The hub revision `config` pins for model `spec`: model.revision for the student, a teacher's
    teacher.revision for its model, else '' (the hub's default branch)."""
    if str(spec) == config.model.student:
        return config.model.revision
    return next((table.revision for table in (config.teacher, *config.teachers.values()) if table.model == str(spec)), "")
