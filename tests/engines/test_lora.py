"""LoRA students (selfopd.engines.lora): only the adapters train, a frozen teacher is the same module
with its adapters off, servers get merged weights under the base checkpoint's names, and
checkpoints are adapter folders that resume, load and merge."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from selfopd.cli import main
from selfopd.config import ConfigError, load_config
from selfopd.engines.build import load_model
from selfopd.engines.local import LocalEngine
from selfopd.engines.lora import add_adapters, served_weights
from selfopd.core.models import ModelError
from selfopd.training.trainer import build_run, train, train_step
from selfopd.training.weight_checks import probe_logprobs
from selfopd.run.tracking import untimed
from tests.training.test_trainer import SMALL as TRAINER_SMALL

# The trainer tests' short runs, at a LoRA learning rate.
SMALL = [*TRAINER_SMALL, "optim.lr=1e-2", "model.lora_rank=8"]


def _config(tmp_path: Path, model: Path | str, *extra: str):
    return load_config(None, [*SMALL, f"model.student={model}", f"run.out_dir={tmp_path}", *extra])


def _started(config):
    run = build_run(config)
    run.run_dir.mkdir(parents=True)
    return run


def _is_adapter(name: str) -> bool:
    return ".lora_" in name


def _step_lines(run_dir: Path) -> list[dict]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [untimed(m) for m in lines if "loss/pg" in m]


def test_only_the_adapters_train(tmp_path, tiny_model_dir):
    """Two real trainer steps at rank 8: every base weight is bit-identical, the adapters
    moved, and the optimizer holds the adapters and nothing else."""
    run = _started(_config(tmp_path, tiny_model_dir, "run.name=adapters"))
    before = {name: param.detach().clone() for name, param in run.model.named_parameters()}
    adapters = [param for name, param in run.model.named_parameters() if _is_adapter(name)]
    optimized = [param for group in run.optimizer.param_groups for param in group["params"]]
    assert len(adapters) == len(optimized) == 2 * 7 * 2  # A and B on 7 linear layers x 2 blocks
    assert {id(p) for p in optimized} == {id(p) for p in adapters}
    train_step(run)
    train_step(run)
    changed = {name for name, param in run.model.named_parameters() if not torch.equal(param, before[name])}
    assert changed and all(_is_adapter(name) for name in changed)
    assert all(name in changed for name in before if ".lora_B." in name)  # every B left its zero start


def test_frozen_teacher_is_the_student_module_with_adapters_off(tmp_path, tiny_model_dir):
    run = _started(_config(tmp_path, tiny_model_dir, "teacher.kind=frozen", "run.name=frozen"))
    assert run.teacher.engine.model is run.model  # no second copy of the weights
    train_step(run)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    expected = probe_logprobs(base, run.probe, run.pad_id)
    teacher = run.teacher.engine.score([run.probe])[0].logprobs
    student = run.student_engine.score([run.probe])[0].logprobs
    assert torch.equal(teacher, expected)
    assert (student - expected).abs().max() > 1e-3
    # The teacher's view is entered per call: the student engine is adapted again afterwards.
    assert torch.equal(run.student_engine.score([run.probe])[0].logprobs, student)


def test_merged_weights_carry_base_names_and_reproduce_the_adapted_model(tmp_path, tiny_model_dir):
    """A separate in-process copy of the base, given `served_weights` as a server would be,
    scores like the adapted module; the merge equals peft's own merge_and_unload, and the
    live module is not touched (its adapters still switch off to the base)."""
    run = _started(_config(tmp_path, tiny_model_dir, "run.name=merged"))
    train_step(run)
    train_step(run)
    live = {name: param.detach().clone() for name, param in run.model.named_parameters()}
    weights = served_weights(run.model)
    assert all(torch.equal(param, live[name]) for name, param in run.model.named_parameters())
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert set(weights) == {name for name, _ in base.named_parameters()}
    copy = LocalEngine(base, run.tokenizer)
    copy.update_weights(weights, version=2)
    adapted = probe_logprobs(run.model, run.probe, run.pad_id)
    assert (copy.score([run.probe])[0].logprobs - adapted).abs().max() < 1e-5
    assert (adapted - probe_logprobs(AutoModelForCausalLM.from_pretrained(tiny_model_dir), run.probe, run.pad_id)).abs().max() > 1e-3

    reference = load_model(tiny_model_dir)[0]
    reference = add_adapters(reference, run.config.model, tiny_model_dir)
    reference.load_state_dict(run.model.state_dict())
    merged = reference.merge_and_unload().state_dict()
    for name, tensor in weights.items():
        assert torch.allclose(tensor, merged[name], atol=1e-6), name
    assert all(torch.equal(weights[name], base.get_parameter(name)) for name in weights)  # the copy holds them


@pytest.mark.slow
def test_checkpoint_resume_equals_an_uninterrupted_run(tmp_path, tiny_model_dir):
    whole = train(_config(tmp_path, tiny_model_dir, "run.steps=3", "run.name=whole"))
    part = train(_config(tmp_path, tiny_model_dir, "run.steps=2", "run.name=part", "run.checkpoint_every=1"))
    checkpoint = part / "checkpoints" / "step_00002"
    files = {path.name for path in checkpoint.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "trainer_state.pt", "tokenizer.json"} <= files
    assert "model.safetensors" not in files  # the adapters only, not a second full model
    resumed = train(load_config(part / "config.toml", ["run.steps=3"]), resume=True)
    assert _step_lines(resumed)[-1] == _step_lines(whole)[-1]
    final, again = (load_file(run / "checkpoints" / "step_00003" / "adapter_model.safetensors") for run in (whole, resumed))
    assert final.keys() == again.keys() and all(torch.equal(final[k], again[k]) for k in final)

    latest = resumed / "checkpoints" / "step_00003"
    with pytest.raises(ConfigError, match=r"model.lora_rank: is 4, but the checkpoint .* was trained with 8"):
        build_run(load_config(part / "config.toml", ["model.lora_rank=4"]), latest)
    with pytest.raises(ConfigError, match="model.lora_rank: is 0, but the checkpoint .* holds LoRA adapters"):
        build_run(load_config(part / "config.toml", ["model.lora_rank=0"]), latest)
    with pytest.raises(ConfigError, match="model.lora_rank: is 8, but the checkpoint .* holds full weights"):
        full = train(_config(tmp_path, tiny_model_dir, "run.steps=1", "run.name=full", "model.lora_rank=0"))
        build_run(load_config(full / "config.toml", ["model.lora_rank=8"]), full / "checkpoints" / "step_00001")


def test_checkpoint_loads_merged_and_merges_into_a_model_folder(tmp_path, tiny_model_dir):
    """What `selfopd eval --model CHECKPOINT` loads, what `selfopd merge-lora` writes, and the
    trained module itself all give the same logprobs."""
    config = _config(tmp_path, tiny_model_dir, "run.steps=2", "run.name=merge")
    run_dir = train(config)
    checkpoint = run_dir / "checkpoints" / "step_00002"
    trained = build_run(config, checkpoint)
    adapted = probe_logprobs(trained.model, trained.probe, trained.pad_id)

    loaded, _ = load_model(checkpoint, frozen=True)
    assert not hasattr(loaded, "peft_config")  # a plain model, adapters merged
    assert (probe_logprobs(loaded, trained.probe, trained.pad_id) - adapted).abs().max() < 1e-5

    out = tmp_path / "merged"
    assert main(["merge-lora", str(checkpoint), str(out)]) == 0
    merged = AutoModelForCausalLM.from_pretrained(out)
    assert (probe_logprobs(merged, trained.probe, trained.pad_id) - adapted).abs().max() < 1e-5


def test_adapter_folder_without_its_base_is_refused_naming_it(tmp_path, tiny_model_dir, capsys):
    run_dir = train(_config(tmp_path, tiny_model_dir, "run.steps=1", "run.name=orphan"))
    checkpoint = run_dir / "checkpoints" / "step_00001"
    adapter_config = checkpoint / "adapter_config.json"
    settings = json.loads(adapter_config.read_text())
    assert settings["base_model_name_or_path"] == str(Path(tiny_model_dir).resolve())
    settings["base_model_name_or_path"] = str(tmp_path / "gone")
    adapter_config.write_text(json.dumps(settings))
    with pytest.raises(ModelError, match=f"LoRA adapter folder {checkpoint}: its base model .*gone.* cannot be found"):
        load_model(checkpoint, frozen=True)
    assert main(["merge-lora", str(checkpoint), str(tmp_path / "out")]) == 1
    assert f"LoRA adapter folder {checkpoint}" in capsys.readouterr().err


def test_adapters_on_the_output_head_are_refused(tmp_path, tiny_model_dir):
    with pytest.raises(ConfigError, match="model.lora_targets"):
        build_run(_config(tmp_path, tiny_model_dir, "model.lora_targets=lm_head,q_proj", "run.name=head"))
    with pytest.raises(ConfigError, match="model.lora_targets"):
        build_run(_config(tmp_path, tiny_model_dir, "model.lora_targets=no_such_layer", "run.name=none"))


@pytest.mark.slow
def test_real_model_adapters_off_is_the_base_after_a_training_step(tmp_path, smollm2_dir, smollm2_model):
    """SmolLM2 at rank 8 with a frozen teacher, one real trainer step: the adapted student's
    logprobs moved, the teacher (the same module, adapters off) still gives the base model's,
    and a fresh base given the merged weights gives the adapted ones."""
    run = _started(_config(tmp_path, "smollm2-135m-instruct", "teacher.kind=frozen", "optim.lr=1e-3",
                           "run.name=real", "rollout.max_tokens=8"))
    assert run.teacher.engine.model is run.model
    base_lp = probe_logprobs(smollm2_model, run.probe, run.pad_id)
    metrics = train_step(run)
    assert "probe/max_abs_diff" not in metrics  # in process: the live module, nothing to probe
    adapted = probe_logprobs(run.model, run.probe, run.pad_id)
    assert (adapted - base_lp).abs().max() > 1e-3
    assert (run.teacher.engine.score([run.probe])[0].logprobs - base_lp).abs().max() <= 1e-6

    fresh = AutoModelForCausalLM.from_pretrained(smollm2_dir)
    engine = LocalEngine(fresh, run.tokenizer)
    engine.update_weights(served_weights(run.model), version=1)
    assert (engine.score([run.probe])[0].logprobs - adapted).abs().max() < 1e-4


def test_bfloat16_lora_student_trains_float32_adapters(tmp_path, tiny_model_dir):
    """peft keeps the adapters in float32 over a bfloat16 base (frozen: no fp32 master copy,
    unlike full training); the merged weights a server gets are bfloat16 like the checkpoint."""
    run = _started(_config(tmp_path, tiny_model_dir, "model.dtype=bfloat16", "run.name=bf16"))
    train_step(run)
    dtypes = {_is_adapter(name): param.dtype for name, param in run.model.named_parameters()}
    assert dtypes == {True: torch.float32, False: torch.bfloat16}
    assert {tensor.dtype for tensor in served_weights(run.model).values()} == {torch.bfloat16}
