"""Resolving a per-request mix (`mix:ID=W,...`, adapters_store.lora.mix) to its adapter.

Every member must be a ready routed task (kind "routing") made for the served inventory: a plain
LoRA has no routing row to mix, and a row of another inventory weighs other skills. The mix's
adapter comes from the cache tiers (AdapterCache.get_mix), keyed by the mix and its members'
versions. Errors: a malformed mix or an unmixable member -> ValueError (a 4xx naming the field),
an unknown member -> TaskNotFound (404), a member not ready -> TaskNotReady (409).
"""

from __future__ import annotations

from typing import Protocol

from adapters_store.lora.mix import Mix, MixError, parse_mix
from adapters_store.store.records import TaskRecord
from server.adapter_cache.cache import AdapterCache
from server.adapter_cache.types import Adapter
from server.registry.errors import TaskNotReady
from server.tenancy.tenants import Tenant


class Members(Protocol):
    """What resolving a mix asks of the task registry (server/registry/tasks.py)."""

    cache: AdapterCache | None

    @property
    def inventory_version(self) -> str | None: ...

    def get(self, task: str, tenant: Tenant | None = None) -> TaskRecord: ...


def mix_records(registry: Members, mix: Mix, tenant: Tenant | None = None) -> list[TaskRecord]:
    """The members' records, checked servable and mixable (blocking: reads the store). A member
    `tenant` may not see is not found, as the task alone would be."""

    records = [registry.get(task, tenant) for task in mix.tasks]
    for record in records:
        if record.status != "ready":
            raise TaskNotReady(record.id, record.status, record.job_id)
        if (record.kind or "routing") != "routing":
            raise MixError(f"mix member {record.id!r} is a plain LoRA (method {record.method!r}); "
                           "only routed tasks mix")
        if record.inventory_version not in (None, registry.inventory_version):
            raise MixError(f"mix member {record.id!r} was trained on another skill inventory")
    return records


def resolve_mix(registry: Members, text: str, tenant: Tenant | None = None) -> Adapter:
    mix = parse_mix(text)
    records = mix_records(registry, mix, tenant)
    if registry.cache is None:
        raise MixError("no skill inventory is loaded: nothing to mix")
    return registry.cache.get_mix(mix, records)


def mix_prompt_format(registry: Members, text: str, tenant: Tenant | None = None) -> str:
    """The members' common prompt format (a mix of tasks trained on different formats has none)."""
    mix = parse_mix(text)
    formats = {registry.get(task, tenant).prompt_format for task in mix.tasks}
    if len(formats) != 1:
        raise MixError("mix members were trained with different prompt formats")
    return formats.pop()
