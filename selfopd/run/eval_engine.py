"""The engine `selfopd eval` samples with: the model in process, or vLLM servers, launched with
the serving code training uses (`selfopd.engines.serving.planned_servers`, the student's slots:
same dtype, context, GPUs, API key) or a running one given by URL. A long eval (AIME avg@16 at
thousands of tokens) is a vLLM job; in process it is HF generate, for small checks."""

from __future__ import annotations

import contextlib
from dataclasses import replace
from pathlib import Path
from typing import Any

from selfopd.config import ConfigError, TrainConfig
from selfopd.engines.base import Engine


def open_eval_engine(model: str | Path, config: TrainConfig, kind: str, server: str | None,
                     stack: contextlib.ExitStack, log_dir: Path, progress: bool = True) -> tuple[Engine, Any]:
    """(engine, tokenizer) that samples `model`: `kind` 'local' in process; 'vllm' on `server` (a
    URL serving that model) or on student servers launched for it, stopped when `stack` closes."""
    if kind == "local":
        from selfopd.engines.build import frozen_engine

        engine = frozen_engine(model, config)
        return engine, engine.tokenizer
    from transformers import AutoTokenizer

    from selfopd.core.models import from_pretrained, resolve_model
    from selfopd.engines.lora import is_adapter_folder
    from selfopd.engines.serving import client_engines, planned_servers
    from selfopd.engines.vllm_server import launch_servers

    folder = resolve_model(model)
    tokenizer = from_pretrained(AutoTokenizer, folder, trust_remote_code=config.model.trust_remote_code)
    if server is not None:
        urls = [server]
    else:
        if is_adapter_folder(folder):
            raise ConfigError("model.student", f"{model} is a LoRA adapter folder, which a vLLM server does not load "
                              "whole: merge it first (selfopd merge-lora) or evaluate with --engine local")
        specs = [replace(spec, model=str(folder)) for spec in planned_servers(config) if spec.name != "teacher"]
        if not specs:
            raise ConfigError("engine.student_urls", "is set, so no student server is launched: pass --server URL to "
                              "evaluate on a running server, or unset engine.student_urls")
        servers = stack.enter_context(launch_servers(specs, log_dir, config.engine.startup_timeout_s, progress))
        urls = [s.spec.url for s in servers]
    engine, _ = client_engines(config, urls, [], stack)
    return engine, tokenizer
