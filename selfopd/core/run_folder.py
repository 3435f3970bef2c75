"""Where everything of a training run lives: the one definition of the run-folder layout.

    RUN/config.toml                  the full config (loads to the run's TrainConfig)
    RUN/config.sig                   this user's signature of it (selfopd.core.folder_key)
    RUN/split.json                   held-out prompt ids and keys, every training prompt's key
    RUN/metrics.jsonl                one JSON line per step and per eval
    RUN/eval/step_NNNNN/             eval.jsonl (per prompt), then summary.json (present: finished)
    RUN/rollouts/step_NNNNN.jsonl    saved rollouts with per-token logprobs
    RUN/checkpoints/step_NNNNN/      HF weights (LoRA: adapters) + tokenizer + trainer_state.pt
                                     (written as .step_NNNNN.partial, then renamed); the latest
                                     run.keep_checkpoints kept, the best eval's with
                                     run.keep_best_checkpoint, and the guard's steps
    RUN/plots/  RUN/diagnostics/  RUN/logs/ (launched servers)  RUN/tensorboard/ RUN/wandb/
    RUN/guard.json  RUN/guard.md     the illusion guard's events (selfopd.training.guard), when it fired
    RUN/finished.json                written by `selfopd compare` when the run is done
    RUN/.lock                        flock + PID of the process writing the run (selfopd.run.folder_guard)

Every module asks here for a path instead of spelling it. Every file is written whole or not
at all (`selfopd.core.atomic`; metrics.jsonl one whole line per write), so a run killed at any
moment resumes from its last checkpoint (`selfopd train --resume`) with nothing torn.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from selfopd.core.file_checks import checkpoint_problem
from selfopd.core.atomic import write_text_atomic
from selfopd.core.folder_key import sign_config, signed_by_user
from selfopd.core.models import ModelError

if TYPE_CHECKING:
    from selfopd.config import TrainConfig


class RunFolderError(ModelError):
    """A run folder's file that is damaged, altered, or not what selfopd wrote there."""


class CheckpointError(RunFolderError):
    """A run's checkpoint that cannot be resumed from: incomplete, damaged, or holding more than data."""


