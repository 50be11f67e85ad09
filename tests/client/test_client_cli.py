"""The client CLI commands through click's CliRunner, over a scripted server."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
import httpx
import pytest
from click.testing import CliRunner, Result

from client import cli
from tests.support.client_fakes import GEN, TASK, FakeServer, err, job, ok, sse


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeServer:
    server = FakeServer()
    built: list[dict[str, Any]] = []

    def factory(**kwargs: Any):
        built.append(kwargs)
        return server.client(**kwargs)

    monkeypatch.setattr(cli, "_client_factory", factory)
    server.built = built  # type: ignore[attr-defined]
    return server


def invoke(command: click.Command, *args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(command, list(args), env=env or {}, catch_exceptions=False)


def test_generate_plain_and_json(fake: FakeServer) -> None:
    fake.on("POST", "/v1/generate", ok(GEN))
    result = invoke(cli.generate, "--task", "reverse", "abc", "--max-new-tokens", "5", "--temperature", "0.7")
    assert result.exit_code == 0, result.output
    assert result.stdout == "cba\n"
    assert fake.last.body == {
        "task": "reverse",
        "prompt": "abc",
        "max_new_tokens": 5,
        "temperature": 0.7,
        "stream": False,
    }
    result = invoke(cli.generate, "--task", "reverse", "abc", "--json")
    assert json.loads(result.stdout) == GEN


def test_generate_stream(fake: FakeServer) -> None:
    fake.on(
        "POST",
        "/v1/generate",
        sse(
            {"id": "g", "task": "t", "text": "hel", "finish_reason": None},
            {"id": "g", "task": "t", "text": "lo", "finish_reason": "stop"},
        ),
    )
    result = invoke(cli.generate, "--task", "t", "p", "--stream")
    assert result.exit_code == 0 and result.stdout == "hello\n"
    assert fake.last.body["stream"] is True
    result = invoke(cli.generate, "--task", "t", "p", "--stream", "--json")
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [line["text"] for line in lines] == ["hel", "lo"] and lines[-1]["finish_reason"] == "stop"


def test_url_and_api_key_options_and_env(fake: FakeServer) -> None:
    fake.on("GET", "/v1/tasks", ok({"data": []}))
    invoke(cli.tasks, "list", "--url", "http://lb:8080", "--api-key", "k1")
    invoke(cli.tasks, "list", env={"POLYSERVE_URL": "http://env:9", "POLYSERVE_API_KEY": "k2"})
    invoke(cli.tasks, "list")
    assert fake.built == [  # type: ignore[attr-defined]
        {"base_url": "http://lb:8080", "api_key": "k1"},
        {"base_url": "http://env:9", "api_key": "k2"},
        {"base_url": "http://127.0.0.1:8000", "api_key": None},
    ]


def test_tasks_list_and_show(fake: FakeServer) -> None:
    fake.on("GET", "/v1/tasks", ok({"data": [TASK, {"id": "other", "status": "training"}]}))
    fake.on("GET", "/v1/tasks/reverse", ok(TASK))
    result = invoke(cli.tasks, "list")
    header, *rows = result.stdout.splitlines()
    assert header.split() == ["ID", "STATUS", "METHOD", "VERSION", "PARAMS", "CREATED", "QUALITY", "DESCRIPTION"]
    assert rows[0].split()[:5] == ["reverse", "ready", "routing", "2", "4096"]
    assert "2024-05-01 12:00:00Z" in rows[0] and rows[1].split()[:3] == ["other", "training", "-"]
    assert [t["id"] for t in json.loads(invoke(cli.tasks, "list", "--json").stdout)] == ["reverse", "other"]
    shown = invoke(cli.tasks, "show", "reverse")
    assert "skills: " in shown.stdout and "2024-05-01 12:00:00Z" in shown.stdout
    assert json.loads(invoke(cli.tasks, "show", "reverse", "--json").stdout) == TASK


def test_jobs_show_and_cancel(fake: FakeServer) -> None:
    fake.on(
        "GET",
        "/v1/jobs/job_123",
        ok(
            job(
                status="failed",
                progress=0.3,
                metrics={"loss": 2.5},
                error={"type": "diverged", "message": "loss is nan"},
            )
        ),
    )
    fake.on(
        "GET", "/v1/jobs/job_123/events", ok({"data": [{"created_at": 0, "level": "warn", "message": "nan"}]})
    )
    fake.on("POST", "/v1/jobs/job_123/cancel", ok(job(status="cancelled")))
    out = invoke(cli.jobs, "show", "job_123", "--events").stdout
    assert "status:" in out and "failed" in out and "30%" in out and "loss:" in out and "2.5" in out
    assert "error: diverged: loss is nan" in out and "1970-01-01 00:00:00Z  warn" in out
    data = json.loads(invoke(cli.jobs, "show", "job_123", "--json").stdout)
    assert data["status"] == "failed" and "events" not in data
    result = invoke(cli.jobs, "cancel", "job_123")
    assert result.exit_code == 0 and result.stdout == "job job_123: cancelled\n"
    assert json.loads(invoke(cli.jobs, "cancel", "job_123", "--json").stdout)["status"] == "cancelled"


@pytest.fixture
def examples(tmp_path: Path) -> Path:
    path = tmp_path / "ex.jsonl"
    path.write_text("\n".join(json.dumps({"input": s, "output": s[::-1]}) for s in ["ab", "abc", "xyz"]))
    return path


def test_register_no_wait(fake: FakeServer, examples: Path) -> None:
    fake.on("POST", "/v1/tasks", ok(job(), status=202))
    result = invoke(
        cli.register,
        "--task",
        "reverse",
        "--examples",
        str(examples),
        "--method",
        "mu",
        "--steps",
        "20",
        "--seed",
        "1",
    )
    assert result.exit_code == 0 and "job job_123 queued" in result.stdout
    assert fake.last.body["method"] == "mu" and fake.last.body["steps"] == 20 and fake.last.body["seed"] == 1
    assert len(fake.last.body["examples"]) == 3
    data = json.loads(invoke(cli.register, "--task", "reverse", "--examples", str(examples), "--json").stdout)
    assert data["id"] == "job_123"


def test_register_wait_shows_progress_and_metrics(fake: FakeServer, examples: Path) -> None:
    fake.on("POST", "/v1/tasks", ok(job(), status=202))
    fake.on(
        "GET",
        "/v1/jobs/job_123",
        ok(job(status="running", progress=0.25, metrics={"loss": 1.5})),
        ok(job(status="running", progress=0.75, metrics={"loss": 0.8})),
        ok(job(status="succeeded", progress=1.0, metrics={"loss": 0.2, "eval_exact_match": 0.9})),
    )
    result = invoke(
        cli.register, "--task", "reverse", "--examples", str(examples), "--wait", "--poll-interval", "0.5"
    )
    assert result.exit_code == 0, result.output
    assert "reverse [running]" in result.stderr and "100%" in result.stderr and "loss=" in result.stderr
    assert "succeeded" in result.stdout and "eval_exact_match: 0.9" in result.stdout
    assert fake.sleeps == [0.5, 0.5]


def test_register_wait_json_and_failure_exit_code(fake: FakeServer, examples: Path) -> None:
    fake.on("POST", "/v1/tasks", ok(job(), status=202))
    fake.on(
        "GET", "/v1/jobs/job_123", ok(job(status="failed", error={"type": "oom", "message": "no memory"}))
    )
    result = invoke(cli.register, "--task", "reverse", "--examples", str(examples), "--wait", "--json")
    assert result.exit_code == 1 and result.stderr == ""
    assert json.loads(result.stdout)["error"]["type"] == "oom"


@pytest.mark.parametrize(
    ("answer", "needle"),
    [
        (err(404, "not_found", "task 'nope' not found"), "404 not_found: task 'nope' not found"),
        (err(401, "unauthorized", "missing key"), "POLYSERVE_API_KEY"),
        (err(500, "internal", "bug"), "500 internal: bug"),
        (
            ok({"error": {"type": "task_not_ready", "message": "training", "job_id": "job_5"}}, 409),
            "polyserve jobs show job_5",
        ),
    ],
)
def test_errors_are_one_line_on_stderr(fake: FakeServer, answer, needle: str) -> None:
    fake.on("GET", "/v1/tasks/nope", answer)
    result = invoke(cli.tasks, "show", "nope")
    assert result.exit_code == 1 and result.stdout == ""
    assert needle in result.stderr and "Traceback" not in result.stderr


def test_connection_and_input_errors(fake: FakeServer, examples: Path, tmp_path: Path) -> None:
    fake.on("GET", "/v1/tasks", httpx.ConnectError("refused"))
    result = invoke(cli.tasks, "list")
    assert result.exit_code == 1 and "cannot reach the server at http://127.0.0.1:8000" in result.stderr
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    result = invoke(cli.register, "--task", "reverse", "--examples", str(empty))
    assert result.exit_code == 2 and "examples must not be empty" in result.stderr
    result = invoke(cli.generate, "--task", "Not Valid", "p")
    assert result.exit_code == 2 and "task id" in result.stderr


def test_client_package_is_standalone() -> None:
    """client/ imports only httpx, click, tqdm and the stdlib: never the server or training code."""
    import subprocess
    import sys

    code = (
        "import sys, client, client.cli; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "{'server', 'training', 'adapters_store', 'torch', 'transformers', 'fastapi'}); "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_tasks_show_prints_every_field_the_server_sends(fake: FakeServer) -> None:
    """A field the client type does not know (`updated_at` when the server added it, or anything
    later) is printed, timestamps made readable, and never crashes `tasks show` / `jobs show`."""
    task = {**TASK, "updated_at": 1714568400.0, "owner": "alice", "brand_new": {"x": 1}}
    fake.on("GET", "/v1/tasks/reverse", ok(task))
    result = invoke(cli.tasks, "show", "reverse")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "updated_at: " in out and "2024-05-01 13:00:00Z" in out
    assert "owner:" in out and "alice" in out and 'brand_new:' in out and '{"x":1}' in out
    fake.on("GET", "/v1/jobs/job_123", ok(job(live_version=2, brand_new="yes", updated_at=0)))
    out = invoke(cli.jobs, "show", "job_123").stdout
    assert "live_version:" in out and "brand_new:" in out and "yes" in out
    assert "updated_at:" in out and "1970-01-01 00:00:00Z" in out


def test_tasks_show_prints_the_prompt_template_on_one_line(fake: FakeServer) -> None:
    task = {**TASK, "prompt_format": "input-output", "prompt_template": "Input: {input}\nOutput:"}
    fake.on("GET", "/v1/tasks/reverse", ok(task))
    out = invoke(cli.tasks, "show", "reverse").stdout
    assert "prompt_format:" in out and "input-output" in out
    (line,) = [x for x in out.splitlines() if x.startswith("prompt_template:")]
    assert line.endswith('"Input: {input}\\nOutput:"'), line  # the newline as \n, a raw caller can copy it


def test_tasks_list_is_one_line_a_task_with_its_description(fake: FakeServer) -> None:
    said = {**TASK, "description": "Reverse the order of the tokens;\nthen  uppercase."}
    fake.on("GET", "/v1/tasks", ok({"data": [said, {"id": "other", "status": "training"}]}))
    header, *rows = invoke(cli.tasks, "list").stdout.splitlines()
    assert len(rows) == 2 and header.split()[-1] == "DESCRIPTION"
    assert rows[0].startswith("reverse") and rows[0].endswith("Reverse the order of the tokens; then uppercase.")
    assert rows[1].split()[-1] == "-"  # none given


def test_tasks_list_search_is_sent_to_the_server(fake: FakeServer) -> None:
    fake.on("GET", "/v1/tasks", ok({"data": [TASK]}))
    assert invoke(cli.tasks, "list", "--search", "reverse words").exit_code == 0
    assert fake.last.params == {"search": "reverse words"}
    invoke(cli.tasks, "list")
    assert "search" not in fake.last.params


def test_register_sends_a_description_only_when_given(fake: FakeServer, examples: Path) -> None:
    fake.on("POST", "/v1/tasks", ok(job(), status=202))
    said = "Reverse the letters."
    assert invoke(cli.register, "--task", "reverse", "--examples", str(examples), "--description", said).exit_code == 0
    assert fake.last.body["description"] == said
    invoke(cli.register, "--task", "reverse", "--examples", str(examples))
    assert "description" not in fake.last.body
    bad = invoke(cli.register, "--task", "reverse", "--examples", str(examples), "--description", "  ")
    assert bad.exit_code != 0 and "description" in bad.output
    assert "description" not in fake.last.body  # refused before anything was sent


def test_models_list_shows_each_models_description(fake: FakeServer) -> None:
    data = [{"id": "base", "object": "model", "created": 0, "owned_by": "polyserve"},
            {"id": "reverse", "object": "model", "created": 0, "owned_by": "polyserve", "parent": "base",
             "description": "Reverse the order of the tokens."}]
    fake.on("GET", "/v1/models", ok({"object": "list", "data": data}))
    header, *rows = invoke(cli.models, "list").stdout.splitlines()
    assert header.split()[-1] == "DESCRIPTION" and len(rows) == 2
    assert rows[1].startswith("reverse") and rows[1].endswith("Reverse the order of the tokens.")
    assert rows[0].split()[-1] == "-"


MEASURED = {"heldout_exact": 0.875, "sentences_exact": 0.5, "n": 16, "measured": "2026-12-02", "below_floor": False}
WEAK = {"heldout_exact": 0.0, "n": 16, "measured": "2026-12-02", "below_floor": True}


def test_tasks_list_shows_each_shipped_tasks_measured_quality_and_the_floor_mark(fake: FakeServer) -> None:
    shipped = {**TASK, "description": "Reverse the order of the tokens.", "quality": MEASURED}
    weak = {**TASK, "id": "caesar", "description": "Shift every letter by one.", "quality": WEAK}
    fake.on("GET", "/v1/tasks", ok({"data": [shipped, weak, {"id": "mine", "status": "ready", "quality": None}]}))
    header, *rows = invoke(cli.tasks, "list").stdout.splitlines()
    assert len(rows) == 3 and header.split()[-2:] == ["QUALITY", "DESCRIPTION"]
    assert "words 0.88 sentences 0.50" in rows[0] and rows[0].endswith("Reverse the order of the tokens.")
    assert "words 0.00 below floor" in rows[1] and rows[1].endswith("Shift every letter by one.")
    assert rows[2].split()[-2:] == ["-", "-"]  # a registered task: no measured quality, no description


def test_tasks_show_and_models_show_say_the_quality_in_words(fake: FakeServer) -> None:
    fake.on("GET", "/v1/tasks/caesar", ok({**TASK, "id": "caesar", "quality": WEAK}))
    (line,) = [x for x in invoke(cli.tasks, "show", "caesar").stdout.splitlines() if x.startswith("quality:")]
    assert "exact match 0.00 on held-out words (16 inputs each, measured 2026-12-02)" in line
    assert "below the quality floor: installed only on request (POLYSERVE_SHIPPED_BELOW_FLOOR)" in line
    assert json.loads(invoke(cli.tasks, "show", "caesar", "--json").stdout)["quality"] == WEAK  # as sent
    model = {"id": "reverse", "object": "model", "created": 0, "owned_by": "polyserve", "quality": MEASURED}
    fake.on("GET", "/v1/models/reverse", ok(model))
    (line,) = [x for x in invoke(cli.models, "show", "reverse").stdout.splitlines() if x.startswith("quality:")]
    assert "0.88 on held-out words, 0.50 on sentences (16 inputs each" in line and "floor" not in line
    fake.on("GET", "/v1/models", ok({"object": "list", "data": [model]}))
    (row,) = invoke(cli.models, "list").stdout.splitlines()[1:]
    assert "words 0.88 sentences 0.50" in row
