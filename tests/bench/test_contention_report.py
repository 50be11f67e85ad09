"""bench/contention.py's table: the peer is the vLLM bare run that was measured, bfloat16 (F) or
float32 (f, on a CPU without bf16), and every figure comes from the rows."""

from __future__ import annotations

from bench.contention import report


def _rows(peer: str) -> list[dict]:
    rows = []
    for r, (a0, p0, a6, p6) in enumerate([(100.0, 90.0, 20.0, 25.0), (110.0, 100.0, 30.0, 24.0),
                                          (90.0, 95.0, 25.0, 20.0)]):
        rows += [{"round": r, "busy": 0, "variant": "a", "tok_per_s": a0},
                 {"round": r, "busy": 0, "variant": peer, "tok_per_s": p0},
                 {"round": r, "busy": 6, "variant": "a", "tok_per_s": a6},
                 {"round": r, "busy": 6, "variant": peer, "tok_per_s": p6}]
    return rows


def test_the_table_pairs_polyserve_with_the_peer_that_ran():
    for peer, name in (("F", "(F) vLLM bare:"), ("f", "(f) vLLM bare, float32:")):
        table = report(_rows(peer)).splitlines()
        assert name in table[0]
        alone, six = table[2], table[3]
        assert alone.startswith("| 0 | 3 | 100.0 (90.0-110.0) | 95.0 (90.0-100.0) "
                                "| 1.10 (1.11, 1.10, 0.95) | 1.00 | 1.00 |")
        # per-round ratios 0.80, 1.25, 1.25; kept = median beside 6 over median alone
        assert six.startswith("| 6 | 3 | 25.0 (20.0-30.0) | 24.0 (20.0-25.0) "
                              "| 1.25 (0.80, 1.25, 1.25) | 0.25 | 0.25 | 0.25 |")


def test_kept_is_also_given_round_by_round_over_the_same_rounds_run_alone():
    lines = report(_rows("F")).splitlines()
    # (a): 20/100, 30/110, 25/90; (F): 25/90, 24/100, 20/95
    assert "(a) kept round by round (over the same round alone): beside 6 0.27 (0.20, 0.27, 0.28)" in lines
    assert "(F) kept round by round (over the same round alone): beside 6 0.24 (0.28, 0.24, 0.21)" in lines
    rows = [row for row in _rows("F") if not (row["busy"] == 0 and row["round"] == 1)]  # round 1 alone missing
    assert ("(a) kept round by round (over the same round alone): beside 6 0.24 (0.20, 0.28)"
            in report(rows).splitlines())


def test_another_engine_variant_gets_its_own_table_against_a_round_by_round():
    rows = _rows("f")
    for r, (w0, w6) in enumerate([(80.0, 10.0), (100.0, 20.0), (90.0, 25.0)]):
        rows += [{"round": r, "busy": 0, "variant": "w", "tok_per_s": w0},
                 {"round": r, "busy": 6, "variant": "w", "tok_per_s": w6}]
    lines = report(rows).splitlines()
    head = lines.index("| busy processes | rounds | (w) tok/s: median (spread) | (a)/(w): median (per round) "
                       "| (w) kept |")
    # (a)/(w) alone: 100/80, 110/100, 90/90; beside 6: 20/10, 30/20, 25/25; kept 20/90
    assert lines[head + 2] == "| 0 | 3 | 90.0 (80.0-100.0) | 1.10 (1.25, 1.10, 1.00) | 1.00 |"
    assert lines[head + 3] == "| 6 | 3 | 20.0 (10.0-25.0) | 1.50 (2.00, 1.50, 1.00) | 0.22 |"
    assert "(f)" not in "\n".join(lines[head:])  # the peer stays in the first table only


