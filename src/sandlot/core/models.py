"""Core records and requests. The server returns these models as-is; they know nothing of HTTP."""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field

from sandlot.errors import InvalidStateError

log = logging.getLogger("sandlot.lifecycle")


def now() -> datetime:
    return datetime.now(UTC)


class SandboxState(StrEnum):
    STARTING = "starting"
    RUNNING = "running"
    STOPPED = "stopped"
    FAILED = "failed"


class SnapshotState(StrEnum):
    CREATING = "creating"
    UPLOADING = "uploading"
    READY = "ready"
    FAILED = "failed"
    DELETED = "deleted"


SANDBOX_TRANSITIONS: dict[SandboxState, set[SandboxState]] = {
    SandboxState.STARTING: {SandboxState.RUNNING, SandboxState.FAILED, SandboxState.STOPPED},
    SandboxState.RUNNING: {SandboxState.STOPPED, SandboxState.FAILED, SandboxState.STARTING},
    SandboxState.FAILED: {SandboxState.STOPPED},
    SandboxState.STOPPED: set(),
}
SNAPSHOT_TRANSITIONS: dict[SnapshotState, set[SnapshotState]] = {
    SnapshotState.CREATING: {SnapshotState.UPLOADING, SnapshotState.READY, SnapshotState.FAILED},
    SnapshotState.UPLOADING: {SnapshotState.READY, SnapshotState.FAILED},
    SnapshotState.READY: {SnapshotState.DELETED},
    SnapshotState.FAILED: {SnapshotState.DELETED},
    SnapshotState.DELETED: set(),
}


def transition(record: SandboxRecord | SnapshotRecord, new: StrEnum) -> None:
    """The one guard for lifecycle changes: raises InvalidStateError, logs every move."""
    table = SANDBOX_TRANSITIONS if isinstance(record, SandboxRecord) else SNAPSHOT_TRANSITIONS
    current = record.state
    if new != current and new not in table[current]:
        raise InvalidStateError(current=current.value,
                                allowed=tuple(s.value for s in table if new in table[s]))
    log.info("%s %s -> %s", record.key, current.value, new.value)
    record.state = new


class NetworkSpec(BaseModel):
    """Egress rules, enforced outside the guest."""

    model_config = ConfigDict(extra="forbid")
    allow_out: list[str] = Field(default_factory=list)
    deny_out: list[str] = Field(default_factory=list)


class SandboxRecord(BaseModel):
    sandbox_id: str
    state: SandboxState = SandboxState.STARTING
    template: str | None = None
    snapshot_id: str | None = None
    memory_mb: int
    cpus: int
    env: dict[str, str] = Field(default_factory=dict)
    metadata: dict[str, str] = Field(default_factory=dict)
    created_at: datetime = Field(default_factory=now)
    expires_at: datetime | None = None
    timeout: int = 300
    internet: bool = True
    network: NetworkSpec | None = None
    generation: str = ""
    pid: int | None = None
    error: str | None = None
    # Internal bookkeeping (not part of the API shape, but harmless to show).
    source_key: str = Field("", exclude=True)
    base: str = Field("", exclude=True)
    workdir: str | None = Field(None, exclude=True)
    disk_index: int = Field(0, exclude=True)
    hotplug_mb: int = Field(0, exclude=True)

    @property
    def key(self) -> str:
        return self.sandbox_id


class SnapshotRecord(BaseModel):
    snapshot_id: str
    name: str | None = None
    state: SnapshotState = SnapshotState.CREATING
    error: str | None = None
    sandbox_id: str | None = None
    template: str | None = None
    memory_mb: int = 512
    cpus: int = 1
    env: dict[str, str] = Field(default_factory=dict)
    created_at: datetime = Field(default_factory=now)
    ready_at: datetime | None = None
    size_bytes: int | None = None
    stored_bytes: int | None = None
    pause_ms: float | None = None
    capture_ms: float | None = None
    internal: bool = False
    ram_mb: int = Field(0, exclude=True)  # main RAM; memory_mb - ram_mb is the pc-dimm
    device_model: str = Field("", exclude=True)
    workdir: str | None = Field(None, exclude=True)
    base: str = Field("", exclude=True)  # template build hash: kernel, initrd, rootfs

    @property
    def key(self) -> str:
        return self.snapshot_id


class SandboxOverrides(BaseModel):
    """What a caller may set on a new sandbox; None takes the template's or snapshot's."""

    model_config = ConfigDict(extra="forbid")
    memory_mb: int | None = Field(None, ge=128, le=16384)
    cpus: int | None = Field(None, ge=1, le=4)
    env: dict[str, str] | None = None
    timeout: int | None = Field(None, ge=0, le=24 * 3600)
    metadata: dict[str, str] | None = None
    internet: bool = True
    network: NetworkSpec | None = None


class CreateSandbox(SandboxOverrides):
    """A new sandbox from a template or a snapshot."""

    template: str | None = None
    snapshot_id: str | None = None


class ExecRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    cmd: str = Field(min_length=1)
    env: dict[str, str] | None = None
    cwd: str | None = None
    user: str = "root"
    timeout: float | None = Field(60, ge=0)
    stdin: str | None = None
    background: bool = False


class TemplateInfo(BaseModel):
    name: str
    hash: str
    memory_mb: int
    cpus: int
    env: dict[str, str] = Field(default_factory=dict)
    workdir: str | None = None
    built_at: datetime | None = None
    kernel: str | None = None
    boot_ms: float | None = None
    device_model: str = ""


def to_doc(record: BaseModel) -> dict:
    """Persisted form of a record: its API shape plus its internal (excluded) fields."""
    doc = record.model_dump(mode="json")
    for name, info in type(record).model_fields.items():
        if info.exclude:
            doc[name] = getattr(record, name)
    return doc
