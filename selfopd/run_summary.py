"""The headline of a finished run: base vs trained held-out accuracy, honestly stated."""

from __future__ import annotations

import json
from pathlib import Path

from selfopd.stats import paired_difference, wilson_interval


def summarize_run(run_dir: Path) -> str:
    """Compare the first and the last held-out evaluation of a run (same items, paired)."""
    evals = sorted((run_dir / "eval").glob("step_*/eval.jsonl"))
    if len(evals) < 2:
        return f"{run_dir}: fewer than two evaluations, nothing to compare"
    before, after = _outcomes(evals[0]), _outcomes(evals[-1])
    ids = sorted(set(before) & set(after))
    base = wilson_interval(sum(before[i] for i in ids), len(ids))
    trained = wilson_interval(sum(after[i] for i in ids), len(ids))
    difference = paired_difference([before[i] for i in ids], [after[i] for i in ids])
    if difference.low > 0:
        verdict = "a gain: the 95% interval of the paired difference is above zero"
    elif difference.high < 0:
        verdict = "a LOSS: the 95% interval of the paired difference is below zero"
    else:
        verdict = "no significant change: the 95% interval of the paired difference contains zero"
    return "\n".join(
        [
            f"held-out accuracy ({evals[0].parent.name} -> {evals[-1].parent.name}, greedy):",
            f"  base     {base}",
            f"  trained  {trained}",
            f"  change   {difference}: {verdict}",
        ]
    )


def _outcomes(path: Path) -> dict[str, bool]:
    return {record["id"]: record["correct"] for record in map(json.loads, path.read_text().splitlines())}
