"""Mutation testing of the modules where a silent bug costs most (mutmut, pinned in the dev extra).

    python -m scripts.mutation [MODULE ...]      all modules when none is named (`make mutation`)
    python -m scripts.mutation MODULE --only PATTERN ...
                                                 only the mutants named (mutmut's names, or fnmatch
                                                 globs of them: '*step__mutmut_*', '*__init____mutmut_2?')

For each module, in its own work directory `.mutation/<module>/` (git-ignored):
    a pyproject.toml holding only that module's mutmut and pytest configuration; the packages and
    tests linked in; `mutmut run` there: it copies the packages into `mutants/`, mutates only
    that module, records which of the module's relevant tests (MODULES below) reach each mutated
    function, then runs each mutant against exactly those tests.
    -> .mutation/<module>/summary.json   the count per status and every survivor's diff
Then .mutation/report.md gathers every module's killed share and survivors: the raw material
of docs/mutation.md (the counts) and docs/history/mutation-triage.md, where each survivor is
triaged (a test that kills it, or why it is equivalent). A module's results are kept: a second run
re-tests only mutants of functions that changed (delete `.mutation/<module>` to start over).
`--only` runs just the mutants it names (again, if they ran before); the summary then counts those
that have a result, every other one "not checked".

Each module's tests are the fast ones that exercise it (no real backbone: `-m "not slow"`), so a
module takes minutes on two cores. OMP_NUM_THREADS=1: mutmut forks its workers from a process
that imported torch, and the tiny model gains nothing from threads.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / ".mutation"
PACKAGES = ["adapters_store", "server"]  # copied into mutants/; training and client come from ROOT

# module -> (file, the tests relevant to it)
# the job runner's parts (server/jobs/) share their tests
JOBS_TESTS = ["tests/server/jobs/test_jobs_runner.py", "tests/server/jobs/test_jobs_bounds.py",
              "tests/server/jobs/test_jobs_service.py", "tests/server/jobs/test_jobs_lease.py"]

MODULES: dict[str, tuple[str, list[str]]] = {
    "routing": ("adapters_store/lora/routing.py",
                ["tests/adapters_store/lora/test_routing_math.py", "tests/adapters_store/lora/test_routed_model.py",
                 "tests/adapters_store/store/test_refine.py"]),
    "combine": ("adapters_store/lora/combine.py",
                ["tests/adapters_store/lora/test_routing_math.py", "tests/adapters_store/lora/test_routed_model.py",
                 "tests/server/engines/native/core/test_slots.py",
                 "tests/adapters_store/lora/test_peft_oracle.py", "tests/adapters_store/store/test_refine.py"]),
    "batched": ("adapters_store/lora/batched.py",
                ["tests/adapters_store/lora/test_routing_math.py", "tests/adapters_store/lora/test_routed_model.py"]),
    "atomic": ("adapters_store/store/atomic.py", ["tests/adapters_store/store/test_directory.py"]),
    "codec": ("server/adapter_cache/codec.py", ["tests/integration/redis/test_cache_tiers.py"]),
    # the slot tables' unit tests and both runners against the routed model (compaction included)
    "slot_lora": ("server/engines/native/model/slot_lora.py",
                  ["tests/server/engines/native/core/test_slots.py",
                   "tests/server/engines/native/model/test_model_runner.py"]),
    # the sampler: a wrong filter or draw changes every sampled token's distribution silently
    # the prefix cache: a wrong key or copy serves another prompt's (or tenant's) KV silently
    "prefix_cache": ("server/engines/native/core/prefix_cache.py",
                     ["tests/server/engines/native/core/test_prefix_cache.py"]),
    "sampling": ("server/engines/native/sample/sampling.py",
                 ["tests/server/engines/native/sample/test_sampling_units.py"]),
    "rows": ("server/engines/native/sample/rows.py",
             ["tests/server/engines/native/sample/test_sampling_units.py",
              "tests/server/engines/native/core/test_engine_features.py"]),
    "isolate": ("server/engines/native/core/isolate.py",
                ["tests/server/engines/native/sample/test_sampling_units.py",
                 "tests/server/engines/native/core/test_engine_faults.py"]),
    "ledger": ("server/engines/native/core/ledger.py",
               ["tests/server/engines/native/sample/test_sampling_units.py",
                "tests/server/engines/native/core/test_engine_faults.py"]),
    "runner": ("server/jobs/runner.py", JOBS_TESTS),
    "journal": ("server/jobs/journal.py", JOBS_TESTS),
    "leases": ("server/jobs/leases.py", JOBS_TESTS),
    # which GGUF blocks the weight kernel may serve from: a wrong match serves wrong weights silently
    "gguf_blocks": ("adapters_store/backbone/gguf_blocks.py", ["tests/adapters_store/backbone/test_gguf_blocks.py"]),
    "quant_linear": ("server/engines/native/kernels/quant_linear.py",
                     ["tests/server/engines/native/kernels/test_quant_linear.py"]),
    "quant_linear_bf16": ("server/engines/native/kernels/quant_linear_bf16.py",
                          ["tests/server/engines/native/kernels/test_quant_linear_bf16.py"]),
}

# mutmut's exit codes (mutmut/stats.py): what a mutant's result means
STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests", 34: "skipped",
          36: "timeout", 24: "timeout", -24: "timeout", 152: "timeout", 255: "timeout",
          37: "caught by type check", -11: "segfault", -9: "segfault", None: "not checked"}


def toml_list(items: list[str]) -> str:
    return "[" + ", ".join(json.dumps(i) for i in items) + "]"


def prepare(name: str) -> Path:
    """The module's work directory: links to the sources and tests, its own pyproject.toml."""
    path, tests = MODULES[name]
    work = WORK / name
    work.mkdir(parents=True, exist_ok=True)
    for entry in [*PACKAGES, "tests"]:
        link = work / entry
        if not link.is_symlink():
            link.symlink_to(ROOT / entry)
    main = (ROOT / "pyproject.toml").read_text()
    pytest_section = main[main.index("[tool.pytest.ini_options]"): main.index("[tool.ruff]")]
    (work / "pyproject.toml").write_text(
        f"# generated by scripts/mutation.py for {path}\n"
        "[tool.mutmut]\n"
        f"source_paths = {toml_list(PACKAGES)}\n"
        f"only_mutate = {toml_list([path])}\n"
        f"pytest_add_cli_args_test_selection = {toml_list(tests)}\n"
        "pytest_add_cli_args = [\"-p\", \"no:cacheprovider\", \"-m\", \"not slow and not heavy and not vllm\","
        " \"--timeout=600\"]\n"
        # mutmut's wall-clock limit per mutant is (the tests' measured time + this) * 15: a module-scoped
        # fixture built again in each mutant's process, on a loaded host, needs more than its default 1 s
        "timeout_constant = 10.0\n"
        "process_isolation = \"forkserver\"\n"
        "use_git_change_detection = false\n\n"
        + pytest_section
    )
    return work


