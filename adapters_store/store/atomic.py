"""Atomic file writes: temp file in the same directory + fsync + rename + fsync of the directory.

A crash at any point leaves either the old file or the new one, never a mix; stray temp files
(names starting with ".tmp-") are ignored by readers and removed by `sweep_temp_files` once they
are older than a grace period (never another process's write in progress).
"""

from __future__ import annotations

import json
import os
import secrets
import time
from pathlib import Path
from typing import Any

TMP_PREFIX = ".tmp-"


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f"{TMP_PREFIX}{path.name}.{os.getpid()}.{secrets.token_hex(4)}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


# A writer renames its temp file within seconds (write + fsync). Replicas in other containers
# share the store but not the pid namespace, so a temp file's pid says nothing reliable about its
# writer: only temp files older than this are considered abandoned.
SWEEP_GRACE_SECONDS = 600.0


def sweep_temp_files(root: Path, grace_seconds: float = SWEEP_GRACE_SECONDS, now: float | None = None) -> int:
    """Remove temp files left by a crashed writer (older than `grace_seconds`, so another
    process's write in progress is never touched); returns how many were removed."""
    removed = 0
    now = time.time() if now is None else now
    for tmp in root.rglob(f"{TMP_PREFIX}*"):
        try:
            if tmp.is_file() and now - tmp.stat().st_mtime > grace_seconds:
                tmp.unlink(missing_ok=True)
                removed += 1
        except FileNotFoundError:  # renamed or removed by its writer meanwhile
            continue
    return removed
