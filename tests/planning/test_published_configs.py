"""The published config.json values shipped for the planner (selfopd/planning/model_configs): each names
its source, agrees with facts counted independently of it, is read only where the Hugging Face cache
has no copy, and ships in the wheel."""

from __future__ import annotations

import fnmatch
import json
import tomllib
from pathlib import Path

import pytest

from selfopd.planning.memory_plan import model_shape, planned_shape
from selfopd.planning.published_configs import shipped_config, shipped_file, shipped_ids

ROOT = Path(__file__).resolve().parents[2]
FOLDER = ROOT / "selfopd" / "planning" / "model_configs"
RECIPE_MODELS = {"Qwen/Qwen3-1.7B", "Qwen/Qwen3.5-0.8B", "Qwen/Qwen3.5-2B", "Qwen/Qwen3.5-4B", "Qwen/Qwen3.5-9B"}
# (hidden, intermediate, layers, heads, KV heads, linear value heads, tied) as the model cards and independent
# copies of each config state them (the README's sources, and the Qwen3.5 model cards' "Model Overview").
FACTS = {"Qwen/Qwen3.5-0.8B": (1024, 3584, 24, 8, 2, 16, True), "Qwen/Qwen3.5-2B": (2048, 6144, 24, 8, 2, 16, True),
         "Qwen/Qwen3.5-4B": (2560, 9216, 32, 16, 4, 32, True), "Qwen/Qwen3.5-9B": (4096, 12288, 32, 16, 4, 32, False)}


@pytest.fixture
def empty_hf_cache(tmp_path, monkeypatch):
    """No Hugging Face cache and no network: what a machine offline without a download has."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))  # read when a file is looked up
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return tmp_path / "hub"


def test_every_recipe_model_ships_and_names_its_source():
    assert set(shipped_ids()) == RECIPE_MODELS
    readme = (FOLDER / "README.md").read_text()
    for spec in RECIPE_MODELS:
        row = next(line for line in readme.splitlines() if line.startswith(f"| `{spec.replace('/', '__')}.json`"))
        assert "@ " in row and "github.com/" in row, row  # repository, path and commit


@pytest.mark.parametrize("spec", sorted(FACTS))
def test_qwen3_5_shapes_are_the_published_ones(spec):
    shape = model_shape(shipped_config(spec), spec)
    hidden, intermediate, layers, heads, kv_heads, value_heads, tied = FACTS[spec]
    assert (shape.hidden, shape.intermediate, shape.layers, shape.heads, shape.kv_heads) == (
        hidden, intermediate, layers, heads, kv_heads)
    assert (shape.head_dim, shape.vocab, shape.linear_value_heads) == (256, 248320, value_heads)
    assert (shape.attention_layers, shape.linear_layers) == (layers // 4, layers - layers // 4)  # 3:1 hybrid
    assert (shape.embedding_params == 248320 * hidden) is tied


def test_counts_match_what_the_checkpoints_hold():
    """Qwen3.5-9B's language model: 8.95B parameters (recovered from the checkpoint, the 9B source's own test);
    Qwen3-1.7B: the 1,720,574,976 the H200 GPU check counted on the model it loaded."""
    assert model_shape(shipped_config("Qwen/Qwen3.5-9B")).params == pytest.approx(8.95e9, rel=0.02)
    assert model_shape(shipped_config("Qwen/Qwen3-1.7B")).params == 1_720_574_976


def test_offline_without_a_cache_the_plan_reads_the_shipped_copy(empty_hf_cache):
    shape = planned_shape("Qwen/Qwen3.5-4B", "model.student")
    assert shape.hidden == 2560 and "shipped with selfopd" in shape.note


def test_a_cached_config_wins_over_the_shipped_copy(empty_hf_cache):
    """The hub cache's config.json (a revision the user has) is what the plan reads when there is one."""
    snapshot = empty_hf_cache / "models--Qwen--Qwen3.5-4B" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    values = json.loads(shipped_file("Qwen/Qwen3.5-4B").read_text())
    values["text_config"]["intermediate_size"] = 4096  # a different revision, as a cache could hold
    (snapshot / "config.json").write_text(json.dumps(values))
    (empty_hf_cache / "models--Qwen--Qwen3.5-4B" / "refs").mkdir()
    (empty_hf_cache / "models--Qwen--Qwen3.5-4B" / "refs" / "main").write_text("a" * 40)
    shape = planned_shape("Qwen/Qwen3.5-4B", "model.student")
    assert shape.intermediate == 4096 and shape.note == ""


def test_a_hub_id_without_a_shipped_copy_is_still_named_when_it_cannot_be_read(empty_hf_cache):
    from selfopd.config import ConfigError

    with pytest.raises(ConfigError, match=r"^teacher\.model: Qwen/Qwen3\.5-27B: cannot read its config\.json"):
        planned_shape("Qwen/Qwen3.5-27B", "teacher.model")


def test_the_wheel_carries_every_shipped_file():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = setuptools["package-data"]["selfopd.planning.model_configs"]
    assert "selfopd.planning.model_configs" in setuptools["packages"]
    for path in FOLDER.iterdir():
        if path.suffix != ".py":
            assert any(fnmatch.fnmatch(path.name, pattern) for pattern in patterns), path.name
