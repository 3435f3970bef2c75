"""Where notebooks find their inputs: the project folder (the one holding `runs/`), every run
under it, and the newest run, with messages that say what is missing and how to make it."""

from __future__ import annotations

import json
from pathlib import Path

from selfopd.core.run_folder import RunFolder


def project_root(start: Path | None = None) -> Path:
    """The nearest folder at or above `start` (default: the working directory, which is
    notebooks/ when Jupyter runs one) that holds `pyproject.toml` or `runs/`; else `start`."""
    start = Path.cwd() if start is None else Path(start)
    for folder in (start.resolve(), *start.resolve().parents):
        if (folder / "pyproject.toml").is_file() or (folder / "runs").is_dir():
            return folder
    return start


def find_runs(runs_dir: Path) -> list[Path]:
    """Every run folder under `runs_dir` (plain runs and `selfopd compare` arms,
    NAME/arms/ARM/seedS) that has logged a step, oldest first."""
    logs = [p for pattern in ("*/metrics.jsonl", "*/arms/*/seed*/metrics.jsonl") for p in Path(runs_dir).glob(pattern)]
    return [log.parent for log in sorted(logs, key=lambda log: (log.stat().st_mtime, str(log)))]


def newest_run(runs_dir: Path, with_rollouts: bool = True) -> Path:
    """The run under `runs_dir` that logged last (with saved rollouts, when asked)."""
    runs = find_runs(runs_dir)
    kept = [run for run in runs if not with_rollouts or RunFolder(run).rollout_steps()]
    if kept:
        return kept[-1]
    if runs:
        raise FileNotFoundError(f"none of the {len(runs)} runs under {runs_dir} saved rollouts (run.rollouts_to_save = "
                                "0): train one with run.rollouts_to_save > 0, or set RUN_DIR")
    raise FileNotFoundError(f"no runs under {runs_dir}: train one (`make demo` saves 32 rollouts per step), or set "
                            "RUN_DIR to a run folder")


def check_run(run_dir: Path, with_rollouts: bool = True) -> Path:
    """`run_dir` if it is a run folder (with saved rollouts, when asked); else say what it lacks."""
    folder = RunFolder(Path(run_dir))
    if not folder.is_run():
        raise FileNotFoundError(f"{run_dir}: not a run folder (no config.toml)")
    if with_rollouts and not folder.rollout_steps():
        raise FileNotFoundError(f"{run_dir}: no saved rollouts in {folder.rollouts} (it ran with run.rollouts_to_save "
                                "= 0, or stopped before its first step)")
    return folder.root


def saves_episodes(run_dir: Path) -> bool:
    """True when the run's last saved rollouts are episodes (`rollout.environment`: each record
    carries a loss mask). Read from the first line only: every record of an episode run has one."""
    folder = RunFolder(Path(run_dir))
    steps = folder.rollout_steps()
    if not steps:
        return False
    with folder.rollouts_file(steps[-1]).open(encoding="utf-8", errors="replace") as lines:
        first = lines.readline()
    try:
        record = json.loads(first)
    except json.JSONDecodeError:
        return False
    return isinstance(record, dict) and record.get("loss_mask") is not None


def newest_episode_run(runs_dir: Path) -> Path | None:
    """The run under `runs_dir` that logged last among those whose saved rollouts are episodes; None if none is."""
    kept = [run for run in find_runs(runs_dir) if saves_episodes(run)]
    return kept[-1] if kept else None
