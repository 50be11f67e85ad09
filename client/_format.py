"""Plain-text rendering for the CLI: aligned tables and key/value listings (no extra dependency)."""

from __future__ import annotations

import datetime as _dt
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .types import Job, Model, Quality, Task, UsageRow, timestamp

# the fields job_details shows in its own head lines; any other field the server sends follows them
_JOB_SHOWN = frozenset({"id", "task", "status", "progress", "created_at", "started_at", "finished_at",
                        "metrics", "error"})


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
    if isinstance(value, str) and not value.isprintable():  # a prompt template's newline stays on its line
        return json.dumps(value, ensure_ascii=False)
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
    """One line a task: its measured quality (a shipped task's), and its description last (on that
    line, however long)."""
    rows = [(t.id, t.status, t.method, t.version, t.params, fmt_time(t.created_at), quality_text(t.quality),
             one_line(t.description)) for t in tasks]
    return table(["id", "status", "method", "version", "params", "created", "quality", "description"], rows)


def quality_text(quality: Quality | None) -> str | None:
    """A measured quality in a few words: ``words 0.88 sentences 0.56``, ``below floor`` where it is."""
    if quality is None:
        return None
    text = f"words {quality.heldout_exact:.2f}"
    if quality.sentences_exact is not None:
        text += f" sentences {quality.sentences_exact:.2f}"
    return text + (" below floor" if quality.below_floor else "")


def one_line(text: str | None) -> str | None:
    """A description on one line (its whitespace runs, newlines included, as single spaces)."""
    return " ".join(text.split()) if text else None


def readable(key: str, value: Any) -> Any:
    """A raw field for printing: a ``*_at`` timestamp (number or ISO-8601) or an OpenAI object's
    ``created`` as UTC time, the rest as it came. Works on any key, so a field the server adds
    later prints too."""
    if (key.endswith("_at") or key == "created") and value is not None:
        ts = timestamp(value)
        return fmt_time(ts) if ts is not None else value
    return value


def raw_details(raw: Mapping[str, Any]) -> str:
    """Every field of a server object, in the server's order."""
    return key_values({k: readable(k, v) for k, v in raw.items()})


def task_details(task: Task) -> str:
    """All the fields the server sent for a task, timestamps made readable; a registration's
    estimate (each form's cross-validated exact match) as a table after them."""
    raw = dict(task.raw or {"id": task.id, "status": task.status})
    if task.quality is not None:  # in words, with what it was measured on
        raw["quality"] = quality_line(task.quality)
    metrics = raw.get("metrics")
    estimate = metrics.get("estimate") if isinstance(metrics, dict) else None
    if isinstance(metrics, dict) and isinstance(estimate, dict):
        raw["metrics"] = {k: v for k, v in metrics.items() if k != "estimate"}
    out = raw_details(raw)
    return out + "\n" + estimate_table(estimate) if isinstance(estimate, dict) else out


def estimate_table(estimate: Mapping[str, Any]) -> str:
    """auto's estimate: a row per form (the chosen one marked) and the majority answer's."""
    found = estimate.get("candidates")
    forms: dict[str, Any] = found if isinstance(found, dict) else {}
    rows = []
    for form, c in [*forms.items(), ("majority answer", estimate.get("majority"))]:
        if not isinstance(c, dict):
            continue
        interval = f"{c['low']:.2f}-{c['high']:.2f}" if "low" in c and "high" in c else ""
        mark = "chosen" if form == estimate.get("chosen") else ("stopped" if c.get("stopped") else "")
        rows.append((form, f"{c.get('exact', 0):.2f}", c.get("n", 0), interval, mark))
    level = estimate.get("level", 0.9)
    head = f"estimate (cross-validated exact match, {level:.0%} interval):"
    note = f"\n{estimate['note']}" if estimate.get("note") else ""
    return head + "\n" + table(["form", "exact", "n", "interval", ""], rows) + note


def quality_line(quality: Quality) -> str:
    """A measured quality in full, for ``tasks show`` and ``models show``."""
    text = f"exact match {quality.heldout_exact:.2f} on held-out words"
    if quality.sentences_exact is not None:
        text += f", {quality.sentences_exact:.2f} on sentences"
    text += f" ({quality.n} inputs each, measured {quality.measured or '-'})"
    if quality.below_floor:
        text += "; below the quality floor: installed only on request (POLYSERVE_SHIPPED_BELOW_FLOOR)"
    return text


def model_details(model: Model) -> str:
    """Every field the server sent for a model, its measured quality in words."""
    raw = dict(model.raw or {"id": model.id})
    if model.quality is not None:
        raw["quality"] = quality_line(model.quality)
    return raw_details(raw)


def models_table(models: Sequence[Model]) -> str:
    rows = [(m.id, m.parent, m.owned_by, fmt_time(m.created), quality_text(m.quality), one_line(m.description))
            for m in models]
    return table(["id", "parent", "owned_by", "created", "quality", "description"], rows)


def usage_table(rows: Sequence[UsageRow]) -> str:
    cells = [(r.tenant, r.task, r.requests, r.prompt_tokens, r.completion_tokens, r.refused) for r in rows]
    return table(["tenant", "task", "requests", "prompt_tokens", "completion_tokens", "refused"], cells)


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
    head.update({k: readable(k, v) for k, v in job.raw.items() if k not in _JOB_SHOWN})
    parts = [key_values(head)]
    if job.metrics:
        parts.append("metrics:\n" + key_values(job.metrics, indent="  "))
    if job.error is not None:
        parts.append(f"error: {job.error.type}: {job.error.message}")
    return "\n".join(parts)


def to_json(value: Any) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False)
