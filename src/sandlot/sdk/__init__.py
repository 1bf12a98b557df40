"""The sandlot Python SDK: sync (`Sandbox`, `Snapshot`, `Sandlot`) and async (`AsyncSandbox`,
`AsyncSnapshot`, `AsyncSandlot`) clients of the REST API in docs/api.md.

Import these from `sandlot` itself; the modules under this package are private.
"""

from ._async._client import (
    AsyncHosts,
    AsyncSandboxes,
    AsyncSandlot,
    AsyncSnapshots,
    AsyncTemplates,
)
from ._async._commands import AsyncCommandHandle, AsyncCommands
from ._async._files import AsyncFiles
from ._async._http import AsyncByteStream
from ._async._sandbox import AsyncForkList, AsyncSandbox, AsyncSnapshot
from ._async._terminals import AsyncTerminal, AsyncTerminals
from ._errors import CommandExitError, SnapshotFailedError, WaitTimeoutError
from ._models import (
    CommandResult,
    EntryInfo,
    HostInfo,
    ProcessInfo,
    SandboxInfo,
    SandboxMetrics,
    SnapshotInfo,
    TemplateInfo,
)
from ._sync._client import Hosts, Sandboxes, Sandlot, Snapshots, Templates
from ._sync._commands import CommandHandle, Commands
from ._sync._files import Files
from ._sync._http import ByteStream
from ._sync._sandbox import ForkList, Sandbox, Snapshot
from ._sync._terminals import Terminal, Terminals

__all__ = [
    "AsyncByteStream",
    "AsyncCommandHandle",
    "AsyncCommands",
    "AsyncFiles",
    "AsyncForkList",
    "AsyncHosts",
    "AsyncSandbox",
    "AsyncSandboxes",
    "AsyncSandlot",
    "AsyncSnapshot",
    "AsyncSnapshots",
    "AsyncTemplates",
    "AsyncTerminal",
    "AsyncTerminals",
    "ByteStream",
    "CommandExitError",
    "CommandHandle",
    "CommandResult",
    "Commands",
    "EntryInfo",
    "Files",
    "ForkList",
    "HostInfo",
    "Hosts",
    "ProcessInfo",
    "SandboxInfo",
    "SandboxMetrics",
    "Sandbox",
    "Sandboxes",
    "Sandlot",
    "Snapshot",
    "SnapshotFailedError",
    "SnapshotInfo",
    "Snapshots",
    "TemplateInfo",
    "Templates",
    "Terminal",
    "Terminals",
    "WaitTimeoutError",
]
