"""What a new sandbox starts from: an image plus what a template or snapshot says of it."""

from __future__ import annotations

from dataclasses import dataclass, field

from sandlot.core.models import MountedVolume
from sandlot.runtime.base import Image


@dataclass(frozen=True)
class Source:
    image: Image
    env: dict[str, str] = field(default_factory=dict)
    template: str | None = None
    snapshot_id: str | None = None
    workdir: str | None = None
    user: str | None = None
    started_from: str | None = None  # a template's snapshot after its start command
    owner: str | None = None  # the tenant of a template's snapshot
    # a snapshot's volumes, mounted in its memory, and their host (where it may start)
    volume_mounts: tuple[MountedVolume, ...] = ()
    volume_host: str | None = None
