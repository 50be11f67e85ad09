"""Helpers for checking the deployment files against the metric contract.

``dashboard_metric_names`` pulls the metric names out of every PromQL expression of a Grafana
dashboard; ``exposition_metric_names`` does the same for a Prometheus ``/metrics`` text, so a live
test can check that the dashboard only asks for series the server really exports.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

# The metric names fixed by docs/contract.md ("Prometheus metrics"), with the `polyserve_`
# prefix.  Keep in step with the contract; histograms are listed by their base name.
CONTRACT_METRICS: frozenset[str] = frozenset(
    "polyserve_" + name
    for name in (
        "requests_total",
        "request_duration_seconds",
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "queue_wait_seconds",
        "batch_size",
        "requests_running",
        "requests_waiting",
        "prompt_tokens_total",
        "generation_tokens_total",
        "adapter_cache_requests_total",
        "adapter_materialize_seconds",
        "tasks_registered",
        "jobs_total",
        "redis_errors_total",
    )
)

_SERIES_SUFFIXES = ("_bucket", "_sum", "_count")
_KEYWORDS = frozenset(
    {
        "and",
        "or",
        "unless",
        "bool",
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "offset",
        "inf",
        "nan",
    }
)
_STRING = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`')
_GRAFANA_VAR = re.compile(r"\$\{[^}]*\}|\$\w+|\[\[\w+\]\]")
_BRACES = re.compile(r"\{[^{}]*\}")
_BRACKETS = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", re.IGNORECASE)
_MODIFIER = re.compile(r"\boffset\s+-?(?:\d+(?:ms|[smhdwy]))+|@\s*(?:start\(\)|end\(\)|[\d.]+)")
_TOKEN = re.compile(
    r"(?P<num>0x[0-9a-fA-F]+|(?:\d+(?:ms|[smhdwy]))+\b|\d*\.?\d+(?:[eE][+-]?\d+)?)"
    r"|(?P<id>[a-zA-Z_:][a-zA-Z0-9_:]*)"
)


def base_metric_name(series: str) -> str:
    """``x_bucket``/``x_sum``/``x_count`` → ``x``; anything else unchanged (``_total`` is kept)."""
    for suffix in _SERIES_SUFFIXES:
        if series.endswith(suffix):
            return series[: -len(suffix)]
    return series


def promql_metric_names(expr: str) -> set[str]:
    """The metric names (series selectors) used in one PromQL expression, as written.

    Strings, label matchers, ranges, grouping clauses, offset/@ modifiers, Grafana variables,
    numbers, durations, keywords and function names (identifiers followed by ``(``) are dropped;
    what is left are metric names.
    """
    text = _STRING.sub(" ", expr)
    text = _GRAFANA_VAR.sub("1", text)
    text = _BRACES.sub(" ", text)
    while _BRACKETS.search(text):
        text = _BRACKETS.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    text = _MODIFIER.sub(" ", text)
    names: set[str] = set()
    for match in _TOKEN.finditer(text):
        name = match.group("id")
        if name is None or name.lower() in _KEYWORDS:
            continue
        if re.match(r"\s*\(", text[match.end() :]):
            continue  # a function or aggregation
        names.add(name)
    return names


def _exprs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "expr" and isinstance(value, str):
                yield value
            else:
                yield from _exprs(value)
    elif isinstance(node, list):
        for item in node:
            yield from _exprs(item)


def dashboard_exprs(dashboard: dict[str, Any]) -> list[str]:
    """Every PromQL ``expr`` in a dashboard (panels, nested row panels, any depth)."""
    return list(_exprs(dashboard))


def dashboard_metric_names(dashboard: dict[str, Any]) -> set[str]:
    """Base metric names used by all the dashboard's PromQL expressions (histogram suffixes removed)."""
    return {base_metric_name(name) for expr in _exprs(dashboard) for name in promql_metric_names(expr)}


def exposition_metric_names(text: str) -> set[str]:
    """Base metric names of a Prometheus text exposition (``GET /metrics``).

    ``_created`` samples (prometheus_client's creation timestamps) are skipped; histogram series
    are reduced to their base name, counters keep ``_total``.
    """
    names: set[str] = set()
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name = re.split(r"[{\s]", line, maxsplit=1)[0]
        if name.endswith("_created"):
            continue
        names.add(base_metric_name(name))
    return names
