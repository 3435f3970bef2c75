"""The published `config.json` of the hub models the GPU recipes name, shipped in
`selfopd/planning/model_configs/` (each file's source is in the README beside them), so that the
memory planner works offline. Only the planner reads them, and only for a hub id whose config
is not in the local Hugging Face cache: a cached copy always wins, and nothing that loads a
model ever reads these files."""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

PACKAGE = "selfopd.planning.model_configs"


def shipped_file(spec: str) -> Any | None:
    """The shipped config.json of hub id `spec` (an importlib Traversable), or None."""
    if spec.count("/") != 1:
        return None
    entry = resources.files(PACKAGE).joinpath(spec.replace("/", "__") + ".json")
    return entry if entry.is_file() else None


def shipped_ids() -> list[str]:
    """The hub ids with a shipped config.json."""
    return sorted(entry.name[: -len(".json")].replace("__", "/") for entry in resources.files(PACKAGE).iterdir()
                  if entry.name.endswith(".json"))


def cached_config(spec: str, trust_remote_code: bool = False) -> Any | None:
    """The transformers config of hub id `spec` from the local Hugging Face cache only (no network), or None."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(spec, local_files_only=True, trust_remote_code=trust_remote_code)
    except Exception:  # not cached (OSError), or not a hub id at all
        return None


def shipped_config(spec: str) -> Any | None:
    """The transformers config built from the shipped copy of `spec`'s config.json, or None when none ships."""
    import tempfile

    from transformers import AutoConfig

    entry = shipped_file(spec)
    if entry is None:
        return None
    with tempfile.TemporaryDirectory() as folder:  # read as any config.json is read
        (Path(folder) / "config.json").write_text(entry.read_text(encoding="utf-8"), encoding="utf-8")
        return AutoConfig.from_pretrained(folder)


def planning_config(spec: str, trust_remote_code: bool = False) -> tuple[Any, str] | None:
    """(config, note) for a hub id with a shipped copy: the cached config.json when there is one (note ''),
    else the shipped copy (the note says so); None for any other spec."""
    if shipped_file(spec) is None:
        return None
    cached = cached_config(spec, trust_remote_code)
    if cached is not None:
        return cached, ""
    return shipped_config(spec), (f"{spec}: not in the Hugging Face cache here; planned from the config.json values "
                                  "shipped with selfopd (selfopd/planning/model_configs/README.md)")
