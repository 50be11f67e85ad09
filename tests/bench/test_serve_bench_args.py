"""bench/serve_bench.py refuses output lengths it cannot draw before it builds anything."""

from __future__ import annotations

import sys

import pytest

from bench import serve_bench


@pytest.mark.parametrize("lo, hi", [(10, 4), (0, 8)])
def test_output_lengths_it_cannot_draw_are_refused_with_a_clear_error(monkeypatch, capsys, lo, hi):
    monkeypatch.setattr(sys, "argv", ["serve_bench", "--out-min", str(lo), "--out-max", str(hi)])
    monkeypatch.setattr(serve_bench, "setup", lambda *a: pytest.fail("built before the arguments were checked"))
    with pytest.raises(SystemExit) as exit_:
        serve_bench.main()
    assert exit_.value.code == 2
    assert f"1 <= --out-min <= --out-max; got --out-min {lo} --out-max {hi}" in capsys.readouterr().err
