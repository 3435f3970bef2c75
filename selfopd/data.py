"""Load task items from any source into `Example`s, and split them into train / eval.

One spec string names a data source everywhere (CLI, configs, logs):

    SPEC   := SOURCE [ "?" KEY "=" VALUE ( "&" KEY "=" VALUE )* ]
    SOURCE := "rg:" TASK       a reasoning-gym task, generated offline from a seed
            | "champ"          the CHAMP competition-math set (270 problems, solutions, hints)
            | "hf:" NAME       a Hugging Face Hub dataset (needs network or a filled HF cache)
            | PATH             a local .jsonl / .json / .parquet / .csv file ("file:PATH" also works)

    rg:chain_sum?min_terms=2&max_terms=3&size=500&seed=1
    champ?concepts=true
    hf:openai/gsm8k?split=test               (preset: config main, answer after "####")
    data/my.jsonl?prompt=question&answer=target&hints=tips&limit=100
    data/gsm8k_test.jsonl?preset=openai/gsm8k

Options, by source (each is a `DataSpec` field of the same name; `id`, `prompt`,
`answer`, `solution`, `hints` are the `*_col` fields):

    all       distinct     true: keep each prompt once (default for rg, false elsewhere)
    hf, file  id, prompt, answer, solution, hints   column names for the Example fields
                (defaults: prompt="prompt", answer="answer", no id / solution / hints column;
                 a preset supplies its own defaults, explicit options win)
              answer_sep   split the answer column at the last separator: the text after it is
                           the answer, the text before it the solution (gsm8k's "####")
              preset       a named mapping from PRESETS (hf: chosen by dataset name by default)
              limit        keep only the first N examples
    hf        config, split  the Hub config name and split (default: the preset's, else "train")
    rg        seed (default 0), size (default 500): the number of items, distinct prompts
              unless distinct=false (the generator is drawn from until it gives that many, and
              says so when its problem space holds fewer); any other key is passed to the
              task's generator config (e.g. min_terms); unknown keys fail with the allowed
              list (no limit: use size)
    champ     concepts=true  put the problem's concepts before its hints (most general first)
              limit

Values are read as bool (true/false), int, float or str, as the field's type says; generator
options (unknown types) are guessed in that order. `&` and `=` cannot appear inside values.

Small procedural tasks repeat prompts a lot (chain_sum with 2-3 one-digit terms: 1763
distinct prompts in 4000 items), and a repeated prompt is one observation, not several:
procedural sources are deduplicated by default. Fresh items for a procedural task come
from excluding known prompts (`load_examples(spec, exclude=...)`), never from another seed:
reasoning-gym's item i of seed s is item i - 1 of seed s + 1. Splitting into train and eval
is `selfopd.split`'s job.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Collection, Literal

from selfopd.example import Example, prompt_key


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
}

# --------------------------------------------------------------------------- the spec

SOURCES = ("rg", "champ", "hf", "file")
FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
_COLUMN_KEYS = {"id": "id_col", "prompt": "prompt_col", "answer": "answer_col",
                "solution": "solution_col", "hints": "hints_col"}  # spec key -> field
_TABLE = {"id_col", "prompt_col", "answer_col", "solution_col", "hints_col",
          "answer_sep", "preset", "limit"}
_APPLIES = {  # which DataSpec fields each source reads
    "hf": _TABLE | {"config", "split", "distinct"},
    "file": _TABLE | {"distinct"},
    "rg": {"seed", "size", "task_config", "distinct"},
    "champ": {"concepts", "limit", "distinct"},
}
PROCEDURAL = ("rg",)  # sources that generate items, and repeat prompts unless told not to


@dataclass(frozen=True)
class DataSpec:
    """Where examples come from. `parse_data_spec` builds one from a spec string; fields
    that do not apply to `source` must keep their defaults (checked here)."""

    source: Literal["rg", "champ", "hf", "file"]
    name: str = ""  # rg task, Hub dataset name, or file path; empty for champ
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
    # reasoning-gym
    seed: int = 0  # generator seed: the same seed gives the same items in any process
    size: int = 500  # number of items to generate
    task_config: dict[str, Any] = field(default_factory=dict)  # generator config kwargs
    # champ
    concepts: bool = False  # prepend the problem's concepts to its hints
    # all but rg (use size there)
    limit: int | None = None  # keep the first `limit` examples
    # all: keep each prompt once (None: yes for procedural sources, no otherwise)
    distinct: bool | None = None

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise DataError(f"unknown source {self.source!r}; allowed: {', '.join(SOURCES)}")
        if self.source == "champ" and self.name:
            raise DataError(f"source 'champ' takes no name, got {self.name!r}")
        if self.source != "champ" and not self.name:
            raise DataError(f"source {self.source!r} needs a name")
        for f in dataclasses.fields(self):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            if f.name not in ("source", "name") and f.name not in _APPLIES[self.source] \
                    and getattr(self, f.name) != default:
                raise DataError(f"{self.label}: option {_spec_key(f.name)!r} does not apply to "
                                f"source {self.source!r}; allowed: {', '.join(_allowed_keys(self.source))}")
        if {"seed", "size"} & set(self.task_config):
            raise DataError(f"{self.label}: give seed and size as DataSpec fields, not in task_config")
        if self.size <= 0:
            raise DataError(f"{self.label}: size must be positive, got {self.size}")
        if self.limit is not None and self.limit < 0:
            raise DataError(f"{self.label}: limit must be >= 0, got {self.limit}")
        if self.preset is not None and self.preset not in PRESETS:
            raise DataError(f"{self.label}: unknown preset {self.preset!r}; "
                            f"allowed: {', '.join(PRESETS)}")
        if self.source == "file" and Path(self.name).suffix.lower() not in FILE_BUILDERS:
            raise DataError(f"{self.name}: unknown file type; allowed: {', '.join(FILE_BUILDERS)}")

    @property
    def dedup(self) -> bool:
        """Whether each prompt is kept once: `distinct`, by default for procedural sources."""
        return self.source in PROCEDURAL if self.distinct is None else self.distinct

    @property
    def label(self) -> str:
        """How errors and meta name this source."""
        if self.source in ("file", "champ"):
            return self.name or "champ"
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


def _spec_key(field_name: str) -> str:
    return next((k for k, v in _COLUMN_KEYS.items() if v == field_name), field_name)


def _allowed_keys(source: str) -> list[str]:
    keys = [_spec_key(n) for n in sorted(_APPLIES[source]) if n != "task_config"]
    return keys + (["<generator option>"] if source == "rg" else [])


_FIELD_TYPES = {"seed": int, "size": int, "limit": int, "concepts": bool, "distinct": bool}  # others are str


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
    if head == "champ":
        source, name = "champ", ""
    elif prefix and prefix.group(1) in ("rg", "hf", "file"):
        source, name = prefix.group(1), head[prefix.end():]
    elif prefix:
        raise DataError(f"unknown data source {prefix.group(1) + ':'!r} in {text!r}; allowed: "
                        f"rg:TASK, champ, hf:NAME, or a path to a {'/'.join(FILE_BUILDERS)} file")
    elif Path(head).suffix.lower() in FILE_BUILDERS:
        source, name = "file", head
    else:
        raise DataError(f"unknown data source {head!r}; allowed: rg:TASK, champ, hf:NAME, "
                        f"or a path to a {'/'.join(FILE_BUILDERS)} file")
    if source != "champ" and not name:
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


# --------------------------------------------------------------------------- loading

# Distinct procedural prompts: draw at most this many items per prompt asked for, and stop
# early once this many draws in a row (or as many as found so far) brought nothing new.
MAX_DRAWS_PER_ITEM = 50
MIN_STALL_DRAWS = 2000


def load_examples(spec: DataSpec | str, exclude: Collection[str] = ()) -> list[Example]:
    """Load every example a spec names. Ids are unique (checked); order is the source's.

    `exclude` holds prompt keys (`selfopd.example.prompt_key`) that must not appear: fresh
    items for a procedural task are drawn past them, other sources just drop those rows.
    With `distinct` (the default for procedural sources) each prompt is kept once."""
    spec = parse_data_spec(spec) if isinstance(spec, str) else spec
    excluded = frozenset(exclude)
    if spec.source == "rg":
        return _load_reasoning_gym(spec, excluded)
    loader = {"hf": _load_hub, "file": _load_file, "champ": _load_champ}
    examples = loader[spec.source](spec)
    check_unique_ids(examples, spec.label)
    kept, seen = [], set(excluded)
    for example in examples:
        key = prompt_key(example.prompt)
        if key in seen:
            continue
        if spec.dedup:
            seen.add(key)
        kept.append(example)
    return kept if spec.limit is None else kept[: spec.limit]


def check_unique_ids(examples: list[Example], label: str) -> None:
    first: dict[str, int] = {}
    for i, ex in enumerate(examples):
        if ex.id in first:
            raise DataError(f"{label}: duplicate id {ex.id!r} at rows {first[ex.id]} and {i}")
        first[ex.id] = i


def _load_hub(spec: DataSpec) -> list[Example]:
    """A Hub dataset through `datasets`; offline this fails, and the error says what to do."""
    import datasets

    preset = PRESETS.get(spec.preset or spec.name)
    config = spec.config or (preset.config if preset else None)
    split = spec.split or (preset.split if preset else "train")
    example = f"preset={spec.name}" if preset else "prompt=COLUMN&answer=COLUMN"
    try:
        table = datasets.load_dataset(spec.name, config, split=split)
    except Exception as e:  # network, missing dataset, bad config/split: all end here
        raise DataError(
            f"could not load Hub dataset {spec.name!r} (config {config!r}, split {split!r}): "
            f"{type(e).__name__}: {e}. Hub datasets need network access (or a copy in the local "
            f"Hugging Face cache); without network, download the data elsewhere and pass a local "
            f".jsonl/.parquet/.csv file instead, e.g. 'data/file.jsonl?{example}'"
        ) from e
    return _rows_to_examples(table, spec, preset, id_prefix=f"{spec.name}/{split}")


def _load_file(spec: DataSpec) -> list[Example]:
    """A local file through `datasets`' json/parquet/csv builders (all rows land in 'train')."""
    import datasets

    path = Path(spec.name)
    if not path.is_file():
        raise DataError(f"{spec.name}: file not found")
    builder = FILE_BUILDERS[path.suffix.lower()]
    table = datasets.load_dataset(builder, data_files=str(path), split="train")
    return _rows_to_examples(table, spec, PRESETS.get(spec.preset or ""), id_prefix=path.stem)


