"""Start-up off the event loop, shared by the server's and the worker's apps.

Loading a backbone takes seconds to minutes. The app starts answering at once: /health says it is
alive, /ready says "loading" until `build` has put its object on `app.state.<attr>`, then ready. A
failed start-up keeps only the exception's kind in `app.state.load_error` (messages may hold paths
or a DSN), for /ready to report; the traceback goes to the log.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI


def init_state(app: FastAPI, attr: str) -> None:
    """What /ready reads before the lifespan has run: nothing built, no error."""
    setattr(app.state, attr, None)
    app.state.load_error = None


@asynccontextmanager
async def built_in_background(app: FastAPI, attr: str, build: Callable[[], Awaitable[Any]],
                              close: Callable[[Any], None], log: logging.Logger) -> AsyncIterator[None]:
    """Run `build()` as a task while the app serves; on shutdown cancel it if still loading, else
    `close` what it built (in a thread: closing joins threads)."""

    async def load() -> None:
        try:
            setattr(app.state, attr, await build())
            log.info("%s ready", app.title)
        except Exception as err:
            log.exception("%s start-up failed", app.title)
            app.state.load_error = type(err).__name__

    loader = asyncio.create_task(load())
    try:
        yield
    finally:
        loader.cancel()
        built = getattr(app.state, attr)
        if built is not None:
            await asyncio.to_thread(close, built)
            setattr(app.state, attr, None)
