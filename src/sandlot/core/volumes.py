"""Volumes: records (per tenant, names unique within it) of directories on the host that
made them, mounted into that tenant's sandboxes (runtime `mount_volume`; the mechanism is in
docs/design.md, "Volumes").

A volume's data lives on one host: a sandbox mounts it only there. Deleting a volume removes
its files at once; sandboxes that have it mounted keep the mount, whose operations fail
(ESTALE) from then on. A delete is not refused while the volume is mounted: a mount lives in
guest memory, so paused sandboxes and snapshots hold it too, and no count of its holders
would be right (E2B's documents do not say what a delete of a mounted volume does).
"""

from __future__ import annotations

import posixpath
import re
import secrets
import time
from datetime import UTC, datetime

from sandlot.core.db import MetadataStore, NameTaken, scoped_name
from sandlot.core.models import VolumeInfo, VolumeMount
from sandlot.core.tenancy import NOBODY, Principal, tenant_of
from sandlot.core.volume_content import VolumeContent
from sandlot.errors import ConflictError, InvalidArgumentError, NotFoundError
from sandlot.runtime.base import Runtime, Vm

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$")
VOLUME_ID_RE = re.compile(r"^vol-[0-9a-f]{12}$")
# Mount paths a volume may not cover: the guest's own system and the agent's files.
RESERVED = ("/", "/bin", "/boot", "/dev", "/etc", "/lib", "/lib64", "/opt/sandlot", "/proc",
            "/run", "/sbin", "/sys", "/usr", "/var")


def check_mount_path(path: str) -> str:
    if not path.startswith("/") or posixpath.normpath(path) != path or "\0" in path:
        raise InvalidArgumentError(f"volume mount path {path[:200]!r} must be a clean "
                                   f"absolute path (like /mnt/data)")
    if path in RESERVED or any(path.startswith(p + "/") for p in RESERVED if p not in (
            "/", "/var", "/run")) or path.startswith("/opt/sandlot/"):
        raise InvalidArgumentError(f"a volume cannot be mounted at {path!r} (a system path)")
    return path


class Volumes:
    """The volume records of the deployment, and their mounts."""

    def __init__(self, db: MetadataStore, runtime: Runtime, host_id: str) -> None:
        self.db = db
        self.runtime = runtime
        self.host_id = host_id
        self.content = VolumeContent(self)  # its files, from outside any sandbox

    @staticmethod
    def _info(doc: dict) -> VolumeInfo:
        return VolumeInfo.model_validate(doc)

    async def create(self, name: str, who: Principal) -> VolumeInfo:
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise InvalidArgumentError(
                "a volume name is 1-63 letters, digits, '-' or '_', starting with a letter "
                f"or digit; not {str(name)[:100]!r}")
        volume_id = "vol-" + secrets.token_hex(6)
        info = VolumeInfo(volume_id=volume_id, name=name, owner=who.tenant, host=self.host_id,
                          created_at=datetime.now(UTC))
        await self.runtime.create_volume(volume_id)
        try:
            await self.db.add_volume(volume_id, scoped_name(who.tenant, name) or "",
                                     self.host_id, info.model_dump(mode="json"), time.time())
        except NameTaken:
            await self.runtime.delete_volume(volume_id)
            raise ConflictError(f"a volume named {name!r} exists already") from None
        return info

    async def get(self, id_or_name: str, who: Principal) -> VolumeInfo:
        """A volume of `who`'s tenant by id or name; another tenant's is not found."""
        doc = None
        if VOLUME_ID_RE.match(id_or_name):
            doc = await self.db.get_volume(id_or_name)
        if doc is None and NAME_RE.match(id_or_name):
            doc = await self.db.get_volume(scoped_name(who.tenant, id_or_name) or "")
        if doc is None or not who.sees(doc.get("owner")):
            raise NotFoundError(f"volume {id_or_name[:100]!r} not found")
        return self._info(doc)

    async def locate(self, volume_id: str) -> str | None:
        """The host of a volume, for routing a request about it there (whose answer checks
        who asks); None if there is no such volume."""
        doc = await self.db.get_volume(volume_id) if VOLUME_ID_RE.match(volume_id) else None
        return doc.get("host") if doc else None

    async def holder_of(self, volume_id: str) -> Principal:
        """Who a credential of one volume (its E2B token) acts for: its tenant."""
        doc = await self.db.get_volume(volume_id) if VOLUME_ID_RE.match(volume_id) else None
        return tenant_of(doc.get("owner")) if doc else NOBODY

    async def list(self, who: Principal) -> list[VolumeInfo]:
        return [self._info(d) for d in await self.db.volumes() if who.sees(d.get("owner"))]

    async def delete(self, volume_id: str, who: Principal) -> None:
        info = await self.get(volume_id, who)
        if info.host != self.host_id:
            raise ConflictError(f"volume {info.volume_id} lives on host {info.host}: delete "
                                f"it through that host")
        await self.db.drop_volume(info.volume_id)
        await self.runtime.delete_volume(info.volume_id)

    async def resolve(self, mounts: list[VolumeMount], who: Principal
                      ) -> list[tuple[VolumeInfo, VolumeMount]]:
        """The volumes a new sandbox mounts, checked before it starts: `who`'s, on this host,
        at distinct paths."""
        out, paths = [], set()
        for m in mounts:
            check_mount_path(m.path)
            if m.path in paths:
                raise InvalidArgumentError(f"two volumes mounted at {m.path!r}")
            paths.add(m.path)
            info = await self.get(m.volume, who)
            if info.host != self.host_id:
                raise InvalidArgumentError(
                    f"volume {info.name!r} lives on host {info.host}, this sandbox would run "
                    f"on {self.host_id}: a volume is mounted on its own host only")
            out.append((info, m))
        return out

    async def mount(self, vm: Vm, mounts: list[tuple[VolumeInfo, VolumeMount]]) -> None:
        for info, m in mounts:
            await self.runtime.mount_volume(vm, info.volume_id, m.path, m.user)