def _rows_to_examples(table, spec: DataSpec, preset: Preset | None, id_prefix: str) -> list[Example]:
    """Map table rows to Examples by the spec's columns (explicit option > preset > default)."""
    p = preset or Preset(prompt="prompt", answer="answer")  # the defaults without a preset
    options = {"id": spec.id_col, "prompt": spec.prompt_col, "answer": spec.answer_col,
               "solution": spec.solution_col, "hints": spec.hints_col}
    cols = {name: getattr(p, name) if col is None else col for name, col in options.items()}
    answer_sep = spec.answer_sep or p.answer_sep
    label = spec.label
    for name, column in cols.items():
        if column is not None and column not in table.column_names:
            raise DataError(f"{label} row 0: missing field {name!r} (mapped from column "
                            f"{column!r}); the columns are: {', '.join(table.column_names)}")
    used = {c for c in cols.values() if c is not None}

    examples = []
    for i, row in enumerate(table):
        where = f"{label} row {i}"
        prompt = _cell(row, cols, "prompt", where, required=True)
        answer = _cell(row, cols, "answer", where, required=True)
        solution = _cell(row, cols, "solution", where, required=False)
        if answer_sep is not None:
            if answer_sep not in answer:
                raise DataError(f"{where}: field 'answer' (column {cols['answer']!r}) "
                                f"has no separator {answer_sep!r}")
            before, after = answer.rsplit(answer_sep, 1)
            answer, solution = after.strip(), solution or before.strip() or None
            if not answer:
                raise DataError(f"{where}: empty field 'answer' after separator {answer_sep!r}")
        examples.append(Example(
            id=_cell(row, cols, "id", where, required=True) if cols["id"] else f"{id_prefix}/{i}",
            prompt=p.clean_prompt(prompt) if p.clean_prompt else prompt,
            answer=answer,
            solution=solution,
            hints=_as_hints(row[cols["hints"]] if cols["hints"] else None),
            meta={"source": label, "row": i, "extra": {k: v for k, v in row.items() if k not in used}},
        ))
    return examples


