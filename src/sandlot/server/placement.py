"""Where a new sandbox runs, in a deployment of several hosts (core/hosts.py ranks them).

A create, restore or resume that another host should take is sent there as it came (its
answer comes back as is); a fork whose children do not all fit on the parent's host (or all of
them, when it is draining) starts the rest elsewhere from one snapshot of the parent.
"""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
from fastapi import Request, Response

from sandlot.core.hosts import HostInfo, HostState, Need
from sandlot.core.models import CreateSandbox, SandboxRecord, SnapshotState
from sandlot.core.service import Core
from sandlot.core.tenancy import Principal
from sandlot.errors import CapacityError, HostUnavailableError, SandlotError, StorageError
from sandlot.server.auth import who
from sandlot.server.deps import core
from sandlot.server.errors import error_body
from sandlot.server.forward import FORWARDED, HOP_BY_HOP, Peers, forwarded

log = logging.getLogger(__name__)
DEFAULT_MEMORY_MB = 512
SPREAD_SNAPSHOT_WAIT = 600.0
FORKED_FROM = "x-sandlot-forked-from"  # on a fork child's create sent to another host


def peers(request: Request) -> Peers:
    return request.app.state.peers


def placing(request: Request) -> bool:
    """Whether this request is placed here (a deployment, and not already placed)."""
    return core(request).hosts.shared and not forwarded(request.scope)


def forked_from(request: Request) -> str | None:
    """The parent of a fork child another host asked this one to start."""
    return request.headers.get(FORKED_FROM) if forwarded(request.scope) else None


async def need_of(c: Core, req: CreateSandbox, caller: Principal) -> Need:
    """What a create asks of a host: its memory, and its image (cached hosts first)."""
    try:
        source = await c.sandboxes.resolve_source(req, caller)
    except SandlotError:
        return Need(memory_mb=req.memory_mb or DEFAULT_MEMORY_MB)
    return Need(memory_mb=req.memory_mb or source.image.machine.memory_mb,
                image_key=source.image.key)


async def elsewhere(request: Request, req: CreateSandbox | None = None,
                    need: Need | None = None) -> Response | None:
    """None when this host takes the create (or resume); else the answer of the host that
    took it."""
    c = core(request)
    if not placing(request):
        return None
    need = need or await need_of(c, req or CreateSandbox(), who(request))
    body = await request.body()
    answer = None
    for host in await c.hosts.place(need):
        if host.id == c.host_id:
            return None
        answer = await _send(request, host, body)
        if answer.status_code != CapacityError.status:
            return answer
        log.info("host %s had no room after all; trying the next", host.id)
    return answer


async def _send(request: Request, host: HostInfo, body: bytes) -> Response:
    headers = [(k, v) for k, v in request.headers.raw
               if k.lower() not in HOP_BY_HOP and k.lower() != b"content-length"]
    headers.append((FORWARDED.encode(), peers(request).token.encode()))
    url = host.url.rstrip("/") + request.url.path
    if request.url.query:
        url += "?" + request.url.query
    try:
        r = await peers(request).client.request(request.method, url, headers=headers,
                                                content=body)
    except httpx.HTTPError as e:
        error = HostUnavailableError(f"host {host.id} did not answer: {e}")
        return Response(json.dumps(error_body(type(error).__name__, error.message)),
                        CapacityError.status, media_type="application/json")
    keep = {"content-type"}
    return Response(r.content, r.status_code,
                    headers={k: v for k, v in r.headers.items() if k.lower() in keep})


def children_here(request: Request, count: int) -> int:
    """How many of a fork's `count` children start on this host."""
    c = core(request)
    if not c.hosts.shared:
        return count
    if c.hosts.state != HostState.ACTIVE:
        return 0
    return min(count, c.sandboxes.free_slots())


async def fork_spread(request: Request, parent_id: str, count: int
                      ) -> list[SandboxRecord | SandlotError]:
    """`count` children of `parent_id` on other hosts: one snapshot of the parent, restored
    where placement puts each child (spread by free slots); the snapshot goes once they run."""
    c, caller = core(request), who(request)
    parent = await c.sandboxes.get(parent_id, caller)
    snap = await c.sandboxes.snapshot(parent_id, internal=True, who=caller)
    try:
        snap = await c.snapshots.wait(snap.snapshot_id, SPREAD_SNAPSHOT_WAIT, who=caller)
        if snap.state != SnapshotState.READY:
            error = StorageError(f"the parent's state could not be stored for children on "
                                 f"other hosts: {snap.error or snap.state.value}")
            return [error] * count
        req = CreateSandbox(snapshot_id=snap.snapshot_id, memory_mb=parent.memory_mb,
                            cpus=parent.cpus, env=parent.env, metadata=parent.metadata,
                            timeout=parent.timeout, internet=parent.internet,
                            network=parent.network)
        body = req.model_dump_json(exclude_none=True).encode()
        try:
            hosts = [h for h in await c.hosts.place(Need(memory_mb=parent.memory_mb,
                                                         image_key=snap.snapshot_id))
                     if h.id != c.host_id]
        except CapacityError as e:
            return [e] * count
        plan = _spread(hosts, count)

        async def child(first: int) -> SandboxRecord | SandlotError:
            last: SandlotError = CapacityError("no other host has room for a fork child")
            for host in hosts[first:] + hosts[:first]:  # its own host first, then the others
                r = await _post_json(request, host, "/v1/sandboxes", body, parent_id)
                if r.status_code == 201:
                    return SandboxRecord.model_validate_json(r.content)
                last = _error_of(r)
                if r.status_code != CapacityError.status:
                    break
            return last

        return list(await asyncio.gather(*(child(i) for i in plan)))
    finally:
        try:
            await c.snapshots.delete(snap.snapshot_id, who=caller)
        except SandlotError as e:
            log.warning("fork snapshot %s not deleted: %s", snap.snapshot_id, e.message)


def _spread(hosts: list[HostInfo], count: int) -> list[int]:
    """Which host (an index into `hosts`, best first) each of `count` children goes to: the
    one with the most free slots left each time, ties to the better ranked."""
    if not hosts:
        return [0] * count
    free = [max(h.free_slots, 0) for h in hosts]
    plan = []
    for _ in range(count):
        i = max(range(len(hosts)), key=lambda j: (free[j], -j))
        plan.append(i)
        free[i] -= 1
    return plan


async def _post_json(request: Request, host: HostInfo, path: str, body: bytes,
                     parent_id: str) -> httpx.Response:
    headers = {"content-type": "application/json", FORWARDED: peers(request).token,
               FORKED_FROM: parent_id}
    auth = request.headers.get("authorization")
    if auth:
        headers["authorization"] = auth
    try:
        return await peers(request).client.post(host.url.rstrip("/") + path, content=body,
                                                headers=headers)
    except httpx.HTTPError as e:
        return httpx.Response(CapacityError.status, json=error_body(
            "HostUnavailableError", f"host {host.id} did not answer: {e}"))


def _error_of(r: httpx.Response) -> SandlotError:
    from sandlot.errors import ERRORS

    try:
        err = r.json()["error"]
        return ERRORS.get(err["type"], SandlotError)(err["message"])
    except (ValueError, KeyError, TypeError):
        return SandlotError(f"HTTP {r.status_code}: {r.text[:200]}")
