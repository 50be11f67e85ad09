"""bench.decode_step's turns: kernel settings and serving dtypes pair up, or one value of either
applies to every turn."""

import pytest

from bench.decode_step import pair_up


def test_settings_pair_up_in_order():
    assert pair_up(["off", "on"], ["bfloat16", "float32"]) == [("off", "bfloat16"), ("on", "float32")]


def test_one_value_goes_with_every_value_of_the_other():
    assert pair_up(["off", "on"], [None]) == [("off", None), ("on", None)]
    assert pair_up(["auto"], ["bfloat16", "float32"]) == [("auto", "bfloat16"), ("auto", "float32")]
    assert pair_up(["auto"], [None]) == [("auto", None)]


def test_lists_of_two_different_lengths_are_refused():
    with pytest.raises(SystemExit, match="pair up"):
        pair_up(["off", "on", "auto"], ["bfloat16", "float32"])
