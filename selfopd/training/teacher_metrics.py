"""Each teacher's part of a training step, when a run has several (`[teachers.NAME]` beside `[teacher]`;
which teacher scores an example is `selfopd.data.routing`). Per step, each teacher's share of the
completion tokens, its mean advantage, KL and teacher-prefers-correct are logged (`teacher_metrics`),
and a teacher that gets no tokens for `guard.starved_teacher_steps` steps in a row is warned about
(`starved_teachers`): a starved teacher's other metrics are silent, not healthy.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import torch

from selfopd.training.loss_metrics import preference_metrics


def teacher_metrics(names: Iterable[str], teacher_of: Sequence[str], lengths: Sequence[int],
                    signal_N: torch.Tensor, aligned: Sequence[bool],
                    outcomes: Sequence[tuple[int, bool]]) -> dict[str, float]:
    """Per teacher, over the step's rollouts it scored (`teacher_of[i]` scored rollout i, of
    `lengths[i]` completion tokens, whose per-token signal teacher - student is `signal_N`'s slice):
      teacher/NAME/token_share      its share of the step's completion tokens (0: starved)
      teacher/NAME/advantage_mean   mean teacher - student logprob over its tokens (absent with none)
      teacher/NAME/reverse_kl       mean student - teacher logprob: the sampled reverse KL
      teacher/NAME/correct_preference  teacher-prefers-correct over its prompt groups (as opd/...)
    A completion it could not read (`aligned` False) counts in its share, not in its means."""
    total = sum(lengths)
    pieces = signal_N.double().split(list(lengths))
    metrics: dict[str, float] = {}
    for name in names:
        mine = [i for i, t in enumerate(teacher_of) if t == name]
        tokens = sum(lengths[i] for i in mine)
        metrics[f"teacher/{name}/token_share"] = tokens / total if total else 0.0
        read = [pieces[i] for i in mine if aligned[i] and lengths[i]]
        if read:
            signal = torch.cat(read)
            metrics[f"teacher/{name}/advantage_mean"] = signal.mean().item()
            metrics[f"teacher/{name}/reverse_kl"] = -signal.mean().item()
        preference = preference_metrics((outcomes[i][0], outcomes[i][1], pieces[i].mean().item())
                                        for i in mine if aligned[i] and lengths[i])
        if "opd/correct_preference" in preference:
            metrics[f"teacher/{name}/correct_preference"] = preference["opd/correct_preference"]
    return metrics


def starved_teachers(history: Sequence[Mapping[str, float]], names: Iterable[str], steps: int) -> list[str]:
    """The teachers whose token share was 0 in each of the last `steps` training steps (0: never)."""
    if steps <= 0 or len(history) < steps:
        return []
    recent = history[-steps:]
    return [name for name in names
            if all(line.get(f"teacher/{name}/token_share", 1.0) == 0.0 for line in recent)]
