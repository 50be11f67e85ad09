"""The engine's team size follows what the CPUs give it (server/infra/contention.py): all threads alone,
one while other processes hold the CPUs, back to all when they leave; driven by a fake clock,
fake schedstat waits and a fake loadavg running count."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from server.engines.native.tuning import Tuning
from server.infra import contention
from server.infra.contention import (
    DEEP_HELPER,
    DEEP_LANES,
    DEEP_ONE,
    DEEP_WINDOWS,
    PROBE_MAX_S,
    PROBE_S,
    WINDOW_S,
    ThreadGovernor,
)


class Host:
    """A fake host: time, the process's summed runnable-wait nanoseconds, runnable threads."""

    def __init__(self) -> None:
        self.t = 0.0
        self.wait_ns = 0
        self.own_wait_ns = 0  # the engine thread's own
        self.running = 1

    def gov(self, max_threads: int = 2, usable: float = 2.0) -> ThreadGovernor:
        return ThreadGovernor(max_threads, usable, clock=lambda: self.t, wait_ns=lambda: self.wait_ns,
                              runnable=lambda: self.running, own_wait_ns=lambda: self.own_wait_ns)

    def run(self, gov: ThreadGovernor, seconds: float, *, wait_per_s: float | Callable[[int], float] = 0.0,
            steps_per_s: int = 40, own_per_s: float | None = None) -> list[int]:
        """Steps for `seconds`, the process waiting wait_per_s runnable seconds each second (a
        function: of the team size the step runs on), the engine thread own_per_s of them (default:
        all of them)."""
        out = []
        for _ in range(int(seconds * steps_per_s)):
            self.t += 1 / steps_per_s
            wait = wait_per_s(gov.current) if callable(wait_per_s) else wait_per_s
            self.wait_ns += int(wait / steps_per_s * 1e9)
            self.own_wait_ns += int((wait if own_per_s is None else own_per_s) / steps_per_s * 1e9)
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


def test_lanes_that_wait_little_where_the_team_waits_much_do_not_flip_every_window():
    """A neighbour that leaves the lanes a CPU most of the time but stalls the team: the team's
    returns back off as probes do, not one every other window."""
    host = Host()
    gov = host.gov()
    host.running = 3
    seen = host.run(gov, 60, wait_per_s=lambda team: 1.5 if team > 1 else 0.1)
    returns = sum(1 for a, b in itertools.pairwise(seen) if (a, b) == (1, 2))
    assert 3 <= returns <= 6
    assert seen.count(2) / len(seen) < 0.05


@pytest.mark.parametrize("lanes_wait, back", [(0.9, False), (0.05, True)])
def test_on_lanes_their_waits_decide_when_the_team_returns(lanes_wait, back):
    """Lanes are as many runnable threads as the team: while they wait, the team would (no probe
    steps); once they do not, the next probe finds the CPUs free, whatever loadavg counts (niced work)."""
    host = Host()
    gov = host.gov()
    host.running = 7
    host.run(gov, 1, wait_per_s=1.5)
    assert gov.current == 1
    # the busy processes stay (lanes wait), or only niced work is left (nothing waits, loadavg still counts it)
    seen = host.run(gov, 60, wait_per_s=lambda team: 1.5 if team > 1 and not back else lanes_wait)
    if back:
        assert seen.index(2) <= int((PROBE_S + 2 * WINDOW_S) * 40)  # the first probe after the drop
        assert set(seen[seen.index(2):]) == {2}
    else:
        assert set(seen) == {1}  # no probe step in a minute


SETTLE = (DEEP_WINDOWS + 1.5) * WINDOW_S  # long enough for DEEP_WINDOWS whole windows in a row


