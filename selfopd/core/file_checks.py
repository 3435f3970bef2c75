"""Cheap checks that a model folder's or a checkpoint's files are whole, before a loader reads them.

A model folder or checkpoint can come from elsewhere, or from a write cut short (a kill, a full
disk): a loader handed a truncated safetensors file or a half-written JSON file stops with a
traceback deep inside a library; one with a safetensors header of absurd shapes, or a config.json
whose sizes are not sizes or describe a model far past its weights, grows memory before any error
(transformers builds a model from its config before it reads a weight: `selfopd.core.model_sizes`).
These checks read only headers and small files, and each problem is one phrase that names the file."""

from __future__ import annotations

import json
import math
import zipfile
from pathlib import Path
from typing import Any

from selfopd.core.model_sizes import config_problem

SAFETENSORS_HEADER_LIMIT = 100 * 2**20  # the safetensors library's own bound on a header


def json_object_problem(path: Path) -> str | None:
    """Why `path` is not a whole UTF-8 JSON file holding an object, as every JSON file of a model
    folder does (None: it is)."""
    try:
        value = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        return f"{path}: not UTF-8 text (damaged, or not a JSON file)"
    except ValueError as error:
        return f"{path}: not valid JSON ({error}; cut short or damaged)"
    return None if isinstance(value, dict) else f"{path}: holds a JSON {type(value).__name__}, not an object"


# Bits an element of each safetensors dtype takes (the safetensors format's own list).
DTYPE_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8,
              "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32,
              "C64": 64, "F64": 64, "I64": 64, "U64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}


def safetensors_problem(path: Path) -> str | None:
    """Why `path` is not a whole safetensors file (None: it is): see `safetensors_elements`."""
    problem = safetensors_elements(path)
    return problem if isinstance(problem, str) else None


def safetensors_elements(path: Path) -> int | str:
    """The number of elements the tensors of the safetensors file `path` hold, or why it is not a
    whole one: its header must parse, each tensor's shape be non-negative integers whose elements
    take exactly the bytes its data_offsets span, the tensors lie one after the other, and the
    file's size be what the header describes."""
    size = path.stat().st_size
    with path.open("rb") as handle:
        head = handle.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < length <= min(size - 8, SAFETENSORS_HEADER_LIMIT):
            return f"{path}: not a safetensors file, or cut short ({size} bytes)"
        try:
            header = json.loads(handle.read(length).decode("utf-8"))
            tensors = sorted(((name, entry) for name, entry in header.items() if name != "__metadata__"),
                             key=lambda item: _offsets(item[1]))
        except (UnicodeDecodeError, ValueError, TypeError, KeyError, IndexError, AttributeError):
            return f"{path}: its safetensors header is damaged"
    end = elements = 0
    for name, entry in tensors:
        if (problem := _tensor_problem(name, entry, end)) is not None:
            return f"{path}: {problem}"
        count = math.prod(entry["shape"])
        elements, end = elements + count, entry["data_offsets"][1]
    if size != 8 + length + end:
        return f"{path}: cut short or damaged ({size} bytes where its header describes {8 + length + end})"
    return elements


def _offsets(entry: Any) -> tuple[int, int]:
    begin, end = entry["data_offsets"]
    if not all(isinstance(n, int) and not isinstance(n, bool) for n in (begin, end)):
        raise TypeError("data_offsets are not integers")
    return begin, end


def _tensor_problem(name: str, entry: dict, start: int) -> str | None:
    """Why one tensor of a safetensors header is not whole (None: it is), `start` where the
    tensor before it ends."""
    shape, dtype, (begin, end) = entry.get("shape"), entry.get("dtype"), entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        return f"tensor {name!r} has dtype {dtype!r}, not a safetensors dtype"
    if not isinstance(shape, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                                              for n in shape):
        return f"tensor {name!r} has shape {shape!r}: not a list of non-negative integers"
    bits = math.prod(shape) * DTYPE_BITS[dtype]
    if begin != start or end < begin:
        return (f"tensor {name!r} has data_offsets [{begin}, {end}], where its data should start at {start} "
                "(overlapping or out of order: damaged)")
    if bits != 8 * (end - begin):
        size = bits // 8 if bits % 8 == 0 else bits / 8
        return (f"tensor {name!r} has shape {shape} of {dtype}: {size} bytes, but its data_offsets [{begin}, {end}] "
                f"span {end - begin}")
    return None


