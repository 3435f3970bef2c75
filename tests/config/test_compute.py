"""The [engine] section's guard on engine.extra_server_args: it splits as shell words and sets no
flag selfopd sets on the servers it launches (a later copy would win: a server on 0.0.0.0, without
selfopd's key check or weight-push checks)."""

from __future__ import annotations

import pytest

from selfopd.config import ConfigError, load_config
from selfopd.config.compute import SERVER_FLAGS, managed_flag
from selfopd.engines.vllm_server import ServerSpec, server_command

# Flags selfopd sets that are tuning only: a user may set them again (the last copy wins).
TUNING = {"--enforce-eager", "--no-enable-chunked-prefill", "--max-num-batched-tokens", "--gpu-memory-utilization"}


@pytest.mark.parametrize("args, flag", [
    ("--host 0.0.0.0", "--host"), ("--host=0.0.0.0", "--host"), ("--ho 0.0.0.0", "--host"),
    ("--port 9999", "--port"), ("--served_model_name x", "--served-model-name"),
    ("--weight-transfer-config.backend nccl", "--weight-transfer-config"),
    ("--weight_transfer_config={}", "--weight-transfer-config"), ("--worker-extension-cls x.Y", "--worker-extension-cls"),
    ("--middleware x.y", "--middleware"), ("--api-key k", "--api-key"), ("--no-trust-remote-code", "--trust-remote-code"),
    ("--trust-remote-code", "--trust-remote-code"), ("--no-enable-prefix-caching", "--enable-prefix-caching"),
    ("-tp 2", "-tp"), ("--config more.yaml", "--config"), ("--seed 1 --max-model-len 9", "--max-model-len"),
])
def test_extra_server_args_may_not_set_a_flag_selfopd_sets(args, flag):
    with pytest.raises(ConfigError, match=rf"engine\.extra_server_args: '.+' is vLLM's {flag}, which "
                                          r"extra_server_args may not set: "):
        load_config(None, [f"engine.extra_server_args={args}"])


@pytest.mark.parametrize("args", ["--max-num-seqs 8", "--seed 1 --enforce-eager", "--model-impl transformers",
                                  "--hf-overrides '{\"rope_theta\": 1}'", "--kv-cache-dtype fp8", ""])
def test_other_extra_server_args_are_taken(args):
    assert load_config(None, [f"engine.extra_server_args={args}"]).engine.extra_server_args == args


def test_every_flag_selfopd_sets_on_a_server_is_guarded_or_tuning_only():
    """A flag added to the servers' command line must be added to SERVER_FLAGS (or to TUNING here)."""
    command = server_command(ServerSpec(name="student", model="/m", port=8100, gpu=True, eager=True,
                                        chunked_prefill=False, trust_remote_code=True))
    flags = {word.split("=")[0] for word in command if word.startswith("-") and word != "-m"}
    assert flags - TUNING and all(managed_flag(flag) in SERVER_FLAGS for flag in flags - TUNING), \
        sorted(flag for flag in flags - TUNING if managed_flag(flag) is None)