def test_deep_contention_is_read_from_the_one_threads_waits_and_kept_on_lanes_until_theirs_fall():
    """deep: the one thread waits DEEP_ONE s a second or more (it holds under half a CPU: beside 6
    busy processes on 2 CPUs ~0.7); beside 2 (~0.3) it is not. On lanes (the engine says so) their
    summed waits decide against DEEP_LANES; a change takes DEEP_WINDOWS windows in a row; back on the
    team it is cleared."""
    host = Host()
    gov = host.gov()
    host.running = 8
    host.run(gov, 1, wait_per_s=1.5)
    assert gov.current == 1 and gov.deep  # the windows after the drop: the one thread waits 1.5 s a second
    host.run(gov, SETTLE, wait_per_s=0.3)  # one thread beside 2 busy processes
    assert not gov.deep
    host.run(gov, SETTLE, wait_per_s=DEEP_ONE + 0.2)  # beside 6
    assert gov.deep
    gov.lanes_running = True
    host.run(gov, 10, wait_per_s=DEEP_LANES + 0.2)  # lanes beside 6 wait more than one thread does
    assert gov.deep and gov.current == 1
    host.run(gov, SETTLE, wait_per_s=DEEP_LANES - 0.2)  # lanes beside 2: above DEEP_ONE, below this
    assert not gov.deep
    gov.lanes_running = False
    host.run(gov, SETTLE, wait_per_s=DEEP_ONE + 0.2)
    assert gov.deep
    host.running = 1  # the busy processes left: the team is back, and contention is not deep
    host.run(gov, SETTLE, wait_per_s=0.0)
    assert gov.current == 2 and not gov.deep


def test_with_the_panel_helper_the_engine_threads_own_waits_read_deep():
    """With the panel helper beside the one thread, the process's waits include the helper's (it
    waits while it has no panels): the engine thread's own waits decide, against DEEP_HELPER (the
    waits measured beside 2 and 6 busy processes: docs/history/openmp-threads.md, "The panel
    helper")."""
    host = Host()
    gov = host.gov()
    host.running = 8
    host.run(gov, 1, wait_per_s=0.3)
    assert gov.current == 1 and not gov.deep
    gov.helper_running = True
    host.run(gov, SETTLE, wait_per_s=1.3, own_per_s=DEEP_HELPER - 0.15)  # beside 2
    assert not gov.deep
    host.run(gov, SETTLE, wait_per_s=1.3, own_per_s=DEEP_HELPER + 0.15)  # beside 6
    assert gov.deep
    host.run(gov, SETTLE, wait_per_s=2.0, own_per_s=DEEP_HELPER - 0.15)
    assert not gov.deep
    gov.helper_running = False  # the one thread alone: the process's waits again
    host.run(gov, SETTLE, wait_per_s=DEEP_ONE + 0.2, own_per_s=0.0)
    assert gov.deep


def test_one_window_across_the_line_does_not_change_the_reading():
    host = Host()
    gov = host.gov()
    host.running = 4
    host.run(gov, 1, wait_per_s=0.3)
    assert gov.current == 1 and not gov.deep
    seen = []
    for _ in range(8):  # spikes half a window long, one every two windows: no two windows in a row read deep
        for wait, length in ((1.2, WINDOW_S / 2), (0.2, 1.5 * WINDOW_S)):
            for _ in range(round(length * 40)):
                host.run(gov, 1 / 40, wait_per_s=wait)
                seen.append(gov.deep)
    assert not any(seen)
    host.run(gov, SETTLE, wait_per_s=0.9)
    assert gov.deep


def test_one_thread_configured_means_one_thread():
    host = Host()
    host.running = 1
    gov = host.gov(max_threads=1, usable=1.0)
    assert set(host.run(gov, 2, wait_per_s=0.9)) == {1}


def test_the_readers_on_this_kernel():
    wait = contention.process_wait_ns()
    running = contention.runnable_threads()
    if wait is None:
        pytest.skip("no schedstat on this kernel")
    assert wait >= 0 and running is not None and running >= 1


def test_the_readers_on_fake_files(tmp_path: Path):
    for tid, line in (("10", "500 7000 3"), ("11", "20 300 1"), ("12", "garbage")):
        (tmp_path / "task" / tid).mkdir(parents=True)
        (tmp_path / "task" / tid / "schedstat").write_text(line + "\n")
    assert contention.process_wait_ns(tmp_path / "task") == 7300
    (tmp_path / "loadavg").write_text("4.50 3.56 1.74 3/157 11979\n")
    assert contention.runnable_threads(tmp_path / "loadavg") == 3


def test_the_engine_runs_each_step_on_the_governors_team(monkeypatch, tiny_base, tokenizer):
    """The engine thread's torch count is the one the governor gave before the step: a
    governor saying 1 under a configured 2 runs every step on one thread."""
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

    class SaysOne:
        current = 1
        deep = False

        def __init__(self, max_threads: int, usable: float) -> None:
            assert max_threads == 2
            self.steps_at: dict[int, int] = {}

        def threads(self) -> int:
            return self.current

    monkeypatch.setattr(engine_mod, "ThreadGovernor", SaysOne)
    monkeypatch.setattr(NativeEngine, "step", step)
    eng = NativeEngine(tiny_base, tokenizer, config=EngineConfig(threads=2))
    eng.start()
    try:
        req = eng.submit(GenRequest(tokenizer("hello", add_special_tokens=False).input_ids,
                                    SamplingParams(max_new_tokens=4, ignore_eos=True)))
        wait_all([req])
    finally:
        eng.stop()
    assert seen and set(seen) == {1}


