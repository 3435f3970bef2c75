"""Where a run's metrics go: always `RUN/metrics.jsonl` (the record every selfopd tool reads),
and TensorBoard or Weights & Biases when `run.trackers` names them, so a run can be watched
where researchers watch runs.

    [run]
    trackers = ["tensorboard", "wandb"]   # tensorboard --logdir runs/ ; wandb sync runs/NAME/wandb/...
    wandb_mode = "offline"                # the default: no network, sync later

A resumed run truncates metrics.jsonl to its checkpoint and logs the re-run steps again;
TensorBoard shows the latest value of a repeated step, W&B keeps the first (it refuses to go
back in steps): metrics.jsonl is the reference.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from selfopd.config import TrainConfig, config_to_dict
from selfopd.run_folder import RunFolder


class MetricsLog:
    """Append-only metrics of one run: one JSON line per step or eval, mirrored to trackers."""

    def __init__(self, folder: RunFolder, config: TrainConfig) -> None:
        self.path = folder.metrics
        self.trackers: list[Any] = []
        for name in config.run.trackers:
            self.trackers.append(_TRACKERS[name](folder, config))

    def truncate_after(self, step: int) -> None:
        """On resume: drop what was logged after the checkpoint's step (those steps run again)."""
        if self.path.exists():
            lines = [line for line in self.path.read_text().splitlines() if json.loads(line)["step"] <= step]
            self.path.write_text("".join(line + "\n" for line in lines))

    def log(self, metrics: dict[str, float]) -> None:
        with self.path.open("a") as handle:
            handle.write(json.dumps(metrics) + "\n")
        scalars = {k: float(v) for k, v in metrics.items()
                   if k != "step" and isinstance(v, (int, float)) and math.isfinite(v)}
        for tracker in self.trackers:
            tracker.log(int(metrics["step"]), scalars)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []


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
