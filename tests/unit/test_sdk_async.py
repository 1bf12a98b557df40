"""The async SDK against the real app and core on the fake machine layer, in process. The sync
SDK is generated from the same code (test_sdk_sync.py has the fuller suite); these cover the
async-specific paths."""

from __future__ import annotations

import io
import json
from collections.abc import AsyncIterator

import httpx
import pytest
from fastkit import Fast

from sandlot import (
    AsyncSandbox,
    AsyncSandlot,
    AsyncSnapshot,
    CommandExitError,
    CommandTimeoutError,
    NotFoundError,
    SandlotError,
    SnapshotFailedError,
)
from sandlot.core.tenancy import SYSTEM

URL = "http://sandlot.test"


@pytest.fixture
async def client(afast: Fast) -> AsyncIterator[AsyncSandlot]:
    async with AsyncSandlot(URL, afast.key, transport=afast.transport) as c:
        yield c


async def test_lifecycle_and_context_manager(async_default_api: Fast) -> None:
    afast = async_default_api
    async with await AsyncSandbox.create(metadata={"k": "v"}) as sbx:
        assert await sbx.is_running()
        assert (await sbx.get_info()).metadata == {"k": "v"}
        assert [s.sandbox_id for s in await AsyncSandbox.list({"k": "v"})] == [sbx.sandbox_id]
        await sbx.set_timeout(5)
        other = await AsyncSandbox.connect(sbx.sandbox_id)
    assert (await afast.core.sandboxes.get(sbx.sandbox_id, SYSTEM)).state == "stopped"
    assert await other.is_running() is False
    assert await other.kill() is False


async def test_commands(client: AsyncSandlot, afast: Fast) -> None:
    sbx = await client.sandboxes.create()
    out: list[str] = []
    result = await sbx.commands.run("echo hi", on_stdout=out.append, timeout=5)
    assert result.stdout == "hi\n" and result.ok and out == ["hi\n"]
    assert afast.requests[-1].extensions["timeout"]["read"] == 35
    with pytest.raises(CommandExitError) as err:
        await sbx.commands.run("echo boom >&2; exit 3", check=True)
    assert err.value.result.exit_code == 3
    with pytest.raises(CommandTimeoutError):
        await sbx.commands.run("sleep 30", timeout=0.2)
    handle = await sbx.commands.run("cat", background=True)
    await handle.send_stdin("xyz", eof=True)
    assert [p.pid for p in await sbx.commands.list()] == [handle.pid]
    assert (await handle.wait()).stdout == "xyz"
    assert await handle.kill() is False
    started = await sbx.commands.start("sleep 9")
    assert await sbx.commands.kill(started.pid) is True


async def test_files(client: AsyncSandlot, afast: Fast, tmp_path) -> None:
    sbx = await client.sandboxes.create()
    await sbx.files.write("/a", b"bytes")
    assert await sbx.files.read("/a") == "bytes"
    assert await sbx.files.read("/a", format="bytes") == b"bytes"

    async def parts() -> AsyncIterator[bytes]:
        yield b"one-"
        yield b"two"

    await sbx.files.write("/b", parts())
    assert await sbx.files.read("/b", format="bytes") == b"one-two"
    blob = b"z" * (3 << 20)
    await sbx.files.write("/c", io.BytesIO(blob))
    assert afast.requests[-1].headers.get("transfer-encoding") == "chunked"
    chunks = [chunk async for chunk in await sbx.files.read("/c", format="stream")]
    assert b"".join(chunks) == blob
    local = tmp_path / "c.bin"
    assert await sbx.files.read_to("/c", local) == len(blob)
    await sbx.files.write_from("/d", local)
    assert await sbx.files.read("/d", format="bytes") == blob
    assert await sbx.files.exists("/d")
    assert (await sbx.files.stat("/d")).size == len(blob)
    assert {e.path for e in await sbx.files.list("/")} >= {"/a", "/b", "/c", "/d"}
    await sbx.files.rename("/d", "/e")
    assert await sbx.files.make_dir("/dir")
    await sbx.files.remove("/e")
    with pytest.raises(NotFoundError):
        await sbx.files.read("/e")


async def test_snapshots_fork_rollback(client: AsyncSandlot, afast: Fast) -> None:
    sbx = await client.sandboxes.create()
    snap = await sbx.create_snapshot()
    assert snap.state == "creating"
    await snap.wait(timeout=5)
    assert snap.state == "ready"
    await snap.save_named("good")
    restored = await snap.restore_with(cpus=4)
    assert restored.info.cpus == 4
    assert (await client.snapshots.restore(sbx.sandbox_id, "good")).sandbox_id
    assert await sbx.rollback("good") is sbx
    afast.runtime.fail_restores = 1
    kids = await sbx.fork(3)
    assert len(kids) == 2 and isinstance(kids.errors[0], SandlotError)
    assert [s.name for s in await client.snapshots.list()] == ["good"]
    afast.runtime.fail_restores = 1  # a stored snapshot forks: each child alone
    kids = await snap.fork(3, env={"K": "v"})
    assert len(kids) == 2 and isinstance(kids.errors[0], SandlotError)
    assert {k.info.env["K"] for k in kids} == {"v"}
    assert await snap.remove() is True
    afast.runtime.fail_persist = "disk full"
    with pytest.raises(SnapshotFailedError):
        await (await sbx.snapshot()).wait()


async def test_snapshot_classmethods(async_default_api: Fast, client: AsyncSandlot) -> None:
    sbx = await client.sandboxes.create()
    await (await sbx.create_snapshot("n")).wait()
    snap = await AsyncSnapshot.get("n")
    assert (await snap.restore()).sandbox_id != sbx.sandbox_id
    assert [s.name for s in await AsyncSnapshot.list()] == ["n"]
    assert await AsyncSnapshot.delete("n") is True
    await snap.aclose()


async def test_connection_errors_are_sandlot_errors() -> None:
    with pytest.raises(SandlotError, match="cannot connect") as err:
        await AsyncSandbox.list(api_url="http://127.0.0.1:1", api_key="k")
    assert isinstance(err.value.__cause__, httpx.ConnectError)

    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.RemoteProtocolError("peer closed", request=request)

    async with AsyncSandlot(URL, "k", transport=httpx.MockTransport(handler)) as c:
        with pytest.raises(SandlotError, match="RemoteProtocolError"):
            await c.templates.list()


async def test_error_body_and_status(client: AsyncSandlot) -> None:
    with pytest.raises(NotFoundError) as err:
        await client.snapshots.get("nothing")
    assert err.value.status == 404 and json.dumps(err.value.message)
