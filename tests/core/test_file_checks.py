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
    assert checkpoint_problem(folder, state) == f"{folder}: holds no weights (*.safetensors, or sharded ones under dcp/)"


def _edit_header(path: Path, edit) -> None:
    """Rewrite the safetensors file `path` with its header changed by `edit(header)`, its data kept."""
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + length])
    edit(header)
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + length:])


def _set(name: str, key: str, value):
    return lambda header: header[name].__setitem__(key, value)


# `folder`'s weights: "b", 4 floats at [0, 16], then "w", 16 floats at [16, 80].
@pytest.mark.parametrize("edit, expected", [
    (_set("w", "shape", [10**12, 10**12]),
     r"tensor 'w' has shape \[1000000000000, 1000000000000\] of F32: 4000000000000000000000000 bytes, but its "
     r"data_offsets \[16, 80\] span 64"),
    (_set("w", "shape", [-4, -16]), r"tensor 'w' has shape \[-4, -16\]: not a list of non-negative integers"),
    (_set("w", "shape", "4x4"), r"tensor 'w' has shape '4x4': not a list of non-negative integers"),
    (_set("w", "shape", [4, 4.0]), r"tensor 'w' has shape \[4, 4\.0\]: not a list of non-negative integers"),
    (_set("w", "dtype", "F128"), r"tensor 'w' has dtype 'F128', not a safetensors dtype"),
    (_set("w", "dtype", ["F32"]), r"tensor 'w' has dtype \['F32'\], not a safetensors dtype"),
    (_set("w", "dtype", "F16"), r"tensor 'w' has shape \[4, 4\] of F16: 32 bytes, but its data_offsets \[16, 80\] span 64"),
    (_set("w", "data_offsets", [16, 76]), r"tensor 'w' has shape \[4, 4\] of F32: 64 bytes, but its data_offsets "
                                          r"\[16, 76\] span 60"),
    (_set("w", "data_offsets", [8, 72]), r"tensor 'w' has data_offsets \[8, 72\], where its data should start at 16 "
                                         r"\(overlapping or out of order: damaged\)"),
    (_set("b", "data_offsets", [64, 80]), r"tensor 'w' has data_offsets \[16, 80\], where its data should start at 0"),
    (_set("w", "data_offsets", [16, 10**30]), r"tensor 'w' has shape \[4, 4\] of F32: 64 bytes, but its data_offsets "
                                              r"\[16, 1000000000000000000000000000000\] span"),
    (_set("w", "data_offsets", [16, -80]), r"tensor 'w' has data_offsets \[16, -80\], where its data should start"),
    (_set("w", "data_offsets", [16, "80"]), r"its safetensors header is damaged"),
    (lambda header: header.update(x={"dtype": "F32", "shape": [1], "data_offsets": [80, 84]}),
     r"cut short or damaged \(\d+ bytes where its header describes \d+\)"),
])
def test_a_safetensors_header_of_absurd_or_inconsistent_tensors_is_named(folder, edit, expected):
    """What the safetensors library refuses with a traceback (or, for absurd shapes, what a loader
    would allocate) is one phrase naming the file and the tensor, before any loader runs."""
    path = folder / "model.safetensors"
    _edit_header(path, edit)
    assert re.search(f"^{path}: {expected}", safetensors_problem(path)), safetensors_problem(path)
    assert model_folder_problem(folder) == safetensors_problem(path)


def test_the_safetensors_dtypes_are_the_libraries_own(tmp_path):
    """Every dtype torch saves through safetensors is known, with its size."""
    from safetensors.torch import _SIZE, _TYPES

    from selfopd.core.file_checks import DTYPE_BITS

    for name, dtype in _TYPES.items():
        assert DTYPE_BITS[name] == 8 * _SIZE[dtype], name
    save_file({"x": torch.ones(3, dtype=torch.bfloat16), "y": torch.ones(2, 2, dtype=torch.int64),
               "z": torch.ones(5, dtype=torch.float8_e4m3fn)}, tmp_path / "m.safetensors")
    assert safetensors_problem(tmp_path / "m.safetensors") is None


@pytest.mark.parametrize("change, expected", [
    ({"num_hidden_layers": 10**9}, r"num_hidden_layers = 1000000000: past 16,777,216, the most a model size can be"),
    ({"vocab_size": -1}, r"vocab_size = -1: a model size must be a positive whole number"),
    ({"num_hidden_layers": 0}, r"num_hidden_layers = 0: a model size must be a positive whole number"),
    ({"hidden_size": "64"}, r"hidden_size = '64': a model size must be a positive whole number"),
    ({"text_config": {"vocab_size": 0}}, r"text_config\.vocab_size = 0: a model size must be a positive whole number"),
    ({"vision_config": {"depth": 10**9}}, r"vision_config\.depth = 1000000000: past 16,777,216"),
    ({"intermediate_size": -5}, r"intermediate_size = -5: a model size must be a whole number >= 0"),
    ({"num_attention_heads": [4] * 10**5 + [-1]},  # a million characters in a config: 60 in the message
     r"num_attention_heads = \[4, 4, 4, [4, ]+4,\.\.\.: a model size must be a positive whole number$"),
    ({"vocab_size": 10**400}, r"vocab_size = 1000+\.\.\.: past 16,777,216"),
    ({"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 20},
     r"its sizes \(num_hidden_layers 20, hidden_size 256, intermediate_size 1024\) describe a model of at least "
     r"13,107,200 parameters, more than 2x the 20 its safetensors files hold \(a damaged or hostile config\): refused "
     r"before anything is built"),
])
def test_a_config_whose_sizes_are_not_sizes_or_past_the_weights_is_named(folder, change, expected):
    """What transformers would build from before it reads a weight: refused naming the file and key."""
    config = {"model_type": "llama", "hidden_size": 8, "intermediate_size": 16, "num_attention_heads": 2,
              "num_hidden_layers": 2, **change}
    (folder / "config.json").write_text(json.dumps(config))
    assert re.search(f"^{folder}/config.json: {expected}", model_folder_problem(folder)), model_folder_problem(folder)


def test_an_adapter_folder_is_not_compared_with_its_base_models_config(folder):
    """A LoRA adapter's weights are a sliver of the model its config.json describes."""
    (folder / "config.json").write_text(json.dumps({"hidden_size": 4096, "num_hidden_layers": 32,
                                                    "intermediate_size": 11008, "vocab_size": 32000}))
    assert "describe a model of at least" in model_folder_problem(folder)
    (folder / "adapter_config.json").write_text('{"r": 8}')
    assert model_folder_problem(folder) is None
