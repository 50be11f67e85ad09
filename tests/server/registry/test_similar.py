"""Task search by routing row: the score, the index (exact and projected), the route, the client
CLI and the routing plot's nearest-task data."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from click.testing import CliRunner

from adapters_store.lora.similar import centred, rank_exact, top_k, unit
from adapters_store.store.materialize import task_weights
from server.registry.similar_index import NotRouted, RoutingIndex
from tests.support.server_fixtures import build_store, live_server, put_task, settings_for, tiny_backbone


def weights_of(logits: torch.Tensor) -> torch.Tensor:
    p = torch.sigmoid(logits)
    return p / p.sum(-1, keepdim=True)


# -- the score ---------------------------------------------------------------------------------
def test_score_is_the_cosine_of_the_deviations_from_mu():
    gen = torch.Generator().manual_seed(0)
    q = weights_of(torch.randn(3, 2, 4, generator=gen) * 3)
    near = weights_of(torch.logit(q.clamp(1e-4, 1 - 1e-4)) + 0.05 * torch.randn(3, 2, 4, generator=gen))
    rows = torch.stack([weights_of(torch.randn(3, 2, 4, generator=gen) * 3) for _ in range(6)] + [near, q])
    ranked = rank_exact(q, rows, 3, exclude=7)
    assert ranked[0][0] == 6 and ranked[0][1] > 0.95  # the perturbed copy is the nearest
    assert [s for _, s in ranked] == sorted((s for _, s in ranked), reverse=True)
    assert rank_exact(q, q[None], 1)[0][1] == pytest.approx(1.0)
    mu = torch.full((3, 2, 4), 0.25)
    assert rank_exact(mu, rows, 1)[0][1] == pytest.approx(0.0, abs=1e-6)  # μ has no direction
    raw = torch.nn.functional.cosine_similarity(q.flatten(), rows[0].flatten(), dim=0)
    centred_score = float(unit(centred(rows[0])) @ unit(centred(q)))
    assert centred_score < raw  # raw rows share the simplex's mean: centring takes it out


def test_top_k_excludes_the_query_and_breaks_ties_by_index():
    scores = torch.tensor([0.5, 0.9, 0.9, 0.1])
    assert top_k(scores, 2) == [(1, pytest.approx(0.9)), (2, pytest.approx(0.9))]
    assert [i for i, _ in top_k(scores, 10, exclude=1)] == [2, 0, 3]
    assert top_k(scores[:1], 3, exclude=0) == []


# -- the index ---------------------------------------------------------------------------------
def twin_store(root, n_extra: int = 0):
    """alpha..delta, alpha-twin (alpha's row, slightly moved) and n_extra random tasks."""
    store = build_store(root)
    logits = store.load_routing("alpha")
    store.put_routing("alpha-twin",
                      logits + 0.05 * torch.randn(logits.shape, generator=torch.Generator().manual_seed(5)))
    for i in range(n_extra):
        put_task(store, f"extra-{i:03d}", seed=100 + i)
    return store


def exact_answer(store, task: str, k: int) -> list[tuple[str, float]]:
    info = store.inventory_info()
    ids = sorted(r.id for r in store.list_tasks() if r.kind == "routing")
    rows = torch.stack([task_weights(info, store.load_routing(t).float()) for t in ids])
    return [(ids[i], s) for i, s in rank_exact(rows[ids.index(task)], rows, k, exclude=ids.index(task))]


def test_index_small_is_exact_and_follows_the_store(tmp_path):
    store = twin_store(tmp_path / "store")
    index = RoutingIndex(store, store.inventory_info(), max_staleness=0)
    got = index.similar("alpha", 3)
    want = exact_answer(store, "alpha", 3)
    assert [t for t, _ in got] == [t for t, _ in want] and got[0][0] == "alpha-twin"
    assert [s for _, s in got] == pytest.approx([s for _, s in want], abs=1e-5)
    put_task(store, "alpha-twin", seed=77)  # rewritten: no longer alpha's twin
    rewritten = index.similar("alpha", 10)
    assert rewritten == [(t, pytest.approx(s, abs=1e-5)) for t, s in exact_answer(store, "alpha", 10)]
    assert dict(rewritten)["alpha-twin"] < 0.9
    store.delete_task("beta")
    assert "beta" not in [t for t, _ in index.similar("alpha", 10)]
    store.put_lora("plain", {"x": torch.zeros(1)}, method="mu")
    assert "plain" not in [t for t, _ in index.similar("alpha", 10)]
    with pytest.raises(NotRouted):
        index.similar("plain", 3)
    from adapters_store.store.errors import TaskNotFound

    with pytest.raises(TaskNotFound):
        index.similar("nope", 3)


def test_a_query_deleted_or_rewritten_since_the_refresh_is_answered_from_the_store(tmp_path):
    from adapters_store.store.errors import TaskNotFound

    store = twin_store(tmp_path / "store")
    index = RoutingIndex(store, store.inventory_info(), max_staleness=3600)  # answers from its last refresh
    assert index.similar("alpha-twin", 1)[0][0] == "alpha"
    put_task(store, "alpha-twin", seed=77)  # rewritten: its old row's file is gone
    assert index.similar("alpha-twin", 10) == [(t, pytest.approx(s, abs=1e-5))
                                               for t, s in exact_answer(store, "alpha-twin", 10)]
    store.delete_task("alpha-twin")
    with pytest.raises(TaskNotFound):
        index.similar("alpha-twin", 3)


def test_a_query_whose_row_cannot_be_read_is_an_error_not_a_missing_task(tmp_path, monkeypatch):
    store = twin_store(tmp_path / "store")
    index = RoutingIndex(store, store.inventory_info(), max_staleness=3600)
    assert index.similar("alpha", 1)  # indexed while its row could be read

    def unreadable(record):
        raise OSError("a damaged row file")
    monkeypatch.setattr(index, "_exact", unreadable)
    with pytest.raises(OSError, match="damaged"):
        index.similar("alpha", 1)


def test_index_projected_shortlist_keeps_exact_scores(tmp_path):
    """Rows projected to fewer dimensions than they have and a shortlist shorter than the
    library: the answer's scores are still exact, and a clear nearest neighbour is found."""
    store = twin_store(tmp_path / "store", n_extra=40)
    info = store.inventory_info()
    d = len(info.layer_names) * info.spec.n_heads * info.spec.n_skills
    index = RoutingIndex(store, info, dim=d // 2, shortlist=8, max_staleness=0)
    assert index.P is not None
    got = index.similar("alpha", 3)
    want = dict(exact_answer(store, "alpha", 100))
    assert got[0][0] == "alpha-twin"
    for task, score in got:
        assert score == pytest.approx(want[task], abs=1e-5)


# -- the route, the client CLI, the plot -------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("similar")
    store = twin_store(root / "store")
    store.put_lora("plain", {"x": torch.zeros(1)}, method="mu")
    with live_server(settings_for(root), tiny_backbone()) as srv:
        yield srv


def test_route_ranks_by_routing_row(server):
    store = server.runtime.registry.store
    with httpx.Client(base_url=server.url, timeout=30) as http:
        r = http.get("/v1/tasks/alpha/similar", params={"k": 3})
        assert r.status_code == 200, r.text
        data = r.json()["data"]
        want = exact_answer(store, "alpha", 3)
        assert [d["id"] for d in data] == [t for t, _ in want]
        assert [d["score"] for d in data] == pytest.approx([s for _, s in want], abs=1e-5)
        assert len(http.get("/v1/tasks/alpha/similar").json()["data"]) == 4  # k=5, 4 other routed tasks
        for path, status in (("/v1/tasks/nope/similar", 404), ("/v1/tasks/plain/similar", 409),
                             ("/v1/tasks/base/similar", 404), ("/v1/tasks/alpha/similar?k=0", 422),
                             ("/v1/tasks/alpha/similar?k=101", 422)):
            got = http.get(path)
            assert got.status_code == status, (path, got.text)
            assert "error" in got.json()


def test_client_cli_tasks_similar(server):
    from client.cli import tasks

    res = CliRunner().invoke(tasks, ["similar", "alpha", "-k", "2", "--url", server.url, "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["data"][0]["id"] == "alpha-twin"
    res = CliRunner().invoke(tasks, ["similar", "alpha", "-k", "2", "--url", server.url])
    assert res.exit_code == 0 and "alpha-twin" in res.output


def test_routing_plot_writes_the_nearest_tasks(tmp_path):
    from training import cli

    store = twin_store(tmp_path / "store")
    res = CliRunner().invoke(cli.routing_plot, ["--store", str(store.root), "--out", str(tmp_path / "p.png")])
    assert res.exit_code == 0, res.output
    near = json.loads((tmp_path / "p.similar.json").read_text())
    assert near["alpha"][0]["id"] == "alpha-twin" and len(near["alpha"]) == 4
    assert near["alpha"] == [{"id": t, "score": pytest.approx(s, abs=1e-5)} for t, s in exact_answer(store, "alpha", 5)]
