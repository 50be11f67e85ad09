"""The CLI against a real server (tiny backbone, real HTTP): what it prints is what the server
sends, and every API operation has a command.

- The contract: `tasks show` / `jobs show` / `tasks list` / `tasks similar` / `models` / `usage`
  print every field of the server's own answers, and their `--json` is that answer unchanged.
- The parity sweep: the commands below are run through the root `polyserve` group, the requests
  they send are recorded, and each operation of the app's /openapi.json must be among them or in
  ALLOWED_WITHOUT_COMMAND with the reason.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import httpx
import pytest
from click.testing import CliRunner, Result

from client import cli as client_cli
from client.sync import PolyserveClient
from server.cli import main
from tests.support.server_fixtures import build_store, live_server, settings_for, tiny_backbone

ADMIN, ALICE = "root-key-1", "alice-key-1"
EXAMPLES = [{"input": f"w{i} x{i}", "output": f"x{i} w{i}"} for i in range(12)]

# An operation with no CLI command, and why. The sweep fails on any other uncovered operation,
# and on an entry here that a command does cover or that the API no longer has.
ALLOWED_WITHOUT_COMMAND = {
    ("GET", "/health"): "a liveness probe for orchestrators, not a person's command",
    ("GET", "/ready"): "a readiness probe for orchestrators and load balancers",
    ("GET", "/metrics"): "Prometheus scrapes it; a person reads it in Prometheus or with curl",
    ("POST", "/v1/completions"): "OpenAI-compatible: the `openai` client is its CLI; `generate` covers generation",
    ("POST", "/v1/chat/completions"): "OpenAI-compatible: the `openai` client is its CLI",
    ("POST", "/v1/responses"): "OpenAI's Responses API: the `openai` client and agent frameworks are its callers",
    ("POST", "/tokenize"): "vLLM-compatible utility route, for vLLM's clients and benchmarks",
    ("POST", "/detokenize"): "vLLM-compatible utility route, for vLLM's clients and benchmarks",
    ("GET", "/version"): "vLLM-compatible; `polyserve --version` prints the installed version",
}


class Recorder(httpx.HTTPTransport):
    """A real transport that notes each request's method and path."""

    def __init__(self, seen: list[tuple[str, str]]) -> None:
        super().__init__()
        self.seen = seen

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.seen.append((request.method, request.url.path))
        return super().handle_request(request)


class Env:
    def __init__(self, url: str, seen: list[tuple[str, str]], tmp: Path) -> None:
        self.url, self.seen, self.tmp = url, seen, tmp
        self.http = httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {ADMIN}"})

    def run(self, *args: str, key: str = ADMIN, ok: bool = True) -> Result:
        env = {"POLYSERVE_URL": self.url, "POLYSERVE_API_KEY": key}
        result = CliRunner().invoke(main, list(args), env=env, catch_exceptions=False)
        if ok:
            assert result.exit_code == 0, (args, result.output)
        return result

    def get(self, path: str, **params: Any) -> Any:
        r = self.http.get(path, params=params)
        assert r.status_code == 200, r.text
        return r.json()


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    root = tmp_path_factory.mktemp("cli-contract")
    build_store(root / "store")
    examples = root / "examples.jsonl"
    examples.write_text("".join(json.dumps(e) + "\n" for e in EXAMPLES))
    settings = settings_for(root, api_keys=[f"alice:{ALICE}"], admin_keys=[f"root:{ADMIN}"], warmup=False)
    seen: list[tuple[str, str]] = []

    def factory(**kwargs: Any) -> PolyserveClient:
        return PolyserveClient(transport=Recorder(seen), **kwargs)

    with live_server(settings, tiny_backbone()) as srv, pytest.MonkeyPatch.context() as mp:
        mp.setattr(client_cli, "_client_factory", factory)
        e = Env(srv.url, seen, root)
        e.run("register", "--task", "contract-r", "--examples", str(examples), "--method", "retrieve", "--wait")
        e.run("register", "--task", "contract-t", "--examples", str(examples), "--method", "routing", "--steps", "2",
              "--serve-early", "--shared", "--wait")
        e.examples = examples  # type: ignore[attr-defined]
        e.runtime = srv.runtime  # type: ignore[attr-defined]
        yield e
        e.http.close()


def plain_shows_every_field(out: str, raw: dict[str, Any]) -> None:
    for key in raw:
        assert re.search(rf"^\s*{re.escape(key)}:", out, re.MULTILINE), f"{key!r} not printed:\n{out}"


