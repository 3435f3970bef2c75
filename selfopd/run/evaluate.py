"""Held-out accuracy of a model on a split, through the verifiers, with a 95% interval over
distinct prompts (each prompt counts once, whatever its copies or samples).

Evaluation in one place: `run_evaluation` is the one entry `selfopd eval` and the in-run eval
(`selfopd.training.outputs.run_eval`) call; this module also chooses what they answer (`eval_set`,
`checked_eval_data`: the split, eval.data, the train/eval overlap), where `selfopd eval` samples
(`open_eval_engine`: in process or on vLLM servers), how both render and grade (`eval_prompting`),
and writes eval.jsonl and summary.json (`evaluate`, `write_eval`)."""

from __future__ import annotations

import contextlib
import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

from tqdm.auto import tqdm

from selfopd.config import ConfigError, TrainConfig
from selfopd.core.atomic import write_json_atomic, write_lines_atomic
from selfopd.data.example import Example, prompt_key
from selfopd.data.mixture import task_of
from selfopd.engines.base import Engine, SamplingParams
from selfopd.core.faults import fault_point
from selfopd.core.stats import (MeanEstimate, Proportion, mean_interval, pass_ks, per_prompt_means, prompt_accuracy,
                                prompt_pass_at_k)
from selfopd.templating.chat_format import ChatFormat
from selfopd.templating.templates import PromptTemplate, render_student
from selfopd.verifiers import Grading


@dataclass(frozen=True)
class EvalPrompting:
    """What an eval of a run renders and how it grades (`eval_prompting`)."""

    template: str  # the template's name, as the config gives it
    template_kwargs: dict[str, Any]  # the student's chat-template arguments, eval.chat_template_kwargs over them
    grading: Grading
    rollout: Any  # the [rollout] whose environment each answer runs in (`EvalConfig.episodes`); 'none': one answer


def eval_prompting(config: TrainConfig) -> EvalPrompting:
    """The prompt template, chat-template arguments, grading and episodes of `config`'s evals, the in-run
    eval and `selfopd eval` alike: [eval]'s settings where set, else training's (`EvalConfig.template`,
    `template_kwargs`, `grading`, `episodes` decide). The tools' definitions are in the eval's prompts
    when its answers are tool-calling episodes, as in training's."""
    from selfopd.episodes.prompt_tools import tool_template_kwargs

    settings = config.eval
    rollout = settings.episodes(config.rollout)
    student = {**config.model.chat_template_kwargs, **tool_template_kwargs(rollout)}
    return EvalPrompting(settings.template(config.data.student_template), settings.template_kwargs(student),
                         Grading.of(settings.grading(config.verifier)), rollout)


@dataclass(frozen=True)
class EvalRecord:
    """One sampled answer's outcome, written as a JSON line so a run can be inspected later."""

    id: str
    sample: int  # 0..k-1 for avg@k; always 0 for greedy
    prompt: str
    completion: str
    extracted: str | None
    reference: str
    correct: bool
    finish_reason: str
    completion_tokens: int
    # A code task with hidden tests: the share of them the program passed (never in any feedback); None
    # elsewhere, and then not written.
    hidden_reward: float | None = None


