"""bench/experiments/lane_split.py: a contended step's lanes timed, and their thread time split by where it went."""

from __future__ import annotations

import threading

import pytest
import torch

from bench.experiments.lane_split import Span, Step, lane_clock, split
from server.engines.native.core.step import Item, StepBatch
from server.engines.native.model.lanes import Lanes
from server.engines.native.model.llama import LlamaRunner


def test_the_split_accounts_for_every_second_of_the_lanes():
    steps = [
        # lane 0 busy 0.0-1.0 (0.6 on a CPU, 0.3 runnable, so 0.1 blocked); lane 1 done at 0.5: 0.5 idle at the join
        Step(0.0, 1.0, [Span(0.0, 1.0, cpu=0.6, runnable=0.3), Span(0.0, 0.5, cpu=0.5, runnable=0.0)]),
        # 0.25 s between the steps; then one item: the second lane idles the whole step
        Step(1.25, 2.0, [Span(1.25, 2.0, cpu=0.75, runnable=0.0)]),
        # 0.5 s between; a probe step on the team (no lanes) for 0.5 s
        Step(2.5, 3.0, []),
    ]
    out = split(steps, lanes=2)
    assert out["wall_s"] == pytest.approx(3.0)
    assert (out["steps"], out["team_steps"]) == (2, 1)
    assert out["on_cpu_s"] == pytest.approx(1.85)
    assert out["runnable_s"] == pytest.approx(0.3)
    assert out["blocked_s"] == pytest.approx(0.1)
    assert out["idle_at_join_s"] == pytest.approx(0.5 + 0.75)
    # lane 1 finished 0.5 s early; in the second step the other lane had no item
    assert (out["join_before_s"], out["join_after_s"], out["join_no_item_s"]) == pytest.approx((0.0, 0.5, 0.75))
    assert out["team_steps_s"] == pytest.approx(2 * 0.5)
    assert out["between_steps_s"] == pytest.approx(2 * (0.25 + 0.5))
    shares = ["on_cpu_share", "runnable_share", "blocked_share", "idle_at_join_share", "team_steps_share",
              "between_steps_share"]
    assert sum(out[k] for k in shares) == pytest.approx(1.0)
    assert out["cpu_of_runnable"] == pytest.approx(1.85 / 2.15)
    with pytest.raises(ValueError):
        split([], lanes=2)
    with pytest.raises(ValueError):
        split([Step(0.0, 1.0, [])], lanes=2)  # only team steps: nothing ran on lanes


def test_the_idle_at_the_join_splits_into_before_and_after_a_lanes_forward():
    # lane 1 starts 0.3 s late (its wake-up) and ends 0.2 s before lane 0; lane 2 ran nothing
    step = Step(0.0, 1.0, [Span(0.0, 1.0, cpu=1.0, runnable=0.0), Span(0.3, 0.8, cpu=0.5, runnable=0.0)])
    out = split([step], lanes=3)
    assert (out["join_before_s"], out["join_after_s"], out["join_no_item_s"]) == pytest.approx((0.3, 0.2, 1.0))
    assert out["idle_at_join_s"] == pytest.approx(1.5)
    assert out["join_before_share"] == pytest.approx(0.1)


def _batch(n: int) -> StepBatch:
    return StepBatch.build([Item(slot=i, start=0, tokens=(1, 2) if i == 0 else (3,)) for i in range(n)])


ran_on: set[int] = set()


def _logits(sub: StepBatch) -> torch.Tensor:
    ran_on.add(threading.get_ident())
    return torch.arange(int(sub.logit_index.numel()), dtype=torch.float32)[:, None].repeat(1, 4)


def test_the_clock_times_each_lanes_forward_and_puts_the_lanes_back():
    ticks = iter(range(1000))
    seen = set()
    ran_on.clear()

    def clock() -> tuple[float, float]:
        seen.add(threading.get_ident())
        return float(next(ticks)), 0.0

    originals = Lanes.run, Lanes.__init__, LlamaRunner.forward
    with lane_clock(lanes=3, clock=clock) as log:
        lanes = Lanes(2)  # the engine's count; the clock asks for 3
        try:
            assert lanes.n == 3 and log.lanes == 3
            out = lanes.run(_batch(4), _logits)
            lanes.run(_batch(1), _logits)  # one item: one lane's forward
        finally:
            lanes.close()
    assert out.shape == (4, 4)
    assert [len(s.spans) for s in log.steps] == [3, 1]
    assert all(s.start <= sp.start <= sp.end <= s.end for s in log.steps for sp in s.spans)
    # each forward's clock was read on the thread that ran it (the pool may reuse one helper thread)
    assert seen == ran_on and threading.get_ident() in seen and len(seen) >= 2
    assert (Lanes.run, Lanes.__init__, LlamaRunner.forward) == originals
