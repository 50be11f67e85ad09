"""Where a contended step's lanes spend their time, beside busy processes.

Runs the standard workload of bench/serve_bench.py, variant (a), with the engine's contended steps
on lanes (server/engines/native/model/lanes.py), once beside each count of busy processes, and splits
the lanes' time over the run: n lanes hold n x the run's wall of thread time, spent

    on a CPU          inside their forwards (schedstat of each lane's thread)
    runnable          inside their forwards, waiting for a CPU the busy processes hold
    blocked           inside their forwards, neither (the GIL, a lock, a page fault)
    idle at the join  the step's lanes are not all inside their forwards, split as
        before          the lane's forward has not started (a helper lane's wake-up, the engine
                        thread's sub-batches)
        after           its forward is done and the step's slowest is not
        no item         the step had fewer items than lanes: a lane had nothing to run
    team steps        the governor's probes: a step on the engine's OpenMP team, not on lanes
    between steps     no forward: the engine thread's serial part (scheduling, sampling,
                      detokenising) or its wait for a CPU there; the helpers sleep

A lane's share of the CPUs is its on-CPU time over its runnable time; what it does with it is the
CPU a token. `--lanes N` runs N lanes instead of the engine's thread count (more lanes than CPUs).

    .venv/bin/python -m bench.experiments.lane_split --busy 2,6 --lanes 2 --dtype float32
    .venv/bin/python -m bench.experiments.lane_split --backbone tiny --requests 8 --busy 1    # a quick smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import server  # noqa: F401  (before torch: OpenMP spin defaults, server/infra/openmp.py)
from server.infra import openmp

# isort: split
import torch

from bench.contention import busy_processes
from bench.serve_bench import run_engine, setup, workload
from server.engines.dtype import serving_dtype
from server.engines.native.config import EngineConfig
from server.engines.native.core.engine import NativeEngine as Engine
from server.engines.native.core.step import StepBatch
from server.engines.native.model.lanes import Lanes
from server.engines.native.model.llama import LlamaRunner
from server.engines.native.tuning import Tuning


@dataclass(frozen=True)
class Span:
    """One lane's forward in one step: wall (perf_counter) and its thread's schedstat deltas (s)."""

    start: float
    end: float
    cpu: float
    runnable: float


@dataclass(frozen=True)
class Step:
    """One forward of the runner; no spans: it ran on the team, not on lanes."""

    start: float
    end: float
    spans: list[Span]


@dataclass
class LaneLog:
    lanes: int = 0
    steps: list[Step] = field(default_factory=list)
    forward_spans: list[Span] | None = None  # the spans of the runner's forward in progress

    def clear(self) -> None:
        self.steps.clear()


def thread_sched() -> tuple[float, float]:
    """(seconds on a CPU, seconds runnable and waiting) of the calling thread."""
    with open("/proc/thread-self/schedstat") as f:
        on_cpu, waiting = f.read().split()[:2]
    return int(on_cpu) / 1e9, int(waiting) / 1e9


@contextlib.contextmanager
def lane_clock(lanes: int | None = None, clock: Callable[[], tuple[float, float]] = thread_sched) -> Iterator[LaneLog]:
    """While inside: every forward of the Llama runner and every Lanes.run is timed into the log;
    lanes: the count every Lanes made inside runs (None: the engine's own)."""
    log = LaneLog()
    run, init, forward = Lanes.run, Lanes.__init__, LlamaRunner.forward

    def counted_init(self: Lanes, n: int) -> None:
        init(self, lanes or n)
        log.lanes = self.n

    def timed_forward(self: LlamaRunner, batch: StepBatch) -> torch.Tensor:
        log.forward_spans = spans = []
        started = time.perf_counter()
        try:
            return forward(self, batch)
        finally:
            log.steps.append(Step(started, time.perf_counter(), spans))
            log.forward_spans = None

    def timed_run(self: Lanes, batch: StepBatch, compute: Callable[[StepBatch], torch.Tensor]) -> torch.Tensor:
        inside = log.forward_spans is not None
        spans: list[Span] = log.forward_spans if log.forward_spans is not None else []

        def timed(sub: StepBatch) -> torch.Tensor:
            cpu0, wait0 = clock()
            t0 = time.perf_counter()
            try:
                return compute(sub)
            finally:
                t1 = time.perf_counter()
                cpu1, wait1 = clock()
                spans.append(Span(t0, t1, cpu1 - cpu0, wait1 - wait0))  # list.append: one lane at a time

        log.lanes = self.n
        started = time.perf_counter()
        out = run(self, batch, timed)
        if not inside:  # called apart from a runner's forward
            log.steps.append(Step(started, time.perf_counter(), spans))
        return out

    Lanes.__init__, Lanes.run, LlamaRunner.forward = counted_init, timed_run, timed_forward  # type: ignore[method-assign]
    try:
        yield log
    finally:
        Lanes.__init__, Lanes.run, LlamaRunner.forward = init, run, forward  # type: ignore[method-assign]


def split(steps: list[Step], lanes: int) -> dict[str, float]:
    """The lanes' thread time from the first step's start to the last one's end, by where it went
    (seconds, and each as a share of the total)."""
    if not any(st.spans for st in steps) or lanes < 1:
        raise ValueError("no lane steps to split")
    wall = steps[-1].end - steps[0].start
    on_lanes = [st for st in steps if st.spans]
    spans = [s for st in on_lanes for s in st.spans]
    in_forward = sum(s.end - s.start for s in spans)
    on_cpu = sum(s.cpu for s in spans)
    runnable = sum(s.runnable for s in spans)
    before = sum(s.start - st.start for st in on_lanes for s in st.spans)
    after = sum(st.end - s.end for st in on_lanes for s in st.spans)
    no_item = sum((lanes - len(st.spans)) * (st.end - st.start) for st in on_lanes)
    team = lanes * sum(st.end - st.start for st in steps if not st.spans)
    between = lanes * sum(b.start - a.end for a, b in itertools.pairwise(steps))
    parts = {"on_cpu_s": on_cpu, "runnable_s": runnable, "blocked_s": max(0.0, in_forward - on_cpu - runnable),
             "idle_at_join_s": before + after + no_item, "team_steps_s": team, "between_steps_s": between}
    total = lanes * wall
    out: dict[str, float] = {"steps": len(on_lanes), "team_steps": len(steps) - len(on_lanes), "lanes": lanes,
                             "wall_s": wall, **parts}
    out.update({k.removesuffix("_s") + "_share": v / total for k, v in parts.items()})
    # the idle at the join's parts (in it, not beside it: the shares above sum to 1 without them)
    joins = {"join_before_s": before, "join_after_s": after, "join_no_item_s": no_item}
    out.update(joins)
    out.update({k.removesuffix("_s") + "_share": v / total for k, v in joins.items()})
    out["cpu_of_runnable"] = on_cpu / (on_cpu + runnable) if on_cpu + runnable else 0.0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--busy", default="2,6", help="busy-process counts, one run each")
    ap.add_argument("--lanes", type=int, default=None, help="lanes a contended step runs on (default: --threads)")
    ap.add_argument("--backbone", default="default")
    ap.add_argument("--tasks", type=int, default=48)
    ap.add_argument("--skills", type=int, default=8)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--out-min", type=int, default=4)
    ap.add_argument("--out-max", type=int, default=128)
    ap.add_argument("--out-dist", choices=["uniform", "loguniform"], default="loguniform")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="auto", help="the engine's serving dtype (auto: as the server picks)")
    ap.add_argument("--weight-kernel", choices=["auto", "on", "off"], default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    args.device = "cpu"
    if args.lanes is not None and args.lanes < 2:
        ap.error("--lanes must be at least 2")

    torch.set_num_threads(args.threads)
    dtype = serving_dtype("cpu", None if args.dtype == "auto" else args.dtype)
    tmp = Path(tempfile.mkdtemp(prefix="polyserve-lanes-"))
    bb, _store, rm, _pm, tasks, adapters = openmp.in_fresh_thread(setup, args, dtype, tmp)
    openmp.one_thread()
    jobs = workload(args.requests, tasks, args.out_min, args.out_max, args.seed, args.out_dist)
    results = []
    for busy in [int(b) for b in args.busy.split(",")]:
        with lane_clock(args.lanes) as log:
            eng = openmp.in_fresh_thread(lambda: _started(Engine(bb.model, bb.tokenizer, rm, EngineConfig(
                max_batch_rows=args.batch, max_batch_tokens=1 << 20, max_prefill_rows=args.batch, max_queue=1 << 16,
                dtype=dtype, threads=args.threads,
                tuning=Tuning(weight_kernel=args.weight_kernel, adaptive_threads=True, contended_lanes="on")))))
            try:
                with busy_processes(busy):
                    run_engine(eng, bb.tokenizer, jobs[:4], adapters, "warm-up")
                    log.clear()
                    out = run_engine(eng, bb.tokenizer, jobs, adapters, "(a)")
            finally:
                eng.stop()
        on_lanes = any(s.spans for s in log.steps)
        row = {"busy": busy, "tok_per_s": out["tok_per_s"],
               **(split(log.steps, log.lanes) if on_lanes else {"lanes": 0})}
        results.append(row)
        if not on_lanes:
            print(f"beside {busy}: {row['tok_per_s']:.1f} tok/s, no step ran on lanes (the team kept the CPUs)")
            continue
        print(f"beside {busy}: {row['tok_per_s']:.1f} tok/s, {row['steps']} steps on {row['lanes']} lanes; "
              f"of the lanes' time: on a CPU {row['on_cpu_share']:.3f}, runnable {row['runnable_share']:.3f}, blocked "
              f"{row['blocked_share']:.3f}, idle at the join {row['idle_at_join_share']:.3f} (before its forward "
              f"{row['join_before_share']:.3f}, after {row['join_after_share']:.3f}, no item "
              f"{row['join_no_item_share']:.3f}), team steps "
              f"{row['team_steps_share']:.3f} ({row['team_steps']}), between steps "
              f"{row['between_steps_share']:.3f}; on a CPU for {row['cpu_of_runnable']:.3f} of their runnable time",
              flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


def _started(eng: Engine) -> Engine:
    eng.start()
    return eng


if __name__ == "__main__":
    main()
