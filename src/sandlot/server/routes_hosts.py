"""/v1/hosts: the hosts of the deployment, and draining one."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel

from sandlot.core.hosts import HostInfo, HostState
from sandlot.server.auth import require_admin
from sandlot.server.deps import core

# The deployment's hosts are the operators' business: admin keys only.
router = APIRouter(prefix="/v1/hosts", tags=["hosts"], dependencies=[Depends(require_admin)])


class HostList(BaseModel):
    hosts: list[HostInfo]
    this_host: str  # the id of the host that answered


@router.get("", response_model=HostList)
async def list_hosts(request: Request) -> HostList:
    c = core(request)
    return HostList(hosts=await c.hosts.list(), this_host=c.host_id)


@router.get("/{host_id}", response_model=HostInfo)
async def get_host(host_id: str, request: Request) -> HostInfo:
    return await core(request).hosts.get(host_id)


@router.post("/{host_id}/drain", response_model=HostInfo)
async def drain_host(host_id: str, request: Request) -> HostInfo:
    """No new sandboxes go to the host; those it runs run to their end."""
    return await core(request).hosts.set_state(host_id, HostState.DRAINING)


@router.post("/{host_id}/activate", response_model=HostInfo)
async def activate_host(host_id: str, request: Request) -> HostInfo:
    """A drained host takes new sandboxes again."""
    return await core(request).hosts.set_state(host_id, HostState.ACTIVE)
