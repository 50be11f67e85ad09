"""What the scheduler gave a process and its children during a run: CPU seconds on a CPU, and
seconds runnable but waiting for one (the contention it met), from /proc/<pid>/task/<tid>/schedstat.

A peer such as vLLM runs its engine core in a child process, so its CPU is the tree's, not the
parent's; the per-process split shows where it goes (a polling engine core, the model's threads).
No dependency beyond the standard library: bench/vllm_peer.py runs it in the vLLM environment.

    tree(pid)                 pid and its descendants
    thread_times(pids)        {"pid/tid": (ns on a CPU, ns waiting runnable)}
    sched_delta(before, after, names, threads)   totals, per-process CPU seconds and the busiest
                              threads between two snapshots
"""

from __future__ import annotations

import os
from pathlib import Path

PROC = Path("/proc")


def _parent(stat: str) -> int:
    # the command name (field 2) may hold spaces and parentheses: fields restart after the last ")"
    return int(stat[stat.rindex(")") + 2:].split()[1])


def tree(root: int | None = None, proc: Path = PROC) -> list[int]:
    """root (this process by default) and every process descended from it, root first."""
    root = os.getpid() if root is None else root
    children: dict[int, list[int]] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            children.setdefault(_parent((entry / "stat").read_text()), []).append(int(entry.name))
        except (OSError, ValueError, IndexError):  # a process that just ended
            continue
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(sorted(children.get(pid, []), reverse=True))
    return out


def thread_times(pids: list[int] | None = None, proc: Path = PROC) -> dict[str, tuple[int, int]]:
    """Per thread of the processes (this one by default): (ns on a CPU, ns runnable but waiting),
    keyed "pid/tid"; empty where the kernel keeps no schedstat."""
    out = {}
    for pid in [os.getpid()] if pids is None else pids:
        try:
            tasks = list((proc / str(pid) / "task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                on_cpu, waiting, _ = (task / "schedstat").read_text().split()
            except (OSError, ValueError):
                continue
            out[f"{pid}/{task.name}"] = (int(on_cpu), int(waiting))
    return out


def process_names(pids: list[int], proc: Path = PROC) -> dict[int, str]:
    names = {}
    for pid in pids:
        try:
            names[pid] = (proc / str(pid) / "comm").read_text().strip()
        except OSError:
            continue
    return names


def sched_delta(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]],
                names: dict[int, str] | None = None, threads: int = 0) -> dict:
    """CPU seconds the threads got between the snapshots and seconds they waited runnable, summed;
    with names (pid -> command), also CPU seconds per process, by "name (pid)"; with threads = N,
    also the N threads that got the most, by "pid/tid": [CPU s, s waiting runnable] (which of a
    process's threads took its CPU: an engine thread, the panel helper, an OpenMP team's worker)."""
    cpu = wait = 0
    per: dict[int, int] = {}
    each: dict[str, tuple[int, int]] = {}
    for key, (on_cpu, waiting) in after.items():
        was = before.get(key, (0, 0))
        cpu += on_cpu - was[0]
        wait += waiting - was[1]
        each[key] = (on_cpu - was[0], waiting - was[1])
        pid = int(key.split("/")[0])
        per[pid] = per.get(pid, 0) + on_cpu - was[0]
    out: dict = {"cpu_s": round(cpu / 1e9, 2), "runnable_wait_s": round(wait / 1e9, 2)}
    if names is not None and len(per) > 1:
        out["cpu_s_by_process"] = {f"{names.get(p, '?')} ({p})": round(ns / 1e9, 2) for p, ns in sorted(per.items())}
    if threads > 0:
        top = sorted(each.items(), key=lambda kv: (-kv[1][0], kv[0]))[:threads]
        out["cpu_s_by_thread"] = {key: [round(run / 1e9, 2), round(waiting / 1e9, 2)] for key, (run, waiting) in top}
    return out
