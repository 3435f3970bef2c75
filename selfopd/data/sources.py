"""The loaders behind `selfopd.data.load_examples`, one per source: Hugging Face Hub datasets
and local files (through `datasets`), reasoning-gym tasks (generated offline, distinct prompts
by default) and CHAMP."""

from __future__ import annotations

import difflib
import functools
import json
import math
import re
import sys
import time
from pathlib import Path
from typing import Any

from selfopd.data.spec import BOXED, FILE_BUILDERS, PRESETS, TEACHER_COLUMN, DataError, DataSpec, Preset
from selfopd.data import code_sources
from selfopd.data.example import Example, prompt_key
from selfopd.data.rg_options import checked_options
from selfopd.data.worked_solutions import arithmetic_solution
from selfopd.verifiers.references import screen_entry

# Distinct procedural prompts: draw at most this many items per prompt asked for, and stop
# early once this many draws in a row (or as many as found so far) brought nothing new.
MAX_DRAWS_PER_ITEM = 50
MIN_STALL_DRAWS = 2000
MAX_GENERATION_S = 120  # the longest a generator may take for the items asked for (10^5 demo items: about 30 s)


def hub_request(spec: DataSpec) -> dict[str, str | None]:
    """`datasets.load_dataset`'s arguments for an hf: spec: the dataset, its config and split (the
    spec's, else its preset's), and the pinned revision (None: the default branch)."""
    preset = PRESETS.get(spec.preset or spec.name)
    return {"path": spec.name, "name": spec.config or (preset.config if preset else None),
            "split": spec.split or (preset.split if preset else "train"), "revision": spec.revision}


def load_hub(spec: DataSpec) -> list[Example]:
    """A Hub dataset through `datasets`; offline this fails, and the error says what to do."""
    import datasets

    preset = PRESETS.get(spec.preset or spec.name)
    request = hub_request(spec)
    config, split = request["name"], request["split"]
    example = f"preset={spec.name}" if preset else "prompt=COLUMN&answer=COLUMN"
    at = f", revision {spec.revision!r}" if spec.revision else ""
    try:
        table = datasets.load_dataset(**request)
    except Exception as e:  # network, missing dataset, bad config/split/revision: all end here
        raise DataError(
            f"could not load Hub dataset {spec.name!r} (config {config!r}, split {split!r}{at}): "
            f"{type(e).__name__}: {e}. Hub datasets need network access (or a copy in the local "
            f"Hugging Face cache); without network, download the data elsewhere and pass a local "
            f".jsonl/.parquet/.csv file instead, e.g. 'data/file.jsonl?{example}'"
        ) from e
    return _rows_to_examples(table, spec, preset, id_prefix=f"{spec.name}/{split}")