def results(name: str) -> dict:
    """Counts per status and the survivors (name, diff) of a module's last run."""
    path, _ = MODULES[name]
    work = WORK / name
    meta = work / "mutants" / (path + ".meta")
    codes = json.loads(meta.read_text())["exit_code_by_key"]
    counts: dict[str, int] = {}
    for code in codes.values():
        status = STATUS.get(code, "suspicious")
        counts[status] = counts.get(status, 0) + 1
    survivors = []
    for key, code in sorted(codes.items()):
        if STATUS.get(code, "suspicious") in ("survived", "no tests", "suspicious", "segfault"):
            diff = subprocess.run([mutmut(), "show", key], cwd=work, capture_output=True, text=True,
                                  check=False).stdout
            survivors.append({"mutant": key, "status": STATUS.get(code, "suspicious"), "diff": diff.strip()})
    tested = sum(counts.values()) - counts.get("not checked", 0) - counts.get("skipped", 0)
    killed = counts.get("killed", 0) + counts.get("timeout", 0) + counts.get("caught by type check", 0)
    return {"module": path, "mutants": len(codes), "counts": counts, "tested": tested, "killed": killed,
            "killed_share": round(killed / tested, 3) if tested else None, "survivors": survivors}


def mutmut() -> str:
    return str(Path(sys.executable).parent / "mutmut")


