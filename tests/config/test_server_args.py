"""engine.extra_server_args is an allow-list: it splits as shell words, sets no flag selfopd sets on the
servers it launches (a later copy would win: a server on 0.0.0.0, without selfopd's key check or weight-push
checks), and passes on only flags known to be inert, each with a value of a checked shape. Flags that load
Python code or change what is served, which a deny-list missed, are refused."""

from __future__ import annotations

import functools

import pytest

from selfopd.config import ConfigError, load_config
from selfopd.config.server_args import INERT_FLAGS, SERVER_FLAGS, SWITCH, managed_flag
from selfopd.serving.server import ServerSpec, server_command

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


@pytest.mark.parametrize("args", [
    "--tool-parser-plugin /tmp/evil.py", "--reasoning-parser-plugin=/tmp/evil.py", "--logits-processors evil.Proc",
    "--worker-cls evil.Worker", "--kv-transfer-config {\"kv_connector_module_path\":\"evil\"}",
    "--kv_transfer_config.kv_connector_module_path evil", "--load-format dummy", "--chat-template /tmp/t.jinja",
    "--hf-overrides {\"rope_theta\":1}", "--io-processor-plugin evil", "--scheduler-cls evil.S",
    "--compilation-config {}", "--speculative-config {}", "--quantization fp8", "--uds /tmp/s.sock",
    "--allowed-local-media-path /", "--tokenizer /tmp/other", "--download-dir /tmp", "--lora-modules a=/tmp/a",
    "--enable-auto-tool-choice", "--otlp-traces-endpoint http://x", "--max-num-seqs 8 --grpc", "stray",
    "--max-num-seqs.x 8",
])
def test_flags_not_known_to_be_inert_are_refused(args):
    """The flags the security re-test ran a planted file through, and others that load code, open an
    address or change the model, are refused by not being on the list."""
    with pytest.raises(ConfigError, match=r"engine\.extra_server_args: '.+' is not one of the vLLM flags "
                                          r"extra_server_args passes on: only flags known not to load code"):
        load_config(None, [f"engine.extra_server_args={args}"])


@pytest.mark.parametrize("args, why", [
    ("--max-num-seqs", "takes a whole number, and none follows"), ("--max-num-seqs eight", "takes a whole number"),
    ("--max-num-seqs=-1", "takes a whole number"), ("--kv-cache-dtype /tmp/x", "takes one plain word"),
    ("--attention-backend=a;b", "takes one plain word"), ("--enforce-eager=1", "takes no value"),
    ("--gpu-memory-utilization 1e9", "takes a number"),
])
def test_a_value_of_the_wrong_shape_is_refused(args, why):
    with pytest.raises(ConfigError, match=rf"engine\.extra_server_args: '.+' {why}"):
        load_config(None, [f"engine.extra_server_args={args}"])


@pytest.mark.parametrize("args", ["--max-num-seqs 8", "--seed 1 --enforce-eager", "--model-impl transformers",
                                  "--kv-cache-dtype fp8", "--max-num-batched-tokens=8k --no-enable-chunked-prefill",
                                  "-pp 2 --disable-log-stats --gpu-memory-utilization 0.85", ""])
def test_inert_extra_server_args_are_taken(args):
    assert load_config(None, [f"engine.extra_server_args={args}"]).engine.extra_server_args == args


def test_every_flag_selfopd_sets_on_a_server_is_guarded_or_tuning_only():
    """A flag added to the servers' command line must be added to SERVER_FLAGS (or to TUNING here)."""
    command = server_command(ServerSpec(name="student", model="/m", port=8100, gpu=True, eager=True,
                                        chunked_prefill=False, trust_remote_code=True))
    flags = {word.split("=")[0] for word in command if word.startswith("-") and word != "-m"}
    assert flags - TUNING and all(managed_flag(flag) in SERVER_FLAGS for flag in flags - TUNING), \
        sorted(flag for flag in flags - TUNING if managed_flag(flag) is None)


@functools.lru_cache(maxsize=1)
def _vllm_actions() -> dict[str, object]:
    """Every option string of the installed vLLM's api_server parser -> its argparse action."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    return {option: action for action in parser._actions for option in action.option_strings}


@pytest.mark.slow
@pytest.mark.parametrize("flag", sorted(INERT_FLAGS))
def test_each_allowed_flag_is_a_flag_of_the_installed_vllm_of_the_declared_kind(flag):
    """The list is checked against vLLM's own parser: a renamed flag, or a switch that takes a value, fails here."""
    action = _vllm_actions().get(flag)
    assert action is not None, f"{flag} is not a flag of the installed vLLM"
    assert (action.nargs == 0) == (INERT_FLAGS[flag] == SWITCH), (flag, action.nargs)
