"""How each step runs on the CPUs (server/engines/native/core/execution.py): the governor's team size
follows what the CPUs give the process (all threads alone, one while other processes hold the CPUs,
back to all when they leave), driven by a fake clock, fake schedstat waits and a fake loadavg
running count; the engine asks once a step and the runner takes the mode whole."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import cast

import pytest
import torch

from server.engines.native.core import execution
from server.engines.native.core.execution import PROBE_MAX_S, PROBE_S, WINDOW_S, Execution, Mode, ThreadGovernor
from server.engines.native.tuning import Tuning


class Host:
    """A fake host: time, the process's summed runnable-wait nanoseconds, runnable threads."""

    def __init__(self) -> None:
        self.t = 0.0
        self.wait_ns = 0
        self.running = 1

    def gov(self, max_threads: int = 2, usable: float = 2.0) -> ThreadGovernor:
        return ThreadGovernor(max_threads, usable, clock=lambda: self.t, wait_ns=lambda: self.wait_ns,
                              runnable=lambda: self.running)

    def run(self, gov: ThreadGovernor, seconds: float, *, wait_per_s: float | Callable[[int], float] = 0.0,
            steps_per_s: int = 40) -> list[int]:
        """Steps for `seconds`, the process waiting wait_per_s runnable seconds each second (a
        function: of the team size the step runs on)."""
        out = []
        for _ in range(int(seconds * steps_per_s)):
            self.t += 1 / steps_per_s
            wait = wait_per_s(gov.current) if callable(wait_per_s) else wait_per_s
            self.wait_ns += int(wait / steps_per_s * 1e9)
            out.append(gov.threads())
        return out


def test_alone_the_team_stays_whole():
    host = Host()
    gov = host.gov()
    assert set(host.run(gov, 5, wait_per_s=0.02)) == {2}
    assert gov.switches == 0


def test_contention_drops_to_one_thread_within_a_window_and_recovers_when_it_ends():
    host = Host()
    gov = host.gov()
    host.run(gov, 1)
    host.running = 4  # this thread + 3 busy processes, each waiting for a CPU
    seen = host.run(gov, 2 * WINDOW_S, wait_per_s=0.9)
    assert seen[-1] == 1
    assert seen.index(1) <= int(2 * WINDOW_S * 40)
    host.running = 1  # they ended: the other CPU is free
    seen = host.run(gov, 2 * WINDOW_S)
    assert seen[-1] == 2


def test_niced_load_counts_as_runnable_but_probes_bring_the_team_back():
    """Low-priority work shows in loadavg's running count but leaves the team's waits near zero:
    a probe finds that and stays at full size."""
    host = Host()
    gov = host.gov()
    host.running = 3
    host.run(gov, 1, wait_per_s=0.9)  # a burst of real contention: down to one
    assert gov.current == 1
    seen = host.run(gov, PROBE_S + 2 * WINDOW_S, wait_per_s=0.01)  # only niced work left
    assert seen[-1] == 2
    assert set(host.run(gov, 5, wait_per_s=0.01)) == {2}


def test_probes_back_off_while_the_cpus_stay_taken():
    """Beside one busy process: one thread gets a CPU without waiting, the team does not."""
    host = Host()
    gov = host.gov()
    host.running = 2
    seen = host.run(gov, 60, wait_per_s=lambda team: 1.5 if team > 1 else 0.05)
    probes = sum(1 for a, b in itertools.pairwise(seen) if (a, b) == (1, 2))
    # at 2, 4, 8, 16, 32 s after the first drop: 5 probes in a minute, not 30
    assert 3 <= probes <= 6
    assert seen.count(2) / len(seen) < 0.05


def test_no_probe_while_even_one_thread_waits_for_a_cpu():
    """Beside many busy processes one thread waits too: a team step there would cost seconds."""
    host = Host()
    gov = host.gov()
    host.running = 7
    seen = host.run(gov, 60, wait_per_s=lambda team: 1.5 if team > 1 else 0.6)
    assert seen[-1] == 1 and seen.count(2) <= int(WINDOW_S * 40) + 1  # the first window only
    seen = host.run(gov, PROBE_MAX_S + 2 * WINDOW_S, wait_per_s=lambda team: 1.5 if team > 1 else 0.05)
    assert 2 in seen  # the one thread stopped waiting: the probes come back


def test_one_thread_that_waits_little_where_the_team_waits_much_does_not_flip_every_window():
    """A neighbour that leaves one thread a CPU most of the time but stalls the team: the team's
    returns back off as probes do, not one every other window."""
    host = Host()
    gov = host.gov()
    host.running = 3
    seen = host.run(gov, 60, wait_per_s=lambda team: 1.5 if team > 1 else 0.1)
    returns = sum(1 for a, b in itertools.pairwise(seen) if (a, b) == (1, 2))
    assert 3 <= returns <= 6
    assert seen.count(2) / len(seen) < 0.05


