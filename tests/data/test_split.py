"""selfopd.data.split: a run folder's split.json is read as data; anything but the record a run writes
is one DataError naming the file."""

from __future__ import annotations

import json

import pytest

from selfopd.data import DataError
from selfopd.data.split import SplitRecord

GOOD = {"data": "rg:chain_sum", "split_seed": 0, "eval_ids": ["a"], "eval_prompts": ["k"], "train_prompts": ["j"]}


def test_a_written_record_reads_back(tmp_path):
    record = SplitRecord(**GOOD)
    record.write(tmp_path)
    assert SplitRecord.read(tmp_path) == record


@pytest.mark.parametrize("text, expected", [
    (b"\x00\x01garbage", "not valid JSON"),
    (b"\xff\xfe", "not valid JSON"),
    (b'{"data": "x", "split_s', "not valid JSON"),
    (b"[1, 2]", r"expected data, split_seed, eval_ids, eval_prompts and train_prompts"),
    (json.dumps({**GOOD, "extra": 1}).encode(), "expected data, split_seed"),
    (json.dumps({**GOOD, "eval_ids": "a"}).encode(), "expected data, split_seed"),
    (json.dumps({**GOOD, "split_seed": "0"}).encode(), "expected data, split_seed"),
    (json.dumps({**GOOD, "train_prompts": [1]}).encode(), "expected data, split_seed"),
])
def test_a_garbage_split_record_is_one_error_naming_the_file(tmp_path, text, expected):
    (tmp_path / "split.json").write_bytes(text)
    with pytest.raises(DataError, match=rf"^{tmp_path}/split\.json: not a split record \(.*{expected}"):
        SplitRecord.read(tmp_path)