def test_the_quota_runs_threads_never_reach_the_next_rounds_runs(monkeypatch):
    import contextlib

    from bench import contention

    calls: list[tuple[str, list[str]]] = []

    def fake_bench(variants, args, prefix=()):
        calls.append(("quota" if prefix else "busy", list(args)))
        return [{"variant": f"({v})", "tok_per_s": 1.0} for v in variants]

    @contextlib.contextmanager
    def nothing(*_):
        yield

    @contextlib.contextmanager
    def quota():
        yield ["limit"], "a test's quota"

    monkeypatch.setattr(contention, "serve_bench", fake_bench)
    monkeypatch.setattr(contention, "busy_processes", nothing)
    monkeypatch.setattr(contention, "one_cpu_quota", quota)
    args = ["--tasks", "4", "--requests", "8", "--threads", "2"]
    contention.measure([0, 2], 2, "af", args, {2: 4}, quota=True)
    assert args == ["--tasks", "4", "--requests", "8", "--threads", "2"]  # what --json records
    busy = [a for kind, a in calls if kind == "busy"]
    assert len(busy) == 4 and all(a[a.index("--threads") + 1] == "2" for a in busy)
    assert [a[a.index("--requests") + 1] for a in busy] == ["8", "4", "8", "4"]
    assert all(a[a.index("--threads") + 1] == "auto" for kind, a in calls if kind == "quota")


def test_the_cpu_table_reads_each_variants_schedstat_figures():
    rows = []
    for r, (cpu_a, cpu_f) in enumerate([(20.0, 30.0), (24.0, 36.0), (22.0, 27.0)]):
        rows += [{"round": r, "busy": 2, "variant": "a", "tok_per_s": 50.0, "tokens": 1000, "wall_s": 20.0,
                  "cpu_s": cpu_a, "runnable_wait_s": cpu_a},
                 {"round": r, "busy": 2, "variant": "f", "tok_per_s": 80.0, "tokens": 1600, "wall_s": 20.0,
                  "cpu_s": cpu_f, "runnable_wait_s": cpu_f / 2}]
    rows.append({"round": 0, "busy": "quota", "variant": "a", "tok_per_s": 1.0, "how": "v2", "tokens": 10,
                 "wall_s": 1.0, "cpu_s": 1.0, "runnable_wait_s": 0.0})  # not a busy level: left out
    lines = report(rows).splitlines()
    head = lines.index("| busy processes | variant | rounds | CPUs held | CPU s per 1,000 tokens "
                       "| on a CPU when runnable |")
    # (a): medians of 20/20, 24/20, 22/20 CPUs; 20, 24, 22 s per 1,000 tokens; half its runnable time
    assert lines[head + 2] == "| 2 | (a) | 3 | 1.10 | 22.0 | 0.50 |"
    # (f): 30, 36, 27 CPU s over 20 s; per 1,000 tokens 18.75, 22.5, 16.875; two thirds on a CPU
    assert lines[head + 3] == "| 2 | (f) | 3 | 1.50 | 18.8 | 0.67 |"
    assert lines[head + 4] == "" and "quota" in lines[head + 5]


def test_rows_without_schedstat_leave_the_cpu_table_out():
    rows = [{"round": 0, "busy": 0, "variant": v, "tok_per_s": 10.0, "tokens": 100, "wall_s": 10.0,
             "cpu_s": 0.0, "runnable_wait_s": 0.0} for v in "af"]
    assert "CPUs held" not in report(rows)


def test_idle_busy_processes_run_at_the_schedulers_idle_priority():
    import os

    from bench import contention, schedstat

    for idle, policy in ((True, os.SCHED_IDLE), (False, os.SCHED_OTHER)):
        before = set(schedstat.tree())  # what the session already runs (a library's helper process, say)
        with contention.busy_processes(1, idle=idle):
            children = [p for p in schedstat.tree() if p not in before]
            assert len(children) == 1 and os.sched_getscheduler(children[0]) == policy


def test_a_variant_served_in_two_dtypes_is_named_under_the_table():
    rows = _rows("F")
    for row in rows:
        if row["variant"] == "a":
            row["dtype"] = "float32" if (row["round"], row["busy"]) == (1, 6) else "bfloat16"
    text = report(rows)
    assert "**(a) served in more than one dtype:** bfloat16: round 0 beside 0, round 0 beside 6, " \
           "round 1 beside 0, round 2 beside 0, round 2 beside 6; float32: round 1 beside 6" in text
    for row in rows:
        row.pop("dtype", None)
    assert "dtype" not in report(rows)
    one = _rows("F")
    for row in one:
        row["dtype"] = "bfloat16"
    assert "dtype" not in report(one)
