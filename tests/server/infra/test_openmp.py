"""`import server` sets libgomp's spin defaults before torch loads (server/infra/openmp.py), and only then.

Each case runs in a fresh interpreter: libgomp reads its environment once, when torch loads, so
the order of imports is the thing under test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")

PROBE = """
import json, os, sys
{before}
import server
from server.infra import openmp
print(json.dumps({{"env": {{k: os.environ.get(k) for k in {vars!r}}}, "state": openmp.state(),
                  "torch_loaded": "torch" in sys.modules}}))
"""


def probe(before: str = "", **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if k not in VARS}
    out = subprocess.run([sys.executable, "-c", PROBE.format(before=before, vars=VARS)], cwd=ROOT,
                         env={**clean, **env}, check=True, capture_output=True, text=True, timeout=120).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_import_server_sets_both_before_torch_loads() -> None:
    got = probe()
    assert got["env"] == {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "300000"}
    assert got["state"].startswith("OMP_WAIT_POLICY=ACTIVE GOMP_SPINCOUNT=300000")  # no quota on the test host
    assert got["torch_loaded"] is False  # `import server` itself must not load torch first


@pytest.mark.parametrize(("quota", "policy"), [(None, "ACTIVE"), (2.0, "ACTIVE"), (1.5, "PASSIVE"), (1.0, "PASSIVE")])
def test_a_quota_below_the_cpus_makes_waiting_threads_sleep(quota, policy):
    """Under a 1.5-CPU quota the engine still has 2 threads; spinning would spend the quota the
    other thread needs to reach the barrier."""
    from server.infra.cpus import CpuBudget
    from server.infra.openmp import wait_policy

    env, why = wait_policy(CpuBudget(online=2, affinity=2, quota=quota))
    assert env["OMP_WAIT_POLICY"] == policy
    assert ("quota" in why) is (policy == "PASSIVE")


@pytest.mark.parametrize("user", [{"OMP_WAIT_POLICY": "PASSIVE"}, {"GOMP_SPINCOUNT": "0"}])
def test_a_users_own_setting_wins_and_nothing_is_added(user: dict) -> None:
    got = probe(**user)
    assert got["env"] == {k: user.get(k) for k in VARS}
    assert got["state"].startswith("left to the environment")


def test_torch_loaded_first_sets_nothing_and_says_so() -> None:
    got = probe(before="import torch")
    assert got["env"] == {k: None for k in VARS}  # too late for libgomp: setting them would mislead
    assert "torch was loaded before polyserve" in got["state"]


THREADS = """
import json, threading
import server
from server.infra import openmp
import torch
mode = {mode!r}
set_up, lowered, out = threading.Event(), threading.Event(), {{}}

def engine():
    if mode == "use_threads":
        openmp.use_threads(2)
    else:
        torch.set_num_threads(2)
    set_up.set()
    lowered.wait()  # another thread asks for one thread before this one has run any op
    out["engine"] = torch.get_num_threads()

def helper():
    set_up.wait()
    openmp.one_thread()
    out["helper"] = torch.get_num_threads()
    lowered.set()

threads = [threading.Thread(target=engine), threading.Thread(target=helper)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(json.dumps(out))
"""


@pytest.mark.parametrize("mode,engine_threads", [("use_threads", 2), ("set_num_threads", 1)])
def test_a_thread_keeps_its_count_when_another_thread_goes_single(mode: str, engine_threads: int) -> None:
    """The engine thread sets 2 threads and has not run an op yet when a helper thread calls
    one_thread(): with use_threads it keeps 2; with a plain torch.set_num_threads it would take
    torch's lazily initialised process-wide 1 (the server's engine ran single-threaded so)."""
    out = subprocess.run([sys.executable, "-c", THREADS.format(mode=mode)], cwd=ROOT, check=True,
                         capture_output=True, text=True, timeout=120).stdout
    got = json.loads(out.strip().splitlines()[-1])
    assert got == {"helper": 1, "engine": engine_threads}
