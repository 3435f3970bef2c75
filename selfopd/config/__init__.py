"""The one typed config of `selfopd train CONFIG.toml [--set section.key=value ...]`.

Every setting of a training run lives here, once (the `[model]` and `[engine]` sections in
`selfopd.config.compute`, re-exported): a TOML file names sections and keys of
these dataclasses, `--set` overrides are parsed against the same fields, and the run
folder gets `config_to_toml(config)` back, which loads to an equal config. Defaults exist
only in the field definitions below; code that reads a config never supplies its own.

Every field carries its help text (`metadata["help"]`), which `config_to_toml` writes as a
comment above the key. Types are checked when a section is built (an int is accepted for a
float, a bool never for a number) and ranges in each `__post_init__`; rules that tie two
sections together sit in `TrainConfig.__post_init__`. Every error is a `ConfigError`
naming the key as `section.key`, prefixed by the file or the `--set` it came from:

    demo.toml: loss.normalisation: must be one of 'token', 'sequence', got 'tokens'
"""

from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, Sequence

from selfopd.config import settings
from selfopd.config.auto import check_lora_dtype
from selfopd.config.compute import server_key
from selfopd.config.environment_target import check_environment, environment_data_problem
from selfopd.config.compute import (  # noqa: F401  (sections of TrainConfig, public here too)
    VLLM_KINDS,
    AttnImplementation,
    DType,
    EngineConfig,
    EngineKind,
    ModelConfig,
    Switch,
    WeightSyncKind,
)
from selfopd.config.loss import FULL_VOCABULARY, Divergence, LossConfig, Normalisation  # noqa: F401  (public here too)
from selfopd.config.guard import GuardConfig  # noqa: F401  (a section of TrainConfig, public here too)
from selfopd.config.run import CheckpointFormat, RunConfig, Tracker, WandbMode  # noqa: F401  (public here too)
from selfopd.config.evaluation import EvalConfig  # noqa: F401  (a section of TrainConfig, public here too)
from selfopd.config.verifier import VerifierConfig  # noqa: F401  (a section of TrainConfig, public here too)
from selfopd.config.teachers import (  # noqa: F401  (a section of TrainConfig and its names, public here too)
    DEFAULT_TEACHER,
    TeacherConfig,
    TeacherKind,
    TeacherTokenizer,
    check_named_teachers,
    teacher_key,
    teacher_tables,
)
from selfopd.config.settings import (  # noqa: F401  (ConfigError and setting are this module's public names too)
    MAX_BATCH,
    MAX_ITEMS,
    MAX_SAMPLES,
    MAX_SEED,
    MAX_STEPS,
    MAX_TEMPERATURE,
    MAX_TOKENS,
    MAX_WEIGHT,
    ConfigError,
    Section,
    build_sections,
    check_folder_name,
    check_printable,
    fail,
    field_types,
    load_document,
    section_toml,
    setting,
)

Schedule = Literal["constant", "cosine", "linear"]
ToolName = Literal["calculator", "python"]  # rollout.tools: selfopd.episodes.tools.TOOLS
# The demo's task (experiments/demo/demo.toml, tested): the default data of every command, so that
# `selfopd eval` or `selfopd sft` without a config see the demo's split and its held-out prompts.
DEMO_DATA = ("rg:basic_arithmetic?min_terms=2&max_terms=2&min_digits=1&max_digits=2&operators=+&allow_negation=false"
             "&allow_parentheses=false&size=4000&seed=1")


@dataclass(frozen=True)
class DataConfig(Section):
    SECTION: ClassVar[str] = "data"
    spec: str = setting(
        DEMO_DATA, "Data spec (see selfopd.data): where the prompts, answers and privileged information come from.",
        guarded="it decides what data is generated, downloaded or read")
    student_template: str = setting("student/plain", "Prompt template the student sees.")
    eval_size: int = setting(200, "Held-out examples, never trained on, for the greedy eval (0: none held out, "
                             "every example trains; needs eval.data, a test set of its own).", ge=0, most=MAX_ITEMS)
    split_seed: int = setting(0, "Seed of the train / eval split.", ge=0, most=MAX_SEED)

    def __post_init__(self) -> None:
        super().__post_init__()
        self._non_empty("spec")
        self._non_empty("student_template")


