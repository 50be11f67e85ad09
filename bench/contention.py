"""Throughput beside busy processes: polyserve (a) and vLLM bare (F) in interleaved rounds.

Each round runs, for each count of busy processes, one `bench.serve_bench` process (the variants
in alternating order from round to round) while that many `python3 -c "while True: pass"`
processes run; the bench starts and stops them itself. `--quota` adds, each round, a run of (a)
inside a cgroup limited to 1 CPU (cgroup v2 `cpu.max` or v1 `cpu.cfs_quota_us`, made by the bench;
`systemd-run --scope -p CPUQuota=100%` first where systemd runs), nothing busy beside it.

    .venv/bin/python -m bench.contention --busy 0,2,6 --rounds 3 --quota --json out.json -- \
        --tasks 48 --requests 96 --batch 16 --out-min 4 --out-max 128 --out-dist loguniform \
        --threads 2 --dtype bfloat16 --vllm-python /path/to/vllm/bin/python

Arguments after `--` go to serve_bench unchanged. `--requests-at 6=48` runs fewer requests at
that count (a round beside 6 busy processes is slow). Rounds can be split over several commands
(`--first-round` numbers them; `--json` files of each) and reported together: `--report a.json
b.json` (runs of one round number pair up for (a)/(F)).

Reported per busy count: the median over rounds of each variant's output tok/s and the spread
(min-max), the median of the per-round ratios (a)/(F) and their spread, and "kept": the median
beside N busy processes over the median with none (fair share of 2 threads on 2 CPUs beside N
single-threaded busy processes: 2 / (2 + N)); under the table, kept round by round (each round's run
beside N over that round's run alone). Then, for each variant, what its processes got from
the scheduler (serve_bench's and the peer's schedstat figures): CPUs held, CPU seconds per 1,000
tokens, and the share of its runnable time on a CPU. `--idle-busy` runs the busy processes at idle
priority: the CPUs never halt, but the bench's processes keep them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUSY = [sys.executable, "-c", "while True: pass"]


@contextlib.contextmanager
def busy_processes(n: int, idle: bool = False) -> Iterator[None]:
    """n busy loops; idle: at the scheduler's idle priority (SCHED_IDLE), which takes a CPU only when
    nothing else wants it, so the CPUs never sit idle but the bench keeps them: what a run gains or
    loses from the CPUs being kept awake alone, apart from sharing them."""
    procs = [subprocess.Popen(BUSY) for _ in range(n)]
    if idle:
        for p in procs:
            os.sched_setscheduler(p.pid, os.SCHED_IDLE, os.sched_param(0))
    try:
        time.sleep(0.5 if n else 0)  # running before the bench starts
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def _cgroup_mount(kind: str) -> Path | None:
    """The mount point of cgroup v2 with the cpu controller enabled for children, or of v1's cpu
    controller."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        point = Path(fields[4])
        if kind == "v2" and tail[0] == "cgroup2" and "cpu" in (point / "cgroup.controllers").read_text().split():
            return point
        if kind == "v1" and tail[0] == "cgroup" and "cpu" in tail[2].split(","):
            return point
    return None