def test_tasks_show_prints_every_field_of_the_real_task(env: Env) -> None:
    for task in ("contract-r", "contract-t", "alpha"):
        raw = env.get(f"/v1/tasks/{task}")
        assert "updated_at" in raw  # the field that crashed `tasks show` before the client kept raw
        out = env.run("tasks", "show", task).stdout
        plain_shows_every_field(out, raw)
        assert json.loads(env.run("tasks", "show", task, "--json").stdout) == raw


def test_register_flags_reach_the_server(env: Env) -> None:
    retrieved = env.get("/v1/tasks/contract-r")
    assert retrieved["method"] == "retrieve" and retrieved["status"] == "ready"
    trained = env.get("/v1/tasks/contract-t")
    job = env.get(f"/v1/jobs/{trained['job_id']}")
    assert job["status"] == "succeeded" and job["serve_early"] is True
    assert trained["version"] == 2, "serve_early: a retrieved first version, then the trained one"
    # --shared: another tenant sees the admin's task
    ids = {t["id"] for t in json.loads(env.run("tasks", "list", "--json", key=ALICE).stdout)}
    assert "contract-t" in ids and "contract-r" not in ids


def test_jobs_show_prints_every_field_of_the_real_job(env: Env) -> None:
    job_id = env.get("/v1/tasks/contract-t")["job_id"]
    raw = env.get(f"/v1/jobs/{job_id}")
    out = env.run("jobs", "show", job_id, "--events").stdout
    head = {k: v for k, v in raw.items() if k not in ("metrics", "error", "created_at", "started_at",
                                                      "finished_at")}
    plain_shows_every_field(out, head)  # the times print as created/started/finished
    for key in raw["metrics"]:
        assert f"  {key}:" in out
    assert "events:" in out and "succeeded" in out
    assert json.loads(env.run("jobs", "show", job_id, "--json").stdout) == raw
    events = env.get(f"/v1/jobs/{job_id}/events")["data"]
    assert json.loads(env.run("jobs", "show", job_id, "--events", "--json").stdout) == {**raw, "events": events}


def test_lists_are_the_server_lists(env: Env) -> None:
    tasks = env.get("/v1/tasks")["data"]
    assert json.loads(env.run("tasks", "list", "--json").stdout) == tasks
    rows = env.run("tasks", "list").stdout.splitlines()[1:]
    assert [r.split()[0] for r in rows] == [t["id"] for t in tasks]
    models = env.get("/v1/models")
    assert json.loads(env.run("models", "list", "--json").stdout) == {"data": models["data"]}
    assert ({r.split()[0] for r in env.run("models", "list").stdout.splitlines()[1:]}
            == {m["id"] for m in models["data"]})
    one = env.get("/v1/models/alpha")
    assert json.loads(env.run("models", "show", "alpha", "--json").stdout) == one
    shown = env.run("models", "show", "alpha").stdout
    plain_shows_every_field(shown, one)
    assert re.search(r"^created: +\d{4}-\d\d-\d\d \d\d:\d\d:\d\dZ$", shown, re.MULTILINE), shown
    similar = env.get("/v1/tasks/contract-r/similar", k=3)
    assert json.loads(env.run("tasks", "similar", "contract-r", "-k", "3", "--json").stdout) == similar
    out = env.run("tasks", "similar", "contract-r", "-k", "3").stdout
    assert [r.split()[0] for r in out.splitlines()[1:]] == [d["id"] for d in similar["data"]]


def test_usage(env: Env) -> None:
    env.run("generate", "--task", "alpha", "w1 x1", "--max-new-tokens", "3", key=ALICE)
    raw = env.get("/v1/usage", window=600)
    got = json.loads(env.run("usage", "--window", "600", "--json").stdout)
    assert got == raw and any(r["tenant"] == "alice" and r["task"] == "alpha" for r in raw["data"])
    out = env.run("usage", "--window", "600").stdout
    assert out.splitlines()[0].split() == ["TENANT", "TASK", "REQUESTS", "PROMPT_TOKENS", "COMPLETION_TOKENS",
                                           "REFUSED"]
    assert any(line.split()[:2] == ["alice", "alpha"] for line in out.splitlines())
    # a tenant key gets what the server gives a tenant (its own rows, or a refusal): the CLI only relays it
    mine = env.run("usage", "--json", key=ALICE, ok=False)
    direct = httpx.get(f"{env.url}/v1/usage", headers={"Authorization": f"Bearer {ALICE}"})
    if direct.status_code == 200:
        assert mine.exit_code == 0 and json.loads(mine.stdout) == direct.json()
    else:
        assert mine.exit_code == 1 and direct.json()["error"]["message"] in mine.stderr


