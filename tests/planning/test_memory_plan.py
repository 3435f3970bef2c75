"""The memory planner's estimates against independent counts: the bytes autograd saves in a real
forward of tiny models (saved_tensors_hooks, shapes other than those the coefficients were read
from), vLLM's own KV page size and Gated DeltaNet state shapes, and the parameter counts that the
H200 GPU check reported for the Qwen3-1.7B shape."""

from __future__ import annotations

import pytest
import torch

from selfopd.planning.memory_plan import ModelShape, model_shape

# Qwen3-1.7B as published (its config.json): what gpu_check built on the H200.
QWEN3_1P7B = dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                  intermediate_size=6144, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=40960)


def tiny(kind: str, h: int, i: int, heads: int, kv: int, head_dim: int, layers: int, **extra):
    from transformers import AutoConfig

    return AutoConfig.for_model(kind, vocab_size=300, hidden_size=h, intermediate_size=i, num_hidden_layers=layers,
                                num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
                                tie_word_embeddings=True, pad_token_id=0, **extra)


def saved_bytes(config, scheme: str, rows: int, prompt: int, completion: int, checkpointing: bool = False) -> int:
    """Bytes of the distinct tensors autograd saves in the trainer's forward (`completion_hidden`),
    leaving out parameters and autocast's bf16 weight copies (the plan counts those apart)."""
    from transformers import AutoModelForCausalLM

    from selfopd.engines.scoring import completion_hidden

    torch.manual_seed(0)
    bf16 = scheme in ("bfloat16", "lora")
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa",
                                             dtype=torch.bfloat16 if bf16 else torch.float32)
    if scheme == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, target_modules="all-linear"))
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    params = {p.data_ptr() for p in model.parameters()}
    shapes = {tuple(p.shape) for p in model.parameters() if p.ndim == 2}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        weight_copy = scheme == "autocast" and tensor.dtype == torch.bfloat16 and (
            tuple(tensor.shape) in shapes or tuple(tensor.shape)[::-1] in shapes)
        if storage.data_ptr() not in params and not weight_copy:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    generator = torch.Generator().manual_seed(0)
    shared = torch.randint(1, 300, (prompt,), generator=generator).tolist()
    sequences = [(shared, torch.randint(1, 300, (completion,), generator=generator).tolist()) for _ in range(rows)]
    region = torch.autocast("cpu", dtype=torch.bfloat16, enabled=scheme != "float32")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), region:
        completion_hidden(model, sequences, 0)
    return sum(saved.values())


def per_layer_token(kind: str, dims: tuple, scheme: str, rows=3, prompt=7, completion=29, **extra) -> tuple[float, float]:
    """(measured, planned) bytes per token of one more decoder layer."""
    config3, config2 = (tiny(kind, *dims, layers=n, **extra) for n in (3, 2))
    measured = saved_bytes(config3, scheme, rows, prompt, completion) - saved_bytes(config2, scheme, rows, prompt, completion)
    shape3, shape2 = model_shape(config3), model_shape(config2)
    tokens = rows * completion + (rows * prompt if shape3.linear_layers else prompt)  # a shared prompt runs once
    return measured / tokens, shape3.activation_bytes_per_token(scheme) - shape2.activation_bytes_per_token(scheme)


# Shapes (hidden, intermediate, heads, kv heads, head_dim) other than the nine the coefficients were read from.
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("scheme", ["float32", "autocast", "bfloat16", "lora"])
@pytest.mark.parametrize("dims", [(112, 352, 7, 7, 16), (80, 480, 4, 2, 48)])
def test_activations_match_the_tensors_autograd_saves(kind, scheme, dims):
    measured, planned = per_layer_token(kind, dims, scheme)
    assert planned == pytest.approx(measured, rel=0.06), (measured, planned)


@pytest.mark.parametrize("scheme", ["float32", "autocast"])
def test_gated_deltanet_layers_match_the_tensors_autograd_saves(scheme):
    """Qwen3.5's linear-attention layers, through transformers' PyTorch path (rows of 128 tokens: its chunks
    are 64), on a shape the coefficients were not read from."""
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    def config(layers):
        return Qwen3_5TextConfig(vocab_size=300, hidden_size=160, intermediate_size=320, num_hidden_layers=layers + 1,
                                 num_attention_heads=2, num_key_value_heads=1, head_dim=64, linear_key_head_dim=48,
                                 linear_value_head_dim=48, linear_num_key_heads=1, linear_num_value_heads=3,
                                 layer_types=["linear_attention"] * layers + ["full_attention"], tie_word_embeddings=True,
                                 pad_token_id=0)

    measured = (saved_bytes(config(3), scheme, 2, 8, 120) - saved_bytes(config(2), scheme, 2, 8, 120)) / 256
    planned = model_shape(config(3)).activation_bytes_per_token(scheme) - model_shape(config(2)).activation_bytes_per_token(scheme)
    assert planned == pytest.approx(measured, rel=0.15), (measured, planned)