def load_file(spec: DataSpec) -> list[Example]:
    """A local file through `datasets`' json/parquet/csv builders (all rows land in 'train')."""
    import datasets

    path = Path(spec.name)
    if path.is_dir():
        raise DataError(f"{spec.name}: is a folder, not a data file")
    if not path.is_file():
        raise DataError(f"{spec.name}: file not found")
    if path.stat().st_size == 0:
        raise DataError(f"{spec.name}: the file is empty: no rows")
    if path.suffix.lower() != ".parquet":
        _check_utf8(path)
    if path.suffix.lower() == ".jsonl":
        _check_json_lines(path)
    builder = FILE_BUILDERS[path.suffix.lower()]
    try:
        table = datasets.load_dataset(builder, data_files=str(path), split="train")
    except (ValueError, datasets.exceptions.DatasetGenerationError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise DataError(f"{spec.name}: cannot read it as {builder}: {reason}") from None
    return _rows_to_examples(table, spec, PRESETS.get(spec.preset or ""), id_prefix=path.stem)


def _check_utf8(path: Path) -> None:
    """Name the line of a text data file that is not UTF-8 (`datasets` fails deep in pyarrow)."""
    with path.open("rb") as handle:
        for number, line in enumerate(handle, start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as error:
                raise DataError(f"{path}:{number}: not UTF-8 text (byte 0x{line[error.start]:02x} at column "
                                f"{error.start + 1}); save the file as UTF-8") from None


def _check_json_lines(path: Path) -> None:
    """Name the line of a JSON-lines file that is not one JSON object (`datasets` gives a byte offset)."""
    with path.open(encoding="utf-8", errors="replace") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise DataError(f"{path}:{number}: invalid JSON: {error.msg} (column {error.colno})") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}:{number}: expected a JSON object per line, got {type(row).__name__}")


def _rows_to_examples(table, spec: DataSpec, preset: Preset | None, id_prefix: str) -> list[Example]:
    """Map table rows to Examples by the spec's columns (explicit option > preset > default). Only
    those columns (and a `teacher` column, for routing) are kept: the others are dropped before
    any row is read, so a large unused column never reaches memory row by row."""
    if spec.code or (preset and preset.code):  # tests, not an answer (selfopd.data.code_sources)
        return code_sources.rows_to_code_examples(table, spec, preset, spec.code or preset.code, id_prefix)
    p = preset or Preset(prompt="prompt", answer="answer")  # the defaults without a preset
    answer_col = spec.answer_col or p.answer  # a preset may read its answer from a \boxed{} too
    boxed = answer_col.startswith(BOXED)
    options = {"id": spec.id_col, "prompt": spec.prompt_col, "answer": answer_col[len(BOXED):] if boxed else answer_col,
               "solution": spec.solution_col, "hints": spec.hints_col}
    cols = {name: getattr(p, name) if col is None else col for name, col in options.items()}
    answer_sep = spec.answer_sep or (None if boxed else p.answer_sep)
    label = spec.label
    for name, column in cols.items():
        if column is not None and column not in table.column_names:
            raise DataError(f"{label} row 0: missing field {name!r} (mapped from column "
                            f"{column!r}); the columns are: {', '.join(table.column_names)}")
    used = [c for c in dict.fromkeys(cols.values()) if c is not None]
    table = table.select_columns(used + [TEACHER_COLUMN] * (TEACHER_COLUMN in table.column_names
                                                            and TEACHER_COLUMN not in used))

    examples, dropped = [], []
    for i, row in enumerate(table):
        where = f"{label} row {i}"
        prompt = _cell(row, cols, "prompt", where, required=True)
        if spec.unanswered == "drop" and _unanswered(row, cols["answer"], boxed):
            dropped.append(i)
            continue
        answer = _cell(row, cols, "answer", where, required=True)
        solution = _cell(row, cols, "solution", where, required=False)
        if boxed:
            answer, solution = _last_boxed(answer, where, cols["answer"]), solution or answer.strip()
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
    if dropped:  # said once, with the rows, so the data under a run never changes unseen
        missing = f"column {cols['answer']!r}" + (", no complete \\boxed{}" if boxed else "")
        print(f"selfopd: warning: {label}: {len(dropped)} of {len(dropped) + len(examples)} rows have no answer "
              f"({missing}) and were left out "
              f"(unanswered=drop): rows {', '.join(map(str, dropped[:10]))}{' ...' if len(dropped) > 10 else ''}",
              file=sys.stderr)
    return examples


def _unanswered(row: dict, column: str, boxed: bool) -> bool:
    """A row whose answer cell is empty, NaN, or (answer=boxed:COLUMN) holds no complete \\boxed{}."""
    value = row.get(column)
    if value is None or (isinstance(value, float) and math.isnan(value)) or not str(value).strip():
        return True
    return boxed and last_boxed(str(value)) is None


_BOXED = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])\s*\{")


def last_boxed(text: str) -> str | None:
    """The content of the last complete, non-empty `\\boxed{...}` (or `\\fbox{}`) of `text`, braces
    balanced and `\\{` `\\}` escapes skipped, as the verifier reads a completion's (the loader's own small
    reader, held equal to the verifier's by a test)."""
    for match in reversed(list(_BOXED.finditer(text))):
        depth, i = 1, match.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 2 if text[i] == "\\" else 1
        if depth == 0 and text[match.end():i - 1].strip():
            return text[match.end():i - 1].strip()
    return None


def _last_boxed(text: str, where: str, column: str) -> str:
    """The answer of answer=boxed:COLUMN, or one error naming the row."""
    answer = last_boxed(text)
    if answer is None:
        raise DataError(f"{where}: field 'answer' (answer={BOXED}{column}) has no complete, non-empty \\boxed{{...}}; "
                        "fix or drop the row, or name another column")
    return answer


def _cell(row: dict, cols: dict[str, str | None], name: str, where: str, required: bool) -> str | None:
    """The text for Example field `name`; a required field must be present and non-blank."""
    column = cols[name]
    text = None if column is None else _as_text(row[column], f"{where}: field {name!r}")
    if required and isinstance(row.get(column), float) and math.isnan(row[column]):
        raise DataError(f"{where}: field {name!r} (mapped from column {column!r}) is NaN, not text: an empty cell of a "
                        "CSV or parquet table, or NaN written in the file; fix or drop the row")
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


def load_reasoning_gym(spec: DataSpec, exclude: frozenset[str] = frozenset()) -> list[Example]:
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
    config = {"seed": spec.seed, "size": spec.size, **checked_options(task, DATASETS[task][1], spec.task_config)}
    # Excluded prompts of the same generator come up in the stream too: they count towards the
    # draw budget and as progress (a new distinct prompt, if not one we may keep).
    draws = max(MAX_DRAWS_PER_ITEM * (spec.size + len(exclude)), MIN_STALL_DRAWS) if spec.dedup else spec.size
    try:
        # Items are generated on access, so a large size costs nothing until drawn.
        dataset = reasoning_gym.create_dataset(task, **{**config, "size": draws})
    except (AssertionError, TypeError, ValueError) as e:  # the generator's own config checks
        raise DataError(f"rg:{task}: invalid config {config}: {e or type(e).__name__}") from e

    examples: list[Example] = []
    excluded, seen, last_new, started = set(exclude), set(), 0, time.monotonic()
    for i in range(draws):
        if len(examples) == spec.size:
            break
        if spec.dedup and i - last_new >= max(MIN_STALL_DRAWS, len(seen)):
            break
        entry = _draw(dataset, i, spec, len(examples), started)
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
        bad = screen_entry(task, entry)  # the scorer would run it as Python (selfopd.verifiers.references)
        if bad is not None:
            raise DataError(f"rg:{task} row {i}: {bad}; an item's reference and metadata must read in its task's "
                            f"grammar (generator options {spec.task_config or 'default'})")
        try:
            json.dumps(entry)  # entries go into logs and caches
        except TypeError as e:
            raise DataError(f"rg:{task} row {i}: item is not JSON-serialisable: {e}") from e
        examples.append(Example(
            id=f"{task}/seed{spec.seed}/{i}", prompt=entry["question"], answer=str(answer),
            solution=_worked_solution(task, entry),
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


def _draw(dataset: Any, i: int, spec: DataSpec, kept: int, started: float) -> dict:
    """Item i of a generator; a DataError when it fails (a 10^5-digit number) or when the items asked
    for would take past MAX_GENERATION_S at the pace so far (many items, each large)."""
    elapsed = time.monotonic() - started
    if elapsed > 2 and elapsed * spec.size / max(kept, 1) > MAX_GENERATION_S:
        raise DataError(f"{spec.label}: {kept} of {spec.size} items took {elapsed:.0f} s, so all of them would take "
                        f"about {elapsed * spec.size / max(kept, 1):.0f} s, past the {MAX_GENERATION_S} s selfopd gives "
                        f"a generator; ask for fewer items (size) or smaller ones (options "
                        f"{spec.task_config or 'default'})")
    try:
        return dataset[i]
    except Exception as error:  # the generator's own failure, whatever it raises
        raise DataError(f"{spec.label} row {i}: the generator failed with options {spec.task_config or 'default'}: "
                        f"{type(error).__name__}: {error}") from None


def _worked_solution(task: str, entry: dict) -> str | None:
    """The task's own worked solution (gsm_symbolic's answer_cot), else one generated for a
    sum or a product (`selfopd.data.worked_solutions`), else None."""
    metadata = entry.get("metadata", {})
    if isinstance(metadata.get("answer_cot"), str):
        return metadata["answer_cot"]
    if task in ("basic_arithmetic", "chain_sum", "products") and isinstance(metadata.get("expression"), str):
        return arithmetic_solution(metadata["expression"])
    return None


@functools.lru_cache(maxsize=1)
def _champ():
    """The CHAMP set (a 72 MB JSON, mostly model transcripts): parse it once per process."""
    import champ_dataset

    return champ_dataset.load("v0")


def load_champ(spec: DataSpec) -> list[Example]:
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
