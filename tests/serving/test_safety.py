"""Safety settings without a server: model.trust_remote_code is the only way a model's own
code runs (transformers loads, launched vLLM servers, colocated vLLM), launched servers bind
to loopback (another address needs a key), every route but /health goes through the key
middleware, and the key (engine.api_key_env's or the launch's own) reaches servers without
going on a command line or in a config. The same settings against a real server: tests/serving/test_vllm_faults.py."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from selfopd.config import ConfigError, load_config
from selfopd.config.bundles import ServingSettings
from selfopd.engines.build import load_model, model_options
from selfopd.serving.server_auth import SECRET_ENV, TRAINER_ENV, transfer_secret
from selfopd.serving.transfer_wire import interface_of
from selfopd.serving.server import server_command, server_env
from selfopd.core.models import ModelError
from selfopd.serving.launch import planned_servers, serve_key

ROOT = Path(__file__).resolve().parents[2]

CUSTOM_CONFIG = """from transformers import LlamaConfig


class CustomConfig(LlamaConfig):
    model_type = "selfopd_custom"
"""
CUSTOM_MODEL = """from transformers import LlamaForCausalLM

from .configuration_custom import CustomConfig


class CustomForCausalLM(LlamaForCausalLM):
    config_class = CustomConfig
"""


@pytest.fixture
def remote_code_model(tiny_model_dir, tmp_path):
    """The tiny model as an architecture transformers does not know: its config's auto_map
    points at Python files in the folder, which only trust_remote_code runs."""
    folder = tmp_path / "custom-model"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="selfopd_custom", architectures=["CustomForCausalLM"],
                  auto_map={"AutoConfig": "configuration_custom.CustomConfig",
                            "AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"})
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "configuration_custom.py").write_text(CUSTOM_CONFIG)
    (folder / "modeling_custom.py").write_text(CUSTOM_MODEL)
    return folder



def _demo(*overrides):
    """experiments/demo/demo.toml with `overrides` (--set values); temperature 1, which vLLM engines need."""
    return load_config(ROOT / "experiments/demo/demo.toml", ["rollout.temperature=1.0", *overrides])


def _served(*overrides) -> ServingSettings:
    """What the vLLM side reads of `_demo(*overrides)`."""
    return ServingSettings.of(_demo(*overrides))


def test_a_model_that_needs_its_own_code_is_refused_unless_the_config_trusts_it(remote_code_model):
    refusing = _demo(f"model.student={remote_code_model}")
    assert model_options(refusing.model)["trust_remote_code"] is False  # the default
    with pytest.raises(ModelError, match=r"custom-model: this model needs its own Python code .* "
                                         r"model\.trust_remote_code = true"):
        load_model(remote_code_model, **model_options(refusing.model))
    trusting = _demo(f"model.student={remote_code_model}", "model.trust_remote_code=true")
    model, _ = load_model(remote_code_model, **model_options(trusting.model))
    assert type(model).__name__ == "CustomForCausalLM"  # the folder's own class ran


def test_launched_servers_get_trust_remote_code_only_from_the_config():
    default, trusting = planned_servers(_served("engine.kind=vllm")), planned_servers(
        _served("engine.kind=vllm", "model.trust_remote_code=true"))
    assert all("--trust-remote-code" not in server_command(spec) for spec in default)
    assert all("--trust-remote-code" in server_command(spec) for spec in trusting)


def test_colocated_vllm_gets_trust_remote_code_from_the_config(monkeypatch):
    """What reaches `vllm.LLM`: captured where the engine hands its options over (starting
    colocated vLLM is tests/serving/test_colocate.py's job; its default is checked there)."""
    from selfopd.serving import colocate

    handed = []

    def capture(options):
        handed.append(options)
        raise RuntimeError("captured")

    monkeypatch.setattr(colocate, "_start_in_process", capture)
    for setting in ("false", "true"):
        config = _demo("engine.kind=vllm_colocate", f"model.trust_remote_code={setting}")
        with pytest.raises(RuntimeError, match="captured"):
            colocate.open_colocated_engines(ServingSettings.of(config), contextlib.ExitStack())
    assert [options["trust_remote_code"] for options in handed] == [False, True]


def test_launched_servers_bind_to_loopback_unless_told_otherwise(monkeypatch):
    (spec, teacher) = planned_servers(_served("engine.kind=vllm"))
    for server in (spec, teacher):
        command = server_command(server)
        assert command[command.index("--host") + 1] == "127.0.0.1"
    monkeypatch.setenv("SELFOPD_VLLM_API_KEY", "sk-selfopd-test-0123456789abcdefghijklmnop")
    (spec, _) = planned_servers(_served("engine.kind=vllm", "engine.host=0.0.0.0", "engine.api_key_env=SELFOPD_VLLM_API_KEY"))
    assert server_command(spec)[server_command(spec).index("--host") + 1] == "0.0.0.0"
    assert spec.url.startswith("http://127.0.0.1:")  # the client still connects on this machine


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "10.0.0.1", "server-node"])
def test_a_host_the_network_reaches_needs_a_key(host):
    with pytest.raises(ConfigError, match=rf"^--set engine\.host={host}: engine\.host: '{host}' is not a loopback "
                                          r"address: .* set engine\.api_key_env") as error:
        _demo("engine.kind=vllm", f"engine.host={host}")
    assert "\n" not in str(error.value)
    for loopback in ("127.0.0.2", "::1", "localhost"):
        assert _demo(f"engine.host={loopback}").engine.host == loopback


