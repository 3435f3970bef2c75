"""Cheap checks that a model folder's or a checkpoint's files are whole, before a loader reads them.

A model folder or checkpoint can come from elsewhere, or from a write cut short (a kill, a full
disk): a loader handed a truncated safetensors file or a half-written JSON file stops with a
traceback deep inside a library. These checks read only headers and small files, and each
problem is one phrase that names the file."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

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


def safetensors_problem(path: Path) -> str | None:
    """Why `path` is not a whole safetensors file: its header must parse and its size must be
    what the header describes (None: it is)."""
    size = path.stat().st_size
    with path.open("rb") as handle:
        head = handle.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < length <= min(size - 8, SAFETENSORS_HEADER_LIMIT):
            return f"{path}: not a safetensors file, or cut short ({size} bytes)"
        try:
            header = json.loads(handle.read(length).decode("utf-8"))
            end = max([int(entry["data_offsets"][1]) for name, entry in header.items() if name != "__metadata__"],
                      default=0)
        except (UnicodeDecodeError, ValueError, TypeError, KeyError, IndexError, AttributeError):
            return f"{path}: its safetensors header is damaged"
    if size != 8 + length + end:
        return f"{path}: cut short or damaged ({size} bytes where its header describes {8 + length + end})"
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
    index, ...) that does not parse, a safetensors file cut short, or a shard its index names
    that is missing (None: none)."""
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
    for path in sorted(folder.glob("*.safetensors")):
        if (problem := safetensors_problem(path)) is not None:
            return problem
    return None


def checkpoint_problem(checkpoint: Path, trainer_state: Path) -> str | None:
    """Why a training checkpoint is not complete (None: it is): weights, a config, every file
    whole and its trainer state (the file `trainer_state`, inside it) present."""
    names = {path.name for path in checkpoint.iterdir()} if checkpoint.is_dir() else set()
    if not names:
        return f"{checkpoint}: empty (its write was cut short)"
    if not any(name.endswith(".safetensors") for name in names):
        return f"{checkpoint}: holds no weights (*.safetensors)"
    if not names & {"config.json", "adapter_config.json"}:
        return f"{checkpoint}: holds no config.json"
    if trainer_state.name not in names:
        return f"{checkpoint}: holds no {trainer_state.name}"
    return model_folder_problem(checkpoint) or zip_problem(trainer_state)
