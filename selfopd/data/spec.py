"""What a data spec string says: `DataSpec` (source, name, options), the presets of known Hub
datasets, and `DataError`. The grammar is in `selfopd.data`."""


from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

from selfopd.config.checks import MAX_SEED  # a data seed takes what run.seed takes
from selfopd.config.environment_target import parse_environment_target



class DataError(ValueError):
    """A data source, spec or row that cannot become Examples; the message names where."""


# --------------------------------------------------------------------------- presets


def _strip_dapo_instructions(text: str) -> str:
    """DAPO prompts wrap the problem in answer-format instructions; selfopd's templates add
    their own, so keep only the problem."""
    head = "Solve the following math problem step by step."
    if text.startswith(head) and "\n\n" in text:
        text = text.split("\n\n", 1)[1]
    return text.split('\n\nRemember to put your answer on its own line after "Answer:"', 1)[0].strip()


@dataclass(frozen=True)
class Preset:
    """Column mapping and loading defaults for a known dataset layout."""

    prompt: str
    answer: str
    id: str | None = None
    solution: str | None = None
    hints: str | None = None
    config: str | None = None  # Hub config name
    split: str = "train"  # Hub split used when the spec names none
    answer_sep: str | None = None
    clean_prompt: Callable[[str], str] | None = None
    code: str | None = None  # a code layout of CODE_LAYOUTS: the rows carry tests (selfopd.data.code_sources)


PRESETS: dict[str, Preset] = {
    # answer column is "<worked solution>\n#### <final answer>"
    "openai/gsm8k": Preset(prompt="question", answer="answer", config="main", answer_sep="####"),
    # only a test split; unique_id looks like "test/precalculus/807.json"
    "HuggingFaceH4/MATH-500": Preset(
        prompt="problem", answer="answer", solution="solution", id="unique_id", split="test"
    ),
    # prompt is a one-message chat list with DAPO's format instructions; label is the answer
    "zhuzilin/dapo-math-17k": Preset(
        prompt="prompt", answer="label", clean_prompt=_strip_dapo_instructions
    ),
    # OPSD's training set (github.com/siyan-zhao/OPSD, opsd_train.py): OpenThoughts math problems with
    # their solutions, the privileged text its teacher reads; the answer is the solution's last \boxed{}
    "siyanzhao/Openthoughts_math_30k_opsd": Preset(prompt="problem", answer="boxed:solution", solution="solution"),
    # code tasks (selfopd.data.code_sources): MBPP's text, reference code and `assert f(x) == y` tests; LiveCodeBench's
    # statement and public / private stdin tests (no reference solution)
    "google-research-datasets/mbpp": Preset(prompt="text", answer="code", id="task_id", config="full", split="test",
                                            code="mbpp"),
    "livecodebench/code_generation_lite": Preset(prompt="question_content", answer="", id="question_id", split="test",
                                                 code="lcb"),
}

# --------------------------------------------------------------------------- the spec

SOURCES = ("rg", "kb", "champ", "hf", "file", "humaneval", "codegen", "env")
NAMELESS = ("champ", "humaneval", "codegen")  # packaged or generated sets: the spec is the bare source
CODE_LAYOUTS = ("mbpp", "lcb")  # tables whose rows carry code tests (selfopd.data.code_sources)
CODEGEN_LEVELS = (1, 2, 3)  # the procedural function-writing task's difficulty (selfopd.data.codegen)
BOXED = "boxed:"  # answer=boxed:COLUMN: the answer is the last \boxed{} of that column
TEACHER_COLUMN = "teacher"  # a table's column that names each row's teacher (selfopd.data.routing)
FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
_COLUMN_KEYS = {"id": "id_col", "prompt": "prompt_col", "answer": "answer_col",
                "solution": "solution_col", "hints": "hints_col"}  # spec key -> field
_TABLE = {"id_col", "prompt_col", "answer_col", "solution_col", "hints_col",
          "answer_sep", "preset", "limit", "unanswered", "code"}
_APPLIES = {  # which DataSpec fields each source reads
    "hf": _TABLE | {"config", "split", "revision", "distinct"},
    "file": _TABLE | {"distinct"},
    "rg": {"seed", "size", "task_config", "distinct"},
    "kb": {"seed", "entities", "unseen", "part", "sheet", "distinct"},
    "champ": {"concepts", "limit", "distinct"},
    "humaneval": {"limit", "distinct"},
    "codegen": {"seed", "size", "level", "distinct"},
    "env": {"seed", "size", "distinct"},  # an environment's opening observations, one per seed
}
PROCEDURAL = ("rg", "codegen")  # sources that generate items, and repeat prompts unless told not to
# The most items a procedural source generates: reasoning-gym draws 0.1-0.3 ms an item on one CPU core
# (a deduplicated draw up to 50 per item), so 10^5 items take 10-30 s and 10^8 would take hours.
MAX_SIZE = 100_000