@pytest.mark.parametrize("lanes_on", [True, False])
def test_without_the_team_the_engine_splits_steps_over_lanes(monkeypatch, tiny_base, tokenizer, lanes_on):
    """A governor saying 1 under a configured 2: the runner splits each step over 2 lanes
    (POLYSERVE_CONTENDED_LANES, the default) or runs it on the engine thread alone; greedy answers
    are the same either way."""
    from server.engines.native.config import EngineConfig
    from server.engines.native.core import engine as engine_mod
    from server.engines.native.core.engine import NativeEngine
    from server.engines.request import GenRequest, SamplingParams
    from tests.support.engine_utils import wait_all

    class SaysOne:
        current = 1
        deep = False

        def __init__(self, max_threads: int, usable: float) -> None:
            self.steps_at: dict[int, int] = {}

        def threads(self) -> int:
            return self.current

    monkeypatch.setattr(engine_mod, "ThreadGovernor", SaysOne)
    answers = {}
    for governed in (True, False):
        eng = NativeEngine(tiny_base, tokenizer, config=EngineConfig(
            threads=2, tuning=Tuning(adaptive_threads=governed, contended_lanes="on" if lanes_on else "off")))
        eng.start()
        try:
            reqs = [eng.submit(GenRequest(tokenizer(p, add_special_tokens=False).input_ids,
                                          SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=0)))
                    for p in ("hello there", "a b c d e f", "x", "the quick brown fox")]
            answers[governed] = [c.key for choices in wait_all(reqs) for c in choices]
        finally:
            eng.stop()
        if governed:
            assert eng.lanes == (2 if lanes_on else 1)
            assert eng.runner._lanes_on is lanes_on
    assert answers[True] == answers[False]


@pytest.mark.parametrize("avx512", [True, False])
def test_lanes_by_default_where_the_cpu_has_no_avx512_and_the_setting_wins(monkeypatch, tiny_base, tokenizer, avx512):
    """POLYSERVE_CONTENDED_LANES auto (the default): lanes on CPUs without AVX-512, one thread on
    CPUs with it (where lanes measured slower on dense weights); where the linears read the GGUF
    blocks, one thread with the panel helper (lanes while contention is deep), or lanes where the
    helper is off; on/off win over the machine."""
    from server.engines.native.config import EngineConfig
    from server.engines.native.core import engine as engine_mod
    from server.engines.native.core.engine import NativeEngine
    from server.engines.native.model import lanes as lanes_mod
    from server.wiring.settings import Settings

    monkeypatch.setattr(lanes_mod, "cpu_has_avx512", lambda: avx512)
    assert lanes_mod.lanes_pay()[0] is (not avx512)
    assert lanes_mod.lanes_pay(weight_kernel=True)[0] is True  # linears on the GGUF blocks: lanes either way
    assert lanes_mod.lanes_pay(True, torch.float32, helper=True)[0] is False  # ... but the helper, where it runs
    # in bf16 on the blocks (AMX) a lane dequantises every tile whatever its rows: as dense weights
    assert lanes_mod.lanes_pay(True, torch.bfloat16)[0] is (not avx512)
    assert EngineConfig.from_settings(Settings()).tuning.contended_lanes == "auto"
    for value, want in (("auto", not avx512), ("on", True), ("off", False)):
        monkeypatch.setenv("POLYSERVE_CONTENDED_LANES", value)
        eng = NativeEngine(tiny_base, tokenizer, config=EngineConfig.from_settings(Settings(), threads=2))
        assert eng.contended_lanes is want, value
    # a runner whose linears read the GGUF blocks (the default backbone on a float32 CPU): under auto
    # one thread with the panel helper, lanes while contention is deep; lanes where the helper is off
    build = engine_mod.build_model_runner

    def on_blocks(*args, **kwargs):
        runner = build(*args, **kwargs)
        runner.weight_kernel = True
        return runner

    monkeypatch.setattr(engine_mod, "build_model_runner", on_blocks)
    monkeypatch.setenv("POLYSERVE_CONTENDED_LANES", "auto")
    monkeypatch.setenv("POLYSERVE_DTYPE", "float32")
    eng = NativeEngine(tiny_base, tokenizer, config=EngineConfig.from_settings(Settings(), threads=2))
    assert eng.contended_helper and not eng.contended_lanes and eng.lanes_when_deep
    monkeypatch.setenv("POLYSERVE_CONTENDED_HELPER", "off")
    eng = NativeEngine(tiny_base, tokenizer, config=EngineConfig.from_settings(Settings(), threads=2))
    assert not eng.contended_helper and eng.contended_lanes
    monkeypatch.delenv("POLYSERVE_CONTENDED_HELPER")
    # ... and in bf16 too
    monkeypatch.setenv("POLYSERVE_DTYPE", "bfloat16")
    eng = NativeEngine(tiny_base, tokenizer, config=EngineConfig.from_settings(Settings(), threads=2))
    assert eng.runner.dtype == torch.bfloat16 and eng.contended_helper and not eng.contended_lanes
    monkeypatch.delenv("POLYSERVE_DTYPE")
    monkeypatch.setattr(engine_mod, "build_model_runner", build)
    monkeypatch.setenv("POLYSERVE_CONTENDED_LANES", "true")  # the values are auto|on|off, like the others
    with pytest.raises(ValueError, match="contended_lanes"):
        Settings()
    monkeypatch.setattr(engine_mod, "lanes_pay", lambda *_: pytest.fail("asked without a governor"))
    NativeEngine(tiny_base, tokenizer, config=EngineConfig(threads=2, tuning=Tuning(adaptive_threads=False)))


