"""What a training run writes besides its metrics: held-out evals, checkpoints, saved
rollouts and the training-curve plots, at the paths `selfopd.core.run_folder` defines."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Sequence

import torch

from selfopd.config import RunConfig
from selfopd.core.atomic import write_text_atomic
from selfopd.data.example import Example
from selfopd.run.rollouts import RolloutRecord, write_records
from selfopd.core.distributed import ShardedSampling, barrier, full_optimizer_state, full_state_dict, is_sharded
from selfopd.run.evaluate import run_evaluation
from selfopd.core.faults import fault_point
from selfopd.core.run_folder import RunFolder, checkpoint_step
from selfopd.training.rollout_pipeline import PENDING_FILE, pending_json
from selfopd.training.state import Run
from selfopd.training.teacher import Scored


def run_eval(run: Run) -> dict[str, float] | None:
    """Held-out accuracy of the current student with its 95% interval over distinct prompts, as
    [eval] asks (greedy by default; avg@k and pass@k with eval.samples > 1), on eval.data or the
    run's held-out split (`eval_examples`): `selfopd.run.evaluate.run_evaluation`, as `selfopd eval`
    runs it, on the run's own student engine: the trainer's module in process, the student's vLLM
    servers (just synced to this step's weights) when training samples there. Under torchrun every
    rank generates its share of each batch; rank 0 writes and gets the metrics (None elsewhere)."""
    out_dir, main = run.folder.eval_dir(run.step), run.world.is_main
    run_evaluation(run.config, eval_examples(run), out_dir if main else None,
                   engine=ShardedSampling(run.student_engine, run.world), tokenizer=run.tokenizer,
                   template=run.eval_template or run.student_template, progress=run.config.run.progress and main)
    return eval_metrics(run.step, out_dir) if main else None


def eval_examples(run: Run) -> Sequence[Example]:
    """What the in-run eval answers: eval.data's items (`selfopd.run.evaluate.checked_eval_data`, when the
    run was built), else the run's held-out split."""
    return run.eval_data or run.eval_examples


def eval_metrics(step: int, eval_dir: Path) -> dict[str, float]:
    """The metrics.jsonl row of one eval folder, read from its summary.json, so that a
    fresh eval and a reused one log exactly the same fields: eval/accuracy is avg@k, and
    eval/pass@k each reported k (absent from evals older than them)."""
    summary = json.loads((eval_dir / "summary.json").read_text())
    metrics = {
        "step": step,
        "eval/accuracy": summary["accuracy"],
        "eval/ci_low": summary["ci95"][0],
        "eval/ci_high": summary["ci95"][1],
        "eval/n": summary["n"],
        "eval/length_mean": summary["mean_completion_tokens"],
        # answers cut at eval.max_tokens, and answers with nothing graded (absent from evals older than them)
        **{f"eval/{key}": summary[key] for key in ("truncated_share", "no_answer_share") if key in summary},
        **{f"eval/{key}": part["value"] for key, part in summary.items() if key.startswith("pass@")},
    }
    for task, part in summary.get("by_task", {}).items():  # a mixture's tasks
        metrics |= {f"eval/accuracy/{task}": part["accuracy"], f"eval/n/{task}": part["n"]}
    return metrics


def reuse_eval(run: Run, source: Path) -> dict[str, float]:
    """Copy an existing eval of the current weights in as this step's eval; its metrics.

    Refused unless it covers exactly this run's held-out ids: a stale or foreign eval
    would silently shift every paired comparison against it."""
    ids = {json.loads(line)["id"] for line in (source / "eval.jsonl").read_text().splitlines()}
    expected = {example.id for example in eval_examples(run)}
    if ids != expected:
        raise ValueError(f"{source}: its eval items are not this run's held-out split "
                         f"({len(ids ^ expected)} ids differ); evaluate again")
    target = run.folder.eval_dir(run.step)
    target.mkdir(parents=True, exist_ok=True)
    for name in ("eval.jsonl", "summary.json"):  # summary.json last: it marks the eval finished
        write_text_atomic(target / name, (source / name).read_text())
    return eval_metrics(run.step, target)


def save_checkpoint(run: Run) -> Path:
    """HF-format weights (loadable by transformers and vLLM), or with LoRA the adapters alone
    (peft's adapter_config.json + adapter_model.safetensors: `selfopd merge-lora` makes them a
    full model), plus the tokenizer and the trainer state; the latest run.keep_checkpoints are kept
    (`prune_checkpoints`: the best eval's too with run.keep_best_checkpoint, and those the illusion
    guard fired at).
    Gathered (run.checkpoint_format): under torchrun the full weights and optimizer state are
    gathered to rank 0 (every rank takes part), which writes them in the one-process layout.
    Sharded: every rank writes its shards (`selfopd.training.sharded_checkpoint`), perhaps in the
    background; HF weights only on export steps (`exports_weights`); the folder is renamed into
    place once the write is done (by the writing thread; `finish_checkpoint_writes` waits for it).
    An `ema` teacher's average is part of the trainer state, so a resumed run continues it exactly;
    so are rollouts sampled ahead of the step (`rollout.max_staleness`)."""
    target, staging = run.folder.checkpoint(run.step), run.folder.checkpoint_staging(run.step)
    writer = run.checkpoint_writer
    if writer is not None:
        writer.wait()  # one write at a time: the previous checkpoint is in place before this one starts
    export = writer is None or exports_weights(run.config.run, run.step)
    sharded = is_sharded(run.model)
    weights = full_state_dict(run.model) if sharded and export else None
    optimizer = full_optimizer_state(run.model, run.optimizer, run.world) if writer is None else {}  # else: the shards
    pending = pending_json(run.rollouts, run.world)  # rollouts sampled ahead (rollout.max_staleness): a resume trains on these
    if run.world.is_main:
        shutil.rmtree(staging, ignore_errors=True)
        if export:
            run.model.save_pretrained(staging, **({"state_dict": weights} if sharded else {}))
        else:
            run.model.config.save_pretrained(staging)  # what the folder is a checkpoint of; weights in the shards
        run.tokenizer.save_pretrained(staging)
        fault_point("checkpoint.weights")
        ema = {"ema": run.ema.state_dict()} if run.ema is not None else {}  # an `ema` teacher's average
        torch.save({"optimizer": optimizer, "scheduler": run.scheduler.state_dict(), "step": run.step, **ema},
                   RunFolder.trainer_state(staging))
        if pending is not None:
            (staging / PENDING_FILE).write_text(pending)
    if writer is None:
        if run.world.is_main:
            _place_checkpoint(run, staging, target)
        return target
    barrier(run.world)  # the staging folder is made before any rank writes into it
    writer.write(run.model, run.optimizer, staging,
                 finish=(lambda: _place_checkpoint(run, staging, target)) if run.world.is_main else (lambda: None))
    return target


