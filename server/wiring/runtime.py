"""Everything the app serves with, built once at start-up (blocking; run off the event loop):

    backbone (load_backbone) -> store (install the default inventory into an empty one)
    -> RoutedModel with the inventory's skills (none: only `base` is servable)
    -> adapter cache tiers (L1, optional L2 Redis) -> task registry
    -> engine (settings.engine: server.engines.factory.build_engine) -> warm-up
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from adapters_store.backbone.load import Backbone, load_backbone
from adapters_store.lora.inject import RoutedModel
from adapters_store.store import open_store
from adapters_store.store.contract import AdapterStore
from adapters_store.store.errors import StoreError
from server.adapter_cache.breaker import CircuitBreaker
from server.adapter_cache.cache import AdapterCache
from server.adapter_cache.l1 import L1Cache
from server.adapter_cache.l2 import RedisTier
from server.adapter_cache.signing import cache_secret
from server.engines.base import Engine
from server.engines.dtype import backbone_dtype, dtype_name
from server.engines.factory import build_engine
from server.engines.request import GenRequest, SamplingParams
from server.infra import cpus, openmp
from server.infra.metrics import Metrics
from server.jobs.service import Registration
from server.registry.tasks import TaskRegistry
from server.tenancy.tenants import Directory
from server.tenancy.usage import UsageLedger
from server.wiring.settings import Settings
from training.precision import resolve_autocast

log = logging.getLogger("polyserve")

def _maybe_install_default_inventory(store: AdapterStore, backbone_spec: str, below_floor_too: bool = False) -> bool:
    """`below_floor_too`: also the shipped tasks below the quality floor (POLYSERVE_SHIPPED_BELOW_FLOOR)."""
    if backbone_spec != "default" or store.has_inventory():
        return False
    if store.task_stamps():
        # tasks and no inventory: another process may be installing right now (tasks go in first,
        # the inventory last), so wait for its install lock; otherwise the store is left alone
        store.install_once(lambda _store: False)
        return False
    try:
        from training.shipped_inventory import install_default_inventory  # type: ignore[import-not-found]
    except ImportError:
        log.info("no shipped default inventory; serving `base` only until one is trained")
        return False
    installed = install_default_inventory(store, below_floor_too=below_floor_too)  # False: installed by another
    if installed:
        log.info("installed the default inventory into %s", store.location)
    return installed


def _refresh_shipped_tasks(store: AdapterStore, backbone_spec: str, below_floor_too: bool = False) -> None:
    """A store installed before task records carried a description and a measured quality: the
    shipped tasks get theirs; with the opt-in, the shipped tasks below the floor it lacks too."""
    if backbone_spec != "default" or not store.has_inventory():
        return
    try:
        from training.shipped_inventory import refresh_shipped  # type: ignore[import-not-found]
    except ImportError:
        return
    written = refresh_shipped(store, below_floor_too=below_floor_too)
    if written:
        log.info("brought %d shipped task records up to date (descriptions, measured quality)", written)

@dataclass
class Runtime:
    settings: Settings
    backbone: Backbone
    store: AdapterStore
    routed: RoutedModel | None
    cache: AdapterCache | None
    registry: TaskRegistry
    engine: Engine
    metrics: Metrics
    l2: RedisTier | None = None
    registration: Registration = field(init=False)  # task registration + jobs, set by build()
    usage: UsageLedger = field(default_factory=UsageLedger)  # GET /v1/usage
    started_at: float = field(default_factory=time.time)

    @property
    def tokenizer(self) -> Any:
        return self.backbone.tokenizer

    @classmethod
    def build(cls, settings: Settings, metrics: Metrics, backbone: Backbone | None = None,
              threads: int | None = None) -> Runtime:
        """threads: the engine's torch threads (default: settings.threads, else one per CPU this
        process may use: server/infra/cpus.py)."""
        threads = threads or cpus.default_threads(settings.threads)
        openmp.use_threads(threads)
        log.info("torch threads: %d (%s); OpenMP spin: %s", threads,
                 "POLYSERVE_THREADS" if settings.threads else cpus.budget().describe(), openmp.state())
        bb = backbone or load_backbone(settings.backbone, device=settings.device,
                                       dtype=dtype_name(backbone_dtype(settings.device, settings.dtype)))
        store = open_store(settings.store_location, cache_dir=settings.home.expanduser() / "inventories")
        _maybe_install_default_inventory(store, settings.backbone, settings.shipped_below_floor)
        _refresh_shipped_tasks(store, settings.backbone, settings.shipped_below_floor)
        routed, cache, l2 = None, None, None
        if store.has_inventory():
            try:
                info, skills = store.load_inventory(expected_fingerprint=bb.fingerprint)
            except StoreError as err:
                log.error("skill inventory not loaded (%s); serving `base` only", err)
            else:
                routed = RoutedModel(bb.model, info.spec)
                if tuple(routed.names) != tuple(info.layer_names):
                    raise StoreError("the inventory's layer order does not match the backbone's target linears")
                routed.load_skills({k: v.to(bb.device) for k, v in skills.items()})
                if settings.redis_url:
                    breaker = CircuitBreaker(settings.redis_breaker_failures, settings.redis_breaker_cooldown)
                    l2 = RedisTier(settings.redis_url, ttl_seconds=settings.redis_ttl_seconds,
                                   socket_timeout=settings.redis_socket_timeout,
                                   connect_timeout=settings.redis_connect_timeout, breaker=breaker, metrics=metrics)
                cache = AdapterCache(
                    store, info, skills, fingerprint=bb.fingerprint, device=bb.device,
                    dtype=next(bb.model.parameters()).dtype, l1=L1Cache(settings.l1_cache_bytes), l2=l2,
                    prefix=settings.redis_prefix, metrics=metrics,
                    # the native engine writes routed tasks' tables from their routing weights
                    routing_layers=settings.engine != "native",
                    secret=cache_secret(settings.cache_secret, store) if l2 is not None else None,
                )
        registry = TaskRegistry(store, cache, metrics,
                                isolated=Directory(settings.api_keys, settings.admin_keys).isolated)
        if routed is not None:
            # registrations train under "auto" autocast; on some CPUs that is a timing probe
            # (training.precision), decided once per process: decide it now, while nothing is
            # served, not at the first registration, when serving load would skew it
            bf16 = resolve_autocast("auto", bb.device)
            log.info("registration training: %s", "bf16 autocast" if bf16 else "float32")
        engine = build_engine(settings, bb, routed, metrics, cache.info if cache is not None else None, threads=threads)
        engine.start()
        rt = cls(settings, bb, store, routed, cache, registry, engine, metrics, l2,
                 usage=UsageLedger(settings.usage_window_max_seconds))
        rt.registration = Registration(rt, rescan_every=settings.rescan_seconds)
        rt.registration.start()
        if settings.warmup:
            rt.warmup()
        return rt

    def warmup(self) -> None:
        """One short generation through the whole engine path (allocations, kernels)."""
        ids = list(self.tokenizer("Hello", add_special_tokens=False).input_ids) or [0]
        req = self.engine.submit(GenRequest(ids, SamplingParams(max_new_tokens=2, ignore_eos=True)))
        if not req.handle.wait(timeout=300):
            raise RuntimeError("warm-up generation did not finish")

    def close(self) -> None:
        if self.registration is not None:
            self.registration.close()
        self.engine.stop()
        if self.l2 is not None:
            self.l2.close()
