"""Client-side CLI commands, mounted by the root ``polyserve`` group (server/cli.py).

``generate``, ``register``, ``tasks list|show|similar|delete``, ``jobs show|cancel``, ``models
list|show`` and ``usage`` talk to a running server over HTTP (``import-lora --url``, in
adapters_store/tools/cli.py, through :func:`import_lora_over_http`).  Every command takes
``--url`` (env ``POLYSERVE_URL``), ``--api-key`` (env ``POLYSERVE_API_KEY``) and ``--json``.
Errors print one line on stderr and exit non-zero.

Tests swap :data:`_client_factory` for one that builds a client over a mock transport.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click

from . import _format as fmt
from ._core import DEFAULT_URL, METHODS
from .errors import Conflict, ConnectionFailed, InvalidInput, PolyserveError, Unauthorized
from .sync import PolyserveClient
from .types import Job

__all__ = ["generate", "import_lora_over_http", "jobs", "models", "register", "tasks", "usage"]

_client_factory: Callable[..., PolyserveClient] = PolyserveClient
"""Builds the client from ``base_url=`` and ``api_key=``; replaced by tests."""


def _common(func: Callable[..., Any]) -> Callable[..., Any]:
    """Add ``--url``, ``--api-key`` and ``--json`` to a command."""
    options = [
        click.option(
            "--url",
            envvar="POLYSERVE_URL",
            default=DEFAULT_URL,
            show_default=True,
            help="Server URL (env POLYSERVE_URL).",
        ),
        click.option(
            "--api-key",
            envvar="POLYSERVE_API_KEY",
            default=None,
            help="Bearer API key (env POLYSERVE_API_KEY).",
        ),
        click.option("--json", "as_json", is_flag=True, help="Machine-readable JSON output."),
    ]
    return functools.reduce(lambda f, opt: opt(f), reversed(options), func)


@contextmanager
def _session(url: str, api_key: str | None) -> Iterator[PolyserveClient]:
    """A client whose errors become one-line CLI errors (exit 1; bad input exits 2)."""
    try:
        with _client_factory(base_url=url, api_key=api_key) as client:
            yield client
    except InvalidInput as exc:
        raise click.UsageError(str(exc)) from None
    except ConnectionFailed as exc:
        raise click.ClickException(f"cannot reach the server at {url} ({exc.message})") from None
    except Unauthorized as exc:
        raise click.ClickException(f"{exc} (pass --api-key or set POLYSERVE_API_KEY)") from None
    except Conflict as exc:
        hint = f" (job {exc.job_id}: see `polyserve jobs show {exc.job_id}`)" if exc.job_id else ""
        raise click.ClickException(f"{exc}{hint}") from None
    except PolyserveError as exc:
        raise click.ClickException(str(exc)) from None
    except TimeoutError as exc:
        raise click.ClickException(str(exc)) from None


def _echo_json(value: Any) -> None:
    click.echo(fmt.to_json(value))


# ---- generate -----------------------------------------------------------------------------------


@click.command()
@click.option("--task", required=True, help="Task id (or `base` for the plain backbone).")
@click.argument("prompt")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=None, help="[server default: 64]")
@click.option("--temperature", type=click.FloatRange(min=0.0), default=None, help="0 = greedy.")
@click.option("--top-p", type=click.FloatRange(0.0, 1.0), default=None)
@click.option("--top-k", type=click.IntRange(min=0), default=None)
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--seed", type=int, default=None)
@click.option("--stream", is_flag=True, help="Print the text as it is generated.")
@_common
def generate(
    task: str,
    prompt: str,
    max_new_tokens: int | None,
    temperature: float | None,
    top_p: float | None,
    top_k: int | None,
    stop: tuple[str, ...],
    seed: int | None,
    stream: bool,
    url: str,
    api_key: str | None,
    as_json: bool,
) -> None:
    """Generate text for PROMPT with a task's adapter."""
    params = {
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "stop": list(stop) or None,
        "seed": seed,
    }
    with _session(url, api_key) as client:
        if not stream:
            result = client.generate(task, prompt, **params)
            _echo_json(result.raw) if as_json else click.echo(result.text)
            return
        for chunk in client.generate_stream(task, prompt, **params):
            if as_json:
                click.echo(json.dumps(chunk.raw, ensure_ascii=False))
            else:
                click.echo(chunk.text, nl=False)
                sys.stdout.flush()
        if not as_json:
            click.echo()


