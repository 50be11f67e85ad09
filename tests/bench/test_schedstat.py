"""bench/schedstat.py: a process tree from /proc's parent links, and what its threads got."""

from __future__ import annotations

from pathlib import Path

from bench import schedstat


def _proc(root: Path, pid: int, parent: int, comm: str, threads: dict[int, tuple[int, int]]) -> None:
    d = root / str(pid)
    (d / "task").mkdir(parents=True)
    # a command name with spaces and a parenthesis, as vLLM's "VLLM::EngineCore" or "(sd-pam)" can be
    (d / "stat").write_text(f"{pid} ({comm}) S {parent} {pid} {pid} 0 -1\n")
    (d / "comm").write_text(comm + "\n")
    for tid, (run, wait) in threads.items():
        (d / "task" / str(tid)).mkdir()
        (d / "task" / str(tid) / "schedstat").write_text(f"{run} {wait} 7\n")


def test_a_tree_is_the_root_and_its_descendants_only(tmp_path):
    _proc(tmp_path, 10, 1, "python", {10: (1, 0)})
    _proc(tmp_path, 11, 10, "Engine) 1 2 (x", {11: (1, 0)})
    _proc(tmp_path, 12, 11, "worker", {12: (1, 0)})
    _proc(tmp_path, 20, 1, "busy", {20: (1, 0)})  # a neighbour, not a child
    (tmp_path / "self").mkdir()  # not a process directory
    assert schedstat.tree(10, proc=tmp_path) == [10, 11, 12]


def test_the_delta_sums_threads_and_splits_cpu_by_process(tmp_path):
    _proc(tmp_path, 10, 1, "python", {10: (1_000_000_000, 0), 13: (500_000_000, 250_000_000)})
    _proc(tmp_path, 11, 10, "EngineCore", {11: (2_000_000_000, 0)})
    before = schedstat.thread_times([10, 11], proc=tmp_path)
    assert before["10/13"] == (500_000_000, 250_000_000)
    _proc(tmp_path, 12, 10, "late", {12: (3_000_000_000, 1_000_000_000)})  # started after the first snapshot
    (tmp_path / "10" / "task" / "10" / "schedstat").write_text("4000000000 2000000000 9\n")
    after = schedstat.thread_times([10, 11, 12, 99], proc=tmp_path)  # 99 has ended: skipped
    out = schedstat.sched_delta(before, after, schedstat.process_names([10, 11, 12], proc=tmp_path))
    assert out["cpu_s"] == 6.0 and out["runnable_wait_s"] == 3.0
    assert out["cpu_s_by_process"] == {"python (10)": 3.0, "EngineCore (11)": 0.0, "late (12)": 3.0}


def test_one_process_has_no_split():
    out = schedstat.sched_delta({}, schedstat.thread_times())
    assert "cpu_s_by_process" not in out and out["cpu_s"] >= 0


def test_the_busiest_threads_are_listed_with_their_waits(tmp_path):
    _proc(tmp_path, 10, 1, "python", {10: (1_000_000_000, 0), 13: (0, 0), 14: (0, 0)})
    before = schedstat.thread_times([10], proc=tmp_path)
    for tid, stat in {10: "1500000000 100000000 3", 13: "4000000000 2000000000 3", 14: "2000000000 0 3"}.items():
        (tmp_path / "10" / "task" / str(tid) / "schedstat").write_text(stat + "\n")
    after = schedstat.thread_times([10], proc=tmp_path)
    out = schedstat.sched_delta(before, after, threads=2)
    assert out["cpu_s_by_thread"] == {"10/13": [4.0, 2.0], "10/14": [2.0, 0.0]}  # 10/10 got 0.5 s: not listed
    assert list(out["cpu_s_by_thread"]) == ["10/13", "10/14"]
    assert "cpu_s_by_thread" not in schedstat.sched_delta(before, after)
