"""Load task items from any source into `Example`s, and split them into train / eval.

One spec string names a data source everywhere (CLI, configs, logs):

    SPEC   := SOURCE [ "?" KEY "=" VALUE ( "&" KEY "=" VALUE )* ]
    SOURCE := "rg:" TASK       a reasoning-gym task, generated offline from a seed
            | "kb:" TASK       a procedural knowledge task (kb:countries), generated offline from a seed
            | "champ"          the CHAMP competition-math set (270 problems, solutions, hints)
            | "humaneval"      HumanEval's 164 function-writing problems with their check functions (offline)
            | "codegen"        a procedural function-writing task with shown and hidden call tests, from a seed
            | "hf:" NAME       a Hugging Face Hub dataset (needs network or a filled HF cache)
            | "env:" ENVIRONMENT  an environment's opening observations, one per seed (as rollout.environment names it)
            | PATH             a local .jsonl / .json / .parquet / .csv file ("file:PATH" also works)

    rg:chain_sum?min_terms=2&max_terms=3&size=500&seed=1
    kb:countries?entities=24&unseen=8&part=study&seed=0
    champ?concepts=true
    humaneval?limit=20
    codegen?level=1&size=200&seed=0
    env:python:my_envs:GuessNumber?size=64&seed=0   (episodes in that environment: selfopd.data.env_source)
    data/mbpp_test.jsonl?code=mbpp           (code tests: selfopd.data.code_shapes, selfopd.data.code_sources)
    hf:openai/gsm8k?split=test               (preset: config main, answer after "####")
    data/my.jsonl?prompt=question&answer=target&hints=tips&limit=100
    data/gsm8k_test.jsonl?preset=openai/gsm8k
    hf:org/math?prompt=problem&answer=boxed:solution&revision=1a2b3c4
    kb:countries?entities=8 + rg:basic_arithmetic?size=400   (a mixture: selfopd.data.mixture)

Options, by source (each is a `DataSpec` field of the same name; `id`, `prompt`,
`answer`, `solution`, `hints` are the `*_col` fields):

    all       distinct     true: keep each prompt once (default for rg, false elsewhere)
    hf, file  id, prompt, answer, solution, hints   column names for the Example fields
                (defaults: prompt="prompt", answer="answer", no id / solution / hints column;
                 a preset supplies its own defaults, explicit options win)
              answer_sep   split the answer column at the last separator: the text after it is
                           the answer, the text before it the solution (gsm8k's "####")
              answer=boxed:COLUMN  the answer is the last complete \\boxed{...} (or \\fbox{}) of
                           COLUMN, braces balanced; the whole text is the solution unless
                           solution= names a column. A row without one is a DataError naming
                           the spec and the row (a skipped row would change the data silently)
              unanswered=drop  leave out (and name, in one warning line) the rows with no answer
                           (an empty cell, or no \\boxed{} for answer=boxed:COLUMN) instead of stopping
              preset       a named mapping from PRESETS (hf: chosen by dataset name by default)
              limit        keep only the first N examples
              code         mbpp or lcb: the rows carry code tests in MBPP's layout (text, code, test_list of
                           `assert f(x) == y`) or LiveCodeBench's (question_content, public_test_cases and
                           private_test_cases of stdin / stdout pairs); their presets set it
    hf        config, split  the Hub config name and split (default: the preset's, else "train")
              revision     the dataset's branch, tag or commit hash (default: its default branch)
    rg        seed (default 0), size (default 500): the number of items, distinct prompts
              unless distinct=false (the generator is drawn from until it gives that many, and
              says so when its problem space holds fewer); any other key is passed to the
              task's generator config (e.g. min_terms) as the type of its field: numbers,
              true/false, a comma-separated list for a tuple or list (operators=+,-; variable
              names plain: variables=a,b); unknown keys and values of the wrong type fail with
              one line naming them (no limit: use size). An item whose reference or metadata
              would not read in its task's grammar is refused (selfopd.verifiers.references)
    kb        seed (default 0), entities (24 trained), unseen (8 never trained), part (study: the
              trained entities' training phrasings and, split off for eval, their other
              phrasings; train, heldout, unseen alone; fresh: the trained facts in
              two more phrasings), sheet (own; shuffled: another entity's
              fact sheet in meta["fact_sheet"]): see selfopd.data.knowledge
    humaneval limit; the tests are each problem's check function (shown: it cannot be split)
    codegen   seed (default 0), size (default 500: distinct functions unless distinct=false), level (1-3 or a
              mixture such as 2+3, default 1: the difficulty); 3 shown and 3 hidden call tests per function (selfopd.data.codegen)
    env       seed (default 0), size (default 500): the seeds seed .. seed + size - 1, one example each
    champ     concepts=true  put the problem's concepts before its hints (most general first)
              limit

Tables (hf, file) keep only the columns the spec maps, and a `teacher` column (it routes rows
to teachers): the rest are dropped before any row is read.

Values are read as bool (true/false), int, float or str, as the field's type says; generator
options (unknown types) are guessed in that order. `&` and `=` cannot appear inside values.

Small procedural tasks repeat prompts a lot (chain_sum with 2-3 one-digit terms: 1763
distinct prompts in 4000 items), and a repeated prompt is one observation, not several:
procedural sources are deduplicated by default. Fresh items for a procedural task come
from excluding known prompts (`load_examples(spec, exclude=...)`), never from another seed:
reasoning-gym's item i of seed s is item i - 1 of seed s + 1. Splitting into train and eval
is `selfopd.data.split`'s job.
"""

from __future__ import annotations

from typing import Collection

from selfopd.data import mixture
from selfopd.data import sources as data_sources
from selfopd.data.code_sources import load_humaneval
from selfopd.data.codegen import load_codegen
from selfopd.data.env_source import load_env
from selfopd.data.knowledge import load_knowledge
from selfopd.data.spec import (  # noqa: F401  (the public names of selfopd.data)
    FILE_BUILDERS,
    PRESETS,
    DataError,
    DataSpec,
    Preset,
    check_generated_total,
    parse_data_spec,
)
from selfopd.data.example import Example, prompt_key


# --------------------------------------------------------------------------- loading

def load_examples(spec: DataSpec | str, exclude: Collection[str] = ()) -> list[Example]:
    """Load every example a spec names. Ids are unique (checked); order is the source's.

    `exclude` holds prompt keys (`selfopd.data.example.prompt_key`) that must not appear: fresh
    items for a procedural task are drawn past them, other sources just drop those rows.
    With `distinct` (the default for procedural sources) each prompt is kept once. A mixture
    ("SPEC + SPEC", `selfopd.data.mixture`) is each part's examples, tagged with its task."""
    if isinstance(spec, str) and len(mixture.parts(spec)) > 1:
        check_generated_total([parse_data_spec(part) for part in mixture.parts(spec)], spec)
        examples = mixture.load_mixture(spec, lambda part: load_examples(part, exclude),
                                        lambda part: parse_data_spec(part).label)
        check_unique_ids(examples, spec)
        return examples
    spec = parse_data_spec(spec) if isinstance(spec, str) else spec
    excluded = frozenset(exclude)
    if spec.source == "rg":
        return data_sources.load_reasoning_gym(spec, excluded)
    if spec.source == "codegen":
        return load_codegen(spec, excluded)
    loader = {"hf": data_sources.load_hub, "file": data_sources.load_file, "champ": data_sources.load_champ,
              "kb": load_knowledge, "humaneval": load_humaneval, "env": load_env}
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
