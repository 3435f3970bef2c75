"""Torch files from a run folder (trainer states, fine-tuning checkpoints) read as data only.

`torch.load(weights_only=True)` rebuilds tensors, numbers, strings and containers, and the plain
record classes a caller names, and refuses anything else a pickle asks for: a file made elsewhere
can hold a pickle that runs a command when loaded, which selfopd never runs."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any, Sequence

from selfopd.core.run_folder import CheckpointError


def load_data(path: Path, what: str, advice: str, records: Sequence[type] = ()) -> Any:
    """What the torch file at `path` holds, read as data (`records`: plain dataclasses it may
    hold); a file that holds anything else, or is damaged, is one CheckpointError naming it as
    `what`, ending with `advice`."""
    import torch

    try:
        with torch.serialization.safe_globals(list(records)):
            return torch.load(path, weights_only=True, map_location="cpu")
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError) as error:
        raise CheckpointError(f"{path}: not {what} selfopd reads ({type(error).__name__}: {_reason(error)}); only "
                              f"tensors, numbers, text and lists are read from it, never code; {advice}") from None


def _reason(error: BaseException) -> str:
    """The part of torch's message that says what the file asked for (not its advice to load it unsafely)."""
    parts = [part.strip() for part in str(error).split("\n\n") if part.strip()]
    middle = [part for part in parts if not part.startswith(("Weights only load failed", "Check the documentation"))]
    reason = " ".join(middle or parts[:1]).replace("\n", " ")
    return reason.split("WeightsUnpickler error:")[-1].strip()[:200]
