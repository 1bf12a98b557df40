# Generated from src/sandlot/sdk/_async/_sandbox.py by scripts/unasync.py; do not edit.
# ruff: noqa: I001
"""Sandboxes and snapshots (sync)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sandlot.errors import NotFoundError, SandlotError

from .. import _base
from .._models import SandboxInfo, SandboxMetrics, SnapshotInfo, parse_list
from ._commands import Commands
from ._files import Files
from ._http import API
from ._terminals import Terminals


class ForkList(list["Sandbox"]):
    """The children of a fork. `errors` holds one error per child that failed to start;
    `pause_ms`, how long the parent was paused for their capture."""

    def __init__(self, children: list[Sandbox], errors: list[SandlotError],
                 pause_ms: float | None = None) -> None:
        super().__init__(children)
        self.errors = errors
        self.pause_ms = pause_ms


class Sandbox:
    """A running microVM sandbox.

    Create one with ``Sandbox.create()`` (or ``client.sandboxes.create()``)::

        with Sandbox.create() as sbx:
            result = sbx.commands.run("echo hi")

    Leaving the ``with`` block kills the sandbox.
    """

    def __init__(self, api: API, info: SandboxInfo, *, owns_api: bool = False) -> None:
        self._api = api
        self._info = info
        self._owns_api = owns_api
        self.sandbox_id = info.sandbox_id
        self.commands = Commands(api, info.sandbox_id)
        self.files = Files(api, info.sandbox_id)
        self.pty = Terminals(api, info.sandbox_id)

    def __repr__(self) -> str:
        return f"Sandbox(sandbox_id={self.sandbox_id!r})"

    @property
    def info(self) -> SandboxInfo:
        """The last `SandboxInfo` the server sent (see `get_info` for a fresh one)."""
        return self._info

    def _child(self, info: SandboxInfo) -> Sandbox:
        # Children share this object's HTTP client; only its creator closes it.
        return Sandbox(self._api, info, owns_api=False)

    @classmethod
    def create(cls, template: str = "base", *, snapshot_id: str | None = None,
               memory_mb: int | None = None, cpus: int | None = None,
               env: dict[str, str] | None = None, timeout: int | None = 300,
               metadata: dict[str, str] | None = None, internet: bool = True,
               network: Any = None, on_timeout: str = "kill", auto_resume: bool = False,
               image: str | None = None, pause_memory: bool = True,
               disk_mb: int | None = None,
               api_url: str | None = None, api_key: str | None = None) -> Sandbox:
        """Start a sandbox from `template`, restore one from `snapshot_id`, or start one from
        the OCI image `image` (``"python:3.12-slim"``; see docs/images.md).

        The first create from an image pulls it and builds a template from it (by digest;
        minutes for a large image), later ones are restores like any other. A bad reference
        raises `ImageError`, an image the registry does not have `ImageNotFoundError`.

        `memory_mb`/`cpus` default to the template's (or snapshot's). `disk_mb` is the disk
        its guest sees, its quota (the server's default otherwise; never less than the
        template's or snapshot's): past it the guest gets ENOSPC. The sandbox is killed
        `timeout` seconds after creation unless extended with `set_timeout`, or paused with
        ``on_timeout="pause"`` (its whole state kept, or with ``pause_memory=False`` its
        filesystem only; `resume` brings it back, and with `auto_resume` the next command,
        file operation or fork does). The server is
        `api_url`/`api_key`, defaulting to env ``SANDLOT_URL``/``SANDLOT_API_KEY``.
        """
        api = API(api_url, api_key)
        try:
            data = api.call(_base.create_sandbox(
                template, snapshot_id=snapshot_id, memory_mb=memory_mb, cpus=cpus, env=env,
                timeout=timeout, metadata=metadata, internet=internet, network=network,
                on_timeout=on_timeout, auto_resume=auto_resume, image=image,
                pause_memory=pause_memory, disk_mb=disk_mb))
        except BaseException:
            api.close()
            raise
        return cls(api, SandboxInfo.model_validate(data), owns_api=True)

    @classmethod
    def connect(cls, sandbox_id: str, *, api_url: str | None = None,
                api_key: str | None = None) -> Sandbox:
        """Attach to an existing sandbox; raises `NotFoundError` if it is unknown or gone."""
        api = API(api_url, api_key)
        try:
            data = api.call(_base.get_sandbox(sandbox_id))
        except BaseException:
            api.close()
            raise
        return cls(api, SandboxInfo.model_validate(data), owns_api=True)

    @classmethod
    def list(cls, metadata: dict[str, str] | None = None, *, api_url: str | None = None,
             api_key: str | None = None) -> list[SandboxInfo]:
        """Running sandboxes whose metadata contains all of `metadata`."""
        api = API(api_url, api_key)
        try:
            data = api.call(_base.list_sandboxes(metadata))
        finally:
            api.close()
        return parse_list(SandboxInfo, data, "sandboxes")

    def get_info(self) -> SandboxInfo:
        """Fetch the sandbox's current `SandboxInfo`."""
        self._info = SandboxInfo.model_validate(
            self._api.call(_base.get_sandbox(self.sandbox_id)))
        return self._info

    def is_running(self) -> bool:
        """True if the sandbox exists and is in state ``running``."""
        try:
            info = self.get_info()
        except NotFoundError:
            return False
        return info.state == "running"

    def set_timeout(self, seconds: int) -> None:
        """Kill the sandbox `seconds` from now instead of at its current deadline."""
        self._info = SandboxInfo.model_validate(
            self._api.call(_base.set_timeout(self.sandbox_id, seconds)))

    def get_metrics(self, start: datetime | float | None = None,
                    end: datetime | float | None = None) -> list[SandboxMetrics]:
        """The sandbox's CPU, memory and disk use over time, sampled by its host (every 5 s by
        default, the last hour kept), between `start` and `end`."""
        data = self._api.call(_base.sandbox_metrics(
            self.sandbox_id, _base.epoch(start), _base.epoch(end)))
        return parse_list(SandboxMetrics, data, "metrics")

    def get_host(self, port: int) -> str:
        """``host:port`` on which the server's host reaches `port` inside the sandbox."""
        data = self._api.call(_base.expose_port(self.sandbox_id, port))
        return str(data["address"])

    def set_network(self, *, internet: bool | None = None,
                    allow_out: list[str] | None = None,
                    deny_out: list[str] | None = None,
                    dns_servers: list[str] | None = None) -> None:
        """Change the egress rules of the running sandbox (None leaves a setting as it is;
        `dns_servers`: IPv4 addresses it reaches whatever allow_out and deny_out say)."""
        self._info = SandboxInfo.model_validate(self._api.call(_base.set_network(
            self.sandbox_id, internet=internet, allow_out=allow_out, deny_out=deny_out,
            dns_servers=dns_servers)))

    def kill(self) -> bool:
        """Stop the sandbox. True if this call killed it, False if it was already gone."""
        try:
            self._api.call(_base.kill_sandbox(self.sandbox_id))
        except NotFoundError:
            return False
        return True

    def destroy(self) -> bool:
        """Alias of `kill`."""
        return self.kill()

    def close(self) -> None:
        """Release this object's HTTP connections (the sandbox keeps running)."""
        if self._owns_api:
            self._api.close()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc_info: object) -> None:
        try:
            self.kill()
        finally:
            self.close()

    def create_snapshot(self, name: str | None = None, *, memory: bool = True
                        ) -> Snapshot:
        """Start snapshotting the sandbox; returns at once with the snapshot ``creating``.

        The sandbox keeps running. Call `Snapshot.wait` to wait until it is ``ready``.
        With ``memory=False`` only its filesystem is kept (synced first; no pause, a
        smaller snapshot): sandboxes made from it boot from that disk, without its processes.
        """
        data = self._api.call(_base.create_snapshot(self.sandbox_id, name, memory))
        return Snapshot(self._api, SnapshotInfo.model_validate(data))

    def snapshot(self, name: str | None = None, *, memory: bool = True) -> Snapshot:
        """Alias of `create_snapshot`."""
        return self.create_snapshot(name, memory=memory)

    def fork(self, count: int = 1) -> ForkList:
        """Start `count` new sandboxes from this one's current state.

        Each child succeeds or fails on its own: the list holds the children that started and
        its `errors` attribute the failures. If every child failed, the first error is raised.
        """
        data = self._api.call(_base.fork_sandbox(self.sandbox_id, count))
        infos, errors = _base.parse_fork(data)
        _base.check_fork(infos, errors)
        return ForkList([self._child(info) for info in infos], errors,
                        data.get("pause_ms") if isinstance(data, dict) else None)

    def pause(self, *, memory: bool | None = None) -> None:
        """Keep the sandbox's whole state (memory, processes, files) and stop its VM, so it
        costs nothing while it waits; `resume` brings it back exactly where it was, under the
        same id. With ``memory=False`` only its files are kept (the resume boots it from its
        disk; default: as the sandbox was created, ``pause_memory``). Returns once the state
        is stored."""
        self._info = SandboxInfo.model_validate(
            self._api.call(_base.pause_sandbox(self.sandbox_id, memory)))

    def resume(self, timeout: int | None = None, *, reboot: bool = False
               ) -> Sandbox:
        """Bring a paused sandbox back (with a new `timeout` if given); returns self. With
        `reboot` it boots from its disk as it was at the pause instead of resuming its
        memory."""
        self._info = SandboxInfo.model_validate(
            self._api.call(_base.resume_sandbox(self.sandbox_id, timeout, reboot)))
        return self

    def rollback(self, snapshot: Snapshot | SnapshotInfo | str) -> Sandbox:
        """Reset this sandbox to `snapshot` (object, id or name); keeps the same sandbox_id."""
        req = _base.rollback_sandbox(self.sandbox_id, _base.snapshot_ref(snapshot))
        self._info = SandboxInfo.model_validate(self._api.call(req))
        return self


