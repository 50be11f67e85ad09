"""The held-out estimate a registration reports (training.estimate): a Wilson interval, its n,
and the note below the floor; the fields are plain numbers and strings (a job keeps only those)."""

from __future__ import annotations

import pytest

from training.estimate import LEVEL, MIN_HELD, exact_estimate, wilson


@pytest.mark.parametrize(("right", "n", "low", "high"), [
    (4, 4, 0.5965, 1.0),  # "1.0 from 4 held-out examples"
    (5, 8, 0.3480, 0.8388),
    (0, 5, 0.0, 0.3511),
    (10, 10, 0.7871, 1.0),
])
def test_wilson_interval(right, n, low, high):
    lo, hi = wilson(right, n)
    assert lo == pytest.approx(low, abs=1e-4) and hi == pytest.approx(high, abs=1e-4)


def test_the_interval_narrows_with_n_and_holds_the_rate():
    bounds = [wilson(n // 2, n) for n in (4, 8, 16, 64, 256)]
    widths = [hi - lo for lo, hi in bounds]
    assert widths == sorted(widths, reverse=True)
    for right, n in ((0, 3), (1, 3), (3, 3), (7, 20)):
        lo, hi = wilson(right, n)
        assert 0.0 <= lo <= right / n <= hi <= 1.0


@pytest.mark.parametrize("bad", [(1, 0), (5, 4), (-1, 3)])
def test_wilson_refuses_impossible_counts(bad):
    with pytest.raises(ValueError):
        wilson(*bad)


def test_below_the_floor_it_says_too_few():
    out = exact_estimate(1.0, 4)
    assert out["eval_exact_n"] == 4 and out["eval_exact_level"] == LEVEL
    assert out["eval_exact_low"] == pytest.approx(0.5965, abs=1e-4) and out["eval_exact_high"] == 1.0
    assert out["eval_note"].startswith("too few held-out examples: 4 of 4 right, 90% interval 0.60-1.00")
    assert f"needs {MIN_HELD}" in out["eval_note"]


def test_at_the_floor_the_figure_stands_with_its_interval():
    out = exact_estimate(0.75, 12)
    assert out["eval_exact_n"] == 12 and "eval_note" not in out
    assert out["eval_exact_low"] < 0.75 < out["eval_exact_high"]
    assert "eval_note" in exact_estimate(0.75, MIN_HELD - 1) and "eval_note" not in exact_estimate(0.7, MIN_HELD)


@pytest.mark.parametrize(("exact", "n"), [(None, 0), (None, 3), (0.5, 0)])
def test_nothing_held_out_says_so(exact, n):
    out = exact_estimate(exact, n)
    assert out["eval_exact_n"] == 0 and "no held-out examples" in out["eval_note"]
    assert "eval_exact_low" not in out


def test_every_field_is_a_plain_scalar():
    for out in (exact_estimate(1.0, 4), exact_estimate(0.5, 20), exact_estimate(None, 0)):
        assert all(isinstance(v, int | float | str) and not isinstance(v, bool) for v in out.values())
