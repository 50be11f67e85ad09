"""L1: an in-process LRU of materialised adapters, bounded in bytes.

Entries are keyed by the versioned cache key, so a new routing version never hits an old entry.
Rows in flight hold their Adapter object; evicting it here only drops the cache's reference.
Methods that change the table return whether they did (vLLM LoRAModelManager style).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from server.adapter_cache.types import Adapter


class L1Cache:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity = capacity_bytes
        self._entries: OrderedDict[str, Adapter] = OrderedDict()
        self.bytes = 0
        self._lock = threading.Lock()

    def get(self, key: str) -> Adapter | None:
        """The entry (now most recently used) or None."""
        with self._lock:
            adapter = self._entries.get(key)
            if adapter is not None:
                self._entries.move_to_end(key)
            return adapter

    def add(self, adapter: Adapter) -> bool:
        """Insert (most recently used), evicting least recently used entries to fit.
        Returns False (nothing cached) when the adapter alone exceeds the capacity."""
        size = adapter.nbytes
        with self._lock:
            if size > self.capacity:
                return False
            if adapter.key in self._entries:
                self._remove(adapter.key)
            while self.bytes + size > self.capacity and self._entries:
                self._remove(next(iter(self._entries)))
            self._entries[adapter.key] = adapter
            self.bytes += size
            return True

    def discard(self, key: str) -> bool:
        with self._lock:
            if key not in self._entries:
                return False
            self._remove(key)
            return True

    def discard_task(self, task: str) -> int:
        """Drop every version of a task (e.g. deleted); returns how many entries went."""
        with self._lock:
            keys = [k for k, a in self._entries.items() if a.task == task]
            for k in keys:
                self._remove(k)
            return len(keys)

    def _remove(self, key: str) -> None:
        self.bytes -= self._entries.pop(key).nbytes

    def keys(self) -> list[str]:
        """Keys from least to most recently used."""
        with self._lock:
            return list(self._entries)

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)
