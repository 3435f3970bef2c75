"""selfopd.core.file_checks: a model folder's or checkpoint's files are checked whole before a loader
reads them, each problem one phrase naming the file."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from selfopd.core.file_checks import checkpoint_problem, model_folder_problem, safetensors_problem, zip_problem


@pytest.fixture()
def folder(tmp_path) -> Path:
    """A small whole model folder: config, tokenizer JSON, weights."""
    save_file({"w": torch.ones(4, 4), "b": torch.zeros(4)}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "tokenizer.json").write_text('{"model": {}}')
    return tmp_path


def test_a_whole_folder_passes(folder):
    assert model_folder_problem(folder) is None


@pytest.mark.parametrize("name, data, expected", [
    ("config.json", b'{"model_type": "lla', "config.json: not valid JSON"),
    ("config.json", b"[]", "config.json: holds a JSON list, not an object"),
    ("tokenizer.json", b"\xff\xfe garbage", "tokenizer.json: not UTF-8 text"),
    ("tokenizer_config.json", b"", "tokenizer_config.json: not valid JSON"),
    ("model.safetensors", b"", r"model.safetensors: not a safetensors file, or cut short \(0 bytes\)"),
    ("model.safetensors", b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}", "model.safetensors: its safetensors header is damaged"),
    ("model.safetensors", (2**62).to_bytes(8, "little") + b"{}", "model.safetensors: not a safetensors file"),
])
def test_a_damaged_file_is_named(folder, name, data, expected):
    (folder / name).write_bytes(data)
    assert re.search(f"^{folder}/{expected}", model_folder_problem(folder))


def test_a_safetensors_file_cut_short_is_named_with_both_sizes(folder):
    path = folder / "model.safetensors"
    whole = path.read_bytes()
    path.write_bytes(whole[:-10])
    assert safetensors_problem(path) == (f"{path}: cut short or damaged ({len(whole) - 10} bytes where its header "
                                         f"describes {len(whole)})")


def test_a_shard_the_index_names_must_be_there(folder):
    shutil.move(folder / "model.safetensors", folder / "model-00001-of-00002.safetensors")
    index = {"weight_map": {"w": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    assert model_folder_problem(folder) == (f"{folder}/model-00002-of-00002.safetensors: missing, though "
                                            "model.safetensors.index.json names it")


def test_a_checkpoint_is_complete_with_weights_config_and_a_whole_trainer_state(folder):
    state = folder / "trainer_state.pt"
    assert checkpoint_problem(folder, state) == f"{folder}: holds no trainer_state.pt"
    torch.save({"step": 1}, state)
    assert checkpoint_problem(folder, state) is None
    whole = state.read_bytes()
    state.write_bytes(whole[: len(whole) // 2])
    assert checkpoint_problem(folder, state) == zip_problem(state) == (
        f"{state}: not a whole torch.save file (cut short, or not written by selfopd)")
    empty = folder / "step_00002"
    empty.mkdir()
    assert checkpoint_problem(empty, empty / state.name) == f"{empty}: empty (its write was cut short)"
    (folder / "model.safetensors").unlink()
    assert checkpoint_problem(folder, state) == f"{folder}: holds no weights (*.safetensors)"
