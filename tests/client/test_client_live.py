"""The Python client and the client CLI against a live server on loopback (tiny model)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from client import AsyncPolyserveClient, PolyserveClient
from client.errors import Conflict, NotFound, Overloaded, Unauthorized, ValidationError
from tests.support.deploy_utils import dashboard_metric_names, exposition_metric_names
from tests.support.server_fixtures import build_store, live_server, settings_for, tiny_backbone

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = [{"input": f"w{i} x{i}", "output": f"x{i} w{i}"} for i in range(10)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("client-live")
    build_store(root / "store")
    with live_server(settings_for(root), backbone=tiny_backbone()) as srv:
        yield srv


@pytest.fixture
def client(server):
    with PolyserveClient(server.url, timeout=30) as c:
        yield c


def test_generate_stream_and_openai_shapes(client):
    gen = client.generate("alpha", "hello", max_new_tokens=8)
    assert gen.task == "alpha" and gen.finish_reason in ("stop", "length") and gen.usage.completion_tokens >= 1
    chunks = list(client.generate_stream("alpha", "hello", max_new_tokens=8))
    assert "".join(c.text for c in chunks) == gen.text
    assert client.completions("beta", "hi", max_tokens=4)["choices"][0]["text"] is not None
    chat = client.chat("base", [{"role": "user", "content": "hi"}], max_tokens=4)
    assert chat["choices"][0]["message"]["role"] == "assistant"
    assert {"alpha", "base"} <= {m["id"] for m in client.models()}


def test_tasks_register_wait_events_delete(client):
    assert {"alpha", "beta"} <= {t.id for t in client.list_tasks()}
    assert client.get_task("alpha").status == "ready"
    job = client.register_task("client-made", EXAMPLES, steps=4, seed=0)
    seen = []
    done = client.wait_for_job(job.id, poll_interval=0.05, timeout=120, on_progress=seen.append)
    assert done.status == "succeeded" and seen
    assert any(e.message for e in client.job_events(job.id))
    assert client.generate("client-made", "w1 x1", max_new_tokens=4).task == "client-made"
    client.delete_task("client-made")
    with pytest.raises(NotFound):
        client.get_task("client-made")


def test_error_mapping_against_the_real_server(client):
    with pytest.raises(NotFound):
        client.generate("no-such-task", "x")
    with pytest.raises(ValidationError, match="max_new_tokens"):
        client.generate("alpha", "x", max_new_tokens=0)
    slow = client.register_task("client-slow", EXAMPLES, steps=5000)
    try:
        with pytest.raises(Conflict) as err:
            client.generate("client-slow", "x")
        assert err.value.job_id == slow.id
        with pytest.raises(Conflict):
            client.register_task("client-slow", EXAMPLES)
    finally:
        # queued: the runner has taken it and is still building its adaptation; the cancel is
        # recorded and the job stops before its first slice
        assert client.cancel_job(slow.id).status in ("cancelled", "running", "queued")
        assert client.wait_for_job(slow.id, poll_interval=0.05, timeout=60).status == "cancelled"


def test_async_client(server):
    async def go():
        async with AsyncPolyserveClient(server.url, timeout=30) as c:
            gen = await c.generate("gamma", "abc", max_new_tokens=6)
            text = "".join([chunk.text async for chunk in c.generate_stream("gamma", "abc", max_new_tokens=6)])
            return gen.text, text, await c.ready()

    sync_text, streamed, ready = asyncio.run(go())
    assert sync_text == streamed and ready


def test_api_key_and_retry_on_429_honouring_retry_after(tmp_path):
    build_store(tmp_path / "store")
    settings = settings_for(tmp_path, api_keys=["sekret"], max_queue=1, max_batch_rows=1)
    with live_server(settings, backbone=tiny_backbone()) as srv:
        with PolyserveClient(srv.url, timeout=30) as anonymous, pytest.raises(Unauthorized):
            anonymous.list_tasks()
        sleeps: list[float] = []
        with PolyserveClient(srv.url, api_key="sekret", max_retries=2, sleep=sleeps.append) as c:
            assert c.get_task("alpha").id == "alpha"
            # one row running and one waiting (limits of 1): a third concurrent request gets 429
            import threading
            import time

            other = PolyserveClient(srv.url, api_key="sekret", max_retries=10, timeout=60)  # fills the server
            engine = srv.runtime.engine
            busy = []
            for state in ("running", "waiting"):  # one row running, then one request waiting
                busy.append(threading.Thread(target=lambda: other.generate("alpha", "x" * 20, max_new_tokens=400)))
                busy[-1].start()
                deadline = time.time() + 10
                while getattr(engine, state) == 0 and time.time() < deadline:
                    time.sleep(0.002)
            with pytest.raises(Overloaded) as err:
                c.generate("beta", "y", max_new_tokens=2)
            for t in busy:
                t.join()
            other.close()
        assert err.value.retry_after is not None and err.value.retry_after >= 1
        assert sleeps == [err.value.retry_after] * 2  # waited what the server asked, twice


def run_cli(server, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "POLYSERVE_URL": server.url}
    return subprocess.run([sys.executable, "-m", "server.cli", *args], env=env, capture_output=True, text=True,
                          timeout=180, cwd=ROOT, check=False)


def test_cli_register_with_progress_then_generate(server, tmp_path):
    path = tmp_path / "ex.jsonl"
    path.write_text("\n".join(json.dumps(e) for e in EXAMPLES) + "\n")
    reg = run_cli(server, "register", "--task", "cli-made", "--examples", str(path), "--steps", "4", "--wait")
    assert reg.returncode == 0, reg.stderr
    assert "succeeded" in reg.stdout + reg.stderr
    out = run_cli(server, "generate", "--task", "cli-made", "--json", "w2 x2")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["task"] == "cli-made"
    listing = json.loads(run_cli(server, "tasks", "list", "--json").stdout)
    assert "cli-made" in {t["id"] for t in listing}
    missing = run_cli(server, "tasks", "show", "nope")
    assert missing.returncode != 0 and "not found" in missing.stderr


def test_dashboard_queries_only_metrics_the_server_exports(client, server):
    client.generate("alpha", "hello", max_new_tokens=2)
    import httpx

    exported = exposition_metric_names(httpx.get(f"{server.url}/metrics").text)
    dashboard = json.loads((ROOT / "docker/grafana/dashboards/polyserve.json").read_text())
    queried = dashboard_metric_names(dashboard)
    assert queried and queried <= exported, sorted(queried - exported)