@pytest.mark.parametrize("one_wait, back", [(0.9, False), (0.05, True)])
def test_the_one_threads_waits_decide_when_the_team_returns(one_wait, back):
    """While one thread (with its panel helper: two runnable threads) waits, the team would (no
    probe steps); once it does not, the next probe finds the CPUs free, whatever loadavg counts
    (niced work)."""
    host = Host()
    gov = host.gov()
    host.running = 7
    host.run(gov, 1, wait_per_s=1.5)
    assert gov.current == 1
    # the busy processes stay (one thread waits), or only niced work is left (nothing waits, loadavg counts it)
    seen = host.run(gov, 60, wait_per_s=lambda team: 1.5 if team > 1 and not back else one_wait)
    if back:
        assert seen.index(2) <= int((PROBE_S + 2 * WINDOW_S) * 40)  # the first probe after the drop
        assert set(seen[seen.index(2):]) == {2}
    else:
        assert set(seen) == {1}  # no probe step in a minute


def test_one_thread_configured_means_one_thread():
    host = Host()
    host.running = 1
    gov = host.gov(max_threads=1, usable=1.0)
    assert set(host.run(gov, 2, wait_per_s=0.9)) == {1}


def test_the_readers_on_this_kernel():
    wait = execution.process_wait_ns()
    running = execution.runnable_threads()
    if wait is None:
        pytest.skip("no schedstat on this kernel")
    assert wait >= 0 and running is not None and running >= 1


def test_the_readers_on_fake_files(tmp_path: Path):
    for tid, line in (("10", "500 7000 3"), ("11", "20 300 1"), ("12", "garbage")):
        (tmp_path / "task" / tid).mkdir(parents=True)
        (tmp_path / "task" / tid / "schedstat").write_text(line + "\n")
    assert execution.process_wait_ns(tmp_path / "task") == 7300
    (tmp_path / "loadavg").write_text("4.50 3.56 1.74 3/157 11979\n")
    assert execution.runnable_threads(tmp_path / "loadavg") == 3


class Runner:
    """What Execution applies modes to: records each set_mode; `helper_starts` False: the helper's
    thread would not start (set_mode runs without it)."""

    def __init__(self, helper_starts: bool = True) -> None:
        self.modes: list[Mode] = []
        self.helper_starts = helper_starts

    def set_mode(self, mode: Mode) -> Mode:
        self.modes.append(mode)
        return Mode(mode.threads, helper=mode.helper and self.helper_starts)


class Says:
    """A governor whose team size the test sets."""

    def __init__(self, n: int) -> None:
        self.current = n

    def threads(self) -> int:
        return self.current


def test_a_mode_is_set_on_the_runner_only_when_it_changes_and_each_step_is_counted():
    runner, gov = Runner(), Says(2)
    ex = Execution(2, cast(ThreadGovernor, gov), helper=True, apply=runner.set_mode)
    assert [ex.step() for _ in range(3)] == [Mode(2)] * 3
    gov.current = 1
    assert [ex.step() for _ in range(2)] == [Mode(1, helper=True)] * 2
    gov.current = 2
    ex.step()
    assert runner.modes == [Mode(2), Mode(1, helper=True), Mode(2)]
    assert ex.steps == {"team": 4, "one": 0, "helper": 2}
    ex.close()  # the helper is not running: nothing to stop
    assert runner.modes[-1] == Mode(2) and len(runner.modes) == 3


def test_without_the_helper_a_contended_step_runs_on_one_thread_and_close_joins_a_running_helper():
    runner, gov = Runner(), Says(1)
    ex = Execution(2, cast(ThreadGovernor, gov), helper=False, apply=runner.set_mode)
    assert ex.step() == Mode(1) and ex.steps["one"] == 1
    runner = Runner()
    ex = Execution(2, cast(ThreadGovernor, gov), helper=True, apply=runner.set_mode)
    ex.step()
    ex.close()
    assert runner.modes == [Mode(1, helper=True), Mode(2)]  # back to the team, the helper's thread joined


def test_a_helper_that_does_not_start_is_not_asked_for_again(caplog):
    runner, gov = Runner(helper_starts=False), Says(1)
    ex = Execution(2, cast(ThreadGovernor, gov), helper=True, apply=runner.set_mode)
    with caplog.at_level("WARNING", logger="polyserve"):
        assert ex.step() == Mode(1)
    assert "did not start" in caplog.text
    gov.current = 2
    ex.step()
    gov.current = 1
    assert ex.step() == Mode(1)
    assert runner.modes == [Mode(1, helper=True), Mode(2), Mode(1)]
    assert ex.steps == {"team": 1, "one": 2, "helper": 0}


@pytest.mark.parametrize("adaptive, setting, possible, governed, helper", [
    (True, "auto", True, True, True), (True, "auto", False, True, False), (True, "off", True, True, False),
    (True, "on", False, True, False), (False, "auto", True, False, False)])