@pytest.mark.parametrize("setting, deep, want", [("auto", True, 2), ("auto", False, 1), ("off", True, 1)])
def test_under_deep_contention_auto_runs_lanes_where_the_cpu_alone_would_not(monkeypatch, tiny_base, tokenizer,
                                                                              setting, deep, want):
    """POLYSERVE_CONTENDED_LANES auto on a CPU where lanes_pay says no (AVX-512, dense weights):
    lanes while the governor reads deep contention, one thread otherwise; "off" never runs lanes.
    The engine tells the governor what ran (lanes_running)."""
    from server.engines.native.config import EngineConfig
    from server.engines.native.core import engine as engine_mod
    from server.engines.native.core.engine import NativeEngine
    from server.engines.native.model import lanes as lanes_mod
    from server.engines.request import GenRequest, SamplingParams
    from tests.support.engine_utils import wait_all

    monkeypatch.setattr(lanes_mod, "cpu_has_avx512", lambda: True)
    made: list = []

    class Deep:
        current = 1

        def __init__(self, max_threads: int, usable: float) -> None:
            self.steps_at: dict[int, int] = {}
            self.deep = deep
            self.lanes_running = False
            made.append(self)

        def threads(self) -> int:
            return self.current

    monkeypatch.setattr(engine_mod, "ThreadGovernor", Deep)
    eng = NativeEngine(tiny_base, tokenizer, config=EngineConfig(threads=2, tuning=Tuning(contended_lanes=setting)))
    assert eng.contended_lanes is False
    eng.start()
    try:
        reqs = [eng.submit(GenRequest(tokenizer(p, add_special_tokens=False).input_ids,
                                      SamplingParams(max_new_tokens=4, ignore_eos=True)))
                for p in ("hello there", "a b c d e f")]
        wait_all(reqs)
        assert eng.lanes == want
        assert made[0].lanes_running is (want == 2)
        made[0].deep = not deep  # contention moved: the next step follows
        reqs = [eng.submit(GenRequest(tokenizer("x y", add_special_tokens=False).input_ids,
                                      SamplingParams(max_new_tokens=4, ignore_eos=True)))]
        wait_all(reqs)
        assert eng.lanes == (1 if setting == "off" or deep else 2)
    finally:
        eng.stop()


@pytest.mark.parametrize("dtype, amx, want", [(torch.bfloat16, True, False), (torch.bfloat16, False, True),
                                              (torch.float32, True, True)])