def evaluate(
    engine: Engine,
    tokenizer: Any,
    examples: Sequence[Example],
    template: PromptTemplate,
    max_new_tokens: int = 64,
    batch_size: int = 16,
    out_dir: Path | None = None,
    progress: bool = True,
    samples: int = 1,
    temperature: float = 0.0,
    seed: int = 0,
    grading: Grading = Grading(),
    template_kwargs: Mapping[str, Any] | None = None,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    rollout: Any = None,
) -> tuple[Proportion | MeanEstimate, list[EvalRecord]]:
    """Accuracy on `examples`: greedy (the default), or avg@k with `samples` > 1 at
    `temperature` (and the `top_p`, `top_k`, `min_p` filters: `SamplingParams`), graded as
    `grading` (the run's [verifier]) reads a completion. With `out_dir`, writes eval.jsonl and
    summary.json (avg@k and pass@k). `template_kwargs`: the student's chat-template arguments
    (model.chat_template_kwargs). `rollout`: a [rollout] whose environment is not 'none' makes each answer an
    episode in it (`selfopd.episodes.sampling.episode_sampler`), eval.max_tokens a turn; graded as training
    grades (`grade_rollout`: the last answer, or an `env:` example's environment reward)."""
    if samples > 1 and temperature == 0:
        raise ValueError("avg@k with k > 1 needs temperature > 0: greedy samples are identical")
    from selfopd.episodes.sampling import episode_sampler
    from selfopd.episodes.verdicts import grade_rollout

    chat = ChatFormat(tokenizer, template_kwargs or {}, grading)  # the eval's chat format
    episodes = episode_sampler(rollout, chat) if rollout is not None else None
    rendered = [chat.prompt(render_student(template, e)) for e in examples]  # each with its template's <think>
    prompts, opened = [p.ids for p in rendered], [p.opens_reasoning for p in rendered]
    check_room(examples, prompts, max_new_tokens, getattr(engine, "max_scored_tokens", None))  # before any sampling
    records: list[EvalRecord] = []
    batches = range(0, len(examples), batch_size)
    for number, start in enumerate(tqdm(batches, desc="eval", unit="batch", disable=not progress)):
        batch = examples[start : start + batch_size]
        params = SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                min_p=min_p, n=samples, seed=seed + number)
        batch_prompts = prompts[start : start + batch_size]
        sampled = (episodes.sample(engine, batch_prompts, batch, params) if episodes is not None
                   else engine.sample(batch_prompts, params))
        for example, completions, opens in zip(batch, sampled, opened[start : start + batch_size]):
            for index, completion in enumerate(completions):
                result = grade_rollout(chat, completion, example, opens)
                records.append(
                    EvalRecord(
                        id=example.id,
                        sample=index,
                        prompt=example.prompt,
                        completion=completion.text,
                        extracted=result.extracted,
                        reference=example.answer,
                        correct=result.correct,
                        finish_reason=completion.finish_reason,
                        completion_tokens=completion.student_tokens,
                        hidden_reward=result.hidden_reward,
                    )
                )
    accuracy = accuracy_of(records, samples)
    if out_dir is not None:
        sampling = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "min_p": min_p,
                    "max_tokens": max_new_tokens, "seed": seed}
        write_eval(out_dir, accuracy, records, template.name, samples, temperature,
                   tasks={e.id: task_of(e) for e in examples}, grading=grading, sampling=sampling)
    return accuracy, records


def check_room(examples: Sequence[Example], prompts: Sequence[list[int]], max_new_tokens: int,
               context: int | None) -> None:
    """Each prompt leaves `max_new_tokens` of room in the model's `context` (None: unknown), or a
    ConfigError naming the first data row that does not: past its context a model's answers are
    garbage (positions it never learned) or a server's request fails mid-eval."""
    if context is None:
        return
    for example, prompt in zip(examples, prompts):
        if len(prompt) + max_new_tokens > context:
            raise ConfigError("eval.max_tokens", f"data row {example.id!r} of {example.meta.get('source', 'the data')}: "
                              f"its prompt ({len(prompt)} tokens) plus eval.max_tokens ({max_new_tokens}) exceeds the "
                              f"model's context of {context} tokens; shorten that prompt or lower eval.max_tokens")


def accuracy_of(records: Sequence[EvalRecord], samples: int = 1) -> Proportion | MeanEstimate:
    """Accuracy over distinct prompts: greedy on distinct prompts is a Wilson interval on
    k/n prompts; avg@k (or repeated prompts) the per-prompt mean with an interval over prompts."""
    return prompt_accuracy(outcomes_by_prompt(records))


