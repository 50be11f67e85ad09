"""Atomic file writes: temp file in the same directory + fsync + rename + fsync of the directory.

A crash at any point leaves either the old file or the new one, never a mix; stray temp files
(names starting with ".tmp-") are ignored by readers and removed by `sweep_temp_files`.
"""

from __future__ import annotations

import json
import os
import secrets
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


def sweep_temp_files(root: Path) -> int:
    """Remove temp files left by a crashed writer; returns how many were removed."""
    removed = 0
    for tmp in root.rglob(f"{TMP_PREFIX}*"):
        if tmp.is_file():
            tmp.unlink(missing_ok=True)
            removed += 1
    return removed
