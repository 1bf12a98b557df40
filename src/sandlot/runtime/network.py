"""Sandbox networking for the runtime: a namespace per VM (vmm.network), async.

Off when ``SANDLOT_NETWORK=off`` (sandboxes then get QEMU's restricted user network: no
outbound access at all). ``SANDLOT_DNS`` (comma-separated) overrides the upstream resolvers
(config.Settings reads both).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import re
import shutil

from sandlot.config import Settings
from sandlot.errors import InvalidArgumentError
from sandlot.vmm.network import NetworkManager, NetworkPolicy, PendingNetwork, SandboxNetwork

log = logging.getLogger(__name__)


def network_owner(instance: str) -> str:
    """The tag a server's network objects carry, from its SANDLOT_INSTANCE."""
    return re.sub(r"[^a-z0-9]", "", instance.lower())[:16]


class Networking:
    """Async face of NetworkManager for the runtime."""

    def __init__(self, manager: NetworkManager) -> None:
        self.manager = manager

    @classmethod
    def from_settings(cls, settings: Settings) -> Networking | None:
        """The host's sandbox networking as `settings` say; None when off (or not root)."""
        if not settings.network:
            return None
        if os.geteuid() != 0 or shutil.which("nft") is None or shutil.which("ip") is None:
            log.warning("sandbox networking is off: it needs root, nft and ip")
            return None
        return cls(NetworkManager(dns_servers=list(settings.dns_servers) or None,
                                  pool=settings.net_pool, owner=network_owner(settings.instance),
                                  table=settings.net_table))

    async def attach(self, vm_id: str, policy: NetworkPolicy,
                     tap_owner: int | None = None) -> SandboxNetwork:
        return await asyncio.to_thread(functools.partial(
            self.manager.setup, vm_id, policy, tap_owner=tap_owner))

    async def begin(self, vm_id: str, policy: NetworkPolicy,
                    tap_owner: int | None = None) -> PendingNetwork:
        """`attach` in two parts: the namespace and its tap (a QEMU can start in it)..."""
        return await asyncio.to_thread(functools.partial(
            self.manager.begin, vm_id, policy, tap_owner=tap_owner))

    async def finish(self, pending: PendingNetwork) -> SandboxNetwork:
        """... then its addresses, routes and rules (before the guest runs)."""
        return await asyncio.to_thread(self.manager.finish, pending)

    async def abandon(self, pending: PendingNetwork) -> None:
        await asyncio.to_thread(self.manager.abandon, pending)

    async def detach(self, vm_id: str) -> None:
        await asyncio.to_thread(self.manager.teardown, vm_id)

    async def update(self, vm_id: str, policy: NetworkPolicy) -> None:
        await asyncio.to_thread(self.manager.update_egress, vm_id, policy)

    async def expose(self, sandbox_id: str, port: int) -> tuple[str, int]:
        if not 1 <= port <= 65535:
            raise InvalidArgumentError("port must be between 1 and 65535")
        return await self.manager.expose(sandbox_id, port)

    async def recover(self, live: dict[str, NetworkPolicy]) -> list[str]:
        """Drop every namespace not of `live`; re-apply the live ones' egress rules.

        Returns the ids whose network could not be recovered.
        """
        await asyncio.to_thread(self.manager.cleanup_stale, set(live))
        lost = []
        for vm_id, policy in live.items():
            try:
                await asyncio.to_thread(self.manager.update_egress, vm_id, policy)
            except Exception as e:  # noqa: BLE001 - reported; the VM is then stopped
                log.warning("network of %s not recovered: %s", vm_id, e)
                lost.append(vm_id)
        return lost
