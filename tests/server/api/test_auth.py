"""Auth on every /v1 route, enumerated from the app (a new route without auth fails here), and
the key rules: POLYSERVE_API_KEYS for inference, reads and a tenant's own tasks, jobs and usage,
POLYSERVE_ADMIN_KEYS for everything, and what happens when only one of the two is set."""

from __future__ import annotations

import re

import httpx
import pytest

from server.api.api_docs import api_routes, dependency_calls
from server.api.app import create_app
from server.api.deps import require_api_key, require_tenant_key
from tests.support.server_fixtures import build_store, live_server, settings_for, tiny_backbone

OPEN = {"/health", "/ready", "/metrics"}
VLLM_UTILITY = {"/tokenize", "/detokenize", "/version"}  # vLLM's paths, keyed as /v1/* is
# need a key whenever any key is set (with only admin keys: an admin key); a tenant key acts on its own
KEYED = {("POST", "/v1/tasks"), ("DELETE", "/v1/tasks/{task}"), ("POST", "/v1/jobs/{job_id}/cancel"),
         ("GET", "/v1/usage")}


def routes(tmp_path) -> list[tuple[str, str, set]]:
    app = create_app(settings_for(tmp_path))
    return [(m, r.path_format, dependency_calls(r)) for r in api_routes(app) for m in sorted(r.methods)]


def test_every_v1_route_needs_a_key(tmp_path):
    seen = routes(tmp_path)
    for method, path, calls in seen:
        if path in OPEN:
            assert not calls & {require_api_key, require_tenant_key}, path
            continue
        assert path.startswith("/v1/") or path in VLLM_UTILITY, \
            f"{method} {path}: a route outside /v1 that is not health/ready/metrics or vLLM's utilities"
        assert require_api_key in calls or require_tenant_key in calls, f"{method} {path} has no auth"
        assert (require_tenant_key in calls) == ((method, path) in KEYED), f"{method} {path}: key rule"
    assert {p for _, p, _ in seen} >= OPEN and KEYED <= {(m, p) for m, p, _ in seen}


def concrete(path: str) -> str:
    return re.sub(r"\{[^}]+\}", "no-such-thing", path)


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    root = tmp_path_factory.mktemp("auth")
    build_store(root / "store")
    settings = settings_for(root, api_keys=["inf"], admin_keys=["adm"], warmup=False)
    with live_server(settings, tiny_backbone()) as srv:
        yield srv


def send(c: httpx.Client, method: str, path: str, key: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {} if method == "POST" else None
    return c.request(method, concrete(path), json=body, headers=headers)


def test_keys_on_every_route(keyed, tmp_path):
    with httpx.Client(base_url=keyed.url, timeout=30) as c:
        for method, path, _ in routes(tmp_path):
            if path in OPEN:
                assert send(c, method, path, None).status_code == 200, path
                continue
            for key in (None, "wrong", "Bearer"):
                r = send(c, method, path, key)
                assert r.status_code == 401, (method, path, key, r.status_code)
                assert r.headers["www-authenticate"] == "Bearer" and r.json()["error"]
            # both kinds of key set: a tenant key reaches every route (what it may do there is
            # its own tasks, jobs and usage: tests/server/tenancy/test_tenancy_api.py)
            for key in ("inf", "adm"):
                status = send(c, method, path, key).status_code
                assert status not in (401, 403), (method, path, key, status)


@pytest.mark.parametrize(("api", "admin", "expect"), [
    # (inference route without key, admin route without key, admin route with the API key)
    (["inf"], [], (401, 401, "ok")),  # one key list guards everything
    ([], ["adm"], ("ok", 401, None)),  # inference open, mutation needs the admin key
    ([], [], ("ok", "ok", None)),
])
def test_rule_when_only_one_list_is_set(tmp_path, api, admin, expect):
    build_store(tmp_path / "store")
    settings = settings_for(tmp_path, api_keys=api, admin_keys=admin, warmup=False)
    with live_server(settings, tiny_backbone()) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        got = (c.get("/v1/models").status_code, c.delete("/v1/tasks/no-such-thing").status_code,
               c.delete("/v1/tasks/no-such-thing", headers={"Authorization": "Bearer inf"}).status_code)
    norm = tuple("ok" if g not in (401, 403) else g for g in got)
    assert norm[:2] == expect[:2]
    if expect[2] is not None:
        assert norm[2] == expect[2]


def test_openapi_declares_auth_only_when_keys_are_set(tmp_path):
    open_doc = create_app(settings_for(tmp_path)).openapi()
    assert "securitySchemes" not in open_doc.get("components", {})
    keyed_doc = create_app(settings_for(tmp_path, api_keys=["k"])).openapi()
    op = keyed_doc["paths"]["/v1/generate"]["post"]
    assert op["security"] == [{"bearer": []}] and "401" in op["responses"]
    assert "security" not in keyed_doc["paths"]["/metrics"]["get"]