@dataclass(frozen=True)
class RolloutConfig(Section):
    SECTION: ClassVar[str] = "rollout"
    prompts_per_step: int = setting(8, "Prompts sampled per optimizer step.", ge=1, most=MAX_BATCH)
    samples_per_prompt: int = setting(
        4, "Samples per prompt (n); a GRPO group is the n samples of one prompt.", ge=1, most=MAX_SAMPLES)
    max_tokens: int = setting(48, "Most completion tokens per sample.", ge=1, most=MAX_TOKENS)
    temperature: float = setting(
        1.0, "Sampling temperature (0: greedy). The trained policy is this tempered distribution: student and "
        "in-process teacher logprobs are taken at it, so a teacher equal to the student has advantage 0.",
        ge=0.0, most=MAX_TEMPERATURE)
    top_p: float = setting(1.0, "Nucleus sampling mass, in (0, 1] (1: off); below 1 needs loss.is_cap = 0.", gt=0, le=1)
    top_k: int = setting(0, "Top-k sampling: draw from the k most likely tokens only (0: off; OPSD: 20); above 0 needs "
                         "loss.is_cap = 0. The trainer's and the teacher's logprobs stay those of the whole tempered "
                         "distribution, as in OPSD.", ge=0, most=MAX_TOKENS)
    min_p: float = setting(0.0, "Min-p sampling: drop tokens below min_p x the top token's probability (0: off); above "
                           "0 needs loss.is_cap = 0.", ge=0, le=1)
    max_staleness: int = setting(
        0, "Sample ahead: k >= 1 samples step s + k's prompts with step s's weights while step s trains, so every "
        "trained rollout is exactly k optimizer steps old (the first k steps' rollouts: the initial weights). 0: "
        "the synchronous loop. Overlaps only with vLLM servers; elsewhere the same rollouts, one after another. "
        "docs/async.md", ge=0, most=1000)
    environment: str = setting(
        "none", "Episodes: 'none' samples one answer per rollout; 'retry_feedback' makes each rollout an episode in "
        "which a wrong answer gets the verifier's one-sentence feedback (never the reference) and another try, up to "
        "rollout.max_turns answers, the environment's tokens context for student and teacher and never trained; "
        "'tools' lets the student call rollout.tools in its model family's own tool format until it answers; "
        "'python:MODULE:NAME' (an OpenEnv Environment class, in process) or 'openenv:ws://HOST:PORT' (an OpenEnv "
        "server) runs that environment, with data.spec = 'env:' + this; 'trl:MODULE:NAME' (a TRL environment_factory "
        "class) makes its public methods the student's tools, its get_reward() the reward (docs/episodes.md).",
        guarded="'python:' and 'trl:' import and run code, 'openenv:' connects to a server")
    max_turns: int = setting(3, "Episodes: the most student turns per episode (rollout.max_tokens each).", ge=1, most=64)
    max_episode_tokens: int = setting(
        512, "Episodes: the most ids after the prompt, the student's and the environment's together; a reply past it "
        "is cut and ends the episode.", ge=1, most=MAX_TOKENS)
    tools: tuple[ToolName, ...] = setting(
        ("calculator",), "Episodes with rollout.environment = 'tools': the tools the student may call, their "
        "definitions in the student's and the teacher's prompts: 'calculator' (arithmetic, read with ast, never "
        "eval) and 'python' (a program run in the bubblewrap sandbox, its output back).")
    max_tool_calls: int = setting(
        4, "Episodes with rollout.environment = 'tools': the most tool calls run per episode; calls past it get one "
        "line saying so.", ge=1, most=1000)

    def __post_init__(self) -> None:
        super().__post_init__()
        try:
            check_environment(self.environment)
        except ValueError as error:
            fail(self._key("environment"), str(error))
        if len(set(self.tools)) != len(self.tools):
            fail(self._key("tools"), f"names a tool twice: {list(self.tools)}")
        if self.environment == "tools" and not self.tools:
            fail(self._key("tools"), "names no tool, and rollout.environment = 'tools' needs at least one")

    @property
    def in_flight(self) -> bool:
        """k >= 2: with vLLM servers, several sampling requests may run at once, across weight pushes
        (which freeze them instead of waiting: `selfopd.training.rollout_pipeline`)."""
        return self.max_staleness >= 2


