"""The headline of a finished run: base vs trained held-out accuracy, honestly stated."""

from __future__ import annotations

from pathlib import Path

from selfopd.evaluate import read_eval_outcomes
from selfopd.split import SPLIT_FILE, SplitRecord
from selfopd.stats import paired_change, prompt_accuracy

VERDICTS = {
    "better": "a gain: the 95% interval of the paired difference is above zero",
    "worse": "a LOSS: the 95% interval of the paired difference is below zero",
    "no significant change": "no significant change: the 95% interval of the paired difference contains zero",
}


def summarize_run(run_dir: Path) -> str:
    """Compare the first and the last held-out evaluation of a run, paired by prompt, each
    distinct prompt counted once."""
    evals = sorted((run_dir / "eval").glob("step_*/eval.jsonl"))
    if len(evals) < 2:
        return f"{run_dir}: fewer than two evaluations, nothing to compare"
    before, after = read_eval_outcomes(evals[0].parent), read_eval_outcomes(evals[-1].parent)
    keys = sorted(set(before) & set(after))
    base = prompt_accuracy({k: before[k] for k in keys})
    trained = prompt_accuracy({k: after[k] for k in keys})
    difference = paired_change(before, after)
    items = sum(len(before[k]) for k in keys)
    repeats = f" ({items} items: repeated prompts count once)" if items != len(keys) else ""
    return "\n".join(
        [
            f"held-out accuracy ({evals[0].parent.name} -> {evals[-1].parent.name}, greedy) over {len(keys)} distinct "
            f"prompts, {_trained_on(run_dir, keys)}{repeats}:",
            f"  base     {base}",
            f"  trained  {trained}",
            f"  change   {difference}: {VERDICTS[difference.verdict]}",
        ]
    )


def _trained_on(run_dir: Path, keys: list[str]) -> str:
    """Whether the run's recorded training prompts include any evaluated prompt."""
    if not (run_dir / SPLIT_FILE).is_file():
        return "not checked against the training prompts (the run has no split.json)"
    overlap = set(keys) & set(SplitRecord.read(run_dir).train_prompts)
    return f"WARNING: {len(overlap)} of them trained on" if overlap else "none trained on"
