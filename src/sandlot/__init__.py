"""sandlot: self-hosted QEMU microVM sandboxes with live snapshot, restore and fork.

    from sandlot import Sandbox

    with Sandbox.create() as sbx:
        print(sbx.commands.run("echo hi").stdout)

Everything public is exported here; modules whose names start with ``_`` are private.
"""

from importlib import metadata as _metadata

from sandlot.errors import (
    AuthenticationError,
    BuildError,
    BuildStepError,
    CapacityError,
    CommandTimeoutError,
    ConflictError,
    GuestError,
    HostUnavailableError,
    ImageError,
    ImageNotFoundError,
    InvalidArgumentError,
    InvalidStateError,
    NotFoundError,
    PayloadTooLargeError,
    PermissionDeniedError,
    SandboxError,
    SandlotError,
    StorageError,
    VmmError,
)
from sandlot.sdk import (
    AsyncByteStream,
    AsyncCommandHandle,
    AsyncCommands,
    AsyncFiles,
    AsyncForkList,
    AsyncHosts,
    AsyncSandbox,
    AsyncSandboxes,
    AsyncSandlot,
    AsyncSnapshot,
    AsyncSnapshots,
    AsyncTemplates,
    AsyncTerminal,
    AsyncTerminals,
    ByteStream,
    CommandExitError,
    CommandHandle,
    CommandResult,
    Commands,
    EntryInfo,
    Files,
    ForkList,
    HostInfo,
    Hosts,
    ProcessInfo,
    Sandbox,
    Sandboxes,
    SandboxInfo,
    SandboxMetrics,
    Sandlot,
    Snapshot,
    SnapshotFailedError,
    SnapshotInfo,
    Snapshots,
    TemplateInfo,
    Templates,
    Terminal,
    Terminals,
    WaitTimeoutError,
)

try:
    __version__ = _metadata.version("sandlot")
except _metadata.PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0"

__all__ = [
    # clients
    "Sandbox",
    "AsyncSandbox",
    "Snapshot",
    "AsyncSnapshot",
    "Sandlot",
    "AsyncSandlot",
    # objects the clients hand out
    "AsyncByteStream",
    "AsyncCommandHandle",
    "AsyncCommands",
    "AsyncFiles",
    "AsyncForkList",
    "AsyncSandboxes",
    "AsyncSnapshots",
    "AsyncTemplates",
    "AsyncTerminal",
    "AsyncTerminals",
    "AsyncHosts",
    "Hosts",
    "HostInfo",
    "SandboxMetrics",
    "ByteStream",
    "CommandHandle",
    "Commands",
    "Files",
    "ForkList",
    "Sandboxes",
    "Snapshots",
    "Templates",
    "Terminal",
    "Terminals",
    # models
    "CommandResult",
    "EntryInfo",
    "ProcessInfo",
    "SandboxInfo",
    "SnapshotInfo",
    "TemplateInfo",
    # errors
    "SandlotError",
    "CapacityError",
    "HostUnavailableError",
    "InvalidArgumentError",
    "PayloadTooLargeError",
    "AuthenticationError",
    "PermissionDeniedError",
    "NotFoundError",
    "ConflictError",
    "InvalidStateError",
    "CommandTimeoutError",
    "SandboxError",
    "GuestError",
    "VmmError",
    "StorageError",
    "BuildError",
    "BuildStepError",
    "ImageError",
    "ImageNotFoundError",
    "CommandExitError",
    "SnapshotFailedError",
    "WaitTimeoutError",
]