def test_checkpointing_keeps_each_layer_input():
    """With gradient checkpointing the forward saves each layer's input: hidden x 4 bytes (fp32) a token."""
    config3, config2 = (tiny("qwen3", 96, 160, 3, 1, 32, layers=n) for n in (3, 2))
    measured = (saved_bytes(config3, "float32", 3, 7, 29, True) - saved_bytes(config2, "float32", 3, 7, 29, True)) / (3 * 36)
    assert measured == pytest.approx(96 * 4, rel=0.05)


def test_kv_cache_and_state_match_vllms_own_sizes():
    """Bytes a token's keys and values take, and a sequence's Gated DeltaNet state, as vLLM sizes them."""
    vllm_cache = pytest.importorskip("vllm.v1.kv_cache_interface")
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    from transformers import Qwen3Config

    for tp in (1, 2):
        shape = model_shape(Qwen3Config(**QWEN3_1P7B))
        spec = vllm_cache.FullAttentionSpec(block_size=16, num_kv_heads=8 // tp, head_size=128, dtype=torch.bfloat16)
        assert shape.kv_bytes_per_token(2, tp) == 28 * spec.page_size_bytes / 16
    hybrid = Qwen3_5TextConfig(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=64, linear_key_head_dim=32,
                               linear_value_head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                               layer_types=["linear_attention"] * 3 + ["full_attention"])
    shape = model_shape(hybrid)
    assert (shape.attention_layers, shape.linear_layers) == (1, 3)
    for tp in (1, 2):
        conv, recurrent = MambaStateShapeCalculator.gated_delta_net_state_shape(tp, 2, 4, 32, 32, 4)
        elements = torch.Size(conv).numel() + torch.Size(recurrent).numel()
        assert shape.state_bytes_per_sequence(2, tp) == 3 * elements * 2
        spec = vllm_cache.FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
        assert shape.kv_bytes_per_token(2, tp) == spec.page_size_bytes / 16


def test_qwen3_1p7b_counts_equal_what_the_gpu_check_built():
    """Parameters, and LoRA rank 16's on every linear layer, as gpu_check_h200.json reports them."""
    from transformers import Qwen3Config

    shape = model_shape(Qwen3Config(**QWEN3_1P7B), "Qwen3-1.7B")
    assert shape.params == 1_720_574_976
    assert shape.lora_params(16, ("all-linear",)) == 17_432_576
    assert shape.embedding_params == 151936 * 2048  # tied: one matrix
    assert shape.kv_bytes_per_token(2) == 28 * 2 * 8 * 128 * 2
    assert shape.qk_norm and shape.linear_layers == 0


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_5", "qwen3_5_conditional"])
def test_every_family_folder_is_read_from_its_config_json(tmp_path, smollm2_tokenizer, family):
    """A saved model folder of each family: its config.json read (the hub layout's text config nested),
    the parameters those of the causal LM the trainer loads."""
    from tests.conftest import save_tiny_family
    from transformers import AutoModelForCausalLM

    from selfopd.planning.memory_plan import read_model_config

    folder = save_tiny_family(tmp_path / family, smollm2_tokenizer, family)
    shape = model_shape(read_model_config(str(folder), "model.student"))
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert shape.params == sum(p.numel() for p in model.parameters())
    hybrid = family.startswith("qwen3_5")
    assert (shape.linear_layers, shape.attention_layers) == ((3, 1) if hybrid else (0, 4))
    assert shape.hidden == 128 and shape.vocab == len(smollm2_tokenizer)


def test_a_model_that_cannot_be_read_names_its_key(tmp_path):
    from selfopd.config import ConfigError
    from selfopd.planning.memory_plan import read_model_config

    with pytest.raises(ConfigError, match=r"^teacher\.model: .*nowhere.*config\.json") as error:
        read_model_config(str(tmp_path / "nowhere"), "teacher.model")
    assert "\n" not in str(error.value)


def test_shape_is_a_plain_record():
    shape = ModelShape("m", 2, 8, 16, 2, 1, 4, 10, 100, 10, 2)
    assert shape.kv_bytes_per_token(4) == 2 * 2 * 1 * 4 * 4 and shape.state_bytes_per_sequence(2) == 0
