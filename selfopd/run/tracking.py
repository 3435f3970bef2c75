"""Where a run's metrics go: always `RUN/metrics.jsonl` (the record every selfopd tool reads),
and TensorBoard or Weights & Biases when `run.trackers` names them, so a run can be watched
where researchers watch runs.

    [run]
    trackers = ["tensorboard", "wandb"]   # tensorboard --logdir runs/ ; wandb sync runs/NAME/wandb/...
    wandb_mode = "offline"                # the default: no network, sync later

A resumed run truncates metrics.jsonl to its checkpoint and logs the re-run steps again;
TensorBoard shows the latest value of a repeated step, W&B keeps the first (it refuses to go
back in steps): metrics.jsonl is the reference. Its lines are whole and unique by
(step, kind) across any sequence of kills and resumes: each is one write of the full line,
fsynced, and the truncation on resume drops a torn last line and rewrites the file atomically.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from pathlib import Path
from typing import Any, Iterator, Mapping

from selfopd.core.atomic import write_lines_atomic
from selfopd.config import TrainConfig, config_to_dict
from selfopd.core.faults import fault_point
from selfopd.core.run_folder import RunFolder


class MetricsLog:
    """Append-only metrics of one run: one JSON line per step or eval, mirrored to trackers."""

    def __init__(self, folder: RunFolder, config: TrainConfig) -> None:
        self.path = folder.metrics
        self.trackers: list[Any] = []
        for name in config.run.trackers:
            self.trackers.append(_TRACKERS[name](folder, config))

    def truncate_after(self, step: int) -> list[dict]:
        """On resume: keep what was logged up to the checkpoint's step, once per (step, kind)
        (the later steps run again); a torn last line of a killed write is dropped. Returns
        the lines kept."""
        from selfopd.core.plots import read_metrics  # matplotlib: loaded only when a run resumes

        if not self.path.exists():
            return []
        kept: dict[tuple[int, str], dict] = {}
        for line in read_metrics(self.path):
            if line["step"] <= step:
                kept[metrics_key(line)] = line
        fault_point("metrics.truncate")
        write_lines_atomic(self.path, kept.values())
        return list(kept.values())

    def log(self, metrics: dict[str, float]) -> None:
        """Append one whole line: a single write of it, flushed to disk before trackers see it."""
        with self.path.open("a") as handle:
            handle.write(json.dumps(metrics) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        fault_point("metrics.logged")
        scalars = {k: float(v) for k, v in metrics.items()
                   if k != "step" and isinstance(v, (int, float)) and math.isfinite(v)}
        for tracker in self.trackers:
            tracker.log(int(metrics["step"]), scalars)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []


def metrics_key(line: dict) -> tuple[int, str]:
    """What makes a metrics line unique: its step, and whether it is an eval ("eval") or a
    training step ("train"): the eval after step N shares step N with that step's line."""
    return int(line["step"]), "eval" if any(key.startswith("eval/") for key in line) else "train"


class _TensorBoard:
    def __init__(self, folder: RunFolder, config: TrainConfig) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(folder.tensorboard))
        self.writer.add_text("config", "```toml\n" + folder.config.read_text() + "\n```"
                             if folder.config.is_file() else json.dumps(config_to_dict(config)))

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _WandB:
    def __init__(self, folder: RunFolder, config: TrainConfig) -> None:
        import wandb

        folder.wandb.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=config.run.wandb_project, name=config.run.name, dir=str(folder.root),
                              mode=config.run.wandb_mode, config=config_to_dict(config), resume="allow",
                              id=_wandb_id(folder.root), reinit="create_new")
        self.last_step = -1

    def log(self, step: int, scalars: dict[str, float]) -> None:
        if step < self.last_step:  # a resumed run logs its re-run steps again; W&B refuses to go back
            return
        self.run.log(scalars, step=step)
        self.last_step = step

    def close(self) -> None:
        self.run.finish()


def _wandb_id(root: Path) -> str:
    """A stable W&B run id per run folder, so a resumed run continues the same W&B run."""
    import hashlib

    return hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:16]


_TRACKERS = {"tensorboard": _TensorBoard, "wandb": _WandB}


TIMED = ("time/", "throughput/", "memory/")  # metrics that depend on the machine's speed and load


def untimed(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """A metrics line less its timings, rates and memory (`TIMED`): what two runs of the same steps agree on."""
    return {key: value for key, value in metrics.items() if not key.startswith(TIMED)}


class PhaseTimer:
    """Wall seconds per named phase of a step, and what the phases do not account for."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.started = time.perf_counter()

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def as_metrics(self) -> dict[str, float]:
        total = time.perf_counter() - self.started
        metrics = {f"time/{name}": seconds for name, seconds in self.seconds.items()}
        metrics["time/step"] = total
        metrics["time/overhead"] = total - sum(self.seconds.values())
        return metrics