@dataclass(frozen=True)
class RunFolder:
    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    @classmethod
    def of(cls, out_dir: str | Path, name: str) -> RunFolder:
        return cls(Path(out_dir) / name)

    @property
    def config(self) -> Path:
        return self.root / "config.toml"

    def write_config(self, config_toml: str) -> None:
        """config.toml of a fresh run, with this user's signature of it (`selfopd.core.folder_key`)."""
        signature = sign_config(config_toml)
        if signature is not None:
            write_text_atomic(self.signature, signature)
        write_text_atomic(self.config, config_toml)

    @property
    def signature(self) -> Path:
        """This user's signature of config.toml (`selfopd.core.folder_key`), written with it."""
        return self.root / "config.sig"

    @property
    def split(self) -> Path:
        return self.root / "split.json"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def evals(self) -> Path:
        return self.root / "eval"

    def eval_dir(self, step: int) -> Path:
        return self.evals / f"step_{step:05d}"

    def eval_steps(self) -> list[int]:
        """Steps with a finished eval (its summary.json, written last), in order."""
        return sorted(int(path.parent.name.removeprefix("step_")) for path in self.evals.glob("step_*/summary.json"))

    @property
    def rollouts(self) -> Path:
        return self.root / "rollouts"

    def rollouts_file(self, step: int) -> Path:
        return self.rollouts / f"step_{step:05d}.jsonl"

    def rollout_steps(self) -> list[int]:
        """Steps with saved rollouts, in order."""
        return sorted(int(path.stem.removeprefix("step_")) for path in self.rollouts.glob("step_*.jsonl"))

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / f"step_{step:05d}"

    def checkpoint_staging(self, step: int) -> Path:
        """Where a checkpoint is written before it is renamed into place (never read)."""
        return self.checkpoints / f".step_{step:05d}.partial"

    def checkpoint_folders(self) -> list[Path]:
        """Every checkpoint folder, oldest first, complete or not (staging folders never match; a link is
        no checkpoint, see `refuse_links`)."""
        return sorted(path for path in self.checkpoints.glob("step_*") if path.is_dir() and not path.is_symlink())

    def complete_checkpoints(self) -> list[Path]:
        """Every complete checkpoint (`checkpoint_problem`), oldest first: one a kill, a full disk or a
        copy cut short is left out."""
        return [path for path in self.checkpoint_folders() if checkpoint_problem(path, self.trainer_state(path)) is None]

    def latest_checkpoint(self) -> Path | None:
        """The newest complete checkpoint (None: none)."""
        return next((path for path in reversed(self.checkpoint_folders())
                     if checkpoint_problem(path, self.trainer_state(path)) is None), None)

    def kept_checkpoint(self, step: int) -> Path:
        """The complete checkpoint of `step` (`selfopd eval --run RUN --step S`), else one line naming
        the steps whose checkpoints the run keeps (run.keep_checkpoints)."""
        complete = self.complete_checkpoints()
        if self.checkpoint(step) in complete:
            if not any(self.checkpoint(step).glob("*.safetensors")):  # run.checkpoint_format = 'sharded'
                exported = [path for path in complete if any(path.glob("*.safetensors"))]
                raise CheckpointError(f"{self.checkpoint(step)}: holds sharded weights only (run.checkpoint_format = "
                                      "'sharded' exports HF weights every run.export_every steps and at the last); "
                                      f"steps with HF weights: {checkpoint_steps_text(exported)}")
            return self.checkpoint(step)
        raise CheckpointError(f"{self.checkpoints}: no complete checkpoint of step {step}; steps kept: "
                              f"{checkpoint_steps_text(complete)}")

    def eval_accuracy(self, step: int) -> float | None:
        """The accuracy of the finished eval of `step` (its summary.json; None: no finished eval).
        A summary that is not JSON or whose accuracy is not a number in [0, 1] (a damaged or
        hand-edited file) raises CheckpointError naming the file, not a traceback mid-prune."""
        summary = self.eval_dir(step) / "summary.json"
        if not summary.is_file():
            return None
        try:
            accuracy = json.loads(summary.read_text())["accuracy"]
        except (ValueError, KeyError, TypeError) as error:
            raise CheckpointError(f"{summary}: not an eval summary with an 'accuracy' ({type(error).__name__}: "
                                  f"{error}); fix or delete that eval folder") from None
        if isinstance(accuracy, bool) or not isinstance(accuracy, (int, float)) or not 0 <= accuracy <= 1:
            raise CheckpointError(f"{summary}: 'accuracy' is {accuracy!r}, not a number in [0, 1]; fix or delete "
                                  "that eval folder")
        return float(accuracy)

    @staticmethod
    def trainer_state(checkpoint: Path) -> Path:
        return Path(checkpoint) / "trainer_state.pt"

    @property
    def templates(self) -> Path:
        """The texts of the templates the run renders from (selfopd.run.templates)."""
        return self.root / "templates"

    @property
    def plots(self) -> Path:
        return self.root / "plots"

    @property
    def diagnostics(self) -> Path:
        return self.root / "diagnostics"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    @property
    def wandb(self) -> Path:
        return self.root / "wandb"

    @property
    def guard_events(self) -> Path:
        return self.root / "guard.json"

    @property
    def guard_notes(self) -> Path:
        return self.root / "guard.md"

    @property
    def finished(self) -> Path:
        return self.root / "finished.json"

    def is_run(self) -> bool:
        return self.config.is_file()


# What selfopd never reads in a run folder: a tracker's own files (wandb links its latest run).
UNREAD_FOLDERS = ("wandb",)


