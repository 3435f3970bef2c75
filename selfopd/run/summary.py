"""The headline of a finished run: base vs trained held-out accuracy, honestly stated."""

from __future__ import annotations

from pathlib import Path

from selfopd.run.evaluate import read_eval_outcomes
from selfopd.run.throughput import run_hours
from selfopd.core.run_folder import RunFolder
from selfopd.data.split import SplitRecord
from selfopd.core.stats import paired_change, prompt_accuracy

VERDICTS = {
    "better": "a gain: the 95% interval of the paired difference is above zero",
    "worse": "a LOSS: the 95% interval of the paired difference is below zero",
    "no significant change": "no significant change: the 95% interval of the paired difference contains zero",
}


def summarize_run(run_dir: Path) -> str:
    """Compare the first and the last held-out evaluation of a run, paired by prompt, each
    distinct prompt counted once; then the hours its steps took (`hours_line`)."""
    return f"{_accuracy_lines(run_dir)}\n{hours_line(run_dir)}"


def hours_line(run_dir: Path) -> str:
    """The wall hours of a run's training steps, and its GPU-hours when it held GPUs (`run_hours`)."""
    hours = run_hours(run_dir)
    gpu = f", {hours['gpu_hours']:.2f} GPU-hours" if hours["gpu_hours"] else ", no GPU"
    return f"training steps: {hours['train_hours']:.2f} h wall{gpu} (evals and start-up not counted)"


def _accuracy_lines(run_dir: Path) -> str:
    folder = RunFolder(run_dir)
    evals = [folder.eval_dir(step) for step in folder.eval_steps()]
    if len(evals) < 2:
        return f"{run_dir}: fewer than two evaluations, nothing to compare"
    before, after = read_eval_outcomes(evals[0]), read_eval_outcomes(evals[-1])
    keys = sorted(set(before) & set(after))
    base = prompt_accuracy({k: before[k] for k in keys})
    trained = prompt_accuracy({k: after[k] for k in keys})
    difference = paired_change(before, after)
    items = sum(len(before[k]) for k in keys)
    repeats = f" ({items} items: repeated prompts count once)" if items != len(keys) else ""
    return "\n".join(
        [
            f"held-out accuracy ({evals[0].name} -> {evals[-1].name}, greedy) over {len(keys)} distinct "
            f"prompts, {_trained_on(run_dir, keys)}{repeats}:",
            f"  base     {base}",
            f"  trained  {trained}",
            f"  change   {difference}: {VERDICTS[difference.verdict]}",
        ]
    )


def _trained_on(run_dir: Path, keys: list[str]) -> str:
    """Whether the run's recorded training prompts include any evaluated prompt."""
    if not RunFolder(run_dir).split.is_file():
        return "not checked against the training prompts (the run has no split.json)"
    overlap = set(keys) & set(SplitRecord.read(run_dir).train_prompts)
    return f"WARNING: {len(overlap)} of them trained on" if overlap else "none trained on"
