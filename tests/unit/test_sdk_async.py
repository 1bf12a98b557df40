"""The async SDK against the in-process fake API. The sync SDK is generated from the same code
(see test_sdk_sync.py for the fuller suite); these cover the async-specific paths."""

from __future__ import annotations

import functools
import io
import json
from collections.abc import AsyncIterator

import httpx
import pytest
from test_sdk_fake import API_KEY, FakeServer

from sandlot import (
    AsyncSandbox,
    AsyncSandlot,
    AsyncSnapshot,
    CommandExitError,
    CommandTimeoutError,
    NotFoundError,
    SandlotError,
    SnapshotFailedError,
    VmmError,
)
from sandlot.sdk._async import _http, _sandbox

URL = "http://sandlot.test"


@pytest.fixture
def fake() -> FakeServer:
    return FakeServer(async_mode=True)


@pytest.fixture
async def client(fake: FakeServer) -> AsyncIterator[AsyncSandlot]:
    async with AsyncSandlot(URL, API_KEY, transport=fake.transport()) as c:
        yield c


@pytest.fixture
def default_api(monkeypatch: pytest.MonkeyPatch, fake: FakeServer) -> None:
    monkeypatch.setenv("SANDLOT_URL", URL)
    monkeypatch.setenv("SANDLOT_API_KEY", API_KEY)
    monkeypatch.setattr(_sandbox, "AsyncAPI",
                        functools.partial(_http.AsyncAPI, transport=fake.transport()))


async def test_lifecycle_and_context_manager(default_api: None, fake: FakeServer) -> None:
    async with await AsyncSandbox.create(metadata={"k": "v"}) as sbx:
        assert await sbx.is_running()
        assert (await sbx.get_info()).metadata == {"k": "v"}
        assert [s.sandbox_id for s in await AsyncSandbox.list({"k": "v"})] == [sbx.sandbox_id]
        await sbx.set_timeout(5)
        other = await AsyncSandbox.connect(sbx.sandbox_id)
    assert fake.sandboxes[sbx.sandbox_id]["state"] == "stopped"
    assert await other.is_running() is False
    assert await other.kill() is False


async def test_commands(client: AsyncSandlot, fake: FakeServer) -> None:
    sbx = await client.sandboxes.create()
    out: list[str] = []
    result = await sbx.commands.run("echo hi", on_stdout=out.append, timeout=5)
    assert result.stdout == "hi\n" and result.ok and out == ["hi", "\n"]
    assert fake.requests[-1].extensions["timeout"]["read"] == 35
    with pytest.raises(CommandExitError) as err:
        await sbx.commands.run("fail", check=True)
    assert err.value.result.exit_code == 3
    with pytest.raises(CommandTimeoutError):
        await sbx.commands.run("hang")
    handle = await sbx.commands.run("cat", background=True)
    await handle.send_stdin("xyz", eof=True)
    assert [p.pid for p in await sbx.commands.list()] == [handle.pid]
    assert (await handle.wait()).stdout == "xyz"
    assert await handle.kill() is False
    started = await sbx.commands.start("sleep 9")
    assert await sbx.commands.kill(started.pid) is True


async def test_files(client: AsyncSandlot, fake: FakeServer, tmp_path) -> None:
    sbx = await client.sandboxes.create()
    await sbx.files.write("/a", b"bytes")
    assert await sbx.files.read("/a") == "bytes"
    assert await sbx.files.read("/a", format="bytes") == b"bytes"

    async def parts() -> AsyncIterator[bytes]:
        yield b"one-"
        yield b"two"

    await sbx.files.write("/b", parts())
    assert fake.files[(sbx.sandbox_id, "/b")] == b"one-two"
    blob = b"z" * (3 << 20)
    await sbx.files.write("/c", io.BytesIO(blob))
    assert fake.requests[-1].headers.get("transfer-encoding") == "chunked"
    chunks = [chunk async for chunk in await sbx.files.read("/c", format="stream")]
    assert b"".join(chunks) == blob
    local = tmp_path / "c.bin"
    assert await sbx.files.read_to("/c", local) == len(blob)
    await sbx.files.write_from("/d", local)
    assert fake.files[(sbx.sandbox_id, "/d")] == blob
    assert await sbx.files.exists("/d")
    assert (await sbx.files.stat("/d")).size == len(blob)
    assert len(await sbx.files.list("/")) == 4
    await sbx.files.rename("/d", "/e")
    assert await sbx.files.make_dir("/dir")
    await sbx.files.remove("/e")
    with pytest.raises(NotFoundError):
        await sbx.files.read("/e")


async def test_snapshots_fork_rollback(client: AsyncSandlot, fake: FakeServer) -> None:
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
    fake.fork_fail_indexes = {2}
    kids = await sbx.fork(3)
    assert len(kids) == 2 and isinstance(kids.errors[0], VmmError)
    assert [s.name for s in await client.snapshots.list()] == ["good"]
    assert await snap.remove() is True
    fake.fail_snapshot = True
    with pytest.raises(SnapshotFailedError):
        await (await sbx.snapshot()).wait()


async def test_snapshot_classmethods(default_api: None, client: AsyncSandlot) -> None:
    sbx = await client.sandboxes.create()
    await sbx.create_snapshot("n")
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