def _cell(row: dict, cols: dict[str, str | None], name: str, where: str, required: bool) -> str | None:
    """The text for Example field `name`; a required field must be present and non-blank."""
    column = cols[name]
    text = None if column is None else _as_text(row[column], f"{where}: field {name!r}")
    if required and text is None:
        raise DataError(f"{where}: missing field {name!r} (mapped from column {column!r})")
    if required and not text.strip():
        raise DataError(f"{where}: empty field {name!r} (mapped from column {column!r})")
    return text if text and text.strip() else None


def _as_text(value: Any, where: str) -> str | None:
    """A cell as text: None/NaN -> None; chat-message lists -> the last user message."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, float) and value.is_integer():
        return str(int(value))  # pandas/CSV turn int columns with gaps into floats: 7.0 -> "7"
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, list) and value and all(isinstance(m, dict) and "content" in m
                                                 for m in value):  # chat messages (DAPO)
        users = [m for m in value if m.get("role") == "user"] or value
        return _as_text(users[-1]["content"], where)
    raise DataError(f"{where}: expected text, got {type(value).__name__}")


def _as_hints(value: Any) -> tuple[str, ...]:
    """Hints from a list column or a single string; empty entries dropped."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ()
    items = [value] if isinstance(value, str) else list(value)
    return tuple(str(h) for h in items if h is not None and str(h).strip())


