"""selfopd.engines.families, and every recipe's family in process: each is found from its config (both of
Qwen3.5's layouts), and each trains one step on the demo config from a tiny random model built from a
config (tests/conftest.py::save_tiny_family), plain and, for the hybrid Qwen3.5, in every mode."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, Qwen3NextConfig

from selfopd.cli import main
from selfopd.engines.families import family_of, shared_prompt_cache_problem

ROOT = Path(__file__).resolve().parents[2]
FAMILY = {"llama": "llama", "qwen3": "qwen3", "qwen3_5": "qwen3_5", "qwen3_5_conditional": "qwen3_5"}
SMALL = [
    "data.spec=rg:chain_sum?min_terms=2&max_terms=2&size=60&seed=2", "data.eval_size=2",
    "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_tokens=4", "optim.micro_batch_prompts=1",
    "eval.max_tokens=2", "eval.batch_size=2", "run.progress=false", "run.eval_every=0", "model.threads=1",
    "optim.lr=1e-3",
]


@pytest.mark.parametrize("name", FAMILY)
def test_each_layout_is_found_from_its_config(tiny_family_dirs, name):
    config = AutoConfig.from_pretrained(tiny_family_dirs[name])
    assert family_of(config).name == FAMILY[name]
    # What the trainer holds: the causal LM's config (Qwen3.5's text config for the hub layout).
    assert family_of(AutoModelForCausalLM.from_config(config).config).name == FAMILY[name]


def test_only_caches_of_keys_and_values_are_shared():
    assert shared_prompt_cache_problem(AutoConfig.for_model("llama")) == ""
    assert "Gated DeltaNet" in shared_prompt_cache_problem(AutoConfig.for_model("qwen3_5_text"))
    # A hybrid of no listed family is told by its layer types.
    hybrid = Qwen3NextConfig(layer_types=["linear_attention", "full_attention"], num_hidden_layers=2)
    assert shared_prompt_cache_problem(hybrid) == ("qwen3_next: its linear_attention layers keep a state that "
                                                   "transformers' cache cannot select per row")


@pytest.mark.parametrize("name", FAMILY)
def test_the_decoder_layers_fsdp_wraps_hold_every_layer_weight(tiny_family_dirs, name):
    """`shard_model` makes each of `get_decoder().layers` an FSDP unit and the rest the root: the
    root must hold the embeddings, the final norm and the head only."""
    model = AutoModelForCausalLM.from_pretrained(tiny_family_dirs[name])
    layers = model.get_decoder().layers
    assert len(layers) == model.config.num_hidden_layers
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    root = {n.split(".")[-2] for n, p in model.named_parameters() if id(p) not in in_layers}
    assert root == {"embed_tokens", "norm"}  # the head is tied to the embeddings


def _train(tmp_path: Path, folder: Path, *sets: str) -> Path:
    argv = ["train", str(ROOT / "experiments" / "demo" / "demo.toml"), "--set", f"model.student={folder}",
            "--set", f"run.out_dir={tmp_path}", "--set", "run.name=run", "--set", "run.steps=1"]
    assert main([*argv, *(arg for s in [*SMALL, *sets] for arg in ("--set", s))]) == 0
    run = tmp_path / "run"
    step = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if "loss/pg" in line]
    assert len(step) == 1 and math.isfinite(step[0]["loss/pg"]) and step[0]["optim/grad_norm"] > 0
    # The sampler's logprobs are the scorer's (the trainer's sampler check): bf16 autocast rounds both.
    assert step[0]["is/sampler_logprob_abs_diff"] < (1e-2 if "model.dtype=bfloat16" in sets else 1e-4)
    return run / "checkpoints" / "step_00001"


# Every family plain; each mode once, on the hybrid (the same code paths for the others: surveyed by hand).
STEPS = [*((name, ()) for name in FAMILY), ("qwen3_5", ("model.gradient_checkpointing=true",)),
         ("qwen3_5", ("model.dtype=bfloat16",))]


@pytest.mark.parametrize(("name", "mode"), STEPS, ids=[f"{n}-{'-'.join(m) or 'plain'}" for n, m in STEPS])
def test_a_step_in_process_changes_every_weight_it_trains(tmp_path, tiny_family_dirs, name, mode):
    checkpoint = _train(tmp_path, tiny_family_dirs[name], *mode)
    initial, trained = load_file(tiny_family_dirs[name] / "model.safetensors"), load_file(checkpoint / "model.safetensors")
    # The hub layout's checkpoint is its language model, under the hub's names: the vision tower stays behind.
    assert set(trained) == {n for n in initial if not n.startswith("model.visual.")}
    assert all(not torch.equal(trained[n], initial[n]) for n in trained)


@pytest.mark.parametrize("targets", ["all-linear", "in_proj_qkv,out_proj,q_proj,v_proj"])
def test_lora_adapts_the_hybrids_layers(tmp_path, tiny_family_dirs, targets):
    checkpoint = _train(tmp_path, tiny_family_dirs["qwen3_5_conditional"], "model.lora_rank=4",
                        f"model.lora_targets={targets}")
    adapters = load_file(checkpoint / "adapter_model.safetensors")
    trained = {n.split(".lora_B")[0].rsplit(".", 1)[-1] for n, t in adapters.items() if ".lora_B" in n and t.any()}
    assert {"in_proj_qkv", "out_proj", "q_proj", "v_proj"} <= trained  # Gated DeltaNet's and attention's


def test_a_hub_layout_checkpoint_loads_as_its_language_model_and_its_saves_load_back(tmp_path, tiny_family_dirs):
    folder = tiny_family_dirs["qwen3_5_conditional"]
    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    assert not any(info.values()) and not any("visual" in name for name in model.state_dict())
    model.save_pretrained(tmp_path)  # as the trainer saves its checkpoints
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["Qwen3_5ForCausalLM"]
    again, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info.values())
    assert all(torch.equal(again.state_dict()[n], t) for n, t in model.state_dict().items())