def refuse_links(folder: RunFolder) -> None:
    """A run folder selfopd resumes, evaluates or diagnoses holds no links (but in UNREAD_FOLDERS): one
    could send a read elsewhere, or a write and checkpoint pruning into another folder. The root may be
    a link: the user named it."""
    for top, folders, files in os.walk(folder.root):
        if Path(top) == folder.root:
            folders[:] = [name for name in folders if name not in UNREAD_FOLDERS]
        for name in folders + files:
            path = Path(top) / name
            if path.is_symlink():
                raise CheckpointError(f"{path}: a link (to {os.readlink(path)}), which selfopd does not follow in a "
                                      f"run folder: it reads, writes and deletes only real files and folders inside "
                                      f"{folder.root}; replace the link with a copy of what it points to")


def checkpoint_step(checkpoint: Path) -> int:
    """The step of a checkpoint folder (RUN/checkpoints/step_NNNNN)."""
    return int(Path(checkpoint).name.removeprefix("step_"))


def checkpoint_steps_text(checkpoints: Sequence[Path]) -> str:
    """'3, 4' for the checkpoints of steps 3 and 4 ('none' for none): how messages and summaries list them."""
    return ", ".join(str(checkpoint_step(path)) for path in checkpoints) or "none"


def portable_path(path: str | Path) -> str:
    """A path as result files store it: relative to the current directory when it lies inside
    it (results then read the same on every machine and checkout), else unchanged."""
    path = Path(path)
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


TRUST_REMOTE_CODE = "model.trust_remote_code"  # never taken from a folder, even one this user wrote


def guarded_values(config: TrainConfig) -> Iterator[tuple[str, str, Any, Any]]:
    """(key, why, value, default) of every setting a run folder from elsewhere may not decide
    (`setting(..., guarded=...)`): launch, network, code and data-source settings."""
    from selfopd.config import KEYED_SECTIONS, SECTIONS

    sections = [(name, getattr(config, name)) for name in SECTIONS]
    sections += [(f"{field}.{name}", table) for field in KEYED_SECTIONS for name, table in getattr(config, field).items()]
    for prefix, section in sections:
        for f in dataclasses.fields(section):
            if "guarded" in f.metadata:
                default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
                yield f"{prefix}.{f.name}", f.metadata["guarded"], getattr(section, f.name), default


def _as_set(key: str, value: Any) -> str:
    """`--set KEY=VALUE` as a shell takes it."""
    text = str(value).lower() if isinstance(value, bool) else str(value)
    return f"--set {shlex.quote(f'{key}={text}')}"


def load_run_config(run_dir: str | Path, overrides: Sequence[str] = ()) -> TrainConfig:
    """A run folder's config.toml with the command line's `overrides` (`--resume`, `eval --run`,
    `diagnose`). The folder is data, not code (docs/security.md): it holds no links (`refuse_links`),
    and a guarded setting (one that starts processes, imports code, names a host, URL or environment
    variable, or a data source) whose value is not its default is taken only when the command line
    restates it or this user's selfopd wrote the folder (`selfopd.core.folder_key`);
    model.trust_remote_code only when the command line sets it."""
    from selfopd.config import ConfigError, load_config
    from selfopd.config.checks import escaped

    folder = RunFolder(Path(run_dir))
    refuse_links(folder)
    config = load_config(folder.config, overrides)
    restated = {override.partition("=")[0].strip() for override in overrides}
    written = load_config(folder.config, resolve=False)
    unrestated = [(key, why, value) for key, why, value, default in guarded_values(written)
                  if value != default and key not in restated]
    for key, why, value in unrestated:
        if key == TRUST_REMOTE_CODE:
            raise ConfigError(key, f"true in the run folder's config, which selfopd never takes from a folder ({why}): "
                              f"pass --set {key}=true if you trust them", source=str(folder.config))
    if unrestated and not signed_by_user(folder.config, folder.signature):
        (key, why, value), others = unrestated[0], [key for key, _, _ in unrestated[1:]]
        also = f" (it also sets {', '.join(others)}, which need the same)" if others else ""
        raise ConfigError(key, escaped(f"{value!r} in a run folder this user's selfopd did not write (unsigned, "
                                       f"altered, or another user's), which decides no such setting ({why}): "
                                       f"{_as_set(key, value)} to accept it{also}"), source=str(folder.config))
    return config
