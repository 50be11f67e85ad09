"""What a job's failure may tell a client: the error's message with every filesystem path taken
out (store paths reveal the deployment's layout; the full error stays in the server log)."""

from __future__ import annotations

import re

# an absolute path (/a/b, ~/a, C:\\a), or a relative one with at least one directory (a/b.txt)
_PATH = re.compile(r"""(?:[A-Za-z]:\\|~?/)[^\s'"]*|(?<![\w:/.])(?:[\w.-]+/)+[\w.-]+""")
MAX_CHARS = 500


def scrub(message: str) -> str:
    """`message` with every path replaced by <path>, at most MAX_CHARS characters."""
    out = _PATH.sub("<path>", message)
    return out if len(out) <= MAX_CHARS else out[: MAX_CHARS - 3] + "..."


def public_error(kind: str, err: BaseException) -> dict[str, str]:
    """A job's `error` object for an exception: its type and its message, scrubbed."""
    return {"type": kind, "message": scrub(str(err)) or type(err).__name__}
