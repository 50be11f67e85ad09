"""`polyserve worker`: run registration jobs from the store's queue (no generations)."""

from __future__ import annotations

from typing import Any

import click


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Where /health, /ready and /metrics answer.")
@click.option("--port", default=8001, show_default=True, type=int)
@click.option("--store", "store_dir", default=None, help="A PostgreSQL DSN or a store directory "
              "[default: $POLYSERVE_STORE].")
@click.option("--backbone", default=None, help="default | tiny | a local HF model directory "
              "[default: $POLYSERVE_BACKBONE or 'default'].")
@click.option("--log-level", default="info", show_default=True)
def worker(host: str, port: int, store_dir: str | None, backbone: str | None, log_level: str) -> None:
    """Claim queued registration jobs (enqueued by servers with POLYSERVE_JOBS=off), run them, commit
    their results. Jobs are leased (POLYSERVE_JOB_LEASE_SECONDS) and renewed while they run."""
    import logging

    import uvicorn

    from server.fleet.worker.app import create_worker_app
    from server.wiring.settings import Settings

    overrides: dict[str, Any] = {k: v for k, v in {"store": store_dir, "backbone": backbone}.items()
                                 if v is not None}
    settings = Settings(**overrides)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvicorn.run(create_worker_app(settings), host=host, port=port, log_level=log_level, timeout_graceful_shutdown=10)
