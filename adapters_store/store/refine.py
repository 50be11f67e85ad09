"""Copy a store with its inventory's routing heads refined (h -> m * h): the same adapters for
every stored task, finer routing for the tasks registered afterwards.

MHR mixes skills per block of dimensions (a head). Refining splits each block into m smaller
ones (`combine.refine_heads`) and repeats each stored routing row's logits for them
(`routing.refine_row`), so every existing task materialises exactly the LoRA it had, while a new
task's routing-only adaptation learns m times as many numbers (L x h x S) to fit its examples.
Serving cost is unchanged: a task is served as its materialised rank-r LoRA whatever h is.

The destination must be empty; the source is only read. The inventory is written last, so a
crash leaves a destination without an inventory (not a mixed one) that can be removed and redone.
"""

from __future__ import annotations

import dataclasses

from adapters_store.lora.combine import refine_heads
from adapters_store.lora.routing import refine_row
from adapters_store.store.directory import DirectoryStore
from adapters_store.store.errors import StoreError
from adapters_store.store.records import InventoryInfo


def refine_store(src: DirectoryStore, dst: DirectoryStore, heads: int) -> InventoryInfo:
    """Write `src`'s inventory with `heads` routing heads, and all its ready tasks, into `dst`."""
    info, skills = src.load_inventory()
    h = info.spec.n_heads
    if dst.has_inventory() or dst.list_tasks():
        raise StoreError(f"{dst.root} is not empty: refine into a new store")
    fine = {}
    for name in info.layer_names:
        fine[f"{name}.A"], fine[f"{name}.B"] = refine_heads(skills[f"{name}.A"], skills[f"{name}.B"], heads)
    factor = heads // h
    formats = {}
    for record in src.list_tasks():
        if record.status != "ready" or record.inventory_version not in (None, info.version):
            continue  # nothing to serve (training, failed) or made for an older inventory
        tensors = src.load_weights(record)
        if record.kind == "routing":
            dst.put_routing(record.id, refine_row(tensors["logits"], factor), method=record.method,
                            source=record.source, metrics=record.metrics)
        else:
            dst.put_lora(record.id, tensors, method=record.method, source=record.source, metrics=record.metrics)
        formats[record.id] = record.prompt_format
    spec = dataclasses.replace(info.spec, n_heads=heads)
    made_by = {**info.made_by, "refined_from_heads": h}
    out = dst.save_inventory(
        spec, list(info.layer_names), list(info.layer_dims), fine, backbone_fingerprint=info.backbone_fingerprint,
        backbone_name=info.backbone_name, made_by=made_by, dtype=next(iter(skills.values())).dtype,
    )
    for record in dst.list_tasks():  # now that the inventory exists, the tasks belong to it
        dst.put_record(dataclasses.replace(record, inventory_version=out.version, prompt_format=formats[record.id]))
    return out
