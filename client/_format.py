"""Plain-text rendering for the CLI: aligned tables and key/value listings (no extra dependency)."""

from __future__ import annotations

import datetime as _dt
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .types import Job, Task

_TIME_KEYS = frozenset({"created_at", "started_at", "finished_at", "updated_at"})


def fmt_time(ts: float | None) -> str:
    """Unix seconds as ``YYYY-MM-DD HH:MM:SSZ`` (UTC); ``-`` when absent."""
    if ts is None:
        return "-"
    return _dt.datetime.fromtimestamp(ts, _dt.UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def fmt_value(value: Any) -> str:
    """A cell: ``-`` for missing, 4 significant digits for floats, compact JSON for containers."""
    if value is None or value == "":
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict | list):
        return json.dumps(value, separators=(",", ":"), sort_keys=True)
    return str(value)


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """Left-aligned columns separated by two spaces, headers upper-cased."""
    cells = [[h.upper() for h in headers]] + [[fmt_value(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells)


def key_values(pairs: Mapping[str, Any], indent: str = "") -> str:
    """``key: value`` lines with the values aligned."""
    if not pairs:
        return f"{indent}(none)"
    width = max(len(k) for k in pairs)
    return "\n".join(f"{indent}{k + ':':<{width + 1}} {fmt_value(v)}" for k, v in pairs.items())


def tasks_table(tasks: Sequence[Task]) -> str:
    rows = [(t.id, t.status, t.method, t.version, t.params, fmt_time(t.created_at)) for t in tasks]
    return table(["id", "status", "method", "version", "params", "created"], rows)


def task_details(task: Task) -> str:
    """All the fields the server sent for a task, timestamps made readable."""
    pairs = {k: (fmt_time(getattr(task, k)) if k in _TIME_KEYS else v) for k, v in task.raw.items()}
    return key_values(pairs or {"id": task.id, "status": task.status})


def job_details(job: Job) -> str:
    """A job's state, then its metrics and its error (if any)."""
    head = {
        "id": job.id,
        "task": job.task,
        "status": job.status,
        "progress": f"{job.progress:.0%}",
        "created": fmt_time(job.created_at),
        "started": fmt_time(job.started_at),
        "finished": fmt_time(job.finished_at),
    }
    parts = [key_values(head)]
    if job.metrics:
        parts.append("metrics:\n" + key_values(job.metrics, indent="  "))
    if job.error is not None:
        parts.append(f"error: {job.error.type}: {job.error.message}")
    return "\n".join(parts)


def to_json(value: Any) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False)