def at_k(records: Sequence[EvalRecord], samples: int) -> dict[str, Any]:
    """summary.json's avg@k and pass@k (k: the powers of two up to `samples`, and `samples`), each
    {value, ci95, n}: a mean over distinct prompts of each prompt's estimate from its answers."""
    outcomes = outcomes_by_prompt(records)
    estimates = {f"avg@{samples}": mean_interval(list(per_prompt_means(outcomes).values()))}
    estimates |= {f"pass@{k}": prompt_pass_at_k(outcomes, k) for k in pass_ks(samples)}
    return {"k": samples, **{name: {"value": e.value, "ci95": [e.low, e.high], "n": e.n} for name, e in estimates.items()}}


def outcomes_by_prompt(records: Sequence[EvalRecord | dict]) -> dict[str, list[bool]]:
    """Prompt key -> the correctness of each of its records (samples, or repeated items)."""
    outcomes: dict[str, list[bool]] = {}
    for record in records:
        row = record if isinstance(record, dict) else asdict(record)
        outcomes.setdefault(prompt_key(row["prompt"]), []).append(bool(row["correct"]))
    return outcomes


def _record_line(record: EvalRecord) -> dict:
    """A record as its JSON line; `hidden_reward` only where the task has hidden tests."""
    line = asdict(record)
    if line["hidden_reward"] is None:
        del line["hidden_reward"]
    return line


def read_eval_outcomes(eval_dir: Path) -> dict[str, list[bool]]:
    """`outcomes_by_prompt` of an eval folder's eval.jsonl (a run's eval/step_N, `selfopd eval --out`)."""
    path = Path(eval_dir) / "eval.jsonl"
    return outcomes_by_prompt([json.loads(line) for line in path.read_text().splitlines() if line.strip()])


def write_eval(
    out_dir: Path,
    accuracy: Proportion | MeanEstimate,
    records: Sequence[EvalRecord],
    template_name: str,
    samples: int = 1,
    temperature: float = 0.0,
    tasks: dict[str, str] | None = None,
    grading: Grading = Grading(),
    sampling: Mapping[str, Any] | None = None,
) -> None:
    """eval.jsonl, then summary.json (its presence marks the eval finished), each whole or absent.
    `tasks` (item id -> task, a mixture's): summary.json also holds each task's accuracy.
    `sampling`: the sampling settings, recorded as given."""
    out_dir.mkdir(parents=True, exist_ok=True)
    write_lines_atomic(out_dir / "eval.jsonl", (_record_line(record) for record in records))
    fault_point("eval.written")
    truncated = sum(r.finish_reason == "length" for r in records)
    summary = {
        "template": template_name,
        "metric": "greedy accuracy" if samples == 1 else f"avg@{samples} accuracy at temperature {temperature}",
        "n": accuracy.n,  # distinct prompts
        "prompts": accuracy.n,
        "items": len({r.id for r in records}),
        "samples_per_item": samples,
        "accuracy": accuracy.value,
        "ci95": [accuracy.low, accuracy.high],
        "truncated": truncated,
        # Shares of the answers (records): cut at max_tokens; with nothing graded (truncated and
        # verifier.truncated = 'wrong', an unclosed reasoning block, or no final answer found).
        "truncated_share": truncated / max(len(records), 1),
        "no_answer_share": sum(r.extracted is None for r in records) / max(len(records), 1),
        "verifier": asdict(grading),
        "mean_completion_tokens": sum(r.completion_tokens for r in records) / max(len(records), 1),
        **({"sampling": dict(sampling)} if sampling else {}),
        **at_k(records, samples),
    }
    hidden = [r for r in records if r.hidden_reward is not None]
    if hidden:  # code tasks: all hidden tests passed, beside `accuracy` (all shown tests passed)
        passed = accuracy_of([replace(r, correct=r.hidden_reward == 1.0) for r in hidden], samples)
        summary["hidden_accuracy"] = {"value": passed.value, "ci95": [passed.low, passed.high], "n": passed.n}
    if tasks and len(set(tasks.values())) > 1:
        by_task = {}
        for task in dict.fromkeys(tasks.values()):
            part = accuracy_of([r for r in records if tasks[r.id] == task], samples)
            by_task[task] = {"accuracy": part.value, "ci95": [part.low, part.high], "n": part.n}
        summary["by_task"] = by_task
    write_json_atomic(out_dir / "summary.json", summary)