def run(name: str, children: int, retest: bool = False, only: list[str] | None = None) -> dict:
    """mutmut run over the module; retest: only its last survivors, again (after adding tests);
    only: just these mutants (names or globs, passed to `mutmut run` as they are)."""
    work = prepare(name)
    names = [sv["mutant"] for sv in json.loads((work / "summary.json").read_text())["survivors"]] if retest else []
    names += only or []
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT),
               POLYSERVE_HOME=os.environ.get("POLYSERVE_HOME", str(Path.home() / ".cache" / "polyserve")))
    started = time.perf_counter()
    log = work / "mutmut.log"
    with open(log, "w") as out:
        code = subprocess.run([mutmut(), "run", "--max-children", str(children), *names], cwd=work, env=env,
                              stdout=out, stderr=subprocess.STDOUT, check=False).returncode
    if code != 0:
        raise RuntimeError(f"{name}: mutmut exited {code}; see {log}")
    seconds = round(time.perf_counter() - started)
    if retest:  # the module's time stays that of its full run
        seconds = json.loads((work / "summary.json").read_text())["seconds"]
    summary = results(name) | {"seconds": seconds} | ({"only": only} if only else {})
    (work / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def report() -> str:
    """Every module that has a summary: its killed share, then each survivor's diff."""
    lines = ["| module | mutants | killed | survived | no tests | killed share | seconds |",
             "|---|---|---|---|---|---|---|"]
    details = []
    for name in MODULES:
        file = WORK / name / "summary.json"
        if not file.exists():
            lines.append(f"| {MODULES[name][0]} | not run | | | | | |")
            continue
        s = json.loads(file.read_text())
        c = s["counts"]
        lines.append(f"| {s['module']} | {s['mutants']} | {s['killed']} | {c.get('survived', 0)} | "
                     f"{c.get('no tests', 0)} | {s['killed_share']:.1%} | {s['seconds']} |")
        for sv in s["survivors"]:
            details.append(f"### {sv['mutant']} ({sv['status']})\n\n```diff\n{sv['diff']}\n```\n")
    return "\n".join(lines) + "\n\n## Survivors\n\n" + "\n".join(details)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("modules", nargs="*", help=f"default: all of {', '.join(MODULES)}")
    parser.add_argument("--children", type=int, default=1, help="mutants tested at once (default 1)")
    parser.add_argument("--report-only", action="store_true", help="only rebuild .mutation/report.md")
    parser.add_argument("--retest", action="store_true",
                        help="re-run only each module's last survivors (after adding tests that should kill them)")
    parser.add_argument("--only", nargs="+", metavar="PATTERN",
                        help="run only these mutants of the one module named: mutmut's names or fnmatch globs")
    args = parser.parse_args()
    unknown = [m for m in args.modules if m not in MODULES]
    if unknown:
        parser.error(f"unknown modules {unknown}; choose from {', '.join(MODULES)}")
    if args.only and (len(args.modules) != 1 or args.retest):
        parser.error("--only needs exactly one module, and no --retest")
    failed = []
    for name in ([] if args.report_only else args.modules or list(MODULES)):
        print(f"{name}: mutating {MODULES[name][0]} ...", flush=True)
        try:
            s = run(name, args.children, args.retest, args.only)
        except RuntimeError as err:  # the next module still runs; the exit status says it failed
            print(err, flush=True)
            failed.append(name)
            continue
        print(f"{name}: {s['killed']}/{s['tested']} killed ({s['killed_share']:.1%}), "
              f"{len(s['survivors'])} to triage, {s['seconds']} s", flush=True)
    WORK.mkdir(exist_ok=True)
    (WORK / "report.md").write_text(report())
    print(f"report: {WORK / 'report.md'}")
    if failed:
        raise SystemExit(f"mutmut failed for {', '.join(failed)}")


if __name__ == "__main__":
    main()
