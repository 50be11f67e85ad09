"""The engine thread never waits on the store: while another process holds the store's lock (so a
registration's commit cannot proceed), streams keep producing tokens; the commit goes through
once the lock is free. (Before, the engine thread took the lock itself to commit, and every
stream stalled for as long as the other process held it.)"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest

from tests.support.server_fixtures import build_store, live_server, settings_for, tiny_backbone

STREAM_S = 8.0  # streams run this long while the lock is held
EXAMPLES = [{"input": f"w{i} x{i}", "output": f"x{i} w{i}"} for i in range(6)]


@pytest.fixture
def server(tmp_path):
    build_store(tmp_path / "store")
    with live_server(settings_for(tmp_path, warmup=False), tiny_backbone()) as srv:
        yield srv


def stream_gaps(c: httpx.Client, until: float) -> list[float]:
    """Back-to-back streams until `until`: every gap between two events (or a request's start and
    its first event)."""
    gaps = []
    while time.monotonic() < until:
        last = time.monotonic()
        body = {"task": "base", "prompt": "w1 x1", "max_new_tokens": 64, "stream": True}
        with c.stream("POST", "/v1/generate", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    now = time.monotonic()
                    gaps.append(now - last)
                    last = now
    return gaps


def test_streams_flow_while_another_process_holds_the_store_lock(server):
    lock = server.runtime.store.root / ".lock"
    holder = subprocess.Popen(  # holds the store lock until told (or 120 s)
        [sys.executable, "-c", (f"import fcntl,sys,select;f=open({str(lock)!r},'a+');fcntl.flock(f,fcntl.LOCK_EX);"
                               "print('locked',flush=True);select.select([sys.stdin],[],[],120)")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with httpx.Client(base_url=server.url, timeout=60) as c:
            r = c.post("/v1/tasks", json={"task": "during-lock", "examples": EXAMPLES, "method": "retrieve"})
            assert r.status_code == 202, r.text
            job_id = r.json()["id"]
            runner = server.runtime.registration.runner
            deadline = time.monotonic() + 60
            while runner.journal._busy is None or runner.journal._busy.done():  # until its commit waits on the lock
                assert time.monotonic() < deadline and holder.poll() is None
                time.sleep(0.05)
            gaps = stream_gaps(c, time.monotonic() + STREAM_S)
            # the job could not commit while the lock was held: it was waiting all along
            assert holder.poll() is None
            assert c.get(f"/v1/jobs/{job_id}").json()["status"] in ("queued", "running")
            # blocked, the engine would give nothing for all of STREAM_S; the bound leaves room for a
            # slow, shared host
            assert len(gaps) > 20 and max(gaps) < STREAM_S / 2, f"a stream stalled for {max(gaps):.1f}s"
            holder.stdin.write("go\n")
            holder.stdin.flush()
            holder.wait(10)
            deadline = time.monotonic() + 30
            while (job := c.get(f"/v1/jobs/{job_id}").json())["status"] in ("queued", "running"):
                assert time.monotonic() < deadline, json.dumps(job)
                time.sleep(0.1)
            assert job["status"] == "succeeded"
    finally:
        holder.kill()
        holder.wait()