def test_import_lora_over_http_then_delete(env: Env, tmp_path: Path) -> None:
    from adapters_store.interop.peft_io import export_peft_lora

    store = env.runtime.registry.store  # type: ignore[attr-defined]
    export_peft_lora(store, "gamma", tmp_path / "peft", base_model=store.inventory_info().backbone_name)
    both = env.run("import-lora", str(tmp_path / "peft"), "--task", "gamma-http", "--url", env.url,
                   "--store", str(tmp_path), ok=False)
    assert both.exit_code == 2 and "exclude each other" in both.output
    answer = json.loads(env.run("import-lora", str(tmp_path / "peft"), "--task", "gamma-http", "--url", env.url).stdout)
    assert answer["task"]["id"] == "gamma-http" and answer["task"]["kind"] == "lora"
    assert answer["task"] == env.get("/v1/tasks/gamma-http")
    a = env.run("generate", "--task", "gamma", "abc", "--max-new-tokens", "6").stdout
    assert env.run("generate", "--task", "gamma-http", "abc", "--max-new-tokens", "6").stdout == a
    assert env.run("tasks", "delete", "gamma-http").stdout == "task gamma-http: deleted\n"
    assert env.http.get("/v1/tasks/gamma-http").status_code == 404


def test_jobs_cancel(env: Env) -> None:
    out = json.loads(env.run("register", "--task", "contract-c", "--examples", str(env.examples),  # type: ignore[attr-defined]
                             "--steps", "5000", "--json").stdout)
    result = env.run("jobs", "cancel", out["id"], "--json")
    assert json.loads(result.stdout)["id"] == out["id"]
    assert PolyserveClient(env.url, ADMIN).wait_for_job(out["id"], poll_interval=0.05, timeout=60).status == "cancelled"


def operation_of(method: str, path: str, templates: dict[tuple[str, str], re.Pattern[str]]) -> tuple[str, str]:
    for (m, template), pattern in templates.items():
        if m == method and pattern.fullmatch(path):
            return m, template
    raise AssertionError(f"the CLI sent {method} {path}, which is no operation of /openapi.json")


def test_every_api_operation_has_a_command(env: Env) -> None:
    """Runs after the tests above in this module (pytest keeps file order), so `seen` holds every
    request their commands sent; it re-runs the cheap ones itself so it also passes alone."""
    for args in (("tasks", "list"), ("tasks", "show", "alpha"), ("tasks", "similar", "alpha"), ("models", "list"),
                 ("models", "show", "alpha"), ("usage",),
                 ("generate", "--task", "alpha", "w1", "--max-new-tokens", "2")):
        env.run(*args)
    if not any(p.startswith("/v1/jobs/") and p.endswith("/cancel") for _, p in env.seen):
        test_jobs_cancel(env)
    if not any(m == "DELETE" for m, _ in env.seen):
        test_import_lora_over_http_then_delete(env, env.tmp / "sweep")
    job_id = env.get("/v1/tasks/contract-t")["job_id"]
    env.run("jobs", "show", job_id, "--events")

    spec = httpx.get(f"{env.url}/openapi.json").json()
    templates = {
        (m.upper(), path): re.compile("".join("[^/]+" if part.startswith("{") else re.escape(part)
                                              for part in re.split(r"(\{[^}]+\})", path)))
        for path, ops in spec["paths"].items() for m in ops if m in ("get", "post", "put", "patch", "delete")
    }
    covered = {operation_of(m, p, templates) for m, p in env.seen}
    missing = sorted(set(templates) - covered - set(ALLOWED_WITHOUT_COMMAND))
    assert not missing, f"API operations with no CLI command (add one, or allow-list it with the reason): {missing}"
    stale = sorted(set(ALLOWED_WITHOUT_COMMAND) - set(templates))
    assert not stale, f"allow-listed operations the API no longer has: {stale}"
    needless = sorted(set(ALLOWED_WITHOUT_COMMAND) & covered)
    assert not needless, f"allow-listed operations a command does cover: {needless}"


def leaf_commands(group: click.Group, prefix: str = "polyserve") -> list[str]:
    found: list[str] = []
    for name, command in group.commands.items():
        path = f"{prefix} {name}"
        found += leaf_commands(command, path) if isinstance(command, click.Group) else [path]
    return found


def test_the_cli_page_has_every_command_with_an_example() -> None:
    section = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()
    row = r"^\| `(polyserve [a-z -]+?)`.*\| `(polyserve [^`]+)` \|$"
    rows = {m[0]: m[1] for m in re.findall(row, section, re.MULTILINE)}
    commands = leaf_commands(main)
    assert len(commands) > 20
    for command in commands:
        assert command in rows, f"docs/cli.md's table has no row for `{command}`"
        assert rows[command].startswith(command), f"the example of `{command}` runs `{rows[command]}`"
