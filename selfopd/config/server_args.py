"""What `engine.extra_server_args` may pass to the vLLM servers selfopd launches: an allow-list.

vLLM has hundreds of flags, and some load Python files or modules before the engine starts
(`--tool-parser-plugin`, `--logits-processors`, `--worker-cls`, `--kv-transfer-config`, ...) or
change what is served (`--load-format dummy`, `--chat-template`, `--hf-overrides`). A deny-list
misses the next one vLLM adds, so only flags known to be inert pass: scheduling, memory, kernels
and logging, each with a value of a checked shape (a count, a number, or one plain word). The
flags selfopd sets itself (SERVER_FLAGS) get a message naming the setting that sets them.
"""

from __future__ import annotations

import re

# Flags of vLLM's api_server that selfopd sets on every server it launches
# (selfopd.serving.server.server_command) and relies on, with where they come from; a later
# copy in extra_server_args would win (a server on 0.0.0.0, without selfopd's key or weight checks).
SERVER_FLAGS = {
    "--host": "selfopd sets it from engine.host",
    "--port": "selfopd sets it from engine.port",
    "--model": "selfopd sets it from model.student or teacher.model",
    "--served-model-name": "selfopd names each server by its role",
    "--api-key": "selfopd sets the key from engine.api_key_env",
    "--middleware": "selfopd's middleware checks the key on every route",
    "--worker-extension-cls": "selfopd's extension verifies every weight push",
    "--weight-transfer-config": "selfopd's engine carries the push's secret",
    "--trust-remote-code": "selfopd sets it from model.trust_remote_code",
    "--dtype": "selfopd sets it from model.dtype",
    "--max-model-len": "selfopd sets it from engine.max_model_len",
    "--max-logprobs": "selfopd sets it from loss.top_k",
    "--logprobs-mode": "the trainer's importance ratio needs processed logprobs",
    "--generation-config": "sampling settings come from the config",
    "--tensor-parallel-size": "selfopd sets it from engine.tensor_parallel_size",
    "-tp": "selfopd sets it from engine.tensor_parallel_size",
    "--enable-prefix-caching": "selfopd sets it so that no cache outlives a weight push",
    "--config": "a file of flags could set any of these",
}

SWITCH, COUNT, NUMBER, WORD = "switch", "count", "number", "word"  # what follows a flag
_VALUES = {
    COUNT: re.compile(r"\d{1,12}[kKmMgG]?"),  # vLLM reads '8k' as 8000
    NUMBER: re.compile(r"\d{1,12}(\.\d{1,12})?"),
    WORD: re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}"),  # a choice such as fp8_e4m3 or FLASH_ATTN: no path
}
_SHOWN = {SWITCH: "no value", COUNT: "a whole number", NUMBER: "a number", WORD: "one plain word (letters, digits, _.+-)"}
# Flags known to change only how fast, in how much memory and with which kernels a server computes, or
# what it logs: no code loaded, no address opened, the same model served (tests/config/test_server_args.py
# checks each against vLLM's own parser).
INERT_FLAGS: dict[str, str] = {
    "--max-num-seqs": COUNT, "--max-num-batched-tokens": COUNT, "--max-num-scheduled-tokens": COUNT,
    "--enable-chunked-prefill": SWITCH, "--long-prefill-token-threshold": COUNT, "--scheduling-policy": WORD,
    "--async-scheduling": SWITCH, "--stream-interval": COUNT,
    "--block-size": COUNT, "--kv-cache-dtype": WORD, "--kv-cache-memory-bytes": COUNT,
    "--num-gpu-blocks-override": COUNT, "--gpu-memory-utilization": NUMBER, "--cpu-offload-gb": NUMBER,
    "--mamba-cache-dtype": WORD, "--mamba-ssm-cache-dtype": WORD,
    "--enforce-eager": SWITCH, "--max-cudagraph-capture-size": COUNT, "--optimization-level": COUNT,
    "--attention-backend": WORD, "--moe-backend": WORD, "--linear-backend": WORD, "--gdn-prefill-backend": WORD,
    "--model-impl": WORD, "--safetensors-load-strategy": WORD, "--max-parallel-loading-workers": COUNT,
    "--pipeline-parallel-size": COUNT, "-pp": COUNT, "--data-parallel-size": COUNT, "-dp": COUNT,
    "--enable-expert-parallel": SWITCH, "-ep": SWITCH, "--disable-custom-all-reduce": SWITCH,
    "--seed": COUNT, "--disable-log-stats": SWITCH, "--enable-log-requests": SWITCH, "--max-log-len": COUNT,
    "--uvicorn-log-level": WORD, "--disable-uvicorn-access-log": SWITCH, "--disable-fastapi-docs": SWITCH,
    "--shutdown-timeout": COUNT,
}
INERT_FLAGS.update({"--no-" + flag[2:]: SWITCH for flag in (  # the switches vLLM also takes as --no-NAME
    "--enable-chunked-prefill", "--async-scheduling", "--enforce-eager", "--enable-expert-parallel",
    "--disable-custom-all-reduce", "--enable-log-requests", "--disable-uvicorn-access-log", "--disable-fastapi-docs")})


def managed_flag(word: str) -> str | None:
    """The flag of SERVER_FLAGS a command-line word sets, as vLLM's parser reads it ('--host=x',
    '--no-enable-prefix-caching', '--served_model_name', '--weight-transfer-config.backend',
    an abbreviation such as '--ho'); None for any other word."""
    if not word.startswith("-") or word == "-":
        return None
    name = _spelled(word)
    name = "--" + name[len("--no-"):] if name.startswith("--no-") else name
    return next((flag for flag in SERVER_FLAGS if flag == name or (len(name) > 3 and flag.startswith(name))), None)


def _spelled(word: str) -> str:
    """The flag a word names, as vLLM spells it: before '=' or '.', underscores as dashes."""
    name = word.split("=", 1)[0].split(".", 1)[0]
    return name[:2] + name[2:].replace("_", "-") if name.startswith("--") else name


def server_args_problem(words: list[str]) -> str | None:
    """Why the shell words of engine.extra_server_args may not reach a launched server (None: they may)."""
    i = 0
    while i < len(words):
        word = words[i]
        if (flag := managed_flag(word)) is not None:
            return f"{word!r} is vLLM's {flag}, which extra_server_args may not set: {SERVER_FLAGS[flag]}"
        name = _spelled(word)
        kind = INERT_FLAGS.get(name)
        if kind is None or "." in word.split("=", 1)[0]:
            return (f"{word!r} is not one of the vLLM flags extra_server_args passes on: only flags known not to load "
                    "code, open an address or change the model served are (scheduling, memory, kernels, logging; the "
                    "list is in docs/security.md)")
        given, value = "=" in word, word.split("=", 1)[1] if "=" in word else None
        if kind != SWITCH and value is None:
            if i + 1 == len(words):
                return f"{word!r} takes {_SHOWN[kind]}, and none follows"
            value, i = words[i + 1], i + 1
        if (kind == SWITCH and given) or (kind != SWITCH and not _VALUES[kind].fullmatch(value or "")):
            return f"{word!r} takes {_SHOWN[kind]}, got {value!r}"
        i += 1
    return None
