"""Test inventories on the tiny backbone: random skills (B non-zero) and a few routing tasks."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from adapters_store.backbone.load import Backbone, fingerprint
from adapters_store.backbone.tiny import tiny_llama, tiny_tokenizer
from adapters_store.lora.inject import RoutedModel
from adapters_store.lora.spec import InventorySpec
from adapters_store.store.directory import DirectoryStore

TASKS = ("alpha", "beta", "gamma", "delta")
SPEC = InventorySpec(n_skills=4, n_heads=2, rank=4)


def tiny_backbone() -> Backbone:
    model = tiny_llama(seed=0)
    return Backbone(model, tiny_tokenizer(), "tiny", fingerprint(model), 0.0)


def random_skills(model: torch.nn.Module, spec: InventorySpec = SPEC, seed: int = 0) -> RoutedModel:
    """A RoutedModel on a copy of `model` with random A and clearly non-zero B."""
    rm = RoutedModel(copy.deepcopy(model), spec)
    rm.reset_skills(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in rm.layers:
            layer.lora_B.normal_(0, 1.0, generator=gen)
    return rm


def build_store(root: str | Path, tasks: tuple[str, ...] = TASKS, spec: InventorySpec = SPEC,
                seed: int = 0) -> DirectoryStore:
    """A store with a random inventory for the tiny backbone and one routing row per task."""
    bb = tiny_backbone()
    rm = random_skills(bb.model, spec, seed)
    store = DirectoryStore(root)
    store.save_inventory(
        spec, rm.names, rm.layer_dims(), rm.skill_tensors(), backbone_fingerprint=bb.fingerprint,
        backbone_name="tiny", made_by={"method": "random-test"},
    )
    gen = torch.Generator().manual_seed(seed + 7)
    shape = (len(rm.names), spec.n_heads, spec.n_skills)
    for task in tasks:
        store.put_routing(task, torch.randn(shape, generator=gen) * 3, method="mhr")
    return store


def routed_engine_parts(root: str | Path):
    """(backbone, RoutedModel with the store's skills, store, AdapterCache) on the tiny backbone:
    what a test needs to drive the native engine with the store's tasks."""
    from server.adapter_cache.cache import AdapterCache
    from server.adapter_cache.l1 import L1Cache

    store = build_store(root)
    bb = tiny_backbone()
    info, skills = store.load_inventory(bb.fingerprint)
    rm = RoutedModel(bb.model, info.spec)
    rm.load_skills(skills)
    cache = AdapterCache(store, info, skills, fingerprint=bb.fingerprint, device=torch.device("cpu"),
                         dtype=torch.float32, l1=L1Cache(1 << 30))
    return bb, rm, store, cache


def put_task(store: DirectoryStore, task: str, seed: int) -> None:
    """Write (or re-write: new version) one routing row."""
    info = store.inventory_info()
    gen = torch.Generator().manual_seed(seed)
    shape = (len(info.layer_names), info.spec.n_heads, info.spec.n_skills)
    store.put_routing(task, torch.randn(shape, generator=gen) * 3, method="mhr")


# -- a real HTTP server in a thread ------------------------------------------------------------
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LiveServer:
    url: str
    app: Any

    @property
    def runtime(self) -> Any:
        return self.app.state.runtime


def wait_ready(get, timeout: float = 60.0) -> None:
    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline:
        with contextlib.suppress(OSError, httpx.HTTPError):
            if get("/ready").status_code == 200:
                return
        time.sleep(0.05)
    raise TimeoutError("server did not become ready")


@contextlib.contextmanager
def live_server(settings: Any, backbone: Backbone | None = None) -> Iterator[LiveServer]:
    """uvicorn on a free loopback port, in a thread; yields once /ready is 200."""
    import httpx
    import uvicorn

    from server.api.app import create_app

    app = create_app(settings, backbone=backbone)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=url, timeout=5) as client:
            wait_ready(client.get)
        yield LiveServer(url, app)
    finally:
        server.should_exit = True
        thread.join(20)


def settings_for(root: str | Path, **overrides: Any) -> Any:
    from server.wiring.settings import Settings

    root = Path(root)
    values = {"home": root, "store": root / "store", "backbone": "tiny", "redis_url": None, "api_keys": []}
    values.update(overrides)
    return Settings(**values)


REDIS_URL = "redis://127.0.0.1:6379/0"


def redis_up(url: str = REDIS_URL) -> bool:
    """Whether the real Redis answers (CI starts it in .ci/run)."""
    import redis

    try:
        return bool(redis.Redis.from_url(url, socket_timeout=0.5).ping())
    except Exception:  # noqa: BLE001
        return False


def shipped_inventory_available() -> bool:
    """Whether training/default_inventory/ holds the shipped inventory (the slow tests need it)."""
    try:
        from training.shipped_inventory import default_inventory_available
    except ImportError:
        return False
    return default_inventory_available()


def vllm_python() -> Path | None:
    """A vLLM environment's python (`make vllm-env` creates .venv-vllm; POLYSERVE_VLLM_PYTHON names
    another), or None: the tests that need real vLLM skip."""
    import os

    in_repo = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"
    path = Path(os.environ.get("POLYSERVE_VLLM_PYTHON", in_repo))
    return path if path.is_file() else None


def require_vllm_and_backbone() -> Path:
    """The vLLM environment's python for a test that runs real vLLM on the default backbone; skips
    (saying why) where either is missing."""
    import pytest

    python = vllm_python()
    if python is None:
        pytest.skip("no vLLM environment: `make vllm-env` creates .venv-vllm (or set POLYSERVE_VLLM_PYTHON)")
    from adapters_store.backbone.load import default_gguf_path

    try:
        default_gguf_path()
    except FileNotFoundError as err:
        pytest.skip(str(err))
    return python
