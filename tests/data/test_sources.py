"""The loaders refuse, in one DataError naming the source, what would hang or fail deep in a
library: a generator option, size or pace that would take hours, a generator that fails on its
options, a data file that is a folder, a device or not UTF-8."""

from __future__ import annotations

import time

import pytest

from selfopd.data import DataError, load_examples


@pytest.mark.parametrize("spec, pattern", [
    ("rg:chain_sum?max_terms=100000000&size=1", r"^rg:chain_sum: option max_terms=100000000 must be within "
                                                r"\[-100000, 100000\]"),
    ("rg:chain_sum?min_terms=nan&size=1", r"option min_terms=nan must be within"),
    ("rg:basic_arithmetic?max_digits=1e300&size=1", r"option max_digits=1e\+300 must be within"),
    ("rg:chain_sum?min_digits=100000&max_digits=100000&min_terms=2&max_terms=2&size=1",
     r"^rg:chain_sum row 0: the generator failed with options .*: ValueError: Exceeds the limit"),
])
def test_a_generator_option_that_would_hang_or_fail_is_one_error(spec, pattern):
    started = time.monotonic()
    with pytest.raises(DataError, match=pattern):
        load_examples(spec)
    assert time.monotonic() - started < 10


def test_an_option_up_to_its_own_default_is_taken():
    assert len(load_examples("rg:count_bits?max_n=2147483647&size=3")) == 3  # its default is past 10^5


def test_items_that_would_take_hours_are_refused_at_the_pace_of_the_first():
    started = time.monotonic()
    with pytest.raises(DataError, match=r"^rg:chain_sum: \d+ of 100000 items took \d+ s, so all of them would take "
                                        r"about \d+ s, past the 120 s selfopd gives a generator"):
        load_examples("rg:chain_sum?min_terms=20000&max_terms=20000&size=100000")
    assert time.monotonic() - started < 30


@pytest.mark.parametrize("make, pattern", [
    (lambda tmp: (tmp / "d.jsonl").mkdir() or tmp / "d.jsonl", r"d\.jsonl: is a folder, not a data file"),
    (lambda tmp: (tmp / "d.csv").write_bytes(b"prompt,answer\ncaf\xe9,2\n") and tmp / "d.csv",
     r"d\.csv:2: not UTF-8 text \(byte 0xe9 at column 4\); save the file as UTF-8"),
    (lambda tmp: (tmp / "d.json").write_bytes(b'[{"prompt": "\xff", "answer": "1"}]') and tmp / "d.json",
     r"d\.json:1: not UTF-8 text \(byte 0xff at column 14\)"),
])
def test_a_data_file_that_is_a_folder_or_not_utf8_is_named(tmp_path, make, pattern):
    with pytest.raises(DataError, match=pattern):
        load_examples(str(make(tmp_path)))