def exports_weights(settings: RunConfig, step: int) -> bool:
    """Whether a sharded checkpoint of `step` also holds HF weights: every run.export_every steps
    and at the last step."""
    return step == settings.steps or bool(settings.export_every and step % settings.export_every == 0)


def finish_checkpoint_writes(run: Run) -> None:
    """Block until a sharded checkpoint's background write is written and in place: before a stop or
    the run's end, so that the process never exits with a write in flight."""
    if run.checkpoint_writer is not None:
        run.checkpoint_writer.wait()


def _place_checkpoint(run: Run, staging: Path, target: Path) -> None:
    """Rank 0: the written staging folder becomes the checkpoint (the rename is what makes it
    count), then older ones are pruned."""
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    fault_point("checkpoint.renamed")
    prune_checkpoints(run.folder, target, run.config.run)


def prune_checkpoints(folder: RunFolder, keep: Path, settings: RunConfig) -> None:
    """Keep `keep` (the checkpoint just written, or the one a resumed run continues from), the
    newest `run.keep_checkpoints` complete ones up to it, with run.keep_best_checkpoint the one
    whose step's eval scored best (`best_checkpoint`), and those of steps where the illusion guard
    fired (RUN/guard.json: the user may go back to them). Everything else goes: older checkpoints,
    incomplete or newer ones a resumed run writes again, staging folders of writes a kill cut short."""
    from selfopd.training.guard import fired_steps

    complete = [path for path in folder.complete_checkpoints() if checkpoint_step(path) <= checkpoint_step(keep)]
    kept = {keep, *complete[-settings.keep_checkpoints:]} | {folder.checkpoint(step) for step in fired_steps(folder.root)}
    best = best_checkpoint(folder, complete) if settings.keep_best_checkpoint else None
    for old in folder.checkpoints.iterdir():  # real folders only: a link is never followed, nor deleted
        if old not in kept and old != best and old.is_dir() and not old.is_symlink():
            shutil.rmtree(old)


def best_checkpoint(folder: RunFolder, checkpoints: Sequence[Path]) -> Path | None:
    """Of `checkpoints`, the one whose step's in-run eval (RUN/eval/step_NNNNN/summary.json) has the
    highest accuracy, the earlier step on a tie (None: no step of them was evaluated)."""
    scored = [(accuracy, -checkpoint_step(path), path) for path in checkpoints
              if (accuracy := folder.eval_accuracy(checkpoint_step(path))) is not None]
    return max(scored)[2] if scored else None


def save_rollouts(run: Run, scored: Sequence[Scored], student_lp_N: torch.Tensor, advantage_N: torch.Tensor,
                  limit: int) -> None:
    """A bounded sample of this step's rollouts (the first `limit`, whole prompt groups
    first), for diagnostics and notebooks after the run. `student_lp_N` and `advantage_N`
    are the step's completion tokens, rollout after rollout, as the loss saw them."""
    if limit <= 0:
        return
    lengths = [s.rollout.student_tokens for s in scored]  # the loss saw the student's own tokens only
    per_rollout = ((s.rollout.on_completion(student), s.rollout.on_completion(advantage))  # 0 at environment ids
                   for s, student, advantage in zip(scored, student_lp_N.split(lengths), advantage_N.split(lengths)))
    records = [
        RolloutRecord(
            step=run.step, id=s.example.id, group=s.group, prompt_ids=s.rollout.prompt_ids,
            completion_ids=s.rollout.completion_ids, text=s.rollout.text,
            sampler_logprobs=list(s.rollout.sampler_logprobs), student_logprobs=student.tolist(),
            teacher_logprobs=s.teacher_logprobs.tolist(), advantage=advantage.tolist(), reward=s.reward,
            correct=s.correct, answer=s.example.answer, demonstration=s.demonstration,
            weight_version=s.rollout.weight_version, last_weight_version=s.rollout.last_weight_version,
            unaligned=s.unaligned,
            teacher=s.teacher if run.several_teachers else None,
            loss_mask=list(s.rollout.loss_mask) if s.rollout.loss_mask is not None else None,
        )
        for s, (student, advantage) in zip(scored[:limit], per_rollout)
    ]
    write_records(run.folder.rollouts_file(run.step), records)


def plot_run(folder: RunFolder) -> None:
    """The training curves of a run (RUN/plots/), from its metrics.jsonl."""
    from selfopd.core.plots import plot_training_curves, read_metrics

    plot_training_curves(read_metrics(folder.metrics), folder.plots, title=folder.root.name)