# ---- register -----------------------------------------------------------------------------------


@click.command()
@click.option("--task", required=True, help="Id of the new task.")
@click.option(
    "--examples",
    "examples_path",
    required=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help='JSONL file, one {"input": str, "output": str} a line.',
)
@click.option(
    "--method",
    type=click.Choice(METHODS),
    default="auto",
    show_default=True,
    help="auto: cross-validate the forms below on the examples and keep the best; demos: the examples "
    "in the prompt, nothing trained; demos+routing: both; routing: train a routing row; retrieve: no "
    "training, built from existing tasks' rows (seconds); mu / full: see the README.",
)
@click.option("--steps", type=click.IntRange(min=1), default=None, help="Training steps [server default].")
@click.option("--seed", type=int, default=None)
@click.option(
    "--serve-early",
    is_flag=True,
    help="Serve a first form while training goes on: auto's demonstrations, or the retrieved starting "
    "routing (routing, mu, full).",
)
@click.option("--shared", is_flag=True, help="Every tenant may use the task (admin keys).")
@click.option("--description", default=None, help="What the task does, in words (shown by `tasks list`).")
@click.option(
    "--wait/--no-wait",
    default=False,
    show_default=True,
    help="Show a progress bar until the job ends, then its metrics.",
)
@click.option(
    "--poll-interval",
    type=click.FloatRange(min=0.0),
    default=1.0,
    show_default=True,
    help="Seconds between polls with --wait.",
)
@_common
def register(
    task: str,
    examples_path: Path,
    method: str,
    steps: int | None,
    seed: int | None,
    serve_early: bool,
    shared: bool,
    description: str | None,
    wait: bool,
    poll_interval: float,
    url: str,
    api_key: str | None,
    as_json: bool,
) -> None:
    """Register a task from examples: starts a training job on the server."""
    with _session(url, api_key) as client:
        job = client.register_task(
            task,
            jsonl_path=examples_path,
            method=method,
            steps=steps,
            seed=seed,
            serve_early=serve_early,
            shared=shared,
            description=description,
        )
        if not wait:
            if as_json:
                _echo_json(job.raw)
            else:
                click.echo(f"job {job.id} {job.status} for task {job.task or task}")
                click.echo(f"follow it with: polyserve jobs show {job.id}")
            return
        job = _wait_with_progress(client, job, poll_interval, show_bar=not as_json)
    if as_json:
        _echo_json(job.raw)
    else:
        click.echo(fmt.job_details(job))
    if not job.succeeded:
        raise click.exceptions.Exit(1)


def _wait_with_progress(client: PolyserveClient, job: Job, poll_interval: float, show_bar: bool) -> Job:
    """Poll ``job`` to its end, drawing a tqdm bar on stderr; Ctrl-C stops waiting, not the job."""
    from tqdm import tqdm

    bar = tqdm(
        total=100,
        unit="%",
        desc=f"{job.task} [{job.status}]",
        file=sys.stderr,
        disable=not show_bar,
        bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed}{postfix}",
    )

    def on_progress(state: Job) -> None:
        bar.set_description_str(f"{state.task or job.task} [{state.status}]", refresh=False)
        numbers = {k: v for k, v in state.metrics.items() if isinstance(v, int | float)}
        bar.set_postfix({k: numbers[k] for k in list(numbers)[:3]}, refresh=False)
        bar.n = round(state.progress * 100)
        bar.refresh()  # once per poll: status and metrics can change while progress does not

    try:
        return client.wait_for_job(job.id, poll_interval=poll_interval, on_progress=on_progress)
    except KeyboardInterrupt:
        click.echo(f"stopped waiting; job {job.id} goes on (polyserve jobs cancel {job.id})", err=True)
        raise click.exceptions.Exit(130) from None
    finally:
        bar.close()


# ---- tasks, jobs --------------------------------------------------------------------------------


@click.group()
def tasks() -> None:
    """List and inspect registered tasks."""


@tasks.command("list")
@click.option("--search", default=None, help="Only tasks whose id or description holds each word of it.")
@_common
def tasks_list(url: str, api_key: str | None, as_json: bool, search: str | None) -> None:
    """List the tasks the server knows, one a line with its description."""
    with _session(url, api_key) as client:
        found = client.list_tasks(search=search)
    if as_json:
        _echo_json([t.raw for t in found])
    else:
        click.echo(fmt.tasks_table(found) if found else "no tasks")


