"""A task's materialised adapter as a PEFT LoRA directory vLLM can load, once per cache key.

Both ways polyserve hands adapters to vLLM write them here: the vLLM engine (engine.py) and the
resolver plugin of vLLM's own server (resolver.py). The adapter comes from the cache tiers
(L1 -> Redis -> store, server/adapter_cache), so its key names the task, its version and the
inventory; the directory is named after that key, written atomically once, and gets a stable
integer id (vLLM identifies LoRAs by int). A re-registered task has a new key, so a new directory
and id: vLLM never serves the old weights under the new version.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
from pathlib import Path
from typing import Any

from adapters_store.interop.peft_io import write_peft_lora
from adapters_store.lora.mix import is_mix
from adapters_store.store.records import InventoryInfo


def lora_int_id(name: str) -> int:
    """A stable positive 31-bit id for a directory name (vLLM needs an int)."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "big") % (2**31 - 1) + 1


def dir_name(task: str, key: str) -> str:
    """A filesystem-safe, key-unique name: the task id (already a safe id; "mix" for a per-request
    mix, whose key names it) + a digest of the key."""
    stem = "mix" if is_mix(task) else task
    return f"{stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


class LoraDirectories:
    """Adapter -> (name, int id, directory); remembers which ids belong to which task."""

    def __init__(self, root: str | Path, info: InventoryInfo, base_model: str) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.info, self.base_model = info, base_model
        self._by_task: dict[str, set[int]] = {}
        self._lock = threading.Lock()

    def ensure(self, adapter: Any) -> tuple[str, int, Path]:
        """Write the adapter's directory if needed (blocking I/O: call off the event loop)."""
        name = dir_name(adapter.task, adapter.key)
        target = self.root / name
        if not (target / "adapter_config.json").is_file():
            tmp = target.with_name(f".{name}.tmp-{os.getpid()}-{threading.get_ident()}")
            write_peft_lora(self.info, adapter.layers, tmp, base_model=self.base_model,
                            provenance={"task": adapter.task, "key": adapter.key})
            try:
                os.rename(tmp, target)  # another process may have written the same content first
            except OSError:
                shutil.rmtree(tmp, ignore_errors=True)
        lora_id = lora_int_id(name)
        with self._lock:
            self._by_task.setdefault(adapter.task, set()).add(lora_id)
        return name, lora_id, target

    def pop_task(self, task: str) -> set[int]:
        """The ids served for `task` so far (forgotten here; the caller removes them from vLLM)."""
        with self._lock:
            return self._by_task.pop(task, set())
