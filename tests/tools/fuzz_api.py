"""Schema-based fuzzing of the HTTP API: schemathesis (`--checks all`) against a live server.

    python -m tests.tools.fuzz_api                         # in-process server (tiny backbone), ~1-2 min
    python -m tests.tools.fuzz_api --max-examples 60       # bigger budget (>= 1,000 generated requests)
    python -m tests.tools.fuzz_api --url http://127.0.0.1:8000 --key K --admin-key A   # a running server

Without --url it starts polyserve in this process on a free loopback port: tiny random backbone,
a random skill inventory with four tasks, API and admin keys set (so the auth checks run), small
limits so that generations stay short. It prints one JSON line: the exit status of schemathesis,
the number of requests it sent, and its failures; the exit code is schemathesis's (0 = nothing
found). `run_fuzz()` is the same as a function (tests/server/api/test_fuzz_api.py, tests/tools/chaos.py).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

KEY, ADMIN_KEY = "fuzz-inference-key", "fuzz-admin-key"
CONFIG = Path(__file__).with_name("schemathesis.toml")


@contextmanager
def local_server(root: Path) -> Iterator[str]:
    """polyserve on the tiny backbone with a random inventory; yields its URL."""
    from tests.support.server_fixtures import build_store, live_server, settings_for, tiny_backbone

    build_store(root / "store")
    settings = settings_for(root, api_keys=[KEY], admin_keys=[ADMIN_KEY], max_new_tokens=16,
                            max_prompt_tokens=256, max_examples_per_task=8, max_n=2,
                            request_timeout_seconds=30, max_body_bytes=1024 * 1024)
    with live_server(settings, tiny_backbone()) as srv:
        yield srv.url


def schemathesis_cmd(url: str, key: str, *, max_examples: int, seed: int, workers: int,
                     report: Path, phases: str, exclude_checks: tuple[str, ...] = ()) -> list[str]:
    exe = Path(sys.executable).with_name("schemathesis")
    return [str(exe), "--config-file", str(CONFIG), "run", f"{url}/openapi.json", "--checks", "all",
            "--max-examples", str(max_examples),
            "--seed", str(seed), "--workers", str(workers), "--phases", phases, "-H", f"Authorization: Bearer {key}",
            "--generation-database", "none", "--no-color", "--request-timeout", "60",
            "--report", "ndjson", "--report-ndjson-path", str(report), "--suppress-health-check", "all",
            *(["--exclude-checks", ",".join(exclude_checks)] if exclude_checks else [])]


def count_requests(report: Path) -> int:
    """Requests schemathesis sent, from its ndjson event log (one interaction per request)."""
    if not report.exists():
        return 0
    return report.read_text().count('"request":')


def run_fuzz(url: str | None = None, key: str = ADMIN_KEY, *, max_examples: int = 10, seed: int = 1,
             workers: int = 1, phases: str = "examples,coverage,fuzzing,stateful", report: Path | None = None,
             exclude_checks: tuple[str, ...] = ()) -> dict:
    """Run schemathesis; returns {"returncode", "requests", "failures", "output"}. The admin key is
    used so every route is reachable (ignored_auth still sends requests without it)."""
    with tempfile.TemporaryDirectory(prefix="polyserve-fuzz-") as tmp:
        tmp_path = Path(tmp)
        report = report or tmp_path / "events.ndjson"
        # our positive-data check replaces schemathesis's (tests/tools/fuzz_checks.py says why)
        env = {**os.environ, "NO_COLOR": "1", "SCHEMATHESIS_HOOKS": "fuzz_checks",
               "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
        exclude_checks = ("positive_data_acceptance", *exclude_checks)

        def run(target: str) -> subprocess.CompletedProcess:
            cmd = schemathesis_cmd(target, key, max_examples=max_examples, seed=seed, workers=workers,
                                   report=report, phases=phases, exclude_checks=exclude_checks)
            return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp, check=False)

        if url is None:
            with local_server(tmp_path) as local:
                done = run(local)
        else:
            done = run(url.rstrip("/"))
        output = done.stdout + done.stderr
        failures = re.findall(r"^\s*(?:\d+\.\s+)?(?:Server error|Undocumented|API rejected|API accepted|"
                              r"Response violates|Missing|Unsupported|Authentication|Undocumented Content-Type|"
                              r"`Allow`).*$", output, re.MULTILINE)
        return {"returncode": done.returncode, "requests": count_requests(report), "failures": failures,
                "output": output}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running server (default: start one in-process)")
    parser.add_argument("--key", help="bearer key for --url (an admin key reaches every route)")
    parser.add_argument("--max-examples", type=int, default=10, help="generated cases per operation and phase")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--phases", default="examples,coverage,fuzzing,stateful")
    parser.add_argument("--verbose", action="store_true", help="print schemathesis's whole output")
    parser.add_argument("--report", type=Path, help="keep schemathesis's ndjson event log here")
    parser.add_argument("--exclude-checks", default="", help="comma-separated schemathesis checks to skip "
                        "(positive_data_acceptance is always replaced by polyserve_positive_data_acceptance)")
    args = parser.parse_args()
    result = run_fuzz(args.url, args.key or ADMIN_KEY, max_examples=args.max_examples, seed=args.seed,
                      workers=args.workers, phases=args.phases, report=args.report,
                      exclude_checks=tuple(c for c in args.exclude_checks.split(",") if c))
    if args.verbose or result["returncode"] != 0:
        print(result["output"], file=sys.stderr)
    print(json.dumps({k: v for k, v in result.items() if k != "output"}))
    return int(result["returncode"])


if __name__ == "__main__":
    raise SystemExit(main())
