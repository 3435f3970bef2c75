"""An episode's environment tokens are context, never trained: the student's step masks them out of
the loss (`Rollout.loss_mask`, `selfopd.training.step.student_mask`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from selfopd.config import load_config
from selfopd.engines.base import Rollout
from selfopd.run.tracking import PhaseTimer
from selfopd.training.step import forward_backward
from selfopd.training.teacher import Scored
from selfopd.training.trainer import build_run

SMALL = [
    "data.spec=rg:chain_sum?min_terms=2&max_terms=2&size=60&seed=2",
    "data.eval_size=4",
    "rollout.prompts_per_step=2",
    "rollout.samples_per_prompt=2",
    "rollout.max_tokens=6",
    "optim.micro_batch_prompts=1",
    "run.progress=false",
    "run.eval_every=0",
]
# Student turn (3 ids), the environment's reply (3 ids), student turn (2 ids).
MASK = (True, True, True, False, False, False, True, True)
ENVIRONMENT = [i for i, own in enumerate(MASK) if not own]


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_model_dir):
    out = tmp_path_factory.mktemp("episode")
    config = load_config(None, [*SMALL, f"model.student={tiny_model_dir}", f"run.out_dir={out}", "run.name=mask"])
    return build_run(config)


def _scored(run, teacher_lp: torch.Tensor, mask: tuple[bool, ...] | None) -> list[Scored]:
    generator = torch.Generator().manual_seed(0)
    vocab = run.model.config.vocab_size
    prompt = torch.randint(3, vocab, (5,), generator=generator).tolist()
    completion = torch.randint(3, vocab, (len(MASK),), generator=generator).tolist()
    sampler = [-1.0 if own else 0.0 for own in MASK]
    rollout = Rollout(prompt, completion, sampler, "stop", "text", loss_mask=mask)
    return [Scored(run.train_examples[0], 0, rollout, 1.0, True, teacher_lp, prompt)]


def _gradients(run, scored: list[Scored]) -> dict[str, torch.Tensor]:
    run.model.zero_grad(set_to_none=True)
    forward_backward(run, scored, [], PhaseTimer())
    gradients = {n: p.grad.detach().clone() for n, p in run.model.named_parameters() if p.grad is not None}
    run.model.zero_grad(set_to_none=True)
    return gradients


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_environment_tokens_change_no_gradient(run):
    teacher = -torch.rand(len(MASK), generator=torch.Generator().manual_seed(1)) * 3
    other = teacher.clone()
    other[ENVIRONMENT] = torch.tensor([-9.0, 0.0, -0.1])  # the teacher's view of the environment's ids
    masked = _gradients(run, _scored(run, teacher, MASK))
    assert masked and any(g.abs().sum() > 0 for g in masked.values())
    assert _same(masked, _gradients(run, _scored(run, other, MASK)))


def test_a_student_token_and_an_unmasked_episode_do_change_it(run):
    """The test above can fail: the same change on a student token, or no mask, moves the gradient."""
    teacher = -torch.rand(len(MASK), generator=torch.Generator().manual_seed(1)) * 3
    masked = _gradients(run, _scored(run, teacher, MASK))
    student_changed = teacher.clone()
    student_changed[1] = -9.0
    assert not _same(masked, _gradients(run, _scored(run, student_changed, MASK)))
    other = teacher.clone()
    other[ENVIRONMENT] = torch.tensor([-9.0, 0.0, -0.1])
    assert not _same(_gradients(run, _scored(run, teacher, None)), _gradients(run, _scored(run, other, None)))


def test_a_loss_mask_must_cover_every_completion_id():
    with pytest.raises(ValueError, match="loss_mask has 2 entries for 3 completion ids"):
        Rollout([1], [2, 3, 4], [0.0] * 3, "stop", "", loss_mask=(True, False))
    assert Rollout([1], [2, 3, 4], [0.0] * 3, "stop", "", loss_mask=(True, False, True)).student_tokens == 2
    assert Rollout([1], [2, 3, 4], [0.0] * 3, "stop", "").student_tokens == 3
    episode = Rollout([1], [2, 3, 4], [0.0] * 3, "stop", "", loss_mask=(True, False, True))
    assert torch.equal(episode.students_part(torch.tensor([1.0, 2.0, 3.0])), torch.tensor([1.0, 3.0]))
    assert torch.equal(episode.on_completion(torch.tensor([1.0, 3.0])), torch.tensor([1.0, 0.0, 3.0]))
