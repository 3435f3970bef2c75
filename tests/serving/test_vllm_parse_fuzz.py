"""Property tests of reading vLLM's logprobs: a correct tensor or a ServerError, nothing else.

`parse_prompt_logprobs` turns a server's prompt_logprobs JSON into the teacher's scores and
`make_rollout` a completion's sampled logprobs into the sampler's: both feed the loss, so
a garbled reply must stop the step with a message naming the server (and the position),
never enter it as a shorter, padded or NaN tensor. The expected tensors are written
straight from the generated ground truth, not by parsing the JSON a second way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from selfopd.serving.vllm_answers import make_rollout, parse_prompt_logprobs
from selfopd.serving.server import ServerError

URL = "http://127.0.0.1:8000"
CLAMPED = -9999.0  # what vLLM's JSON says for -inf


@dataclass
class Position:
    """The truth at one prompt position: the top k (id, logprob) best first, and the actual token."""

    top: list[tuple[int, float]]
    actual: int
    actual_logprob: float
    actual_rank: int


@st.composite
def scored_prompts(draw):
    """(ids, start, top_k, positions): a prompt whose positions start.. are scored."""
    top_k = draw(st.integers(0, 4))
    length = draw(st.integers(2, 7))
    ids = draw(st.lists(st.integers(0, 60), min_size=length, max_size=length))
    start = draw(st.integers(1, length - 1))
    positions = []
    for token in ids:
        others = draw(st.lists(st.integers(0, 60).filter(lambda t, token=token: t != token), min_size=top_k,
                               max_size=top_k, unique=True))
        values = sorted(draw(st.lists(st.floats(-30, 0), min_size=top_k + 1, max_size=top_k + 1, unique=True)),
                        reverse=True)
        clamped = draw(st.integers(0, top_k))  # the least likely alternatives may be -inf
        top_values = values[:top_k - clamped] + [CLAMPED] * clamped
        finite_ranks = top_k - clamped
        if finite_ranks and draw(st.booleans()):  # the actual token is one of the top k
            rank = draw(st.integers(1, finite_ranks))
            others[rank - 1] = token
            positions.append(Position(list(zip(others, top_values)), token, top_values[rank - 1], rank))
        else:
            positions.append(Position(list(zip(others, top_values)), token, values[-1],
                                      top_k + 1 + draw(st.integers(0, 1000))))
    return ids, start, top_k, positions


def to_json(positions: list[Position]) -> list[dict | None]:
    """What a vLLM server sends: None for position 0, then {id: {logprob, rank, decoded_token}}."""
    entries: list[dict | None] = [None]
    for p in positions[1:]:
        entry = {str(i): {"logprob": lp, "rank": r, "decoded_token": "t"} for r, (i, lp) in enumerate(p.top, 1)}
        entry[str(p.actual)] = {"logprob": p.actual_logprob, "rank": p.actual_rank, "decoded_token": "t"}
        entries.append(entry)
    return entries


def expected(positions: list[Position], start: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    scored = positions[start:]
    logprobs = torch.tensor([p.actual_logprob for p in scored], dtype=torch.float32)
    ids = torch.tensor([[i for i, _ in p.top] for p in scored], dtype=torch.long).reshape(len(scored), top_k)
    values = torch.tensor([[-math.inf if lp <= CLAMPED else lp for _, lp in p.top] for p in scored],
                          dtype=torch.float32).reshape(len(scored), top_k)
    return logprobs, ids, values


# Changes a healthy reply survives unchanged, and breakages that must raise, at position p.
HARMLESS = ["none", "reversed_order", "extra_item_key", "unranked_extra", "low_ranked_extra", "before_start_none"]
BROKEN = ["entry_none", "entry_not_a_dict", "actual_missing", "actual_clamped", "actual_nan", "actual_inf",
          "actual_logprob_none", "actual_logprob_text", "topk_nan", "topk_rank_none", "topk_bad_id", "topk_item_list",
          "one_position_more", "one_position_less", "no_entries"]


def corrupt(entries: list, positions: list[Position], position: int, start: int, top_k: int, how: str) -> bool:
    """Apply `how` at `position` (a scored one); True when it must raise. Some breakages need
    a top k or an alternative that is not the actual token: then nothing changes (False)."""
    entry = entries[position]
    truth = positions[position]
    alternatives = [str(i) for i, _ in truth.top if i != truth.actual]
    spare = str(100 + position)  # an id that is nowhere else in the entry
    if how == "reversed_order":
        entries[position] = dict(reversed(list(entry.items())))
    elif how == "extra_item_key":
        for item in entry.values():
            item["bytes"] = [116]
    elif how == "unranked_extra":
        entry[spare] = {"logprob": -1.0, "rank": None}
    elif how == "low_ranked_extra":
        entry[spare] = {"logprob": -50.0, "rank": top_k + 1}
    elif how == "before_start_none":
        entries[start - 1] = None
    elif how == "entry_none":
        entries[position] = None
    elif how == "entry_not_a_dict":
        entries[position] = list(entry.items())
    elif how == "actual_missing":
        del entry[str(truth.actual)]
    elif how == "actual_clamped":
        entry[str(truth.actual)]["logprob"] = CLAMPED
    elif how == "actual_nan":
        entry[str(truth.actual)]["logprob"] = math.nan
    elif how == "actual_inf":
        entry[str(truth.actual)]["logprob"] = math.inf
    elif how == "actual_logprob_none":
        entry[str(truth.actual)]["logprob"] = None
    elif how == "actual_logprob_text":
        entry[str(truth.actual)]["logprob"] = "-0.5x"
    elif how == "topk_nan" and alternatives:
        entry[alternatives[0]]["logprob"] = math.nan
    elif how == "topk_rank_none" and alternatives:
        entry[alternatives[0]]["rank"] = None
    elif how == "topk_bad_id" and alternatives:
        entry["token"] = entry.pop(alternatives[0])
    elif how == "topk_item_list" and alternatives:
        entry[alternatives[0]] = [-0.5, 1]
    elif how == "one_position_more":
        entries.append(dict(entry))
    elif how == "one_position_less":
        entries.pop()
    elif how == "no_entries":
        entries.clear()
    else:
        return False
    return how in BROKEN


@given(scored_prompts(), st.sampled_from(HARMLESS + BROKEN), st.data())
@example(([5, 6, 7], 1, 0, [Position([], 5, 0.0, 1), Position([], 6, -0.5, 1), Position([], 7, -3.0, 40)]),
         "actual_nan", None)  # NaN passed every check and entered the teacher's logprobs
@example(([5, 6, 7], 1, 0, [Position([], 5, 0.0, 1), Position([], 6, -0.5, 1), Position([], 7, -3.0, 40)]),
         "one_position_less", None)  # was an IndexError from in-process (colocated) scoring
def test_prompt_logprobs_give_the_true_tensor_or_a_server_error(prompt, how, data):
    ids, start, top_k, positions = prompt
    entries = to_json(positions)
    position = data.draw(st.integers(start, len(ids) - 1)) if data is not None else len(ids) - 1
    must_raise = corrupt(entries, positions, position, start, top_k, how)
    if must_raise:
        with pytest.raises(ServerError) as error:
            parse_prompt_logprobs(entries, ids, start, top_k, URL)
        assert str(error.value).startswith(URL)
        if how not in ("one_position_more", "one_position_less", "no_entries"):
            assert f"position {position}" in str(error.value)
        return
    scores = parse_prompt_logprobs(entries, ids, start, top_k, URL)
    logprobs, topk_ids, topk_logprobs = expected(positions, start, top_k)
    assert torch.equal(scores.logprobs, logprobs)
    if top_k:
        assert torch.equal(scores.topk_ids, topk_ids)
        assert torch.equal(scores.topk_logprobs, topk_logprobs)
    else:
        assert scores.topk_ids is None and scores.topk_logprobs is None


json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(), st.text(max_size=5)),
    lambda children: st.one_of(st.lists(children, max_size=3),
                               st.dictionaries(st.one_of(st.text(max_size=3), st.integers(0, 9).map(str)), children,
                                               max_size=4)),
    max_leaves=10,
)
items = st.fixed_dictionaries({"logprob": st.one_of(st.floats(), st.just(CLAMPED), json_values)},
                              optional={"rank": st.one_of(st.none(), st.integers(-1, 5), json_values)})
entries_json = st.one_of(st.none(), json_values,
                         st.dictionaries(st.integers(0, 9).map(str), st.one_of(items, json_values), max_size=5))


@given(st.lists(st.integers(0, 9), min_size=2, max_size=5), st.integers(1, 4), st.integers(0, 3),
       st.lists(entries_json, max_size=6))
def test_garbage_prompt_logprobs_never_give_a_wrong_shape_or_another_error(ids, start, top_k, entries):
    start = min(start, len(ids) - 1)
    try:
        scores = parse_prompt_logprobs(entries, ids, start, top_k, URL)
    except ServerError as error:
        assert str(error).startswith(URL)
        return
    assert scores.logprobs.shape == (len(ids) - start,)
    assert torch.isfinite(scores.logprobs).all()
    if top_k:
        assert scores.topk_ids.shape == scores.topk_logprobs.shape == (len(ids) - start, top_k)
        assert not torch.isnan(scores.topk_logprobs).any()


sampled_values = st.one_of(st.floats(-50, 0), st.floats(), st.just(CLAMPED), st.none(), st.text(max_size=4),
                           st.integers(-5, 0))


@given(st.lists(st.integers(0, 100), max_size=6), st.one_of(st.none(), st.lists(sampled_values, max_size=7)),
       st.sampled_from(["stop", "length", "abort", None]))
@example([1, 2], [-0.1, math.nan], "stop")  # NaN became the sampler's logprob
@example([1, 2], [-0.1, CLAMPED], "stop")  # -inf: an infinite importance ratio
def test_rollout_has_one_finite_logprob_per_token_or_a_server_error(ids, logprobs, finish):
    try:
        rollout = make_rollout([7], ids, logprobs, finish, "text", URL)
    except ServerError as error:
        message = str(error)
        assert message.startswith(URL)
        if logprobs is not None and len(logprobs) == len(ids):
            bad = next(i for i, v in enumerate(logprobs)
                       if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= CLAMPED)
            assert f"completion token {bad} " in message
        return
    assert logprobs is not None and len(rollout.sampler_logprobs) == len(ids) == len(logprobs)
    assert rollout.sampler_logprobs == [float(v) for v in logprobs]
    assert all(math.isfinite(v) and v > CLAMPED for v in rollout.sampler_logprobs)
    assert rollout.finish_reason == ("stop" if finish == "stop" else "length")
