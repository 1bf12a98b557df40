# Generated from src/sandlot/sdk/_async/_client.py by scripts/unasync.py; do not edit.
# ruff: noqa: I001
"""The `Sandlot` client object (sync)."""

from __future__ import annotations

import time
import os
from typing import Any

import httpx

from .. import _base
from .._models import HostInfo, SandboxInfo, SnapshotInfo, TemplateInfo, parse_list
from ._http import API
from ._sandbox import Sandbox, Snapshot, _delete_snapshot


class Sandboxes:
    """``client.sandboxes``."""

    def __init__(self, api: API) -> None:
        self._api = api

    def create(self, template: str = "base", *, snapshot_id: str | None = None,
               memory_mb: int | None = None, cpus: int | None = None,
               env: dict[str, str] | None = None, timeout: int | None = 300,
               metadata: dict[str, str] | None = None, internet: bool = True,
               network: Any = None, on_timeout: str = "kill",
               auto_resume: bool = False, image: str | None = None,
               pause_memory: bool = True, disk_mb: int | None = None) -> Sandbox:
        """Start a sandbox; see `Sandbox.create`."""
        data = self._api.call(_base.create_sandbox(
            template, snapshot_id=snapshot_id, memory_mb=memory_mb, cpus=cpus, env=env,
            timeout=timeout, metadata=metadata, internet=internet, network=network,
            on_timeout=on_timeout, auto_resume=auto_resume, image=image,
            pause_memory=pause_memory, disk_mb=disk_mb))
        return Sandbox(self._api, SandboxInfo.model_validate(data))

    def connect(self, sandbox_id: str) -> Sandbox:
        """Attach to an existing sandbox; raises `NotFoundError` if it is unknown or gone."""
        data = self._api.call(_base.get_sandbox(sandbox_id))
        return Sandbox(self._api, SandboxInfo.model_validate(data))

    def get_info(self, sandbox_id: str) -> SandboxInfo:
        """The `SandboxInfo` of `sandbox_id`."""
        return SandboxInfo.model_validate(self._api.call(_base.get_sandbox(sandbox_id)))

    def list(self, metadata: dict[str, str] | None = None, *,
             include_stopped: bool = False) -> list[SandboxInfo]:
        """Sandboxes whose metadata contains all of `metadata` (running ones unless
        `include_stopped`)."""
        data = self._api.call(
            _base.list_sandboxes(metadata, include_stopped=include_stopped))
        return parse_list(SandboxInfo, data, "sandboxes")

    def kill(self, sandbox_id: str) -> bool:
        """Stop `sandbox_id`; False if it was already gone."""
        return Sandbox(self._api, SandboxInfo(sandbox_id=sandbox_id)).kill()

    def pause(self, sandbox_id: str, *, memory: bool | None = None) -> SandboxInfo:
        """Pause `sandbox_id` (see `Sandbox.pause`)."""
        return SandboxInfo.model_validate(
            self._api.call(_base.pause_sandbox(sandbox_id, memory)))

    def resume(self, sandbox_id: str, timeout: int | None = None, *,
               reboot: bool = False) -> Sandbox:
        """Resume a paused sandbox (see `Sandbox.resume`); the running sandbox."""
        data = self._api.call(_base.resume_sandbox(sandbox_id, timeout, reboot))
        return Sandbox(self._api, SandboxInfo.model_validate(data))


class Snapshots:
    """``client.snapshots``."""

    def __init__(self, api: API) -> None:
        self._api = api

    def get(self, name_or_id: str) -> Snapshot:
        """Look a snapshot up by id or name; raises `NotFoundError` if there is none."""
        data = self._api.call(_base.get_snapshot(name_or_id))
        return Snapshot(self._api, SnapshotInfo.model_validate(data))

    def list(self, sandbox_id: str | None = None) -> list[SnapshotInfo]:
        """All snapshots that are not deleted, optionally only those of `sandbox_id`."""
        data = self._api.call(_base.list_snapshots(sandbox_id))
        return parse_list(SnapshotInfo, data, "snapshots")

    def delete(self, name_or_id: str) -> bool:
        """Delete a snapshot by id or name; False if there was none."""
        return _delete_snapshot(self._api, name_or_id)

    def restore(self, sandbox_id: str | None, snapshot_id: str, *,
                name: str | None = None, memory_mb: int | None = None,
                cpus: int | None = None, env: dict[str, str] | None = None,
                timeout: int | None = None, metadata: dict[str, str] | None = None,
                internet: bool = True) -> Sandbox:
        """Restore `snapshot_id` (id or name) into a new sandbox.

        `sandbox_id` does not change the target: the restore always makes a new sandbox. When
        given, it must be the sandbox the snapshot was taken from (`InvalidArgumentError`
        otherwise); pass None to skip that check.
        """
        snapshot = self.get(snapshot_id)
        _base.check_restore_source(snapshot.info, sandbox_id)
        return snapshot.restore_with(name, memory_mb=memory_mb, cpus=cpus, env=env,
                                     timeout=timeout, metadata=metadata,
                                     internet=internet)


