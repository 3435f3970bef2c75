"""The engine `selfopd eval` samples with: the model in process, or vLLM servers, launched with
the serving code training uses (`selfopd.serving.launch.planned_servers`, the student's slots:
same dtype, context, GPUs, API key) or a running one given by URL. A long eval (AIME avg@16 at
thousands of tokens) is a vLLM job; in process it is HF generate, for small checks."""

from __future__ import annotations

import contextlib
from dataclasses import replace
from pathlib import Path
from typing import Any

from selfopd.config import VLLM_KINDS, ConfigError, TrainConfig
from selfopd.engines.base import Engine


def eval_engine_kind(engine: str | None, server: str | None, run_config: TrainConfig | None) -> str:
    """Where `selfopd eval` samples: `engine` when given (--engine); 'vllm' with a `server` URL, or with
    a run's config (--run) whose engine.kind is 'vllm' or 'vllm_colocate': the run's own engine, launched
    as training launches the student's (a long eval is a vLLM job); else 'local', in process."""
    if engine is not None:
        return engine
    if server is not None or (run_config is not None and run_config.engine.kind in VLLM_KINDS):
        return "vllm"
    return "local"


def open_eval_engine(model: str | Path, config: TrainConfig, kind: str, server: str | None,
                     stack: contextlib.ExitStack, log_dir: Path, progress: bool = True) -> tuple[Engine, Any]:
    """(engine, tokenizer) that samples `model`: `kind` 'local' in process; 'vllm' on `server` (a
    URL serving that model) or on student servers launched for it, stopped when `stack` closes."""
    if kind == "local":
        from selfopd.engines.build import frozen_engine

        engine = frozen_engine(model, config)
        return engine, engine.tokenizer
    from transformers import AutoTokenizer

    from selfopd.config.bundles import ServingSettings
    from selfopd.core.models import from_pretrained, resolve_model
    from selfopd.engines.lora import is_adapter_folder
    from selfopd.serving.launch import client_engines, planned_servers
    from selfopd.serving.server import launch_servers

    adapters = is_adapter_folder(Path(model))  # a LoRA checkpoint: its folder holds the adapters and the tokenizer
    folder = Path(model) if adapters else resolve_model(model)
    tokenizer = from_pretrained(AutoTokenizer, folder, trust_remote_code=config.model.trust_remote_code)
    if server is not None:
        urls = [server]
    else:
        if adapters:  # a vLLM server loads whole models: the adapters merged, as training pushes them
            folder = merged_for_serving(folder, log_dir.parent, config.model.dtype, stack)
        specs = [replace(spec, model=str(folder)) for spec in planned_servers(ServingSettings.of(config))
                 if spec.name != "teacher"]
        if not specs:
            raise ConfigError("engine.student_urls", "is set, so no student server is launched: pass --server URL to "
                              "evaluate on a running server, or unset engine.student_urls")
        servers = stack.enter_context(launch_servers(specs, log_dir, config.engine.startup_timeout_s, progress))
        urls = [s.spec.url for s in servers]
    engine, _ = client_engines(config.engine, urls, [], stack)
    return engine, tokenizer


def merged_for_serving(checkpoint: Path, beside: Path, dtype: str, stack: contextlib.ExitStack) -> Path:
    """A LoRA checkpoint's adapters merged into its base, in the dtype its servers served during training
    (model.dtype), in a new folder under `beside` (the eval's output folder) deleted when `stack` closes."""
    import shutil
    import tempfile

    from selfopd.engines.lora import merge_checkpoint

    beside.mkdir(parents=True, exist_ok=True)
    out = Path(tempfile.mkdtemp(prefix=".merged-", dir=beside))
    stack.callback(shutil.rmtree, out, ignore_errors=True)
    print(f"selfopd: merging the LoRA adapters of {checkpoint} into {out} for the vLLM server (deleted after the eval)")
    return merge_checkpoint(checkpoint, out, "bfloat16" if dtype == "bfloat16" else "float32")
