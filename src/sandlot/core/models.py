"""Core records and requests. The server returns these models as-is; they know nothing of HTTP."""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, PlainSerializer
from pydantic.json_schema import SkipJsonSchema

from sandlot.errors import InvalidStateError, without_paths

# Why a sandbox or snapshot failed, as answers show it: without host paths (the server's log
# has the whole message).
ErrorText = Annotated[str | None, PlainSerializer(
    lambda v: without_paths(v) if v else v, return_type=str | None, when_used="json")]

log = logging.getLogger("sandlot.lifecycle")


def now() -> datetime:
    return datetime.now(UTC)


class SandboxState(StrEnum):
    STARTING = "starting"
    RUNNING = "running"
    PAUSED = "paused"  # its state is in a snapshot (`paused_snapshot`); no VM runs
    STOPPED = "stopped"
    FAILED = "failed"
    LOST = "lost"  # its host stopped answering (core/hosts.py); it is not running anywhere


class SnapshotState(StrEnum):
    CREATING = "creating"
    UPLOADING = "uploading"
    READY = "ready"
    FAILED = "failed"
    DELETED = "deleted"


class SnapshotKind(StrEnum):
    USER = "user"  # taken by a user: listed, named, restorable
    PAUSE = "pause"  # holds a paused sandbox's state: not listed, gone when it resumes


