"""Who may see a task (and its jobs): the task's owner, admins, and everyone for shared tasks.

    owner None (shipped tasks, and records written before tenants)   shared: everyone
    shared True (an admin registered it with "shared": true)         everyone
    owner == the caller's tenant                                      the caller
    an admin tenant                                                   sees and manages every task
    anyone else                                                       404, as if it did not exist

Changing (deleting, re-registering a failed one) is the owner's and the admins'; a shared task
that a tenant sees is an admin's to change (403) once admin keys exist, and any key's before.

Isolation is on only when inference callers are identified (POLYSERVE_API_KEYS set); without
keys everything is everyone's, as before tenants.
"""

from __future__ import annotations

from adapters_store.store.records import TaskRecord
from server.tenancy.tenants import ANONYMOUS, Tenant


def can_see(record: TaskRecord, tenant: Tenant | None, *, isolated: bool) -> bool:
    if tenant is None or not isolated or tenant.admin:
        return True
    return record.owner is None or record.shared or record.owner == tenant.name


def can_change(record: TaskRecord, tenant: Tenant | None, *, isolated: bool, admins_exist: bool) -> bool:
    """Whether `tenant` may delete or replace a task it can see (can_see)."""
    if tenant is None or not isolated or tenant.admin or record.owner == tenant.name:
        return True
    # with only API keys nobody is an admin: any key keeps managing the shared tasks, as before tenants
    return not admins_exist and (record.owner is None or record.shared)


def owner_of_new_task(tenant: Tenant | None) -> str | None:
    """The owner a registration records: the caller's tenant, or None (shared) when nobody is
    identified (no keys configured)."""
    if tenant is None or tenant is ANONYMOUS:
        return None
    return tenant.name


def can_see_job(job_tenant: str | None, tenant: Tenant | None, *, isolated: bool) -> bool:
    """A job is its registering tenant's (and admins'); one from before tenants is everyone's."""
    if tenant is None or not isolated or tenant.admin:
        return True
    return job_tenant is None or job_tenant == tenant.name
