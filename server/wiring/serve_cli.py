"""`polyserve serve`: run the HTTP server (FastAPI + uvicorn)."""

from __future__ import annotations

from typing import Any

import click


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=int)
@click.option("--store", "store_dir", default=None, help="Store directory [default: $POLYSERVE_STORE].")
@click.option("--backbone", default=None, help="default | tiny | a local HF model directory "
              "[default: $POLYSERVE_BACKBONE or 'default'].")
@click.option("--log-level", default="info", show_default=True)
def serve(host: str, port: int, store_dir: str | None, backbone: str | None, log_level: str) -> None:
    """Serve every task of the store over one frozen backbone (OpenAI-compatible API included)."""
    import logging

    import uvicorn

    from server.api.app import create_app
    from server.wiring.settings import Settings

    overrides: dict[str, Any] = {k: v for k, v in {"store": store_dir, "backbone": backbone}.items()
                                 if v is not None}
    settings = Settings(**overrides)
    from server.wiring.exposure import exposure_error

    refused = exposure_error(host, settings)
    if refused is not None:  # before anything loads: the Docker image serves 0.0.0.0
        raise click.UsageError(refused)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvicorn.run(create_app(settings), host=host, port=port, log_level=log_level, timeout_graceful_shutdown=10)