def test_every_route_of_a_launched_server_goes_through_the_key_middleware():
    command = server_command(replace(planned_servers(_served("engine.kind=vllm"))[0], api_key="k"))
    assert command[command.index("--middleware") + 1] == "selfopd.serving.server_auth.RequireKey"


def test_the_workers_get_the_push_secret_and_the_trainer_address_and_bind_their_own_groups_to_loopback(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth-of-the-trainer")  # a trainer's torchrun setting, not the server's
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    spec = replace(planned_servers(_served("engine.kind=vllm", "engine.trainer_address=127.0.0.3"))[0], api_key="k1")
    env = server_env(spec)
    assert env[SECRET_ENV] == transfer_secret("k1") and env[TRAINER_ENV] == "127.0.0.3"
    assert env["GLOO_SOCKET_IFNAME"] == interface_of("127.0.0.1")  # vLLM's own gloo groups stay on this machine
    assert env["NCCL_SOCKET_IFNAME"] == f"={interface_of('127.0.0.1')}"  # NCCL towards the trainer (untested on a GPU)
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "=ib0")
    assert server_env(spec)["NCCL_SOCKET_IFNAME"] == "=ib0"  # a choice of the user's is kept


def test_the_api_key_reaches_servers_in_their_environment_never_their_command_line(monkeypatch):
    key = "sk-selfopd-test-0123456789abcdefghijklmnop"
    monkeypatch.setenv("SELFOPD_VLLM_API_KEY", key)
    monkeypatch.setenv("VLLM_API_KEY", "inherited-by-accident")
    keyed = planned_servers(_served("engine.kind=vllm", "engine.api_key_env=SELFOPD_VLLM_API_KEY"))
    for spec in keyed:
        assert server_env(spec)["VLLM_API_KEY"] == key
        assert key not in " ".join(server_command(spec)) and key not in repr(spec)
    monkeypatch.setenv(SECRET_ENV, "inherited-too")
    for spec in planned_servers(_served("engine.kind=vllm")):  # no key configured: the launch's own, never the inherited
        assert spec.api_key is None and not {"VLLM_API_KEY", SECRET_ENV} & set(server_env(spec))  # refuses all
        assert server_env(replace(spec, api_key="generated"))["VLLM_API_KEY"] == "generated"


def test_api_key_env_must_name_a_set_variable_and_is_never_echoed(monkeypatch, tmp_path):
    monkeypatch.delenv("SELFOPD_NO_SUCH_KEY", raising=False)
    config = _demo("engine.kind=vllm", "engine.api_key_env=SELFOPD_NO_SUCH_KEY")
    with pytest.raises(ConfigError, match="engine.api_key_env.*SELFOPD_NO_SUCH_KEY, which is not set"):
        config.engine.api_key()
    pasted = "sk-live-abc.def/123"  # the key itself, pasted into a config file by mistake
    (tmp_path / "keyed.toml").write_text(f'[engine]\napi_key_env = "{pasted}"\n')
    with pytest.raises(ConfigError, match="keyed.toml: engine.api_key_env: must be the NAME") as error:
        load_config(tmp_path / "keyed.toml")
    assert pasted not in str(error.value)


@pytest.mark.parametrize("variable", ["HOME", "PATH", "USER", "CUDA_VISIBLE_DEVICES"])
def test_api_key_env_must_name_a_variable_that_holds_a_secret(variable):
    """api_key_env = HOME made $HOME's value the key of servers on 0.0.0.0 (and sent it as a bearer token)."""
    with pytest.raises(ConfigError, match=rf"engine\.api_key_env: '{variable}' does not name a secret: .* \(its name "
                                          r"contains KEY, TOKEN, SECRET or PASSWORD"):
        _demo("engine.kind=vllm", "engine.host=0.0.0.0", f"engine.api_key_env={variable}")


@pytest.mark.parametrize("variable, value", [("SELFOPD_WEAK_KEY", "/root"), ("SELFOPD_WEAK_KEY", "password"),
                                             ("SELFOPD_WEAK_KEY", "a" * 40), ("SELFOPD_WEAK_KEY", "abc def " * 6),
                                             ("SELFOPD_WEAK_KEY", "0123456789" * 3)])
def test_a_launched_server_takes_only_a_key_that_looks_like_a_secret(monkeypatch, variable, value):
    """A variable's value is a launched server's key (which alone keeps the network off its routes) only when
    it is 32+ random printable characters; the value is never echoed."""
    monkeypatch.setenv(variable, value)
    config = _demo("engine.kind=vllm", "engine.host=0.0.0.0", f"engine.api_key_env={variable}")
    with pytest.raises(ConfigError, match=rf"engine\.api_key_env: the value of {variable} is not a key a launched "
                                          r"server can take: it must be 32 or more random") as error:
        planned_servers(ServingSettings.of(config))
    assert value not in str(error.value)
    with pytest.raises(ConfigError, match="is not a key a launched server can take"):
        with serve_key(config.engine, Path("/nonexistent")):
            pass
    assert config.engine.api_key() == value  # a running server's own key is the server's business: it is sent


def test_a_strong_key_is_taken_for_a_launch(monkeypatch):
    monkeypatch.setenv("SELFOPD_STRONG_KEY", secrets.token_hex(16))
    (spec, _) = planned_servers(_served("engine.kind=vllm", "engine.host=0.0.0.0", "engine.api_key_env=SELFOPD_STRONG_KEY"))
    assert spec.api_key == os.environ["SELFOPD_STRONG_KEY"]
