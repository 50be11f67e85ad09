"""POST /v1/tasks with "method": "lora": bring your own LoRA over HTTP (admin keys only, once set).

    {"task": ID, "method": "lora", "adapter": base64(adapter_model.safetensors),
     "adapter_config": {...adapter_config.json...}, "project": false}
    -> 201 {"task": <the task, as GET /v1/tasks/{task}>, "import": {...}}

The bytes are parsed as safetensors only (never pickle); adapters_store.interop.lora_import decides what
can be served and says why not (422 naming `adapter_config` or `adapter`); an existing id is 409.
With project: true the task becomes the routing row fitted to the LoRA (adapters_store.interop.lora_project),
and "import" reports the fit error. The work runs off the event loop.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from typing import Any

from fastapi.responses import JSONResponse

from adapters_store.interop.lora_import import ImportRefused, import_lora
from adapters_store.store.errors import TaskExists, TaskLimit
from server.api.errors import ApiError
from server.api.schemas import task_out
from server.registry.ownership import owner_of_new_task
from server.tenancy import tenants
from server.wiring.runtime import Runtime

# what JSON Schema cannot say: the bytes are not a LoRA this store can serve
CODE = "invalid_adapter"


def _tensors(data: str) -> dict[str, Any]:
    from safetensors.torch import load

    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(422, "validation_error", "adapter: not base64", param="adapter", code=CODE) from None
    try:
        return load(raw)
    except Exception:  # noqa: BLE001 - SafetensorError, OverflowError...: all mean unreadable
        raise ApiError(422, "validation_error", "adapter: not a safetensors file", param="adapter",
                       code=CODE) from None


async def import_lora_task(body: Any, rt: Runtime) -> JSONResponse:

    if body.adapter is None:
        raise ApiError(422, "validation_error", "adapter: required with method lora", param="adapter")
    if body.adapter_config is None:
        raise ApiError(422, "validation_error", "adapter_config: required with method lora", param="adapter_config")
    if rt.registry.cache is None:
        raise ApiError(409, "conflict", "no skill inventory is loaded: a LoRA cannot be imported")

    caller = tenants.current()

    def work() -> dict[str, Any]:
        tensors = _tensors(body.adapter)
        if not rt.registry.store.has_task(body.task):  # an existing id answers 409 conflict below
            rt.registration.check_task_quota(caller)
        try:
            record = import_lora(rt.registry.store, body.task, body.adapter_config, tensors,
                                 source={"imported_from": "POST /v1/tasks"}, owner=owner_of_new_task(caller),
                                 shared=bool(body.shared), max_tasks=rt.settings.max_tasks)
        except ImportRefused as err:
            raise ApiError(422, "validation_error", f"adapter_config: {err}", param="adapter_config",
                           code=CODE) from None
        except TaskExists as err:
            raise ApiError(409, "conflict", str(err), param="task") from None
        except TaskLimit as err:
            raise ApiError(409, "task_limit", str(err), param="task") from None
        except ValueError as err:  # the id (reserved)
            raise ApiError(422, "validation_error", f"task: {err}", param="task") from None
        report: dict[str, Any] = {"kind": "lora", "params": record.params}
        if body.project:
            from adapters_store.interop.lora_project import project_task

            report["project"] = project_task(rt.registry.store, record.id)
        rt.registry.forget(record.id)
        return {"task": task_out(rt.registry.get(record.id, caller)).model_dump(), "import": report}

    return JSONResponse(status_code=201, content=await asyncio.to_thread(work))