@contextlib.contextmanager
def one_cpu_quota() -> Iterator[tuple[list[str], str]]:
    """A command prefix that runs a command under a 1-CPU quota, and how."""
    if shutil.which("systemd-run") and subprocess.run(
            ["systemd-run", "--scope", "-q", "-p", "CPUQuota=100%", "true"], check=False,
            capture_output=True).returncode == 0:
        yield ["systemd-run", "--scope", "-q", "-p", "CPUQuota=100%"], "systemd-run --scope -p CPUQuota=100%"
        return
    made: Path | None = None
    how = ""
    try:
        v2 = _cgroup_mount("v2")
        if v2 is not None:
            if "cpu" not in (v2 / "cgroup.subtree_control").read_text().split():
                (v2 / "cgroup.subtree_control").write_text("+cpu\n")
            made = v2 / f"polyserve-bench-{os.getpid()}"
            made.mkdir()
            (made / "cpu.max").write_text("100000 100000\n")
            how = f"cgroup v2 {made}: cpu.max 100000 100000"
        else:
            v1 = _cgroup_mount("v1")
            if v1 is None:
                raise OSError("no cgroup cpu controller")
            made = v1 / f"polyserve-bench-{os.getpid()}"
            made.mkdir()
            (made / "cpu.cfs_period_us").write_text("100000\n")
            (made / "cpu.cfs_quota_us").write_text("100000\n")
            how = f"cgroup v1 {made}: cpu.cfs_quota_us 100000 / cpu.cfs_period_us 100000"
        enter = f'echo $$ > {made}/cgroup.procs && exec "$@"'
        yield ["sh", "-c", enter, "sh"], how
    except OSError as err:
        yield ["taskset", "-c", "0"], f"taskset -c 0 (no CPU quota could be set here: {err})"
    finally:
        if made is not None:
            for _ in range(50):  # the cgroup empties once its last process has been reaped
                try:
                    made.rmdir()
                    break
                except OSError:
                    time.sleep(0.1)


def serve_bench(variants: str, args: list[str], prefix: list[str] | None = None) -> list[dict]:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [*(prefix or []), sys.executable, "-m", "bench.serve_bench", *args, "--variants", variants,
               "--json", out.name]
        run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
        if run.returncode != 0:
            raise SystemExit(f"serve_bench failed ({run.returncode}): {' '.join(cmd)}\n{run.stderr[-3000:]}")
        return json.loads(Path(out.name).read_text())["results"]


def with_option(args: list[str], flag: str, value: str) -> list[str]:
    """serve_bench's arguments with `flag value` set, replacing the flag's value where it is given;
    always a new list, so that a run's changes never reach the next round's."""
    out = list(args)
    if flag in out:
        out[out.index(flag) + 1] = value
    else:
        out += [flag, value]
    return out


def with_requests(args: list[str], n: int | None) -> list[str]:
    """serve_bench's arguments with n requests (None: as given; a new list either way)."""
    return list(args) if n is None else with_option(args, "--requests", str(n))


KEPT = ("tokens", "wall_s", "cpu_s", "runnable_wait_s", "cpu_s_by_process", "cpu_s_by_thread", "one_thread_steps",
        "contended_steps", "steps", "dtype")


def measure(busy: list[int], rounds: int, variants: str, bench_args: list[str], requests_at: dict[int, int],
            quota: bool, first_round: int = 0, idle_busy: bool = False) -> list[dict]:
    rows = []
    for r in range(first_round, first_round + rounds):
        order = variants if r % 2 == 0 else variants[::-1]
        for n in busy:
            load = os.getloadavg()[0]
            with busy_processes(n, idle_busy):
                results = serve_bench(order, with_requests(bench_args, requests_at.get(n)))
            for res in results:
                rows.append({"round": r, "busy": n, "variant": res["variant"][1], "tok_per_s": res["tok_per_s"],
                             "load_before": load, **{k: res[k] for k in KEPT if k in res}})
                print(json.dumps(rows[-1]), flush=True)
        if quota:
            # threads as the server sizes them inside the cgroup (server/infra/cpus.py): 1
            quota_args = with_option(with_requests(bench_args, requests_at.get(0)), "--threads", "auto")
            with one_cpu_quota() as (prefix, how):
                res = serve_bench("a", quota_args, prefix)[0]
            rows.append({"round": r, "busy": "quota", "how": how, "variant": "a", "tok_per_s": res["tok_per_s"],
                         **{k: res[k] for k in KEPT if k in res}})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def spread(xs: list[float]) -> str:
    return f"{min(xs):.1f}-{max(xs):.1f}" if len(xs) > 1 else "-"


def by_round(rows: list[dict], busy: int, variant: str) -> dict[int, float]:
    """A variant's tok/s beside `busy` busy processes, by round."""
    return {row["round"]: row["tok_per_s"] for row in rows if row["busy"] == busy and row["variant"] == variant}


