"""Data objects the SDK returns. They mirror the objects in docs/api.md and ignore unknown fields,
so a newer server can add fields without breaking older clients."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class SandboxInfo(_Model):
    """A sandbox as the server describes it. `state` is ``starting``, ``running``, ``paused``
    (its whole state kept; `resume` brings it back), ``stopped``, ``failed`` or ``lost`` (its
    host stopped answering). `host` is the id of the host that runs it."""

    sandbox_id: str
    template: str | None = None
    snapshot_id: str | None = None
    forked_from: str | None = None  # the parent of a fork child
    state: str = "running"
    memory_mb: int | None = None
    cpus: int | None = None
    disk_mb: int | None = None  # the disk its guest sees: its quota
    metadata: dict[str, str] = Field(default_factory=dict)
    env: dict[str, str] = Field(default_factory=dict)
    created_at: datetime | None = None
    expires_at: datetime | None = None
    timeout: int | None = None
    internet: bool = True
    generation: str | None = None
    on_timeout: str = "kill"
    pause_memory: bool = True
    auto_resume: bool = False
    host: str | None = None
    pid: int | None = None
    error: str | None = None  # why it failed, if it did


class SnapshotInfo(_Model):
    """A snapshot as the server describes it.

    `state` goes ``creating`` -> ``uploading`` -> ``ready``, or ends in ``failed`` (see `error`)
    or ``deleted``.
    """

    snapshot_id: str
    name: str | None = None
    state: str = "creating"
    error: str | None = None
    sandbox_id: str | None = None
    template: str | None = None
    memory_mb: int | None = None
    cpus: int | None = None
    created_at: datetime | None = None
    ready_at: datetime | None = None
    size_bytes: int | None = None
    stored_bytes: int | None = None
    pause_ms: float | None = None
    capture_ms: float | None = None
    memory: bool = True  # False: the filesystem only; sandboxes made from it boot


class TemplateInfo(_Model):
    """A built template on the server."""

    name: str
    hash: str | None = None
    memory_mb: int | None = None
    cpus: int | None = None
    env: dict[str, str] = Field(default_factory=dict)
    workdir: str | None = None
    built_at: datetime | None = None
    image: str | None = None  # the pinned image reference (or Dockerfile) it was built from
    user: str | None = None  # commands' default user (the image's USER); None: root
    entrypoint: list[str] = Field(default_factory=list)  # the image's, recorded, not run
    cmd: list[str] = Field(default_factory=list)


class SandboxMetrics(_Model):
    """A sample of a sandbox's use, taken by its host. `cpu_used_pct` is of its own vCPUs;
    `mem_used` is memory that is its own on the host; `disk_used` the bytes its own disk
    layers hold."""

    timestamp: datetime
    cpu_count: int = 0
    cpu_used_pct: float = 0.0
    mem_used: int = 0
    mem_total: int = 0
    disk_used: int = 0
    disk_total: int = 0
    disk_errors: int = 0  # its disk I/Os the host failed


class HostInfo(_Model):
    """A host of the deployment (``GET /v1/hosts``). `state` is ``active``, ``draining`` (no
    new sandboxes), ``lost`` (stopped heartbeating) or ``stopped``."""

    id: str
    url: str = ""
    state: str = "active"
    cores: int = 0
    memory_mb: int = 0
    memory_free_mb: int = 0
    disk_free_mb: int = 0
    cache_free_mb: int = 0
    slots: int = 0
    sandboxes: int = 0
    heartbeat_age_s: float = 0.0


class ProcessInfo(_Model):
    """A process started with ``commands.run``/``commands.start``."""

    pid: int
    cmd: str = ""
    user: str | None = None
    running: bool = True
    exit_code: int | None = None
    started_at: float | None = None
    pty: bool = False  # it runs on a terminal (``sbx.pty``)


class EntryInfo(_Model):
    """A file system entry in a sandbox. `type` is ``file``, ``dir``, ``symlink`` or ``other``."""

    name: str
    path: str
    type: str = "file"
    size: int = 0
    mode: int | None = None
    owner: str | None = None
    mtime: float | None = None
    target: str | None = None  # a symlink's
    metadata: dict[str, str] | None = None  # user metadata given when it was written


@dataclass(frozen=True)
class CommandResult:
    """The outcome of a finished command. `ok` is ``exit_code == 0``."""

    stdout: str
    stderr: str
    exit_code: int
    ok: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ok", self.exit_code == 0)


def parse_list(model: type[_Model], data: Any, key: str) -> list[Any]:
    """Parse ``{key: [obj, ...]}`` into a list of `model`."""
    return [model.model_validate(item) for item in (data or {}).get(key, [])]