@dataclass(frozen=True)
class OptimConfig(Section):
    SECTION: ClassVar[str] = "optim"
    lr: float = setting(1e-6, "Peak AdamW learning rate.", gt=0, most=1)
    weight_decay: float = setting(0.0, "AdamW decoupled weight decay.", ge=0.0, most=100)
    beta1: float = setting(0.9, "AdamW beta1.", ge=0, lt=1)
    beta2: float = setting(0.999, "AdamW beta2.", ge=0, lt=1)
    warmup_steps: int = setting(0, "Steps of linear warm-up to lr.", ge=0, most=MAX_STEPS)
    schedule: Schedule = setting("constant", "Learning-rate schedule after warm-up; cosine and linear decay to 0 at run.steps.")
    grad_clip: float = setting(1.0, "Max global gradient norm (0: no clipping).", ge=0.0, most=MAX_WEIGHT)
    micro_batch_prompts: int = setting(
        2, "Prompts per forward/backward (whole GRPO groups); gradients accumulate over a step.", ge=1, most=MAX_BATCH)
    max_nonfinite_steps: int = setting(
        3, "A step whose loss or gradient is NaN or inf is skipped (no update, logged as skipped); this many in a "
        "row stop the run, its last checkpoint intact.", ge=1, most=MAX_STEPS)


@dataclass(frozen=True)
class ProbeConfig(Section):
    SECTION: ClassVar[str] = "probe"
    tolerance: float = setting(
        3e-4, "Max |engine - trainer| logprob on the probe sequence after each weight sync. In-process it is 0; "
        "fp32 vLLM-cpu kernels alone are up to 9e-5 from float64 on the demo probe, a partial update is ~0.5.",
        gt=0, most=MAX_WEIGHT)
    bf16_tolerance: float = setting(
        0.25, "With model.dtype = 'bfloat16': max mean |engine - trainer| logprob over the probe's tokens. bf16 "
        "kernels differ token by token (SmolLM2 on CPU, fp32-master autocast vs bf16 weights: mean 0.05-0.10, max "
        "0.5 nats), so only gross failures (weights not loaded, a stale head) are caught, not one missed step.",
        gt=0, most=MAX_WEIGHT)


