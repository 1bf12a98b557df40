"""Where a new sandbox runs, in a deployment of several hosts (core/hosts.py ranks them).

A create or restore that another host should take is sent there as it came (its answer comes
back as is); a fork whose children do not all fit on the parent's host starts the rest
elsewhere from a snapshot of the parent, taken once for all of them.
"""

from __future__ import annotations

import asyncio
import logging

import httpx
from fastapi import Request, Response

from sandlot.core.hosts import HostInfo, Need
from sandlot.core.models import CreateSandbox, SandboxRecord, SnapshotState
from sandlot.core.service import Core
from sandlot.errors import CapacityError, SandlotError, StorageError
from sandlot.server.deps import core
from sandlot.server.forward import FORWARDED, HOP_BY_HOP, Peers

log = logging.getLogger(__name__)
DEFAULT_MEMORY_MB = 512
SPREAD_SNAPSHOT_WAIT = 600.0


def peers(request: Request) -> Peers:
    return request.app.state.peers


async def need_of(c: Core, req: CreateSandbox) -> Need:
    """What a create asks of a host: its memory, and its image (cached hosts first)."""
    try:
        source = await c.sandboxes.resolve_source(req)
    except SandlotError:
        return Need(memory_mb=req.memory_mb or DEFAULT_MEMORY_MB)
    return Need(memory_mb=req.memory_mb or source.image.machine.memory_mb,
                image_key=source.image.key)


async def elsewhere(request: Request, req: CreateSandbox) -> Response | None:
    """None when this host takes the create; else the answer of the host that took it."""
    c = core(request)
    if not c.hosts.shared or request.headers.get(FORWARDED):
        return None
    body = await request.body()
    answer = None
    for host in await c.hosts.place(await need_of(c, req)):
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
    headers.append((FORWARDED.encode(), core(request).host_id.encode()))
    url = host.url.rstrip("/") + request.url.path
    if request.url.query:
        url += "?" + request.url.query
    try:
        r = await peers(request).client.request(request.method, url, headers=headers,
                                                content=body)
    except httpx.HTTPError as e:
        return Response(status_code=CapacityError.status, content=str(e))
    keep = {"content-type"}
    return Response(r.content, r.status_code,
                    headers={k: v for k, v in r.headers.items() if k.lower() in keep})


async def fork_spread(request: Request, parent_id: str, count: int
                      ) -> list[SandboxRecord | SandlotError]:
    """`count` children of `parent_id` on other hosts: one snapshot of the parent, restored
    where placement puts each child; the snapshot goes once they run."""
    c = core(request)
    parent = (await c.sandboxes.get(parent_id))
    snap = await c.sandboxes.snapshot(parent_id, internal=True)
    try:
        snap = await c.snapshots.wait(snap.snapshot_id, SPREAD_SNAPSHOT_WAIT)
        if snap.state != SnapshotState.READY:
            error = StorageError(f"the parent's state could not be stored for children on "
                                 f"other hosts: {snap.error or snap.state.value}")
            return [error] * count
        req = CreateSandbox(snapshot_id=snap.snapshot_id, memory_mb=parent.memory_mb,
                            cpus=parent.cpus, env=parent.env, metadata=parent.metadata,
                            timeout=parent.timeout, internet=parent.internet,
                            network=parent.network)
        body = req.model_dump_json(exclude_none=True).encode()
        need = Need(memory_mb=parent.memory_mb, image_key=snap.snapshot_id)

        async def child() -> SandboxRecord | SandlotError:
            try:
                hosts = [h for h in await c.hosts.place(need) if h.id != c.host_id]
            except CapacityError as e:
                return e
            last: SandlotError = CapacityError("no other host has room for a fork child")
            for host in hosts:
                r = await _post_json(request, host, "/v1/sandboxes", body)
                if r.status_code == 201:
                    return SandboxRecord.model_validate_json(r.content)
                last = _error_of(r)
                if r.status_code != CapacityError.status:
                    break
            return last

        return list(await asyncio.gather(*(child() for _ in range(count))))
    finally:
        try:
            await c.snapshots.delete(snap.snapshot_id)
        except SandlotError as e:
            log.warning("fork snapshot %s not deleted: %s", snap.snapshot_id, e.message)


async def _post_json(request: Request, host: HostInfo, path: str, body: bytes
                     ) -> httpx.Response:
    headers = {"content-type": "application/json", FORWARDED: core(request).host_id}
    auth = request.headers.get("authorization")
    if auth:
        headers["authorization"] = auth
    try:
        return await peers(request).client.post(host.url.rstrip("/") + path, content=body,
                                                headers=headers)
    except httpx.HTTPError as e:
        return httpx.Response(CapacityError.status, json={"error": {
            "type": "CapacityError", "message": f"host {host.id} did not answer: {e}"}})


def _error_of(r: httpx.Response) -> SandlotError:
    from sandlot import errors

    try:
        err = r.json()["error"]
        kind = getattr(errors, err["type"], SandlotError)
        if not (isinstance(kind, type) and issubclass(kind, SandlotError)):
            kind = SandlotError
        return kind(err["message"])
    except (ValueError, KeyError, TypeError):
        return SandlotError(f"HTTP {r.status_code}: {r.text[:200]}")
