"""Core's lifecycles through the REST API, in process on the fake runtime: pause and resume,
snapshot completion, snapshots a host cannot load, fork bookkeeping, restarts."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from sandlot.core.models import SnapshotState
from sandlot.core.tenancy import SYSTEM, Principal
from sandlot.testing import in_process
from sandlot.vmm.cpu import HostCpu
from sandlot.vmm.description import FORMAT, MachineDescription
from sandlot.vmm.qemu import parse_machine_help


@pytest.fixture
async def api(tmp_path):
    async with in_process(tmp_path) as srv:
        async with httpx.AsyncClient(transport=srv.async_transport(), base_url=srv.url,
                                     headers={"authorization": f"Bearer {srv.key}"}) as http:
            http.srv = srv
            yield http


async def create(api, **body) -> dict:
    r = await api.post("/v1/sandboxes", json=body)
    assert r.status_code == 201, r.text
    return r.json()


async def ready_snapshot(api, sid: str, name: str | None = None) -> dict:
    r = await api.post(f"/v1/sandboxes/{sid}/snapshots", json={"name": name})
    assert r.status_code == 201, r.text
    r = await api.post(f"/v1/snapshots/{r.json()['snapshot_id']}/wait", params={"timeout": 5})
    assert r.json()["state"] == "ready", r.text
    return r.json()


async def test_pause_and_resume_keep_the_sandbox(api) -> None:
    sb = await create(api, metadata={"k": "v"}, env={"E": "1"})
    sid = sb["sandbox_id"]
    await api.put(f"/v1/sandboxes/{sid}/files", params={"path": "/tmp/f"}, content=b"kept")
    r = await api.post(f"/v1/sandboxes/{sid}/pause")
    assert r.status_code == 200 and r.json()["state"] == "paused" and r.json()["pid"] is None
    listed = (await api.get("/v1/sandboxes", params={"state": "paused"})).json()["sandboxes"]
    assert [s["sandbox_id"] for s in listed] == [sid]
    assert (await api.get("/v1/snapshots")).json()["snapshots"] == []  # pause snapshots hide
    r = await api.get(f"/v1/sandboxes/{sid}/files", params={"path": "/tmp/f"})
    assert r.status_code == 404 and "not running" in r.json()["error"]["message"]
    r = await api.post(f"/v1/sandboxes/{sid}/pause")
    assert r.status_code == 409 and r.json()["error"]["type"] == "InvalidStateError", r.text
    assert "already paused" in r.json()["error"]["message"]
    r = await api.post(f"/v1/sandboxes/{sid}/resume", json={"timeout": 77})
    assert r.status_code == 200, r.text
    info = r.json()
    assert info["state"] == "running" and info["timeout"] == 77
    assert info["metadata"] == {"k": "v"} and info["env"] == {"E": "1"}
    assert info["generation"] != sb["generation"]
    r = await api.get(f"/v1/sandboxes/{sid}/files", params={"path": "/tmp/f"})
    assert r.content == b"kept"
    r = await api.post(f"/v1/sandboxes/{sid}/resume")
    assert r.status_code == 409 and r.json()["error"]["type"] == "InvalidStateError"
    # A paused sandbox can be killed; its state goes with it.
    await api.post(f"/v1/sandboxes/{sid}/pause")
    assert (await api.delete(f"/v1/sandboxes/{sid}")).status_code == 204
    assert (await api.get(f"/v1/sandboxes/{sid}")).json()["state"] == "stopped"
    snaps = await api.srv.core.snapshots.list(kind="pause", who=SYSTEM)
    assert snaps == []


async def test_a_failed_pause_upload_stops_the_sandbox_with_the_reason(api) -> None:
    sid = (await create(api))["sandbox_id"]
    api.srv.runtime.fail_persist = "store unreachable"
    r = await api.post(f"/v1/sandboxes/{sid}/pause")
    assert r.status_code == 500 and "store unreachable" in r.json()["error"]["message"]
    info = (await api.get(f"/v1/sandboxes/{sid}")).json()
    assert info["state"] == "stopped" and "store unreachable" in info["error"]


@pytest.mark.timeout(120)  # a wait that ran to its deadline (300 s) would end here
async def test_snapshot_completion_is_awaited_not_polled(api) -> None:
    sid = (await create(api))["sandbox_id"]
    api.srv.runtime.persist_delay = 0.3
    r = await api.post(f"/v1/sandboxes/{sid}/snapshots", json={})
    snap = r.json()
    assert snap["state"] == "creating"
    # ready, and answered when the capture was done, not at the wait's deadline
    r = await api.post(f"/v1/snapshots/{snap['snapshot_id']}/wait", params={"timeout": 300})
    assert r.json()["state"] == "ready"
    r = await api.post(f"/v1/snapshots/{snap['snapshot_id']}/wait", params={"timeout": 10})
    assert r.json()["state"] == "ready"  # done: answers at once
    api.srv.runtime.persist_delay = 5
    r = await api.post(f"/v1/sandboxes/{sid}/snapshots", json={})
    r = await api.post(f"/v1/snapshots/{r.json()['snapshot_id']}/wait", params={"timeout": 0.2})
    assert r.json()["state"] == "uploading"
    assert (await api.post("/v1/snapshots/nope/wait")).status_code == 404


async def test_a_snapshot_of_a_machine_this_host_lacks_is_refused_before_anything_starts(
        api) -> None:
    sid = (await create(api))["sandbox_id"]
    snap = await ready_snapshot(api, sid, "old-qemu")
    core = api.srv.core
    rec = await core.snapshots.get("old-qemu", Principal("test"))
    rec.machine = {**rec.machine, "machine_type": "pc-q35-99.1", "qemu_version": "99.1.0"}
    await core.snapshots._save(rec)
    restores = api.srv.runtime.restores
    r = await api.post(f"/v1/snapshots/{snap['snapshot_id']}/restore")
    assert r.status_code == 409
    message = r.json()["error"]["message"]
    assert "pc-q35-99.1" in message and "QEMU 99.1.0" in message and "lacks" in message
    assert api.srv.runtime.restores == restores
    r = await api.post(f"/v1/sandboxes/{sid}/rollback", json={"snapshot_id": "old-qemu"})
    assert r.status_code == 409 and "pc-q35-99.1" in r.json()["error"]["message"]
    assert (await api.get(f"/v1/sandboxes/{sid}")).json()["state"] == "running"


async def test_fork_children_know_their_parent_and_leave_no_snapshot(api) -> None:
    sid = (await create(api))["sandbox_id"]
    r = await api.post(f"/v1/sandboxes/{sid}/fork", json={"count": 3})
    kids = r.json()["sandboxes"]
    assert len(kids) == 3 and {k["forked_from"] for k in kids} == {sid}
    assert {k["snapshot_id"] for k in kids} == {None}
    assert (await api.get("/v1/snapshots")).json()["snapshots"] == []
    assert api.srv.runtime.captures == {}  # the fork's capture is released


async def test_a_restart_keeps_paused_sandboxes_and_snapshots(tmp_path) -> None:
    async with in_process(tmp_path) as srv:
        core = srv.core
        from sandlot.core.models import CreateSandbox
        rec = await core.sandboxes.create(CreateSandbox(), who=SYSTEM)
        snap = await core.sandboxes.snapshot(rec.sandbox_id, "keep", who=SYSTEM)
        await core.snapshots.wait(snap.snapshot_id, who=SYSTEM)
        await core.sandboxes.pause(rec.sandbox_id, who=SYSTEM)
    async with in_process(tmp_path, srv.runtime) as srv:
        core = srv.core
        assert (await core.sandboxes.get(rec.sandbox_id, SYSTEM)).state == "paused"
        assert (await core.snapshots.get("keep", SYSTEM)).state == SnapshotState.READY
        resumed = await core.sandboxes.resume(rec.sandbox_id, who=SYSTEM)
        assert resumed.state == "running"


async def test_concurrent_pause_and_kill_serialize(api) -> None:
    sid = (await create(api))["sandbox_id"]
    results = await asyncio.gather(api.post(f"/v1/sandboxes/{sid}/pause"),
                                   api.delete(f"/v1/sandboxes/{sid}"), return_exceptions=True)
    codes = sorted(r.status_code for r in results)
    assert codes[0] in (200, 204) and all(c < 500 for c in codes), [r.text for r in results]
    assert (await api.get(f"/v1/sandboxes/{sid}")).json()["state"] in ("paused", "stopped")


def test_machine_description_versions_and_problems() -> None:
    types, q35 = parse_machine_help(
        "Supported machines are:\nq35                  Standard PC (Q35 + ICH9, 2009) "
        "(alias of pc-q35-7.2)\npc-q35-7.2           Standard PC (Q35 + ICH9, 2009)\n"
        "pc-q35-7.1           Standard PC (Q35 + ICH9, 2009)\n")
    assert q35 == "pc-q35-7.2" and {"pc-q35-7.1", "q35"} <= types
    d = MachineDescription(machine_type="pc-q35-7.1", qemu_version="7.1.0", device_model="m",
                           accel="tcg", base_mb=512, dimm_mb=128)
    assert d.memory_mb == 640
    assert MachineDescription.from_dict(d.to_dict()) == d
    major = FORMAT.split(".")[0]
    from sandlot.errors import InvalidStateError
    for fmt in (f"{int(major) + 1}.0", f"{major}.99"):
        with pytest.raises(InvalidStateError, match="format"):
            MachineDescription.from_dict({**d.to_dict(), "format": fmt})
    with pytest.raises(InvalidStateError, match="older sandlot"):
        MachineDescription.from_dict(None)
    from sandlot.vmm.qemu import QemuInfo
    host = QemuInfo(version="8.0.0", machine_types=frozenset({"pc-q35-7.1"}),
                    default_q35="pc-q35-8.0")
    assert d.problems(host, "m", "tcg", HostCpu("max")) == []
    problems = d.problems(host, "other", "kvm", HostCpu("host"))
    assert len(problems) == 2 and "device model" in problems[0] and "kvm" in problems[1]


async def test_a_server_with_another_data_dir_restores_from_the_store(tmp_path) -> None:
    """Another server sharing only the store (the fake runtime's images here) restores a
    snapshot it never saw, by id, with the record the snapshot was stored with."""
    from sandlot.core.models import CreateSandbox

    async with in_process(tmp_path / "a") as a:
        rec = await a.core.sandboxes.create(CreateSandbox(env={"K": "v"}, metadata={"m": "1"}),
                                            who=SYSTEM)
        snap = await a.core.sandboxes.snapshot(rec.sandbox_id, "named-on-a", who=SYSTEM)
        snap = await a.core.snapshots.wait(snap.snapshot_id, who=SYSTEM)
        assert snap.state == "ready"
    async with in_process(tmp_path / "b", a.runtime) as b:
        from sandlot.errors import NotFoundError
        with pytest.raises(NotFoundError):  # another tenant's is as good as missing
            await b.core.sandboxes.create(CreateSandbox(snapshot_id=snap.snapshot_id),
                                          who=Principal("other"))
        restored = await b.core.sandboxes.create(CreateSandbox(snapshot_id=snap.snapshot_id),
                                                 who=SYSTEM)
        assert restored.env == {"K": "v"} and restored.snapshot_id == snap.snapshot_id
        assert (await b.core.snapshots.get(snap.snapshot_id, SYSTEM)).state == "ready"
        with pytest.raises(NotFoundError):
            await b.core.sandboxes.create(CreateSandbox(snapshot_id="named-on-a"), who=SYSTEM)
        with pytest.raises(NotFoundError):
            await b.core.sandboxes.create(CreateSandbox(snapshot_id="snap-0000000000"),
                                          who=SYSTEM)


async def test_a_sandbox_paused_at_its_timeout_resumes_on_the_next_use(api) -> None:
    sid = (await create(api, timeout=1, on_timeout="pause", auto_resume=True))["sandbox_id"]
    r = await api.put(f"/v1/sandboxes/{sid}/files", params={"path": "/tmp/f"}, content=b"kept")
    assert r.status_code == 200
    deadline = time.monotonic() + 10
    while (await api.get(f"/v1/sandboxes/{sid}")).json()["state"] != "paused":
        assert time.monotonic() < deadline, "not paused at its timeout"
        await asyncio.sleep(0.2)
    listed = (await api.get("/v1/sandboxes", params={"state": "paused"})).json()["sandboxes"]
    assert [s["sandbox_id"] for s in listed] == [sid]
    # Reading its record does not resume it; a file read does, and finds what it had.
    assert (await api.get(f"/v1/sandboxes/{sid}")).json()["state"] == "paused"
    r = await api.get(f"/v1/sandboxes/{sid}/files", params={"path": "/tmp/f"})
    assert r.status_code == 200 and r.content == b"kept"
    info = (await api.get(f"/v1/sandboxes/{sid}")).json()
    assert info["state"] == "running" and info["auto_resume"] and info["on_timeout"] == "pause"


async def test_without_auto_resume_a_paused_sandbox_stays_paused(api) -> None:
    sid = (await create(api, timeout=1, on_timeout="pause"))["sandbox_id"]
    deadline = time.monotonic() + 10
    while (await api.get(f"/v1/sandboxes/{sid}")).json()["state"] != "paused":
        assert time.monotonic() < deadline, "not paused at its timeout"
        await asyncio.sleep(0.2)
    r = await api.get(f"/v1/sandboxes/{sid}/files", params={"path": "/tmp/f"})
    assert r.status_code == 404 and "paused" in r.json()["error"]["message"]


async def test_a_filesystem_only_pause_keeps_files_and_boots_on_resume(api) -> None:
    sid = (await create(api))["sandbox_id"]
    for path in ("/root/disk", "/tmp/mem"):
        r = await api.put(f"/v1/sandboxes/{sid}/files", params={"path": path}, content=b"x")
        assert r.status_code == 200
    r = await api.post(f"/v1/sandboxes/{sid}/pause", json={"memory": False})
    assert r.status_code == 200 and r.json()["state"] == "paused", r.text
    r = await api.post(f"/v1/sandboxes/{sid}/resume")
    assert r.status_code == 200 and r.json()["state"] == "running", r.text
    assert api.srv.runtime.vms[sid].booted  # from its disk: tmpfs (memory) is gone
    r = await api.get(f"/v1/sandboxes/{sid}/files", params={"path": "/root/disk"})
    assert r.status_code == 200 and r.content == b"x"
    r = await api.get(f"/v1/sandboxes/{sid}/files", params={"path": "/tmp/mem"})
    assert r.status_code == 404


async def test_a_pause_at_the_timeout_keeps_what_the_sandbox_was_made_to(api) -> None:
    sb = await create(api, timeout=1, on_timeout="pause", pause_memory=False)
    assert sb["pause_memory"] is False
    sid = sb["sandbox_id"]
    deadline = time.monotonic() + 10
    while (await api.get(f"/v1/sandboxes/{sid}")).json()["state"] != "paused":
        assert time.monotonic() < deadline, "not paused at its timeout"
        await asyncio.sleep(0.2)
    assert (await api.post(f"/v1/sandboxes/{sid}/resume")).status_code == 200
    assert api.srv.runtime.vms[sid].booted


async def test_a_reboot_resume_boots_a_memory_pause_from_its_disk(api) -> None:
    sid = (await create(api))["sandbox_id"]
    assert (await api.post(f"/v1/sandboxes/{sid}/pause")).status_code == 200
    r = await api.post(f"/v1/sandboxes/{sid}/resume", json={"reboot": True})
    assert r.status_code == 200, r.text
    assert api.srv.runtime.vms[sid].booted


async def test_a_filesystem_only_snapshot_restores_by_booting(api) -> None:
    sid = (await create(api))["sandbox_id"]
    await api.put(f"/v1/sandboxes/{sid}/files", params={"path": "/root/f"}, content=b"v1")
    r = await api.post(f"/v1/sandboxes/{sid}/snapshots", json={"memory": False})
    assert r.status_code == 201 and r.json()["memory"] is False
    snap = (await api.post(f"/v1/snapshots/{r.json()['snapshot_id']}/wait")).json()
    assert snap["state"] == "ready" and snap["memory"] is False and snap["pause_ms"] == 0
    # Any memory size and CPUs: nothing to load, so nothing to match.
    r = await api.post(f"/v1/snapshots/{snap['snapshot_id']}/restore",
                       json={"memory_mb": 384, "cpus": 2})
    assert r.status_code == 201, r.text
    child = r.json()["sandbox_id"]
    assert api.srv.runtime.vms[child].booted and r.json()["memory_mb"] == 384
    r = await api.get(f"/v1/sandboxes/{child}/files", params={"path": "/root/f"})
    assert r.content == b"v1"
    r = await api.post(f"/v1/snapshots/{snap['snapshot_id']}/restore", json={"memory_mb": 64})
    assert r.status_code == 422 or r.status_code == 400, r.text
    # A rollback to it boots the sandbox under its id.
    await api.put(f"/v1/sandboxes/{sid}/files", params={"path": "/root/f"}, content=b"v2")
    r = await api.post(f"/v1/sandboxes/{sid}/rollback", json={"snapshot_id": snap["snapshot_id"]})
    assert r.status_code == 200, r.text
    r = await api.get(f"/v1/sandboxes/{sid}/files", params={"path": "/root/f"})
    assert r.content == b"v1" and api.srv.runtime.vms[sid].booted


async def test_a_capture_whose_record_cannot_be_saved_is_released(api, monkeypatch) -> None:
    """A capture done but its snapshot's record not saved: the snapshot fails and the
    capture's hold (its buffer and cache entry, on QEMU) is released, not kept forever."""
    from sandlot.core.snapshots import SnapshotManager
    from sandlot.errors import StorageError

    save = SnapshotManager._save

    async def failing(self, rec) -> None:
        if rec.state == SnapshotState.UPLOADING:
            raise StorageError("metadata store unreachable")
        await save(self, rec)

    monkeypatch.setattr(SnapshotManager, "_save", failing)
    sid = (await create(api))["sandbox_id"]
    r = await api.post(f"/v1/sandboxes/{sid}/snapshots", json={})
    assert r.status_code == 201, r.text
    r = await api.post(f"/v1/snapshots/{r.json()['snapshot_id']}/wait", params={"timeout": 5})
    assert r.json()["state"] == "failed" and "unreachable" in r.json()["error"]
    assert api.srv.runtime.captures == {}