@tasks.command("show")
@click.argument("task_id")
@_common
def tasks_show(task_id: str, url: str, api_key: str | None, as_json: bool) -> None:
    """Show one task."""
    with _session(url, api_key) as client:
        task = client.get_task(task_id)
    _echo_json(task.raw) if as_json else click.echo(fmt.task_details(task))


@tasks.command("similar")
@click.argument("task_id")
@click.option("-k", "k", type=click.IntRange(1, 100), default=5, show_default=True, help="How many tasks.")
@_common
def tasks_similar(task_id: str, k: int, url: str, api_key: str | None, as_json: bool) -> None:
    """The tasks nearest to TASK_ID by routing row (score: cosine in skill space)."""
    with _session(url, api_key) as client:
        found = client.similar(task_id, k)
    if as_json:
        _echo_json({"data": [t.raw for t in found]})
    else:
        rows = [(t.id, f"{t.score:.4f}") for t in found]
        click.echo(fmt.table(["id", "score"], rows) if found else "no other routed tasks")


@tasks.command("delete")
@click.argument("task_id")
@_common
def tasks_delete(task_id: str, url: str, api_key: str | None, as_json: bool) -> None:
    """Delete a registered task (its adapter stops being served)."""
    with _session(url, api_key) as client:
        client.delete_task(task_id)
    _echo_json({"id": task_id, "deleted": True}) if as_json else click.echo(f"task {task_id}: deleted")


@click.group()
def jobs() -> None:
    """Inspect and cancel training jobs."""


@jobs.command("show")
@click.argument("job_id")
@click.option("--events", is_flag=True, help="Also list the job's events.")
@_common
def jobs_show(job_id: str, events: bool, url: str, api_key: str | None, as_json: bool) -> None:
    """Show a job: status, progress, metrics, error."""
    with _session(url, api_key) as client:
        job = client.get_job(job_id)
        log = client.job_events(job_id) if events else []
    if as_json:
        _echo_json({**job.raw, "events": [e.raw for e in log]} if events else job.raw)
        return
    click.echo(fmt.job_details(job))
    if events:
        rows = [(fmt.fmt_time(e.created_at), e.level, e.message) for e in log]
        click.echo("events:\n" + (fmt.table(["time", "level", "message"], rows) if rows else "(none)"))


@jobs.command("cancel")
@click.argument("job_id")
@_common
def jobs_cancel(job_id: str, url: str, api_key: str | None, as_json: bool) -> None:
    """Cancel a queued or running job."""
    with _session(url, api_key) as client:
        job = client.cancel_job(job_id)
    _echo_json(job.raw) if as_json else click.echo(f"job {job.id}: {job.status}")


# ---- models, usage, import-lora over HTTP -------------------------------------------------------


@click.group()
def models() -> None:
    """The models the OpenAI-compatible routes accept (ready tasks and `base`)."""


@models.command("list")
@_common
def models_list(url: str, api_key: str | None, as_json: bool) -> None:
    """List the models (GET /v1/models)."""
    with _session(url, api_key) as client:
        found = client.list_models()
    if as_json:
        _echo_json({"data": [m.raw for m in found]})
    else:
        click.echo(fmt.models_table(found) if found else "no models")


@models.command("show")
@click.argument("model_id")
@_common
def models_show(model_id: str, url: str, api_key: str | None, as_json: bool) -> None:
    """Show one model: every field the server sends."""
    with _session(url, api_key) as client:
        model = client.get_model(model_id)
    _echo_json(model.raw) if as_json else click.echo(fmt.model_details(model))


@click.command()
@click.option("--window", type=click.IntRange(min=1), default=None, help="Seconds back [server default].")
@_common
def usage(window: int | None, url: str, api_key: str | None, as_json: bool) -> None:
    """Requests and tokens by tenant and task (every tenant's with an admin key, your own with a
    tenant key)."""
    with _session(url, api_key) as client:
        rows = client.usage(window)
    if as_json:
        _echo_json({"data": [r.raw for r in rows]})
    else:
        click.echo(fmt.usage_table(rows) if rows else "no usage in the window")


def import_lora_over_http(url: str, api_key: str | None, src: str, task: str, *, project: bool, shared: bool) -> None:
    """``polyserve import-lora --url``: POST the PEFT directory to the server and print its answer
    (the task as GET /v1/tasks/{task} shows it, and the import report) as JSON."""
    with _session(url, api_key) as client:
        answer = client.import_lora(task, src, project=project, shared=shared)
    _echo_json(answer)
