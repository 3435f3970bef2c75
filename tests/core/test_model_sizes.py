"""selfopd.core.model_sizes: a config.json's sizes are sizes, and the parameters it describes are
not far past what its safetensors files hold, measured on every model family the tests build and
on the default config of every causal LM family transformers knows."""

from __future__ import annotations

import json

import pytest
import torch

from selfopd.core.file_checks import model_folder_problem, safetensors_elements
from selfopd.core.model_sizes import WEIGHTS_FACTOR, WEIGHTS_SLACK, parameter_estimate, size_problem, weights_problem


def _ratio(folder) -> float:
    """The estimate over the elements the folder's safetensors files hold."""
    config = json.loads((folder / "config.json").read_text())
    return parameter_estimate(config)[0] / sum(safetensors_elements(p) for p in folder.glob("*.safetensors"))


def test_every_model_the_tests_build_passes_with_a_lower_bound_estimate(smollm2_dir, tiny_model_dir,
                                                                         servable_tiny_model_dir, tiny_family_dirs):
    """Measured: SmolLM2 0.75, the tiny Llama 0.99, its 64-wide-head copy 0.98, the families 0.97
    (Llama, Qwen3), 0.96 (Qwen3.5) and 0.94 (Qwen3.5 in its vision-language layout): the estimate
    is a lower bound, so the factor of 2 is headroom, not a fit."""
    folders = {"smollm2": smollm2_dir, "tiny": tiny_model_dir, "servable": servable_tiny_model_dir, **tiny_family_dirs}
    ratios = {name: _ratio(folder) for name, folder in folders.items()}
    assert all(0.5 < ratio <= 1 for ratio in ratios.values()), ratios
    assert {name: model_folder_problem(folder) for name, folder in folders.items()} == dict.fromkeys(folders)


def _meta_parameters(config) -> int:
    """The parameters transformers builds from `config`, counted on the meta device (nothing allocated)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    auto = AutoModelForCausalLM if config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES else AutoModelForImageTextToText
    with torch.device("meta"):
        return sum(p.numel() for p in auto.from_config(config).parameters())


@pytest.mark.parametrize("name", ["LlamaConfig", "Qwen3Config", "Qwen3MoeConfig", "Qwen3_5Config", "Qwen3_5MoeConfig",
                                  "MixtralConfig", "Gemma3Config", "GptOssConfig", "DeepseekV3Config", "Zamba2Config"])
def test_the_estimate_stays_under_what_real_families_build(name):
    """Default configs (7B to 671B, dense, mixtures of experts, Gated DeltaNet and Mamba hybrids,
    vision towers): at most 0.75 of the parameters, but Zamba2's 1.46 (its attention block is
    shared by many layers), under the factor."""
    import transformers

    config = getattr(transformers, name)()
    parameters = _meta_parameters(config)
    assert parameter_estimate(config.to_dict())[0] <= WEIGHTS_FACTOR * parameters
    assert size_problem(config.to_dict(), name) is None
    assert weights_problem(config.to_dict(), name, parameters, 0) is None


@pytest.mark.slow
def test_no_causal_lm_family_transformers_knows_is_refused():
    """Every causal LM and image-text-to-text family whose default config builds (about 220): its
    sizes pass, and the estimate is at most 1.7x its parameters (hrm_text 1.69, zamba 1.46)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)

    transformers.logging.set_verbosity_error()
    ratios = {}
    for family in sorted({*MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, *MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES}):
        try:
            config = CONFIG_MAPPING[family]()
            parameters = _meta_parameters(config)
        except Exception:  # a default config some families cannot build from (one needs timm, ...)
            continue
        assert size_problem(config.to_dict(), family) is None
        ratios[family] = parameter_estimate(config.to_dict())[0] / parameters
    assert len(ratios) > 200 and max(ratios.values()) < 1.75, sorted(ratios.items(), key=lambda item: -item[1])[:3]


def test_the_rule_is_the_factor_plus_the_slack():
    config = {"hidden_size": 1024, "num_hidden_layers": 10, "num_attention_heads": 8, "intermediate_size": 4096,
              "vocab_size": 1000}
    estimate = parameter_estimate(config)[0]
    assert estimate == 1000 * 1024 + 10 * (2 * 1024 * 1024 + 2 * 1024 * 4096)
    held = (estimate - WEIGHTS_SLACK) // WEIGHTS_FACTOR
    assert weights_problem(config, "c.json", held + 1, 0) is None
    assert weights_problem(config, "c.json", held - 1, 0).startswith(
        "c.json: its sizes (num_hidden_layers 10, hidden_size 1024, intermediate_size 4096, vocab_size 1000) describe "
        f"a model of at least {estimate:,} parameters, more than 2x the {held - 1:,} its safetensors files hold")


def test_a_quantized_model_counts_a_parameter_a_bit():
    """4-bit weights packed 8 to an int32 element: 1/8 of the elements, never refused as too few."""
    config = {"hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 11008, "vocab_size": 32000,
              "num_attention_heads": 32}
    packed = parameter_estimate(config)[0] // 8
    assert weights_problem(config, "c.json", packed, 4 * packed) is not None
    assert weights_problem({**config, "quantization_config": {"bits": 4}}, "c.json", packed, 4 * packed) is None
    assert weights_problem({"text_config": {**config, "quantization_config": {}}}, "c.json", packed, 4 * packed) is None


def test_a_vision_language_layout_counts_its_language_model_and_its_towers():
    text = {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 100}
    vision = {"hidden_size": 32, "depth": 3, "intermediate_size": 64, "num_heads": 2}
    total, sizes = parameter_estimate({"text_config": text, "vision_config": vision, "vocab_size": 999})
    assert total == 100 * 64 + 2 * (2 * 64 * 64 + 2 * 64 * 128) + 3 * (2 * 32 * 32 + 2 * 32 * 64)
    assert sizes == ("text_config.num_hidden_layers 2, text_config.hidden_size 64, text_config.intermediate_size 128, "
                     "text_config.vocab_size 100")
    bomb = parameter_estimate({"text_config": text, "vision_config": {**vision, "depth": 10**6}})
    assert bomb[1].startswith("vision_config.depth 1000000, vision_config.hidden_size 32")


def test_a_mixture_of_experts_counts_one_expert_when_its_dense_size_is_larger():
    config = {"hidden_size": 64, "num_hidden_layers": 1, "intermediate_size": 4096, "num_experts": 2,
              "moe_intermediate_size": 32, "vocab_size": 10}
    assert parameter_estimate(config)[0] == 10 * 64 + (2 * 64 * 64 + 2 * 64 * 64)
