"""What the E2B layer keeps beside core: envd access tokens, the lifecycle (pause locks), the
E2B view of started processes, and directory watchers. One `E2BState` per app, made on first
use."""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import Request

from sandlot.core.files import Files
from sandlot.core.service import Core
from sandlot.core.tenancy import Principal
from sandlot.server.deps import core
from sandlot.server.e2b.errors import SandboxNotRunning
from sandlot.server.e2b.lifecycle import Lifecycle

TOKEN_FILE = "e2b-access.key"
TOKEN_SECRET = "e2b-access-key"  # its name in a deployment's database
# Why: the registry only remembers what E2B clients passed to Start (args, envs, cwd, tag);
# processes that vanish are dropped on List, and this bounds what a client can make it hold.
MAX_REMEMBERED = 4096


class AccessTokens:
    """envd access tokens: an HMAC of the sandbox id under a key kept in the data dir (one
    host) or in the deployment's database (several: any host checks any sandbox's token, and
    a sandbox resumed on another host keeps its token), so they survive a restart without a
    table, and differ per sandbox."""

    def __init__(self, path: Path | None = None, key: bytes | None = None) -> None:
        if key is None:
            assert path is not None
            if not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(secrets.token_hex(32))
            key = bytes.fromhex(path.read_text().strip())
        self._key = key

    def token(self, sandbox_id: str) -> str:
        return hmac.new(self._key, sandbox_id.encode(), hashlib.sha256).hexdigest()[:40]

    def check(self, sandbox_id: str, token: str) -> bool:
        return hmac.compare_digest(self.token(sandbox_id), token)

    def volume(self, volume_id: str) -> str:
        """A volume's token for E2B's content API (server/e2b/volume_content.py): another
        HMAC under the same key, apart from every sandbox's."""
        return hmac.new(self._key, b"volume:" + volume_id.encode(),
                        hashlib.sha256).hexdigest()[:40]

    def check_volume(self, volume_id: str, token: str) -> bool:
        return hmac.compare_digest(self.volume(volume_id), token)

    def traffic(self, sandbox_id: str) -> str:
        """The sandbox's traffic access token (its port URLs, server/ports.py): another
        HMAC under the same key, so neither token gives away the other."""
        return hmac.new(self._key, b"traffic:" + sandbox_id.encode(),
                        hashlib.sha256).hexdigest()[:40]


@dataclass
class ProcessConfig:
    cmd: str
    args: list[str]
    envs: dict[str, str]
    cwd: str | None
    tag: str | None = None


@dataclass
class E2BState:
    tokens: AccessTokens
    lifecycle: Lifecycle
    processes: dict[tuple[str, int], ProcessConfig] = field(default_factory=dict)
    watchers: dict[str, object] = field(default_factory=dict)  # id -> filesystem.Watcher

    def remember(self, sandbox_id: str, pid: int, config: ProcessConfig) -> None:
        if len(self.processes) >= MAX_REMEMBERED:
            self.processes.pop(next(iter(self.processes)))
        self.processes[(sandbox_id, pid)] = config

    def forget_except(self, sandbox_id: str, running: set[int]) -> None:
        for key in [k for k in self.processes if k[0] == sandbox_id and k[1] not in running]:
            del self.processes[key]

    def pid_for_tag(self, sandbox_id: str, tag: str) -> int | None:
        for (sid, pid), cfg in self.processes.items():
            if sid == sandbox_id and cfg.tag == tag:
                return pid
        return None


@dataclass
class Envd:
    """One envd call: who it acts for, the sandbox it is for, the user it runs as, its
    deadline and keepalive interval (seconds)."""

    core: Core
    state: E2BState
    who: Principal
    sandbox_id: str
    user: str
    timeout: float | None = None
    keepalive: float | None = None

    def check_running(self) -> None:
        if not self.core.sandboxes.is_running(self.sandbox_id, self.who):
            raise SandboxNotRunning(self.sandbox_id)

    @property
    def files(self) -> Files:
        return self.core.files


async def start_e2b_state(app_state, c: Core) -> None:
    """The E2B layer's state for an app whose core has started (a deployment's token key
    comes from its database)."""
    secret = await c.deployment_secret(TOKEN_SECRET)
    if secret:
        key = bytes.fromhex(secret)
        app_state.e2b = E2BState(tokens=AccessTokens(key=key), lifecycle=Lifecycle(c))


def e2b_state(request: Request) -> E2BState:
    app_state = request.app.state
    st = getattr(app_state, "e2b", None)
    if st is None:
        c: Core = core(request)
        st = E2BState(tokens=AccessTokens(c.settings.data_dir / TOKEN_FILE),
                      lifecycle=Lifecycle(c))
        app_state.e2b = st
    return st