def test_deep_contention_keeps_one_thread_for_bf16_on_amx(monkeypatch, tiny_base, tokenizer, dtype, amx, want):
    """auto on an AVX-512 CPU: lanes under deep contention, except where bf16 GEMMs run on AMX (a
    lane of half the rows costs nearly a whole step there); never under "off" or without a governor."""
    from server.engines.native.config import EngineConfig
    from server.engines.native.core.engine import NativeEngine
    from server.engines.native.model import lanes as lanes_mod

    monkeypatch.setattr(lanes_mod, "cpu_has_avx512", lambda: True)
    monkeypatch.setattr(lanes_mod, "cpu_has_amx", lambda: amx)
    assert lanes_mod.deep_lanes_pay(dtype)[0] is want
    eng = NativeEngine(tiny_base, tokenizer, config=EngineConfig(threads=2, dtype=dtype))
    assert eng.contended_lanes is False and eng.lanes_when_deep is want
    assert not NativeEngine(tiny_base, tokenizer, config=EngineConfig(
        threads=2, dtype=dtype, tuning=Tuning(contended_lanes="off"))).lanes_when_deep
    assert not NativeEngine(tiny_base, tokenizer, config=EngineConfig(
        threads=2, dtype=dtype, tuning=Tuning(adaptive_threads=False))).lanes_when_deep


def test_without_the_team_the_panel_helper_runs_until_contention_is_deep(monkeypatch, tiny_base, tokenizer):
    """Where the runner has the panel helper (bf16 on the GGUF blocks), a step without the team runs
    on the engine thread with the helper; under deep contention the lanes take over where they pay
    (the helper stops), and the helper comes back when contention eases; the engine stops it when it
    stops. POLYSERVE_CONTENDED_HELPER off: never; on, where the runner has none: a warning, never."""
    from server.engines.native.config import EngineConfig
    from server.engines.native.core import engine as engine_mod
    from server.engines.native.core.engine import NativeEngine
    from server.engines.native.model import lanes as lanes_mod
    from server.engines.request import GenRequest, SamplingParams
    from server.wiring.settings import Settings
    from tests.support.engine_utils import wait_all

    monkeypatch.setattr(lanes_mod, "cpu_has_avx512", lambda: True)
    monkeypatch.setattr(lanes_mod, "cpu_has_amx", lambda: False)
    made: list = []
    calls: list[bool] = []

    class Governor:
        current = 1

        def __init__(self, max_threads: int, usable: float) -> None:
            self.steps_at: dict[int, int] = {}
            self.deep = False
            made.append(self)

        def threads(self) -> int:
            return self.current

    build = engine_mod.build_model_runner

    def with_helper(*args, **kwargs):
        runner = build(*args, **kwargs)
        runner.helper_possible = lambda: True

        def use_helper(on: bool) -> bool:
            calls.append(on)
            return on

        runner.use_helper = use_helper
        return runner

    def generate(eng: NativeEngine) -> None:
        wait_all([eng.submit(GenRequest(tokenizer("hello there", add_special_tokens=False).input_ids,
                                        SamplingParams(max_new_tokens=4, ignore_eos=True)))])

    monkeypatch.setattr(engine_mod, "ThreadGovernor", Governor)
    monkeypatch.setattr(engine_mod, "build_model_runner", with_helper)
    eng = NativeEngine(tiny_base, tokenizer, config=EngineConfig(threads=2))
    assert eng.contended_helper and eng.lanes_when_deep
    eng.start()
    try:
        generate(eng)
        assert calls == [True] and eng.helper and eng.lanes == 1 and made[0].helper_running
        made[0].deep = True
        generate(eng)
        assert calls == [True, False] and not eng.helper and eng.lanes == 2
        made[0].deep = False
        generate(eng)
        assert calls == [True, False, True] and eng.helper and eng.lanes == 1
        assert eng.contended_steps["helper"] > 0 and eng.contended_steps["lanes"] > 0
        assert eng.contended_steps["one"] == 0
    finally:
        eng.stop()
    assert calls[-1] is False and not eng.helper  # stopped with the engine
    monkeypatch.setenv("POLYSERVE_CONTENDED_HELPER", "off")
    assert not NativeEngine(tiny_base, tokenizer,
                            config=EngineConfig.from_settings(Settings(), threads=2)).contended_helper
    monkeypatch.setattr(engine_mod, "build_model_runner", build)
    monkeypatch.setenv("POLYSERVE_CONTENDED_HELPER", "on")
    eng = NativeEngine(tiny_base, tokenizer, config=EngineConfig.from_settings(Settings(), threads=2))
    assert not eng.contended_helper  # the tiny float32 runner has no panel helper