@dataclass(frozen=True)
class DataSpec:
    """Where examples come from. `parse_data_spec` builds one from a spec string; fields
    that do not apply to `source` must keep their defaults (checked here)."""

    source: Literal["rg", "kb", "champ", "hf", "file", "humaneval", "codegen", "env"]
    name: str = ""  # rg task, kb task, Hub dataset name, or file path; empty for champ, humaneval, codegen
    # table sources (hf, file): which column feeds which Example field (None: preset/default)
    id_col: str | None = None
    prompt_col: str | None = None
    answer_col: str | None = None
    solution_col: str | None = None
    hints_col: str | None = None  # a list-of-strings column or a single-string column
    answer_sep: str | None = None  # answer = text after the last separator, solution = before
    preset: str | None = None  # key of PRESETS; hf picks one by dataset name when unset
    config: str | None = None  # hf: config name (None: the preset's, else the default one)
    split: str | None = None  # hf: split (None: the preset's, else "train")
    revision: str | None = None  # hf: the dataset's revision (branch, tag or commit; None: the default branch)
    code: str | None = None  # hf, file: the rows' code-test layout, one of CODE_LAYOUTS (None: the preset's, else none)
    # reasoning-gym
    seed: int = 0  # generator seed: the same seed gives the same items in any process
    size: int = 500  # number of items to generate
    task_config: dict[str, Any] = field(default_factory=dict)  # generator config kwargs
    # kb (selfopd.data.knowledge): trained and unseen entities, which part, whose fact sheet
    entities: int = 24
    unseen: int = 8
    part: str = "study"
    sheet: str = "own"
    # champ
    concepts: bool = False  # prepend the problem's concepts to its hints
    # codegen: difficulty, one of CODEGEN_LEVELS (1: one operation on a number, string or list), or a
    # mixture "2+3" (item i at the (i mod k)-th level named)
    level: str = "1"
    @property
    def levels(self) -> tuple[int, ...]:
        """codegen: the levels of a mixture in order (one level: a tuple of one)."""
        return tuple(int(part) for part in str(self.level).split("+"))

    # all but rg (use size there)
    limit: int | None = None  # keep the first `limit` examples
    unanswered: Literal["refuse", "drop"] = "refuse"  # tables: a row with no answer stops the load, or is left out
    # all: keep each prompt once (None: yes for procedural sources, no otherwise)
    distinct: bool | None = None

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise DataError(f"unknown source {self.source!r}; allowed: {', '.join(SOURCES)}")
        if self.source in NAMELESS and self.name:
            raise DataError(f"source {self.source!r} takes no name, got {self.name!r}")
        if self.source not in NAMELESS and not self.name:
            raise DataError(f"source {self.source!r} needs a name")
        for f in dataclasses.fields(self):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            if f.name not in ("source", "name") and f.name not in _APPLIES[self.source] \
                    and getattr(self, f.name) != default:
                raise DataError(f"{self.label}: option {_spec_key(f.name)!r} does not apply to "
                                f"source {self.source!r}; allowed: {', '.join(_allowed_keys(self.source))}")
        if {"seed", "size"} & set(self.task_config):
            raise DataError(f"{self.label}: give seed and size as DataSpec fields, not in task_config")
        if not 0 < self.size <= MAX_SIZE:
            raise DataError(f"{self.label}: size must be in [1, {MAX_SIZE}] (the most items a generator is asked for: "
                            f"10^5 take 10-30 s to generate, more would hang the run), got {self.size}")
        if not 0 <= self.seed <= MAX_SEED:
            raise DataError(f"{self.label}: seed must be in [0, {MAX_SEED}], got {self.seed}")
        if self.limit is not None and self.limit < 0:
            raise DataError(f"{self.label}: limit must be >= 0, got {self.limit}")
        if self.preset is not None and self.preset not in PRESETS:
            raise DataError(f"{self.label}: unknown preset {self.preset!r}; "
                            f"allowed: {', '.join(PRESETS)}")
        if self.answer_col is not None and self.answer_col.startswith(BOXED):
            if not self.answer_col[len(BOXED):]:
                raise DataError(f"{self.label}: answer={self.answer_col} names no column; write answer=boxed:COLUMN")
            if self.answer_sep is not None:
                raise DataError(f"{self.label}: answer={self.answer_col} and answer_sep both say where the answer "
                                "is; give one")
        if self.unanswered not in ("refuse", "drop"):
            raise DataError(f"{self.label}: unanswered must be 'refuse' or 'drop', got {self.unanswered!r}")
        if self.code is not None and self.code not in CODE_LAYOUTS:
            raise DataError(f"{self.label}: unknown code layout {self.code!r}; allowed: {', '.join(CODE_LAYOUTS)}")
        if not all(part.strip().isdigit() and int(part) in CODEGEN_LEVELS for part in str(self.level).split("+")):
            raise DataError(f"{self.label}: level must be one of {', '.join(map(str, CODEGEN_LEVELS))} or a mixture "
                            f"such as 2+3, got {self.level!r}")
        if self.source == "file" and Path(self.name).suffix.lower() not in FILE_BUILDERS:
            raise DataError(f"{self.name}: unknown file type; allowed: {', '.join(FILE_BUILDERS)}")
        if self.source == "env":
            try:
                parse_environment_target(self.name)
            except ValueError as error:
                raise DataError(f"{self.label}: {error}") from None

    @property
    def dedup(self) -> bool:
        """Whether each prompt is kept once: `distinct`, by default for procedural sources."""
        return self.source in PROCEDURAL if self.distinct is None else self.distinct

    @property
    def label(self) -> str:
        """How errors and meta name this source."""
        if self.source == "file" or self.source in NAMELESS:
            return self.name or self.source
        return f"{self.source}:{self.name}"

    def __str__(self) -> str:
        """The spec string; `parse_data_spec(str(spec)) == spec` when no value holds & or =."""
        options = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in ("source", "name", "task_config") or value == f.default:
                continue
            options[_spec_key(f.name)] = value
        options.update(self.task_config)
        text = "&".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}"
                        for k, v in options.items())
        return self.label + (f"?{text}" if text else "")