class Snapshot:
    """A snapshot of a sandbox: memory, devices and disk, restorable into new sandboxes."""

    def __init__(self, api: API, info: SnapshotInfo, *, owns_api: bool = False) -> None:
        self._api = api
        self._info = info
        self._owns_api = owns_api

    def __repr__(self) -> str:
        return (f"Snapshot(snapshot_id={self.snapshot_id!r}, name={self.name!r}, "
                f"state={self.state!r})")

    @property
    def info(self) -> SnapshotInfo:
        """The last `SnapshotInfo` the server sent (see `refresh`)."""
        return self._info

    @property
    def snapshot_id(self) -> str:
        """The snapshot's id (``snap-...``)."""
        return self._info.snapshot_id

    @property
    def name(self) -> str | None:
        """The snapshot's name, if it has one."""
        return self._info.name

    @property
    def state(self) -> str:
        """``creating``, ``uploading``, ``ready``, ``failed`` or ``deleted`` (as last seen)."""
        return self._info.state

    @property
    def error(self) -> str | None:
        """Why the snapshot failed, if it did."""
        return self._info.error

    @classmethod
    def get(cls, name_or_id: str, *, api_url: str | None = None,
            api_key: str | None = None) -> Snapshot:
        """Look a snapshot up by id or name; raises `NotFoundError` if there is none."""
        api = API(api_url, api_key)
        try:
            data = api.call(_base.get_snapshot(name_or_id))
        except BaseException:
            api.close()
            raise
        return cls(api, SnapshotInfo.model_validate(data), owns_api=True)

    @classmethod
    def list(cls, *, sandbox_id: str | None = None, api_url: str | None = None,
             api_key: str | None = None) -> list[SnapshotInfo]:
        """All snapshots that are not deleted, optionally only those of `sandbox_id`."""
        api = API(api_url, api_key)
        try:
            data = api.call(_base.list_snapshots(sandbox_id))
        finally:
            api.close()
        return parse_list(SnapshotInfo, data, "snapshots")

    @classmethod
    def delete(cls, name_or_id: str, *, api_url: str | None = None,
               api_key: str | None = None) -> bool:
        """Delete the snapshot with this id or name; False if there was none.

        To delete a snapshot object you hold, call its `remove` method.
        """
        api = API(api_url, api_key)
        try:
            return _delete_snapshot(api, name_or_id)
        finally:
            api.close()

    def refresh(self) -> Snapshot:
        """Fetch the snapshot's current state; returns self."""
        self._info = SnapshotInfo.model_validate(
            self._api.call(_base.get_snapshot(self.snapshot_id)))
        return self

    def wait(self, timeout: float | None = 120) -> Snapshot:
        """Wait until the snapshot is ``ready``; returns self. The server answers the moment
        it is (no polling interval to wait out).

        Raises `SnapshotFailedError` if it fails (or is deleted) and `WaitTimeoutError` after
        `timeout` seconds (None: wait forever).
        """
        deadline = _base.wait_deadline(timeout)
        while not _base.snapshot_done(self._info):
            step = _base.check_wait(self._info, deadline, timeout)
            self._info = SnapshotInfo.model_validate(
                self._api.call(_base.wait_snapshot(self.snapshot_id, step)))
        return self

    def restore(self, name: str | None = None) -> Sandbox:
        """Start a new sandbox from this snapshot with the snapshot's settings.

        `name`, if given, is recorded as the new sandbox's ``name`` metadata.
        """
        return self.restore_with(name)

    def restore_with(self, name: str | None = None, memory_mb: int | None = None,
                     cpus: int | None = None, env: dict[str, str] | None = None,
                     timeout: int | None = None, metadata: dict[str, str] | None = None,
                     internet: bool = True) -> Sandbox:
        """Start a new sandbox from this snapshot, overriding some of its settings.

        `name`, if given, is recorded as the new sandbox's ``name`` metadata.
        `memory_mb` may only grow the snapshot's memory; `env` is merged into the environment
        of later commands; `timeout` is the new sandbox's lifetime in seconds.
        """
        req = _base.restore_snapshot(self.snapshot_id, name=name, memory_mb=memory_mb,
                                     cpus=cpus, env=env, timeout=timeout, metadata=metadata,
                                     internet=internet)
        data = self._api.call(req)
        return Sandbox(self._api, SandboxInfo.model_validate(data), owns_api=False)

    def fork(self, count: int = 1, *, memory_mb: int | None = None,
             cpus: int | None = None, env: dict[str, str] | None = None,
             timeout: int | None = None, metadata: dict[str, str] | None = None
             ) -> ForkList:
        """Start `count` independent sandboxes from this snapshot at once, no running parent
        needed (in a deployment, spread over the hosts with room), each with the settings
        given (as `restore_with`).

        Each child succeeds or fails on its own: the list holds the children that started and
        its `errors` attribute the failures. If every child failed, the first error is raised.
        """
        data = self._api.call(_base.fork_snapshot(
            self.snapshot_id, count, memory_mb=memory_mb, cpus=cpus, env=env,
            timeout=timeout, metadata=metadata))
        infos, errors = _base.parse_fork(data)
        _base.check_fork(infos, errors)
        return ForkList([Sandbox(self._api, info, owns_api=False) for info in infos],
                        errors, 0.0)

    def save_named(self, name: str) -> Snapshot:
        """Give the snapshot `name` (raises `ConflictError` if taken); returns self."""
        self._info = SnapshotInfo.model_validate(
            self._api.call(_base.rename_snapshot(self.snapshot_id, name)))
        return self

    def remove(self) -> bool:
        """Delete this snapshot; False if it was already gone."""
        return _delete_snapshot(self._api, self.snapshot_id)

    def close(self) -> None:
        """Release this object's HTTP connections."""
        if self._owns_api:
            self._api.close()


def _delete_snapshot(api: API, name_or_id: str) -> bool:
    try:
        api.call(_base.delete_snapshot(name_or_id))
    except NotFoundError:
        return False
    return True
