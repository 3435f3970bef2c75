"""The fine-tuning loop of `selfopd sft` and its checkpoints: what it takes to stop it at any
step (a kill included) and continue it to exactly the model an uninterrupted run makes."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from selfopd.core.atomic import replace_atomic
from selfopd.core.faults import fault_point
from selfopd.comparisons.sft_targets import Target, TargetStats


def completion_nll(model: Any, targets: Sequence[Target], pad_id: int, batch_size: int = 64) -> float:
    """Mean negative log-likelihood per completion token of `targets` (no grad, eval mode)."""
    import torch

    from selfopd.engines.scoring import completion_logprobs

    was_training = model.training
    model.eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(targets), batch_size):
            chunk = targets[start : start + batch_size]
            logprobs, mask = completion_logprobs(model, [(t.prompt_ids, t.completion_ids) for t in chunk], pad_id)
            total -= float((logprobs * mask).sum())
            tokens += int(mask.sum())
    model.train(was_training)
    return total / max(tokens, 1)


@dataclass
class SftState:
    """A fine-tuning after `step` optimizer steps: with the weights, enough to continue exactly."""

    step: int = 0
    losses: list[float] = dataclasses.field(default_factory=list)
    optimizer: dict[str, Any] | None = None  # AdamW's state_dict
    rng: Any = None  # torch's CPU generator state


def train_sft(model: Any, targets: Sequence[Target], pad_id: int, config: Any, progress: bool = True,
              state: SftState | None = None, save: Callable[[SftState], None] | None = None) -> list[float]:
    """Cross-entropy on completion tokens only (the prompt is context, never a target), AdamW,
    seeded shuffles per epoch; returns the loss of every step. `config`: a `selfopd.comparisons.sft.SftConfig`
    (not imported: that module imports this one). `state`: a checkpoint's (its weights already
    in `model`) to continue from; `save` gets the state every `sft.checkpoint_every` steps."""
    import torch
    from tqdm.auto import tqdm

    from selfopd.engines.scoring import completion_logprobs

    sft, optim, seed = config.sft, config.train.optim, config.train.run.seed
    state = state or SftState()
    if state.rng is None:
        torch.manual_seed(seed)
    else:
        torch.set_rng_state(state.rng)
    optimizer = torch.optim.AdamW(model.parameters(), lr=sft.lr, weight_decay=optim.weight_decay)
    if state.optimizer is not None:
        optimizer.load_state_dict(state.optimizer)
    batches = _batches(len(targets), sft.batch_size, sft.epochs, seed)
    losses = list(state.losses)
    model.train()
    bar = tqdm(total=len(batches), initial=state.step, desc="sft", unit="step", disable=not progress)
    for step, (epoch, indices) in enumerate(batches[state.step :], start=state.step + 1):
        batch = [targets[i] for i in indices]
        logprobs, mask = completion_logprobs(model, [(t.prompt_ids, t.completion_ids) for t in batch], pad_id)
        loss = -(logprobs * mask).sum() / mask.sum()
        loss.backward()
        if optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), optim.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        fault_point("sft.step")
        if save is not None and sft.checkpoint_every and step % sft.checkpoint_every == 0 and step < len(batches):
            save(SftState(step, list(losses), optimizer.state_dict(), torch.get_rng_state()))
        bar.set_postfix(epoch=epoch + 1, loss=f"{losses[-1]:.3f}")
        bar.update(1)
    bar.close()
    model.eval()
    return losses


def _batches(count: int, batch_size: int, epochs: int, seed: int) -> list[tuple[int, list[int]]]:
    """(epoch, target indices) of every optimizer step: a seeded shuffle per epoch, so the
    order depends only on the seed and a resumed fine-tuning sees the same batches."""
    batches = []
    for epoch in range(epochs):
        order = list(range(count))
        random.Random(f"{seed}/sft/{epoch}").shuffle(order)
        batches.extend((epoch, order[start : start + batch_size]) for start in range(0, count, batch_size))
    return batches


@dataclass(frozen=True)
class Prelude:
    """What a fine-tuning computes before its first step, kept in its checkpoints so that a
    continued run trains on exactly these targets and reports this base eval."""

    base: Any
    base_records: list[Any]
    targets: list[Target]
    stats: Any  # TargetStats
    nll_before: float
    seconds: dict[str, float]


@dataclass(frozen=True)
class SftCheckpoint:
    """An interrupted fine-tuning: the settings it runs with, its weights, what it computed
    before training and where training stands."""

    settings: dict[str, Any]
    model: dict[str, Any]  # the model's state_dict
    prelude: Prelude
    state: SftState


def write_checkpoint(path: Path, checkpoint: SftCheckpoint) -> None:
    """One file, written under a temporary name and renamed into place: whole or absent."""
    import torch

    def write(temporary: Path) -> None:
        torch.save(checkpoint, temporary)
        fault_point("sft.checkpoint")

    replace_atomic(path, write)


def read_checkpoint(path: Path) -> SftCheckpoint | None:
    """The checkpoint at `path` (None: none), written by `write_checkpoint`, read as data
    (`selfopd.core.torch_files`: tensors, numbers, containers and the plain records below, never
    anything that runs code); a file that holds more, or is damaged, is one CheckpointError."""
    if not path.is_file():
        return None
    from selfopd.core.run_folder import CheckpointError
    from selfopd.core.stats import MeanEstimate, Proportion
    from selfopd.core.torch_files import load_data
    from selfopd.run.evaluate import EvalRecord

    advice = "delete it to start the fine-tuning again"
    records = [SftCheckpoint, Prelude, SftState, Target, TargetStats, EvalRecord, Proportion, MeanEstimate]
    checkpoint = load_data(path, "a fine-tuning checkpoint", advice, records)
    if not isinstance(checkpoint, SftCheckpoint):
        raise CheckpointError(f"{path}: not a fine-tuning checkpoint (it holds a {type(checkpoint).__name__}); {advice}")
    return checkpoint
