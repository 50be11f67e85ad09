"""Integration (slow): register a held-out procedural task from 16 examples over HTTP on the real
default backbone with the shipped inventory; report wall time and accuracy vs zero-shot μ."""

from __future__ import annotations

import time

import httpx
import pytest
import torch

from tests.support.server_fixtures import live_server, settings_for, shipped_inventory_available

pytestmark = pytest.mark.slow


def exact_match(client: httpx.Client, task: str, cases) -> float:
    hits = 0
    for ex in cases:
        r = client.post("/v1/generate", json={"task": task, "prompt": ex.input, "max_new_tokens": 32})
        assert r.status_code == 200, r.text
        hits += r.json()["text"].strip() == ex.output.strip()
    return hits / len(cases)


@pytest.mark.skipif(not shipped_inventory_available(),
                    reason="no shipped default inventory (training/default_inventory)")
def test_register_a_heldout_task_over_http_on_the_default_backbone(tmp_path):
    from training.suite import build_suite, examples

    task = build_suite().heldout_tasks[2]  # first2.rev-chars: fixed choice, not tuned
    train = examples(task, 16, seed=0, split="train")
    test = examples(task, 16, seed=0, split="test")
    with live_server(settings_for(tmp_path, backbone="default")) as srv, \
            httpx.Client(base_url=srv.url, timeout=120) as c:
        info = srv.runtime.store.inventory_info()
        srv.runtime.store.put_routing(
            "mu-zero", torch.zeros(len(info.layer_names), info.spec.n_heads, info.spec.n_skills), method="mu")
        started = time.perf_counter()
        # routing: this test is the trained row's path (auto's choice: tests/integration/backbone)
        job = c.post("/v1/tasks", json={"task": "heldout-new", "seed": 0, "method": "routing",
                                        "examples": [{"input": e.input, "output": e.output} for e in train]})
        assert job.status_code == 202, job.text
        while (state := c.get(f"/v1/jobs/{job.json()['id']}").json())["status"] in ("queued", "running"):
            time.sleep(0.2)
        wall = time.perf_counter() - started
        assert state["status"] == "succeeded", state
        em_new, em_mu = exact_match(c, "heldout-new", test), exact_match(c, "mu-zero", test)
    print(f"\nregistered {task.name} from 16 examples over HTTP in {wall:.1f} s "
          f"(target <= 30 s on 2 idle cores); exact match {em_new:.2f} vs zero-shot mu {em_mu:.2f}")
    assert wall < 300  # the target is ~30 s on an idle machine; CI machines are shared
    assert em_new > em_mu
