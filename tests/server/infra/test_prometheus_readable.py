"""Metrics a Prometheus user can read: request durations by endpoint template (bounded: never a
raw path or a task id), no `_created` series, and health / readiness polls logged at DEBUG."""

from __future__ import annotations

import logging

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server.infra.access_log import ACCESS_LOGGER, ProbesAtDebug, install
from server.infra.metrics import Metrics
from tests.support.server_fixtures import TASKS, build_store, live_server, settings_for, tiny_backbone

DURATION = "polyserve_request_duration_seconds"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(the exposition before the requests below, after them)"""
    root = tmp_path_factory.mktemp("metrics")
    build_store(root / "store")
    with live_server(settings_for(root, warmup=False), tiny_backbone()) as srv, \
            httpx.Client(base_url=srv.url, timeout=30) as c:
        before = c.get("/metrics").text
        for _ in range(3):
            assert c.get("/ready").status_code == 200
        for task in TASKS:
            assert c.get(f"/v1/tasks/{task}").status_code == 200
        assert c.get("/v1/tasks/no-such-task").status_code == 404
        assert c.post("/v1/generate", json={"task": TASKS[0], "prompt": "a b", "max_new_tokens": 2}).status_code == 200
        assert c.get("/no/such/path").status_code == 404
        return before, c.get("/metrics").text


@pytest.fixture(scope="module")
def exposition(served) -> str:
    return served[1]


def duration_counts(text: str) -> dict[str, float]:
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == DURATION]
    return {s.labels["endpoint"]: s.value for s in family.samples if s.name == DURATION + "_count"}


def test_request_durations_carry_the_endpoint_template(served, exposition):
    before = duration_counts(served[0])
    counts = {e: n - before.get(e, 0.0) for e, n in duration_counts(exposition).items()}
    assert counts["/ready"] == 3
    assert counts["/v1/tasks/{task}"] == len(TASKS) + 1  # one series for every task id, found or not
    assert counts["/v1/generate"] == 1
    assert counts["other"] == 1  # a path no route matched: one series, not one per path
    assert not any(t in endpoint for endpoint in counts for t in (*TASKS, "no-such-task", "/no/such"))
    # the generation's duration is readable apart from the polls
    bucket = [line for line in exposition.splitlines()
              if line.startswith(DURATION + "_bucket{") and 'endpoint="/v1/generate"' in line]
    assert bucket and all('le="' in line for line in bucket)


def test_no_created_series(exposition):
    assert "_created" not in exposition
    fresh = Metrics()  # a new registry of this process too
    fresh.requests.labels(endpoint="/v1/generate", status="200", tenant="").inc()
    fresh.request_duration.labels(endpoint="/v1/generate").observe(0.1)
    assert "_created" not in fresh.render().decode()


def access_record(path: str) -> logging.LogRecord:
    return logging.LogRecord(ACCESS_LOGGER, logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
                             ("127.0.0.1:5000", "GET", path, "1.1", 200), None)


@pytest.mark.parametrize("path", ["/health", "/ready", "/ready?probe=1"])
def test_health_and_ready_polls_are_debug(path):
    logger = logging.getLogger(ACCESS_LOGGER)
    before = logger.level
    try:
        logger.setLevel(logging.INFO)
        record = access_record(path)
        assert ProbesAtDebug().filter(record) is False and record.levelname == "DEBUG"
        logger.setLevel(logging.DEBUG)  # --log-level debug: logged again, as DEBUG
        record = access_record(path)
        assert ProbesAtDebug().filter(record) is True and record.levelno == logging.DEBUG
    finally:
        logger.setLevel(before)


@pytest.mark.parametrize("path", ["/v1/generate", "/metrics", "/healthz", "/v1/tasks/ready"])
def test_other_requests_stay_info(path):
    record = access_record(path)
    assert ProbesAtDebug().filter(record) is True and record.levelno == logging.INFO


def test_the_filter_is_on_the_access_logger_once(caplog):
    install()
    install()
    logger = logging.getLogger(ACCESS_LOGGER)
    assert sum(isinstance(f, ProbesAtDebug) for f in logger.filters) == 1
    with caplog.at_level(logging.INFO, logger=ACCESS_LOGGER):
        logger.info('%s - "%s %s HTTP/%s" %d', "127.0.0.1:5000", "GET", "/ready", "1.1", 200)
        logger.info('%s - "%s %s HTTP/%s" %d', "127.0.0.1:5000", "POST", "/v1/generate", "1.1", 200)
    assert [r.args[2] for r in caplog.records if r.name == ACCESS_LOGGER] == ["/v1/generate"]
