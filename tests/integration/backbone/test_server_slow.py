"""Integration on the real default backbone (SmolLM2-135M-Instruct) with the shipped inventory."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.support.server_fixtures import live_server, settings_for, shipped_inventory_available

pytestmark = pytest.mark.slow


@pytest.mark.skipif(not shipped_inventory_available(), reason="no shipped default inventory yet "
                    "(training/default_inventory/inventory/inventory.json is missing)")
def test_shipped_tasks_answer_correctly_through_generate(tmp_path):
    from training.suite import examples, parse_task

    settings = settings_for(tmp_path, backbone="default", max_batch_rows=16)
    with live_server(settings) as srv:  # an empty store: the server installs the shipped inventory
        records = [r for r in srv.runtime.registry.list() if r.status == "ready"]
        tasks = []
        for r in records:
            try:
                tasks.append(parse_task(r.id))
            except ValueError:
                continue
        tasks = sorted(tasks, key=lambda t: len(t.primitives))[:3]
        assert tasks, "the shipped inventory holds no suite task"
        cases = [(t.name, ex) for t in tasks for ex in examples(t, 4, seed=0, split="test")]

        async def ask():
            async with httpx.AsyncClient(base_url=srv.url, timeout=300) as c:
                return await asyncio.gather(*(
                    c.post("/v1/generate", json={"task": name, "prompt": ex.input, "max_new_tokens": 32})
                    for name, ex in cases))

        answers = [r.json() for r in asyncio.run(ask())]
    correct = [a["text"].strip() == ex.output for a, (_, ex) in zip(answers, cases, strict=True)]
    assert all(a["finish_reason"] in ("stop", "length") for a in answers)
    assert sum(correct) >= len(cases) / 2, list(zip([ex.output for _, ex in cases], [a["text"] for a in answers]))