# --- the one entry: `selfopd eval` and the in-run eval both call `run_evaluation` ---------------


def run_evaluation(config: TrainConfig, examples: Sequence[Example], out_dir: Path | None, *,
                   engine: Engine | None = None, tokenizer: Any = None, template: PromptTemplate | None = None,
                   model: str | Path | None = None, kind: str = "local", server: str | None = None, seed: int = 0,
                   progress: bool = True) -> tuple[Proportion | MeanEstimate, list[EvalRecord]]:
    """The eval `config` asks for ([eval], over training's template, chat-template arguments and
    [verifier]: `eval_prompting`) of `examples` (`eval_set`, or the run's `checked_eval_data` or held-out
    split), written to `out_dir` (None: not written, as on a torchrun rank other than 0).

    It samples on `engine` with `tokenizer` when given (in-run: the run's own student engine, and
    `template` its kept copy of the eval template), else on `model`, opened here as `kind` says
    (`open_eval_engine`: 'local' in process, 'vllm' on `server` or on servers launched for it, their
    logs in out_dir/server-logs) and closed before it returns. `seed`: the first batch's sampling seed."""
    prompting = eval_prompting(config)
    if template is None:
        from selfopd.templating.templates import load_template

        template = load_template(prompting.template)
    settings = config.eval
    with contextlib.ExitStack() as stack:
        if engine is None:
            assert model is not None and out_dir is not None, "an eval that opens its engine names a model and a folder"
            engine, tokenizer = open_eval_engine(model, config, kind, server, stack, out_dir / "server-logs", progress)
        return evaluate(engine, tokenizer, examples, template, settings.max_tokens, settings.batch_size,
                        out_dir=out_dir, progress=progress, samples=settings.samples,
                        temperature=settings.temperature, seed=seed, grading=prompting.grading,
                        template_kwargs=prompting.template_kwargs, top_p=settings.top_p, top_k=settings.top_k,
                        min_p=settings.min_p, rollout=prompting.rollout)


@dataclass(frozen=True)
class EvalSet:
    """The examples `selfopd eval` answers, and how its report names them."""

    examples: Sequence[Example]
    what: str


def eval_set(config: TrainConfig, data: str | None = None, split: str = "eval", run_dir: Path | None = None,
             fresh: bool = False) -> EvalSet:
    """What `selfopd eval` answers: `data`'s items (default: eval.data, the in-run eval's set), else
    `split` ('train', 'eval' or 'all') of the config's split. With a run (`run_dir`): `data` is refused
    when the run trained on one of its prompts, or with `fresh` drawn past every prompt of the run's
    data; without `data`, the run's held-out prompts, checked against its split.json."""
    from selfopd.data import DataError, load_examples
    from selfopd.data.split import SplitRecord, distinct_prompts, load_split, trained_on

    record = SplitRecord.read(run_dir) if run_dir is not None else None
    data = data if data is not None else config.eval.data or None
    if data is not None:
        known = set(record.eval_prompts) | set(record.train_prompts) if fresh and record is not None else ()
        examples = load_examples(data, exclude=known)
        if record is not None and not fresh and (overlap := trained_on(examples, record.train_prompts)):
            raise DataError(f"{len(overlap)} of the {distinct_prompts(examples)} distinct prompts of {data} were "
                            f"trained on by {run_dir} (e.g. {overlap[0].prompt!r}); evaluate its held-out prompts (no "
                            f"--data), or pass --fresh to draw prompts its data never held")
        return EvalSet(examples, data)
    train, held_out = load_split(config.data.spec, config.data.eval_size, config.data.split_seed)
    if record is not None:
        SplitRecord.of(config.data.spec, config.data.split_seed, train, held_out).check_same(record, str(run_dir))
        return EvalSet(held_out, f"{run_dir}'s held-out prompts")
    return EvalSet({"train": train, "eval": held_out, "all": train + held_out}[split], f"{config.data.spec} [{split}]")