def report(rows: list[dict]) -> str:
    """The table; the peer is vLLM bare at the dtype that was run: (F) bfloat16 or (f) float32 (its
    fastest on a CPU without bf16)."""
    def tps(busy: int, v: str) -> dict[int, float]:
        return by_round(rows, busy, v)

    peer = "F" if any(row["variant"] == "F" for row in rows) else "f"
    name = {"F": "vLLM bare", "f": "vLLM bare, float32"}[peer]
    lines = [(f"| busy processes | rounds | (a) polyserve tok/s: median (spread) | ({peer}) {name}: median (spread) "
              f"| (a)/({peer}): median (per round) | (a) kept | ({peer}) kept | fair share |"),
             "|---:|---:|---|---|---|---:|---:|---:|"]
    levels = sorted({row["busy"] for row in rows if row["busy"] != "quota"})
    alone = {v: statistics.median(tps(0, v).values()) for v in ("a", peer) if tps(0, v)}
    for n in levels:
        a, f = tps(n, "a"), tps(n, peer)
        ratios = [a[k] / f[k] for k in a if k in f]
        med = {v: statistics.median(x.values()) if x else float("nan") for v, x in (("a", a), (peer, f))}
        kept = {v: f"{med[v] / alone[v]:.2f}" if alone.get(v) else "-" for v in ("a", peer)}
        lines.append(
            f"| {n} | {len(a)} | {med['a']:.1f} ({spread(list(a.values()))}) "
            f"| {med[peer]:.1f} ({spread(list(f.values()))}) "
            f"| {statistics.median(ratios):.2f} ({', '.join(f'{x:.2f}' for x in ratios)}) | {kept['a']} | {kept[peer]} "
            f"| {2 / (2 + n):.2f} |" if ratios else
            f"| {n} | {len(a)} | {med['a']:.1f} ({spread(list(a.values()))}) | - | - | {kept['a']} | - "
            f"| {2 / (2 + n):.2f} |")
    lines += kept_by_round(rows, levels, ("a", peer))
    # other variants run beside them (e.g. (w), the engine on dense weights): against (a), round by round
    for v in sorted({row["variant"] for row in rows if row["busy"] != "quota"} - {"a", peer}):
        lines += ["", (f"| busy processes | rounds | ({v}) tok/s: median (spread) | (a)/({v}): median (per round) "
                      f"| ({v}) kept |"), "|---:|---:|---|---|---:|"]
        alone_v = statistics.median(tps(0, v).values()) if tps(0, v) else None
        for n in levels:
            a, other = tps(n, "a"), tps(n, v)
            if not other:
                continue
            ratios = [a[k] / other[k] for k in a if k in other]
            med_v = statistics.median(other.values())
            lines.append(f"| {n} | {len(other)} | {med_v:.1f} ({spread(list(other.values()))}) | "
                         + (f"{statistics.median(ratios):.2f} ({', '.join(f'{x:.2f}' for x in ratios)})"
                            if ratios else "-")
                         + (f" | {med_v / alone_v:.2f} |" if alone_v else " | - |"))
    lines += cpu_table(rows, levels)
    lines += mixed_dtypes(rows)
    q = [row for row in rows if row["busy"] == "quota"]
    if q:
        qs = [row["tok_per_s"] for row in q]
        lines.append("")
        lines.append(f"1-CPU quota ({q[0]['how']}), nothing busy: (a) {statistics.median(qs):.1f} tok/s median "
                     f"({spread(qs)}, {len(qs)} rounds)"
                     + (f" = {statistics.median(qs) / alone['a']:.2f} of (a) unlimited" if "a" in alone else ""))
    return "\n".join(lines)


def kept_by_round(rows: list[dict], levels: list[int], variants: tuple[str, ...]) -> list[str]:
    """Kept round by round: each round's run beside N busy processes over the same round's run alone,
    a median of those and each round's. The table's kept divides medians of runs made up to a round
    apart; where the host's own speed moves between rounds, the two can differ."""
    out = []
    for v in variants:
        alone = by_round(rows, 0, v)
        parts = []
        for n in levels:
            kept = [x / alone[r] for r, x in sorted(by_round(rows, n, v).items()) if r in alone] if n else []
            if kept:
                parts.append(f"beside {n} {statistics.median(kept):.2f} ({', '.join(f'{k:.2f}' for k in kept)})")
        if parts:
            out.append(f"({v}) kept round by round (over the same round alone): {'; '.join(parts)}")
    return [""] + out if out else []


