"""What a data spec may ask for: at most MAX_SIZE generated items (one part or a mixture's parts
in all) and seeds in [0, 2^32 - 1], each refused in one error giving the limit."""

from __future__ import annotations

import pytest

from selfopd.data import DataError, load_examples, parse_data_spec
from selfopd.data.spec import MAX_SIZE


@pytest.mark.parametrize("spec, pattern", [
    ("rg:chain_sum?size=100000000", r"^rg:chain_sum: size must be in \[1, 100000\] .*got 100000000$"),
    (f"rg:chain_sum?size={MAX_SIZE + 1}", r"size must be in \[1, 100000\]"),
    ("rg:chain_sum?size=0", r"size must be in \[1, 100000\]"),
    ("rg:chain_sum?size=10^8", r"option 'size': expected int, got '10\^8'"),
    ("rg:chain_sum?seed=99999999999999999999", r"^rg:chain_sum: seed must be in \[0, 4294967295\], got 9+$"),
    ("rg:chain_sum?seed=-1", r"seed must be in \[0, 4294967295\], got -1"),
    ("kb:countries?seed=4294967296", r"^kb:countries: seed must be in \[0, 4294967295\]"),
])
def test_a_spec_past_its_limits_is_refused_when_parsed(spec, pattern):
    with pytest.raises(DataError, match=pattern):
        parse_data_spec(spec)


def test_the_limits_themselves_are_taken():
    assert parse_data_spec(f"rg:chain_sum?size={MAX_SIZE}&seed=4294967295").size == MAX_SIZE


def test_a_mixture_asks_for_at_most_max_size_generated_items_in_all():
    spec = " + ".join(f"rg:chain_sum?size=40000&seed={seed}" for seed in range(3))
    with pytest.raises(DataError, match=r"its parts ask for 120000 generated items in all, past 100000"):
        load_examples(spec)