def zip_problem(path: Path) -> str | None:
    """Why `path` is not a whole zip file, the layout of `torch.save` (None: it is). A write cut
    short loses the zip's directory, which sits at its end."""
    try:
        with zipfile.ZipFile(path):
            return None
    except (zipfile.BadZipFile, OSError):
        return f"{path}: not a whole torch.save file (cut short, or not written by selfopd)"


def model_folder_problem(folder: Path) -> str | None:
    """The first file of a model folder that is not whole: a JSON file (config, tokenizer,
    index, ...) that does not parse, a safetensors file cut short or damaged, a shard its index
    names that is missing, or a config.json whose sizes are not sizes or describe more than the
    weights hold (`selfopd.core.model_sizes`) (None: none)."""
    for path in sorted(folder.glob("*.json")):
        if (problem := json_object_problem(path)) is not None:
            return problem
        if path.name.endswith(".safetensors.index.json"):
            shards = json.loads(path.read_text()).get("weight_map")
            if not isinstance(shards, dict):
                return f"{path}: has no weight_map (damaged)"
            missing = sorted({str(shard) for shard in shards.values()} - {p.name for p in folder.iterdir()})
            if missing:
                return f"{folder / missing[0]}: missing, though {path.name} names it"
    elements, data_bytes = None, 0
    for path in sorted(folder.glob("*.safetensors")):
        if isinstance(count := safetensors_elements(path), str):
            return count
        elements, data_bytes = (elements or 0) + count, data_bytes + path.stat().st_size
    config = folder / "config.json"
    if config.is_file() and not (folder / "adapter_config.json").is_file():  # an adapter's weights are not the model's
        return config_problem(config, json.loads(config.read_text()), elements, data_bytes)
    return None


DCP_FOLDER = "dcp"  # a sharded checkpoint's (selfopd.training.sharded_checkpoint): DCP's .metadata and *.distcp files


def is_sharded_checkpoint(checkpoint: Path) -> bool:
    """A checkpoint written with run.checkpoint_format = 'sharded' (its DCP metadata present)."""
    return (Path(checkpoint) / DCP_FOLDER / ".metadata").is_file()


def sharded_problem(checkpoint: Path) -> str | None:
    """Why a sharded checkpoint's DCP folder is not whole (None: it is): its metadata and at least
    one data file, none of them empty."""
    folder = Path(checkpoint) / DCP_FOLDER
    files = sorted(folder.glob("*.distcp"))
    if not files:
        return f"{folder}: holds no *.distcp data files (its write was cut short)"
    empty = [path for path in [folder / ".metadata", *files] if path.stat().st_size == 0]
    return f"{empty[0]}: empty (its write was cut short)" if empty else None


def checkpoint_problem(checkpoint: Path, trainer_state: Path) -> str | None:
    """Why a training checkpoint is not complete (None: it is): weights, a config, every file
    whole and its trainer state (the file `trainer_state`, inside it) present."""
    names = {path.name for path in checkpoint.iterdir()} if checkpoint.is_dir() else set()
    if not names:
        return f"{checkpoint}: empty (its write was cut short)"
    if not any(name.endswith(".safetensors") for name in names) and not is_sharded_checkpoint(checkpoint):
        return f"{checkpoint}: holds no weights (*.safetensors, or sharded ones under dcp/)"
    if (checkpoint / DCP_FOLDER).is_dir() and (problem := sharded_problem(checkpoint)) is not None:
        return problem
    if not names & {"config.json", "adapter_config.json"}:
        return f"{checkpoint}: holds no config.json"
    if trainer_state.name not in names:
        return f"{checkpoint}: holds no {trainer_state.name}"
    return model_folder_problem(checkpoint) or zip_problem(trainer_state)
