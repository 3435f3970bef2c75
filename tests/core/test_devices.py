"""Device placement and the attention kernel, resolved from the config; gradient
checkpointing gives the gradients of the shared-prompt path."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from selfopd.config import ConfigError, load_config
from selfopd.core.devices import attn_implementation, model_device, resolve_device, use_device
from selfopd.engines.build import load_model, model_options
from selfopd.engines.scoring import _hidden_in_one_pass, completion_hidden, completion_logprobs, right_pad

SEQUENCES = [([1, 5, 9, 4], [7, 8, 2]), ([1, 5, 9, 4], [7, 3]), ([1, 6], [9, 9, 9, 2])]


def test_devices_resolve_or_say_why():
    assert resolve_device("cpu") == torch.device("cpu")
    if torch.cuda.is_available():
        assert resolve_device("auto", local_rank=0) == torch.device("cuda", 0)
        with pytest.raises(ConfigError, match=r"model.device: 'cuda:99': GPU 99 does not exist"):
            resolve_device("cuda:99")
    else:
        assert resolve_device("auto", local_rank=1) == torch.device("cpu")
        with pytest.raises(ConfigError, match=r"^model.device: 'cuda:1': no CUDA device is visible here"):
            resolve_device("cuda:1")


def test_attention_kernel_defaults_to_sdpa_and_flash_needs_cuda():
    assert attn_implementation("auto", torch.device("cpu")) == "sdpa"
    assert attn_implementation("eager", torch.device("cpu")) == "eager"
    with pytest.raises(ConfigError, match=r"model.attn_implementation: 'flash_attention_2' runs on CUDA only"):
        attn_implementation("flash_attention_2", torch.device("cpu"))


def test_flash_attention_only_for_bf16(monkeypatch):
    """Flash kernels refuse fp32 inputs, and an fp32 run computes in fp32 everywhere: 'auto'
    picks flash for bf16 only, and an explicit flash setting with fp32 is refused at start.
    (Whether flash-attn is installed is what the decision reads; here it is said to be.)"""
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "flash_attn" else real_find_spec(name, *a))
    gpu = torch.device("cuda", 0)
    assert attn_implementation("auto", gpu, "bfloat16") == "flash_attention_2"
    assert attn_implementation("auto", gpu, "float32") == "sdpa"
    assert attn_implementation("flash_attention_2", gpu, "bfloat16") == "flash_attention_2"
    with pytest.raises(ConfigError, match=r"^model.attn_implementation: 'flash_attention_2' computes in fp16/bf16 only "
                       r"and model.dtype is 'float32': set model.dtype = 'bfloat16' or use 'sdpa'$"):
        attn_implementation("flash_attention_2", gpu, "float32")


def test_a_trainer_on_any_gpu_makes_it_the_current_device(monkeypatch):
    """NCCL endpoints and tensors sent to "cuda" land on the current device: one process on
    cuda:1 must make GPU 1 current, not only a torchrun rank. (No GPU here: the call is recorded.)"""
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    use_device(torch.device("cuda", 1))
    use_device(torch.device("cpu"))
    assert calls == [torch.device("cuda", 1)]


def test_the_model_loads_where_the_config_says(tiny_model_dir):
    config = load_config(None, ["model.device=cpu", "model.attn_implementation=eager"])
    options = model_options(config.model)
    model, _ = load_model(tiny_model_dir, **options)
    assert model_device(model) == options["device"] == torch.device("cpu")
    assert model.config._attn_implementation == "eager"
    frozen, _ = load_model(tiny_model_dir, "bfloat16", frozen=True, **options)
    assert next(frozen.parameters()).dtype == torch.bfloat16 and not frozen.training
    trained, _ = load_model(tiny_model_dir, "bfloat16", **options)
    assert next(trained.parameters()).dtype == torch.float32  # master weights (selfopd.core.devices)


def test_one_pass_states_equal_the_shared_prompt_states(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    with torch.no_grad():
        shared, ids, mask = completion_hidden(model, SEQUENCES, pad_id=2)
        ids_BC, mask_BC = right_pad([c for _, c in SEQUENCES], 2)
        one_pass = _hidden_in_one_pass(model, SEQUENCES, ids_BC, mask_BC, 2)
    real = mask.bool()
    assert torch.allclose(shared[real], one_pass[real], atol=1e-5)


def test_gradient_checkpointing_gives_the_same_gradients(tiny_model_dir):
    """transformers drops the KV cache under checkpointing; the one-pass path must keep the
    completions attending to their prompts (else the gradients would differ)."""
    grads = []
    for checkpointing in (False, True):
        model, _ = load_model(tiny_model_dir, gradient_checkpointing=checkpointing)
        model.train()
        logprobs, mask = completion_logprobs(model, SEQUENCES, pad_id=2)
        (logprobs * mask).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        assert model.is_gradient_checkpointing == checkpointing
    for name, grad in grads[0].items():
        assert torch.allclose(grad, grads[1][name], atol=1e-6, rtol=1e-5), name