def checked_eval_data(config: TrainConfig, train_examples: Sequence[Example]) -> tuple[Example, ...]:
    """What the in-run eval answers instead of the run's held-out split: eval.data's items (none when it
    is ''), refused in one line naming the spec when one of its prompts is a training prompt; `build_run`
    calls it once, before the run folder is made."""
    from selfopd.data import load_examples
    from selfopd.data.split import distinct_prompts, trained_on

    spec = config.eval.data
    if not spec:
        return ()
    examples = tuple(load_examples(spec))
    overlap = trained_on(examples, (prompt_key(example.prompt) for example in train_examples))
    if overlap:
        raise ConfigError("eval.data", f"{spec}: {len(overlap)} of its {distinct_prompts(examples)} distinct prompts "
                          f"are training prompts of this run (e.g. {overlap[0].prompt[:80]!r}); evaluate on prompts "
                          "the run does not train on")
    return examples


def eval_engine_kind(engine: str | None, server: str | None, run_config: TrainConfig | None) -> str:
    """Where `selfopd eval` samples: `engine` when given (--engine); 'vllm' with a `server` URL, or with
    a run's config (--run) whose engine.kind is 'vllm' or 'vllm_colocate': the run's own engine, launched
    as training launches the student's (a long eval is a vLLM job); else 'local', in process."""
    from selfopd.config import VLLM_KINDS

    if engine is not None:
        return engine
    if server is not None or (run_config is not None and run_config.engine.kind in VLLM_KINDS):
        return "vllm"
    return "local"


def open_eval_engine(model: str | Path, config: TrainConfig, kind: str, server: str | None,
                     stack: contextlib.ExitStack, log_dir: Path, progress: bool = True) -> tuple[Engine, Any]:
    """(engine, tokenizer) that samples `model`: `kind` 'local' in process (HF generate, for small checks);
    'vllm' on `server` (a URL serving that model) or on the student's servers as training launches them
    (`selfopd.serving.launch.open_student_engine`: same dtype, context, GPUs, key), stopped when `stack`
    closes. A long eval (AIME avg@16 at thousands of tokens) is a vLLM job."""
    if kind == "local":
        from selfopd.engines.build import frozen_engine

        engine = frozen_engine(model, config)
        return engine, engine.tokenizer
    from transformers import AutoTokenizer

    from selfopd.config.bundles import ServingSettings
    from selfopd.core.models import from_pretrained, resolve_model
    from selfopd.engines.lora import is_adapter_folder
    from selfopd.serving.launch import open_student_engine

    adapters = is_adapter_folder(Path(model))  # a LoRA checkpoint: its folder holds the adapters and the tokenizer
    folder = Path(model) if adapters else resolve_model(model)
    tokenizer = from_pretrained(AutoTokenizer, folder, trust_remote_code=config.model.trust_remote_code)
    if adapters and server is None:  # a vLLM server loads whole models: the adapters merged, as training pushes them
        folder = merged_for_serving(folder, log_dir.parent, config.model.dtype, stack)
    engine = open_student_engine(ServingSettings.of(config), str(folder), log_dir, stack, [server] if server else [],
                                 progress)
    return engine, tokenizer


def merged_for_serving(checkpoint: Path, beside: Path, dtype: str, stack: contextlib.ExitStack) -> Path:
    """A LoRA checkpoint's adapters merged into its base, in the dtype its servers served during training
    (model.dtype), in a new folder under `beside` (the eval's output folder) deleted when `stack` closes."""
    import shutil
    import tempfile

    from selfopd.engines.lora import merge_checkpoint

    beside.mkdir(parents=True, exist_ok=True)
    out = Path(tempfile.mkdtemp(prefix=".merged-", dir=beside))
    stack.callback(shutil.rmtree, out, ignore_errors=True)
    print(f"selfopd: merging the LoRA adapters of {checkpoint} into {out} for the vLLM server (deleted after the eval)")
    return merge_checkpoint(checkpoint, out, "bfloat16" if dtype == "bfloat16" else "float32")
