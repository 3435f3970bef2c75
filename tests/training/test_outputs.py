"""selfopd.training.outputs: the checkpoints a run keeps (run.keep_checkpoints, run.keep_best_checkpoint,
the guard's steps), on real checkpoint folders; a real run keeps them, resumes among them, and each kept
one is a Hugging Face folder that transformers, `selfopd eval --run RUN --step S` and a vLLM server load."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from selfopd.cli import main
from selfopd.config import RunConfig, load_config
from selfopd.core.run_folder import RunFolder
from selfopd.training.outputs import prune_checkpoints
from selfopd.training.trainer import train

SMALL = ["data.spec=rg:chain_sum?min_terms=2&max_terms=2&size=60&seed=2", "data.eval_size=4",
         "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_tokens=6",
         "optim.micro_batch_prompts=1", "optim.lr=1e-3", "eval.max_tokens=6", "eval.batch_size=4", "run.progress=false",
         "model.dtype=float32"]


def _folder(tmp_path: Path, model: Path, steps: range, accuracy: dict[int, float] | None = None) -> RunFolder:
    """A run folder holding a complete checkpoint of each of `steps` (the model's files and a trainer
    state), a staging folder a kill left, and a finished eval of each step `accuracy` names."""
    folder = RunFolder(tmp_path / "run")
    for step in steps:
        shutil.copytree(model, folder.checkpoint(step))
        torch.save({"step": step}, folder.trainer_state(folder.checkpoint(step)))
    folder.checkpoint_staging(steps[-1] + 1).mkdir()
    for step, value in (accuracy or {}).items():
        folder.eval_dir(step).mkdir(parents=True)
        (folder.eval_dir(step) / "summary.json").write_text(json.dumps({"accuracy": value}))
    return folder


def _kept(folder: RunFolder) -> list[str]:
    return sorted(path.name for path in folder.checkpoints.iterdir())


@pytest.mark.parametrize(("keep", "kept"), [(1, ["step_00004"]), (2, ["step_00003", "step_00004"]),
                                            (9, ["step_00001", "step_00002", "step_00003", "step_00004"])])
def test_the_latest_n_are_kept_and_staging_folders_go(tmp_path, tiny_model_dir, keep, kept):
    folder = _folder(tmp_path, tiny_model_dir, range(1, 5))
    prune_checkpoints(folder, folder.checkpoint(4), RunConfig(keep_checkpoints=keep))
    assert _kept(folder) == kept


def test_the_best_eval_s_checkpoint_is_kept_the_earlier_on_a_tie(tmp_path, tiny_model_dir):
    folder = _folder(tmp_path, tiny_model_dir, range(1, 6), accuracy={0: 1.0, 1: 0.5, 2: 0.75, 3: 0.75, 4: 0.25})
    prune_checkpoints(folder, folder.checkpoint(5), RunConfig(keep_best_checkpoint=True))
    assert _kept(folder) == ["step_00002", "step_00005"]  # step 0 (the base model) has no checkpoint
    prune_checkpoints(folder, folder.checkpoint(5), RunConfig(keep_best_checkpoint=False))
    assert _kept(folder) == ["step_00005"]


@pytest.mark.parametrize("summary", ['{"accuracy": "high"}', '{"accuracy": NaN}', '{"n": 4}', "{not json",
                                     '{"accuracy": true}'])
def test_a_damaged_eval_summary_stops_the_prune_in_one_line_keeping_every_checkpoint(tmp_path, tiny_model_dir,
                                                                                   summary):
    from selfopd.core.run_folder import CheckpointError

    folder = _folder(tmp_path, tiny_model_dir, range(1, 4), accuracy={1: 0.5, 2: 0.75})
    path = folder.eval_dir(2) / "summary.json"
    path.write_text(summary)
    with pytest.raises(CheckpointError, match=rf"^{path}: .*fix or delete that eval folder$"):
        prune_checkpoints(folder, folder.checkpoint(3), RunConfig(keep_best_checkpoint=True))
    assert _kept(folder) == [".step_00004.partial", "step_00001", "step_00002", "step_00003"]  # nothing deleted


def test_a_resume_keeps_its_checkpoint_and_the_guard_s_and_drops_a_damaged_newer_one(tmp_path, tiny_model_dir):
    folder = _folder(tmp_path, tiny_model_dir, range(1, 6), accuracy={4: 1.0})
    weights = folder.checkpoint(4) / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # the best eval's checkpoint, damaged: never kept as best
    (folder.checkpoint(5) / "trainer_state.pt").unlink()  # the newest, cut short: the resume falls back to 3
    folder.guard_events.write_text(json.dumps([{"step": 1}]))
    resumed = folder.latest_checkpoint()
    assert resumed == folder.checkpoint(3)
    prune_checkpoints(folder, resumed, RunConfig(keep_checkpoints=2, keep_best_checkpoint=True))
    assert _kept(folder) == ["step_00001", "step_00002", "step_00003"]


def _lines(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _best(folder: RunFolder, steps: range) -> int:
    """The step the best eval of `steps` was at, the earlier on a tie."""
    scores = {step: folder.eval_accuracy(step) for step in steps}
    return min(step for step, value in scores.items() if value == max(scores.values()))


@pytest.mark.slow
def test_a_run_keeps_its_checkpoints_resumes_among_them_and_evaluates_a_kept_step(tmp_path, tiny_model_dir, capsys):
    """4 steps, a checkpoint and an eval each, keep 2 and the best: steps 3, 4 and the best eval's.
    The newest damaged, --resume to 5 steps falls back to step 3; steps 4, 5 and the best are then
    kept. The kept step 4 (not the latest) loads in transformers and `selfopd eval --run --step 4`
    answers as the in-run eval of step 4 did; a step not kept is one line listing the kept ones."""
    sets = [*SMALL, f"model.student={tiny_model_dir}", f"run.out_dir={tmp_path}", "run.name=kept", "run.steps=4",
            "run.eval_every=1", "run.checkpoint_every=1", "run.keep_checkpoints=2", "run.keep_best_checkpoint=true"]
    folder = RunFolder(train(load_config(None, sets)))
    best = _best(folder, range(1, 5))
    assert _kept(folder) == sorted({f"step_{s:05d}" for s in (best, 3, 4)})
    weights = folder.checkpoint(4) / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    first_answers = (folder.eval_dir(4) / "eval.jsonl").read_text()
    capsys.readouterr()
    assert main(["train", "--resume", str(folder.root), "--set", "run.steps=5"]) == 0
    out, err = capsys.readouterr()
    assert f"resuming from {folder.checkpoint(3)}" in err
    best = _best(folder, range(1, 6))
    kept = sorted({best, 4, 5})
    assert _kept(folder) == [f"step_{s:05d}" for s in kept]
    assert f"checkpoints kept: steps {', '.join(map(str, kept))} " in out
    assert [m["step"] for m in _lines(folder.root) if "loss/pg" in m] == [1, 2, 3, 4, 5]

    model = AutoModelForCausalLM.from_pretrained(folder.checkpoint(4))
    latest = AutoModelForCausalLM.from_pretrained(folder.checkpoint(5))
    assert not all(torch.equal(p, latest.state_dict()[n]) for n, p in model.state_dict().items())
    assert main(["eval", "--run", str(folder.root), "--step", "4", "--out", str(tmp_path / "eval")]) == 0
    assert f"{folder.checkpoint(4)} on " in capsys.readouterr().out
    again = [json.loads(line) for line in (tmp_path / "eval" / "eval.jsonl").read_text().splitlines()]
    in_run = [json.loads(line) for line in first_answers.splitlines()]
    assert [r["completion"] for r in again] == [r["completion"] for r in in_run]

    assert main(["eval", "--run", str(folder.root), "--step", "3", "--out", str(tmp_path / "none")]) == 1
    assert capsys.readouterr().err.strip() == (
        f"selfopd: error: {folder.checkpoints}: no complete checkpoint of step 3; steps kept: {', '.join(map(str, kept))}")
    assert not (tmp_path / "none").exists()


@pytest.mark.slow
@pytest.mark.vllm
def test_a_kept_checkpoint_is_served_by_vllm_as_in_process(tmp_path, servable_tiny_model_dir):
    """Step 1's checkpoint, kept beside step 2's (the latest), served as selfopd launches servers:
    its logprobs are the in-process model's of that folder, not the latest step's."""
    from tests.engine_contract import TOLERANCE

    from selfopd.engines.local import LocalEngine
    from selfopd.serving.vllm import VLLMEngine
    from selfopd.serving.server import ServerSpec, free_port, launch_servers

    sets = [*SMALL, f"model.student={servable_tiny_model_dir}", f"run.out_dir={tmp_path}", "run.name=served",
            "run.steps=2", "run.eval_every=0", "run.checkpoint_every=1", "run.keep_checkpoints=2"]
    folder = RunFolder(train(load_config(None, sets)))
    assert _kept(folder) == ["step_00001", "step_00002"]
    local = {step: LocalEngine(AutoModelForCausalLM.from_pretrained(folder.checkpoint(step)),
                               AutoTokenizer.from_pretrained(folder.checkpoint(step))) for step in (1, 2)}
    sequences = [([1, 504, 2254, 30], [9, 16, 28, 1191, 2]), ([17, 18, 19], [42, 43])]
    spec = ServerSpec(name="student", model=str(folder.checkpoint(1)), port=free_port(), max_model_len=256)
    with launch_servers([spec], tmp_path / "logs", timeout_s=900, progress=False) as launched:
        engine = VLLMEngine([launched[0].spec.url])
        try:
            served = engine.score(sequences)
        finally:
            engine.close()
    for step, within in ((1, True), (2, False)):
        gaps = [(s.logprobs - m.logprobs).abs().max().item() for s, m in zip(served, local[step].score(sequences))]
        assert (max(gaps) <= TOLERANCE) == within, (step, gaps)