class Templates:
    """``client.templates``. Templates are built on the server host with
    ``sandlot template build``."""

    def __init__(self, api: API) -> None:
        self._api = api

    def list(self) -> list[TemplateInfo]:
        """The templates the server can start sandboxes from."""
        return parse_list(TemplateInfo, self._api.call(_base.list_templates()), "templates")

    def get(self, name: str) -> TemplateInfo:
        """The template called `name`."""
        return TemplateInfo.model_validate(self._api.call(_base.get_template(name)))

    def build(self, name: str, *, dockerfile: str | os.PathLike,
              context: str | os.PathLike | bytes | None = None,
              timeout: float | None = 3600, cpus: int | None = None,
              memory_mb: int | None = None) -> TemplateInfo:
        """Build template `name` (yours) from a one-stage Dockerfile (a path, or its text)
        on the server, in a sandbox of its FROM (a template or an image), and wait for it.
        `context`: the folder COPY takes files from (default: the Dockerfile's folder when
        it is a path), or a tar's bytes. An unchanged build is served from the cache.
        Raises BuildStepError (the failing step's output), or WaitTimeoutError."""
        text = _base.dockerfile_text(dockerfile)
        if context is None and not (isinstance(dockerfile, str) and "\n" in dockerfile):
            context = os.path.dirname(os.path.abspath(os.fspath(dockerfile)))
        status = self._api.call(_base.build_template(
            name, text, _base.build_context(context), cpus=cpus, memory_mb=memory_mb))
        started = _base.clock()
        while not _base.build_waited(status, started, timeout):
            time.sleep(1)
            seen = status.get("logs_offset", 0) + len(status.get("logs") or [])
            status = self._api.call(_base.template_build(name, status["build_id"], seen))
        return self.get(name)


class Hosts:
    """``client.hosts``: the hosts of a deployment (one, unless the server shares a database
    with others: docs/cluster.md)."""

    def __init__(self, api: API) -> None:
        self._api = api

    def list(self) -> list[HostInfo]:
        """Every host, with its state, capacity and load."""
        return parse_list(HostInfo, self._api.call(_base.list_hosts()), "hosts")

    def drain(self, host_id: str) -> HostInfo:
        """No new sandboxes go to the host; those it runs run to their end."""
        return HostInfo.model_validate(
            self._api.call(_base.set_host_state(host_id, "drain")))

    def activate(self, host_id: str) -> HostInfo:
        """A drained host takes new sandboxes again."""
        return HostInfo.model_validate(
            self._api.call(_base.set_host_state(host_id, "activate")))


class Sandlot:
    """A connection to a sandlot server: URL, API key and a pool of HTTP connections.

    `api_url`/`api_key` default to env ``SANDLOT_URL`` (else ``http://127.0.0.1:7070``) and
    ``SANDLOT_API_KEY``. Pass `transport` (e.g. ``httpx.ASGITransport(app)``) to talk to a
    server in process. `request_timeout` is the HTTP timeout of ordinary calls (not of commands,
    whose HTTP timeout follows their own `timeout`).

        with Sandlot() as client:
            sbx = client.sandboxes.create()
    """

    def __init__(self, api_url: str | None = None, api_key: str | None = None, *,
                 transport: httpx.BaseTransport | None = None,
                 request_timeout: float | httpx.Timeout | None = None) -> None:
        self._api = API(api_url, api_key, transport=transport,
                        request_timeout=request_timeout)
        self.sandboxes = Sandboxes(self._api)
        self.snapshots = Snapshots(self._api)
        self.templates = Templates(self._api)
        self.hosts = Hosts(self._api)

    @property
    def api_url(self) -> str:
        """The server's base URL."""
        return self._api.api_url

    def __repr__(self) -> str:
        return f"Sandlot(api_url={self.api_url!r})"

    def health(self) -> dict[str, Any]:
        """``GET /health``: ``{"status": "ok", "version": ...}``."""
        return self._api.call(_base.health())

    def close(self) -> None:
        """Close the HTTP connections (sandboxes made with this client reopen them if used)."""
        self._api.close()

    def __enter__(self) -> Sandlot:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