def mixed_dtypes(rows: list[dict]) -> list[str]:
    """A warning where one variant served in more than one dtype across the runs: "auto" is decided
    per process, and a table that mixes dtypes compares more than the CPUs' sharing."""
    lines = []
    for v in sorted({row["variant"] for row in rows if "dtype" in row}):
        seen: dict[str, list[str]] = {}
        for row in rows:
            if row["variant"] == v and "dtype" in row:
                seen.setdefault(row["dtype"], []).append(f"round {row['round']} beside {row['busy']}")
        if len(seen) > 1:
            lines += ["", f"**({v}) served in more than one dtype:** "
                      + "; ".join(f"{dt}: {', '.join(runs)}" for dt, runs in sorted(seen.items()))]
    return lines


def cpu_table(rows: list[dict], levels: list[int]) -> list[str]:
    """Where each variant's time went, from its processes' schedstat (rows that carry it): CPUs it
    held on average (CPU seconds over wall seconds), CPU seconds per 1,000 output tokens, and the
    share of its runnable time it spent on a CPU (the rest it waited for one). Medians over rounds."""
    have = [row for row in rows if row["busy"] in levels
            and {"cpu_s", "runnable_wait_s", "wall_s", "tokens"} <= row.keys()
            and row["cpu_s"] > 0]  # no schedstat: nothing to say
    if not have:
        return []
    lines = ["", "| busy processes | variant | rounds | CPUs held | CPU s per 1,000 tokens | on a CPU when runnable |",
             "|---:|---|---:|---:|---:|---:|"]
    for n in levels:
        for v in sorted({row["variant"] for row in have if row["busy"] == n}):
            runs = [row for row in have if row["busy"] == n and row["variant"] == v]
            held = statistics.median(row["cpu_s"] / row["wall_s"] for row in runs)
            per_k = statistics.median(1000 * row["cpu_s"] / row["tokens"] for row in runs)
            on = statistics.median(row["cpu_s"] / (row["cpu_s"] + row["runnable_wait_s"]) for row in runs)
            lines.append(f"| {n} | ({v}) | {len(runs)} | {held:.2f} | {per_k:.1f} | {on:.2f} |")
    return lines


def main() -> None:
    argv = sys.argv[1:]
    bench_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--busy", default="0,2,6", help="counts of busy processes, comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--first-round", type=int, default=0,
                    help="number of the first round: runs of one round split over commands pair up by it")
    ap.add_argument("--variants", default="aF", help="serve_bench letters run at each count")
    ap.add_argument("--requests-at", default="", help="e.g. 6=48: --requests for that busy count")
    ap.add_argument("--quota", action="store_true", help="also (a) under a 1-CPU quota, each round")
    ap.add_argument("--idle-busy", action="store_true",
                    help="run the busy processes at idle priority (SCHED_IDLE): CPUs kept awake, not shared")
    ap.add_argument("--json", type=Path, help="write the rows here")
    ap.add_argument("--report", type=Path, nargs="*", help="only report rows from these --json files")
    args = ap.parse_args(own)
    if args.report:
        rows = []
        for path in args.report:
            rows += json.loads(path.read_text())["rows"]
        print(report(rows))
        return
    requests_at = {int(k): int(v) for k, v in (kv.split("=") for kv in args.requests_at.split(",") if kv)}
    rows = measure([int(x) for x in args.busy.split(",")], args.rounds, args.variants, bench_args, requests_at,
                   args.quota, args.first_round, args.idle_busy)
    if args.json:
        args.json.write_text(json.dumps({"bench_args": bench_args, "argv": own, "rows": rows}, indent=1))
    print(report(rows))


if __name__ == "__main__":
    main()