@dataclass(frozen=True)
class TrainConfig:
    """Everything `selfopd train` reads; one field per TOML section."""

    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    probe: ProbeConfig = field(default_factory=ProbeConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    verifier: VerifierConfig = field(default_factory=VerifierConfig)
    # [teachers.NAME] tables: more teachers beside [teacher] (which is named 'default'), by name.
    teachers: dict[str, TeacherConfig] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, cls in SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                fail(f"[{name}]", f"expected a {cls.__name__}, got {type(getattr(self, name)).__name__}")
        check_named_teachers(self)
        # Rules across sections.
        if self.rollout.prompts_per_step % self.optim.micro_batch_prompts:
            fail(
                "optim.micro_batch_prompts",
                f"must divide rollout.prompts_per_step ({self.rollout.prompts_per_step}), got {self.optim.micro_batch_prompts}",
            )
        if self.data.eval_size == 0 and not self.eval.data.strip():
            fail("data.eval_size", "0 holds nothing out of data.spec, so the in-run eval needs eval.data, a test set "
                 "of its own; set eval.data, or data.eval_size >= 1")
        if self.optim.warmup_steps > self.run.steps:
            fail("optim.warmup_steps", f"must be <= run.steps ({self.run.steps}), got {self.optim.warmup_steps}")
        if self.loss.divergence in FULL_VOCABULARY and not self.engine.teacher_in_process:
            fail("loss.divergence", f"{self.loss.divergence!r} needs the teacher's full distribution in process "
                  "(engine.kind = 'local', or 'vllm' with engine.teacher_engine = 'local'); with a vLLM teacher use "
                  "'sampled' or 'topk_reverse_kl'")
        if not self.engine.teacher_in_process and self.rollout.temperature != 1.0:
            fail("rollout.temperature", f"must be 1 with engine.kind = {self.engine.kind!r}, got {self.rollout.temperature}: vLLM "
                 "scores (prompt logprobs) from the raw logits only, so a vLLM teacher cannot score the tempered "
                 "distribution the student samples from; use engine.kind = 'local', or engine.teacher_engine = "
                 "'local' (vLLM samples at any temperature, the trainer scores)")
        if self.rollout.top_p < 1.0 and self.loss.is_cap:
            fail("loss.is_cap", f"must be 0 with rollout.top_p = {self.rollout.top_p} < 1: the sampler's logprobs are "
                 "over the renormalised nucleus, the trainer's over the whole tempered distribution, so their ratio "
                 "is the nucleus mass (below 1 on every token), not an importance weight")
        for name, value, filtered in (("top_k", self.rollout.top_k, self.rollout.top_k > 0),
                                      ("min_p", self.rollout.min_p, self.rollout.min_p > 0)):
            if filtered and self.loss.is_cap:
                fail("loss.is_cap", f"must be 0 with rollout.{name} = {value} > 0: the sampler's logprobs are over the "
                     f"renormalised tokens {name} keeps, the trainer's over the whole tempered distribution, so their "
                     "ratio is the kept mass (below 1 on every token), not an importance weight")
        if self.teacher.kind == "ema" and self.model.lora:
            fail("teacher.kind", "'ema' with model.lora_rank > 0 is not supported: use teacher.kind = 'frozen' or "
                 "'self' with LoRA, or model.lora_rank = 0 with 'ema'")
        if self.run.checkpoint_format == "sharded" and self.model.lora:
            fail("run.checkpoint_format", "'sharded' with model.lora_rank > 0 is not supported: a LoRA checkpoint "
                 "already holds the adapters alone (megabytes); use 'gathered'")
        if self.teacher.kind == "ema" and self.engine.kind == "vllm_colocate":
            fail("teacher.kind", "'ema' with engine.kind = 'vllm_colocate' is not supported: use engine.kind = "
                 "'local' or 'vllm'")
        check_lora_dtype(self.model, self.engine)  # LoRA with vLLM in bf16 (selfopd.config.auto: the dtype rules)
        if self.engine.kind == "vllm_colocate" and re.fullmatch(r"cuda:[1-9]\d*", self.model.device):
            fail("model.device", f"{self.model.device!r} with engine.kind = 'vllm_colocate': the in-process vLLM "
                 "always takes GPU 0 of what the process sees; run with CUDA_VISIBLE_DEVICES=N and model.device = "
                 "'cuda' instead")
        teacher_on_student = [url for url in self.engine.urls("teacher_url")
                              if server_key(url) in {server_key(other) for other in self.engine.urls("student_urls")}]
        if teacher_on_student and self.teacher.kind != "self":
            fail("engine.teacher_url", f"{teacher_on_student[0]} is also a student server, which serves the student's "
                 f"current weights; a {self.teacher.kind!r} teacher needs a server of its own (a 'self' teacher may "
                 "share one: it is sent the weights once)")
        if self.teacher.tokenizer == "own" and self.loss.divergence != "sampled":
            fail("loss.divergence", f"{self.loss.divergence!r} needs the teacher's distribution over the student's "
                 "vocabulary, which a teacher with teacher.tokenizer = 'own' does not have (its tokens cover other "
                 "stretches of text); use loss.divergence = 'sampled'")
        if self.rollout.environment != "none" and (self.teacher.tokenizer == "own" or any(
                table.tokenizer == "own" for table in self.teachers.values())):
            fail("rollout.environment", f"{self.rollout.environment!r} with a teacher of its own tokenizer is not "
                 "supported: its token bridge reads one answer's text, not an episode's turns; use "
                 "teacher.tokenizer = 'student'")
        if (problem := environment_data_problem(self.rollout.environment, self.data.spec)) is not None:
            fail(*problem)
        if self.eval.data and (problem := environment_data_problem(self.eval.episodes(self.rollout).environment,
                                                                   self.eval.data, "eval.data")) is not None:
            fail(*problem)
        if self.teacher.kind == "none":
            check_no_teacher(self)
        if self.loss.opd_baseline == "same_engine" and self.teacher.kind != "self":
            fail("loss.opd_baseline", f"'same_engine' takes the student's logprobs from the teacher's engine, which "
                 f"serves the student's weights only with teacher.kind = 'self' (got {self.teacher.kind!r})")
        if self.loss.lambda_rl > 0 and self.rollout.samples_per_prompt < 2 and self.loss.rl_advantage != "raw":
            fail(
                "rollout.samples_per_prompt",
                "must be >= 2 when loss.lambda_rl > 0: a GRPO group of one sample has advantage 0 (with "
                "loss.rl_advantage = 'raw', which has no group baseline, 1 is allowed)",
            )


# Tables of named sections ([teachers.NAME]): field of TrainConfig -> the class of each table.
KEYED_SECTIONS: dict[str, type[Section]] = {"teachers": TeacherConfig}
# Section name -> class, read off TrainConfig's fields: the one list of sections.
SECTIONS: dict[str, type[Section]] = {
    f.name: typing.get_type_hints(TrainConfig)[f.name] for f in dataclasses.fields(TrainConfig)
    if f.name not in KEYED_SECTIONS
}


def build_config(tables: dict[str, Any], resolve: bool = True) -> TrainConfig:
    """A TrainConfig from nested dicts as TOML gives them; missing sections and keys take defaults.
    `[teachers.NAME]` tables are TeacherConfigs whose errors name `teachers.NAME.key`. `resolve`:
    model.dtype = 'auto' made what it means on this machine (selfopd.config.auto)."""
    from selfopd.config.auto import Machine, resolve_auto

    tables = dict(tables)
    keyed = {section: settings.build_keyed(tables.pop(section, {}), section, cls)
             for section, cls in KEYED_SECTIONS.items()}
    config = TrainConfig(**build_sections(tables, SECTIONS), **keyed)
    return resolve_auto(config, Machine.here()) if resolve else config


def parse_overrides(overrides: Sequence[str]) -> dict[str, dict[str, Any]]:
    """`--set` strings parsed against the training sections (see `selfopd.config.settings.parse_overrides`)."""
    return settings.parse_overrides(overrides, SECTIONS, KEYED_SECTIONS)


def load_config(path: str | Path | None, overrides: Sequence[str] = (), resolve: bool = True) -> TrainConfig:
    """The config in the TOML file at `path` (None: all defaults) with `--set` overrides applied
    (`resolve`: and its 'auto' dtype resolved for this machine, see `build_config`).

    A `--set` wins over the file. Errors name the file, or the `--set` when the bad value
    came from one.
    """
    return load_document(path, overrides, SECTIONS, lambda tables: build_config(tables, resolve),
                         keyed=KEYED_SECTIONS)


def config_to_dict(config: TrainConfig) -> dict[str, dict[str, Any]]:
    """`{section: {key: value}}`, as in the TOML file (e.g. for logging the run's config);
    `teachers` only when there are any."""
    tables = dataclasses.asdict(config)
    if not tables["teachers"]:
        del tables["teachers"]
    return tables


def config_to_toml(config: TrainConfig) -> str:
    """The full config as TOML with each field's help as a comment; `load_config` of it gives `config`."""
    tables = ["\n".join(section_toml(name, getattr(config, name))) for name in SECTIONS]
    tables += ["\n".join(section_toml(f"teachers.{name}", teacher)) for name, teacher in config.teachers.items()]
    return "\n\n".join(tables) + "\n"


def flat_config(config: TrainConfig) -> dict[str, Any]:
    """`{"section.key": value}` of every field (to compare two configs key by key)."""
    return settings.flatten({**{name: getattr(config, name) for name in SECTIONS},
                             **{f"teachers.{name}": teacher for name, teacher in config.teachers.items()}})


def check_no_teacher(config: TrainConfig) -> None:
    """teacher.kind = 'none' (GRPO alone): nothing in the loss may need a teacher's logprobs."""
    loss = config.loss
    needs = [(key, why) for key, why in (
        ("loss.lambda_opd", loss.lambda_opd != 0), ("loss.rlsd_weight", loss.rlsd_weight != 0),
        ("loss.divergence", loss.divergence != "sampled"), ("loss.opd_baseline", loss.opd_baseline != "student"),
        ("engine.teacher_url", bool(config.engine.urls("teacher_url"))), ("[teachers.*]", bool(config.teachers)),
    ) if why]
    if needs:
        key = needs[0][0]
        fail(key, "asks for a teacher, and teacher.kind is 'none': GRPO alone needs loss.lambda_opd = 0, "
             "loss.rlsd_weight = 0, loss.divergence = 'sampled', loss.opd_baseline = 'student', no teacher server and "
             "no [teachers.*]; set those, or choose a teacher")
