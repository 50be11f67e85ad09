"""Python client for the polyserve HTTP API (sync and asyncio), plus its CLI commands.

Only ``httpx`` and the standard library are needed; nothing here imports the server.

>>> from client import PolyserveClient                                      # doctest: +SKIP
>>> with PolyserveClient("http://127.0.0.1:8000") as c:                     # doctest: +SKIP
...     job = c.register_task("reverse", [{"input": "abc", "output": "cba"}])
...     c.wait_for_job(job.id)
...     print(c.generate("reverse", "xyz").text)
"""

from .aio import AsyncPolyserveClient
from .errors import (
    BadRequest,
    Conflict,
    ConnectionFailed,
    DeadlineExceeded,
    Forbidden,
    InvalidInput,
    NotFound,
    Overloaded,
    PayloadTooLarge,
    PolyserveError,
    ServerError,
    Unauthorized,
    Unavailable,
    ValidationError,
    error_from_response,
)
from .sync import PolyserveClient
from .types import (
    ErrorInfo,
    Generation,
    Job,
    JobEvent,
    Model,
    Quality,
    SimilarTask,
    StreamChunk,
    Task,
    Usage,
    UsageRow,
)

__all__ = [
    "AsyncPolyserveClient",
    "BadRequest",
    "Conflict",
    "ConnectionFailed",
    "DeadlineExceeded",
    "ErrorInfo",
    "Forbidden",
    "Generation",
    "InvalidInput",
    "Job",
    "JobEvent",
    "Model",
    "NotFound",
    "Overloaded",
    "PayloadTooLarge",
    "PolyserveClient",
    "PolyserveError",
    "Quality",
    "ServerError",
    "SimilarTask",
    "StreamChunk",
    "Task",
    "Unauthorized",
    "Unavailable",
    "Usage",
    "UsageRow",
    "ValidationError",
    "error_from_response",
]