def check_generated_total(specs: list[DataSpec], text: str) -> None:
    """A mixture's procedural parts ask for at most MAX_SIZE items in all, as one part may."""
    total = sum(spec.size for spec in specs if spec.source in PROCEDURAL)
    if total > MAX_SIZE:
        raise DataError(f"{text[:200]}: its parts ask for {total} generated items in all, past {MAX_SIZE}, the most "
                        "selfopd generates for one data spec")


def _spec_key(field_name: str) -> str:
    return next((k for k, v in _COLUMN_KEYS.items() if v == field_name), field_name)


def _allowed_keys(source: str) -> list[str]:
    keys = [_spec_key(n) for n in sorted(_APPLIES[source]) if n != "task_config"]
    return keys + (["<generator option>"] if source == "rg" else [])


_FIELD_TYPES = {"seed": int, "size": int, "limit": int, "concepts": bool, "distinct": bool, "entities": int,
                "unseen": int}  # others are str


def _parse_value(text: str, kind: type | None) -> Any:
    """Read one option value: as `kind` when known, else the first of bool/int/float/str."""
    if kind is str:
        return text
    if kind in (bool, None) and text.lower() in ("true", "false"):
        return text.lower() == "true"
    if kind in (int, None):
        try:
            return int(text)
        except ValueError:
            pass
    if kind is None:
        try:
            return float(text)
        except ValueError:
            return text
    raise DataError(f"expected {kind.__name__}, got {text!r}")


def parse_data_spec(text: str) -> DataSpec:
    """Parse a spec string (grammar in the module docstring) into a DataSpec."""
    head, _, query = text.strip().partition("?")
    prefix = re.match(r"^([A-Za-z][A-Za-z0-9_+.-]*):", head)  # a URL-like scheme
    if head in NAMELESS:
        source, name = head, ""
    elif prefix and prefix.group(1) in ("rg", "kb", "hf", "file", "env"):
        source, name = prefix.group(1), head[prefix.end():]
    elif prefix:
        raise DataError(f"unknown data source {prefix.group(1) + ':'!r} in {text!r}; allowed: "
                        f"rg:TASK, kb:TASK, champ, hf:NAME, humaneval, codegen, env:ENVIRONMENT, or a path to a {'/'.join(FILE_BUILDERS)} file")
    elif Path(head).suffix.lower() in FILE_BUILDERS:
        source, name = "file", head
    else:
        raise DataError(f"unknown data source {head!r}; allowed: rg:TASK, kb:TASK, champ, hf:NAME, humaneval, codegen, env:ENVIRONMENT, "
                        f"or a path to a {'/'.join(FILE_BUILDERS)} file")
    if source not in NAMELESS and not name:
        raise DataError(f"{text!r}: source {source + ':'!r} needs a name")

    kwargs: dict[str, Any] = {}
    task_config: dict[str, Any] = {}
    allowed = _APPLIES[source]
    for item in filter(None, query.split("&")):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise DataError(f"{text!r}: option {item!r} is not KEY=VALUE")
        field_name = _COLUMN_KEYS.get(key, key)
        if field_name in allowed and field_name != "task_config":
            try:
                kwargs[field_name] = _parse_value(value, _FIELD_TYPES.get(field_name, str))
            except DataError as e:
                raise DataError(f"{text!r}: option {key!r}: {e}") from None
        elif source == "rg":
            task_config[key] = _parse_value(value, None)  # checked against the generator on load
        else:
            raise DataError(f"{text!r}: unknown option {key!r} for source {source!r}; "
                            f"allowed: {', '.join(_allowed_keys(source))}")
    if task_config:
        kwargs["task_config"] = task_config
    return DataSpec(source=source, name=name, **kwargs)
