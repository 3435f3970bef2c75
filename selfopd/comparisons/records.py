"""A comparison's finished runs kept outside its run folders (`selfopd compare --keep-records DIR`).

Run folders live under `runs/`, which a fresh clone, another machine or a cleaned disk lacks, so
a comparison longer than one sitting would start again from nothing. As each run finishes, its
records (metrics, evals, saved rollouts, diagnostics, config, split: everything but its weights,
plots and HTML pages, about 1-2 MB) are copied to DIR, at the same paths as under the
comparison's folder; a later call copies the finished runs DIR holds back into a comparison
folder that lacks them, and the comparison then skips them as finished. A restored run has no
weights: its records are complete, but nothing can be evaluated on it again.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from selfopd.core.run_folder import RunFolder

if TYPE_CHECKING:
    from selfopd.comparisons.compare import CompareConfig

NOT_RECORDS = ("checkpoints", "plots", "figures", "*.html", ".lock")
TIMING = "timing.jsonl"


def keep_run(compare: CompareConfig, run_dir: Path, keep: Path) -> Path:
    """Copy one run's records, and the comparison's timing log, under `keep`; returns the copy."""
    target = keep / run_dir.relative_to(compare.folder)
    shutil.copytree(run_dir, target, dirs_exist_ok=True, ignore=shutil.ignore_patterns(*NOT_RECORDS))
    timing = compare.folder / TIMING
    if timing.is_file():
        shutil.copy2(timing, keep / TIMING)
    return target


def unkept_runs(compare: CompareConfig, keep: Path) -> list[tuple[str, int, Path]]:
    """(arm, seed, run folder) of each finished run whose records `keep` lacks (one finished by a
    call stopped before it kept them)."""
    return [(arm, seed, run_dir) for arm, seed in compare.runs()
            if RunFolder(run_dir := compare.arm_dir(arm, seed)).finished.is_file()
            and not (keep / run_dir.relative_to(compare.folder) / "finished.json").is_file()]


def keep_finished(compare: CompareConfig, keep: Path) -> list[Path]:
    """Keep every finished run that `keep` lacks."""
    return [keep_run(compare, run_dir, keep) for _, _, run_dir in unkept_runs(compare, keep)]


def restore_runs(compare: CompareConfig, keep: Path) -> list[Path]:
    """Copy back each finished run of this comparison that `keep` holds and its folder lacks (a
    run already in the folder is never overwritten); the timing log too when the folder has none."""
    restored = []
    for arm, seed in compare.runs():
        run_dir = compare.arm_dir(arm, seed)
        kept = keep / run_dir.relative_to(compare.folder)
        if (kept / "finished.json").is_file() and not run_dir.exists():
            shutil.copytree(kept, run_dir)
            restored.append(run_dir)
    if (keep / TIMING).is_file() and not (compare.folder / TIMING).is_file():
        compare.folder.mkdir(parents=True, exist_ok=True)
        shutil.copy2(keep / TIMING, compare.folder / TIMING)
    return restored