def test_built_from_the_switches_and_the_runner(caplog, adaptive, setting, possible, governed, helper):
    """adaptive_threads off: every step on the whole team, no governor; contended_helper auto/on:
    the helper where the runner has one (on, where it has none: a warning)."""
    with caplog.at_level("WARNING", logger="polyserve"):
        ex = Execution.build(2, 2.0, Tuning(adaptive_threads=adaptive, contended_helper=setting), possible,
                             Runner().set_mode)
    assert (ex.governor is not None) is governed and ex.helper is helper
    assert ("no panel helper" in caplog.text) is (setting == "on" and not possible)
    assert Execution.build(1, 1.0, Tuning(), True, Runner().set_mode).governor is None  # one thread: nothing to govern


def test_the_retired_lanes_switch_is_reported_not_silently_ignored(caplog):
    with caplog.at_level("WARNING", logger="polyserve"):
        tuning = Tuning.from_env({"POLYSERVE_CONTENDED_LANES": "on"})
    assert tuning == Tuning()
    assert "POLYSERVE_CONTENDED_LANES has no effect" in caplog.text
    assert "contended_lanes" not in {f.lower().removeprefix("polyserve_") for f in Tuning.env_names()}


def test_the_engine_runs_each_step_in_the_mode_it_was_given(monkeypatch, tiny_base, tokenizer):
    """The engine thread's torch count is the team of the Mode set before the step: a governor
    saying 1 under a configured 2 runs every step on one thread, and the answers equal those of an
    engine without a governor."""
    from server.engines.native.config import EngineConfig
    from server.engines.native.core import engine as engine_mod
    from server.engines.native.core.engine import NativeEngine
    from server.engines.request import GenRequest, SamplingParams
    from tests.support.engine_utils import wait_all

    seen: list[int] = []
    real_step = NativeEngine.step

    def step(self):
        seen.append(torch.get_num_threads())
        real_step(self)

    monkeypatch.setattr(execution, "ThreadGovernor", lambda max_threads, usable: Says(1))
    monkeypatch.setattr(NativeEngine, "step", step)
    answers = {}
    for governed in (True, False):
        seen.clear()
        config = EngineConfig(threads=2, tuning=Tuning(adaptive_threads=governed))
        eng = NativeEngine(tiny_base, tokenizer, config=config)
        eng.start()
        try:
            reqs = [eng.submit(GenRequest(tokenizer(p, add_special_tokens=False).input_ids,
                                          SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=0)))
                    for p in ("hello there", "a b c d e f", "x", "the quick brown fox")]
            answers[governed] = [c.key for choices in wait_all(reqs) for c in choices]
        finally:
            eng.stop()
        assert seen and set(seen) == ({1} if governed else {2})
        assert eng.execution.steps["one" if governed else "team"] == eng.steps
    assert answers[True] == answers[False]
    tiny = engine_mod.NativeEngine(tiny_base, tokenizer, config=EngineConfig(threads=2))
    assert not tiny.execution.helper  # the tiny float32 runner's linears have no panel helper


def test_the_engine_runs_contended_steps_with_the_runners_panel_helper_and_stops_it(monkeypatch, tiny_base,
                                                                                      tokenizer):
    """Where the runner has the panel helper, a step without the team runs with it; the engine
    stops it when it stops, and POLYSERVE_CONTENDED_HELPER=off never starts it."""
    from server.engines.native.config import EngineConfig
    from server.engines.native.core import engine as engine_mod
    from server.engines.native.core.engine import NativeEngine
    from server.engines.request import GenRequest, SamplingParams
    from server.wiring.settings import Settings
    from tests.support.engine_utils import wait_all

    gov = Says(1)
    modes: list[Mode] = []
    build = engine_mod.build_model_runner

    def with_helper(*args, **kwargs):
        runner = build(*args, **kwargs)
        runner.panel_helper = True
        real = runner.set_mode

        def set_mode(mode: Mode) -> Mode:
            modes.append(mode)
            real(Mode(mode.threads))
            return mode

        runner.set_mode = set_mode
        return runner

    def generate(eng: NativeEngine) -> None:
        wait_all([eng.submit(GenRequest(tokenizer("hello there", add_special_tokens=False).input_ids,
                                        SamplingParams(max_new_tokens=4, ignore_eos=True)))])

    monkeypatch.setattr(execution, "ThreadGovernor", lambda max_threads, usable: gov)
    monkeypatch.setattr(engine_mod, "build_model_runner", with_helper)
    eng = NativeEngine(tiny_base, tokenizer, config=EngineConfig(threads=2))
    assert eng.execution.helper
    eng.start()
    try:
        generate(eng)
        assert modes == [Mode(1, helper=True)]
        gov.current = 2
        generate(eng)
        assert modes == [Mode(1, helper=True), Mode(2)]
        gov.current = 1
        generate(eng)
        assert eng.execution.steps["helper"] > 0 and eng.execution.steps["one"] == 0
    finally:
        eng.stop()
    assert modes[-1] == Mode(2)  # stopped with the engine: the helper's thread joined
    monkeypatch.setenv("POLYSERVE_CONTENDED_HELPER", "off")
    eng = NativeEngine(tiny_base, tokenizer, config=EngineConfig.from_settings(Settings(), threads=2))
    assert not eng.execution.helper