def _load_reasoning_gym(spec: DataSpec, exclude: frozenset[str] = frozenset()) -> list[Example]:
    """Procedural items; item i depends only on (task, config, seed, i).

    With `spec.dedup` the generator is drawn from, in index order, until it has given
    `spec.size` distinct prompts outside `exclude`; a task whose problem space is smaller
    stops being drawn from once it brings nothing new, with an error that says how many it
    holds. Ids keep the generator index, so an item is the same wherever it is loaded.

    meta["reasoning_gym"]["entry"] is the generator's own dict, for `score_answer(answer, entry)`.
    Keep that object: a JSON round trip turns its tuples into lists, which breaks the scoring
    of some tasks (arc_agi, rearc score their own answer 0.05 after one).
    """
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    task = spec.name
    if task not in DATASETS:
        close = difflib.get_close_matches(task, DATASETS, n=3)
        raise DataError(f"rg:{task}: unknown reasoning-gym task"
                        + (f" (did you mean {', '.join(close)}?)" if close else "")
                        + f"; allowed: {', '.join(sorted(DATASETS))}")
    allowed = [f.name for f in dataclasses.fields(DATASETS[task][1])]
    for key in spec.task_config:
        if key not in allowed:
            raise DataError(f"rg:{task}: unknown option {key!r}; allowed: {', '.join(allowed)}")
    config = {"seed": spec.seed, "size": spec.size, **spec.task_config}
    # Excluded prompts of the same generator come up in the stream too: they count towards the
    # draw budget and as progress (a new distinct prompt, if not one we may keep).
    draws = max(MAX_DRAWS_PER_ITEM * (spec.size + len(exclude)), MIN_STALL_DRAWS) if spec.dedup else spec.size
    try:
        # Items are generated on access, so a large size costs nothing until drawn.
        dataset = reasoning_gym.create_dataset(task, **{**config, "size": draws})
    except (AssertionError, TypeError, ValueError) as e:  # the generator's own config checks
        raise DataError(f"rg:{task}: invalid config {config}: {e or type(e).__name__}") from e

    examples: list[Example] = []
    excluded, seen, last_new = set(exclude), set(), 0
    for i in range(draws):
        if len(examples) == spec.size:
            break
        if spec.dedup and i - last_new >= max(MIN_STALL_DRAWS, len(seen)):
            break
        entry = dataset[i]
        key = prompt_key(entry["question"])
        if key in seen:
            continue
        if spec.dedup:
            seen.add(key)
            last_new = i
        if key in excluded:
            continue
        answer = entry.get("answer")
        if answer is None or not str(answer).strip():
            raise DataError(f"rg:{task} row {i}: missing field 'answer' (this task has no reference "
                            f"answer; its score_answer judges answers by rules)")
        try:
            json.dumps(entry)  # entries go into logs and caches
        except TypeError as e:
            raise DataError(f"rg:{task} row {i}: item is not JSON-serialisable: {e}") from e
        cot = entry.get("metadata", {}).get("answer_cot")  # worked solution (gsm_symbolic)
        examples.append(Example(
            id=f"{task}/seed{spec.seed}/{i}", prompt=entry["question"], answer=str(answer),
            solution=cot if isinstance(cot, str) else None,
            meta={"source": spec.label, "row": i,
                  "reasoning_gym": {"task": task, "config": config, "entry": entry}},
        ))
    if spec.dedup and len(examples) < spec.size:
        outside = f" outside the {len(exclude)} excluded ones" if exclude else ""
        raise DataError(
            f"rg:{task}: asked for {spec.size} distinct prompts{outside}, but {i + 1} draws gave only "
            f"{len(examples)} (config {spec.task_config or 'default'}): that is about all its problem space holds. "
            f"Ask for fewer (size={len(examples)}), widen the task (more terms or digits), or allow repeated "
            f"prompts with distinct=false")
    return examples


@functools.lru_cache(maxsize=1)
def _champ():
    """The CHAMP set (a 72 MB JSON, mostly model transcripts): parse it once per process."""
    import champ_dataset

    return champ_dataset.load("v0")


def _load_champ(spec: DataSpec) -> list[Example]:
    """CHAMP problems with their step solutions and problem-specific hints."""
    data = _champ()
    examples = []
    for i, problem in enumerate(data.problems.values()):
        hints = [data.hints[h].text for h in problem.ch_list if h.startswith("H_")]
        concepts = [f"{c.name}: {c.text}" if c.name else c.text
                    for c in (data.concepts[k] for k in problem.ch_list if k.startswith("C_"))]
        examples.append(Example(
            id=problem.identifier, prompt=problem.text, answer=problem.answer,
            solution="\n".join(step.text for step in problem.solution.steps),
            hints=tuple(concepts + hints if spec.concepts else hints),
            meta={"source": "champ", "row": i, "category": problem.category, "concepts": concepts},
        ))
    return examples
