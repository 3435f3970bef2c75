"""The `ema` teacher's weights: an exponential moving average of the student's.

After every optimizer step that was taken, ema <- (1 - rate) * ema + rate * student, from
the initial weights. `torch.lerp` computes exactly that and returns exactly the student at
rate 1 and exactly the old average at rate 0, so those two rates reproduce the `self` and
the `frozen` teacher bit for bit. The average is held in float32 like the student's
master weights; an in-process teacher engine scores with this very module, a vLLM teacher
server is sent a copy after each update (`selfopd.training.weight_checks.sync_weights`).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch


class EmaWeights:
    """A frozen copy of the student (same architecture, same parameter names) that follows it."""

    def __init__(self, model: Any, rate: float) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"EMA rate must be in [0, 1], got {rate}")
        self.model = model
        self.rate = rate

    def _pairs(self, student: Any) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        mine = dict(self.model.named_parameters())
        theirs = dict(student.named_parameters())
        if mine.keys() != theirs.keys():
            raise ValueError(f"the EMA copy and the student differ in parameters: "
                             f"{sorted(mine.keys() ^ theirs.keys())[:3]}")
        return [(name, mine[name], theirs[name]) for name in mine]

    @torch.no_grad()
    def update(self, student: Any) -> None:
        """One step of the average toward the student's current weights."""
        for _, average, current in self._pairs(student):
            average.lerp_(current.detach().to(average.dtype), self.rate)

    @torch.no_grad()
    def distance(self, student: Any) -> float:
        """||ema - student|| / ||student|| over every parameter (0: the same weights)."""
        gap = norm = 0.0
        for _, average, current in self._pairs(student):
            gap += (average.double() - current.detach().double()).square().sum().item()
            norm += current.detach().double().square().sum().item()
        return (gap / norm) ** 0.5 if norm else 0.0

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The averaged parameters, on the CPU (a checkpoint's)."""
        return {name: param.detach().to("cpu", copy=True) for name, param in self.model.named_parameters()}

    @torch.no_grad()
    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Restore a checkpoint's average; every parameter must be there."""
        params = dict(self.model.named_parameters())
        if params.keys() != state.keys():
            raise ValueError(f"the checkpoint's EMA weights do not match the model: {sorted(params.keys() ^ state.keys())[:3]}")
        for name, param in params.items():
            param.copy_(state[name])