SANDBOX_TRANSITIONS: dict[SandboxState, set[SandboxState]] = {
    # (paused again: a resume that failed, its state still stored)
    SandboxState.STARTING: {SandboxState.RUNNING, SandboxState.FAILED, SandboxState.STOPPED,
                            SandboxState.LOST, SandboxState.PAUSED},
    SandboxState.RUNNING: {SandboxState.STOPPED, SandboxState.FAILED, SandboxState.STARTING,
                           SandboxState.PAUSED, SandboxState.LOST},
    SandboxState.PAUSED: {SandboxState.STARTING, SandboxState.STOPPED},
    SandboxState.FAILED: {SandboxState.STOPPED},
    SandboxState.STOPPED: set(),
    SandboxState.LOST: {SandboxState.STOPPED},  # its host came back and removed it
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
    # IPv4 addresses the sandbox reaches whatever allow_out and deny_out say (E2B's
    # dnsServers; its own nameserver, 10.0.2.3, answers either way). None: none given
    dns_servers: list[str] | None = None


class MountedVolume(BaseModel):
    """A volume a sandbox has mounted (E2B's SandboxVolumeMount): its name, and where."""

    name: str
    path: str


class SandboxRecord(BaseModel):
    sandbox_id: str
    state: SandboxState = SandboxState.STARTING
    template: str | None = None
    snapshot_id: str | None = None
    memory_mb: int
    cpus: int
    # the disk its guest sees, MiB: its quota (its filesystem is full there: ENOSPC)
    disk_mb: int | None = None
    env: dict[str, str] = Field(default_factory=dict)
    metadata: dict[str, str] = Field(default_factory=dict)
    created_at: datetime = Field(default_factory=now)
    expires_at: datetime | None = None
    timeout: int = 300
    internet: bool = True
    network: NetworkSpec | None = None
    generation: str = ""
    forked_from: str | None = None  # the parent sandbox of a fork child
    on_timeout: Literal["kill", "pause"] = "kill"
    pause_memory: bool = True  # a pause at its timeout keeps memory (False: the disk only)
    auto_resume: bool = False
    pid: int | None = None
    error: ErrorText = None
    host: str | None = None  # the id of the host it runs on (GET /v1/hosts)
    # the volumes it has mounted (its restores and forks have them too: the mount is memory)
    volume_mounts: list[MountedVolume] = Field(default_factory=list)
    # Internal bookkeeping, persisted but not part of the API shape.
    image_key: str = Field("", exclude=True,
                           validation_alias=AliasChoices("image_key", "source_key"))
    build: str = Field("", exclude=True, validation_alias=AliasChoices("build", "base"))
    workdir: str | None = Field(None, exclude=True)
    user: str | None = Field(None, exclude=True)  # commands' default user (an image's USER)
    paused_snapshot: str | None = Field(None, exclude=True)
    owner: str | None = Field(None, exclude=True)  # its tenant (core/tenancy.py)
    # False: its port URLs need its traffic access token (E2B's allow_public_traffic)
    public_traffic: bool = Field(True, exclude=True)
    # the host its volumes live on: it runs there only (core/placement.py)
    volume_host: str | None = Field(None, exclude=True)

    @property
    def key(self) -> str:
        return self.sandbox_id


class SnapshotRecord(BaseModel):
    snapshot_id: str
    name: str | None = None
    state: SnapshotState = SnapshotState.CREATING
    error: ErrorText = None
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
    # False: the filesystem only (no memory, no processes); sandboxes made from it boot
    memory: bool = True
    kind: SnapshotKind = Field(SnapshotKind.USER, exclude=True)
    owner: str | None = Field(None, exclude=True)  # its tenant (core/tenancy.py)
    internal: bool = Field(False, exclude=True)  # a fork's, for children on other hosts
    machine: dict | None = Field(None, exclude=True)  # vmm.description.MachineDescription
    workdir: str | None = Field(None, exclude=True)
    user: str | None = Field(None, exclude=True)
    build: str = Field("", exclude=True, validation_alias=AliasChoices("build", "base"))
    # of a sandbox with volumes mounted (a snapshot with memory): what its sandboxes have
    # mounted, and the host they run on
    volume_mounts: list[MountedVolume] = Field(default_factory=list, exclude=True)
    volume_host: str | None = Field(None, exclude=True)

    @property
    def key(self) -> str:
        return self.snapshot_id


class SandboxOverrides(BaseModel):
    """What a caller may set on a new sandbox; None takes the template's or snapshot's."""

    model_config = ConfigDict(extra="forbid")
    memory_mb: int | None = Field(None, ge=128, le=16384)
    cpus: int | None = Field(None, ge=1, le=4)
    # the disk its guest sees (its quota), MiB: at most the server's SANDLOT_MAX_DISK_MB;
    # default the server's SANDLOT_DISK_QUOTA_MB; never less than its template's or snapshot's
    disk_mb: int | None = Field(None, ge=64)
    env: dict[str, str] | None = None
    timeout: int | None = Field(None, ge=0, le=24 * 3600)
    metadata: dict[str, str] | None = None
    internet: bool = True
    network: NetworkSpec | None = None
    # at its timeout: killed, or paused (its whole state kept, `resume` brings it back)
    on_timeout: Literal["kill", "pause"] = "kill"
    # a pause at its timeout keeps memory and processes; False: the filesystem only (smaller,
    # and the resume boots from the disk: processes start afresh)
    pause_memory: bool = True
    # a paused sandbox resumes by itself on the next request that needs it running
    auto_resume: bool = False
    # E2B's allow_public_traffic (server/ports.py); not part of sandlot's own API
    public_traffic: SkipJsonSchema[bool] = True


def overrides_of(rec: SandboxRecord, timeout: int | None = None) -> SandboxOverrides:
    """A new sandbox's settings as `rec`'s (a fork child's; `timeout`: another lifetime)."""
    return SandboxOverrides(
        memory_mb=rec.memory_mb, cpus=rec.cpus, disk_mb=rec.disk_mb, env=rec.env,
        timeout=rec.timeout if timeout is None else timeout, metadata=rec.metadata,
        internet=rec.internet, network=rec.network, on_timeout=rec.on_timeout,
        pause_memory=rec.pause_memory, auto_resume=rec.auto_resume,
        public_traffic=rec.public_traffic)


class VolumeMount(BaseModel):
    """A volume (by id or name) mounted in a new sandbox at `path`, its files `user`'s."""

    model_config = ConfigDict(extra="forbid")
    volume: str = Field(min_length=1, max_length=128)
    path: str = Field(min_length=2, max_length=1024)
    user: str | None = Field(None, max_length=64)


class VolumeInfo(BaseModel):
    """A volume: a directory on the host that made it, mountable in that tenant's sandboxes."""

    volume_id: str
    name: str
    owner: str | None = None
    host: str = ""
    created_at: datetime


class CreateSandbox(SandboxOverrides):
    """A new sandbox from a template, a snapshot or an OCI image."""

    template: str | None = None
    snapshot_id: str | None = None
    image: str | None = Field(None, max_length=512, description=(
        "an OCI image reference (`python:3.12-slim`, `registry:5000/team/app@sha256:...`): "
        "pulled and made a template on first use (by digest), a restore after that"))
    volume_mounts: list[VolumeMount] = Field(default_factory=list, max_length=16)


class TerminalSize(BaseModel):
    """A terminal's size in characters."""

    model_config = ConfigDict(extra="forbid")
    cols: int = Field(ge=1, le=4096)
    rows: int = Field(ge=1, le=4096)


class ExecRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    cmd: str = Field(min_length=1)
    env: dict[str, str] | None = None
    cwd: str | None = None
    user: str | None = Field(None, description="the guest user to run as; default the "
                             "template's (an image's USER), else root")
    timeout: float | None = Field(60, ge=0)
    stdin: str | None = None
    background: bool = False
    pty: TerminalSize | None = Field(
        None, description="run on a new terminal of this size (TERM=xterm-256color): its "
                          "output all `stdout`, input through stdin, size through resize; "
                          "needs `background`")


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
    machine: dict | None = None  # what its VM is: vmm.description.MachineDescription
    # From an OCI image or a Dockerfile: where it came from (a pinned reference, or the
    # Dockerfile's path), the user commands run as by default (None: root), and the image's
    # ENTRYPOINT and CMD (recorded, not run: docs/images.md).
    image: str | None = None
    user: str | None = None
    entrypoint: list[str] = Field(default_factory=list)
    cmd: list[str] = Field(default_factory=list)
    # the tenant that built it through the API (None: the operator's, shared by every tenant)
    owner: str | None = None
    # its owner made it public (E2B's): every tenant may create from it; its owner alone
    # builds, tags, deletes or updates it, and lists it
    public: bool = False
    # Built through the API (core/builds.py): its steps ran in a sandbox of the base image,
    # its start command was started and its ready command succeeded, and the sandbox was
    # snapshotted then; sandboxes of the template restore that snapshot. `recipe`: the hash
    # of what it was built from (an unchanged rebuild keeps it).
    start_cmd: str | None = None
    ready_cmd: str | None = None
    snapshot_id: str | None = None
    recipe: str | None = None
    build_id: str | None = None  # the build through the API that made it


# ---- what commands and files in a running sandbox answer -----------------------------------


class FileInfo(BaseModel):
    """A file system entry in a sandbox. `type` is file, dir, symlink or other."""

    name: str
    path: str
    type: Literal["file", "dir", "symlink", "other"] | str
    size: int
    mode: int
    owner: str
    mtime: float
    target: str | None = None  # a symlink's
    metadata: dict[str, str] | None = None  # user metadata, set when it was written


class FileList(BaseModel):
    entries: list[FileInfo]


class MkdirResult(FileInfo):
    created: bool  # False: it was there already


class Exists(BaseModel):
    exists: bool


class ProcessInfo(BaseModel):
    """A process a command started in a sandbox."""

    pid: int
    cmd: str
    user: str
    running: bool
    exit_code: int | None = None
    started_at: float
    pty: bool = False  # it runs on a terminal


class ProcessList(BaseModel):
    processes: list[ProcessInfo]


class Started(BaseModel):
    pid: int


class Killed(BaseModel):
    killed: bool  # False: it had already exited


class CommandEvent(BaseModel):
    """One line of a command's NDJSON stream: start (pid), stdout/stderr (data), exit
    (exit_code: 128 + n for a signal n), error (a typed error that ended the stream), or
    keepalive (sent while the command is silent; clients ignore it)."""

    type: Literal["start", "stdout", "stderr", "exit", "error", "keepalive"]
    pid: int | None = None
    data: str | None = None
    exit_code: int | None = None
    error: dict | None = None


def to_doc(record: BaseModel) -> dict:
    """Persisted form of a record: its API shape plus its internal (excluded) fields."""
    doc = record.model_dump(mode="json")
    for name, info in type(record).model_fields.items():
        if info.exclude:
            value = getattr(record, name)
            if isinstance(value, list):
                value = [v.model_dump(mode="json") if isinstance(v, BaseModel) else v
                         for v in value]
            doc[name] = value.value if isinstance(value, StrEnum) else value
    return doc
