"""The `[run]` section of a training config: the run's name and folder, its length, evals,
checkpoints (their format: gathered or sharded) and where its metrics go. Part of
`selfopd.config`, which re-exports it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from selfopd.config.settings import (MAX_ITEMS, MAX_SEED, MAX_STEPS, Section, check_folder_name, check_printable, fail,
                                     setting)

Tracker = Literal["tensorboard", "wandb"]
WandbMode = Literal["offline", "online"]
CheckpointFormat = Literal["gathered", "sharded"]


@dataclass(frozen=True)
class RunConfig(Section):
    SECTION: ClassVar[str] = "run"
    name: str = setting("run", "Name of the run: its folder is OUT_DIR/NAME.")
    out_dir: str = setting("runs", "Folder that holds run folders.")
    seed: int = setting(0, "Seeds sampling, data order and the init of anything random.", ge=0, most=MAX_SEED)
    steps: int = setting(20, "Optimizer steps to take.", ge=1, most=MAX_STEPS)
    eval_every: int = setting(10, "Greedy held-out eval every N steps (0: only at the start and the end).", ge=0,
                              most=MAX_STEPS)
    checkpoint_every: int = setting(0, "HF checkpoint plus trainer state every N steps (0: only at the end).", ge=0,
                                    most=MAX_STEPS)
    checkpoint_format: CheckpointFormat = setting(
        "gathered", "'gathered': rank 0 gathers the weights and optimizer state and writes HF weights plus "
        "trainer_state.pt, the training waiting meanwhile. 'sharded': every rank writes its own shard with "
        "torch.distributed.checkpoint (RUN/checkpoints/step_N/dcp/), resumable on another number of ranks; HF "
        "weights only every run.export_every steps and at the last step.")
    checkpoint_async: bool = setting(
        True, "With run.checkpoint_format = 'sharded': the shards are copied to memory, then written in the "
        "background while training goes on; the checkpoint counts (is renamed into place) once the write "
        "finishes. A stop signal or the run's end waits for it.")
    export_every: int = setting(
        0, "With run.checkpoint_format = 'sharded': HF weights (gathered to rank 0, loadable by transformers and "
        "vLLM) in the checkpoints of every N steps (0: the last step's only).", ge=0, most=MAX_STEPS)
    keep_checkpoints: int = setting(
        1, "Checkpoints kept: the latest N (besides those of steps where the illusion guard fired).", ge=1,
        most=MAX_STEPS)
    keep_best_checkpoint: bool = setting(
        False, "Also keep the checkpoint with the best in-run eval accuracy so far (ties: the earlier step); only "
        "steps both evaluated and checkpointed compete (run.eval_every, run.checkpoint_every).")
    rollouts_to_save: int = setting(
        32, "Rollouts kept per step under OUT_DIR/NAME/rollouts/ for `selfopd diagnose` and notebooks (0: none).",
        ge=0, most=MAX_ITEMS)
    progress: bool = setting(True, "Show a progress bar.")
    trackers: tuple[Tracker, ...] = setting(
        (), "Where metrics go besides RUN/metrics.jsonl: 'tensorboard' (RUN/tensorboard/), 'wandb' (RUN/wandb/).")
    wandb_project: str = setting("selfopd", "wandb: the W&B project of the run.")
    wandb_mode: WandbMode = setting("offline", "wandb: 'offline' (no network; `wandb sync` later) or 'online'.",
                                    guarded="'online' sends the run's metrics over the network")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_folder_name(self._key("name"), self.name)
        self._non_empty("out_dir")
        check_printable(self._key("out_dir"), self.out_dir, allow="")  # a path on one line, as every message shows it
        if len(set(self.trackers)) != len(self.trackers):
            fail(self._key("trackers"), f"names a tracker twice: {list(self.trackers)}")
