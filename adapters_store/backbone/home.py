"""Where polyserve keeps its files on this machine: one answer for every process and command.

    $POLYSERVE_HOME             default ~/.cache/polyserve
      store/                    the directory store, when POLYSERVE_STORE is not set
      backbones/                the dequantised default backbone
      inventories/              a PostgreSQL store's inventories, cached on this node
      kernels/                  the native engine's compiled LoRA kernel
      vllm-loras/               tasks written as PEFT LoRA directories for vLLM
"""

from __future__ import annotations

import os
from pathlib import Path


def polyserve_home() -> Path:
    """$POLYSERVE_HOME, ~ expanded; default ~/.cache/polyserve."""
    return Path(os.environ.get("POLYSERVE_HOME") or Path.home() / ".cache" / "polyserve").expanduser()


def default_store() -> str:
    """$POLYSERVE_STORE (a directory or a postgresql:// DSN), else $POLYSERVE_HOME/store."""
    return os.environ.get("POLYSERVE_STORE") or str(polyserve_home() / "store")
